"""The model a run trains, decided in one place: plan_model says where its weights come from (a resumed
checkpoint, run.init_from, or nothing: a new model) and its architecture as it will be built; build_model builds
exactly that. train.py builds it; train.py --validate (feasibility.py) sizes the same plan on the meta device, so the
model --validate checks is the one training builds.

    plan = plan_model(cfg, dataset, resume)     # checked against the dataset: vocabulary, context
    model = build_model(plan, resume)           # the planned model, with its weights

From run.init_from the architecture is the source's, with the config's dropout, its context cropped to
model.block_size when that is shorter (fine-tuning a long-context model on shorter sequences), and its vocabulary
grown when chat data adds the chat tokens to the source's tokenizer (grow_vocabulary). With lora.enabled the plan
also says which adapters the frozen source gets and records the source (path and sha256, loading.base_record), which a
resumed LoRA run checks before anything else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from model import GPT
from quillgpt.chat_template import with_chat_tokens
from quillgpt.checkpoint import TrainingCheckpoint
from quillgpt.config import NO_CAP, Config, GPTConfig, TrainingConfig
from quillgpt.data import Dataset, check_fits, check_vocab_compatible, micro_batch_rows
from quillgpt.errors import UserError
from quillgpt.loading import (
    base_record,
    check_base,
    describe_model,
    load_base,
    load_model,
    load_model_weights,
    lora_model,
    model_config_from_args,
)
from quillgpt.lora import LoraSettings, add_adapters
from quillgpt.peft_io import load_peft_adapters, peft_settings
from quillgpt.tokenizer import same_tokenizer, tokenizer_from_dict


@dataclass(frozen=True)
class LoraPlan:
    """The adapters a LoRA run trains and the frozen base they sit on."""

    settings: LoraSettings
    base: dict  # loading.base_record: the source, the file or directory read, its sha256
    base_config: GPTConfig  # the base as its source describes it (before the vocabulary grows, the context is cropped)
    adapters: str | None = None  # a new run: the PEFT directory its adapters start from (lora.adapters)

    def record(self) -> dict:
        """What the run's checkpoints hold of it (TrainingCheckpoint.lora)."""
        return {"settings": self.settings.record(), "base": self.base}


@dataclass(frozen=True)
class ModelPlan:
    origin: str  # "resume", "init_from" or "scratch"
    config: GPTConfig  # the architecture as built: vocabulary grown, context cropped
    source: str | None = None  # init_from: what load_model reads
    lora: LoraPlan | None = None  # lora.enabled: the adapters, on the frozen source
    # a resumed DPO or RL (kl_coef > 0) run: run.init_from's model, its reference (a new run's is the model as it starts)
    reference: ModelPlan | None = None


def plan_model(cfg: Config, dataset: Dataset, resume: TrainingCheckpoint | None) -> ModelPlan:
    """The model the run trains, checked against the dataset (and, resumed, against the config): no weights read."""
    if resume is not None:
        config = model_config_from_args(resume.model_args, "checkpoint")
        if config.to_dict() != cfg.model_args():
            diff = [k for k, v in config.to_dict().items() if cfg.model_args()[k] != v]
            raise UserError(
                f"--resume: the config's model differs from the checkpoint's in {diff}; "
                "resume with the run's own config, or fine-tune with run.init_from instead"
            )
        check_vocab_compatible(config.vocab_size, resume.tokenizer, dataset, "the checkpoint")
        plan = ModelPlan("resume", config, lora=resumed_lora(cfg, resume))
    elif cfg.run.init_from != "scratch":
        described = describe_model(cfg.run.init_from, dropout=cfg.model.dropout)
        config, tokenizer = described.config, described.tokenizer
        if dataset.chat and adds_chat_tokens(tokenizer, dataset):  # the chat tokens get rows (grow_vocabulary)
            config = replace(config, vocab_size=max(config.vocab_size, dataset.vocab_size))
            tokenizer = dataset.tokenizer.to_dict()
        check_vocab_compatible(config.vocab_size, tokenizer, dataset, described.source)
        config = replace(config, block_size=min(config.block_size, cfg.model.block_size))
        lora = plan_lora(cfg, described.config) if cfg.lora.enabled else None
        plan = ModelPlan("init_from", config, cfg.run.init_from, lora)
    else:
        vocab_size = cfg.model.vocab_size or dataset.vocab_size
        plan = ModelPlan("scratch", GPTConfig.from_dict({**cfg.model_args(), "vocab_size": vocab_size}))
    check_fits(dataset, plan.config.block_size, plan.config.vocab_size)
    if (dataset.preference or cfg.rl.enabled and cfg.rl.kl_coef > 0) and plan.origin == "resume":
        plan = replace(plan, reference=plan_model(cfg, dataset, None))
    return plan


