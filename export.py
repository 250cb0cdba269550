"""GPT-2 weights in; Hugging Face GPT-2 directories and plain safetensors files out.

    python export.py --ckpt checkpoints/base --hf exports/base-hf                  # a run dir: its ckpt_best.pt
    python export.py --ckpt checkpoints/base/ckpt_last.pt --safetensors exports/base.safetensors

The Hugging Face directory loads with transformers.AutoModelForCausalLM.from_pretrained and gives
the same logits; it holds the GPT-2 tokenizer files too when the checkpoint uses tiktoken's gpt2
and tiktoken has that encoding cached. Only GPT-2's architecture exports (learned positions,
LayerNorm, GELU, tied embeddings, no soft-cap). The safetensors file takes any model: the weights,
plus the model arguments and the tokenizer as JSON in its metadata (sample.py --ckpt reads it).

From Python:

    from export import load_gpt2, load_safetensors
    model = load_gpt2("gpt2")                     # OpenAI's weights through transformers (network once)
    model = load_gpt2("path/to/hf-gpt2")          # a local Hugging Face GPT-2 directory, offline
    model, tokenizer = load_safetensors("exports/base.safetensors")
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from checkpoint import load_checkpoint, load_model_weights, model_from_checkpoint, resolve_checkpoint
from common import UserError, atomic_write, atomic_write_json, read_json, run_main
from model import GPT, GPTConfig
from tokenizer import Tokenizer, get_tiktoken, tokenizer_from_dict

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_TOKENIZER = {"kind": "tiktoken", "name": "gpt2"}
GPT2_VOCAB_SIZE = 50257  # the last id is <|endoftext|>
# HF's GPT-2 stores these as Conv1D weights, (in, out): the transpose of nn.Linear's (out, in)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> GPTConfig.gelu_approx
LAYER_NORM_EPS = 1e-5  # model.py's LayerNorm
# the files tiktoken builds its gpt2 encoding from are HF's vocab.json and merges.txt
GPT2_TOKENIZER_URLS = {
    "vocab.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "merges.txt": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}


def is_gpt2_source(name_or_dir: str | Path) -> bool:
    """A GPT-2 name or a local Hugging Face model directory (as opposed to a quillgpt checkpoint)."""
    path = Path(name_or_dir)
    return (str(name_or_dir) in GPT2_NAMES and not path.exists()) or (path / "config.json").is_file()


# ---- import -----------------------------------------------------------------------------------------

def load_gpt2(name_or_dir: str, dropout: float = 0.0) -> GPT:
    """OpenAI's GPT-2 by name (through transformers) or a local Hugging Face GPT-2 directory (offline)."""
    path = Path(name_or_dir)
    if path.is_dir():
        hf_config, state = read_hf_dir(path)
    elif name_or_dir in GPT2_NAMES:
        hf_config, state = download_gpt2(name_or_dir)
    else:
        raise UserError(f"{name_or_dir!r} is neither a GPT-2 model ({', '.join(GPT2_NAMES)}) "
                        "nor a local Hugging Face GPT-2 directory")
    model = GPT(gpt_config_from_hf(hf_config, dropout, name_or_dir))
    load_model_weights(model, state_from_hf(state), name_or_dir)
    return model


def download_gpt2(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    local = "or give a local Hugging Face GPT-2 directory (config.json + model.safetensors) instead of the name"
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise UserError(f"loading {name} needs transformers: pip install '.[hf]', {local}") from None
    try:
        hf = GPT2LMHeadModel.from_pretrained(name)
    except OSError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"could not load {name} from the Hugging Face hub ({reason}): "
                        f"it downloads once with network access; {local}") from None
    return hf.config.to_dict(), hf.state_dict()


