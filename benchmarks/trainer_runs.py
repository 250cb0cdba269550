"""Trainers run as their users run them, timed from outside (what bench.py --gpu races our train.py and nanoGPT's
with): each line a trainer prints is stamped with the seconds since its launch, and the run is stopped at a target
val loss or a time limit. A trainer that logs reads its loss back from the device first, so the time between two of
its iteration lines is the device's, whatever its own clock says; windows with an evaluation are left out.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quillgpt.files import atomic_write, atomic_write_json
from quillgpt.tokenizer import CharTokenizer, save_tokenizer


@dataclass(frozen=True)
class Dialect:
    """How a trainer prints an iteration line (group 1: the iteration) and an evaluation (groups: iteration, val)."""

    iteration: re.Pattern
    evaluation: re.Pattern


OURS = Dialect(
    re.compile(r"^iter +(\d+)/\d+ \| "),
    re.compile(r"^eval (\d+)(?: \(assistant tokens\))?: train [\d.]+ \| val ([\d.]+)"),
)
NANOGPT = Dialect(
    re.compile(r"^iter (\d+): loss [\d.]+, time [\d.]+ms"),
    re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)"),
)


@dataclass
class Timeline:
    """What a trainer printed, each line with the seconds since its launch, and how it ended."""

    lines: list[tuple[float, str]]
    wall: float  # seconds from launch to exit
    returncode: int
    stopped: str  # "": it ran to its end; "target": stopped at the target; "limit": stopped at the time limit

    def evaluations(self, dialect: Dialect) -> list[tuple[float, int, float]]:
        """(seconds, iteration, val loss) of each evaluation line."""
        return [(t, int(m[1]), float(m[2])) for t, line in self.lines if (m := dialect.evaluation.match(line))]

    def iterations(self, dialect: Dialect) -> list[tuple[float, int]]:
        return [(t, int(m[1])) for t, line in self.lines if (m := dialect.iteration.match(line))]

    def tail(self, n: int = 8) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def follow(
    cmd: list[str], cwd: Path, limit_s: float, stop: Callable[[str], bool] = lambda line: False, env: dict | None = None
) -> Timeline:
    """Run cmd, stamping each line it prints; SIGTERM it when stop(line) says so or at limit_s (train.py then finishes
    its step and saves; nanoGPT's train.py ends)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    why = {"stopped": ""}

    def at_limit() -> None:
        if proc.poll() is None:
            why["stopped"] = "limit"
            proc.send_signal(signal.SIGTERM)

    timer = threading.Timer(limit_s, at_limit)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if not why["stopped"] and stop(line):
                why["stopped"] = "target"
                proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    return Timeline(lines, time.perf_counter() - start, proc.returncode, why["stopped"])


def stop_at(dialect: Dialect, target: float) -> Callable[[str], bool]:
    """stop(line) for follow: true at the first evaluation at or below target."""
    return lambda line: bool((m := dialect.evaluation.match(line)) and float(m[2]) <= target)


def steady_ms_per_iter(timeline: Timeline, dialect: Dialect, after: int = 0) -> float | None:
    """The median ms per iteration between iteration lines after `after`, windows with an evaluation left out."""
    evals = [t for t, _, _ in timeline.evaluations(dialect)]
    its = [(t, i) for t, i in timeline.iterations(dialect) if i > after]
    pairs = [(a, b) for a, b in zip(its, its[1:]) if b[1] > a[1] and not any(a[0] < e < b[0] for e in evals)]
    windows = [(t2 - t1) / (i2 - i1) * 1e3 for (t1, i1), (t2, i2) in pairs]
    return statistics.median(windows) if windows else None


@dataclass
class RaceResult:
    """One trainer's run to a target val loss: when it first evaluated at or below it, and how fast it stepped."""

    arm: str
    target: float
    reached_s: float | None = None  # seconds from launch to the first evaluation at or below target
    reached_iter: int | None = None
    best_val: float | None = None
    ms_per_iter: float | None = None
    wall_s: float = 0.0
    stopped: str = ""
    error: str = ""
    evaluations: list[tuple[float, int, float]] = field(default_factory=list)


def race_result(arm: str, timeline: Timeline, dialect: Dialect, target: float) -> RaceResult:
    evals = timeline.evaluations(dialect)
    first = next(((t, i) for t, i, v in evals if v <= target), (None, None))
    failed = timeline.returncode not in (0, -signal.SIGTERM) and not timeline.stopped
    best, ms = min((v for _, _, v in evals), default=None), steady_ms_per_iter(timeline, dialect)
    error = f"exit {timeline.returncode}: {timeline.tail()}" if failed else ""
    return RaceResult(arm, target, *first, best, ms, timeline.wall, timeline.stopped, error, evals)


def random_token_dataset(directory: Path, vocab_size: int, tokens: int, seed: int = 0) -> Path:
    """A dataset of uniformly random ids under a char tokenizer of vocab_size characters (a step's speed does not depend
    on the text), as train.py reads it with data.processed_dir and nanoGPT's from data/<dataset>/ (meta.pkl aside)."""
    if vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab_size {vocab_size} does not fit nanoGPT's uint16 tokens")
    chars = [chr(c) for c in range(0x100, 0x100 + vocab_size)]  # below the surrogates for any uint16 vocabulary
    rng = np.random.default_rng(seed)
    for split, n in (("train", tokens), ("val", max(tokens // 10, 4096))):
        with atomic_write(directory / f"{split}.bin") as f:
            f.write(rng.integers(0, vocab_size, n, dtype=np.uint16).tobytes())
    save_tokenizer(CharTokenizer(chars), directory / "tokenizer.json")
    tokenizer_meta = {"kind": "char", "name": None, "file": "tokenizer.json"}
    meta = {"dataset": directory.name, "tokenizer": tokenizer_meta, "vocab_size": vocab_size, "dtype": "uint16"}
    atomic_write_json(directory / "meta.json", meta)
    return directory
