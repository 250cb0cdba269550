"""Speed tricks for decoding on a CPU, swapped into a loaded model (use_decoding_kernels, int8's quantize_int8) by the
decoding plan (quillgpt.generate.plan_decoding), which decides each from a measurement or a flag and says so. The
model's own layers (model.py) stay plain torch; each trick here computes what they compute.

- a few fp32 rows through a big weight (a decoding step's linear maps): the weight's row blocks, one a thread, times
  the rows in one batched matmul, where this machine runs that faster than F.linear (measured once, split_pays): on
  an AMD EPYC MKL's matrix-vector product ran on one thread at a quarter of the batched matmul's speed. In a step
  compiled ahead of time, bf16 too (inductor writes the split products as its own loops).
- a bf16 or fp16 row or two, eager: PyTorch's own matrix-vector kernel, not oneDNN's, which reorders the weight on
  every call (2.7x the kernel's time for one row on an AMD EPYC); from four rows oneDNN's blocked kernel wins.
- exact GELU on a few rows: PyTorch's own kernel rather than oneDNN's, which F.gelu calls for every fp32 CPU tensor
  and which costs a fixed ~25 us a call.
- weight-only int8 (--dtype int8): a quarter of fp32's bytes a token.
The measurements behind each are in docs/LOG.md; tests check each against F.linear and F.gelu.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F

from quillgpt.precision import kept_measurement, machine_key

# A linear map of this many rows or fewer (a decoding step's, a batch's) may be split; more go to F.linear
SPLIT_MAX_ROWS = 16
# and a weight of at least this many elements (512 KB of fp32): below it the split's extra ops cost more than it
# saves. In a decoding step (AMD EPYC, 2 threads; docs/LOG.md) 2^17 against 2^18: 2.53 against 2.83 ms a token at
# width 384 (its 384 x 384 projections split too), 1.67 against 1.92 at 256; 2^16 slowed width 128 by 20%
SPLIT_MIN_ELEMENTS = 1 << 17
SPLIT_MARGIN = 1.25  # the split must measure this much faster than F.linear on the probe to be used
SPLIT_PROBE_SHAPE = (2048, 512)  # the probe's weights, (out, in): a decoding model's MLP, 4 MB of fp32 each
SPLIT_PROBE_WEIGHTS = 8  # weights it cycles through, 32 MB: a model's, not a cache's (a hot weight misleads)
# What splits: eager, fp32 only (oneDNN's bf16 product beats a split of it: 1.5 against 2.4 ms a token); a graph
# being compiled, bf16 too, whose split products inductor writes as its own loops (a bf16 step: 0.94 against 1.40 ms)
EAGER_SPLIT_DTYPES = (torch.float32,)
GRAPH_SPLIT_DTYPES = (torch.float32, torch.bfloat16)
# Products that run PyTorch's own kernel for a few rows: its matrix-vector product reads a row's weights at ~30 GB/s
# here where oneDNN's reorder reads them twice; at four rows and more oneDNN was faster
REDUCED_ROW_DTYPES = (torch.bfloat16, torch.float16)
REDUCED_MAX_ROWS = 2
# Below this many elements PyTorch's own GELU kernel is faster than oneDNN's on the CPU (fp32, 2 threads: 8 against
# 31 us for one 1,536-wide row, 29 against 36 at 16 rows; oneDNN wins from ~48k elements: docs/LOG.md)
ONEDNN_GELU_FROM = 32768
SPLIT_MEASUREMENT = "split_linear.json"  # the kept speed-up of the split (precision.kept_measurement)


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing this code (a graph takes no eager-only path)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def without_onednn(op, *args, **kw):
    """op(*args) with oneDNN switched off around the call, so that PyTorch's own CPU kernel runs. The switch is
    global, so it is back on after; where it is already off (another thread in here, or the user) the call just
    runs."""
    if not torch._C._get_mkldnn_enabled():
        return op(*args, **kw)
    torch._C._set_mkldnn_enabled(False)
    try:
        return op(*args, **kw)
    finally:
        torch._C._set_mkldnn_enabled(True)


# ---- the products ----------------------------------------------------------------------------------------------


def split_product(rows: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """The weight's row blocks times the rows in one batched matmul: rows (m, in), weight (out, in) ->
    (parts, out / parts, m). The rows go in as one view with rows.t()'s strides repeated, (0, 1, in), which make
    the second operand BLAS-ready; a contiguous (in, 1) column took bmm's slower path, 6x here."""
    out, width = weight.shape
    m = rows.size(0)
    columns = rows.contiguous().as_strided((parts, width, m), (0, 1, width))  # (parts, in, m), the same memory
    return torch.bmm(weight.view(parts, out // parts, width), columns)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """F.linear as the weight's `parts` row blocks times the rows (split_product)."""
    rows = x.reshape(-1, x.size(-1))  # (m, in)
    y = split_product(rows, weight, parts)  # (parts, out / parts, m)
    if rows.size(0) > 1:  # one row's blocks are already its outputs in order
        y = y.permute(2, 0, 1)  # (m, parts, out / parts)
    y = y.reshape(*x.shape[:-1], weight.size(0))  # (..., out)
    return y if bias is None else y + bias


class DecodingLinear(nn.Module):
    """An nn.Linear (the same parameters, and state-dict names) whose product of a few rows takes the path the plan
    chose for it: split into `parts` row blocks (fp32 eager, and bf16 in a compiled graph), or for a row or two in
    bf16 or fp16 PyTorch's own kernel (reduced); more rows, or autograd on, F.linear."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, parts: int):
        super().__init__()
        self.weight, self.bias = weight, bias  # the Linear's own parameters
        self.out_features, self.in_features = weight.shape
        self.parts = parts
        self.eager_split = weight.dtype in EAGER_SPLIT_DTYPES
        self.reduced = weight.dtype in REDUCED_ROW_DTYPES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.size(-1)
        if rows <= SPLIT_MAX_ROWS and not torch.is_grad_enabled():
            if self.parts > 1 and (self.eager_split or tracing()):
                return split_linear(x, self.weight, self.bias, self.parts)
            if self.reduced and rows <= REDUCED_MAX_ROWS and not tracing():
                return without_onednn(F.linear, x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def split_parts(weight: torch.Tensor, split_pays: bool) -> int:
    """Into how many row blocks a decoding product over this weight splits: the threads (as their gcd with its rows)
    where the split pays on this machine, for a large enough contiguous weight of a dtype that splits; else 1."""
    if not split_pays or weight.numel() < SPLIT_MIN_ELEMENTS or not weight.is_contiguous():
        return 1
    if weight.dtype not in GRAPH_SPLIT_DTYPES or weight.device.type != "cpu":
        return 1
    return math.gcd(weight.size(0), torch.get_num_threads())


def small_gelu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu, by PyTorch's own kernel for a few rows of exact GELU (oneDNN's fixed cost is most of a row's GELU)."""
    if h.numel() >= ONEDNN_GELU_FROM or approximate != "none" or tracing():
        return F.gelu(h, approximate=approximate)
    return without_onednn(F.gelu, h)


def use_decoding_kernels(model: nn.Module, split_pays: bool) -> list[str]:
    """Swap the decoding products into a model loaded for decoding on the CPU: each nn.Linear a DecodingLinear (split
    where split_pays and its weight is big enough; a bf16 or fp16 row by PyTorch's kernel), each exact GELU
    small_gelu. Returns what was swapped in, for the plan's line."""
    linears = [(m, name, child) for m in model.modules() for name, child in m.named_children()]
    linears = [(m, name, child) for m, name, child in linears if type(child) is nn.Linear]
    split = reduced = 0
    for module, name, child in linears:
        swapped = DecodingLinear(child.weight, child.bias, split_parts(child.weight, split_pays))
        split += swapped.parts > 1
        reduced += swapped.reduced
        setattr(module, name, swapped)
    gelus = 0
    for module in model.modules():
        act = getattr(module, "act", None)
        if isinstance(act, partial) and act.func is F.gelu and act.keywords.get("approximate", "none") == "none":
            module.act, gelus = small_gelu, gelus + 1
    done = []
    if split:
        parts = max(m.parts for m in model.modules() if isinstance(m, DecodingLinear))
        done.append(f"{split} of {len(linears)} linear maps split in {parts} row blocks for a few rows")
    if reduced:
        done.append(f"a row or two of {reduced} bf16/fp16 linear maps by PyTorch's kernel, not oneDNN's")
    if gelus:
        done.append(f"the exact GELU of a few rows by PyTorch's kernel ({gelus} MLPs)")
    return done


# ---- the measurements the plan decides by ---------------------------------------------------------------------------


def best_of_alternating(calls: dict, rounds: int = 5) -> dict:
    """Each call's best time over `rounds` rounds after a warm-up one, the calls taking turns in each (a busy moment
    cannot fall on one side only), autograd off."""
    best = dict.fromkeys(calls, float("inf"))
    with torch.no_grad():
        for round in range(rounds + 1):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                if round:
                    best[name] = min(best[name], time.perf_counter() - t0)
    return best


def split_speedup() -> tuple[float, str]:
    """F.linear's time over the split's for one fp32 row, as kept for this machine (kept_measurement: measured once,
    ~30 ms), and where the number comes from."""
    return kept_measurement(SPLIT_MEASUREMENT, machine_key(), measure_split_speedup, float, where=True)


def measure_split_speedup() -> float:
    """F.linear's time over the split's for one row through SPLIT_PROBE_WEIGHTS weights of SPLIT_PROBE_SHAPE."""
    out, width = SPLIT_PROBE_SHAPE
    parts = math.gcd(out, torch.get_num_threads())
    if parts == 1:
        return 0.0
    weights = [torch.full((out, width), 0.01 * (i + 1)) for i in range(SPLIT_PROBE_WEIGHTS)]
    x = torch.full((1, width), 0.5)
    best = best_of_alternating(
        {
            "plain": lambda: [F.linear(x, w) for w in weights],
            "split": lambda: [split_product(x, w, parts) for w in weights],
        }
    )
    return best["plain"] / best["split"]


# The decoding probe's weights: (4 * width, width) each, enough of them for this many bytes of fp32 (decoding reads
# every weight once a token: a hot weight misleads), the width capped (past it the rate no longer changes)
ROW_PROBE_BYTES = 32 << 20
ROW_PROBE_MAX_WIDTH = 1024


def measure_bf16_speedup(width: int, rows: int, split_pays: bool) -> float:
    """fp32's time over bf16's for `rows` decoding rows through a model's worth of (4 * width, width) weights, each
    precision's product as DecodingLinear runs it (in fp32 the split or F.linear; in bf16 PyTorch's matrix-vector
    kernel for a row or two, else F.linear)."""
    width = min(width, ROW_PROBE_MAX_WIDTH)
    count = max(2, math.ceil(ROW_PROBE_BYTES / (16 * width * width)))
    weights = [torch.full((4 * width, width), 0.01 * (i + 1)) for i in range(count)]
    products = {
        dtype: [DecodingLinear(w.to(dtype), None, split_parts(w.to(dtype), split_pays)) for w in weights]
        for dtype in (torch.float32, torch.bfloat16)
    }
    x = {dtype: torch.full((rows, width), 0.5, dtype=dtype) for dtype in products}
    best = best_of_alternating({dtype: lambda d=dtype: [p(x[d]) for p in products[d]] for dtype in products})
    return best[torch.float32] / best[torch.bfloat16]


# ---- int8 -----------------------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """A Linear for decoding with its weight in int8, one scale per output row (weight-only quantization, as gpt-fast
    and llama.cpp's q8_0 do): a batch-1 token reads every weight once, so a quarter of fp32's bytes is ~4x less
    time in the matmuls on a CPU. Activations stay in the model's dtype (torch._weight_int8pack_mm)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)), self.weight, self.scale)  # (B*T, out)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Every Linear of the model (blocks and head) as an Int8Linear, the rest and the activations in `dtype` (bf16
    where the int8 product runs faster with it: precision.int8_activations): for decoding on a CPU only."""
    model.to(dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child, dtype))
    return model
