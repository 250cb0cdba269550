"""Hand-written CPU training paths for attention and dropout, which model.py switches to in CPU training (eager or compiled).

PyTorch's own ops are the reference and the path everywhere else (CUDA, inference):
- dropout: F.dropout draws one random number per element with bernoulli_, slowly on a CPU;
  cpu_keep_mask takes four 16-bit draws out of each 64-bit word of numpy's SFC64 generator (seeded from torch's),
  several times faster. It is a custom op (quill::keep_mask), so torch.compile calls it as it is and fuses the
  multiplies around it: inductor's own random numbers made the compiled step slower than eager.
- attention with dropout: written out as SDPA's CPU math path computes it, with that mask; the probabilities come
  from one custom op (quill::causal_softmax: a matmul that starts from the causal mask, and PyTorch's softmax),
  which torch.compile calls whole: inductor's own fused mask-and-softmax writes the exponentials to an fp32 buffer
  and reads them back, several times slower than PyTorch's softmax kernel in bf16.
- bf16 causal attention without dropout: the CPU flash kernel's forward, and a backward from bf16
  batched matmuls (the flash backward is slower in bf16 than in fp32).
- exact GELU on a few rows (decoding): PyTorch's own kernel rather than oneDNN's, which F.gelu calls for every
  fp32 CPU tensor and which costs a fixed ~25 us a call.
- an fp32 linear map of a few rows (decoding; bf16 too in a compiled step): the weight's row blocks times the rows
  in one batched matmul, one block a thread, where this machine runs that faster than F.linear (measured once,
  split_pays): on an AMD EPYC MKL's matrix-vector product ran on one thread at a quarter of the batched matmul's speed.
- a bf16 or fp16 linear map of a row or two (eager decoding): PyTorch's own matrix-vector kernel, not oneDNN's, which
  reorders the weight on every call.
The measurements behind each choice are in docs/LOG.md. Tests check each against its PyTorch definition (gradients
included).
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from quillgpt.precision import kept_measurement, machine_key


def tag_compile_caches_with_this_file() -> None:
    """torch.compile's on-disk caches key a graph by the ops in it, not by the Python of a custom op's registered
    backward (pytorch/pytorch#144344): after an edit to a backward below, or between two checkouts (bench.py
    --against), a cached graph would go on running the old one. Tagging every cache key with this file's hash makes
    such an edit a cache miss; an unchanged file still hits."""
    tag = f"quill-kernels-{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}"
    if tag not in torch.compiler.config.cache_key_tag:
        torch.compiler.config.cache_key_tag = "+".join(filter(None, [torch.compiler.config.cache_key_tag, tag]))


tag_compile_caches_with_this_file()


def cpu_keep_mask(like: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """A dropout keep-mask of 0s and 1s shaped and typed like `like`, drawn 16 bits per element, and the
    scale that keeps expectations unchanged.

    On the CPU, F.dropout's bernoulli_ draws one random number per element; taking four 16-bit draws out of
    each 64-bit word is several times faster (docs/LOG.md). p is rounded to a
    multiple of 1/65536 and the scale uses the rounded value, so E[mask * scale] = 1. The mask is
    0/1 rather than 0/scale because a bf16 scale (1/0.9 -> 1.109) would bias every activation."""
    dropped = round(p * 65536)
    return keep_mask(like.detach(), dropped), 65536 / (65536 - dropped)


# 1.0 in the 16-bit float types, as the int16 with the same bits
ONE_AS_INT16 = {dtype: int(torch.ones((), dtype=dtype).view(torch.int16)) for dtype in (torch.bfloat16, torch.float16)}


def random_words(count: int) -> np.ndarray:
    """`count` random 64-bit words from numpy's SFC64, seeded by one draw from torch's default generator, so
    torch.manual_seed and a checkpoint's saved RNG state replay the same words. SFC64 fills words several times
    faster than torch's CPU generator (mt19937; docs/LOG.md)."""
    seed = int(torch.empty((), dtype=torch.int64).random_())
    return np.random.Generator(np.random.SFC64(seed)).integers(0, 2**64, size=count, dtype=np.uint64)


