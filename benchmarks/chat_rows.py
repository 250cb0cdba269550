"""--chat: chat fine-tuning's two measurements, on conversations generated here ("What is a + b?" -> the sum, some
with a system message or a second exchange), prepared with prepare.py --chat's pipeline (char + ChatML):

- the masked loss against the unmasked one: the same model and batches, the targets outside the assistant's tokens
  -1 (the loss counts the assistant's tokens) or all real (the batch's every token); the training step's ms/iter in
  turns (bench.py's default mode's method), and their ratio;
- --rows SECONDS: rows "packed" (from a conversation start on into the following ones) against "padded" (the first
  conversation's targets only), each trained for SECONDS of wall time from the same start: assistant tokens per
  step, steps done, and the val loss and accuracy over the assistant's tokens reached, evaluated on padded rows
  (a conversation from position 0 with nothing before it, as chat.py sees one) and on packed rows.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import CPU_PRESET, Bench, Mode, describe, print_table, time_training, trainer_for
from benchmarks.conditions import load_average
from quillgpt.config import parse_overrides
from quillgpt.data import BatchSource
from quillgpt.files import atomic_write_text
from quillgpt.optim import lr_multiplier, set_lr
from quillgpt.trainer import Trainer, eval_metrics, train_step

MODEL = {
    "model.n_layer": 4,
    "model.n_head": 4,
    "model.n_embd": 128,
    "model.block_size": 256,
    "model.dropout": 0.0,
    "training.batch_size": 16,
    "training.eval_iters": 20,
    "training.precision": "fp32",
    "optimizer.warmup_iters": 20,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=20_000, help="generated conversations (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default %(default)s)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per repeat (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported (default %(default)s)")
    p.add_argument(
        "--rows", type=float, metavar="SECONDS", help="also train packed and padded rows for SECONDS each and compare"
    )


def sums_conversations(n: int, seed: int = 0, top: int = 999) -> list[list[dict]]:
    """n conversations "What is a + b?" -> the sum (a, b <= top), a third with a system message, a quarter with a
    second exchange."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, top), rng.randint(0, top)
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with a number."})
        if i % 4 == 0:
            messages += [
                {"role": "user", "content": "And doubled?"},
                {"role": "assistant", "content": str(2 * (a + b))},
            ]
        out.append(messages)
    return out


class UnmaskedBatchSource(BatchSource):
    """The same rows as the chat batches, every target real: the unmasked loss's batches."""

    def chat_rows_of(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        from quillgpt.data import gather_rows

        starts = self.starts(split, index)
        rows = gather_rows(self.dataset.path(split), self.dataset.dtype, starts, self.block_size, pad=True)
        return rows[:, :-1], rows[:, 1:]


def run(args: argparse.Namespace, cli: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "sums.jsonl"
        atomic_write_text(
            source, "".join(json.dumps({"messages": m}) + "\n" for m in sums_conversations(args.conversations))
        )
        overrides = [
            *parse_overrides([f"--{k}={v}" for k, v in MODEL.items()]),
            ("data.dataset", "sums"),
            ("data.data_dir", tmp),
            ("data.input", str(source)),
            ("data.chat", True),
            *parse_overrides(cli),
        ]
        masked = trainer_for(str(CPU_PRESET), overrides)
        print(f"model: {describe(masked)}", flush=True)
        time_masked_loss(masked, args)
        if args.rows:
            compare_rows(str(CPU_PRESET), overrides, args.rows)
    print(load_average())


def time_masked_loss(masked: Trainer, args: argparse.Namespace) -> None:
    tr = masked
    unmasked = replace(
        tr,
        batches=UnmaskedBatchSource(
            tr.dataset, tr.raw_model.config.block_size, tr.cfg.training.batch_size, tr.cfg.run.seed, tr.rt.device
        ),
    )
    rows, _ = time_training(
        {"masked (assistant tokens)": Bench(tr), "unmasked (every token)": Bench(unmasked)},
        args.warmup,
        args.iters,
        args.repeats,
    )
    print_table(
        ["loss", "ms/iter (median)", "ms/iter (best)", "rounds (ms/iter)"],
        [[r.name, f"{r.ms_median:.1f}", f"{r.ms_best:.1f}", ", ".join(f"{t:.1f}" for t in r.round_ms)] for r in rows],
    )
    print(f"masked / unmasked step time: {rows[0].ms_median / rows[1].ms_median:.3f} (median ms/iter)")


def compare_rows(config: str, overrides: list, seconds: float) -> None:
    results = {}
    for rows in ("packed", "padded"):
        tr = trainer_for(config, [*overrides, ("data.chat_rows", rows)])
        steps, counted = train_for(tr, seconds)
        padded_eval = with_rows(tr, "padded")
        packed_eval = with_rows(tr, "packed")
        results[rows] = (steps, counted / steps, eval_metrics(padded_eval), eval_metrics(packed_eval))
    print_table(
        ["rows", "steps", "assistant tokens/step", "val loss (padded eval)", "val acc", "val loss (packed eval)"],
        [
            [name, f"{s}", f"{c:,.0f}", f"{p['val_loss']:.4f}", f"{p['val_acc']:.3f}", f"{q['val_loss']:.4f}"]
            for name, (s, c, p, q) in results.items()
        ],
    )


def train_for(tr: Trainer, seconds: float) -> tuple[int, int]:
    """Train until `seconds` have passed; returns (steps, assistant targets seen)."""
    it, counted, end = 0, 0, time.perf_counter() + seconds
    tr.model.train()
    while time.perf_counter() < end:
        set_lr(tr.optimizers, lr_multiplier(it, tr.cfg))
        counted += int((tr.batches.get("train", it)[1] >= 0).sum())
        train_step(tr, it)
        it += 1
    return it, counted


def with_rows(tr: Trainer, rows: str) -> Trainer:
    b = tr.batches
    return replace(
        tr, batches=BatchSource(b.dataset, b.block_size, b.batch_size, b.seed, b.device, prefetch=False, chat_rows=rows)
    )


MODE = Mode(
    "--chat",
    "chat fine-tuning: the masked loss's step time vs the unmasked one; --rows: packed vs padded rows",
    __doc__,
    add_arguments,
    run,
)
