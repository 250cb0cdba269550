"""The one GPT definition used by train.py, sample.py, bench.py and export.py.

Defaults reproduce GPT-2 (learned positions, LayerNorm, GELU MLP, tied embeddings), so GPT-2
weights load unchanged. A modern recipe is available through switches: rotary positions,
RMSNorm, QK-norm, ReLU^2 / SwiGLU MLPs, untied embeddings, logit soft-capping, zero-initialised
output projections, and Muon for the 2-D hidden weights.

References: nanoGPT's model.py; GPT-2 (Radford et al. 2019); RoFormer (Su et al. 2021);
modded-nanogpt for QK-norm, ReLU^2, soft-capping and Muon.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GPTConfig:
    """Model arguments. Stored in every checkpoint as a plain dict; rebuilds the model."""

    block_size: int = _f(1024, "context length in tokens")
    vocab_size: int | None = _f(None, "vocabulary size; None takes the dataset's exactly (set a larger multiple of 64 yourself for speed)")
    n_layer: int = _f(12, "number of transformer blocks")
    n_head: int = _f(12, "attention heads per block")
    n_embd: int = _f(768, "model width")
    dropout: float = _f(0.0, "dropout probability in [0, 1)")
    bias: bool = _f(True, "bias in Linear and norm layers (GPT-2: true)")
    pos_emb: str = _f("learned", "position encoding: learned | rope", choices=("learned", "rope"))
    norm: str = _f("layernorm", "normalisation: layernorm | rmsnorm", choices=("layernorm", "rmsnorm"))
    qk_norm: bool = _f(False, "normalise queries and keys before attention")
    mlp: str = _f("gelu", "MLP activation: gelu | relu2 | swiglu", choices=("gelu", "relu2", "swiglu"))
    gelu_approx: str = _f("none", "GELU form: none (exact erf) | tanh (OpenAI GPT-2's gelu_new)", choices=("none", "tanh"))
    tie_embeddings: bool = _f(True, "share the token embedding and output head weights")
    logit_softcap: float = _f(0.0, "soft-cap logits at this value with tanh (0 = off)")
    zero_init_proj: bool = _f(False, "zero-initialise the attention/MLP output projections and the head")
    rope_theta: float = _f(10000.0, "rotary base frequency (pos_emb = rope)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model arguments: {sorted(unknown)}")
        return cls(**d)

    @property
    def is_gpt2_compatible(self) -> bool:
        return not self.gpt2_incompatibilities()

    def gpt2_incompatibilities(self) -> list[str]:
        """The switches that make this model differ from GPT-2's architecture, as 'name = value' strings."""
        gpt2 = dict(pos_emb="learned", norm="layernorm", qk_norm=False, mlp="gelu", tie_embeddings=True, logit_softcap=0.0)
        return [f"{k} = {getattr(self, k)!r}" for k, v in gpt2.items() if getattr(self, k) != v]


class RMSNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32, as autocast runs LayerNorm: a bf16 input with an fp32 weight misses the fused kernel
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), 1e-5).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's can't switch bias off on older versions)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


