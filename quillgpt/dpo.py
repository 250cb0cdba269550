"""DPO (Direct Preference Optimization, Rafailov et al. 2023) on preference pairs, computed as TRL's DPOTrainer
computes it (trl 1.16: loss_type sigmoid and robust, beta, label_smoothing), inside the trainer's own loop:
train.py on a preference dataset (prepare.py --preference) trains with this loss; checkpoints, resume, logging and
the best checkpoint are the trainer's.

    batches = PairBatches(dataset, block_size, batch_size, seed, device)   # (x, y, stored reference log-probs)
    objective = build_preference_pairs(cfg.dpo, cfg.training, seed, dataset, reference, fresh, rt)
    loss = dpo.loss(model, x, y, stored)                                   # TRL's per-pair loss, averaged

A micro-batch of batch_size pairs is 2 x batch_size rows, the chosen sides then the rejected ones (TRL's order),
each read from its conversation's start as a padded chat row: its targets outside the reply are -1. A row's log-prob
is the sum of its reply tokens' log-probs (TRL's, without length normalisation). With
    delta = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
the per-pair loss is -log sigmoid(beta delta) (sigmoid), or rDPO's (robust: labels flipped with probability
e = label_smoothing) (-(1 - e) log sigmoid(beta delta) + e log sigmoid(-beta delta)) / (1 - 2e); the micro-batch's
loss is their mean, plus sft_weight x the chosen replies' mean per-token NLL when set (TRL's loss_type [sigmoid, sft]).
The rewards TRL logs are beta x (log pi - log ref) of each side.

The reference is run.init_from's model (eval mode, the run's precision). dpo.reference = "precomputed" computes its
log-probs of every conversation once and stores them beside the data, in data/<dataset>/reference/<key>/ (key: a hash
of the reference's weights, block_size, precision and the dataset's meta.json), so other runs and resumes read them;
"on_the_fly" keeps the reference model in memory and runs it on each batch.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm import tqdm

from quillgpt import distributed
from quillgpt.config import DPOConfig, TrainingConfig
from quillgpt.data import Dataset, batch_rng, gather_rows
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, atomic_write_json, read_json
from quillgpt.objective import Objective, Trainer, eval_indices, hellaswag

REFERENCE_DIR = "reference"
SUMS = ("loss", "reward_acc", "reward_margin", "chosen_reward", "rejected_reward")  # then the pair count


# ---- the loss ---------------------------------------------------------------------------------------


def sequence_logps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(R, T) inputs and targets -> (R,) fp32: each row's summed log-probs of its counted targets (-1: not counted)."""
    logits, _ = model(x)  # (R, T, V)
    nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none", ignore_index=-1)  # (R*T,)
    return -nats.view(y.shape).sum(1)


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, settings: DPOConfig) -> torch.Tensor:
    """(2B,) log-probs of the policy and of the reference, chosen rows first -> (B,) per-pair losses (TRL's)."""
    beta, e = settings.beta, settings.label_smoothing
    delta = log_ratios(policy, reference)
    delta = delta[0] - delta[1]
    if settings.loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    return (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)


def chosen_nll(policy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The chosen replies' mean negative log-likelihood per token over the micro-batch (TRL's sft loss)."""
    chosen_targets = y.chunk(2)[0]  # (B, T)
    return -policy.chunk(2)[0].sum() / (chosen_targets >= 0).sum().clamp(min=1)


def log_ratios(policy: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log pi - log ref, (B,) each."""
    ratio = policy - reference  # (2B,)
    return ratio.chunk(2)