def read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the weights of a Hugging Face model directory, without transformers."""
    hf_config = read_json(path / "config.json", "Hugging Face config")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / f for f in sorted(set(read_json(index, "safetensors index").get("weight_map", {}).values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "pytorch_model.bin").is_file():
        try:
            return hf_config, torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling reports corruption in many exception types
            raise UserError(f"cannot read {path / 'pytorch_model.bin'}: {(str(e).splitlines() or [''])[0]}") from None
    else:
        raise UserError(f"{path} has config.json but no weights (model.safetensors or pytorch_model.bin)")
    state = {}
    for f in files:
        state.update(read_safetensors_file(f))
    return hf_config, state


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def gpt_config_from_hf(hf: dict, dropout: float, source: str) -> GPTConfig:
    """A Hugging Face GPT-2 config.json -> GPTConfig; refuses settings model.py would compute differently."""
    def refuse(what: str) -> UserError:
        return UserError(f"{source}: {what}, which model.py cannot reproduce")

    if hf.get("model_type", "gpt2") != "gpt2":
        raise refuse(f"model_type is {hf.get('model_type')!r}, not gpt2")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise refuse(f"activation_function is {activation!r} (supported: {', '.join(HF_ACTIVATIONS)})")
    if abs(hf.get("layer_norm_epsilon", LAYER_NORM_EPS) - LAYER_NORM_EPS) > 1e-12:
        raise refuse(f"layer_norm_epsilon is {hf['layer_norm_epsilon']} (model.py uses {LAYER_NORM_EPS})")
    for key, expected in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if hf.get(key, expected) != expected:
            raise refuse(f"{key} is {hf[key]}")
    try:
        n_embd = int(hf["n_embd"])
        if hf.get("n_inner") not in (None, 4 * n_embd):
            raise refuse(f"n_inner is {hf['n_inner']} (GPT-2 uses 4 * n_embd = {4 * n_embd})")
        return GPTConfig(block_size=int(hf["n_positions"]), vocab_size=int(hf["vocab_size"]), n_layer=int(hf["n_layer"]),
                         n_head=int(hf["n_head"]), n_embd=n_embd, dropout=dropout, bias=True,
                         gelu_approx=HF_ACTIVATIONS[activation])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source}: config.json lacks a valid GPT-2 setting ({e})") from None


def state_from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel weights -> model.py's names and layout (the head tied to the token embedding)."""
    state = {}
    for k, v in hf_state.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers in old checkpoints
            continue
        if not k.startswith(("transformer.", "lm_head.")):  # OpenAI's hub files name GPT2Model's weights bare
            k = "transformer." + k
        state[k] = v.t() if k.endswith(CONV1D_WEIGHTS) else v
    if "transformer.wte.weight" in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


# ---- export: Hugging Face ---------------------------------------------------------------------------

def check_gpt2_exportable(config: GPTConfig, source: str) -> None:
    blockers = config.gpt2_incompatibilities()
    if blockers:
        raise UserError(f"{source} cannot be exported as Hugging Face GPT-2: model.{', model.'.join(blockers)} "
                        "has no GPT-2 equivalent (export it with --safetensors instead)")


def hf_config(config: GPTConfig, tokenizer: dict | None) -> dict:
    end_of_text = GPT2_VOCAB_SIZE - 1 if tokenizer == GPT2_TOKENIZER and config.vocab_size >= GPT2_VOCAB_SIZE else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new" if config.gelu_approx == "tanh" else "gelu",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
    }


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """model.py's weights in HF GPT2LMHeadModel's layout; the tied head is left out, as HF saves it.

    A bias=False model gets zero biases, which compute the same function."""
    state = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        v = v.t() if k.endswith(CONV1D_WEIGHTS) else v
        state[k] = v.detach().cpu().contiguous()
        if not model.config.bias and not k.startswith(("transformer.wte.", "transformer.wpe.")):
            state[k.removesuffix("weight") + "bias"] = torch.zeros(v.shape[-1], dtype=v.dtype)
    return state


def export_hf(model: GPT, tokenizer: dict | None, out_dir: str | Path, source: str = "model") -> list[str]:
    """Write a Hugging Face GPT-2 directory; returns notes for the user (e.g. skipped tokenizer files)."""
    check_gpt2_exportable(model.config, source)
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "config.json", hf_config(model.config, tokenizer))
    with atomic_write(out_dir / "model.safetensors") as f:
        f.write(save(hf_state_dict(model), metadata={"format": "pt"}))
    if tokenizer != GPT2_TOKENIZER:
        kind = (tokenizer or {}).get("name") or (tokenizer or {}).get("kind", "unknown")
        return [f"no tokenizer files written: the {kind} tokenizer has no Hugging Face GPT-2 equivalent"]
    try:
        files = gpt2_tokenizer_files()
    except UserError:
        return ["no tokenizer files written: GPT-2's vocabulary files are not in tiktoken's cache and could not be "
                "downloaded (export again online, or load the tokenizer with AutoTokenizer.from_pretrained('gpt2'))"]
    return save_gpt2_tokenizer(out_dir, files, model.config.block_size)


