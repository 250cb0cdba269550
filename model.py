"""The one GPT definition every script uses: the network, its FLOP count, and generation with a KV cache.

Defaults reproduce GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings), so GPT-2
weights load unchanged. A modern recipe is available through switches (quillgpt.config.GPTConfig):
rotary positions, RMSNorm, QK-norm, ReLU^2 / SwiGLU MLPs, untied embeddings, logit soft-capping
and zero-initialised output projections. Optimizers live in quillgpt/optim.py, the CPU training kernels
that attention and dropout switch to in quillgpt/kernels.py.

References: nanoGPT's model.py; GPT-2 (Radford et al. 2019); RoFormer (Su et al. 2021);
modded-nanogpt for QK-norm, ReLU^2, soft-capping and Muon.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from quillgpt.config import GPTConfig
from quillgpt.kernels import Dropout, Linear, causal_attention, gelu, tracing


class RMSNorm(nn.Module):
    """RMSNorm scaled by its weight, or (plus_one, Gemma's) by 1 + its weight, which then starts at 0."""

    def __init__(self, ndim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(ndim) if plus_one else torch.ones(ndim))
        self.offset = float(plus_one)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32, as autocast runs LayerNorm: a bf16 input with an fp32 weight misses the fused kernel
        scale = self.weight.float() + self.offset if self.offset else self.weight.float()
        return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's can't switch bias off on older versions)."""

    def __init__(self, ndim: int, bias: bool, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def make_norm(config: GPTConfig, ndim: int | None = None, used: bool = True) -> nn.Module:
    """The config's norm over the last ndim features (default n_embd); an Identity where it is not used."""
    ndim = ndim or config.n_embd
    if not used:
        return nn.Identity()
    if config.norm == "rmsnorm":
        return RMSNorm(ndim, config.norm_eps, config.norm_plus_one)
    return LayerNorm(ndim, config.bias, config.norm_eps)


def rotary_width(config: GPTConfig) -> int:
    """How many of a head's dimensions rotate: all, or the first rope_fraction of them (Phi), an even number."""
    return int(config.head_width * config.rope_fraction) // 2 * 2


def rope_frequencies(config: GPTConfig) -> torch.Tensor:
    """The rotary inverse frequencies of a head's rotating dimension pairs (rotary_width / 2,), scaled: Llama 3's
    (long wavelengths slowed by rope_factor, short ones kept, those between blended), linear (every one slowed by
    rope_factor) or LongRoPE's (each divided by its own factor)."""
    dim = rotary_width(config)
    wavelengths = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # (dim / 2,)
    if config.rope_scaling == "longrope":
        return 1.0 / (torch.tensor(config.rope_factors, dtype=torch.float32) * wavelengths)
    inv_freq = 1.0 / wavelengths
    if config.rope_scaling == "none":
        return inv_freq
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor
    factor, low, high, context = (
        config.rope_factor,
        config.rope_low_freq_factor,
        config.rope_high_freq_factor,
        config.rope_original_context,
    )
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, blended, scaled)


def rope_tables(config: GPTConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) of every position and rotating dimension, (T, rotary_width) each, by the kind of layer that reads
    them: "global" (rope_theta, scaled), and "local" for sliding-window layers where they have a base of their own
    (rope_theta_local, unscaled: Gemma 3); "long", LongRoPE's long factors, which the global layers take instead in a
    forward pass that reaches past the original context. Dimensions i and i + rotary_width / 2 rotate as a pair by the same angle,
    as in transformers' Llama: both halves hold the pair's cos and sin, sin's first half negated (apply_rope)."""
    positions = torch.arange(config.block_size, dtype=torch.float32)

    def tables(frequencies: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions, frequencies)  # (T, rotary_width / 2)
        cos, sin = angles.cos() * scale, angles.sin() * scale
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (T, rotary_width) each

    # LongRoPE's attention factor scales both tables, so every score by its square
    rotary = {"global": tables(rope_frequencies(config), config.rope_attention_factor)}
    if config.rope_scaling == "longrope" and config.rope_long_factors:  # past the original context (GPT.ropes)
        long = replace(config, rope_factors=config.rope_long_factors)
        rotary["long"] = tables(rope_frequencies(long), config.rope_attention_factor)
    if config.rope_theta_local is not None:
        rotary["local"] = tables(
            rope_frequencies(replace(config, rope_theta=config.rope_theta_local, rope_scaling="none"))
        )
    return rotary


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) with each head's first rotary_width dimensions rotated by the tables (rope_tables): x * cos
    plus its halves swapped times the signed sin, which is (x1 cos - x2 sin, x2 cos + x1 sin) to the bit, in four
    ops where the halves written out took eleven (a decoding step calls this twice a layer)."""
    if cos.dtype != x.dtype:  # autocast's activations, fp32 tables
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotating = cos.size(-1)
    if rotating == x.size(-1):
        return x * cos + x.roll(rotating // 2, dims=-1) * sin
    part = x[..., :rotating]
    return torch.cat((part * cos + part.roll(rotating // 2, dims=-1) * sin, x[..., rotating:]), dim=-1)


class KVCache:
    """Per-layer key/value buffers for generation (n_kv_head heads each), allocated once: each new token writes one
    position. Zero-filled, because the compiled decoding step attends over the whole buffer with the unfilled part
    masked (a masked NaN would still poison the output: 0 * NaN); an eager step reads only the filled part."""

    def __init__(
        self,
        n_layer: int,
        batch: int,
        n_head: int,
        length: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (batch, n_head, length, head_dim)
        self.length = length
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = 0  # number of positions filled

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.size(2)
        self.k[layer][:, :, self.pos : self.pos + T] = k
        self.v[layer][:, :, self.pos : self.pos + T] = v
        end = self.pos + T
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write(
        self, layer: int, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's k, v (B, nkv, 1, hs) at `position` (a (1,) tensor); returns the whole buffers (B, nkv, L, hs)."""
        self.k[layer].index_copy_(2, position, k.to(self.k[layer].dtype))  # a cache built outside autocast may differ
        self.v[layer].index_copy_(2, position, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]


