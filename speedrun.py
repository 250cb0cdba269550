"""Time to a target validation loss on tiny Shakespeare: the GPT-2-style CPU preset vs the modern recipe.

    python speedrun.py                       # cpu.toml vs speedrun_cpu.toml, target val loss 1.88
    python speedrun.py --target 1.9 --configs configs/shakespeare_char/speedrun_cpu.toml

Each preset trains in its own train.py process: the real training loop, unchanged, evaluating
every --eval-interval steps with the preset's eval_iters. The clock starts when train.py
has finished its start-up (the `run:` line, just before the first evaluation) and stops at the
first evaluation whose val loss is <= --target, so it counts compilation, every training step
and every evaluation up to that point; the run is then stopped (SIGTERM: train.py saves and
exits). Checkpoints are written only at the end and the loss plot is off, so neither run pays
for them. Timings are wall-clock on a possibly shared machine: run it when the machine is quiet,
or --repeats N and read the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import UserError, format_duration, load_average, run_main, with_shakespeare_input

REPO = Path(__file__).resolve().parent
CONFIGS = ["configs/shakespeare_char/cpu.toml", "configs/shakespeare_char/speedrun_cpu.toml"]
EVAL_LINE = re.compile(r"^eval (\d+): train [\d.]+ \| val ([\d.]+)")


@dataclass
class Crossing:
    config: str
    seconds: float | None  # wall time to the first eval at or below the target; None if never reached
    iters: int  # the step of that eval, or the last one evaluated
    val_loss: float  # that eval's val loss, or the best one seen
    total_seconds: float  # time of the last eval read


def time_to_target(config: str, target: float, eval_interval: int, extra: list[str], out_dir: str) -> Crossing:
    """Run train.py on `config` and time the first evaluation with val loss <= target."""
    name = Path(config).stem
    cmd = [sys.executable, "train.py", "--config", config, "--run.out_dir", out_dir, "--run.name", name, "--force",
           "--training.eval_interval", str(eval_interval), "--training.save_interval", "0",
           "--training.save_best", "false", "--logging.plot", "false", "--logging.json_log", "false", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    start, best, last_iter, last_time, tail = None, float("inf"), 0, 0.0, []
    try:
        for line in proc.stdout:
            now = time.perf_counter()
            tail = (tail + [line.rstrip()])[-5:]
            if start is None and line.startswith("run: "):
                start = now
            match = EVAL_LINE.match(line)
            if match is None or start is None:
                continue
            last_iter, val, last_time = int(match[1]), float(match[2]), now - start
            print(f"  {name}: {format_duration(last_time)} ({last_time:.1f}s) iter {last_iter} val {val:.4f}", flush=True)
            if val <= target:
                proc.send_signal(signal.SIGTERM)  # train.py finishes the step, saves and exits
                proc.wait()
                return Crossing(config, last_time, last_iter, val, last_time)
            best = min(best, val)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode:
        raise UserError(f"train.py --config {config} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return Crossing(config, None, last_iter, best, last_time)


def print_table(results: dict[str, list[Crossing]], target: float) -> None:
    print(f"| config | time to val loss <= {target} | at iter | val loss |")
    print("| --- | ---: | ---: | ---: |")
    for config, runs in results.items():
        times = [r.seconds for r in runs if r.seconds is not None]
        if len(times) < len(runs):
            last = runs[-1]
            print(f"| {config} | not reached in {last.total_seconds:.1f}s | {last.iters} | best {last.val_loss:.4f} |")
            continue
        spread = f" (runs: {', '.join(f'{t:.1f}' for t in times)})" if len(times) > 1 else ""
        print(f"| {config} | {statistics.median(times):.1f}s{spread} | {runs[-1].iters} | {runs[-1].val_loss:.4f} |")


def ratio_line(results: dict[str, list[Crossing]]) -> str:
    (base, base_runs), (fast, fast_runs) = list(results.items())[:2]
    fast_times = [r.seconds for r in fast_runs]
    if None in fast_times:
        return f"{fast} did not reach the target"
    fast_t = statistics.median(fast_times)
    base_times = [r.seconds for r in base_runs]
    if None in base_times:  # the baseline's whole run bounds its time to the target from below
        bound = min(r.total_seconds for r in base_runs)
        return f"{fast} / {base}: < {fast_t / bound:.2f} ({base} never reached the target; its full run took {bound:.1f}s)"
    base_t = statistics.median(base_times)
    return f"{fast} / {base}: {fast_t:.1f}s / {base_t:.1f}s = {fast_t / base_t:.2f} of the wall time ({base_t / fast_t:.2f}x faster)"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other --section.key value pair is passed to every train.py run.")
    p.add_argument("--configs", nargs="+", default=CONFIGS, help="presets to time; the ratio compares the second to the first")
    p.add_argument("--target", type=float, default=1.88, help="val loss to reach")
    p.add_argument("--eval-interval", type=int, default=50, help="evaluate every this many steps (both runs)")
    p.add_argument("--repeats", type=int, default=1, help="runs per preset; medians are reported")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    extra = with_shakespeare_input(extra)  # prepare tiny Shakespeare offline if needed
    results: dict[str, list[Crossing]] = {}
    with tempfile.TemporaryDirectory(prefix="speedrun_") as out_dir:
        for _ in range(args.repeats):
            for config in args.configs:
                print(f"{config}:", flush=True)
                results.setdefault(config, []).append(time_to_target(config, args.target, args.eval_interval, extra, out_dir))
    print_table(results, args.target)
    if len(results) > 1:
        print(ratio_line(results))
    print(load_average())
    return 0


if __name__ == "__main__":
    run_main(main)
