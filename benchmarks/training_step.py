"""The training step, bench.py's default mode: the real trainer.train_step on the Trainer that train.py builds
(quillgpt.trainer.build), timed: ms/iter, tokens/s, MFU, peak memory, and the share of the tokens/s that this
machine's matmul rate allows.

--baseline also times the same model with every optimisation off: eager, for-loop AdamW (no fused or foreach
kernel), fp32, batches built row by row in Python without prefetching, and a host sync (loss.item()) every step.
Both live in one process and take turns, --repeats rounds of --iters steps each, so a machine whose speed drifts
slows both alike (peak RSS is then the process's). Every time is the median (and best) of the rounds, and the table
ends with the load average; above the core count means someone else was computing at the same time.

--json prints the measurements as one JSON line instead of the table: what --against, --memory and --finetune read
from the bench.py they run as a child. --profile also writes a torch profiler trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    CPU_PRESET,
    Bench,
    Mode,
    StepTiming,
    add_config,
    describe,
    matmul_ceiling,
    print_table,
    run_steps,
    synchronize,
    time_training,
    trainer_for,
)
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.config import parse_overrides
from quillgpt.data import Batch, BatchSource
from quillgpt.files import atomic_write
from quillgpt.trainer import Trainer

# the all-off baseline: the same model eager, fp32, with a for-loop AdamW
BASELINE = [("training.compile", False), ("optimizer.fused", False), ("training.precision", "fp32")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, CPU_PRESET)
    p.add_argument("--baseline", action="store_true", help="also run with every optimisation off and print the ratio")
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first, the first one compiling (default %(default)s)"
    )
    p.add_argument("--iters", type=int, default=50, help="timed steps per repeat (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON line instead of a table")
    p.add_argument(
        "--profile",
        nargs="?",
        const="bench_out",
        default=None,
        metavar="DIR",
        help="write a torch profiler chrome trace to DIR/trace.json (default bench_out)",
    )
    p.add_argument(
        "--profile-steps", type=int, default=5, help="optimizer steps under the profiler (default %(default)s)"
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    overrides = parse_overrides(with_shakespeare_input(cli))
    benches = {"optimised": Bench(trainer_for(args.config, overrides))}
    print(f"optimised: {describe(benches['optimised'].tr)}", flush=True)
    if args.baseline:
        benches["baseline (all off)"] = baseline_bench(args.config, overrides)
        print(f"baseline (all off): {describe(benches['baseline (all off)'].tr)}", flush=True)
    optimised = benches["optimised"]
    rows, ceilings = time_training(benches, args.warmup, args.iters, args.repeats, lambda: matmul_ceiling(optimised.tr))
    if args.profile:
        path = profile_training(
            optimised, Path(args.profile), args.profile_steps, args.warmup + args.iters * args.repeats
        )
        print(f"profiler trace: {path}")
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    print_training_table(rows, optimised.tr.rt.device)
    print_ceiling(optimised.tr, rows[0], ceilings)
    if args.baseline:
        print(f"speed-up over the baseline: {rows[1].ms_median / rows[0].ms_median:.2f}x (median ms/iter)")
    print(load_average())


MODE = Mode(None, "the training step (no mode flag): ms/iter, tokens/s, MFU", __doc__, add_arguments, run)


class LoopBatchSource(BatchSource):
    """nanoGPT's batch building for the baseline: a slice and a tensor per row, stacked in Python.

    The same start offsets as BatchSource, so the same batches; only the gathering differs."""

    def _load(self, split: str, index: int) -> Batch:
        data = np.memmap(self.dataset.path(split), dtype=self.dataset.dtype, mode="r")
        T = self.block_size
        starts = self.starts(split, index)
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in starts])
        return Batch(x, y, None)


def baseline_bench(config: str, overrides: list[tuple[str, object]]) -> Bench:
    """The same Trainer with every optimisation off: BASELINE's overrides, batches built row by row without
    prefetching, and the loss read back after every step."""
    tr = trainer_for(config, overrides + BASELINE)
    batches = LoopBatchSource(
        tr.dataset,
        tr.raw_model.config.block_size,
        tr.cfg.training.batch_size,
        tr.cfg.run.seed,
        tr.rt.device,
        prefetch=False,
    )
    return Bench(replace(tr, batches=batches), sync_every_step=True)


def profile_training(b: Bench, out_dir: Path, steps: int, start: int) -> Path:
    """A torch profiler trace of `steps` optimizer steps (open it in chrome://tracing or ui.perfetto.dev)."""
    from torch.profiler import ProfilerActivity, profile

    device = b.tr.rt.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_steps(b, start, steps)
        synchronize(device)
    path = out_dir / "trace.json"
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes a file itself: move it in atomically
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with atomic_write(path) as f:
            f.write(Path(tmp, "trace.json").read_bytes())
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15))
    return path


def print_training_table(rows: list[StepTiming], device: torch.device) -> None:
    mem = "max allocated (MB)" if device.type == "cuda" else "peak RSS (MB)"
    print_table(
        ["run", "ms/iter (median)", "ms/iter (best)", "tokens/s", "MFU", mem, "first step (s)"],
        [
            [
                r.name,
                f"{r.ms_median:.1f}",
                f"{r.ms_best:.1f}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.mfu * 100:.1f}%",
                f"{r.peak_mb:,.0f}",
                f"{r.first_step_s:.1f}",
            ]
            for r in rows
        ],
    )


def print_ceiling(tr: Trainer, row: StepTiming, ceilings: list[float]) -> None:
    """The share of the matmul ceiling the step reaches: each round's tokens/s over the ceiling measured just before
    it (the machine drifts between rounds), the median of those shares."""
    per_token = tr.raw_model.flops_per_token()
    shares = [tr.tokens_per_step / (ms / 1e3) / (ceiling / per_token) for ms, ceiling in zip(row.round_ms, ceilings)]
    flops = statistics.median(ceilings)
    print(
        f"matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s ({tr.rt.precision}, MLP shape; median of "
        f"{len(ceilings)}, {min(ceilings) / 1e9:,.0f}-{max(ceilings) / 1e9:,.0f}, one before each round) -> at most "
        f"{flops / per_token:,.0f} tokens/s at {per_token / 1e6:.1f} MFLOP/token; optimised runs at "
        f"{percent(statistics.median(shares))} of it (median over rounds; {percent(min(shares))}-"
        f"{percent(max(shares))})"
    )


def percent(share: float) -> str:
    """A share as a percentage: whole numbers, two decimals below 1% (a tiny model's 0.31% is not 0%)."""
    return f"{100 * share:.0f}%" if share >= 0.01 else f"{100 * share:.2f}%"
