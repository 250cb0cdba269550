"""Wall time to validation-loss rungs on tiny Shakespeare (1.88, 1.70, 1.55, 1.47), per preset, variant and seed.

    python speedrun.py                        # cpu.toml, speedrun_cpu.toml and record_cpu.toml, seed 1337
    python speedrun.py --configs configs/shakespeare_char/record_cpu.toml --seeds 1337 1338 1339 --keep checkpoints/record
    python speedrun.py --isa avx2 --configs configs/shakespeare_char/record_cpu.toml --seeds 1337   # an AVX2-only CPU's path
    python speedrun.py --configs configs/shakespeare_char/record_cpu.toml --budget-minutes 4 \\
        --variant "dropout 0=--model.dropout 0" --variant "dropout 0.2=--model.dropout 0.2"       # a sweep

Each run is its own train.py process: the real training loop, unchanged. The clock starts when the process
is launched, so it counts start-up, compilation, every step and every evaluation. A rung's time is that of
the first in-run evaluation (the preset's eval_iters batches, or --eval-interval) at or below it. The run
goes on to max_iters, where train.py evaluates --final-batches fixed val batches (training.final_eval_iters):
that final val loss is the figure that counts, and its wall time must fit the budget.

The budget is --budget-minutes on a machine whose matmuls, in the precision the run uses (a preset's auto: the
faster of bf16 and fp32 here), run at 800 GFLOP/s or more; a slower one gets it scaled by the rate measured here
just before each run (printed beside the times, with its precision): half as fast, twice the time. A faster one
gets the stated minutes, not fewer (a CPU with AMX tiles runs bf16 matmuls several times past 800 at this shape,
but only its matmuls run that much faster). A run
still going at its budget is stopped (SIGTERM) and reported as over budget. Checkpoints are written only
at the end and the loss plot is off. Run it on an otherwise idle machine; --seeds gives the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.conditions import ISA_ENV, load_average, run_on_isa, with_shakespeare_input
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.errors import UserError, run_main
from quillgpt.metrics import matmul_ceiling

REPO = Path(__file__).resolve().parent
CONFIGS = [
    "configs/shakespeare_char/cpu.toml",
    "configs/shakespeare_char/speedrun_cpu.toml",
    "configs/shakespeare_char/record_cpu.toml",
]
TARGETS = [1.88, 1.70, 1.55, 1.47]
REFERENCE_GFLOPS = 800.0  # the machine the budget is stated for
EVAL_LINE = re.compile(r"^eval (\d+)(?: \(assistant tokens\))?: train [\d.]+ \| val ([\d.]+)")


@dataclass
class Run:
    config: str
    variant: str
    seed: int
    gflops: float  # matmul rate measured just before the run, in its precision
    budget: float  # seconds
    rungs: dict[float, tuple[float, int]] = field(
        default_factory=dict
    )  # target -> (seconds, iter) of the first eval at or below it
    final_val: float | None = None  # the evaluation at max_iters (over final_eval_iters batches)
    final_iter: int = 0
    seconds: float = 0.0  # wall time to the final evaluation, or to the last one read
    best_val: float = float("inf")  # best val loss of any evaluation
    over_budget: bool = False
    precision: str = "bf16"  # the precision the run trains in, whose matmul rate scales its budget


def budget_seconds(minutes: float, gflops: float) -> float:
    """The wall-time budget on a machine whose matmuls measured `gflops`: `minutes` at 800 GFLOP/s or more,
    scaled up on a slower machine."""
    return minutes * 60 * max(1.0, REFERENCE_GFLOPS / gflops)


def run_precision(config: str, cli: list[str]) -> str:
    """training.precision as the run's config and overrides set it (auto, fp32, bf16...)."""
    return build_config(load_toml(config), parse_overrides(cli), source=config).training.precision


