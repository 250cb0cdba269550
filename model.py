"""The one GPT definition every script uses: the network and its FLOP count, in plain torch modules.

Defaults reproduce GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings), so GPT-2
weights load unchanged. A modern recipe is available through switches (quillgpt.config.GPTConfig):
rotary positions, RMSNorm, QK-norm, ReLU^2 / SwiGLU MLPs, untied embeddings, logit soft-capping
and zero-initialised output projections; nanochat's value embeddings, smear and skips. Optimizers live in
quillgpt/optim.py. Decoding (the KV cache, the one-token step, sampling) is quillgpt/engine.py's: a forward pass
given a cache asks it for the positions of the new tokens (and, for smear, the tokens before them) and lets it store
and attend. Speed tricks are swapped into a built model, never built into it: the CPU
training kernels by quillgpt/kernels.py, the decoding products and int8 weights by quillgpt/decoding_kernels.py.

References: nanoGPT's model.py; GPT-2 (Radford et al. 2019); RoFormer (Su et al. 2021);
modded-nanogpt for QK-norm, ReLU^2, soft-capping and Muon.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from quillgpt.config import GPTConfig


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
    (docs/LOG.md has the measurements)."""

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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs), each position seeing those up to itself (grouped-
    query attention: each key/value head serves nh / nkv query heads)."""
    grouped = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_width
        widths = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim)
        self.widths = widths  # of q, k and v in c_attn's output
        self.c_attn = nn.Linear(config.n_embd, sum(widths), bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(widths[0], config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.causal = causal_attention  # kernels.use_cpu_training_kernels swaps its CPU kernel in here
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
        # value embeddings: a gate per key/value head from the first VE_GATE_INPUTS channels of the input
        self.ve_gate = nn.Linear(VE_GATE_INPUTS, self.n_kv_head, bias=False) if has_value_embed(config, layer) else None

    def forward(
        self, x: torch.Tensor, rope, cache=None, documents: DocumentMask | None = None, ve=None
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). With a cache (decoding: quillgpt/engine.py) the cache stores the new keys and
        values and attends over what it holds; with documents, each attends only within itself (packed rows). ve
        (B, T, nkv * hs): the layer's value embeddings of the tokens, added to the values through the gate."""
        B, T, C = x.size()
        heads = self.c_attn(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh + 2 * nkv, T, hs)
        q, k, v = heads.split((self.n_head, self.n_kv_head, self.n_kv_head), dim=1)  # (B, nh | nkv | nkv, T, hs)
        if ve is not None:  # the gate in (0, 3), as nanochat's
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_INPUTS])).transpose(1, 2).unsqueeze(
                -1
            )  # (B, nkv, T, 1)
            v = v + gate * ve.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.qk_norm:
            q, k = self.norm_queries_and_keys(q, k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        dropout = self.dropout if self.training else 0.0
        if cache is not None:
            y = cache.attend(self.layer, q, k, v, self.window)
        elif documents is not None:
            y = documents.attend(q, k, v, dropout)
        elif self.window:  # a sliding window: each position sees the last `window` positions, itself included
            visible = visible_keys(torch.arange(T, device=q.device), T, self.window)  # (T, T)
            grouped = self.n_kv_head != self.n_head
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, enable_gqa=grouped)
        else:
            y = self.causal(q, k, v, dropout)
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


VE_GATE_INPUTS = 12  # nanochat's ve_gate_channels
SMEAR_GATE_INPUTS = 24  # the first channels of a token's embedding that gate its smear (nanochat's)


