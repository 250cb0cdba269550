"""--muon: milliseconds per Muon step on the speedrun preset's real gradients: torch.optim.Muon (one Newton-Schulz
chain per matrix) against optim.Muon (one per shape), and each one's share of the measured training step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import REPO, Bench, Mode, add_config, print_table, time_training, trainer_for
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.config import parse_overrides
from quillgpt.errors import UserError
from quillgpt.optim import Muon

SPEEDRUN_PRESET = REPO / "configs" / "shakespeare_char" / "speedrun_cpu.toml"
WARMUP_STEPS, ROUNDS, STEPS = 3, 3, 20  # each optimizer: untimed steps, then the median of ROUNDS timings of STEPS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, SPEEDRUN_PRESET)
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="untimed training steps first, the first one compiling (default %(default)s)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed training steps per repeat (default %(default)s)")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed repeats of the training step; the median is reported (default %(default)s)",
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    bench = Bench(trainer_for(args.config, parse_overrides(with_shakespeare_input(cli))))
    tr = bench.tr
    ours = tr.optimizers[0]
    if not isinstance(ours, Muon):
        raise UserError("--muon needs optimizer.name = 'muon' (the default config is the speedrun preset)")
    (step,), _ = time_training({"training step": bench}, args.warmup, args.iters, args.repeats)
    x, y, _ = tr.batches.get("train", 0)
    with tr.rt.autocast:
        _, loss = tr.model(x, y)
    loss.backward()
    params = [p for g in ours.param_groups for p in g["params"]]
    group = ours.param_groups[0]
    theirs = torch.optim.Muon(
        params,
        lr=group["lr"],
        momentum=group["momentum"],
        weight_decay=group["weight_decay"],
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    shapes = {tuple(p.shape) for p in params}
    print(
        f"Muon on {len(params)} matrices of {len(shapes)} shapes; training step "
        f"{step.ms_median:.1f} ms (median), {torch.get_num_threads()} threads"
    )
    rows = []
    for name, opt in (("torch.optim.Muon (a chain per matrix)", theirs), ("optim.Muon (a chain per shape)", ours)):
        ms = optimizer_step_ms(opt)
        rows.append([name, f"{ms:.2f}", f"{ms / step.ms_median:.1%}"])
    print_table(["Muon", f"ms per step (median of {ROUNDS} x {STEPS})", "share of the training step"], rows)
    print(load_average())


MODE = Mode(
    "--muon", "Muon's step, per matrix against batched per shape (the speedrun preset)", __doc__, add_arguments, run
)


def optimizer_step_ms(opt: torch.optim.Optimizer) -> float:
    """Milliseconds per step() on the gradients in place."""
    for _ in range(WARMUP_STEPS):
        opt.step()
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            opt.step()
        times.append((time.perf_counter() - t0) / STEPS * 1e3)
    return statistics.median(times)
