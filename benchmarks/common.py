"""What several of bench.py's modes share: how a mode declares itself, the Trainer under measurement and its timed
steps, the matmul ceiling, batch-1 decoding time, child processes with their peak RSS, and markdown tables."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPT, GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError
from quillgpt.files import atomic_write
from quillgpt.metrics import matmul_flops, rss_mb
from quillgpt.precision import PRECISIONS
from quillgpt.trainer import Trainer, build_trainer, setup, synchronize, train_step

REPO = Path(__file__).resolve().parents[1]
CPU_PRESET = REPO / "configs" / "shakespeare_char" / "cpu.toml"
GPU_PRESET = REPO / "configs" / "shakespeare_char" / "gpu.toml"


# ---- modes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One benchmark of bench.py: the flag that picks it, its line in bench.py --help, its --help text, its own flags
    with their defaults, and what runs it with the parsed flags and the command line's --section.key value pairs."""

    flag: str | None  # None: the mode bench.py runs when no mode flag is given (the training step)
    summary: str
    doc: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, list[str]], None]
    metavar: str | None = None  # the flag takes a value (--against REV)
    takes_overrides: bool = True  # whether --section.key value pairs mean anything to it

    @property
    def name(self) -> str:
        return self.flag or "the training step"

    @property
    def command(self) -> str:
        """How it is run: bench.py, bench.py --sample, bench.py --against REV."""
        return " ".join(["bench.py", *filter(None, (self.flag, self.metavar))])

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed namespace."""
        return (self.flag or "").removeprefix("--").replace("-", "_")


def llama_cpp_installed(module: str = "llama_cpp") -> bool:
    """Whether llama-cpp-python's `module` imports (llama_cpp.server.app: its [server] extra); a broken build too
    reads as missing."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError):
        return False
    return True


def add_config(p: argparse.ArgumentParser, default: Path) -> None:
    p.add_argument("--config", default=str(default), help=f"TOML config (default {default.relative_to(REPO)})")