@dataclass
class DPO:
    """What DPO adds to the trainer: its settings and the reference model (None: the batches carry its stored
    log-probs)."""

    settings: DPOConfig
    reference_model: nn.Module | None
    description: str = ""  # the start-up line

    def reference_logps(self, x: torch.Tensor, y: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        if stored is not None:
            return stored
        with torch.no_grad():
            return sequence_logps(self.reference_model, x, y)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        """The micro-batch's DPO loss: the mean of its pairs' losses (and sft_weight x the chosen replies' NLL)."""
        policy = sequence_logps(model, x, y)
        loss = dpo_losses(policy, self.reference_logps(x, y, stored), self.settings).mean()
        return loss + self.settings.sft_weight * chosen_nll(policy, y) if self.settings.sft_weight else loss

    def sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        """(6,) sums over the micro-batch's pairs of the loss (loss() per pair), a right preference (the chosen reward
        above the rejected), the reward margin and each side's reward (SUMS), and the number of pairs."""
        policy, reference = sequence_logps(model, x, y), self.reference_logps(x, y, stored)
        chosen, rejected = (self.settings.beta * r for r in log_ratios(policy, reference))
        losses = dpo_losses(policy, reference, self.settings)
        if self.settings.sft_weight:
            losses = losses + self.settings.sft_weight * chosen_nll(policy, y)
        count = torch.tensor(float(len(losses)), device=losses.device)
        return torch.stack(
            [
                losses.sum(),
                (chosen > rejected).float().sum(),
                (chosen - rejected).sum(),
                chosen.sum(),
                rejected.sum(),
                count,
            ]
        )


def figures(sums: torch.Tensor, split: str) -> dict[str, float]:
    """DPO.sums added over batches -> the split's means: {split}_loss, {split}_reward_acc, ..."""
    values = sums.tolist()
    pairs = max(values[-1], 1.0)
    return {f"{split}_{name}": value / pairs for name, value in zip(SUMS, values)}


# ---- the batches ------------------------------------------------------------------------------------


def reply_rows(dataset: Dataset, split: str, conversations: np.ndarray, block_size: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets), (R, block_size) each, of rows read from the conversations' starts: targets outside the
    conversation's reply are -1 (data.py's padded chat rows)."""
    starts = dataset.starts[split][conversations]
    rows = gather_rows(dataset.path(split), dataset.dtype, starts, block_size, pad=True)
    counted = gather_rows(dataset.mask_path(split), np.dtype(np.uint8), starts, block_size, pad=True)
    length = dataset.conversation_ends(split)[conversations] - starts  # (R,)
    counted[np.arange(block_size + 1)[None, :] >= length[:, None]] = 0
    return rows[:, :-1], np.where(counted[:, 1:] == 1, rows[:, 1:], -1)


def counted_targets(dataset: Dataset, split: str, block_size: int) -> np.ndarray:
    """(conversations,) how many reply tokens a row from each conversation's start counts (tokens 1 to block_size of
    the conversation; a longer one is cut there)."""
    mask = np.fromfile(dataset.mask_path(split), dtype=np.uint8)
    before = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])  # before[i]: reply tokens among the first i
    starts, ends = dataset.starts[split], dataset.conversation_ends(split)
    return before[np.minimum(starts + block_size + 1, ends)] - before[starts + 1]


class PairBatches:
    """Batches of preference pairs for (split, index), a pure function of (seed, split, index) as data.BatchSource's:
    (x, y, stored) with x and y (2B, block_size), the chosen sides' rows then the rejected ones', and stored (2B,) the
    reference's stored log-probs of those rows (None: computed on the fly). Pairs are drawn from those whose two rows
    each count a reply token (a prompt that fills the context leaves none: TRL drops such pairs too)."""

    def __init__(self, dataset: Dataset, block_size: int, batch_size: int, seed: int, device: torch.device):
        self.dataset, self.block_size, self.batch_size, self.seed, self.device = (
            dataset,
            block_size,
            batch_size,
            seed,
            device,
        )
        self.stored: dict[str, np.ndarray] | None = None  # split -> the reference's log-prob of each conversation
        self.usable, self.cut = {}, {}
        for split in ("train", "val"):
            n = len(dataset.starts[split])
            if n % 2:
                raise UserError(
                    f"{dataset.directory}: the {split} split has {n} conversations, not two a pair: re-run prepare.py "
                    "--preference with --reset"
                )
            counted = counted_targets(dataset, split, block_size).reshape(-1, 2)  # (pairs, 2)
            self.usable[split] = np.flatnonzero((counted > 0).all(1))
            length = dataset.conversation_ends(split) - dataset.starts[split]
            self.cut[split] = int((length.reshape(-1, 2) > block_size + 1).any(1).sum())
            if not len(self.usable[split]):
                raise UserError(
                    f"no {split} pair has a reply token within block_size + 1 = {block_size + 1} tokens of its start: "
                    "raise model.block_size or shorten the prompts"
                )

    def pairs(self, split: str) -> int:
        return len(self.dataset.starts[split]) // 2

    def drawn(self, split: str, index: int) -> np.ndarray:
        """(B,) the pairs of batch (split, index)."""
        usable = self.usable[split]
        return usable[batch_rng(self.seed, split, index).integers(0, len(usable), size=self.batch_size)]

    def get(
        self, split: str, index: int, next_index: int | None = None, rows: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The batch for (split, index), or its first `rows` pairs. (next_index: BatchSource's prefetch hint; rows
        are read here, not ahead.)"""
        pairs = self.drawn(split, index)[:rows]
        conversations = np.concatenate([2 * pairs, 2 * pairs + 1])  # chosen rows, then rejected rows
        x, y = (torch.from_numpy(np.ascontiguousarray(r)).to(self.device) for r in self.rows(split, conversations))
        stored = None if self.stored is None else torch.from_numpy(self.stored[split][conversations]).to(self.device)
        return x, y, stored

    def rows(self, split: str, conversations: np.ndarray) -> tuple[np.ndarray, ...]:
        return reply_rows(self.dataset, split, conversations, self.block_size)

    def describe(self) -> str:
        t, v = self.pairs("train"), self.pairs("val")
        left_out = t - len(self.usable["train"])
        return (
            f"{t:,} train / {v:,} val pairs | {self.cut['train']:,} train pairs longer than block_size + 1 = "
            f"{self.block_size + 1} (cut there), {left_out:,} with no reply token inside it (left out)"
        )