def plan_lora(cfg: Config, base_config: GPTConfig) -> LoraPlan:
    """A new LoRA run's adapters (lora.adapters': the PEFT directory's rank, alpha and targets) on run.init_from."""
    settings = LoraSettings.from_config(cfg.lora, base_config)
    if cfg.lora.adapters is not None:
        settings = peft_settings(cfg.lora.adapters, settings)
    return LoraPlan(settings, base_record(cfg.run.init_from), base_config, cfg.lora.adapters)


def resumed_lora(cfg: Config, resume: TrainingCheckpoint) -> LoraPlan | None:
    """A resumed LoRA run's adapters and base, the base checked against the sha256 its checkpoint recorded."""
    if resume.lora is None:
        if cfg.lora.enabled:
            raise UserError("--resume: the checkpoint is not a LoRA run's, but the config has lora.enabled")
        return None
    if not cfg.lora.enabled:
        raise UserError("--resume: the checkpoint is a LoRA run's, but the config has lora.enabled = false")
    settings = LoraSettings.from_record(resume.lora.get("settings") or {}, "the checkpoint")
    check_base(resume.lora.get("base"), "the checkpoint")
    base = describe_model(resume.lora["base"]["source"])
    return LoraPlan(settings, resume.lora["base"], base.config)


def build_model(plan: ModelPlan, resume: TrainingCheckpoint | None = None, base_dtype=torch.float32) -> GPT:
    """The planned model with its weights: the resumed checkpoint's, the init_from source's, or new ones. A LoRA
    model's frozen linear weights are kept in base_dtype (the run's precision: lora.add_adapters)."""
    if plan.lora is not None:
        return build_lora_model(plan, resume, base_dtype)
    if plan.origin == "init_from":
        model = load_model(plan.source, dropout=plan.config.dropout).model
        grow_vocabulary(model, plan.config.vocab_size)
        if plan.config.block_size < model.config.block_size:
            model.crop_block_size(plan.config.block_size)
        if model.config != plan.config:
            raise UserError(f"{plan.source} changed on disk since the run was planned: start the run again")
        return model
    model = GPT(plan.config)
    if resume is not None:
        load_model_weights(model, resume.model, "checkpoint")
    return model


def build_lora_model(plan: ModelPlan, resume: TrainingCheckpoint | None, base_dtype: torch.dtype) -> GPT:
    """The frozen base with the planned adapters: a resumed run's, a PEFT directory's, or new ones (B = 0)."""
    if resume is not None:
        return lora_model(resume.lora, plan.config, resume.model, "the checkpoint", base_dtype, verified=True)
    model = load_base(plan.lora.base, plan.lora.base["path"], plan.config.dropout, verified=True)
    if plan.config.block_size < model.config.block_size:
        model.crop_block_size(plan.config.block_size)
    model = add_adapters(model, plan.lora.settings, plan.config.vocab_size, base_dtype)
    if model.config != plan.config:
        raise UserError(f"{plan.source} changed on disk since the run was planned: start the run again")
    if plan.lora.adapters is not None:
        load_peft_adapters(model, plan.lora.adapters, plan.lora.base_config)
    return model


def meta_model(plan: ModelPlan) -> GPT:
    """The planned model on the meta device: shapes and counts without allocating memory (train.py --validate); a
    LoRA plan's with its adapters (its base unquantized: feasibility counts the bytes a quantized base takes)."""
    with torch.device("meta"):
        if plan.lora is None:
            return GPT(plan.config)
        base = GPT(replace(plan.config, vocab_size=plan.lora.base_config.vocab_size))
        return add_adapters(base, replace(plan.lora.settings, quantize="none"), plan.config.vocab_size)


