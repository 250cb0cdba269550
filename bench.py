"""Benchmarks: how fast this machine trains, samples and prepares data, and how much memory it takes.

Training runs the real train.train_step on the model, optimizer, batches and precision train.py builds:
    python bench.py --config configs/shakespeare_char/cpu.toml                # ms/iter, tokens/s, MFU, peak memory
    python bench.py --config configs/shakespeare_char/cpu.toml --baseline     # ... and the speed-up over all-off
    python bench.py --config configs/shakespeare_char/gpu.toml --training.batch_size 8 --training.precision bf16
    python bench.py --config configs/shakespeare_char/cpu.toml --profile      # + a chrome trace in bench_out/
Other modes:
    python bench.py --sample             # generation tokens/s with and without the KV cache (GPU preset's model)
    python bench.py --prepare            # BPE training time, encoding MB/s, peak RSS of preparing a 1 GB file
    python bench.py --memory             # training RSS on a 1 GB train.bin vs tiny Shakespeare's
    python bench.py --precision-curves --training.batch_size 8   # val loss of fp32 vs bf16 training, 300 iters

The baseline is the same model with every optimisation off: eager, for-loop AdamW (no fused or
foreach kernel), fp32, batches built row by row in Python without prefetching, and a host sync
(loss.item()) every step. Both live in one process and take turns, --repeats rounds of --iters
steps each, so a machine whose speed drifts slows both alike (peak RSS is then the process's).
Every time is the median (and best) of the rounds, and each table ends with the load average;
above the core count means someone else was computing at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import distributed as dist_utils
from checkpoint import RunDir
from common import UserError, atomic_write, run_main
from config import build_config, load_toml, parse_overrides
from data import BatchSource
from metrics import rss_mb
from model import GPT, GPTConfig
from train import (PRECISIONS, Runtime, build_model, make_optimizers, make_runtime, prepare_data, resolve_device,
                   resolve_precision, train, train_step)

REPO = Path(__file__).resolve().parent
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
CPU_PRESET = REPO / "configs" / "shakespeare_char" / "cpu.toml"
GPU_PRESET = REPO / "configs" / "shakespeare_char" / "gpu.toml"
CHAR_VOCAB = 65  # tiny Shakespeare's characters: the vocabulary of a model benchmarked without data


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


def load_average() -> str:
    return f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


# ---- training -------------------------------------------------------------------------------------

class LoopBatchSource(BatchSource):
    """nanoGPT's batch building for the baseline: a slice and a tensor per row, stacked in Python.

    The same start offsets as BatchSource, so the same batches; only the gathering differs."""

    def _load(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(self.dataset.path(split), dtype=self.dataset.dtype, mode="r")
        T = self.block_size
        starts = self.starts(split, index)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in starts])
        return x, y


@dataclass
class Trainer:
    """What train.py's loop holds: the (compiled) model, its raw GPT, optimizers, scaler and batches."""
    rt: Runtime
    model: torch.nn.Module
    raw_model: GPT
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler
    batches: BatchSource
    baseline: bool


def make_trainer(config: str | None, overrides: list[tuple[str, object]], baseline: bool) -> Trainer:
    """Build everything as train.py does; baseline switches every optimisation off."""
    cfg = build_config(load_toml(config) if config else {}, overrides, source=str(config or "config"))
    if baseline:
        cfg.model.compile, cfg.optimizer.fused, cfg.training.precision = False, False, "fp32"
    dist = dist_utils.DistInfo()
    device = resolve_device(cfg.run.device, dist)
    rt = make_runtime(cfg, device, resolve_precision(cfg.training.precision, device), dist,
                      RunDir(REPO / "bench_out"))  # never written: no checkpoints here
    dataset = prepare_data(cfg, dist)
    raw_model, _ = build_model(cfg, dataset, None)
    raw_model.to(device)
    raw_model.gradient_checkpointing = cfg.training.gradient_checkpointing
    model = dist_utils.wrap_model(raw_model, cfg, dist, device)
    optimizers = make_optimizers(raw_model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=rt.precision == "fp16")
    t = cfg.training
    rt.tokens_per_step = t.batch_size * t.grad_accum_steps * raw_model.config.block_size
    batch_source = LoopBatchSource if baseline else BatchSource
    batches = batch_source(dataset, raw_model.config.block_size, t.batch_size, cfg.run.seed, device, prefetch=not baseline)
    return Trainer(rt, model, raw_model, optimizers, scaler, batches, baseline)


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