# ---- the reference ----------------------------------------------------------------------------------


@torch.no_grad()
def conversation_logps(
    model: nn.Module, batches: PairBatches, split: str, autocast, rows_per_batch: int, desc: str
) -> np.ndarray:
    """(conversations,) fp32: the model's log-prob of each conversation's reply, as the batches' rows read it."""
    n = len(batches.dataset.starts[split])
    out = np.zeros(n, dtype=np.float32)
    was_training = model.training
    model.eval()
    for lo in tqdm(range(0, n, rows_per_batch), desc=desc, leave=False, unit="batch"):
        conversations = np.arange(lo, min(lo + rows_per_batch, n))
        x, y = (
            torch.from_numpy(np.ascontiguousarray(r)).to(batches.device) for r in batches.rows(split, conversations)
        )
        with autocast:
            out[conversations] = sequence_logps(model, x, y).cpu().numpy()
    model.train(was_training)
    return out


def reference_key(model: nn.Module, dataset: Dataset, block_size: int, precision: str) -> str:
    """What the stored log-probs depend on, hashed: the reference's weights, the rows' length, the precision it ran
    in and the dataset (its meta.json, which a re-prepare rewrites)."""
    digest = hashlib.sha256(f"quillgpt-dpo-reference:1:{block_size}:{precision}:".encode())
    digest.update((dataset.directory / "meta.json").read_bytes())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def stored_reference(
    model: nn.Module, batches: PairBatches, precision: str, autocast, dist: DistInfo
) -> tuple[dict[str, np.ndarray], str]:
    """The reference's log-prob of every conversation of each split, read from data/<dataset>/reference/<key>/
    (computed once by rank 0 and written there first when missing); with a line saying which."""
    dataset = batches.dataset
    directory = dataset.directory / REFERENCE_DIR / reference_key(model, dataset, batches.block_size, precision)
    found = distributed.broadcast_object((directory / "about.json").is_file(), dist)  # rank 0's: it writes them
    t0 = time.perf_counter()
    if not found:
        distributed.on_main(write_reference, dist, model, batches, directory, precision, autocast)
    stored = {split: read_reference(directory, split, len(dataset.starts[split])) for split in ("train", "val")}
    how = "reused" if found else f"computed in {time.perf_counter() - t0:.0f}s"
    return stored, f"reference log-probs of run.init_from's model {how}, in {directory}"