def adds_chat_tokens(model_tokenizer: dict | None, dataset: Dataset) -> bool:
    """The chat dataset's tokenizer is the model's with the chat template and its tokens added (with_chat_tokens)."""
    if model_tokenizer is None:
        return False
    with_chat = with_chat_tokens(tokenizer_from_dict(model_tokenizer)).to_dict()
    return same_tokenizer(with_chat, dataset.tokenizer.to_dict()) and not same_tokenizer(
        model_tokenizer, dataset.tokenizer.to_dict()
    )


@torch.no_grad()
def grow_vocabulary(model: GPT, vocab_size: int) -> None:
    """Give the model ids up to vocab_size (the chat tokens added after its vocabulary): the new rows of the token
    embedding and of the head are the means of the old ones, so a new token starts as an average token, not as
    noise that the first steps would spend their updates on."""
    old = model.config.vocab_size
    if vocab_size <= old:
        return
    tied = model.lm_head.weight is model.transformer.wte.weight

    def grown(weight: torch.Tensor) -> nn.Parameter:
        mean = weight.mean(0, keepdim=True).expand(vocab_size - old, -1)  # (new, C)
        return nn.Parameter(torch.cat([weight, mean]))

    model.transformer.wte.weight = grown(model.transformer.wte.weight)
    model.transformer.wte.num_embeddings = vocab_size
    model.lm_head.weight = model.transformer.wte.weight if tied else grown(model.lm_head.weight)
    model.lm_head.out_features = vocab_size
    model.config = replace(model.config, vocab_size=vocab_size)


def scaling_params(model_config: GPTConfig) -> tuple[int, float]:
    """(the blocks' matrices plus the head's weights, training FLOPs per token) of a model, built on the meta device."""
    with torch.device("meta"):
        model = GPT(model_config)
    matrices = sum(p.numel() for p in model.transformer.h.parameters() if p.dim() >= 2)
    return matrices + model.lm_head.weight.numel(), model.flops_per_token()


def steps_for_tokens(t: TrainingConfig, target: float, row_tokens: int, rounding: Callable[[float], int]) -> int:
    """The optimizer steps that train on `target` tokens, a step's micro-batch rows each worth `row_tokens` (block
    size x accumulation x ranks): the batch ramp's smaller steps first (training.batch_ramp_iters), then full steps,
    their count rounded by `rounding`; at least 1."""
    steps, done = 0, 0
    while steps < t.batch_ramp_iters and done < target:
        done += micro_batch_rows(t, steps) * row_tokens
        steps += 1
    if done < target:
        steps += rounding((target - done) / (t.batch_size * row_tokens))
    return max(1, steps)


def horizon(cfg: Config, model_config: GPTConfig, world_size: int) -> tuple[Config, str]:
    """cfg with max_iters from its horizon target (the targets then cleared: the run records the steps), and the line
    that says where max_iters came from."""
    t = cfg.training
    row_tokens = model_config.block_size * t.grad_accum_steps * world_size  # one micro-batch row, over all ranks
    tokens = t.batch_size * row_tokens  # one optimizer step
    params, flops = scaling_params(model_config)
    ramp = f" after the batch ramp's {t.batch_ramp_iters:,} smaller steps" if t.batch_ramp_iters else ""
    if t.target_flops is not None:
        steps = steps_for_tokens(t, t.target_flops / flops, row_tokens, round)
        why = f"target_flops {t.target_flops:.3g} / ({flops:.3g} FLOPs a token x {tokens:,} tokens a step{ramp})"
    elif t.target_param_data_ratio is not None:
        steps = steps_for_tokens(t, int(t.target_param_data_ratio * params), row_tokens, math.floor)
        why = (
            f"target_param_data_ratio {t.target_param_data_ratio:g} x {params:,} scaling parameters / {tokens:,} "
            f"tokens a step{ramp}"
        )
    elif t.max_iters == NO_CAP:
        return cfg, f"training.max_iters: no cap (training.time_budget_s {t.time_budget_s:g} ends the run)"
    else:
        ratio = t.max_iters * tokens / params
        return (
            cfg,
            f"training.max_iters = {t.max_iters:,} ({ratio:.3g} tokens per scaling parameter, {params:,} of them)",
        )
    training = dataclasses.replace(t, max_iters=steps, target_flops=None, target_param_data_ratio=None)
    return dataclasses.replace(cfg, training=training), f"training.max_iters = {steps:,} ({why})"
