"""Every way a model comes in: quillgpt checkpoints and run directories, .safetensors files from
export.py, and Hugging Face models (GPT-2, Llama, Qwen2, Qwen3: local directories, or hub names
downloaded once; hf.py reads them). sample.py, eval.py, train.py (init_from, resume) and export.py
load through here.

    from quillgpt.loading import load_model
    loaded = load_model("checkpoints/base")            # a run dir: its ckpt_best.pt
    loaded = load_model("exports/base.safetensors")
    loaded = load_model("models/SmolLM2-135M")         # config.json + model.safetensors (+ tokenizer.json)
    loaded.model, loaded.tokenizer, loaded.source      # GPT, tokenizer dict (or None), what was read

A LoRA run's checkpoint holds its adapters and a pointer to its base (base_record: the source, and the sha256 of
the weights read); it loads as the base, checked against that hash, plus the adapters (lora_model), merged into a
plain GPT unless the adapters are asked for (keep_adapters: export.py --peft).

Every failure is a one-line UserError naming the file; checkpoints load with weights_only=True and
HF weights from safetensors, so nothing loaded can run code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from model import GPT
from quillgpt import hf
from quillgpt.checkpoint import load_checkpoint, resolve_checkpoint
from quillgpt.config import GPTConfig, build_config
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, sha256_file
from quillgpt.lora import LoraSettings, add_adapters, is_lora, load_adapter_state, merged


@dataclass
class Loaded:
    model: GPT
    tokenizer: dict | None  # tokenizer.to_dict() of what the model was trained with, when known
    source: str  # the file or name read
    lora: dict | None = None  # a LoRA run's record: its adapters' settings and its base (TrainingCheckpoint.lora)


def load_model(
    source: str | Path, dropout: float | None = None, keep_adapters: bool = False, as_stored: bool = False
) -> Loaded:
    """A checkpoint file, run directory (its best checkpoint), .safetensors file, or Hugging Face directory or hub name.

    dropout, when given, replaces the model's recorded dropout (fine-tuning); Hugging Face imports default to 0. A LoRA
    run's model is its base plus its adapters, merged into a plain GPT, or kept apart with keep_adapters. as_stored: a
    Hugging Face model's weights in the file's dtype (bf16 for most), not fp32 (a LoRA base: lora.add_adapters
    converts them)."""
    if is_hf_source(source):
        model, tokenizer = hf.load_hf(source, dropout or 0.0, None if as_stored else torch.float32)
        return Loaded(model, tokenizer, str(source))
    if Path(source).suffix == ".safetensors":
        return read_safetensors(Path(source))
    path = resolve_checkpoint(source, prefer="best")
    ckpt = load_checkpoint(path)
    model = model_from_checkpoint(ckpt, path, dropout)
    if is_lora(model) and not keep_adapters:
        model = merged(model)
    return Loaded(model, ckpt.get("tokenizer"), str(path), ckpt.get("lora"))


@dataclass
class Described:
    """What load_model(source) would give, but the weights: the architecture and the tokenizer."""

    config: GPTConfig
    tokenizer: dict | None
    source: str


def describe_model(source: str | Path, dropout: float | None = None) -> Described:
    """The architecture and tokenizer load_model(source, dropout) would give, without building the model (a Hugging
    Face directory's config.json and tokenizer files, a safetensors header, a checkpoint's model_args)."""
    if is_hf_source(source):
        directory = Path(source) if Path(source).is_dir() else hf.download(str(source))
        config, tokenizer = hf.read_config_and_tokenizer(directory, str(source), dropout or 0.0)
        return Described(config, tokenizer, str(source))
    if Path(source).suffix == ".safetensors":
        config, tokenizer = read_safetensors_metadata(Path(source))
        return Described(config, tokenizer, str(source))
    path = resolve_checkpoint(source, prefer="best")
    ckpt = load_checkpoint(path)
    config = model_config_from_args(ckpt["model_args"], path)
    return Described(config if dropout is None else replace(config, dropout=dropout), ckpt.get("tokenizer"), str(path))


def is_hf_source(name_or_dir: str | Path) -> bool:
    """A Hugging Face model directory or hub name (as opposed to a quillgpt checkpoint or file)."""
    return (Path(name_or_dir) / "config.json").is_file() or hf.is_hub_name(str(name_or_dir))


# ---- quillgpt checkpoints --------------------------------------------------------------------------


def model_config_from_args(args: dict, path: str | Path = "checkpoint") -> GPTConfig:
    """A checkpoint's model_args as a GPTConfig, checked by the config schema."""
    if not isinstance(args, dict) or not isinstance(args.get("vocab_size"), int):
        raise UserError(f"{path}: model_args is not a complete model description (it needs an integer vocab_size)")
    build_config({"model": args}, source=f"{path} model_args")  # the config schema's type and range checks
    return GPTConfig.from_dict(args)


def model_from_checkpoint(ckpt: dict, path: str | Path = "checkpoint", dropout: float | None = None) -> GPT:
    """The checkpoint's model with its weights; dropout (when given) replaces the recorded one. A LoRA checkpoint's
    model has its adapters (lora.add_adapters)."""
    config = model_config_from_args(ckpt["model_args"], path)
    if dropout is not None:
        config.dropout = dropout
    if ckpt.get("lora") is not None:
        return lora_model(ckpt["lora"], config, ckpt["model"], path)
    model = GPT(config)
    load_model_weights(model, ckpt["model"], path)
    return model