class DecodeStep(NamedTuple):
    """What one decoding step (GPT.decode_one) writes and reads of the cache: the new token's k and v go to
    `position` (1,); attention reads the first `span` positions, masked by `visible` (span,), or all of them when
    it is None."""

    position: torch.Tensor
    span: int
    visible: torch.Tensor | None

    @staticmethod
    def at(position: torch.Tensor, cache: KVCache) -> DecodeStep:
        """Eager, the filled prefix and the new position (everything in it visible): attention costs what has been
        written, not the cache's length. Its length is the cache's count (the position being written is cache.pos),
        never read back from the device, which would make the host wait for it every token. Under torch.compile (or
        with a position per row) the whole cache, the unfilled part masked: fixed shapes, one graph for every
        position, and cache.pos is not read (a graph would be specialised to it)."""
        if position.numel() == 1 and not tracing():
            return DecodeStep(position, cache.pos + 1, None)
        return DecodeStep(position, cache.length, torch.arange(cache.length, device=position.device) <= position)

    def keys(self, window: int) -> tuple[int, torch.Tensor | None]:
        """(first cached position read, visible mask) for a layer that sees the last `window` positions (0: all):
        eager, the window's slice of the filled prefix; with a mask, the positions before the window masked too."""
        if self.visible is None:
            return (max(0, self.span - window) if window else 0), None
        if not window:
            return 0, self.visible
        recent = torch.arange(self.span, device=self.position.device) > self.position.view(-1, 1) - window  # (1|B, L)
        return 0, self.visible & recent.view(self.visible.shape)


