"""LoRA adapters in Hugging Face PEFT's format, both ways: adapter_config.json + adapter_model.safetensors.

    write_peft(model, out_dir, base_source)          # export.py --peft: PeftModel.from_pretrained(base_hf, out_dir)
    settings = peft_settings(directory, settings)    # lora.adapters: the directory's rank, alpha and targets
    load_peft_adapters(model, directory, base_config)

A LoRA model here (quillgpt/lora.py) holds each adapter in PEFT's own shape: A (rank, in) and B (out, rank) of one
of a Llama-family layer's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (the first three are
pieces of model.py's fused c_attn), so the files are a renaming: block i's target t is PEFT's
`base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_{A|B}.weight`. Token rows a chat run added are PEFT's
trainable tokens (trainable_token_indices): their full rows, as PEFT stores them. Bases that export as Llama,
Mistral, Qwen2, Qwen3, Gemma 3, OLMo 2 or SmolLM3 (families.export_family) have these names; GPT-2's fused Conv1D
c_attn and Phi-3's fused qkv_proj and gate_up_proj have one PEFT adapter where we have several, and are refused.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from model import GPT
from quillgpt.config import LORA_TARGET_GROUPS, GPTConfig
from quillgpt.errors import UserError
from quillgpt.families import export_family
from quillgpt.files import atomic_write, atomic_write_json, read_json
from quillgpt.lora import GrownEmbedding, GrownHead, LoraLinear, LoraSettings

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
TOKEN_KEYS = {  # where PEFT keeps trainable token rows, by the module whose rows they are
    "embed_tokens": PREFIX + "model.embed_tokens.token_adapter.trainable_tokens_delta",
    "lm_head": PREFIX + "lm_head.token_adapter.trainable_tokens_delta",
}
UNSUPPORTED = {  # adapter_config.json settings a model here can't reproduce, and what they mean
    "use_dora": "DoRA's magnitude vectors",
    "modules_to_save": "whole modules trained beside the adapters (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_to_transform": "adapters on some layers only (layers_to_transform)",
}


def hf_module(layer: int, target: str) -> str:
    section = "self_attn" if target in LORA_TARGET_GROUPS["attention"] else "mlp"
    return f"model.layers.{layer}.{section}.{target}"


def adapters_by_place(model: GPT) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, target) -> that adapter of the LoRA model."""
    out = {}
    for i, block in enumerate(model.transformer.h):
        for module in block.modules():
            if isinstance(module, LoraLinear):
                for target, adapter in module.adapters.items():
                    out[(i, target)] = adapter
    return out


def token_rows(model: GPT) -> dict[str, torch.nn.Parameter]:
    """PEFT's module name -> the added token rows (the head's only when untied: tied, they are the embedding's)."""
    out = {}
    if isinstance(model.transformer.wte, GrownEmbedding):
        out["embed_tokens"] = model.transformer.wte.rows
    if isinstance(model.lm_head, GrownHead) and model.lm_head.rows is not out.get("embed_tokens"):
        out["lm_head"] = model.lm_head.rows
    return out


def check_family(config: GPTConfig, source: str) -> str:
    family = export_family(config, source, target="PEFT base")
    if family in FUSED:
        raise UserError(
            f"{source}: PEFT adapters are written for bases with Llama's module names (Llama, Mistral, Qwen2, Qwen3, "
            f"Gemma 3, OLMo 2, SmolLM3); this one exports as {FUSED[family]} one PEFT adapter where model.py has "
            "several: export.py --merge --hf instead"
        )
    return family


FUSED = {  # families whose fused projections hold one PEFT adapter where model.py has several
    "gpt2": "GPT-2, whose fused c_attn holds",
    "phi3": "Phi-3, whose fused qkv_proj and gate_up_proj hold",
}


# ---- out ----------------------------------------------------------------------------------------------


def write_peft(model: GPT, out_dir: str | Path, base_source: str, source: str = "model") -> None:
    """adapter_config.json and adapter_model.safetensors for PeftModel.from_pretrained(base, out_dir), where base is
    the Hugging Face model this run's base exports as (export.py --hf of it, or the directory it came from). A run that
    added tokens needs the base's embeddings resized to its vocabulary first (resize_token_embeddings)."""
    settings: LoraSettings = model.lora
    check_family(model.config, source)
    tensors = {}
    for (layer, target), adapter in adapters_by_place(model).items():
        name = PREFIX + hf_module(layer, target)
        tensors[f"{name}.lora_A.weight"] = adapter.A.detach().float().cpu().contiguous()
        tensors[f"{name}.lora_B.weight"] = adapter.B.detach().float().cpu().contiguous()
    indices = {}
    for module, rows in token_rows(model).items():
        start = model.config.vocab_size - rows.size(0)
        indices[module] = list(range(start, model.config.vocab_size))
        tensors[TOKEN_KEYS[module]] = rows.detach().float().cpu().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_source,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "trainable_token_indices": indices or None,
        "inference_mode": True,
    }
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / CONFIG_FILE, config)
    with atomic_write(out_dir / WEIGHTS_FILE) as f:
        f.write(save(tensors, metadata={"format": "pt"}))


# ---- in -----------------------------------------------------------------------------------------------


