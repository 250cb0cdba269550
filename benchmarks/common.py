"""What several of bench.py's modes share: how a mode declares itself, the Trainer under measurement and its timed
steps, child processes, the decoding benchmarks' model, and markdown tables."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError
from quillgpt.metrics import rss_mb
from quillgpt.trainer import Trainer, build_trainer, setup, synchronize, train_step

REPO = Path(__file__).resolve().parents[1]
CPU_PRESET = REPO / "configs" / "shakespeare_char" / "cpu.toml"
GPU_PRESET = REPO / "configs" / "shakespeare_char" / "gpu.toml"


@dataclass(frozen=True)
class Mode:
    """One benchmark of bench.py: the flag that picks it, its line in bench.py --help, its --help text, its own flags
    with their defaults, and what runs it with the parsed flags and the command line's --section.key value pairs."""

    flag: str | None  # None: the mode bench.py runs when no mode flag is given (the training step)
    summary: str
    doc: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, list[str]], None]
    takes_overrides: bool = True  # whether --section.key value pairs mean anything to it

    @property
    def name(self) -> str:
        return self.flag or "the training step"

    @property
    def command(self) -> str:
        """How it is run: bench.py, bench.py --serve."""
        return f"bench.py {self.flag}" if self.flag else "bench.py"

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed namespace."""
        return (self.flag or "").removeprefix("--").replace("-", "_")


def add_config(p: argparse.ArgumentParser, default: Path) -> None:
    p.add_argument("--config", default=str(default), help=f"TOML config (default {default.relative_to(REPO)})")


def run_child(cmd: list[str], env: dict | None = None, timeout: float | None = None, cwd: Path = REPO) -> tuple:
    """(wall seconds, stdout, stderr) of a fresh process, env added to ours: what a user's run of it costs. A failure,
    or a run past `timeout` seconds, is a UserError naming the command, with the tail of what it printed."""
    name, t0, env = " ".join(str(a) for a in cmd[1:3]), time.perf_counter(), {**os.environ, **(env or {})}
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"{name} ... stopped after {timeout:.0f} s") from None
    if done.returncode:
        raise UserError(f"{name} ... failed (exit {done.returncode}): {(done.stdout + done.stderr).strip()[-600:]}")
    return time.perf_counter() - t0, done.stdout, done.stderr


def print_table(header: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A markdown table of formatted cells: the first `left` columns aligned left, the rest (numbers) right."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] * left + ["---:"] * (len(header) - left)) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peak: CUDA's allocator's, or on the CPU the kernel's RSS high-water mark (VmHWM, Linux >= 4.0)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Max allocated on CUDA; on the CPU the RSS high-water mark since the reset (the current RSS without /proc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1e3
    except (OSError, StopIteration):
        return rss_mb()


def trainer_for(config: str, overrides: list[tuple[str, object]]) -> Trainer:
    """The Trainer train.py would build for this config and these overrides (nothing is written)."""
    cfg, dist = build_config(load_toml(config), overrides, source=config), DistInfo()
    return build_trainer(cfg, setup(cfg, dist), find_dataset(cfg, dist))


@dataclass
class Bench:
    """A Trainer under measurement; the all-off baseline also waits for each step's loss, as a loop printing it does."""

    tr: Trainer
    sync_every_step: bool = False


@dataclass
class StepTiming:
    name: str
    ms_median: float
    ms_best: float
    tokens_per_s: float
    mfu: float
    peak_mb: float
    first_step_s: float
    round_ms: list[float]  # each round's ms/iter, in order


def run_steps(b: Bench, start: int, n: int) -> int:
    """n optimizer steps from step `start`; returns the next step."""
    for it in range(start, start + n):
        loss, _, _ = train_step(b.tr, it)
        if b.sync_every_step:
            loss.item()
    return start + n


def time_training(
    benches: dict[str, Bench], warmup: int, iters: int, repeats: int, ceiling: Callable[[], float] | None = None
) -> tuple[list[StepTiming], list[float]]:
    """Warm each trainer up, then `repeats` rounds in which each runs `iters` timed steps in turn: taking turns puts
    every trainer through the same moments of a shared machine's load, so their ratio holds when its speed drifts.
    `ceiling`, if given, is measured just before each round (a short burst of matmuls), for the same reason."""
    steps, firsts, times, peaks, ceilings = {}, {}, {n: [] for n in benches}, dict.fromkeys(benches, 0.0), []
    for name, b in benches.items():  # `warmup` untimed steps, the first one timed apart (it compiles)
        t0 = time.perf_counter()
        steps[name] = run_steps(b, 0, 1)
        synchronize(b.tr.rt.device)
        firsts[name] = time.perf_counter() - t0
        steps[name] = run_steps(b, steps[name], max(0, warmup - 1))
    for _ in range(repeats):
        if ceiling is not None:
            ceilings.append(ceiling())
        for name, b in benches.items():
            device = b.tr.rt.device
            reset_peak_memory(device)
            synchronize(device)
            t0 = time.perf_counter()
            steps[name] = run_steps(b, steps[name], iters)
            synchronize(device)
            times[name].append((time.perf_counter() - t0) / iters)
            peaks[name] = max(peaks[name], peak_memory_mb(device))
    rows = []
    for name, b in benches.items():
        median, ms = statistics.median(times[name]), [t * 1e3 for t in times[name]]
        tps = b.tr.tokens_per_step / median
        mfu = b.tr.raw_model.estimate_mfu(tps, b.tr.rt.peak_flops)
        rows.append(StepTiming(name, median * 1e3, min(ms), tps, mfu, peaks[name], firsts[name], ms))
    return rows, ceilings


CHAR_VOCAB = 65  # tiny Shakespeare's characters: the vocabulary of a model benchmarked without data


def bench_model_args(config: str, cli: list[str]) -> GPTConfig:
    """The config's model with random weights, which need no data: a char vocabulary unless it names one; no dropout."""
    cfg = build_config(load_toml(config), parse_overrides(cli), source=config)
    return GPTConfig.from_dict({**cfg.model_args(), "vocab_size": cfg.model.vocab_size or CHAR_VOCAB, "dropout": 0.0})