def print_table(header: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A markdown table of formatted cells: the first `left` columns aligned left, the rest (numbers) right."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] * left + ["---:"] * (len(header) - left)) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


# ---- memory ---------------------------------------------------------------------------------------


def reset_peak_rss() -> None:
    """Restart the kernel's RSS high-water mark (VmHWM) for this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """RSS high-water mark since the last reset_peak_rss (the current RSS where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1e3
    except (OSError, StopIteration):
        return rss_mb()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory_mb(device: torch.device) -> float:
    """Max allocated on CUDA, peak RSS on the CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e6 if device.type == "cuda" else peak_rss_mb()


# ---- timed training steps -------------------------------------------------------------------------


def trainer_for(config: str, overrides: list[tuple[str, object]]) -> Trainer:
    """The Trainer train.py would build for this config and these overrides (nothing is written)."""
    cfg = build_config(load_toml(config), overrides, source=config)
    dist = DistInfo()
    rt = setup(cfg, dist)
    return build_trainer(cfg, rt, find_dataset(cfg, dist))


@dataclass
class Bench:
    """A Trainer under measurement; the all-off baseline also waits for every step's loss, as a loop printing it
    does."""

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
    rss_end_mb: float
    round_ms: list[float]  # each round's ms/iter, in order


def run_steps(b: Bench, start: int, n: int) -> int:
    """n optimizer steps from step `start`; returns the next step."""
    for it in range(start, start + n):
        loss, _, _ = train_step(b.tr, it)
        if b.sync_every_step:
            loss.item()
    return start + n


def warm_up(b: Bench, warmup: int) -> tuple[int, float]:
    """`warmup` untimed steps; returns the next step and the seconds the first one took (it compiles)."""
    t0 = time.perf_counter()
    it = run_steps(b, 0, 1)
    synchronize(b.tr.rt.device)
    first = time.perf_counter() - t0
    return run_steps(b, it, max(0, warmup - 1)), first


def timed_round(b: Bench, it: int, iters: int) -> tuple[int, float, float]:
    """`iters` timed steps from step `it`: (next step, seconds per step, peak memory in MB)."""
    device = b.tr.rt.device
    reset_peak_memory(device)
    synchronize(device)
    t0 = time.perf_counter()
    it = run_steps(b, it, iters)
    synchronize(device)
    return it, (time.perf_counter() - t0) / iters, peak_memory_mb(device)


def time_training(
    benches: dict[str, Bench], warmup: int, iters: int, repeats: int, ceiling: Callable[[], float] | None = None
) -> tuple[list[StepTiming], list[float]]:
    """Warm each trainer up, then `repeats` rounds in which each runs `iters` timed steps in turn.

    Taking turns puts every trainer through the same moments of a shared machine's load, so their
    ratio holds even when the machine's speed drifts during the benchmark. `ceiling`, if given, is
    measured just before each round (a short burst of matmuls), for the same reason: returned beside the rows."""
    steps, firsts, times, peaks = {}, {}, {n: [] for n in benches}, {n: 0.0 for n in benches}
    ceilings = []
    for name, b in benches.items():
        steps[name], firsts[name] = warm_up(b, warmup)
    for _ in range(repeats):
        if ceiling is not None:
            ceilings.append(ceiling())
        for name, b in benches.items():
            steps[name], seconds, peak = timed_round(b, steps[name], iters)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    rows = []
    for name, b in benches.items():
        median = statistics.median(times[name])
        tps = b.tr.tokens_per_step / median
        rows.append(
            StepTiming(
                name,
                median * 1e3,
                min(times[name]) * 1e3,
                tps,
                b.tr.raw_model.estimate_mfu(tps, b.tr.rt.peak_flops),
                peaks[name],
                firsts[name],
                rss_mb(),
                [t * 1e3 for t in times[name]],
            )
        )
    return rows, ceilings


def describe(tr: Trainer) -> str:
    rt = tr.rt
    threads = f", {torch.get_num_threads()} threads" if rt.device.type == "cpu" else ""
    return (
        f"{tr.raw_model.num_params() / 1e6:.2f}M parameters | {tr.tokens_per_step:,} tokens/step | "
        f"{rt.device} {rt.precision}{threads} | compile {'on' if rt.compile else 'off'}"
    )


def matmul_ceiling(tr: Trainer, repeats: int = 10) -> float:
    """FLOP/s of this machine's matmul at the model's MLP shape, (B*T, C) @ (C, 4C), in the training dtype.

    Every training FLOP the model counts is a matmul, so flops_per_token over this rate bounds
    tokens/s: no step can be faster, whatever else is optimised."""
    c = tr.raw_model.config
    return matmul_flops(
        c.n_embd, tr.cfg.training.batch_size * c.block_size, PRECISIONS[tr.rt.precision], tr.rt.device, repeats
    )


# ---- decoding -------------------------------------------------------------------------------------

CHAR_VOCAB = 65  # tiny Shakespeare's characters: the vocabulary of a model benchmarked without data
PROMPT_TOKENS = 16


def decoding_model_args(config: str, cli: list[str]) -> GPTConfig:
    """The config's model as decoding benchmarks build it: random weights need no data, so a char vocabulary unless
    the config gives one, and no dropout."""
    cfg = build_config(load_toml(config), parse_overrides(cli), source=config)
    return GPTConfig.from_dict({**cfg.model_args(), "vocab_size": cfg.model.vocab_size or CHAR_VOCAB, "dropout": 0.0})


def time_generation(
    model: GPT, new_tokens: int, use_cache: bool, repeats: int, compile: bool = False, prompt_tokens: int = 1
) -> tuple[float, float]:
    """(best seconds for new_tokens tokens, best seconds to the first of them) over `repeats` generations."""
    prompt = torch.zeros((1, prompt_tokens), dtype=torch.long)
    best, first = float("inf"), float("inf")
    for _ in range(repeats):
        generator = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        stream = model.generate_stream(prompt, new_tokens, use_cache=use_cache, generator=generator, compile=compile)
        next(stream)
        first = min(first, time.perf_counter() - t0)
        deque(stream, maxlen=0)
        best = min(best, time.perf_counter() - t0)
    return best, first


# ---- child processes and files --------------------------------------------------------------------


def run_child(cmd: list[str], log: Path, cwd: Path = REPO) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a child process. The peak is the child's own VmHWM, read every 50 ms while it runs
    (a high-water mark: the last reading holds all before it). Not wait4's ru_maxrss: Linux carries a process's
    high-water mark over fork and exec, so a child of a parent that once held a big model would report the parent's
    peak (every 1B variant read the 8.09 GB of the parent that wrote the random weights). Where there is no /proc
    (macOS), ru_maxrss it is."""
    t0 = time.perf_counter()
    peak_kb = 0
    with atomic_write(log) as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        status_file = Path(f"/proc/{proc.pid}/status")
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak_kb = max(peak_kb, high_water_kb(status_file))
            time.sleep(0.05)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    if peak_kb:
        return seconds, peak_kb / 1e3
    scale = 1e3 if sys.platform != "darwin" else 1e6  # ru_maxrss: KB on Linux, bytes on macOS
    return seconds, usage.ru_maxrss / scale


def high_water_kb(status_file: Path) -> int:
    """A running process's VmHWM (peak resident set, KB) from its /proc status; 0 where it cannot be read."""
    try:
        text = status_file.read_text()
    except OSError:
        return 0
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(found[1]) if found else 0


def child_step_flags(warmup: int, iters: int) -> list[str]:
    """The flags that make a child bench.py (this checkout's or another commit's) time one round of `iters` training
    steps and print the measurements as its last line, as JSON: what child_step_timing reads."""
    return ["--warmup", str(warmup), "--iters", str(iters), "--repeats", "1", "--json"]


def child_step_timing(log: Path) -> dict:
    """The training step's measurements (a StepTiming's fields) a child bench.py run with child_step_flags printed."""
    return json.loads(log.read_text().strip().splitlines()[-1])[0]


def write_repeated(path: Path, data: bytes, size: int) -> None:
    """A file of `size` bytes: `data` over and over (cut at the end)."""
    with atomic_write(path) as f:
        for start in range(0, size, len(data)):
            f.write(data[: size - start])