def run_once(
    config: str, variant: tuple[str, list[str]], seed: int, args: argparse.Namespace, extra: list[str], out_dir: str
) -> Run:
    """One train.py run, timed from launch; its rungs, final val loss and wall time."""
    flops, precision = matmul_ceiling(run_precision(config, [*variant[1], *extra]))
    gflops = flops / 1e9
    run = Run(config, variant[0], seed, gflops, budget_seconds(args.budget_minutes, gflops), precision=precision)
    name = "-".join([Path(config).stem, str(seed), *re.findall(r"[\w.]+", variant[0])])
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        config,
        "--run.out_dir",
        out_dir,
        "--run.name",
        name,
        "--force",
        "--run.seed",
        str(seed),
        "--training.final_eval_iters",
        str(args.final_batches),
        "--training.save_interval",
        "0",
        "--training.save_best",
        "false",
        "--logging.plot",
        "false",
        "--logging.json_log",
        "false",
        "--training.keep_decoding_step",  # a race ends at its final evaluation: no decoding step compiled after it
        "false",
        *(["--training.eval_interval", str(args.eval_interval)] if args.eval_interval else []),
        *extra,
        *variant[1],
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail, last = [], None
    try:
        for line in proc.stdout:
            now = time.perf_counter() - start
            tail = (tail + [line.rstrip()])[-5:]
            if now > run.budget and not run.over_budget:
                run.over_budget = True
                proc.send_signal(signal.SIGTERM)  # train.py finishes the step, saves and exits
            if (m := EVAL_LINE.match(line)) is None:
                continue
            it, val = int(m[1]), float(m[2])
            run.seconds, run.best_val, last = now, min(run.best_val, val), (val, it)
            for target in args.targets:
                if val <= target and target not in run.rungs:
                    run.rungs[target] = (now, it)
            print(f"  {run.variant or name}: {now:.1f}s iter {it} val {val:.4f}", flush=True)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode and not run.over_budget:
        raise UserError(f"train.py --config {config} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    if not run.over_budget and last is not None:  # train.py ended at max_iters: its last evaluation is the final one
        run.final_val, run.final_iter = last
    return run


def cell(run: Run, target: float) -> str:
    if target in run.rungs:
        seconds, it = run.rungs[target]
        return f"{seconds:.1f}s @{it}"
    return "—"


def print_runs(runs: list[Run], targets: list[float], final_batches: int) -> None:
    print(
        f"| config | variant | seed | {' | '.join(f'to {t}' for t in targets)} | final val ({final_batches} batches) "
        f"| wall | budget (matmul rate) |"
    )
    print("| --- | --- | ---: |" + " ---: |" * len(targets) + " ---: | ---: | ---: |")
    for r in runs:
        final = (
            f"{r.final_val:.4f} @{r.final_iter}" if r.final_val is not None else f"over budget (best {r.best_val:.4f})"
        )
        print(
            f"| {Path(r.config).name} | {r.variant or '-'} | {r.seed} | {' | '.join(cell(r, t) for t in targets)} | "
            f"{final} | {r.seconds:.1f}s | {r.budget:.0f}s ({r.gflops:,.0f} GFLOP/s {r.precision}) |"
        )


def median_rung(runs: list[Run], target: float) -> float | None:
    times = [r.rungs[target][0] for r in runs if target in r.rungs]
    return statistics.median(times) if len(times) == len(runs) else None


def ratio_line(runs: list[Run], target: float) -> str:
    """The second config against the first (both over their seeds) at `target`."""
    configs = list(dict.fromkeys(r.config for r in runs))[:2]
    base, fast = ([r for r in runs if r.config == c] for c in configs)
    fast_t, base_t = median_rung(fast, target), median_rung(base, target)
    if fast_t is None:
        return f"{configs[1]} did not reach {target}"
    if base_t is None:  # the baseline's whole run bounds its time to the target from below
        bound = min(r.seconds for r in base)
        return (
            f"{configs[1]} / {configs[0]} to {target}: < {fast_t / bound:.2f} ({configs[0]} never reached it; "
            f"its full run took {bound:.1f}s)"
        )
    return (
        f"{configs[1]} / {configs[0]} to {target}: {fast_t:.1f}s / {base_t:.1f}s = {fast_t / base_t:.2f} of the "
        f"wall time ({base_t / fast_t:.2f}x faster)"
    )


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name.strip():
        raise UserError(f"--variant {text!r}: expected NAME=--section.key value ...")
    return name.strip(), overrides.split()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --section.key value pair is passed to every train.py run.",
    )
    # Lists take both `--x a b` and `--x a --x b` (extend: a repeated flag adds to the list, never replaces it); their
    # defaults are filled in after parsing, as extend would add to a default list rather than replace it.
    p.add_argument(
        "--configs",
        nargs="+",
        action="extend",
        help="presets to time; the ratio compares the second to the first (default: " + ", ".join(CONFIGS) + ")",
    )
    p.add_argument(
        "--targets",
        "--target",
        nargs="+",
        action="extend",
        type=float,
        help="val losses to time (rungs; default: " + " ".join(map(str, TARGETS)) + ")",
    )
    p.add_argument("--seeds", nargs="+", action="extend", type=int, help="one run per seed (run.seed; default: 1337)")
    p.add_argument(
        "--variant",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=OVERRIDES",
        help="sweep points: overrides applied to every config (default: the presets as they are)",
    )
    p.add_argument(
        "--eval-interval", type=int, default=None, help="evaluate every this many steps (default: the preset's)"
    )
    p.add_argument("--final-batches", type=int, default=200, help="val batches of the evaluation at max_iters")
    p.add_argument(
        "--keep",
        metavar="DIR",
        default=None,
        help="keep each run's directory (final checkpoint) under DIR, named <preset>-<seed>[-<variant>] "
        "(default: a temporary directory, removed)",
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=10.0,
        help="wall-time budget on a machine whose matmuls, in the run's precision, run at 800 GFLOP/s or more, "
        "scaled up on a slower one",
    )
    p.add_argument(
        "--isa",
        choices=list(ISA_ENV),
        default="native",
        help="run everything (the rate behind each budget too) on this CPU path: avx2 caps oneDNN, MKL and ATen at "
        "AVX2, where bf16 is emulated as on most laptops",
    )
    args, extra = p.parse_known_args(argv)
    args.configs, args.targets, args.seeds = args.configs or CONFIGS, args.targets or TARGETS, args.seeds or [1337]
    return args, extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_args(argv)
    if args.isa != "native" and (code := run_on_isa(args.isa, __file__, argv)) is not None:
        return code
    variants = [parse_variant(v) for v in args.variant] or [("", [])]
    extra = with_shakespeare_input(extra)  # prepare tiny Shakespeare offline if needed
    runs: list[Run] = []
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="speedrun_") as out_dir:
        for seed in args.seeds:
            for variant in variants:
                for config in args.configs:
                    print(f"{config} {variant[0]} seed {seed}:", flush=True)
                    runs.append(run_once(config, variant, seed, args, extra, out_dir))
    print_runs(runs, args.targets, args.final_batches)
    if len(args.configs) > 1:
        print(ratio_line(runs, args.targets[0]))
    print(load_average())
    return 0


if __name__ == "__main__":
    run_main(main)