def read_peft(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA directory's config and tensors; UserError for anything else."""
    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise UserError(f"lora.adapters = {directory}: no {CONFIG_FILE} there (a PEFT adapter directory has one)")
    config = read_json(directory / CONFIG_FILE, "PEFT adapter config")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise UserError(f"{directory} holds a PEFT {kind} adapter, not LoRA: only LoRA adapters load here")
    experts = [t for t in config.get("target_parameters") or [] if "experts" in t]
    experts += [p for p in config.get("rank_pattern") or {} if "gate_up_proj" in p or "experts" in p]
    if experts:
        raise UserError(
            f"{directory}: adapters on a mixture of experts' experts ({experts[0]}), which LoRA here does not hold "
            "(a mixture of experts gets adapters on attention only)"
        )
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise UserError(f"{directory}: {what} are not supported here ({key} = {config[key]!r})")
    if config.get("bias", "none") != "none":
        raise UserError(f"{directory}: trained biases (bias = {config['bias']!r}) are not supported here")
    if (
        not isinstance(config.get("r"), int)
        or config["r"] <= 0
        or not isinstance(config.get("lora_alpha"), int | float)
    ):
        raise UserError(f"{directory}: {CONFIG_FILE} needs a positive integer r and a number lora_alpha")
    try:
        tensors = load_file(directory / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {directory / WEIGHTS_FILE}: {e}") from None
    return config, tensors


def peft_settings(directory: str | Path, configured: LoraSettings) -> LoraSettings:
    """The adapters a PEFT directory holds: its rank and alpha (rsLoRA's alpha / sqrt(r) as the same scaling), the
    targets its tensors name (the same in every layer); quantize and dropout stay the configured ones."""
    config, tensors = read_peft(directory)
    rank, alpha = config["r"], float(config["lora_alpha"])
    if config.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # alpha / rank then equals rsLoRA's alpha / sqrt(rank)
    return LoraSettings(rank, alpha, adapter_targets(directory, tensors), configured.quantize, configured.dropout)


def adapter_targets(directory: str | Path, tensors: dict[str, torch.Tensor]) -> tuple[str, ...]:
    per_layer: dict[int, set[str]] = {}
    for key in tensors:
        if key in TOKEN_KEYS.values():
            continue
        m = KEY.fullmatch(key.replace(".default.", "."))
        if not m or m[3] not in hf_target_names():
            raise UserError(f"{directory}: tensor {key} is not a LoRA adapter of a Llama-family layer")
        per_layer.setdefault(int(m[1]), set()).add(m[3])
    if not per_layer:
        raise UserError(f"{directory}: {WEIGHTS_FILE} holds no LoRA adapter")
    sets = {frozenset(s) for s in per_layer.values()}
    if len(sets) > 1:
        raise UserError(f"{directory}: its layers have adapters on different modules, which is not supported here")
    return tuple(t for t in hf_target_names() if t in next(iter(sets)))


def hf_target_names() -> tuple[str, ...]:
    return LORA_TARGET_GROUPS["all-linear"]


def load_peft_adapters(model: GPT, directory: str | Path, base_config: GPTConfig) -> None:
    """Put a PEFT directory's adapters (and trainable token rows) into the LoRA model peft_settings planned; UserError
    when they were made for another base (a layer it lacks, a shape it doesn't have)."""
    check_family(base_config, str(directory))
    config, tensors = read_peft(directory)
    tensors = {k.replace(".default.", "."): v for k, v in tensors.items()}
    places = adapters_by_place(model)
    n_layer = model.config.n_layer
    expected = {f"{PREFIX}{hf_module(layer, t)}.lora_{w}.weight" for layer, t in places for w in "AB"}
    missing = sorted(expected - set(tensors))
    if missing:
        raise UserError(f"{directory}: adapters for another base: no {missing[0]} (the base has {n_layer} layers)")
    with torch.no_grad():
        for key, tensor in tensors.items():
            if key in TOKEN_KEYS.values():
                continue
            m = KEY.fullmatch(key)
            layer, target, which = int(m[1]), m[3], m[4]
            if layer >= n_layer:
                raise UserError(
                    f"{directory}: adapters for another base: {key} is for layer {layer}, the base has {n_layer}"
                )
            param = getattr(places[(layer, target)], which)
            copy_checked(param, tensor, key, directory)
        rows = token_rows(model)
        wanted = config.get("trainable_token_indices") or {}
        if set(wanted) != set(rows):
            raise UserError(
                f"{directory}: trainable tokens for {sorted(wanted) or 'none'}, but the run adds rows to "
                f"{sorted(rows) or 'none'} (adapters for another vocabulary)"
            )
        for module, param in rows.items():
            start = model.config.vocab_size - param.size(0)
            if list(wanted[module]) != list(range(start, model.config.vocab_size)):
                raise UserError(f"{directory}: its trainable tokens are not the ids the run adds ({start} on)")
            copy_checked(param, tensors.get(TOKEN_KEYS[module]), TOKEN_KEYS[module], directory)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor | None, key: str, directory: str | Path) -> None:
    if tensor is None:
        raise UserError(f"{directory}: {key} is missing from {WEIGHTS_FILE}")
    if tuple(tensor.shape) != tuple(param.shape):
        raise UserError(
            f"{directory}: adapters for another base: {key} is {list(tensor.shape)}, this base needs {list(param.shape)}"
        )
    param.copy_(tensor)
