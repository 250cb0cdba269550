"""What a run trains on, chosen once when its trainer is built (trainer.build_trainer): an Objective gives the loss of
a micro-batch (or, for RL, the whole optimizer step), the evaluation, the tokens of a step and the step line's
figures; the loop (trainer.fit) is the same for all three:

    LanguageModeling   next-token cross-entropy on text or chat rows (here)
    PreferencePairs    DPO on preference pairs (quillgpt/dpo.py)
    Reinforcement      GRPO on sampled replies, a LanguageModeling that steps on its own rollouts (quillgpt/rl.py)

The step's parts they share are here too: accumulation over micro-batches (Objective.step), clipping, and an
optimizer step that leaves the weights alone where the gradients are not finite (apply_gradients).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm import tqdm

from quillgpt import distributed
from quillgpt.config import Config
from quillgpt.data import BatchSource, Dataset, micro_batch_index, micro_batch_rows
from quillgpt.moe import RouterTally
from quillgpt.scoring import HellaSwagItem, score_hellaswag


class Trainer(Protocol):
    """What an objective reads of the run it trains (trainer.Trainer is one; it lives above this module)."""

    cfg: Config
    rt: Any  # trainer.Runtime: device, precision, dist, autocast
    dataset: Dataset
    raw_model: nn.Module
    model: nn.Module  # raw_model as the step calls it (wrapped, compiled)
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler
    evaluation: Any  # trainer.Evaluation: token bytes, HellaSwag items

    @property
    def block_size(self) -> int: ...


class Objective:
    """The language-model-shaped step (micro-batches of batch_size rows, accumulated) and the hooks an objective
    fills in. batches: where its micro-batches come from, get(split, index)."""

    name = "lm"  # what train_log.json and the curves are of: "lm", "dpo" or "rl"
    loss_name = "loss"  # what the step line calls the loss it prints
    rows_per_sample = 1  # rows a micro-batch's sample is (DPO's pair: 2)
    batches: Any = None

    def data_line(self, tr: Trainer) -> str | None:
        """The start-up line about what the data is trained as (None: plain text)."""
        if tr.dataset.chat:
            return chat_line(tr.dataset, tr.block_size, tr.cfg.data.chat_rows)
        if tr.cfg.data.document_mask:
            return "documents: each attends only within itself, its positions from 0 (data.document_mask)"
        return None

    def batch_line(self, tr: Trainer) -> str:
        t, world = tr.cfg.training, tr.rt.dist.world_size
        samples = "pairs (2 rows each)" if self.rows_per_sample == 2 else "sequences"
        ramp = (
            f"; from {t.batch_ramp_start} rows a micro-batch at step 0 to {t.batch_size} at step "
            f"{t.batch_ramp_iters:,} (training.batch_ramp_iters)"
            if t.batch_ramp_iters
            else ""
        )
        return (
            f"batch: {t.batch_size} x {t.grad_accum_steps} accum x {world} ranks = "
            f"{t.batch_size * t.grad_accum_steps * world} {samples}, {self.tokens_per_step(tr):,} tokens per "
            f"optimizer step{ramp}"
        )

    def loss(self, tr: Trainer, batch: tuple) -> torch.Tensor:
        """One micro-batch's loss (the mean over what it counts)."""
        raise NotImplementedError

    def evaluate(self, tr: Trainer, batches: int) -> dict[str, float]:
        raise NotImplementedError

    def figures(self) -> dict[str, float] | None:
        """The step line's figures besides the loss (None: none)."""
        return None

    def tokens_per_step(self, tr: Trainer, it: int | None = None) -> int:
        """Tokens an optimizer step trains on over all ranks: at full batch, or at step `it` (a batch ramp's)."""
        t = tr.cfg.training
        rows = t.batch_size if it is None else micro_batch_rows(t, it)
        return self.rows_per_sample * rows * t.grad_accum_steps * tr.rt.dist.world_size * tr.block_size

    def reported(self, loss: torch.Tensor, accum: int) -> torch.Tensor:
        """The part of a micro-batch's loss (already divided by accum) the step line reports (LanguageModeling:
        without an MoE's router losses)."""
        return loss.detach()

    def end_step(self, skipped: torch.Tensor) -> None:
        """After the optimizer's step (skipped: 1.0 where it was not applied)."""

    def step(self, tr: Trainer, it: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward over grad_accum_steps micro-batches, clip, step. Returns (loss, grad norm, skipped):
        tensors on the device, `skipped` 1.0 where non-finite gradients left the weights as they were. Nothing here
        waits for the device, so on a GPU the host queues the next step while this one runs."""
        accum, rank, world = tr.cfg.training.grad_accum_steps, tr.rt.dist.rank, tr.rt.dist.world_size
        total = torch.zeros((), device=tr.rt.device)
        for micro in range(accum):
            index = micro_batch_index(it, rank, micro, accum, world)
            upcoming = (
                micro_batch_index(it, rank, micro + 1, accum, world)
                if micro + 1 < accum
                else micro_batch_index(it + 1, rank, 0, accum, world)
            )
            batch = self.batches.get("train", index, next_index=upcoming, rows=micro_batch_rows(tr.cfg.training, it))
            with distributed.no_sync(tr.model, last=micro == accum - 1):
                with tr.rt.autocast:
                    loss = self.loss(tr, batch) / accum
                tr.scaler.scale(loss).backward()
            total += self.reported(loss, accum)
        norm, skipped = apply_gradients(tr)
        self.end_step(skipped)
        return total, norm, skipped


def apply_gradients(tr: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscale, clip and step every optimizer unless the gradients are non-finite, then clear them: (the gradients'
    norm before clipping, the skip flag)."""
    for opt in tr.optimizers:
        tr.scaler.unscale_(opt)
    norm = clip_gradients(tr.model, tr.cfg.optimizer.grad_clip)
    skipped = step_unless_nonfinite(tr.optimizers, tr.scaler, norm)
    for opt in tr.optimizers:
        opt.zero_grad(set_to_none=True)
    return norm, skipped


def step_unless_nonfinite(
    optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, norm: torch.Tensor
) -> torch.Tensor:
    """Apply each optimizer's update unless the gradients are non-finite, decided on the device; returns the skip
    flag (0-dim, 1.0 = skipped). fp16: GradScaler finds the infs and skips (and lowers its scale). Otherwise the
    flag goes to the optimizers as GradScaler's `found_inf`, which fused AdamW and Muon skip on without a host sync;
    an optimizer without that protocol (for-loop AdamW) has the host read the flag."""
    if scaler.is_enabled():
        scale = scaler._get_scale_async().clone()
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        return (scaler._get_scale_async() < scale).float()
    found_inf = (~torch.isfinite(norm)).float()
    for opt in optimizers:
        if getattr(opt, "_step_supports_amp_scaling", False):
            opt.grad_scale, opt.found_inf = None, found_inf
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif not found_inf.item():
            opt.step()
    return found_inf


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0: don't) and return the global L2 norm of the gradients before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
    return distributed.full_tensor(norm)


# ---- language modelling ------------------------------------------------------------------------------------------


class LanguageModeling(Objective):
    """The next token's cross-entropy, over the counted targets (chat data: the assistant's tokens). An MoE's router
    losses are in the loss trained on, not in the loss reported; routing keeps their balance over each step."""

    def __init__(self, batches: BatchSource, routing: RouterTally | None):
        self.batches, self.routing = batches, routing

    def loss(self, tr: Trainer, batch: tuple) -> torch.Tensor:
        x, y, positions = batch
        return tr.model(x, y, positions=positions)[1]

    def reported(self, loss: torch.Tensor, accum: int) -> torch.Tensor:
        if self.routing is None:
            return loss.detach()
        return loss.detach() - self.routing.add() / accum  # the cross-entropy; the tally counts the routing

    def end_step(self, skipped: torch.Tensor) -> None:
        if self.routing is not None:
            self.routing.end_step(skipped)  # DeepSeek-V3's biases move after the weights, by the step's loads

    def figures(self) -> dict[str, float] | None:
        return self.routing.figures() if self.routing is not None else None

    @torch.no_grad()  # not inference_mode: FSDP's unsharded weights made here are reused by training
    def evaluate(self, tr: Trainer, batches: int) -> dict[str, float]:
        """Mean loss, perplexity, next-token accuracy and bits per byte over `batches` batches per split (the same
        batches every time), and HellaSwag when eval.hellaswag names it. On chat data all of them are over the
        assistant's tokens (the targets that count), weighted by their number. The batches are dealt round-robin to
        the ranks, so the result does not depend on the world size; every rank runs the same number of forwards
        (FSDP gathers weights collectively), padding batches counting zero."""
        tr.model.eval()
        out, device = {}, tr.rt.device
        for split in ("train", "val"):
            # the sums of loss x w, correct / numel, w, nats of tokens with bytes, their bytes, where w is the share of
            # the batch's targets that count (1 except on chat data); loss x w is the batch's nats over its numel
            sums = torch.zeros(5, device=device)
            for k in eval_indices(tr, batches, split):
                x, y, positions = self.batches.get(split, k)
                with tr.rt.autocast:
                    logits, _ = tr.model(x, positions=positions)  # no targets: the cross-entropy is per token below
                counted = y >= 0
                w = counted.sum().float() / y.numel()
                nbytes = tr.evaluation.token_bytes[y.clamp(min=0)] * counted
                nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none", ignore_index=-1)
                right = ((logits.argmax(-1) == y) & counted).sum().float() / y.numel()
                with_bytes = (nats * (nbytes.flatten() > 0)).sum()
                sums += (k < batches) * torch.stack(
                    [nats.sum() / y.numel(), right, w, with_bytes, nbytes.sum().float()]
                )
            sums = distributed.all_reduce_sum(sums)
            counted = sums[2].clamp(min=1e-9)  # (a split without a counted token reports 0, not 0/0)
            loss = (sums[0] / counted).item()
            out[f"{split}_loss"] = loss
            out[f"{split}_ppl"] = math.exp(min(loss, 50))
            out[f"{split}_acc"] = (sums[1] / counted).item()
            out[f"{split}_bpb"] = (sums[3] / math.log(2) / sums[4].clamp(min=1)).item()
        if tr.evaluation.hellaswag:
            out.update(hellaswag(tr, tr.evaluation.hellaswag))
        tr.model.train()
        return out


ISOLATED = ", each conversation attending only within itself"


def chat_line(dataset: Dataset, block_size: int, rows: str) -> str:
    """What chat training counts: the assistant's tokens, their share, and the conversations rows cut short."""
    starts = dataset.starts["train"]
    longer = int((np.diff(np.append(starts, dataset.lengths["train"])) > block_size + 1).sum())
    share = dataset.meta.get("train_assistant_tokens", 0) / dataset.lengths["train"]
    return (
        f"chat: losses, accuracy and the best checkpoint count the assistant's tokens only ({share:.1%} of train "
        f"tokens) | rows {rows}, each from a conversation start{ISOLATED if rows == 'packed' else ''} | {longer:,} of "
        f"{len(starts):,} train conversations "
        f"are longer than block_size + 1 = {block_size + 1}: rows cut them there"
    )


def eval_indices(tr: Trainer, n: int, split: str) -> Iterable[int]:
    """The evaluation batches this rank reads, dealt round-robin: every rank the same count (an index >= n pads a
    rank's share and counts zero), with a progress bar on the main rank."""
    rank, world = tr.rt.dist.rank, tr.rt.dist.world_size
    return tqdm(
        range(rank, math.ceil(n / world) * world, world),
        desc=f"eval {split}",
        leave=False,
        disable=None if tr.rt.dist.is_main else True,
    )


def hellaswag(tr: Trainer, items: list[HellaSwagItem]) -> dict[str, float]:
    """acc and acc_norm on the items, dealt to the ranks in turn; every rank scores as many (padding items count
    zero), so FSDP's collective forwards stay in step. The uncompiled model: items vary in length, which would make
    torch.compile compile again and again."""
    rank, world = tr.rt.dist.rank, tr.rt.dist.world_size
    share = [items[i % len(items)] for i in range(rank, math.ceil(len(items) / world) * world, world)]
    score = score_hellaswag(tr.raw_model, tr.dataset.tokenizer, share, tr.rt.autocast)
    real = [i < len(items) for i in range(rank, math.ceil(len(items) / world) * world, world)]
    right = sum(r for r, k in zip(score.right, real) if k), sum(r for r, k in zip(score.right_norm, real) if k)
    sums = distributed.all_reduce_sum(torch.tensor([*right, sum(real)], dtype=torch.float64, device=tr.rt.device))
    return {"hellaswag_acc": (sums[0] / sums[2]).item(), "hellaswag_acc_norm": (sums[1] / sums[2]).item()}