def make_norm(config: GPTConfig, ndim: int | None = None) -> nn.Module:
    cls = RMSNorm if config.norm == "rmsnorm" else LayerNorm
    return cls(ndim or config.n_embd, config.bias)


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hs); rotate the two halves of each head as complex pairs
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class KVCache:
    """Per-layer key/value buffers for generation: each new token costs one position."""

    def __init__(self, n_layer: int, batch: int, n_head: int, length: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        shape = (batch, n_head, length, head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.pos = 0  # number of positions filled

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.size(2)
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        end = self.pos + T
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def cpu_keep_mask(shape: torch.Size, p: float, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, float]:
    """A dropout keep-mask of 0s and 1s in `dtype`, drawn 16 bits per element, and the scale that keeps
    expectations unchanged.

    On the CPU, F.dropout's bernoulli_ draws one random number per element (~90M/s on 2 cores);
    taking four 16-bit draws out of each 64-bit word is several times faster. p is rounded to a
    multiple of 1/65536 and the scale uses the rounded value, so E[mask * scale] = 1. The mask is
    0/1 rather than 0/scale because a bf16 scale (1/0.9 -> 1.109) would bias every activation."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2**63, 2**63 - 1)
    bits = words.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    dropped = round(p * 65536)
    # one conversion here: multiplying by a bool mask converts it again in forward and backward
    return (bits >= dropped - 32768).to(dtype), 65536 / (65536 - dropped)


class Dropout(nn.Dropout):
    """nn.Dropout, with the faster mask of cpu_keep_mask in eager CPU training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu" or torch.compiler.is_compiling():
            return super().forward(x)
        keep, scale = cpu_keep_mask(x.shape, self.p, x.dtype, x.device)
        return x * keep * scale


def causal_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled attention scores with the future masked out: q, k (B, nh, T, hs) -> (B, nh, T, T)."""
    T = q.size(-2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # scaling q: T x hs multiplies, not T x T
    return scores.masked_fill_(future, float("-inf"))


def cpu_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Causal attention with dropout on the probabilities, written out (as SDPA's CPU math path
    computes it) so that the mask comes from cpu_keep_mask: q, k, v (B, nh, T, hs) -> (B, nh, T, hs).
    The softmax stays in the input dtype: in fp32 its backward (with the casts around it) was the
    slowest op of the bf16 step, 16 ms per layer against 0.6 ms in bf16 at (8, 6, 256, 256)."""
    att = causal_scores(q, k).softmax(-1)
    keep, scale = cpu_keep_mask(att.shape, p, att.dtype, att.device)
    return (att * keep) @ v * scale  # (B, nh, T, hs): the scale goes on the smaller tensor


class CPUCausalAttention(torch.autograd.Function):
    """Causal attention for bf16 training on the CPU: PyTorch's flash kernel forward, a matmul backward.

    The CPU flash kernel's backward is slow in bf16 (3x its fp32 time at T = 64); recomputing the
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


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.layer = layer
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = config.dropout
        self.resid_dropout = Dropout(config.dropout)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # with a cache, a single new query attends to every cached key: no mask needed
        is_causal = cache is None or cache.pos == 0
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        dropout = self.dropout if self.training else 0.0
        cpu_training = q.requires_grad and q.device.type == "cpu" and cache is None and T > 1
        if cpu_training and dropout and not torch.compiler.is_compiling():  # inductor fuses its own mask
            y = cpu_dropout_attention(q, k, v, dropout)
        elif cpu_training and not dropout and q.dtype == torch.bfloat16:
            y = CPUCausalAttention.apply(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal and T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        self.gelu_approx = config.gelu_approx
        hidden = 4 * config.n_embd
        if self.kind == "swiglu":  # same parameter count as a 4x GELU MLP
            hidden = 64 * math.ceil(2 * hidden / 3 / 64)
            self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.c_proj.is_residual_proj = True
        self.dropout = Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "gelu":
            h = F.gelu(h, approximate=self.gelu_approx)
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.silu(self.c_gate(x)) * h
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope=None, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.vocab_size is not None, "vocab_size must be resolved before building the model"
        self.config = config
        self.gradient_checkpointing = False
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:
            cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, last_only: bool = False):
        """idx (B, T) token ids -> (logits, loss). loss is None without targets.

        last_only returns logits for the final position only (generation)."""
        B, T = idx.size()
        start = cache.pos if cache is not None else 0
        assert start + T <= self.config.block_size, f"sequence of {start + T} exceeds block_size {self.config.block_size}"
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if self.config.pos_emb == "learned":
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
            x = x + self.transformer.wpe(pos)
        else:
            rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T])  # (T, hs/2)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope, cache)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, [-1], :]  # (B, 1, C)
        logits = self.lm_head(x)  # (B, T, V)
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # ---- accounting -------------------------------------------------------------------------

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights plus the attention scores (PaLM appendix B)."""
        cfg = self.config
        N = self.num_params()
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return 6 * N + 12 * L * H * Q * T

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
        return self.flops_per_token() * tokens_per_second / peak_flops

    # ---- optimizers ---------------------------------------------------------------------------

    def param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
        """(2-D hidden matrices, embeddings + head, 1-D params): Muon takes the first group only."""
        embed_ids = {id(self.transformer.wte.weight), id(self.lm_head.weight)}
        if "wpe" in self.transformer:
            embed_ids.add(id(self.transformer.wpe.weight))
        hidden, embed, flat = [], [], []
        for p in self.parameters():  # parameters() yields a tied weight once
            if not p.requires_grad:
                continue
            if id(p) in embed_ids:
                embed.append(p)
            elif p.dim() >= 2:
                hidden.append(p)
            else:
                flat.append(p)
        return hidden, embed, flat

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str, optimizer: str = "adamw", fused: bool | None = None,
                             muon_lr: float = 0.02, muon_momentum: float = 0.95) -> list[torch.optim.Optimizer]:
        """AdamW with decay on matrices only (no decay on 1-D params); optionally Muon for hidden matrices.

        Returns a list of optimizers; each param group carries `base_lr` so the LR schedule can
        scale every group by the same factor. fused=None picks fused AdamW where the device has it.
        """
        hidden, embed, flat = self.param_groups()
        if fused is None:
            fused = device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
        adam_kw = dict(betas=betas, fused=True) if fused else dict(betas=betas, foreach=False, fused=False)
        if optimizer == "adamw":
            groups = [{"params": hidden + embed, "weight_decay": weight_decay, "base_lr": learning_rate},
                      {"params": flat, "weight_decay": 0.0, "base_lr": learning_rate}]
            return [torch.optim.AdamW(groups, lr=learning_rate, **adam_kw)]
        if optimizer == "muon":
            groups = [{"params": embed, "weight_decay": weight_decay, "base_lr": learning_rate},
                      {"params": flat, "weight_decay": 0.0, "base_lr": learning_rate}]
            adam = torch.optim.AdamW(groups, lr=learning_rate, **adam_kw)
            muon = make_muon([{"params": hidden, "base_lr": muon_lr}], lr=muon_lr, momentum=muon_momentum,
                             weight_decay=weight_decay)
            return [muon, adam]
        raise ValueError(f"unknown optimizer {optimizer!r}")

    # ---- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
                        generator: torch.Generator | None = None, vocab_limit: int | None = None) -> Iterator[torch.Tensor]:
        """Yield (B, 1) new tokens one at a time. temperature 0 is greedy.

        vocab_limit masks ids the tokenizer can't decode (a vocabulary padded for speed).
        The prompt is cropped to its last block_size tokens. With the KV cache, each step runs one
        position; when the cache is full it is refilled from the last block_size/2 tokens (learned
        positions make a sliding window impossible), so beyond block_size the two paths differ.
        """
        block = self.config.block_size
        idx = idx[:, -block:]
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -block:], last_only=True)
            else:
                if cache is None or cache.pos >= block:
                    context = idx[:, -(block // 2):] if cache is not None else idx
                    cache = self.new_cache(idx.size(0))
                    logits, _ = self(context, cache=cache, last_only=True)
                else:
                    logits, _ = self(idx[:, -1:], cache=cache, last_only=True)
            logits = logits[:, -1, :].float()
            if vocab_limit is not None and vocab_limit < logits.size(-1):
                logits[:, vocab_limit:] = -float("inf")
            next_token = sample_next(logits, temperature, top_k, top_p, generator)
            idx = torch.cat((idx, next_token), dim=1)
            yield next_token

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
        """(B, T) prompt -> (B, T + max_new_tokens), the prompt cropped to block_size as in generate_stream."""
        new = list(self.generate_stream(idx, max_new_tokens, **kw))
        return torch.cat([idx[:, -self.config.block_size:], *new], dim=1) if new else idx

    def new_cache(self, batch: int) -> KVCache:
        cfg = self.config
        p = self.lm_head.weight
        return KVCache(cfg.n_layer, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head, p.device, p.dtype)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > top_p  # keep the smallest set whose mass reaches top_p
        sorted_logits[drop] = -float("inf")
        logits = torch.full_like(logits, -float("inf")).scatter(1, sorted_idx, sorted_logits)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# ---- Muon ---------------------------------------------------------------------------------------

def make_muon(groups: list[dict], lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch.optim.Muon where the installed torch has it, else our short implementation."""
    if hasattr(torch.optim, "Muon"):
        return torch.optim.Muon(groups, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                nesterov=True, adjust_lr_fn="match_rms_adamw")
    return Muon(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)


def zeropower_via_newtonschulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately orthogonalise G (Keller Jordan's quintic Newton-Schulz iteration)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.float()
    transposed = X.size(0) > X.size(1)
    if transposed:
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if transposed else X


class Muon(torch.optim.Optimizer):
    """Momentum + Newton-Schulz orthogonalised update for 2-D weights (fallback for torch < 2.9)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = zeropower_via_newtonschulz(p.grad.lerp(buf, group["momentum"]))
                # match AdamW's update RMS so the same lr scale works (Moonshot's rule)
                scale = 0.2 * math.sqrt(max(p.size(0), p.size(1)))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)