def load_model_weights(model: GPT, state: dict, path: str | Path = "checkpoint") -> None:
    """load_state_dict with a message that names the first mismatch instead of a traceback."""
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise UserError(f"{path}: its model weights are not a dict of named tensors")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UserError(
                f"{path} does not match the model: {k} is {list(v.shape)} in the checkpoint, "
                f"{list(own[k].shape)} in the model (different architecture or vocabulary)"
            )
    model.load_state_dict(state)


# ---- safetensors files from export.py --------------------------------------------------------------


def write_safetensors(model: GPT, tokenizer: dict | None, path: str | Path) -> None:
    """export.py --safetensors: the weights plus model arguments and tokenizer (JSON strings in the metadata); a tied
    head is stored once."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["transformer.wte.weight"]  # the same tensor as lm_head.weight; safetensors refuses shared tensors
    metadata = {"format": "pt", "model_args": json.dumps(model.config.to_dict())}
    if tokenizer is not None:
        metadata["tokenizer"] = json.dumps(tokenizer)
    with atomic_write(path) as f:
        f.write(save(state, metadata=metadata))


def read_safetensors(path: Path) -> Loaded:
    """A file written by write_safetensors: weights, with the model arguments and tokenizer in its metadata."""
    config, tokenizer = read_safetensors_metadata(path)
    state = hf.read_safetensors_file(path)
    if config.tie_embeddings and "lm_head.weight" in state:
        state["transformer.wte.weight"] = state["lm_head.weight"]
    model = GPT(config)
    load_model_weights(model, state, path)
    return Loaded(model, tokenizer, str(path))


def read_safetensors_metadata(path: Path) -> tuple[GPTConfig, dict | None]:
    """The model arguments and tokenizer export.py stores in a safetensors file's metadata."""
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
        return (
            GPTConfig.from_dict(json.loads(metadata["model_args"])),
            json.loads(metadata["tokenizer"]) if "tokenizer" in metadata else None,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: malformed metadata: {e}") from None


# ---- LoRA runs: the base they point to ----------------------------------------------------------------


def base_record(source: str) -> dict:
    """What a LoRA run records of its base (run.init_from): the source as given, the file or directory read, and the
    sha256 of what was read (a checkpoint file; a Hugging Face directory's config.json and weight files)."""
    path, files = base_files(source)
    return {"source": str(source), "path": str(path), "sha256": files_digest(files)}


def base_files(source: str) -> tuple[Path, list[Path]]:
    if is_hf_source(source):
        directory = Path(source) if Path(source).is_dir() else hf.download(str(source))
        return directory, [directory / "config.json", *hf.weight_files(directory)]
    if Path(source).suffix == ".safetensors":
        if not Path(source).is_file():
            raise UserError(f"safetensors file not found: {source}")
        return Path(source), [Path(source)]
    path = resolve_checkpoint(source, prefer="best")
    return path, [path]


def files_digest(files: list[Path]) -> str:
    """One sha256 of several files: of their own sha256s, in order (a single file: its own)."""
    if len(files) == 1:
        return sha256_file(files[0])
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()


def check_base(record: dict, path: str | Path) -> None:
    """UserError when the base a LoRA checkpoint points to is not the one its adapters were trained on."""
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("source", "path", "sha256")):
        raise UserError(f"{path}: its LoRA record has no valid base (source, path, sha256)")
    try:
        now = files_digest(base_files(record["source"])[1])
    except UserError as e:
        raise UserError(f"{path}: the base of this LoRA run cannot be read: {e}") from None
    if now != record["sha256"]:
        raise UserError(
            f"{path}: its base {record['path']} changed on disk since the adapters were trained on it (sha256 "
            f"{record['sha256'][:12]}... then, {now[:12]}... now): restore that base, or start a new run from it"
        )


def load_base(record: dict, path: str | Path, dropout: float | None = None, verified: bool = False) -> GPT:
    """The base a LoRA run points to (a LoRA run's own model merged), checked against its recorded sha256 (unless the
    caller just did: verified)."""
    if not verified:
        check_base(record, path)
    return load_model(record["source"], dropout=dropout, as_stored=True).model


def lora_model(
    record: dict,
    config: GPTConfig,
    adapters: dict,
    path: str | Path,
    base_dtype: torch.dtype = torch.float32,
    verified: bool = False,
) -> GPT:
    """A LoRA checkpoint's model: its base (checked, unless verified), cropped to its context, with its adapters.
    config: the model as the run built it (model_args: the vocabulary grown for chat tokens, the context cropped)."""
    if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
        raise UserError(f"{path}: its LoRA record is malformed (it needs settings and base)")
    settings = LoraSettings.from_record(record["settings"], str(path))
    model = load_base(record.get("base"), path, config.dropout, verified)
    if config.block_size < model.config.block_size:
        model.crop_block_size(config.block_size)
    model = add_adapters(model, settings, config.vocab_size, base_dtype)
    if model.config != config:
        raise UserError(f"{path}: its base does not build the model the run trained ({record['base']['path']})")
    load_adapter_state(model, adapters, str(path))
    return model
