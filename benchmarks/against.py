"""--against REV: this checkout's training step against the same step at commit REV (unpacked with `git archive`
into a temporary directory). Each round runs one fresh `bench.py --json` process per side, in ABBA order, so both
sides see the same drift of the machine; the table gives every round. Each side prepares and reads its own data
directory: the two versions' dataset formats may differ.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    CPU_PRESET,
    REPO,
    Mode,
    add_config,
    child_step_flags,
    child_step_timing,
    print_table,
    run_child,
)
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.errors import UserError

THIS = "this checkout"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, CPU_PRESET)
    p.add_argument("--rounds", type=int, default=6, help="rounds of one process per side (default %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first in each process (default %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed steps in each process (default %(default)s)")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    config = str(Path(args.config).resolve())  # the other side runs in another directory
    cli = with_shakespeare_input(cli)
    times: dict[str, list[float]] = {THIS: [], args.against: []}
    with tempfile.TemporaryDirectory(prefix="bench_against_") as tmp:
        checkout_commit(args.against, Path(tmp))
        sides = {
            THIS: (REPO, with_data_dir(cli, REPO / "data", keep=True)),
            args.against: (Path(tmp), with_data_dir(cli, Path(tmp) / "data", keep=False)),
        }
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                where, side_cli = sides[side]
                log = Path(tmp) / "round.log"
                cmd = [sys.executable, str(where / "bench.py"), "--config", config, *side_cli]
                run_child([*cmd, *child_step_flags(args.warmup, args.iters)], log, cwd=where)
                times[side].append(child_step_timing(log)["ms_median"])
    print(f"training step, {config} {' '.join(cli)}: {args.rounds} rounds of {args.iters} steps per side, ABBA order")
    print_table(
        ["code", "ms/iter per round", "median ms/iter"],
        [[side, ", ".join(f"{m:.1f}" for m in ms), f"{statistics.median(ms):.1f}"] for side, ms in times.items()],
        left=2,
    )
    new, old = (statistics.median(ms) for ms in times.values())
    print(f"this checkout / {args.against}: {new / old:.3f} of the time per step ({old / new:.3f}x the speed)")
    print(load_average())


MODE = Mode(
    "--against",
    "this checkout's training step against commit REV's, in ABBA rounds of fresh processes",
    __doc__,
    add_arguments,
    run,
    metavar="REV",
)


def with_data_dir(cli: list[str], data_dir: Path, keep: bool) -> list[str]:
    """cli with --data.data_dir data_dir: replacing a given one, or (keep) only where none is given."""
    given = [i for i, a in enumerate(cli) if a.split("=")[0] == "--data.data_dir"]
    if given and keep:
        return cli
    rest = [a for i, a in enumerate(cli) if not any(i == g or (i == g + 1 and "=" not in cli[g]) for g in given)]
    return [*rest, "--data.data_dir", str(data_dir)]


def checkout_commit(rev: str, into: Path) -> None:
    """The files of commit `rev` of this repository, unpacked into `into` (no git metadata is touched)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, capture_output=True)
    if archive.returncode:
        raise UserError(f"--against {rev}: git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