def write_reference(model: nn.Module, batches: PairBatches, directory: Path, precision: str, autocast) -> None:
    """Compute and write each split's log-probs, then about.json (last: its presence means they are complete)."""
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        logps = conversation_logps(
            model, batches, split, autocast, 2 * batches.batch_size, f"reference log-probs ({split})"
        )
        with atomic_write(directory / f"{split}.f32") as f:
            f.write(logps.astype("<f4").tobytes())
    seconds = time.perf_counter() - t0
    atomic_write_json(
        directory / "about.json",
        {"block_size": batches.block_size, "precision": precision, "seconds": round(seconds, 1)},
    )


def read_reference(directory: Path, split: str, conversations: int) -> np.ndarray:
    read_json(directory / "about.json", "DPO reference log-probs")
    path = directory / f"{split}.f32"
    if not path.is_file() or path.stat().st_size != 4 * conversations:
        raise UserError(
            f"{path} does not hold a log-prob for each of the {conversations} {split} conversations: delete "
            f"{directory} and run again to recompute it"
        )
    return np.fromfile(path, dtype="<f4")


def frozen(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


class PreferencePairs(Objective):
    """DPO's objective: a micro-batch of pairs' DPO loss (DPO.loss), its evaluation TRL's figures on held-out pairs."""

    name, rows_per_sample = "dpo", 2

    def __init__(self, dpo: DPO, batches: PairBatches):
        self.dpo, self.batches = dpo, batches

    def loss(self, tr: Trainer, batch: tuple) -> torch.Tensor:
        return self.dpo.loss(tr.model, *batch)

    def data_line(self, tr: Trainer) -> str:
        return self.dpo.description

    @torch.no_grad()
    def evaluate(self, tr: Trainer, batches: int) -> dict[str, float]:
        """Per split the DPO loss and TRL's reward figures (a side's reward is beta x its log-prob gain over the
        reference): how often the chosen side's is the higher, their mean margin and each side's mean, over `batches`
        batches of pairs (the same every time), dealt to the ranks as LanguageModeling.evaluate deals them."""
        tr.model.eval()
        out = {}
        for split in ("train", "val"):
            sums = torch.zeros(6, device=tr.rt.device)
            for k in eval_indices(tr, batches, split):
                with tr.rt.autocast:
                    sums += (k < batches) * self.dpo.sums(tr.model, *self.batches.get(split, k))
            out.update(figures(distributed.all_reduce_sum(sums), split))
        if tr.evaluation.hellaswag:
            out.update(hellaswag(tr, tr.evaluation.hellaswag))
        tr.model.train()
        return out


def build_preference_pairs(
    settings: DPOConfig,
    training: TrainingConfig,
    seed: int,
    dataset: Dataset,
    reference: nn.Module,
    fresh: bool,
    rt,
) -> PreferencePairs:
    """The objective of a run on preference pairs. reference: run.init_from's model on the run's device; fresh: it
    is the run's own model before training (a new run), which on_the_fly then copies."""
    if training.best_metric == "bpb":
        raise UserError("training.best_metric = 'bpb' means nothing for DPO: use val_loss (the DPO loss)")
    if training.loss_chunks > 1:
        raise UserError("training.loss_chunks applies to the language-model loss: DPO needs it at 1")
    batches = PairBatches(dataset, reference.config.block_size, training.batch_size, seed, rt.device)
    if settings.reference == "on_the_fly":
        dpo = DPO(settings, frozen(copy.deepcopy(reference) if fresh else reference))
        how = "the reference (run.init_from's model) runs on each batch"
    else:
        batches.stored, how = stored_reference(reference, batches, rt.precision, rt.autocast, rt.dist)
        dpo = DPO(settings, None)
    s = settings
    loss = s.loss_type + (f", label_smoothing {s.label_smoothing}" if s.loss_type == "robust" else "")
    loss += f" + {s.sft_weight} x the chosen replies' NLL" if s.sft_weight else ""
    dpo.description = f"dpo: beta {s.beta}, {loss} loss | {batches.describe()} | {how}"
    return PreferencePairs(dpo, batches)
