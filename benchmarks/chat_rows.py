"""--chat: chat fine-tuning's measurements.

On conversations generated here ("What is a + b?" -> the sum, some with a system message or a second exchange),
prepared with prepare.py --chat's pipeline (char + ChatML), with the model of MODEL:
- the masked loss against the unmasked one: the same model and batches, the targets outside the assistant's tokens
  -1 (the loss counts the assistant's tokens) or all real (the batch's every token); the training step's ms/iter in
  turns (bench.py's default mode's method), and their ratio;
- --attention: what keeping the conversations of packed rows apart costs. The attention of packed rows (real ones,
  their conversations' positions) through SDPA with the document mask, through FlexAttention, and the causal
  attention of unpacked rows (kernels.py's CPU path), forward and backward, in fp32 and bf16, eager and compiled,
  in turns; then the whole training step on packed rows against padded ones.

On the CPU chat demo (configs/chat/base_chat.toml: the Quickstart's model, checkpoints/base, fine-tuned on
tasks.py's conversations of up to 3 turns, 20,000 of them):
- --rows SECONDS: rows "padded" (one conversation's targets), "packed" (whole conversations back to back, each
  attending only within itself) and the packing before isolation (the same rows, every conversation attending to
  the ones before it), each trained for SECONDS of its own step time from the base model, one step each in turn (so
  every arm meets the same moments of a shared machine's load); then each one's val loss and accuracy over the
  assistant's tokens on padded rows (a conversation from position 0, as chat.py sees it), and its accuracy on the
  held-out task items (eval.py --chat-task's greedy answers).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import CPU_PRESET, REPO, Bench, Mode, describe, print_table, time_training, trainer_for
from benchmarks.conditions import load_average
from model import DocumentMask
from quillgpt import tasks
from quillgpt.config import parse_overrides
from quillgpt.data import BatchSource
from quillgpt.errors import UserError
from quillgpt.evaluate import run_chat_tasks
from quillgpt.files import atomic_write_text
from quillgpt.kernels import causal_attention
from quillgpt.optim import lr_multiplier, set_lr
from quillgpt.trainer import Trainer, eval_metrics, train_step

DEMO = REPO / "configs" / "chat" / "base_chat.toml"

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
        "--attention",
        action="store_true",
        help="also time packed rows' attention (SDPA + document mask, FlexAttention) and training step",
    )
    p.add_argument(
        "--rows",
        type=float,
        metavar="SECONDS",
        help="also train the chat demo on padded, packed and unisolated packed rows for SECONDS each and compare",
    )
    p.add_argument("--init-from", default="checkpoints/base", help="--rows: the base model (default %(default)s)")
    p.add_argument("--chat-items", type=int, default=100, help="--rows: held-out items per task (default %(default)s)")
    p.add_argument("--eval-batches", type=int, default=50, help="--rows: val batches (default %(default)s)")


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
        if args.attention:
            time_packed_attention(masked, args)
            time_packed_step(str(CPU_PRESET), overrides, args)
        if args.rows:
            compare_rows(demo_overrides(Path(tmp), args.init_from, args.conversations, cli), args)
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


# ---- the attention of packed rows ------------------------------------------------------------------


def time_packed_attention(tr: Trainer, args: argparse.Namespace) -> None:
    """Attention alone at the model's shape, on the positions of a real batch of packed rows: forward and backward
    (training) and forward alone (evaluation), ms per call, medians over args.repeats rounds taken in turns."""
    c, B = tr.raw_model.config, tr.cfg.training.batch_size
    positions = with_rows(tr, "packed").batches.get("train", 0).positions
    print(
        f"attention: ({B}, {c.n_head}, {c.block_size}, {c.head_width}), packed rows of "
        f"{(positions == 0).sum().item() / B:.1f} conversations on average",
        flush=True,
    )
    masks = {"sdpa": DocumentMask(positions, flex=False), "flex": DocumentMask(positions, flex=True)}
    cases = []
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q, k, v = (torch.randn(B, c.n_head, c.block_size, c.head_width, dtype=dtype) for _ in range(3))
        calls = {
            "causal, unpacked rows (kernels.py)": lambda q, k, v: causal_attention(q, k, v, 0.0, True),
            "SDPA + document mask": lambda q, k, v: masks["sdpa"].attend(q, k, v, 0.0),
            "FlexAttention": lambda q, k, v: masks["flex"].attend(q, k, v, 0.0),
        }
        for compiled in (False, True):
            for name, call in calls.items():
                run = torch.compile(call) if compiled else call
                label = f"{name}, {precision}, {'compiled' if compiled else 'eager'}"
                cases.append((label, attention_case(run, q, k, v, backward=True), attention_case(run, q, k, v)))
    times = {label: ([], []) for label, *_ in cases}
    for _ in range(args.repeats):  # in turns: every case meets the same moments of the machine's load
        for label, *timers in cases:
            for timer, into in zip(timers, times[label]):
                into.append(timer() if timer else float("nan"))
    print_table(
        ["attention", "forward + backward, ms", "forward, ms"],
        [[label, *(cell(t) for t in both)] for label, both in times.items()],
    )


def cell(ms: list[float]) -> str:
    return "no backward on the CPU" if np.isnan(ms).all() else f"{np.median(ms):.2f}"


def attention_case(call, q, k, v, backward: bool = False, iters: int = 5):
    """A timer of `iters` calls (returns ms per call), warmed up; None where torch cannot run it (FlexAttention has
    no backward on the CPU)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    grad = torch.randn_like(q)

    def once() -> None:
        with torch.set_grad_enabled(backward), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention on the CPU warns that it is unfused
            y = call(q, k, v)
            if backward:
                y.backward(grad)

    try:
        once(), once()
    except NotImplementedError:
        return None

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        return (time.perf_counter() - t0) / iters * 1e3

    return timed