def visible_keys(queries: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """(T, S) boolean: which of n_keys positions each query position (T,) sees: those up to itself, and with a
    window (0: none) only the last `window` of them, its own included (transformers' sliding_window)."""
    keys = torch.arange(n_keys, device=queries.device)
    seen = keys <= queries[:, None]
    return seen & (keys > queries[:, None] - window) if window else seen


class DocumentMask:
    """Attention confined to each document of packed rows (data.py's Batch.positions: 0 at each document's first
    token), built once per forward for every layer of a window: a token sees the tokens up to itself in its own
    document only (and with a window, only the last `window` positions of them).
    A document whose positions start at p > 0 instead continues its row's first document after that document's
    first p tokens: it sees those too. Rows of one prompt and its sampled replies (RL's groups: quillgpt/rl.py) so
    read the prompt once for every reply, each reply at the positions it has after the prompt.
    FlexAttention's block mask where torch trains with it fused (CUDA, under torch.compile, without attention
    dropout: the blocks of the (T, T) scores that no document reaches are skipped), else a (B, 1, T, T) boolean mask
    for SDPA: torch has no FlexAttention backward on the CPU, and eager FlexAttention materialises the scores anyway
    (docs/chat.md has the choice and its measurements)."""

    def __init__(self, positions: torch.Tensor, flex: bool, window: int = 0):
        B, T = positions.shape
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        documents = starts.cumsum(-1)  # (B, T): which document of its row each token is in, 1 for the first
        columns = torch.arange(T, device=positions.device)
        first = torch.where(starts, columns, 0).cummax(-1).values  # (B, T): the column its document starts at
        shared = positions.gather(1, first)  # (B, T): how many of the first document's tokens its document sees
        self.block_mask = self.visible = None
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask

            def sees(b, h, q, k):
                near = (positions[b, q] - positions[b, k] < window) if window else True
                prefix = (documents[b, k] == 1) & (positions[b, k] < shared[b, q])
                return (q >= k) & near & ((documents[b, q] == documents[b, k]) | prefix)

            self.block_mask = create_block_mask(sees, B, None, T, T, device=positions.device)
        else:
            same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
            prefix = (documents[:, None, :] == 1) & (positions[:, None, :] < shared[:, :, None])
            visible = (columns[None, :] <= columns[:, None]) & (same | prefix)
            if window:
                visible &= positions[:, :, None] - positions[:, None, :] < window
            self.visible = visible.unsqueeze(1)  # (B, 1, T, T)

    @staticmethod
    def flex_trains_here(positions: torch.Tensor, dropout: float) -> bool:
        return positions.is_cuda and torch.compiler.is_compiling() and not dropout

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs)."""
        grouped = k.size(1) != q.size(1)
        if self.block_mask is not None:
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=grouped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.visible, dropout_p=dropout, enable_gqa=grouped)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_width
        widths = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim)
        self.widths = widths  # of q, k and v in c_attn's output
        self.c_attn = Linear(config.n_embd, sum(widths), bias=config.bias or config.qkv_bias)
        self.c_proj = Linear(widths[0], config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = config.dropout
        self.resid_dropout = Dropout(config.dropout)
        # qk_norm over each head's query and key, or over all heads' at once (OLMo 2): the norm's width
        self.qk_norm = config.qk_norm
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        qk_norm_widths = (self.head_dim, self.head_dim) if self.qk_norm_per_head else widths[:2]
        self.q_norm = make_norm(config, qk_norm_widths[0], used=config.qk_norm)
        self.k_norm = make_norm(config, qk_norm_widths[1], used=config.qk_norm)
        # scores are scaled by head_dim ** -0.5 everywhere (SDPA, the CPU kernels); another scale goes on the queries
        self.q_scale = config.attn_scale * self.head_dim**0.5 if config.attn_scale else 1.0
        self.window = layer_window(config, layer)
        self.rope_kind = layer_rope(config, layer)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        step: DecodeStep | None = None,
        documents: DocumentMask | None = None,
    ) -> torch.Tensor:
        """With a step, decodes one token against the cache (GPT.decode_one); with documents, each attends only
        within itself (packed rows, no cache)."""
        B, T, C = x.size()
        heads = self.c_attn(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh + 2 * nkv, T, hs)
        q, k, v = heads.split((self.n_head, self.n_kv_head, self.n_kv_head), dim=1)  # (B, nh | nkv | nkv, T, hs)
        if self.qk_norm:
            q, k = self.norm_queries_and_keys(q, k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        dropout = self.dropout if self.training else 0.0
        if step is not None:
            k, v = cache.write(self.layer, step.position, k, v)  # (B, nkv, L, hs)
            first, visible = step.keys(self.window)
            k, v = k[:, :, first : step.span].to(q.dtype), v[:, :, first : step.span].to(q.dtype)
            y = self.attend_cache(q, k, v, visible)
        elif documents is not None:
            y = documents.attend(q, k, v, dropout)
        else:
            start = cache.pos if cache is not None else 0
            if cache is not None:
                k, v = (t.to(q.dtype) for t in cache.update(self.layer, k, v))  # (B, nkv, start + T, hs)
            y = self.attend(q, k, v, start, dropout)
        y = y.transpose(1, 2).reshape(B, T, self.widths[0])  # (B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))

    def norm_queries_and_keys(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk_norm: q (B, nh, T, hs) and k (B, nkv, T, hs) normed over each head's hs, or (OLMo 2) over all of a
        position's heads at once."""
        if self.qk_norm_per_head:
            return self.q_norm(q), self.k_norm(k)
        B, _, T, hs = q.shape
        q = self.q_norm(q.transpose(1, 2).reshape(B, T, -1)).view(B, T, -1, hs).transpose(1, 2)
        k = self.k_norm(k.transpose(1, 2).reshape(B, T, -1)).view(B, T, -1, hs).transpose(1, 2)
        return q, k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, dropout: float) -> torch.Tensor:
        """T queries at positions start... against S = start + T keys: q (B, nh, T, hs), k and v (B, nkv, S, hs).
        Causal attention's kernels where nothing else hides a key (a prompt from the start, or one new query over
        the cache), else an explicit mask: a chat turn appended to the cache, a sliding window."""
        T, S = q.size(2), k.size(2)
        if not self.window and (start == 0 or T == 1):
            return causal_attention(q, k, v, dropout, T > 1)
        visible = visible_keys(torch.arange(start, S, device=q.device), S, self.window)  # (T, S)
        grouped = self.n_kv_head != self.n_head
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, enable_gqa=grouped)

    def attend_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None
    ) -> torch.Tensor:
        """One query per head against cached keys: q (B, nh, 1, hs), k and v (B, nkv, S, hs) -> (B, nh, 1, hs).
        visible (S,) masks the keys not yet written; None when all are (eager decoding attends over the filled
        prefix only: one SDPA call, no mask). The masked form is written out rather than SDPA so that torch.compile
        fuses it: SDPA's CPU flash kernel with a mask stood out in the compiled step's profile (docs/LOG.md)."""
        if visible is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.n_kv_head != self.n_head)
        B, nh, _, hs = q.shape
        q = q.view(B, self.n_kv_head, nh // self.n_kv_head, hs)  # (B, nkv, group, hs): GQA without copying k, v
        # (B, nkv, group, L). A bf16 batched matmul copies a transposed operand (k's, the big one), so there k comes
        # first; fp32's (MKL) takes it as it is, and is slow with a one-column second operand (docs/LOG.md)
        if q.dtype == torch.float32:
            scores = q @ k.transpose(-2, -1)
        else:
            scores = (k @ q.transpose(-2, -1)).transpose(-2, -1)
        scores = scores.float() * hs**-0.5
        mask = ~visible.view(-1, 1, 1, visible.size(-1))  # (1 or B, 1, 1, L): one mask, or one per row (decode_rows)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype)
        return (probs @ v).view(B, nh, 1, hs)


def layer_window(config: GPTConfig, layer: int) -> int:
    """The positions a layer attends to, 0 for all: sliding_window but in global_layers (a window as long as the
    context is no window)."""
    window = config.sliding_window if layer not in config.global_layers else 0
    return window if window < config.block_size else 0


def layer_rope(config: GPTConfig, layer: int) -> str:
    """Which rotary table a layer reads (GPT.ropes): none (learned positions, a NoPE layer), local (a sliding layer
    of a model whose sliding layers have a base of their own) or global."""
    if config.pos_emb != "rope" or layer in config.nope_layers:
        return "none"
    return "local" if layer_window(config, layer) and config.rope_theta_local is not None else "global"


def mlp_hidden_width(config: GPTConfig) -> int:
    """mlp_hidden, or 4 x n_embd; a gated MLP (swiglu, geglu) 2/3 of that, rounded up to 64: the same parameters."""
    hidden = 4 * config.n_embd
    if config.mlp in GATED:
        hidden = 64 * math.ceil(2 * hidden / 3 / 64)
    return config.mlp_hidden or hidden


def expert_hidden_width(config: GPTConfig) -> int:
    """A mixture-of-experts layer's expert width: expert_hidden, or the dense MLP's (mlp_hidden_width)."""
    return config.expert_hidden or mlp_hidden_width(config)


GATED = ("swiglu", "geglu")  # MLPs whose activation gates a second projection (c_gate)


def activation(config: GPTConfig):
    """The MLP's activation: GELU (exact or tanh, gelu_approx), ReLU squared, or the gate's SiLU or GELU."""
    exact_or_tanh = partial(gelu, approximate=config.gelu_approx)
    return {"gelu": exact_or_tanh, "relu2": lambda h: F.relu(h).square(), "swiglu": F.silu, "geglu": exact_or_tanh}[
        config.mlp
    ]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or mlp_hidden_width(config)
        self.act = activation(config)
        self.c_gate = Linear(config.n_embd, hidden, bias=config.bias) if config.mlp in GATED else None
        self.c_fc = Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = Linear(hidden, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = self.act(h) if self.c_gate is None else self.act(self.c_gate(x)) * h
        return self.dropout(self.c_proj(h))


def make_mlp(config: GPTConfig, layer: int) -> nn.Module:
    """The block's feed-forward part: a mixture of experts (quillgpt/moe.py) where the config asks for one and this
    layer is past the dense ones, else the dense MLP. Both map (B, T, C) to (B, T, C)."""
    if config.n_experts and layer >= config.dense_layers:
        from quillgpt.moe import MoE

        # experts of the dense MLP's kind; they come from here because moe.py imports nothing from model.py
        hidden = expert_hidden_width(config)
        shared = MLP(config, hidden=config.shared_experts * hidden) if config.shared_experts else None
        return MoE(config, hidden, activation(config), gated=config.mlp in GATED, shared=shared)
    return MLP(config)


class Block(nn.Module):
    """Attention then the MLP, each added to the residual stream, each with a norm before it (pre_norm: GPT-2, Llama)
    and, or, after it (post_norm: Gemma has both, OLMo 2 only the one after); a norm not used is an Identity."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(config, used=config.pre_norm)
        self.attn = CausalSelfAttention(config, layer)
        self.post_attn_norm = make_norm(config, used=config.post_norm)
        self.ln_2 = make_norm(config, used=config.pre_norm)
        self.mlp = make_mlp(config, layer)
        self.post_mlp_norm = make_norm(config, used=config.post_norm)

    def forward(
        self, x: torch.Tensor, rope=None, cache: KVCache | None = None, step=None, documents=None
    ) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.ln_1(x), rope, cache, step, documents))
        x = x + self.post_mlp_norm(self.mlp(self.ln_2(x)))
        return x


def building_on_meta() -> bool:
    """Whether modules are being built on the meta device, as a model to be given its weights is (hf.load_hf): not
    initialised then, since normal_ and arange on a meta tensor import torch._dynamo, a second of a sample.py start."""
    return torch.get_default_device().type == "meta"


def embedding(rows: int, width: int) -> nn.Embedding:
    """nn.Embedding, not initialised on the meta device (building_on_meta)."""
    if building_on_meta():
        return nn.Embedding(rows, width, _weight=torch.empty(rows, width))
    return nn.Embedding(rows, width)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.vocab_size is not None, "vocab_size must be resolved before building the model"
        self.config = config
        self.gradient_checkpointing = False
        self.loss_chunks = 1  # training.loss_chunks: >1 computes the training loss by chunks (chunked_loss)
        self.transformer = nn.ModuleDict(
            dict(
                wte=embedding(config.vocab_size, config.n_embd),
                drop=Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=make_norm(config),
            )
        )
        if config.pos_emb == "learned":
            self.transformer.wpe = embedding(config.block_size, config.n_embd)
        else:
            self.set_rope_tables()
        self.embed_scale = config.n_embd**0.5 if config.embed_scale else 1.0  # Gemma's embeddings x sqrt(width)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        if not building_on_meta():
            self.apply(self._init_weights)

    def set_rope_tables(self) -> None:
        """The rotary tables of the config (rope_tables), as buffers not saved with the weights: rope_cos and
        rope_sin, and rope_cos_local and rope_sin_local where sliding layers have their own. Computed on the CPU
        where the model is built on the meta device (building_on_meta): they are not among the weights it is given."""
        with torch.device("cpu") if building_on_meta() else nullcontext():
            tables = rope_tables(self.config)
        for kind, (cos, sin) in tables.items():
            suffix = "" if kind == "global" else f"_{kind}"
            self.register_buffer(f"rope_cos{suffix}", cos, persistent=False)
            self.register_buffer(f"rope_sin{suffix}", sin, persistent=False)

    def ropes(self, pick, reach=None) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each kind of layer's (cos, sin) (CausalSelfAttention.rope_kind), at the positions pick(table) selects.
        reach: the furthest position the pass reads (an int, or a tensor shaped to broadcast over the picked rows):
        where LongRoPE has long factors, the global layers take them wherever it is past the original context, as
        transformers decides by the sequence's length (the keys cached before keep the short ones)."""
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {"none": None}
        for kind, suffix in (("global", ""), ("local", "_local")):
            if hasattr(self, f"rope_cos{suffix}"):
                ropes[kind] = (pick(getattr(self, f"rope_cos{suffix}")), pick(getattr(self, f"rope_sin{suffix}")))
        if hasattr(self, "rope_cos_long") and reach is not None:
            past = reach >= self.config.rope_original_context
            if isinstance(past, bool):
                ropes["global"] = (pick(self.rope_cos_long), pick(self.rope_sin_long)) if past else ropes["global"]
            else:
                long = pick(self.rope_cos_long), pick(self.rope_sin_long)
                ropes["global"] = tuple(torch.where(past, a, b) for a, b in zip(long, ropes["global"]))
        return ropes

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C), scaled where the family does so."""
        x = self.transformer.wte(idx)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer)
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            if self.config.zero_init_proj and (getattr(module, "is_residual_proj", False) or module is self.lm_head):
                if not (module is self.lm_head and self.config.tie_embeddings):
                    std = 0.0
            nn.init.normal_(module.weight, mean=0.0, std=std) if std else nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without position embeddings (as nanoGPT reports it).

        Token embeddings count once when tied (they are the head's weights)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def active_params(self) -> int:
        """num_params less the experts a token is not routed to (quillgpt/moe.py): the weights one token's FLOPs use."""
        moe = [b.mlp for b in self.transformer.h if hasattr(b.mlp, "inactive_params")]
        return self.num_params() - sum(m.inactive_params() for m in moe)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
    ):
        """idx (B, T) token ids -> (logits, loss). loss is None without targets.

        last_only returns logits for the final position only (generation). positions (B, T), each token's position
        in its document, 0 at each document's first token (packed rows, data.py's Batch): each document then attends
        only within itself, at the positions it would have alone (learned or rotary); a document starting at p > 0
        continues the row's first one (DocumentMask), so a row may hold more than block_size tokens; not with a cache."""
        B, T = idx.size()
        start = cache.pos if cache is not None else 0
        assert positions is not None or start + T <= self.config.block_size, (
            f"sequence of {start + T} exceeds block_size {self.config.block_size}"
        )
        x = self.embed(idx)  # (B, T, C)
        windows = {block.attn.window for block in self.transformer.h}
        documents = dict.fromkeys(windows)  # each window's DocumentMask, for packed rows
        if positions is not None:
            assert cache is None, "positions are for packed rows, not for decoding with a KV cache"
            flex = DocumentMask.flex_trains_here(positions, self.training * self.config.dropout)
            documents = {window: DocumentMask(positions, flex, window) for window in windows}
        if self.config.pos_emb == "learned":
            pos = (
                torch.arange(start, start + T, dtype=torch.long, device=idx.device) if positions is None else positions
            )
            x = x + self.transformer.wpe(pos)  # (T, C) or (B, T, C)
        if positions is None:
            ropes = self.ropes(lambda table: table[start : start + T], start + T - 1)  # (T, rotary_width)
        else:  # (B, 1, T, rotary_width): each row's furthest position decides for the row
            ropes = self.ropes(lambda table: table[positions].unsqueeze(1), positions.amax(1).view(B, 1, 1, 1))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            rope, mask = ropes[block.attn.rope_kind], documents[block.attn.window]
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, rope, None, None, mask, use_reentrant=False)
            else:
                x = block(x, rope, cache, documents=mask)
        if cache is not None:
            cache.pos += T
        if last_only:
            x = x[:, [-1], :]  # (B, 1, C)
        if targets is not None and self.loss_chunks > 1 and self.training:
            return None, self.chunked_loss(x, targets) + self.router_loss()
        logits = self.head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # mean over the counted targets (-1: not counted, e.g. chat's non-assistant tokens); a batch with none
            # gives 0, not 0/0, and the count stays on the device
            flat = targets.reshape(-1)
            loss = summed_nats(logits.view(-1, logits.size(-1)), flat) / (flat >= 0).sum().clamp(min=1)
            if self.training:
                loss = loss + self.router_loss()
        return logits, loss

    def router_loss(self) -> torch.Tensor | float:
        """The MoE layers' router losses of this forward (balancing and z-loss, weighted: quillgpt/moe.py), which the
        training loss adds to the cross-entropy (the trainer reports them apart); 0.0 for a dense model."""
        return sum((b.mlp.router_loss for b in self.transformer.h if hasattr(b.mlp, "router_loss")), 0.0)

    def chunked_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of forward(), the head and the cross-entropy run over loss_chunks slices of the rows, each
        slice recomputed in the backward pass: the (B, T, V) fp32 logits and their gradient never exist whole (at
        GPT-2's vocabulary they are most of a step's memory), for a second head matmul. x (B, T, C), targets (B, T)."""
        rows, flat = x.reshape(-1, x.size(-1)), targets.reshape(-1)  # (B*T, C), (B*T,)
        nats = [
            checkpoint(self.summed_head_nats, r, t, use_reentrant=False)
            for r, t in zip(rows.chunk(self.loss_chunks), flat.chunk(self.loss_chunks))
        ]
        return torch.stack(nats).sum() / (flat >= 0).sum().clamp(min=1)

    def summed_head_nats(self, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of the counted targets of rows (N, C) of final hidden states."""
        return summed_nats(self.head(rows), targets)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and soft-cap: (B, T, C) -> (B, T, V)."""
        logits = self.lm_head(self.transformer.ln_f(x))
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def decode_one(self, token: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (B, V) for token (B, 1) at `position` (a (1,) tensor on the device, which must hold
        cache.pos), its k and v written into the cache. Under torch.compile shapes never change with the position (the
        whole cache is attended over, the positions after this one masked), so one compiled graph serves a whole
        generation (GPT.generate_stream(compile=True)); eager, it attends over the filled prefix only."""
        x = self.embed(token)  # (B, 1, C)
        if self.config.pos_emb == "learned":
            x = x + self.transformer.wpe(position)
        ropes = self.ropes(lambda table: table.index_select(0, position), position)  # (1, rotary_width)
        step = DecodeStep.at(position, cache)
        for block in self.transformer.h:
            x = block(x, ropes[block.attn.rope_kind], cache, step)
        return self.head(x)[:, -1, :]

    def decode_rows(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """decode_one with each row at its own position: tokens (B, 1), positions (B,) -> next-token logits (B, V).
        For continuous batching (quillgpt/serve/batcher.py), where requests that started at different times share a step.
        The cache's write(layer, positions, k, v) stores row i's k and v at positions[i] and returns the buffers
        (B, nkv, L, hs) the rows attend over; cache.length is L. Each row sees the positions up to its own."""
        B = tokens.size(0)
        x = self.embed(tokens)  # (B, 1, C)
        if self.config.pos_emb == "learned":
            x = x + self.transformer.wpe(positions).unsqueeze(1)  # (B, 1, C)
        ropes = self.ropes(lambda table: table[positions].view(B, 1, 1, -1), positions.view(B, 1, 1, 1))
        visible = torch.arange(cache.length, device=tokens.device) <= positions[:, None]  # (B, L)
        step = DecodeStep(positions, cache.length, visible)
        for block in self.transformer.h:
            x = block(x, ropes[block.attn.rope_kind], cache, step)
        return self.head(x)[:, -1, :]

    # ---- accounting -------------------------------------------------------------------------

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights plus the attention scores (PaLM appendix B); N counts the
        active weights (an MoE layer's routed experts, not all of them)."""
        cfg = self.config
        N = self.active_params()
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.head_width, cfg.block_size
        return 6 * N + 12 * L * H * Q * T

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
        return self.flops_per_token() * tokens_per_second / peak_flops

    # ---- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        vocab_limit: int | None = None,
        compile: bool | None = False,
    ) -> Iterator[torch.Tensor]:
        """Yield (B, 1) new tokens one at a time. temperature 0 is greedy.

        vocab_limit leaves out ids the tokenizer can't decode (a vocabulary padded for speed).
        The prompt is cropped to its last block_size tokens. With the KV cache (allocated once, its length a power
        of two that holds the prompt and the new tokens, at most block_size) the prompt runs in one forward pass,
        then each token in one decode_one step, compiled or not (decoding_cache: compile True compiles it, None takes
        a compiled one only where one is kept; the prompt's pass stays eager). When the cache is full it is
        refilled from the last block_size/2 tokens (learned positions make a sliding window impossible), so beyond
        block_size the cached and uncached paths differ.
        """
        block = self.config.block_size
        idx = idx[:, -block:]
        cache = positions = token = step = None
        new: list[torch.Tensor] = []  # (B, 1) tokens not yet appended to idx: only a (re)fill or no cache reads idx
        for _ in range(max_new_tokens):
            if use_cache and cache is not None and cache.pos < cache.length:
                logits = step(token, positions[cache.pos : cache.pos + 1], cache)  # (B, V)
                cache.pos += 1
            else:
                idx, new = torch.cat((idx, *new), dim=1), []
                if use_cache:  # the first token, or the cache is full: fill one from the prompt or the last block/2
                    context = idx[:, -(block // 2) :] if cache is not None else idx
                    cache, step = self.decoding_cache(idx.size(0), context.size(1) + max_new_tokens, compile)
                    positions = torch.arange(cache.length, device=idx.device)
                else:
                    context = idx[:, -block:]
                logits = self(context, cache=cache, last_only=True)[0][:, -1, :]
            token = sample_next(logits[:, :vocab_limit].float(), temperature, top_k, top_p, generator)
            new.append(token)
            yield token

    def decoding_cache(self, batch: int, needed: int, compile: bool | None) -> tuple[KVCache, Callable]:
        """A KV cache with room for `needed` positions (cache_length's power of two) and the one-token step over it,
        decode_one's signature. compile: on the CPU the step compiled ahead of time and kept on disk between runs
        (quillgpt/compiled_step.py; True: compiled for this length and kept first, unless a kept one holds it; None:
        only a kept one, else eager), whose cache may be longer; elsewhere decode_one under torch.compile, kept on
        the model (a later generation reuses it). False: decode_one as it is."""
        length = cache_length(needed, self.config.block_size)
        if compile is not False and self.transformer.wte.weight.device.type == "cpu":
            from quillgpt.compiled_step import compiled_cache

            kept = compiled_cache(self, batch, length, build=bool(compile))
            if kept is not None:
                return kept
        cache = self.new_cache(batch, length)
        if not compile:
            return cache, self.decode_one
        if getattr(self, "_compiled_decode_one", None) is None:
            self._compiled_decode_one = torch.compile(self.decode_one, dynamic=False, fullgraph=True)
        return cache, self._compiled_decode_one

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
        """(B, T) prompt -> (B, T + max_new_tokens), the prompt cropped to block_size as in generate_stream."""
        new = list(self.generate_stream(idx, max_new_tokens, **kw))
        return torch.cat([idx[:, -self.config.block_size :], *new], dim=1) if new else idx

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context to block_size (fine-tuning a long-context model on shorter sequences)."""
        assert 0 < block_size <= self.config.block_size
        self.config = replace(self.config, block_size=block_size)
        if self.config.pos_emb == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].clone())
        for name, table in list(self.named_buffers(recurse=False)):
            if name.startswith("rope_"):  # the rotary tables, (T, rotary_width) each
                setattr(self, name, table[:block_size].clone())

    def new_cache(self, batch: int, length: int | None = None) -> KVCache:
        """Room for `length` positions (at most, and by default, block_size), in the dtype keys and values come in:
        the weights', or under autocast (RL's sampler) autocast's, which holds them exactly and is attended without
        converting the cache every step (a quarter of RL's sampling time when the cache was fp32: docs/LOG.md)."""
        cfg = self.config
        p = self.transformer.wte.weight  # the head may be int8 (quantize_int8)
        length = min(length or cfg.block_size, cfg.block_size)
        kind = p.device.type
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else p.dtype
        return KVCache(cfg.n_layer, batch, cfg.kv_heads, length, cfg.head_width, p.device, dtype)


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


def quantize_int8(model: GPT, dtype: torch.dtype = torch.bfloat16) -> GPT:
    """Every Linear of the model (blocks and head) as an Int8Linear, the rest and the activations in `dtype` (bf16
    where the int8 product runs faster with it: precision.int8_activations): for generation on a CPU only."""
    model.to(dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child, dtype))
    return model


def summed_nats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of logits (N, V) in fp32, summed over the counted targets (N,) (-1: not counted)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction="sum")


def cache_length(needed: int, block_size: int) -> int:
    """A power of two >= needed (and >= 64), at most block_size: few distinct lengths, so few compiled graphs."""
    return min(block_size, max(64, 1 << (needed - 1).bit_length()))


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids.

    The draw is made among the candidates only (the top-k, then the top-p of them), not over the whole vocabulary
    with the rest masked: the same distribution, but a draw's cost grows with the tensor it is given, and over a
    GPT-2 vocabulary it cost more than a small model's whole step. Off the CPU nothing is read back to the host:
    there the top-p candidates are masked among the top-k, not cut out (the same distribution again)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    vocab = logits.size(-1)
    k = min(top_k, vocab) if top_k is not None and top_k > 0 else vocab
    nucleus = top_p is not None and 0 < top_p < 1
    if k == vocab and not nucleus:
        return draw(F.softmax(logits / temperature, dim=-1), generator)
    logits, ids = torch.topk(logits, k)  # (B, k), best first (a temperature keeps the order: applied after)
    logits = logits / temperature
    if nucleus:
        probs = logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(drop, -float("inf"))
        if logits.device.type == "cpu":
            # the widest row's nucleus: the columns after it hold no candidate. On the CPU its width costs nothing to
            # read and narrows the draw; on a GPU reading it would wait for the device, so the draw keeps all k
            keep = int((~drop).sum(dim=-1).max())
            logits, ids = logits[:, :keep], ids[:, :keep]
    choice = draw(F.softmax(logits, dim=-1), generator)  # (B, 1) of k
    return ids.gather(-1, choice)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One column per row of probs (B, n) -> (B, 1), drawn by inverse CDF from one uniform number per row: on a
    CPU, multinomial draws an exponential number per entry, slowly (most of a rollout's sampling: 144 rows of a
    130-token vocabulary). The sums are in float64 (but on Apple's MPS, which has none), so that the last columns'
    mass is not lost to rounding; the search finds the first column whose sum passes the draw, never a column of
    mass 0."""
    cdf = probs.to(torch.float32 if probs.device.type == "mps" else torch.float64).cumsum(-1)  # (B, n)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cdf.dtype)  # in [0, 1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (B, 1): u * the total stays below the total
