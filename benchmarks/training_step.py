"""The training step, bench.py's default mode: the real trainer.train_step on the Trainer that train.py builds, timed:
ms/iter, tokens/s, MFU, peak memory, and the share of the tokens/s that this machine's matmul rate allows. --baseline
also times it with every optimisation off (eager, for-loop AdamW, fp32, batches built row by row, a host sync every
step), the two taking turns in one process, so that a machine whose speed drifts slows both alike. Times are the
median (and best) of --repeats rounds; the table ends with the load average. --json: one JSON line instead, what
bench.py --gpu reads.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from dataclasses import asdict, replace

import numpy as np
import torch

from benchmarks.common import CPU_PRESET, Bench, Mode, StepTiming, add_config, print_table, time_training, trainer_for
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.config import parse_overrides
from quillgpt.data import Batch, BatchSource
from quillgpt.metrics import matmul_flops
from quillgpt.precision import PRECISIONS
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


def run(args: argparse.Namespace, cli: list[str]) -> None:
    overrides = parse_overrides(with_shakespeare_input(cli))
    benches = {"optimised": Bench(trainer_for(args.config, overrides))}
    print(f"optimised: {describe(benches['optimised'].tr)}", flush=True)
    if args.baseline:
        benches["baseline (all off)"] = baseline_bench(args.config, overrides)
        print(f"baseline (all off): {describe(benches['baseline (all off)'].tr)}", flush=True)
    optimised = benches["optimised"]
    rows, ceilings = time_training(benches, args.warmup, args.iters, args.repeats, lambda: matmul_ceiling(optimised.tr))
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    mem = "max allocated (MB)" if optimised.tr.rt.device.type == "cuda" else "peak RSS (MB)"
    header = ["run", "ms/iter (median)", "ms/iter (best)", "tokens/s", "MFU", mem, "first step (s)"]
    cells = "{0.name}|{0.ms_median:.1f}|{0.ms_best:.1f}|{0.tokens_per_s:,.0f}|{0.mfu:.1%}|{0.peak_mb:,.0f}|"
    print_table(header, [(cells + "{0.first_step_s:.1f}").format(r).split("|") for r in rows])
    print_ceiling(optimised.tr, rows[0], ceilings)
    if args.baseline:
        print(f"speed-up over the baseline: {rows[1].ms_median / rows[0].ms_median:.2f}x (median ms/iter)")
    print(load_average())


MODE = Mode(None, "the training step (no mode flag): ms/iter, tokens/s, MFU", __doc__, add_arguments, run)


class LoopBatchSource(BatchSource):
    """nanoGPT's batch building for the baseline: a slice and a tensor per row, stacked in Python (BatchSource's start
    offsets, so the same batches; only the gathering differs)."""

    def _load(self, split: str, index: int) -> Batch:
        data = np.memmap(self.dataset.path(split), dtype=self.dataset.dtype, mode="r")
        T = self.block_size
        starts = self.starts(split, index)
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in starts])
        return Batch(x, y, None)


def baseline_bench(config: str, overrides: list[tuple[str, object]]) -> Bench:
    """The same Trainer with every optimisation off: BASELINE's overrides, batches built row by row without
    prefetching (the objective's batches, on a copy of it), and the loss read back after every step."""
    tr = trainer_for(config, overrides + BASELINE)
    objective, c = copy.copy(tr.objective), tr.cfg
    objective.batches = LoopBatchSource(
        tr.dataset, tr.block_size, c.training.batch_size, c.run.seed, tr.rt.device, prefetch=False
    )
    return Bench(replace(tr, objective=objective), sync_every_step=True)


def print_ceiling(tr: Trainer, row: StepTiming, ceilings: list[float]) -> None:
    """The share of the matmul ceiling the step reaches: each round's tokens/s over the ceiling measured just before
    it (the machine drifts between rounds), the median of those shares."""
    per_token = tr.raw_model.flops_per_token()
    shares = [tr.tokens_per_step / (ms / 1e3) / (ceiling / per_token) for ms, ceiling in zip(row.round_ms, ceilings)]
    flops = statistics.median(ceilings)
    spread = f"median of {len(ceilings)}, {min(ceilings) / 1e9:,.0f}-{max(ceilings) / 1e9:,.0f}, one before each round"
    span = f"{percent(min(shares))}-{percent(max(shares))}"
    share = f"{percent(statistics.median(shares))} of it (median over rounds; {span})"
    print(
        f"matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s ({tr.rt.precision}, MLP shape; {spread}) -> at most "
        f"{flops / per_token:,.0f} tokens/s at {per_token / 1e6:.1f} MFLOP/token; optimised runs at {share}"
    )


def percent(share: float) -> str:
    """A share as a percentage: whole numbers, two decimals below 1% (a tiny model's 0.31% is not 0%)."""
    return f"{100 * share:.0f}%" if share >= 0.01 else f"{100 * share:.2f}%"


def describe(tr: Trainer) -> str:
    rt = tr.rt
    threads = f", {torch.get_num_threads()} threads" if rt.device.type == "cpu" else ""
    return (
        f"{tr.raw_model.num_params() / 1e6:.2f}M parameters | {tr.tokens_per_step:,} tokens/step | "
        f"{rt.device} {rt.precision}{threads} | compile {'on' if rt.compile else 'off'}"
    )


def matmul_ceiling(tr: Trainer, repeats: int = 10) -> float:
    """FLOP/s of this machine's matmul at the model's MLP shape, (B*T, C) @ (C, 4C), in the training dtype: every
    training FLOP the model counts is a matmul, so flops_per_token over this rate bounds tokens/s."""
    rows, dtype = tr.cfg.training.batch_size * tr.block_size, PRECISIONS[tr.rt.precision]
    return matmul_flops(tr.raw_model.config.n_embd, rows, dtype, tr.rt.device, repeats)
