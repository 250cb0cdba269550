"""The precisions a run can use, the torch dtypes behind them, and how `auto` picks one on the CPU: one place for
training, evaluation and sampling.

On a CPU, bf16 is only worth it where its matmuls run faster than fp32's: AVX512-BF16 and AMX run them several times
faster, while an AVX2-only CPU emulates them, far slower. CPU flags can't decide this (a flag can be present while a
library's path is emulated, and a library can gain a fast path no flag shows), so `auto` times a matmul at the
model's own shape in both precisions and takes bf16 where it is clearly faster (BF16_MARGIN), else fp32. The probe
is bounded in time, and paid once per process and shape.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MARGIN = 1.5  # bf16 must measure this much faster: near parity, fp32's exactness wins and no re-run flips
PROBE_SECONDS = 0.06  # per precision, after one warm-up call, in PROBE_ROUNDS windows
PROBE_ROUNDS = 3
PROBE_MAX_ROWS = 256  # rows of the probe's (rows, width) @ (width, 4 * width)


def autocast(device_type: str, precision: str):
    """The autocast context a forward pass runs under: none for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type, dtype=PRECISIONS[precision])


@dataclass(frozen=True)
class MatmulRates:
    """FLOP/s of fp32 and bf16 matmuls at one shape on this CPU, measured one after the other."""

    fp32: float
    bf16: float
    shape: tuple[int, int, int]  # (rows, width, 4 * width)

    @property
    def faster(self) -> str:
        """bf16 where it measures clearly faster (BF16_MARGIN), else fp32."""
        return "bf16" if self.bf16 > BF16_MARGIN * self.fp32 else "fp32"

    def rate(self, precision: str) -> float:
        return self.bf16 if precision == "bf16" else self.fp32

    def describe(self) -> str:
        m, k, n = self.shape
        return f"matmul ({m}, {k}) @ ({k}, {n}): fp32 {self.fp32 / 1e9:,.1f}, bf16 {self.bf16 / 1e9:,.1f} GFLOP/s"


@functools.cache
def measure_cpu_rates(width: int, rows: int) -> MatmulRates:
    """fp32 and bf16 rates of (rows, width) @ (width, 4 * width), a model's MLP shape (rows capped: the probe stays
    well under a second). The two precisions take turns in PROBE_ROUNDS short windows and each keeps its best call,
    so that a busy moment of the machine (another process, threads descheduled mid-matmul) cannot fall on one
    precision only; an emulated bf16 path is slow enough that its single calls tell."""
    rows = max(1, min(rows, PROBE_MAX_ROWS))
    operands = {
        name: (torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    best = dict.fromkeys(operands, float("inf"))
    with torch.no_grad():
        for a, b in operands.values():
            a @ b  # oneDNN picks and builds its kernel on the first call
        for _ in range(PROBE_ROUNDS):
            for name, (a, b) in operands.items():
                window_end = time.perf_counter() + PROBE_SECONDS / PROBE_ROUNDS
                while True:
                    t0 = time.perf_counter()
                    a @ b
                    now = time.perf_counter()
                    best[name] = min(best[name], now - t0)
                    if now >= window_end:
                        break
    flops = 2 * rows * width * 4 * width
    return MatmulRates(flops / best["fp32"], flops / best["bf16"], (rows, width, 4 * width))


def emulation_warning(rates: MatmulRates) -> str:
    """The line for a user who forces bf16 where it measures slower than fp32."""
    return (
        f"warning: bf16 runs {rates.fp32 / rates.bf16:,.1f}x slower than fp32 on this CPU (emulated; "
        f"{rates.describe()}): --training.precision auto or fp32 is faster"
    )


def inference_precision(requested: str, device: torch.device, width: int, rows: int) -> tuple[str, MatmulRates | None]:
    """The precision sampling or evaluation runs in: `requested`, or for "auto" bf16 on a CUDA device that has it and
    on the CPU whichever of fp32 and bf16 measures faster at (rows, width) @ (width, 4 * width) — decoding one token
    is a (1, width) row, where reading the weights, not the arithmetic, sets the pace. Returns the rates measured."""
    if requested != "auto":
        return requested, None
    if device.type == "cuda":
        return ("bf16" if torch.cuda.is_bf16_supported() else "fp32"), None
    if device.type != "cpu":
        return "fp32", None
    rates = measure_cpu_rates(width, rows)
    return rates.faster, rates