# Taking the tensor (not its shape) makes each call its own graph node: torch.compile's common-subexpression
# pass would merge two calls with equal arguments into one mask for every layer, as it would rand_like's
# were it not on its list of random ops.
@torch.library.custom_op("quill::keep_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def keep_mask(like: torch.Tensor, dropped: int) -> torch.Tensor:
    """0/1 shaped and typed like `like`, 0 with probability dropped / 65536: the kernel of cpu_keep_mask."""
    n = like.numel()
    bits = torch.from_numpy(random_words((n + 3) // 4).view(np.int16)[:n]).view(
        like.shape
    )  # uniform over [-32768, 32767]
    if like.dtype in ONE_AS_INT16:
        # 0/1 in int16 times the bit pattern of 1.0, read as like's dtype: a compare into bf16 converts through a
        # temporary, which costs more (docs/LOG.md)
        keep = torch.ge(bits, dropped - 32768, out=torch.empty(like.shape, dtype=torch.int16))
        return keep.mul_(ONE_AS_INT16[like.dtype]).view(like.dtype)
    # compared straight into like's dtype: a bool mask converted after is several times slower (docs/LOG.md)
    return torch.ge(bits, dropped - 32768, out=torch.empty(like.shape, dtype=like.dtype))


@keep_mask.register_fake
def _(like: torch.Tensor, dropped: int) -> torch.Tensor:
    return torch.empty_like(like, memory_format=torch.contiguous_format)


class Dropout(nn.Dropout):
    """nn.Dropout, with the faster mask of cpu_keep_mask in CPU training (eager or compiled). Off (evaluation,
    p 0) it returns its input without calling an op: an eager decoding step calls two a layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return super().forward(x)
        keep, scale = cpu_keep_mask(x, self.p)
        return x * keep * scale


# Below this many elements PyTorch's own GELU kernel is faster than oneDNN's on the CPU (fp32, 2 threads: 8 against
# 31 us for one 1,536-wide row, 29 against 36 at 16 rows; oneDNN wins from ~48k elements: docs/LOG.md)
ONEDNN_GELU_FROM = 32768


def gelu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu. For an exact GELU of a few rows on the CPU (a decoding step's) it runs PyTorch's own kernel
    (without_onednn): F.gelu goes to oneDNN for any contiguous fp32 (or native-bf16) CPU tensor, whose fixed cost is
    most of a decoding row's GELU."""
    small_on_cpu = h.device.type == "cpu" and h.numel() < ONEDNN_GELU_FROM and approximate == "none"
    if not small_on_cpu or tracing():
        return F.gelu(h, approximate=approximate)
    return without_onednn(F.gelu, h)


def without_onednn(op, *args):
    """op(*args) with oneDNN switched off around the call, so that PyTorch's own CPU kernel runs. The switch is
    global, so it is back on after; where it is already off (another thread in here, or the user) the call just
    runs."""
    if not torch._C._get_mkldnn_enabled():
        return op(*args)
    torch._C._set_mkldnn_enabled(False)
    try:
        return op(*args)
    finally:
        torch._C._set_mkldnn_enabled(True)


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing this code (a graph takes no eager-only path)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


# A linear map of this many rows or fewer (a decoding step's, a batcher's) may be split (linear); more go to F.linear
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
# Products that run PyTorch's own kernel for a few rows (reduced_rows): its matrix-vector product reads a row's
# weights at ~30 GB/s here where oneDNN's reorder reads them twice; at four rows and more oneDNN was faster
REDUCED_ROW_DTYPES = (torch.bfloat16, torch.float16)
REDUCED_MAX_ROWS = 2
_split_pays: dict[int, bool] = {}  # this process's answer, by its number of threads


class Linear(nn.Linear):
    """nn.Linear (the same parameters, state-dict names and init), whose forward is kernels.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear. For a few rows in fp32 on the CPU without autograd (decoding; bf16 too in a graph being compiled),
    where this machine runs it faster (split_pays): the weight's row blocks, one a thread, times the rows in one
    batched matmul (split_product)."""
    parts = split_parts(x, weight)
    if parts == 1:
        return without_onednn(F.linear, x, weight, bias) if reduced_rows(x, weight) else F.linear(x, weight, bias)
    rows = x.reshape(-1, x.size(-1))  # (m, in)
    y = split_product(rows, weight, parts)  # (parts, out / parts, m)
    if rows.size(0) > 1:  # one row's blocks are already its outputs in order
        y = y.permute(2, 0, 1)  # (m, parts, out / parts)
    y = y.reshape(*x.shape[:-1], weight.size(0))  # (..., out)
    return y if bias is None else y + bias


def reduced_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear runs this product by PyTorch's own matrix-vector kernel (oneDNN off): a row or two in bf16
    or fp16 on the CPU, eager, with autograd off (a decoding step). oneDNN reorders the weight on every call, which
    for one row cost 2.7x the kernel's time on an AMD EPYC; from four rows its blocked kernel wins (docs/LOG.md)."""
    if torch.is_grad_enabled() or not x.is_cpu or x.dtype not in REDUCED_ROW_DTYPES or x.dtype != weight.dtype:
        return False
    return x.numel() <= REDUCED_MAX_ROWS * x.size(-1) and not tracing()


def split_product(rows: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """The weight's row blocks times the rows in one batched matmul: rows (m, in), weight (out, in) ->
    (parts, out / parts, m). The rows go in as one view with rows.t()'s strides repeated, (0, 1, in), which make
    the second operand BLAS-ready; a contiguous (in, 1) column took bmm's slower path, 6x here."""
    out, width = weight.shape
    m = rows.size(0)
    columns = rows.contiguous().as_strided((parts, width, m), (0, 1, width))  # (parts, in, m), the same memory
    return torch.bmm(weight.view(parts, out // parts, width), columns)


def split_parts(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Into how many row blocks linear splits this product: one (F.linear) but for a few fp32 rows on the CPU with
    autograd off (bf16 too in a graph being compiled), a large enough contiguous weight, and a machine where the
    split pays (split_pays; never measured while tracing: a graph takes what this process has measured)."""
    if torch.is_grad_enabled() or not x.is_cpu or x.dtype != weight.dtype:
        return 1
    if weight.numel() < SPLIT_MIN_ELEMENTS or x.numel() > SPLIT_MAX_ROWS * x.size(-1) or not weight.is_contiguous():
        return 1
    graph = tracing()
    if x.dtype not in (GRAPH_SPLIT_DTYPES if graph else EAGER_SPLIT_DTYPES):
        return 1
    threads = torch.get_num_threads()
    parts = math.gcd(weight.size(0), threads)
    if parts == 1:
        return 1
    pays = _split_pays.get(threads, False) if graph else split_pays()
    return parts if pays else 1


def graph_splits(weight: torch.Tensor) -> bool:
    """Whether a graph compiled now splits a decoding row's products over weights like this one (what
    split_parts decides while tracing, once this process has measured the machine)."""
    return weight.device.type == "cpu" and weight.dtype in GRAPH_SPLIT_DTYPES and split_pays()


def split_pays() -> bool:
    """Whether this machine runs a decoding row's fp32 linear faster split (linear) than by F.linear: measured once
    (SPLIT_PROBE_SHAPE, by SPLIT_MARGIN) and kept (precision.kept_measurement), so that every run on the machine
    decodes the same way and pays the ~30 ms probe once."""
    threads = torch.get_num_threads()
    if threads not in _split_pays:
        speedup = kept_measurement("split_linear.json", machine_key(), measure_split_speedup, float)
        _split_pays[threads] = speedup >= SPLIT_MARGIN
    return _split_pays[threads]


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


def measure_bf16_speedup(width: int, rows: int) -> float:
    """fp32's time over bf16's for `rows` decoding rows through a model's worth of (4 * width, width) weights, each
    precision's product as linear runs it (in fp32 the split or F.linear; in bf16 PyTorch's matrix-vector kernel
    for a row or two, else F.linear)."""
    width = min(width, ROW_PROBE_MAX_WIDTH)
    count = max(2, math.ceil(ROW_PROBE_BYTES / (16 * width * width)))
    weights = {torch.float32: [torch.full((4 * width, width), 0.01 * (i + 1)) for i in range(count)]}
    weights[torch.bfloat16] = [w.bfloat16() for w in weights[torch.float32]]
    x = {dtype: torch.full((rows, width), 0.5, dtype=dtype) for dtype in weights}
    best = best_of_alternating(
        {dtype: lambda dtype=dtype: [linear(x[dtype], w) for w in weights[dtype]] for dtype in weights}
    )
    return best[torch.float32] / best[torch.bfloat16]


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


def causal_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled attention scores with the future at -inf: q, k (B, nh, T, hs) -> (B, nh, T, T).

    One batched matmul that starts from the causal mask (baddbmm) rather than a matmul then masked_fill, whose
    broadcast mask costs more than the matmul itself (docs/LOG.md)."""
    B, nh, T, hs = q.shape
    future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = torch.baddbmm(future, q.reshape(B * nh, T, hs), k.reshape(B * nh, T, hs).transpose(-2, -1), alpha=hs**-0.5)
    return scores.view(B, nh, T, T)


# An op of its own so that torch.compile calls PyTorch's softmax kernel as it is: inductor's softmax, fused with
# the mask, writes the exponentials to an fp32 buffer and reads them back, slower than the matmul with the mask and
# PyTorch's softmax together (docs/LOG.md).
@torch.library.custom_op("quill::causal_softmax", mutates_args=())
def causal_softmax(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities in the inputs' dtype: q, k (B, nh, T, hs) -> (B, nh, T, T)."""
    return causal_scores(q, k).softmax(-1)


@causal_softmax.register_fake
def _(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q.new_empty(*q.shape[:-1], k.size(-2))


def _causal_softmax_setup(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs, output)


def _causal_softmax_backward(ctx, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, p = ctx.saved_tensors
    ds = torch._softmax_backward_data(dp, p, -1, p.dtype)  # (B, nh, T, T); 0 where p is (the future)
    scale = q.size(-1) ** -0.5
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale


causal_softmax.register_autograd(_causal_softmax_backward, setup_context=_causal_softmax_setup)


def cpu_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Causal attention with dropout on the probabilities, written out (as SDPA's CPU math path
    computes it) so that the mask comes from cpu_keep_mask: q, k, v (B, nh, T, hs) -> (B, nh, T, hs).
    The softmax stays in the input dtype: in fp32 its backward (with the casts around it) was the
    slowest op of the bf16 step (docs/LOG.md)."""
    att = causal_softmax(q, k)
    keep, scale = cpu_keep_mask(att, p)
    return (att * keep) @ v * scale  # (B, nh, T, hs): the scale goes on the smaller tensor


class CPUCausalAttention(torch.autograd.Function):
    """Causal attention for bf16 training on the CPU: PyTorch's flash kernel forward, a matmul backward.

    The CPU flash kernel's backward is slower in bf16 than in fp32 (docs/LOG.md); recomputing the
    probabilities with bf16 batched matmuls is several times faster, and like flash it saves no
    (T, T) tensor for the backward pass. Gradients match flash to bf16 precision.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, y = ctx.saved_tensors
        scale = q.size(-1) ** -0.5
        p = causal_scores(q, k).softmax(-1, dtype=torch.float32)
        dv = p.to(dy.dtype).transpose(-2, -1) @ dy
        # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dY * Y)
        dp = (dy @ v.transpose(-2, -1)).float()
        ds = (p * (dp - (dy.float() * y.float()).sum(-1, keepdim=True)) * scale).to(q.dtype)
        return ds @ k, ds.transpose(-2, -1) @ q, dv


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, is_causal: bool
) -> torch.Tensor:
    """Attention as the model computes it: q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs), where
    nh is a multiple of nkv (grouped-query attention: each key/value head serves nh / nkv query heads).

    SDPA, except in CPU training (autograd on, no cache): dropout through our mask, and bf16 without
    dropout through CPUCausalAttention."""
    cpu_training = q.requires_grad and q.device.type == "cpu" and is_causal
    custom = cpu_training and (dropout or q.dtype == torch.bfloat16)
    grouped = k.size(1) != q.size(1)
    if custom:
        if grouped:
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))  # (B, nh, S, hs)
        return cpu_dropout_attention(q, k, v, dropout) if dropout else CPUCausalAttention.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal, enable_gqa=grouped)