def has_value_embed(config: GPTConfig, layer: int) -> bool:
    """value_embeds: every other layer, counted back from the last (nanochat's has_ve)."""
    return config.value_embeds and layer % 2 == (config.n_layer - 1) % 2


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
    exact_or_tanh = partial(F.gelu, approximate=config.gelu_approx)
    return {"gelu": exact_or_tanh, "relu2": lambda h: F.relu(h).square(), "swiglu": F.silu, "geglu": exact_or_tanh}[
        config.mlp
    ]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or mlp_hidden_width(config)
        self.act = activation(config)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias) if config.mlp in GATED else None
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = nn.Dropout(config.dropout)

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

    def forward(self, x: torch.Tensor, rope=None, cache=None, documents=None, ve=None) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.ln_1(x), rope, cache, documents, ve))
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
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=make_norm(config),
            )
        )
        if config.pos_emb == "learned":
            self.transformer.wpe = embedding(config.block_size, config.n_embd)
        else:
            self.set_rope_tables()
        self.embed_scale = config.n_embd**0.5 if config.embed_scale else 1.0  # Gemma's embeddings x sqrt(width)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        if config.value_embeds:  # one table per layer that has them, as wide as its values
            kv_width = config.kv_heads * config.head_width
            layers = [i for i in range(config.n_layer) if has_value_embed(config, i)]
            self.value_embeds = nn.ModuleDict({str(i): embedding(config.vocab_size, kv_width) for i in layers})
        if config.smear:  # the gate's weights over the first channels (a vector: AdamW's), and the share
            self.smear_gate = nn.Parameter(torch.zeros(min(SMEAR_GATE_INPUTS, config.n_embd)))
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.backout:  # per layer: the residual's and the embeddings' weights; the middle layer's share taken off
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        if not building_on_meta():
            self.apply(self._init_weights)
            self.init_switches()

    @torch.no_grad()
    def init_switches(self) -> None:
        """nanochat's starting values: value embeddings as wide as a normal(0, 0.02)'s spread, their gates just open;
        the residual weighed 1.15 down to 1.05 by depth, the embeddings 0.20 down to 0.05, a fifth of the middle out; no
        smear."""
        last = max(self.config.n_layer - 1, 1)
        for i, block in enumerate(self.transformer.h):
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
                nn.init.uniform_(self.value_embeds[str(i)].weight, -(3**0.5) * 0.02, 3**0.5 * 0.02)
            if self.config.backout:
                self.resid_lambdas[i] = 1.15 - 0.10 * i / last
                self.x0_lambdas[i] = 0.20 - 0.15 * i / last
        if self.config.backout:
            self.backout_lambda.fill_(0.2)
        if self.config.smear:  # shut at first (the share 0), the gate half open
            nn.init.uniform_(self.smear_gate, 0.0, 0.02)
            self.smear_lambda.zero_()

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

    def ropes(self, pick, reach) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each kind of layer's (cos, sin) (CausalSelfAttention.rope_kind) at the positions pick(table) selects:
        (T, rotary_width), or (B, 1, T, rotary_width) for rows at positions of their own. reach: the furthest position
        the pass reads (an int, or a tensor (B, 1, 1) per row): where LongRoPE has long factors, the global layers
        take them wherever it is past the original context, as transformers decides by the sequence's length (keys
        cached before keep the short ones)."""
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {"none": None}
        for kind, suffix in (("global", ""), ("local", "_local")):
            if hasattr(self, f"rope_cos{suffix}"):
                ropes[kind] = (pick(getattr(self, f"rope_cos{suffix}")), pick(getattr(self, f"rope_sin{suffix}")))
        if hasattr(self, "rope_cos_long"):
            past = reach >= self.config.rope_original_context
            long = (pick(self.rope_cos_long), pick(self.rope_sin_long))
            if isinstance(past, bool):
                ropes["global"] = long if past else ropes["global"]
            else:
                ropes["global"] = tuple(torch.where(past, a, b) for a, b in zip(long, ropes["global"]))
        for kind, tables in ropes.items():
            if tables is not None and tables[0].dim() == 3:  # (B, T, d) -> (B, 1, T, d): every head alike
                ropes[kind] = (tables[0].unsqueeze(1), tables[1].unsqueeze(1))
        return ropes

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C), scaled where the family does so."""
        x = self.transformer.wte(idx)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def smear(self, x: torch.Tensor, idx: torch.Tensor, cache, positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, T, C) plus, at each token, a gated share of the previous token's embedding; a row's first token and
        a document's (positions 0) have none. With a cache, the cache keeps the tokens and says which came before."""
        if cache is not None:
            before = cache.previous(idx)  # (B, T), -1 where there is none
        else:
            before = F.pad(idx[:, :-1], (1, 0), value=-1)  # (B, T)
            if positions is not None:
                before = before.masked_fill(positions == 0, -1)
        previous = self.embed(before.clamp(min=0)) * (before >= 0).unsqueeze(-1).to(x.dtype)  # (B, T, C)
        gate = torch.sigmoid(x[..., : self.smear_gate.numel()] @ self.smear_gate.to(x.dtype))  # (B, T)
        return x + self.smear_lambda.to(x.dtype) * gate.unsqueeze(-1) * previous

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
        cache=None,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
    ):
        """idx (B, T) token ids -> (logits, loss). loss is None without targets.

        cache: decoding (quillgpt/engine.py's KVCache or GraphCache): the new tokens come after what the cache holds,
        which says where they are (pick, reach) and stores and attends in every layer. last_only returns the logits
        of the final position only (a prompt's pass). positions (B, T), each token's position in its document, 0 at
        each document's first token (packed rows, data.py's Batch): each document then attends only within itself,
        at the positions it would have alone (learned or rotary); a document starting at p > 0 continues the row's
        first one (DocumentMask), so a row may hold more than block_size tokens."""
        B, T = idx.size()
        x = self.embed(idx)  # (B, T, C)
        if self.config.smear:
            x = self.smear(x, idx, cache, positions)
        documents = None
        if cache is not None:
            pick, reach = cache.pick, cache.reach()
        elif positions is None:
            assert T <= self.config.block_size, f"sequence of {T} exceeds block_size {self.config.block_size}"
            pick, reach = (lambda table: table[:T]), T - 1
        else:  # each row's furthest position decides LongRoPE's factors for the row
            pick, reach = (lambda table: table[positions]), positions.amax(1).view(B, 1, 1)
            flex = DocumentMask.flex_trains_here(positions, self.training * self.config.dropout)
            windows = {block.attn.window for block in self.transformer.h}
            documents = {window: DocumentMask(positions, flex, window) for window in windows}
        if self.config.pos_emb == "learned":
            x = x + pick(self.transformer.wpe.weight)  # (T, C) or (B, T, C)
        ropes = self.ropes(pick, reach)
        x = x0 = self.transformer.drop(x)
        middle = None
        for i, block in enumerate(self.transformer.h):
            rope, mask = ropes[block.attn.rope_kind], documents and documents[block.attn.window]
            ve = self.value_embeds[str(i)](idx) if block.attn.ve_gate is not None else None  # (B, T, nkv * hs)
            if self.config.backout:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, rope, None, mask, ve, use_reentrant=False)
            else:
                x = block(x, rope, cache, mask, ve)
            middle = x if i == self.config.n_layer // 2 else middle
        if self.config.backout:
            x = x - self.backout_lambda * middle
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

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context to block_size (fine-tuning a long-context model on shorter sequences)."""
        assert 0 < block_size <= self.config.block_size
        self.config = replace(self.config, block_size=block_size)
        if self.config.pos_emb == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].clone())
        for name, table in list(self.named_buffers(recurse=False)):
            if name.startswith("rope_"):  # the rotary tables, (T, rotary_width) each
                setattr(self, name, table[:block_size].clone())


def summed_nats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of logits (N, V) in fp32, summed over the counted targets (N,) (-1: not counted)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction="sum")
