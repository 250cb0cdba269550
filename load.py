"""Every way a model comes in: quillgpt checkpoints and run directories, .safetensors files from
export.py, OpenAI's GPT-2 by name (through transformers, network once) and local Hugging Face
GPT-2 directories (offline, no transformers needed). sample.py, train.py (init_from, resume) and
export.py load through here.

    from load import load_model
    loaded = load_model("checkpoints/base")            # a run dir: its ckpt_best.pt
    loaded = load_model("exports/base.safetensors")
    loaded = load_model("path/to/hf-gpt2")             # config.json + model.safetensors
    loaded.model, loaded.tokenizer, loaded.source      # GPT, tokenizer dict (or None), what was read

Every failure is a one-line UserError naming the file; checkpoints load with weights_only=True and
HF weights from safetensors, so nothing loaded can run code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from checkpoint import load_checkpoint, resolve_checkpoint
from common import UserError, read_json
from config import GPTConfig, build_config
from model import GPT

GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_TOKENIZER = {"kind": "tiktoken", "name": "gpt2"}
GPT2_VOCAB_SIZE = 50257  # the last id is <|endoftext|>
# HF's GPT-2 stores these as Conv1D weights, (in, out): the transpose of nn.Linear's (out, in)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> GPTConfig.gelu_approx
LAYER_NORM_EPS = 1e-5  # model.py's LayerNorm


@dataclass
class Loaded:
    model: GPT
    tokenizer: dict | None  # tokenizer.to_dict() of what the model was trained with, when known
    source: str  # the file or name read


def load_model(source: str | Path, dropout: float | None = None) -> Loaded:
    """A checkpoint file, run directory (its best checkpoint), .safetensors file, GPT-2 name or HF GPT-2 directory.

    dropout, when given, replaces the model's recorded dropout (fine-tuning); GPT-2 imports default to 0."""
    if is_hf_source(source):
        model = load_gpt2(str(source), dropout or 0.0)
        tokenizer = GPT2_TOKENIZER if model.config.vocab_size >= GPT2_VOCAB_SIZE else None
        return Loaded(model, tokenizer, str(source))
    if Path(source).suffix == ".safetensors":
        return read_safetensors(Path(source))
    path = resolve_checkpoint(source, prefer="best")
    ckpt = load_checkpoint(path)
    return Loaded(model_from_checkpoint(ckpt, path, dropout), ckpt.get("tokenizer"), str(path))


def is_hf_source(name_or_dir: str | Path) -> bool:
    """A GPT-2 name or a local Hugging Face model directory (as opposed to a quillgpt checkpoint)."""
    path = Path(name_or_dir)
    return (str(name_or_dir) in GPT2_NAMES and not path.exists()) or (path / "config.json").is_file()


# ---- quillgpt checkpoints --------------------------------------------------------------------------

def model_config_from_args(args: dict, path: str | Path = "checkpoint") -> GPTConfig:
    """A checkpoint's model_args as a GPTConfig, checked by the config schema."""
    if not isinstance(args, dict) or not isinstance(args.get("vocab_size"), int):
        raise UserError(f"{path}: model_args is not a complete model description (it needs an integer vocab_size)")
    build_config({"model": args}, source=f"{path} model_args")  # the config schema's type and range checks
    return GPTConfig.from_dict(args)


def model_from_checkpoint(ckpt: dict, path: str | Path = "checkpoint", dropout: float | None = None) -> GPT:
    """The checkpoint's model with its weights; dropout (when given) replaces the recorded one."""
    config = model_config_from_args(ckpt["model_args"], path)
    if dropout is not None:
        config.dropout = dropout
    model = GPT(config)
    load_model_weights(model, ckpt["model"], path)
    return model


def load_model_weights(model: GPT, state: dict, path: str | Path = "checkpoint") -> None:
    """load_state_dict with a message that names the first mismatch instead of a traceback."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{path}: its model weights are not a dict of named tensors")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UserError(f"{path} does not match the model: {k} is {list(v.shape)} in the checkpoint, "
                            f"{list(own[k].shape)} in the model (different architecture or vocabulary)")
    model.load_state_dict(state)


# ---- safetensors files from export.py --------------------------------------------------------------

def read_safetensors(path: Path) -> Loaded:
    """A file written by export.export_safetensors: weights, with the model arguments and tokenizer in its metadata."""
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
    return Loaded(model, tokenizer, str(path))


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


# ---- GPT-2 ------------------------------------------------------------------------------------------

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
