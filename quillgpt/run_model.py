"""The model a run trains, decided in one place: plan_model says where its weights come from (a resumed
checkpoint, run.init_from, or nothing: a new model) and its architecture as it will be built; build_model builds
exactly that. train.py builds it; train.py --validate (feasibility.py) sizes the same plan on the meta device, so the
model --validate checks is the one training builds.

    plan = plan_model(cfg, dataset, resume)     # checked against the dataset: vocabulary, context
    model = build_model(plan, resume)           # the planned model, with its weights

From run.init_from the architecture is the source's, with the config's dropout, its context cropped to
model.block_size when that is shorter (fine-tuning a long-context model on shorter sequences), and its vocabulary
grown when chat data adds the chat tokens to the source's tokenizer (grow_vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from model import GPT
from quillgpt.chat_template import with_chat_tokens
from quillgpt.checkpoint import TrainingCheckpoint
from quillgpt.config import Config, GPTConfig
from quillgpt.data import Dataset, check_fits, check_vocab_compatible
from quillgpt.errors import UserError
from quillgpt.loading import describe_model, load_model, load_model_weights, model_config_from_args
from quillgpt.tokenizer import same_tokenizer, tokenizer_from_dict


@dataclass(frozen=True)
class ModelPlan:
    origin: str  # "resume", "init_from" or "scratch"
    config: GPTConfig  # the architecture as built: vocabulary grown, context cropped
    source: str | None = None  # init_from: what load_model reads


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
        plan = ModelPlan("resume", config)
    elif cfg.run.init_from != "scratch":
        described = describe_model(cfg.run.init_from, dropout=cfg.model.dropout)
        config, tokenizer = described.config, described.tokenizer
        if dataset.chat and adds_chat_tokens(tokenizer, dataset):  # the chat tokens get rows (grow_vocabulary)
            config = replace(config, vocab_size=max(config.vocab_size, dataset.vocab_size))
            tokenizer = dataset.tokenizer.to_dict()
        check_vocab_compatible(config.vocab_size, tokenizer, dataset, described.source)
        config = replace(config, block_size=min(config.block_size, cfg.model.block_size))
        plan = ModelPlan("init_from", config, cfg.run.init_from)
    else:
        vocab_size = cfg.model.vocab_size or dataset.vocab_size
        plan = ModelPlan("scratch", GPTConfig.from_dict({**cfg.model_args(), "vocab_size": vocab_size}))
    check_fits(dataset, plan.config.block_size, plan.config.vocab_size)
    return plan


def build_model(plan: ModelPlan, resume: TrainingCheckpoint | None = None) -> GPT:
    """The planned model with its weights: the resumed checkpoint's, the init_from source's, or new ones."""
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


def meta_model(plan: ModelPlan) -> GPT:
    """The planned model on the meta device: shapes and counts without allocating memory (train.py --validate)."""
    with torch.device("meta"):
        return GPT(plan.config)


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
