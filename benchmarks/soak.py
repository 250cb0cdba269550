"""Soak test: a long tiny CPU training run, watching its memory and its run directory.

    python -m benchmarks.soak                          # 2000 iterations, eval every 100, checkpoint every 50, keep_last 3
    python -m benchmarks.soak --iters 300 --warmup 100 # a shorter check
    python -m benchmarks.soak --input my.txt --keep    # another corpus; keep the temp directory for a look

Runs `python train.py` on a tiny model in a temp directory, samples the child's RSS (psutil) and the
run directory's disk usage (distinct inodes: a step checkpoint hard-linked to ckpt_last counts once)
every --sample-s seconds, prints a table and exits 1 when a bound is violated:

- RSS growth from after warm-up (median over the --warmup window) to the end (median over the last
  100 iterations) is under 5%;
- the maximum disk usage stays under (keep_last + 3) checkpoints + 1 MB: last, best and keep_last
  step checkpoints, one more being written, the logs;
- the files at the end are exactly ckpt_last.pt, ckpt_best.pt, at most keep_last step checkpoints,
  latest, config.toml, train_log.json and loss_curve.png (no temp files).

The corpus is tiny Shakespeare when ../shared/data/tinyshakespeare.txt exists, else 2 MB of the
offline pystdlib dataset.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.conditions import SHAKESPEARE
from quillgpt.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent

MAX_RSS_GROWTH = 0.05
STEP_LINE = re.compile(r"^(?:iter\s+|eval )(\d+)")
CONFIG = """\
[run]
name = "soak"
device = "cpu"
[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64
[training]
batch_size = 8
max_iters = {iters}
eval_interval = {eval_interval}
eval_iters = 10
log_interval = 10
save_interval = {save_interval}
keep_last = {keep_last}
[optimizer]
learning_rate = 1e-3
warmup_iters = 50
"""


@dataclass
class Sample:
    iteration: int
    rss_mb: float
    disk_mb: float
    files: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=200, help="RSS baseline: the median over iterations [warmup, warmup + 100)"
    )
    p.add_argument("--sample-s", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--input", type=Path, default=SHAKESPEARE if SHAKESPEARE.is_file() else None)
    p.add_argument("--keep", action="store_true", help="keep the temp directory")
    p.add_argument("--csv", type=Path, help="also write every sample (iteration, rss_mb, disk_mb, files) here")
    args = p.parse_args(argv)
    if args.warmup + 100 >= args.iters - 100:
        p.error("--iters must exceed --warmup + 200 so the warm-up and end windows don't overlap")
    return args


def disk_usage(directory: Path) -> tuple[float, int]:
    """(MB allocated by distinct inodes, number of files) under directory."""
    inodes, files = {}, 0
    for path in directory.rglob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:  # pruned or renamed while we looked
            continue
        if path.is_file():
            files += 1
            inodes[st.st_ino] = st.st_blocks * 512
    return sum(inodes.values()) / 1e6, files


def train_command(args: argparse.Namespace, tmp: Path) -> list[str]:
    config = tmp / "soak.toml"
    atomic_write_text(
        config,
        CONFIG.format(
            iters=args.iters,
            eval_interval=args.eval_interval,
            save_interval=args.save_interval,
            keep_last=args.keep_last,
        ),
    )
    data = (
        ["--data.dataset", "soak", "--data.input", str(args.input)]
        if args.input
        else ["--data.dataset", "pystdlib", "--data.max_bytes", "2000000"]
    )
    return [
        sys.executable,
        "train.py",
        "--config",
        str(config),
        "--run.out_dir",
        str(tmp / "runs"),
        "--data.data_dir",
        str(tmp / "data"),
        *data,
    ]


def follow(proc: subprocess.Popen, progress: list[int], tail: deque) -> None:
    """Track the child's iteration from its `iter N/M` and `eval N:` lines."""
    for line in proc.stdout:
        tail.append(line.rstrip())
        match = STEP_LINE.match(line)
        if match:
            progress[0] = int(match.group(1))


def watch(cmd: list[str], run_dir: Path, every_s: float) -> tuple[list[Sample], int, list[str], float]:
    """Run cmd, sampling until it exits; returns (samples, exit code, last output lines, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress, tail = [0], deque(maxlen=20)
    reader = threading.Thread(target=follow, args=(proc, progress, tail), daemon=True)
    reader.start()
    child, samples = psutil.Process(proc.pid), []
    while proc.poll() is None:
        try:
            rss = child.memory_info().rss / 1e6
        except psutil.NoSuchProcess:
            break
        disk, files = disk_usage(run_dir) if run_dir.is_dir() else (0.0, 0)
        samples.append(Sample(progress[0], rss, disk, files))
        time.sleep(every_s)
    proc.wait()
    reader.join(timeout=5)
    return samples, proc.returncode, list(tail), time.monotonic() - t0


def expected_files(run_dir: Path, keep_last: int) -> list[str]:
    """Problems with the final file set; empty when it is exactly what the run should leave."""
    names = sorted(p.name for p in run_dir.iterdir())
    steps = [n for n in names if re.fullmatch(r"ckpt_step\d+\.pt", n)]
    fixed = {"ckpt_last.pt", "ckpt_best.pt", "latest", "config.toml", "train_log.json", "loss_curve.png"}
    problems = [f"missing {n}" for n in sorted(fixed - set(names))]
    problems += [f"unexpected {n}" for n in names if n not in fixed and n not in steps]
    if len(steps) > keep_last:
        problems.append(f"{len(steps)} step checkpoints, more than keep_last {keep_last}")
    return problems


def median_rss(samples: list[Sample], lo: int, hi: int) -> float:
    window = [s.rss_mb for s in samples if lo <= s.iteration < hi]
    if not window:
        raise SystemExit(f"no RSS samples between iterations {lo} and {hi}: lower --sample-s")
    return statistics.median(window)


def report(args: argparse.Namespace, samples: list[Sample], run_dir: Path, seconds: float) -> bool:
    warm = median_rss(samples, args.warmup, args.warmup + 100)
    end = median_rss(samples, args.iters - 100, args.iters + 1)
    growth = end / warm - 1
    ckpt_mb = (run_dir / "ckpt_last.pt").stat().st_size / 1e6
    disk_bound = (args.keep_last + 3) * ckpt_mb + 1
    max_disk = max(s.disk_mb for s in samples)
    final_disk, final_files = disk_usage(run_dir)
    file_problems = expected_files(run_dir, args.keep_last)
    rows = [
        ("RSS after warm-up", f"{warm:.1f} MB", f"iters {args.warmup}-{args.warmup + 100}", None),
        ("RSS at the end", f"{end:.1f} MB", "last 100 iters", None),
        ("RSS growth", f"{growth * 100:+.2f} %", f"< {MAX_RSS_GROWTH * 100:.0f} %", growth < MAX_RSS_GROWTH),
        ("peak RSS", f"{max(s.rss_mb for s in samples):.1f} MB", "", None),
        ("checkpoint size", f"{ckpt_mb:.2f} MB", "", None),
        ("max disk usage", f"{max_disk:.2f} MB", f"<= {disk_bound:.2f} MB", max_disk <= disk_bound),
        ("disk usage at the end", f"{final_disk:.2f} MB", "", None),
        ("files at the end", str(final_files), "the expected set", not file_problems),
    ]
    print(
        f"\nsoak: {args.iters} iters, eval every {args.eval_interval}, checkpoint every {args.save_interval}, "
        f"keep_last {args.keep_last}; {len(samples)} samples in {seconds:.0f} s"
    )
    print(f"{'metric':<24}{'value':>14}  {'bound':<26}ok")
    for name, value, bound, ok in rows:
        print(f"{name:<24}{value:>14}  {bound:<26}{'' if ok is None else 'yes' if ok else 'NO'}")
    for problem in file_problems:
        print(f"  {problem}")
    print("files: " + " ".join(sorted(p.name for p in run_dir.iterdir())))
    return all(ok for *_, ok in rows if ok is not None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="quillgpt-soak-"))
    run_dir = tmp / "runs" / "soak"
    samples, code, tail, seconds = watch(train_command(args, tmp), run_dir, args.sample_s)
    if code != 0:
        print("\n".join(tail), file=sys.stderr)
        print(f"train.py exited with {code}; files kept in {tmp}", file=sys.stderr)
        return 1
    ok = report(args, samples, run_dir, seconds)
    if args.csv:
        atomic_write_text(
            args.csv,
            "iteration,rss_mb,disk_mb,files\n"
            + "".join(f"{s.iteration},{s.rss_mb:.1f},{s.disk_mb:.2f},{s.files}\n" for s in samples),
        )
    if args.keep:
        print(f"kept {tmp}")
    else:
        shutil.rmtree(tmp)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
