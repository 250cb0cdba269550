"""Hand-written CPU training paths for attention and dropout, swapped into a model that trains on the CPU
(use_cpu_training_kernels; eager or compiled). PyTorch's own ops are the reference and the path everywhere else (CUDA,
evaluation, decoding):
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
The measurements behind each choice are in docs/LOG.md. Tests check each against its PyTorch definition (gradients
included).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F


def tag_compile_caches_with_this_file() -> None:
    """torch.compile's on-disk caches key a graph by the ops in it, not by the Python of a custom op's registered
    backward (pytorch/pytorch#144344): after an edit to a backward below, or between two checkouts sharing
    one cache, a cached graph would go on running the old one. Tagging every cache key with this file's hash makes
    such an edit a cache miss; an unchanged file still hits."""
    tag = f"quill-kernels-{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}"
    if tag not in torch.compiler.config.cache_key_tag:
        torch.compiler.config.cache_key_tag = "+".join(filter(None, [torch.compiler.config.cache_key_tag, tag]))


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


def cpu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """model.causal_attention as CPU training runs it: q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs).
    With autograd on, dropout through our mask, and bf16 without dropout through CPUCausalAttention; else SDPA."""
    if q.requires_grad and q.device.type == "cpu" and (dropout or q.dtype == torch.bfloat16):
        if k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))  # (B, nh, T, hs)
        return cpu_dropout_attention(q, k, v, dropout) if dropout else CPUCausalAttention.apply(q, k, v)
    grouped = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)


def use_cpu_training_kernels(model: nn.Module) -> nn.Module:
    """Swap this file's kernels into a model that trains on the CPU: every nn.Dropout becomes Dropout (the faster
    mask), every attention's causal path cpu_causal_attention. Tags torch.compile's cache keys first
    (tag_compile_caches_with_this_file). The weights and the state dict are untouched."""
    tag_compile_caches_with_this_file()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, name, Dropout(child.p))
        if hasattr(module, "causal"):
            module.causal = cpu_causal_attention
    return model