def gpt2_tokenizer_files() -> dict[str, bytes]:
    """vocab.json and merges.txt from tiktoken's cache (downloaded once when tiktoken first loads gpt2)."""
    from tiktoken.load import read_file_cached

    get_tiktoken("gpt2")  # fetches and hash-checks the files, or explains why it can't
    return {name: read_file_cached(url) for name, url in GPT2_TOKENIZER_URLS.items()}


def save_gpt2_tokenizer(out_dir: Path, files: dict[str, bytes], block_size: int) -> list[str]:
    """GPT2TokenizerFast built from vocab.json + merges.txt, saved beside the model in transformers' own format."""
    try:
        from transformers import GPT2TokenizerFast
    except ImportError:
        return ["no tokenizer files written: building them needs transformers (pip install '.[hf]')"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        tok = GPT2TokenizerFast.from_pretrained(tmp, model_max_length=block_size)
        saved = Path(tmp) / "saved"
        tok.save_pretrained(str(saved))
        for f in sorted(saved.iterdir()):
            with atomic_write(out_dir / f.name) as out:
                out.write(f.read_bytes())
    return []


# ---- export: safetensors ----------------------------------------------------------------------------

def export_safetensors(model: GPT, tokenizer: dict | None, path: str | Path) -> None:
    """The weights plus model arguments and tokenizer (JSON strings in the metadata); a tied head is stored once."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["transformer.wte.weight"]  # the same tensor as lm_head.weight; safetensors refuses shared tensors
    metadata = {"format": "pt", "model_args": json.dumps(model.config.to_dict())}
    if tokenizer is not None:
        metadata["tokenizer"] = json.dumps(tokenizer)
    with atomic_write(path) as f:
        f.write(save(state, metadata=metadata))


def read_safetensors(path: str | Path) -> tuple[GPT, dict | None]:
    """A file written by export_safetensors -> (model, tokenizer dict or None)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"safetensors file not found: {path}")
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path} is not a readable safetensors file: {e}") from None
    if "model_args" not in metadata:
        raise UserError(f"{path} has no model_args metadata: only files written by export.py --safetensors load here")
    try:
        config = GPTConfig.from_dict(json.loads(metadata["model_args"]))
        tokenizer = json.loads(metadata["tokenizer"]) if "tokenizer" in metadata else None
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: malformed metadata: {e}") from None
    state = read_safetensors_file(path)
    if config.tie_embeddings and "lm_head.weight" in state:
        state["transformer.wte.weight"] = state["lm_head.weight"]
    model = GPT(config)
    load_model_weights(model, state, path)
    return model, tokenizer


def load_safetensors(path: str | Path) -> tuple[GPT, Tokenizer | None]:
    model, tokenizer = read_safetensors(path)
    return model, tokenizer_from_dict(tokenizer) if tokenizer is not None else None


def load_model(path: str | Path) -> tuple[GPT, dict | None, Path]:
    """A checkpoint file, run directory (its best checkpoint) or .safetensors file -> (model, tokenizer dict, file)."""
    if Path(path).suffix == ".safetensors":
        return *read_safetensors(path), Path(path)
    file = resolve_checkpoint(path, prefer="best")
    ckpt = load_checkpoint(file)
    return model_from_checkpoint(ckpt, file), ckpt.get("tokenizer"), file


# ---- command line -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file, run directory (its ckpt_best.pt) or .safetensors file")
    p.add_argument("--hf", metavar="OUT_DIR", help="write a Hugging Face GPT-2 directory")
    p.add_argument("--safetensors", metavar="OUT", help="write one .safetensors file with the model arguments in its metadata")
    args = p.parse_args(argv)
    if not args.hf and not args.safetensors:
        p.error("give --hf OUT_DIR and/or --safetensors OUT.safetensors")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, tokenizer, source = load_model(args.ckpt)
    if args.hf:  # refuse before writing anything
        check_gpt2_exportable(model.config, str(source))
    if args.safetensors:
        export_safetensors(model, tokenizer, args.safetensors)
        print(f"wrote {args.safetensors}")
    if args.hf:
        for note in export_hf(model, tokenizer, args.hf, str(source)):
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {args.hf} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    run_main(main)