def run_steps(tr: Trainer, start: int, n: int) -> int:
    """n optimizer steps from step `start`; the baseline syncs with the host after every one."""
    for it in range(start, start + n):
        loss, _, _ = train_step(tr.model, tr.optimizers, tr.scaler, tr.batches, tr.rt, it)
        if tr.baseline:
            loss.item()
    return start + n


def warm_up(tr: Trainer, warmup: int) -> tuple[int, float]:
    """`warmup` untimed steps; returns the next step and the seconds the first one took (it compiles)."""
    t0 = time.perf_counter()
    it = run_steps(tr, 0, 1)
    synchronize(tr.rt.device)
    first = time.perf_counter() - t0
    return run_steps(tr, it, max(0, warmup - 1)), first


def timed_round(tr: Trainer, it: int, iters: int) -> tuple[int, float, float]:
    """`iters` timed steps from step `it`: (next step, seconds per step, peak memory in MB)."""
    reset_peak_memory(tr.rt.device)
    synchronize(tr.rt.device)
    t0 = time.perf_counter()
    it = run_steps(tr, it, iters)
    synchronize(tr.rt.device)
    return it, (time.perf_counter() - t0) / iters, peak_memory_mb(tr.rt.device)


def time_training(trainers: dict[str, Trainer], warmup: int, iters: int, repeats: int) -> list[StepTiming]:
    """Warm each trainer up, then `repeats` rounds in which each runs `iters` timed steps in turn.

    Taking turns puts every trainer through the same moments of a shared machine's load, so their
    ratio holds even when the machine's speed drifts during the benchmark."""
    steps, firsts, times, peaks = {}, {}, {n: [] for n in trainers}, {n: 0.0 for n in trainers}
    for name, tr in trainers.items():
        steps[name], firsts[name] = warm_up(tr, warmup)
    for _ in range(repeats):
        for name, tr in trainers.items():
            steps[name], seconds, peak = timed_round(tr, steps[name], iters)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    rows = []
    for name, tr in trainers.items():
        median = statistics.median(times[name])
        tps = tr.rt.tokens_per_step / median
        rows.append(StepTiming(name, median * 1e3, min(times[name]) * 1e3, tps,
                               tr.raw_model.estimate_mfu(tps, tr.rt.peak_flops), peaks[name], firsts[name], rss_mb()))
    return rows


