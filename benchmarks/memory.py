"""--memory: train on the config's dataset and on a copy whose train.bin is repeated to --size-mb, and compare the
RSS. Each run is its own bench.py process, so neither inherits the other's allocations.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    CPU_PRESET,
    Mode,
    add_config,
    child_step_flags,
    child_step_timing,
    print_table,
    run_child,
    write_repeated,
)
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import find_dataset
from quillgpt.distributed import DistInfo

WARMUP = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, CPU_PRESET)
    p.add_argument(
        "--iters",
        type=int,
        default=300,
        help=f"timed training steps in each run, after {WARMUP} untimed (default %(default)s)",
    )
    p.add_argument(
        "--size-mb", type=float, default=1000, help="size of the large train.bin in MB (default %(default)s)"
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    cli = with_shakespeare_input(cli)
    cfg = build_config(load_toml(args.config), parse_overrides(cli), source=args.config)
    dataset = find_dataset(cfg, DistInfo())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        big = Path(tmp) / "big"
        big.mkdir()
        for name in ("meta.json", "tokenizer.json", "val.bin"):
            (big / name).symlink_to(dataset.directory.resolve() / name)
        size = int(args.size_mb * 1e6) // dataset.dtype.itemsize * dataset.dtype.itemsize
        write_repeated(big / "train.bin", dataset.path("train").read_bytes(), size)
        for directory in (dataset.directory, big):
            cmd = [sys.executable, "bench.py", "--config", args.config, *cli, "--data.processed_dir", str(directory)]
            log = Path(tmp) / "bench.log"
            _, process_peak = run_child([*cmd, *child_step_flags(WARMUP, args.iters)], log)
            rows.append(((directory / "train.bin").stat().st_size, child_step_timing(log), process_peak))
    print(f"training RSS vs dataset size: {args.config}, {args.iters} steps after {WARMUP} warm-up steps")
    print_table(
        ["train.bin", "RSS after training (MB)", "peak RSS while training (MB)", "process peak RSS (MB)"],
        [
            [f"{size / 1e6:,.1f} MB", f"{timing['rss_end_mb']:,.0f}", f"{timing['peak_mb']:,.0f}", f"{peak:,.0f}"]
            for size, timing, peak in rows
        ],
        left=0,
    )
    (_, small, _), (large_size, large, _) = rows
    added = large["peak_mb"] - small["peak_mb"]
    print(f"a {large_size / 1e6:,.0f} MB train.bin adds {added:+.0f} MB of peak training RSS")
    print(load_average())


MODE = Mode("--memory", "training RSS on a --size-mb train.bin against the real one's", __doc__, add_arguments, run)
