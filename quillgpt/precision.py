"""The precisions a run can use, the torch dtypes behind them, and how `auto` picks one on the CPU: one place for
training, evaluation and sampling.

On a CPU, bf16 is only worth it where its matmuls run faster than fp32's: AVX512-BF16 and AMX run them several times
faster, while an AVX2-only CPU emulates them, far slower. CPU flags can't decide this (a flag can be present while a
library's path is emulated, and a library can gain a fast path no flag shows), so `auto` times a matmul at the
model's own shape in both precisions and takes bf16 where it is clearly faster (BF16_MARGIN), else fp32. The probe
is bounded in time, and paid once per process and shape; sampling's and evaluation's answer once per machine and
shape (kept_measurement).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from quillgpt.errors import WriteError
from quillgpt.files import atomic_write_json, cache_dir
from quillgpt.machine import cpu_flags, cpu_model

# the environment caps that change which CPU kernels torch runs (bench.py --isa sets them: benchmarks/conditions.py)
CPU_PATH_ENV = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")

T = TypeVar("T")

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MARGIN = 1.5  # bf16 must measure this much faster: near parity, fp32's exactness wins and no re-run flips
PROBE_SECONDS = 0.06  # per precision, after one warm-up call, in PROBE_ROUNDS windows
PROBE_ROUNDS = 3
PROBE_MAX_ROWS = 256  # rows of the probe's (rows, width) @ (width, 4 * width)
# and its width: past it a matmul's rate no longer changes with the width, while one call's cost grows as its square
# (an 8,192-wide model's probe took a minute of randn and single matmuls of a second each)
PROBE_MAX_WIDTH = 1024
# and its FLOPs a call, rows cut to fit: where bf16 is emulated (AVX2) it runs at ~1 GFLOP/s, and a probe at
# (256, 2048) took 6.6 s a bf16 call, 8 minutes in all for --validate of a wide model
PROBE_MAX_FLOPS = 2**30


def autocast(device_type: str, precision: str):
    """The autocast context a forward pass runs under: none for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type, dtype=PRECISIONS[precision])


@dataclass(frozen=True)
class MatmulRates:
    """FLOP/s of fp32 and bf16 matmuls at one shape on this CPU, and the precision auto takes by them."""

    fp32: float
    bf16: float
    shape: tuple[int, int, int]  # (rows, width, 4 * width)
    settled_by: str = ""  # where a busy machine misled the readings: what decided instead, and why
    choice: str = ""  # the precision auto takes ("": by the rates, BF16_MARGIN)
    one_thread: tuple[float, float] | None = None  # (fp32, bf16) best on one thread, where those were read

    @property
    def faster(self) -> str:
        """bf16 where it measures clearly faster (BF16_MARGIN), else fp32; or the CPU class's choice (settled_by)."""
        return self.choice or measured_faster(self.fp32, self.bf16)

    def rate(self, precision: str) -> float:
        return self.bf16 if precision == "bf16" else self.fp32

    @property
    def bf16_slowdown(self) -> float:
        """How many times slower bf16 runs than fp32: by the rates shown, or where a busy machine misled them (the
        readings were not of one mind) by the one-thread readings."""
        fp32, bf16 = self.one_thread if self.settled_by and self.one_thread else (self.fp32, self.bf16)
        return fp32 / bf16

    def describe(self) -> str:
        m, k, n = self.shape
        line = f"matmul ({m}, {k}) @ ({k}, {n}): fp32 {self.fp32 / 1e9:,.1f}, bf16 {self.bf16 / 1e9:,.1f} GFLOP/s"
        return f"{line}; {self.settled_by}" if self.settled_by else line


def measured_faster(fp32: float, bf16: float) -> str:
    return "bf16" if bf16 > BF16_MARGIN * fp32 else "fp32"