def profile_training(tr: Trainer, out_dir: Path, steps: int, start: int) -> Path:
    """A torch profiler trace of `steps` optimizer steps (open it in chrome://tracing or ui.perfetto.dev)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.rt.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_steps(tr, start, steps)
        synchronize(tr.rt.device)
    path = out_dir / "trace.json"
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes a file itself: move it in atomically
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with atomic_write(path) as f:
            f.write(Path(tmp, "trace.json").read_bytes())
    sort = "self_cuda_time_total" if tr.rt.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15))
    return path


def describe(tr: Trainer) -> str:
    cfg, rt = tr.rt.cfg, tr.rt
    threads = f", {torch.get_num_threads()} threads" if rt.device.type == "cpu" else ""
    return (f"{tr.raw_model.num_params() / 1e6:.2f}M parameters | {rt.tokens_per_step:,} tokens/step | "
            f"{rt.device} {rt.precision}{threads} | compile {'on' if cfg.model.compile else 'off'}")


def print_training_table(rows: list[StepTiming], device: torch.device) -> None:
    mem = "max allocated (MB)" if device.type == "cuda" else "peak RSS (MB)"
    print(f"| run | ms/iter (median) | ms/iter (best) | tokens/s | MFU | {mem} | first step (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r.name} | {r.ms_median:.1f} | {r.ms_best:.1f} | {r.tokens_per_s:,.0f} | {r.mfu * 100:.1f}% | "
              f"{r.peak_mb:,.0f} | {r.first_step_s:.1f} |")


def matmul_ceiling(tr: Trainer, repeats: int = 10) -> float:
    """FLOP/s of this machine's matmul at the model's MLP shape, (B*T, C) @ (C, 4C), in the training dtype.

    Every training FLOP the model counts is a matmul, so flops_per_token over this rate bounds
    tokens/s: no step can be faster, whatever else is optimised."""
    cfg, rt = tr.rt.cfg, tr.rt
    dtype = PRECISIONS[rt.precision]
    m, c = cfg.training.batch_size * cfg.model.block_size, cfg.model.n_embd
    a = torch.randn(m, c, dtype=dtype, device=rt.device)
    b = torch.randn(c, 4 * c, dtype=dtype, device=rt.device)
    best = float("inf")
    for _ in range(repeats + 2):  # two warm-ups, then the best of `repeats`
        synchronize(rt.device)
        t0 = time.perf_counter()
        a @ b
        synchronize(rt.device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * c * 4 * c / best


def print_ceiling(tr: Trainer, row: StepTiming) -> None:
    flops = matmul_ceiling(tr)
    per_token = tr.raw_model.flops_per_token()
    ceiling = flops / per_token
    print(f"matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s ({tr.rt.precision}, MLP shape) -> at most "
          f"{ceiling:,.0f} tokens/s at {per_token / 1e6:.1f} MFLOP/token; optimised runs at "
          f"{row.tokens_per_s / ceiling:.0%} of it")


def bench_training(args: argparse.Namespace, overrides: list) -> None:
    trainers = {}
    for baseline in (False, True) if args.baseline else (False,):
        name = "baseline (all off)" if baseline else "optimised"
        trainers[name] = make_trainer(args.config, overrides, baseline)
        print(f"{name}: {describe(trainers[name])}", flush=True)
    rows = time_training(trainers, args.warmup, args.iters, args.repeats)
    device = trainers["optimised"].rt.device
    if args.profile:
        tr = trainers["optimised"]
        path = profile_training(tr, Path(args.profile), args.profile_steps, args.warmup + args.iters * args.repeats)
        print(f"profiler trace: {path}")
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    print_training_table(rows, device)
    print_ceiling(trainers["optimised"], rows[0])
    if args.baseline:
        print(f"speed-up over the baseline: {rows[1].ms_median / rows[0].ms_median:.2f}x (median ms/iter)")
    print(load_average())


# ---- generation -----------------------------------------------------------------------------------

def time_generation(model: GPT, new_tokens: int, use_cache: bool, repeats: int) -> float:
    """Best seconds over `repeats` generations of new_tokens tokens from a one-token prompt."""
    prompt = torch.zeros((1, 1), dtype=torch.long)
    best = float("inf")
    for _ in range(repeats):
        generator = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        deque(model.generate_stream(prompt, new_tokens, use_cache=use_cache, generator=generator), maxlen=0)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_sample(args: argparse.Namespace, overrides: list) -> None:
    cfg = build_config(load_toml(args.config or GPU_PRESET), overrides, source=str(args.config or GPU_PRESET))
    margs = GPTConfig.from_dict({**cfg.model_args(), "vocab_size": cfg.model.vocab_size or CHAR_VOCAB, "dropout": 0.0})
    torch.manual_seed(0)
    model = GPT(margs).eval()  # random weights: the speed does not depend on them
    print(f"generation: {model.num_params() / 1e6:.2f}M parameters, block {margs.block_size}, "
          f"{args.new_tokens} new tokens, batch 1, fp32, {torch.get_num_threads()} threads, best of {args.repeats}")
    time_generation(model, min(args.new_tokens, 8), True, 1)  # warm-up
    seconds = {cache: time_generation(model, args.new_tokens, cache, args.repeats) for cache in (True, False)}
    print("| KV cache | tokens/s | ms/token |")
    print("| --- | ---: | ---: |")
    for cache, s in seconds.items():
        print(f"| {'on' if cache else 'off'} | {args.new_tokens / s:,.1f} | {s / args.new_tokens * 1e3:.2f} |")
    print(f"KV cache speed-up: {seconds[False] / seconds[True]:.1f}x")
    print(load_average())


# ---- data preparation -----------------------------------------------------------------------------

def write_repeated(path: Path, data: bytes, size: int) -> None:
    """A file of `size` bytes: `data` over and over (cut at the end)."""
    with atomic_write(path) as f:
        for start in range(0, size, len(data)):
            f.write(data[:size - start])


def run_child(cmd: list[str], log: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB) of a child process; wait4 reports that child's own high-water mark."""
    t0 = time.perf_counter()
    with atomic_write(log) as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    scale = 1e3 if sys.platform != "darwin" else 1e6  # ru_maxrss: KB on Linux, bytes on macOS
    return seconds, usage.ru_maxrss / scale


