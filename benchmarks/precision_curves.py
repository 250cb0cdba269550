"""--precision-curves: the same training run in fp32 and in bf16 autocast (real train.py runs, one after the
other), and the two val-loss sequences side by side with each run's training speed.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import GPU_PRESET, REPO, Mode, add_config, print_table
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--iters", type=int, default=300, help="training steps of each run (default %(default)s)")
    p.add_argument("--eval-interval", type=int, default=25, help="evaluate every this many steps (default %(default)s)")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    cli = with_shakespeare_input(cli)
    curves, speed = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        for precision in ("fp32", "bf16"):
            history = train_and_read_history(args, cli, precision, Path(tmp))
            curves[precision] = {p["iter"]: p["val_loss"] for p in history if p["kind"] == "eval"}
            speed[precision] = statistics.median(p["tokens_per_s"] for p in history if p["kind"] == "train")
    print(f"val loss, fp32 vs bf16 autocast: {args.config} {' '.join(cli)}")
    rows = []
    for it, fp32 in curves["fp32"].items():
        bf16 = curves["bf16"].get(it, float("nan"))
        rows.append([str(it), f"{fp32:.4f}", f"{bf16:.4f}", f"{bf16 - fp32:+.4f}"])
    print_table(["iter", "fp32", "bf16", "bf16 - fp32"], rows, left=0)
    print(
        f"training speed (median of the logged steps): fp32 {speed['fp32']:,.0f} tokens/s, "
        f"bf16 {speed['bf16']:,.0f} tokens/s"
    )
    print(load_average())


MODE = Mode("--precision-curves", "val loss of fp32 against bf16 training runs (train.py)", __doc__, add_arguments, run)


def train_and_read_history(args: argparse.Namespace, cli: list[str], precision: str, out_dir: Path) -> list[dict]:
    """One train.py run in `precision` under out_dir; its train_log.json's history."""
    overrides = [
        *("--training.max_iters", str(args.iters)),
        *("--training.eval_interval", str(args.eval_interval)),
        *("--training.eval_iters", "20"),
        *("--training.log_interval", str(args.eval_interval)),
        *("--training.save_interval", "0", "--training.save_best", "false", "--logging.plot", "false"),
        *cli,
        *("--training.precision", precision, "--run.out_dir", str(out_dir), "--run.name", precision),
    ]
    if train_in_child(["--config", args.config, "--force", *overrides]):  # it saved and stopped; so do we
        raise SystemExit(f"stopped by a signal during the {precision} run")
    return json.loads((out_dir / precision / "train_log.json").read_text())["history"]


def train_in_child(args: list[str]) -> bool:
    """python train.py ARGS, printing to our stdout; SIGINT or SIGTERM sent to us is passed on once (train.py then
    saves and stops). Returns whether that happened; a failed run is a UserError."""
    sys.stdout.flush()
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, start_new_session=True)  # Ctrl-C: ours only
    received = []

    def forward(signum, frame):
        received.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code and not received:
        raise UserError(f"train.py {' '.join(args)} failed with exit code {code}")
    return bool(received)
