"""Models out: Hugging Face GPT-2 directories and plain safetensors files (load.py brings models in).

    python export.py --ckpt checkpoints/base --hf exports/base-hf                  # a run dir: its ckpt_best.pt
    python export.py --ckpt checkpoints/base/ckpt_last.pt --safetensors exports/base.safetensors

The Hugging Face directory loads with transformers.AutoModelForCausalLM.from_pretrained and gives
the same logits; it holds the GPT-2 tokenizer files too when the checkpoint uses tiktoken's gpt2
and tiktoken has that encoding cached. Only GPT-2's architecture exports (learned positions,
LayerNorm, GELU, tied embeddings, no soft-cap). The safetensors file takes any model: the weights,
plus the model arguments and the tokenizer as JSON in its metadata (sample.py --ckpt reads it).

From Python:

    from export import export_hf, export_safetensors
    from load import load_model
    loaded = load_model("checkpoints/base")
    export_safetensors(loaded.model, loaded.tokenizer, "exports/base.safetensors")
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

from common import UserError, atomic_write, atomic_write_json, run_main
from config import GPTConfig
from load import CONV1D_WEIGHTS, GPT2_TOKENIZER, GPT2_VOCAB_SIZE, LAYER_NORM_EPS, load_model
from model import GPT
from tokenizer import GPT2_FILES, get_tiktoken, tokenizer_label

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
        kind = tokenizer_label(tokenizer) if tokenizer else "unknown"
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
    hf_names = {"encoder.json": "vocab.json", "vocab.bpe": "merges.txt"}
    return {hf_names[name]: read_file_cached(url) for name, url in GPT2_FILES.items()}


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
    loaded = load_model(args.ckpt)
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.source
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