def bench_prepare(args: argparse.Namespace) -> None:
    from prepare import BPE_TRAIN_PIECE_CHARS
    from tokenizer import split_text, train_tokenizer

    source = Path(args.input)
    if not source.is_file():
        raise UserError(f"--input {source} not found (tiny Shakespeare is expected at {SHAKESPEARE})")
    text = source.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    tok = train_tokenizer("bpe", split_text(text, BPE_TRAIN_PIECE_CHARS), args.vocab_size)
    train_s = time.perf_counter() - t0
    big_text = text * max(1, round(args.encode_mb * 1e6 / len(text.encode())))
    encode_s = min(timed(lambda: tok.encode_array(big_text)) for _ in range(args.repeats))
    mb = len(big_text.encode()) / 1e6
    print(f"data preparation: {source.name} ({len(text.encode()) / 1e6:.2f} MB), {os.cpu_count()} cores")
    print("| measurement | value |")
    print("| --- | ---: |")
    print(f"| BPE training to {tok.vocab_size} tokens on {source.name} | {train_s:.2f} s |")
    print(f"| BPE encoding ({mb:.1f} MB in memory, best of {args.repeats}) | {mb / encode_s:.1f} MB/s |")
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        big = Path(tmp) / "input.txt"
        size = int(args.size_mb * 1e6)
        write_repeated(big, text.encode(), size)
        cmd = [sys.executable, "prepare.py", "--dataset", "big", "--input", str(big), "--data-dir", tmp,
               "--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)]
        seconds, peak = run_child(cmd, Path(tmp) / "prepare.log")
    print(f"| prepare.py --tokenizer bpe on a {size / 1e6:,.0f} MB file: time | {seconds:.1f} s ({size / 1e6 / seconds:.1f} MB/s) |")
    print(f"| prepare.py --tokenizer bpe on a {size / 1e6:,.0f} MB file: peak RSS | {peak:,.0f} MB |")
    print(load_average())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- memory ----------------------------------------------------------------------------------------

def bench_memory(args: argparse.Namespace, cli: list[str]) -> None:
    """Train on the config's dataset and on a copy whose train.bin is repeated to --size-mb; compare RSS.

    Each run is its own process, so neither inherits the other's allocations."""
    config = args.config or str(CPU_PRESET)
    cfg = build_config(load_toml(config), parse_overrides(cli), source=config)
    dataset = prepare_data(cfg, dist_utils.DistInfo())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        big = Path(tmp) / "big"
        big.mkdir()
        for name in ("meta.json", "tokenizer.json", "val.bin"):
            (big / name).symlink_to(dataset.directory.resolve() / name)
        size = int(args.size_mb * 1e6) // dataset.dtype.itemsize * dataset.dtype.itemsize
        write_repeated(big / "train.bin", dataset.path("train").read_bytes(), size)
        for directory in (dataset.directory, big):
            cmd = [sys.executable, "bench.py", "--config", config, *cli, "--data.processed_dir", str(directory),
                   "--warmup", "5", "--iters", str(args.iters), "--repeats", "1", "--json"]
            log = Path(tmp) / "bench.log"
            _, process_peak = run_child(cmd, log)
            timing = json.loads(log.read_text().strip().splitlines()[-1])[0]
            rows.append((directory, (directory / "train.bin").stat().st_size, timing, process_peak))
    print(f"training RSS vs dataset size: {config}, {args.iters} steps after 5 warm-up steps")
    print("| train.bin | RSS after training (MB) | peak RSS while training (MB) | process peak RSS (MB) |")
    print("| ---: | ---: | ---: | ---: |")
    for _, size, timing, process_peak in rows:
        print(f"| {size / 1e6:,.1f} MB | {timing['rss_end_mb']:,.0f} | {timing['peak_mb']:,.0f} | {process_peak:,.0f} |")
    (_, _, small, _), (_, _, large, _) = rows
    print(f"a {rows[1][1] / 1e6:,.0f} MB train.bin adds {large['peak_mb'] - small['peak_mb']:+.0f} MB of peak training RSS")
    print(load_average())


# ---- precision --------------------------------------------------------------------------------------

def precision_curves(args: argparse.Namespace, cli: list[str]) -> None:
    """Train the same run in fp32 and bf16 (real train() runs) and print the two val-loss sequences."""
    config = args.config or str(GPU_PRESET)
    curves, speed = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        for precision in ("fp32", "bf16"):
            overrides = ["--training.max_iters", str(args.iters), "--training.eval_interval", str(args.eval_interval),
                         "--training.eval_iters", "20", "--training.log_interval", str(args.eval_interval),
                         "--training.save_interval", "0", "--training.save_best", "false", "--logging.plot", "false",
                         *cli, "--training.precision", precision, "--run.out_dir", tmp, "--run.name", precision]
            result = train(config, overrides=overrides, force=True)
            if result.stop_reason == "signal":  # train() saved and returned; the benchmark stops with it
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
    print(f"training speed (median of the logged steps): fp32 {speed['fp32']:,.0f} tokens/s, "
          f"bf16 {speed['bf16']:,.0f} tokens/s")
    print(load_average())


# ---- command line ----------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other --section.key value pair overrides the config.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", help="generation speed with and without the KV cache")
    mode.add_argument("--prepare", action="store_true", help="BPE training/encoding speed and prepare.py's peak RSS")
    mode.add_argument("--memory", action="store_true", help="training RSS with a --size-mb train.bin vs the real one")
    mode.add_argument("--precision-curves", action="store_true", help="val loss of fp32 vs bf16 training runs")
    p.add_argument("--config", help="TOML config (training/--memory: the CPU preset; --sample/--precision-curves: the GPU preset)")
    p.add_argument("--baseline", action="store_true", help="also run with every optimisation off and print the ratio")
    p.add_argument("--profile", nargs="?", const="bench_out", default=None, metavar="DIR",
                   help="write a torch profiler chrome trace to DIR/trace.json (default bench_out)")
    p.add_argument("--profile-steps", type=int, default=5, help="optimizer steps under the profiler")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (the first one compiles)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per repeat (training 50, --memory 300, curves 300)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument("--json", action="store_true", help="print the training measurements as one JSON line")
    p.add_argument("--new-tokens", type=int, default=500, help="--sample: tokens generated per run")
    p.add_argument("--input", default=str(SHAKESPEARE), help="--prepare: the text to train BPE on and repeat")
    p.add_argument("--vocab-size", type=int, default=4096, help="--prepare: BPE vocabulary size")
    p.add_argument("--encode-mb", type=float, default=16, help="--prepare: MB of text encoded in memory")
    p.add_argument("--size-mb", type=float, default=1000, help="--prepare/--memory: size of the large input in MB")
    p.add_argument("--eval-interval", type=int, default=25, help="--precision-curves: evaluate every this many steps")
    return p.parse_known_args(argv)


def data_overrides(cli: list[str]) -> list[str]:
    """Tiny Shakespeare's local copy as the default raw input, so the presets prepare offline."""
    given = any(a.split("=")[0] == "--data.input" for a in cli)
    return cli if given or not SHAKESPEARE.is_file() else ["--data.input", str(SHAKESPEARE), *cli]


def main(argv: list[str] | None = None) -> int:
    args, cli = parse_args(sys.argv[1:] if argv is None else argv)
    if args.prepare:
        bench_prepare(args)
    elif args.sample:
        bench_sample(args, parse_overrides(cli))
    elif args.memory:
        args.iters = args.iters or 300
        bench_memory(args, data_overrides(cli))
    elif args.precision_curves:
        args.iters = args.iters or 300
        precision_curves(args, data_overrides(cli))
    else:
        args.iters = args.iters or 50
        args.config = args.config or str(CPU_PRESET)
        bench_training(args, parse_overrides(data_overrides(cli)))
    return 0


if __name__ == "__main__":
    run_main(main)