def time_packed_step(config: str, overrides: list, args: argparse.Namespace) -> None:
    """The whole training step on packed rows (SDPA + document mask) against padded rows (kernels.py's causal
    path): the same model and batch size, in turns."""
    benches = {
        f"{rows} rows": Bench(trainer_for(config, [*overrides, ("data.chat_rows", rows)]))
        for rows in ("padded", "packed")
    }
    timings, _ = time_training(benches, args.warmup, args.iters, args.repeats)
    print_table(
        ["rows", "ms/iter (median)", "ms/iter (best)", "rounds (ms/iter)"],
        [
            [r.name, f"{r.ms_median:.1f}", f"{r.ms_best:.1f}", ", ".join(f"{t:.1f}" for t in r.round_ms)]
            for r in timings
        ],
    )
    print(f"packed / padded step time: {timings[1].ms_median / timings[0].ms_median:.3f} (median ms/iter)")


# ---- packed against padded rows on the chat demo -----------------------------------------------------


class UnisolatedBatchSource(BatchSource):
    """Packed rows as they were before isolation: every conversation of a row attends to the ones before it, at the
    positions it has in the row (the model gets no positions)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.isolated = False


ARMS = {"padded": "padded", "packed": "packed", "packed, unisolated (before)": "packed"}


def demo_overrides(tmp: Path, init_from: str, n: int, cli: list[str]) -> list:
    """The chat demo's overrides: n of tasks.py's conversations (up to 3 turns) written to tmp, from init_from."""
    if not Path(init_from).exists():
        raise UserError(
            f"--rows fine-tunes the chat demo's base model, {init_from}, which is missing: train it with python "
            "train.py --config configs/base/base.toml (about 1.5 minutes on 2 cores), or name one with --init-from"
        )
    source = tmp / "chat_tasks.jsonl"
    conversations = tasks.conversations(list(tasks.TASKS), "train", n, 0, 3)
    atomic_write_text(source, "".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return [
        ("data.dataset", "chat_tasks"),
        ("data.data_dir", str(tmp / "demo")),
        ("data.input", str(source)),
        ("run.init_from", init_from),
        *parse_overrides(cli),
    ]


def compare_rows(overrides: list, args: argparse.Namespace) -> None:
    trainers = {}
    for name, rows in ARMS.items():
        tr = trainer_for(str(DEMO), [*overrides, ("data.chat_rows", rows)])
        overrides = [*overrides, ("training.precision", tr.rt.precision)]  # auto decides once, for every arm
        trainers[name] = unisolated(tr) if "unisolated" in name else tr
    print(f"chat demo: {describe(trainers['padded'])}", flush=True)
    steps = train_in_turns(trainers, args.rows)
    table = []
    for name, tr in trainers.items():
        metrics = eval_metrics(with_rows(tr, "padded"), args.eval_batches)
        tr.raw_model.eval()
        graded = run_chat_tasks(tr.raw_model, tr.dataset.tokenizer, list(tasks.TASKS), args.chat_items)["tasks"]
        counted = [int((tr.batches.get("train", i).y >= 0).sum()) for i in range(min(steps[name], 200))]
        table.append(
            [
                name,
                f"{steps[name]}",
                f"{np.mean(counted):,.0f}",
                f"{metrics['val_loss']:.4f}",
                f"{metrics['val_acc']:.3f}",
                *(f"{graded[t]['correct']}/{graded[t]['items']}" for t in tasks.TASKS),
            ]
        )
    print(f"each arm trained for {args.rows:g} s of its own step time, one step each in turn")
    print_table(
        ["rows", "steps", "assistant tokens/step", "val loss", "val acc", *(f"held-out {t}" for t in tasks.TASKS)],
        table,
    )


def train_in_turns(trainers: dict[str, Trainer], seconds: float) -> dict[str, int]:
    """Train each for `seconds` of its own step time (loading its batches included), one step each in turn; returns
    the steps each made."""
    spent, steps = dict.fromkeys(trainers, 0.0), dict.fromkeys(trainers, 0)
    for tr in trainers.values():
        tr.model.train()
    while active := [name for name in trainers if spent[name] < seconds]:
        for name in active:
            tr = trainers[name]
            set_lr(tr.optimizers, lr_multiplier(steps[name], tr.cfg))
            t0 = time.perf_counter()
            train_step(tr, steps[name])
            spent[name] += time.perf_counter() - t0
            steps[name] += 1
    return steps


def unisolated(tr: Trainer) -> Trainer:
    b = tr.batches
    return replace(
        tr, batches=UnisolatedBatchSource(b.dataset, b.block_size, b.batch_size, b.seed, b.device, chat_rows="packed")
    )


def with_rows(tr: Trainer, rows: str) -> Trainer:
    b = tr.batches
    return replace(
        tr, batches=BatchSource(b.dataset, b.block_size, b.batch_size, b.seed, b.device, prefetch=False, chat_rows=rows)
    )


MODE = Mode(
    "--chat",
    "chat fine-tuning: the masked loss's step time vs the unmasked one; --attention: packed rows' attention; --rows: "
    "packed vs padded rows on the chat demo",
    __doc__,
    add_arguments,
    run,
)