@functools.cache
def measure_cpu_rates(width: int, rows: int) -> MatmulRates:
    """fp32 and bf16 rates of (rows, width) @ (width, 4 * width), a model's MLP shape (rows and width capped: the
    probe stays well under a second), and the precision auto takes by them.

    Two readings on all threads give the rates (MFU's ceiling), two on one thread the choice (read_rates: each keeps
    its best calls): on a busy machine threads that wait for each other read a matmul at a hundredth of its speed (a
    contended 2-core box read 8 GFLOP/s, an AVX2 path's fp32 below its emulated bf16), while one thread is only
    slowed between calls, so the same config picks the same precision however busy the machine. Where the one-thread
    readings disagree too (near parity, BF16_MARGIN), the CPU's class decides (cpu_bf16_class: native bf16 matmuls
    or not, from its flags and the libraries' caps); the text says so wherever the readings were not of one mind."""
    rows, width = probe_shape(width, rows)
    readings = [read_rates(width, rows) for _ in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = [read_rates(width, rows) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    return settle(readings, single, (rows, width, 4 * width), cpu_bf16_class())


def probe_shape(width: int, rows: int) -> tuple[int, int]:
    """(rows, width) of the probe's matmul for a model's: capped, so that it stays well under a second."""
    width = max(1, min(width, PROBE_MAX_WIDTH))
    return max(1, min(rows, PROBE_MAX_ROWS, PROBE_MAX_FLOPS // (8 * width * width))), width


def settle(
    readings: list[tuple[float, float]],
    single: list[tuple[float, float]],
    shape: tuple[int, int, int],
    cpu_class: tuple[str, str] | None,
) -> MatmulRates:
    """MatmulRates from all-thread and one-thread (fp32, bf16) readings: each precision's best all-thread rate; the
    precision the one-thread readings agree on, else the CPU class's (their majority's, the first's on a tie, where
    the class is unknown); in settled_by, why, wherever the readings were not all of one mind."""
    fp32, bf16 = max(r[0] for r in readings), max(r[1] for r in readings)
    one_thread = (max(r[0] for r in single), max(r[1] for r in single))
    votes = [measured_faster(*r) for r in single]

    def shown(rs: list[tuple[float, float]]) -> str:
        return ", ".join(f"{a / 1e9:,.0f}/{b / 1e9:,.0f}" for a, b in rs)

    if len(set(votes)) == 1:
        choice, why = votes[0], f"the 1-thread readings ({shown(single)}), which a busy machine does not mislead"
        if {measured_faster(*r) for r in readings} == {choice}:
            return MatmulRates(fp32, bf16, shape, choice=choice, one_thread=one_thread)
    else:
        choice, why = cpu_class or (max(votes, key=votes.count), "the 1-thread readings' majority")
        why = f"{why} (1 thread read {shown(single)})"
    settled = f"the readings (fp32/bf16 GFLOP/s: {shown(readings)}) were not of one mind: {choice} by {why}"
    return MatmulRates(fp32, bf16, shape, settled_by=settled, choice=choice, one_thread=one_thread)


def read_rates(width: int, rows: int) -> tuple[float, float]:
    """One reading: (fp32, bf16) FLOP/s of (rows, width) @ (width, 4 * width). The two precisions take turns in
    PROBE_ROUNDS short windows and each keeps its best call, so that a busy moment (another process, threads
    descheduled mid-matmul) cannot fall on one precision only; an emulated bf16 path is slow enough that its single
    calls tell."""
    operands = {
        name: (torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    best = dict.fromkeys(operands, float("inf"))
    slow = set()  # a precision whose one call outlasts the probe's time: that call tells (an emulated path)
    with torch.no_grad():
        for name, (a, b) in operands.items():
            t0 = time.perf_counter()
            a @ b  # oneDNN picks and builds its kernel on the first call
            if time.perf_counter() - t0 > PROBE_SECONDS:
                slow.add(name)
                best[name] = time.perf_counter() - t0
        for _ in range(PROBE_ROUNDS):
            for name, (a, b) in operands.items():
                if name in slow:
                    continue
                window_end = time.perf_counter() + PROBE_SECONDS / PROBE_ROUNDS
                while True:
                    t0 = time.perf_counter()
                    a @ b
                    now = time.perf_counter()
                    best[name] = min(best[name], now - t0)
                    if now >= window_end:
                        break
    flops = 2 * rows * width * 4 * width
    return flops / best["fp32"], flops / best["bf16"]


def cpu_bf16_class() -> tuple[str, str] | None:
    """(precision, why) from what this CPU is, where readings can't tell: bf16 where its matmuls run natively
    (x86 with AMX or AVX512-BF16 in /proc/cpuinfo, on ATen's AVX512 path and not capped below it by
    ONEDNN_MAX_CPU_ISA), fp32 on any other x86 path (bf16 emulated). None elsewhere (ARM, no /proc/cpuinfo)."""
    flags = cpu_flags()
    if not flags or not ({"avx2", "avx512f", "sse4_2"} & flags):
        return None
    native = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = not (cap in ("ALL", "DEFAULT") or "BF16" in cap or "AMX" in cap)
    if native and capability.startswith("AVX512") and not capped:
        return "bf16", f"this CPU's class: native bf16 matmuls ({native[0]})"
    return "fp32", f"this CPU's class: bf16 matmuls emulated ({capability} path{', oneDNN capped' if capped else ''})"


def emulation_warning(rates: MatmulRates) -> str:
    """The line for a user who forces bf16 where it measures slower than fp32."""
    return (
        f"warning: bf16 runs {rates.bf16_slowdown:,.1f}x slower than fp32 on this CPU (emulated; "
        f"{rates.describe()}): --training.precision auto or fp32 is faster"
    )


def inference_precision(requested: str, device: torch.device, width: int, rows: int) -> str:
    """The precision evaluation runs in: `requested`, or for "auto" bf16 on a CUDA device that has it and on the CPU
    whichever of fp32 and bf16 measures faster at (rows, width) @ (width, 4 * width). The CPU's answer is measured
    once per machine and shape and kept (kept_measurement): every run on the machine then takes the same."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if cuda_has_native_bf16() else "fp32"
    if device.type != "cpu":
        return "fp32"
    rows, width = probe_shape(width, rows)
    key = f"{machine_key()}|{rows}x{width}"
    return kept_measurement("auto_precision.json", key, lambda: measure_cpu_rates(width, rows).faster, str)


INT8_PROBE_MAX_WIDTH = 1024  # the int8 probe's width cap: its slow fp32 side took ~2 ms a call at 1,024


@functools.cache
def int8_activations(width: int) -> str:
    """The activations' precision a weight-only int8 model decodes with on the CPU: bf16 where the int8 product
    (torch._weight_int8pack_mm) of one row of `width` measures BF16_MARGIN faster with bf16 activations than with
    fp32, else fp32. The product's own speed decides, not bf16's matmul rate: with fp32 activations it ran 13x slower
    than with bf16 on an AMD EPYC, 11x on its AVX2 path too (docs/LOG.md)."""
    return measured_faster(*read_int8_rates(width))


def read_int8_rates(width: int) -> tuple[float, float]:
    """(fp32, bf16) products a second of int8 weights (4 * width, width) with one row of activations in each
    precision, each side's best of PROBE_ROUNDS alternating rounds after a warm-up."""
    width = max(1, min(width, INT8_PROBE_MAX_WIDTH))
    weights = [torch.randint(-127, 128, (4 * width, width), dtype=torch.int8) for _ in range(2)]
    best = dict.fromkeys(("fp32", "bf16"), float("inf"))
    with torch.no_grad():
        for _ in range(PROBE_ROUNDS + 1):  # the first round warms both up
            for name in best:
                x, scale = torch.randn(1, width, dtype=PRECISIONS[name]), torch.rand(4 * width, dtype=PRECISIONS[name])
                t0 = time.perf_counter()
                for w in weights:
                    torch._weight_int8pack_mm(x, w, scale)
                best[name] = min(best[name], time.perf_counter() - t0)
    return len(weights) / best["fp32"], len(weights) / best["bf16"]


def cuda_has_native_bf16() -> bool:
    """bf16 on this CUDA device runs in hardware (Ampere and later). torch's is_bf16_supported() also counts
    emulation, which on older cards is slower than fp16 with a GradScaler."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


# ---- measurements kept between runs ---------------------------------------------------------------------------


def machine_key() -> str:
    """What a kept measurement of this machine's kernels holds for: the CPU, its code path (bench.py --isa's caps),
    the threads and torch's version."""
    caps = ",".join(os.environ.get(k, "") for k in CPU_PATH_ENV)
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{cpu_model()}|{capability}|{caps}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def kept_measurement(name: str, key: str, measure: Callable[[], T], kind: type, where: bool = False):
    """A measurement of this machine kept in the cache directory's file `name` (files.cache_dir) under `key`: read
    where kept (of `kind`, a number finite and >= 0), else measured and written, so that every run on the machine
    takes the same answer and pays the probe once. An unreadable file, or a value that is not such a number, costs
    the probe again; a file that cannot be written, only this run's answer. where: (the value, where it came from)."""
    path = cache_dir() / name
    kept = read_kept(path, (kind,))
    value = kept.get(key)
    if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
        value = None
    source = f"kept in {path}"
    if value is None:
        value = kept[key] = measure()
        try:
            atomic_write_json(path, kept)
            source = f"measured now, kept in {path}"
        except WriteError:
            source = f"measured now ({path} could not be written)"
    return (value, source) if where else value


def read_kept(path: Path, kinds: tuple[type, ...]) -> dict:
    """A file of kept measurements: {key: value}, every value of one of `kinds`; {} where there is none, or where it
    is not such a file."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or not JSON
        return {}
    ok = isinstance(kept, dict) and all(isinstance(v, kinds) and not isinstance(v, bool) for v in kept.values())
    return kept if ok else {}
