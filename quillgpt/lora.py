"""LoRA and QLoRA on model.py's GPT: low-rank adapters trained on a frozen base, the base optionally quantized.

    model = add_adapters(base, settings, vocab_size)   # the base frozen, every adapter's B = 0: the base's function
    state = adapter_state(model)                       # what a LoRA checkpoint holds: the trainable tensors only
    plain = merged(model)                              # a plain GPT, each adapter folded into its weight

An adapted linear map computes y = W x + (alpha / rank) * B A dropout(x), A (rank, in) initialised as PEFT and
nn.Linear do (Kaiming-uniform), B (out, rank) zero (Hu et al. 2021). model.py fuses the query, key and value
projections into one c_attn; PEFT (on Hugging Face models) has three, so an adapter here sits on a piece of a
Linear's output: c_attn's q, k or v rows. That keeps each adapter PEFT's shape, so export and import are a renaming
(quillgpt/peft_io.py). Tokens a chat run adds to the base's vocabulary (run_model.adds_chat_tokens) get trainable
rows of their own (the base's rows stay frozen), as PEFT's trainable_token_indices does.

QLoRA (Dettmers et al. 2023): the frozen base's linear weights are stored as int8 (one absmax scale per output row,
as model.Int8Linear for decoding) or NF4 (4-bit NormalFloat codes, one absmax scale per block of 64) and
dequantized to the compute precision in each forward and backward pass, never kept: the activations' gradient needs
the weight, the weight needs no gradient. The embedding, norms and head stay as loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

from model import GATED, GPT
from quillgpt.config import GPTConfig, LoraConfig, lora_targets
from quillgpt.errors import UserError

# target -> (its Linear's path inside a model.py Block, which piece of the Linear's output: q, k, v of c_attn, or None:
# all of it). The names are PEFT's for a Llama layer (config.LORA_TARGETS).
PARTS = {
    "q_proj": ("attn.c_attn", 0),
    "k_proj": ("attn.c_attn", 1),
    "v_proj": ("attn.c_attn", 2),
    "o_proj": ("attn.c_proj", None),
    "gate_proj": ("mlp.c_gate", None),
    "up_proj": ("mlp.c_fc", None),
    "down_proj": ("mlp.c_proj", None),
}
NF4_BLOCK = 64
# the 16 NormalFloat4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact 0 (QLoRA's appendix; the table
# bitsandbytes and torchao use)
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
BYTE_CODES = torch.stack([torch.arange(256) >> 4, torch.arange(256) & 15], dim=-1)  # a byte's two NF4 codes (256, 2)


@dataclass(frozen=True)
class LoraSettings:
    """The adapters a LoRA model has: what a checkpoint records of them and PEFT's adapter_config.json describes."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # config.LORA_TARGETS names, groups expanded
    quantize: str = "none"  # none | int8 | nf4: how the frozen base's linear weights are stored
    dropout: float = 0.0  # on the adapters' input, in training

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lo: LoraConfig, model: GPTConfig) -> LoraSettings:
        """The [lora] section's adapters on this model: a group (mlp, all-linear) leaves out the gate an MLP without
        a gate (SwiGLU, GeGLU) lacks; naming gate_proj itself there is a UserError."""
        targets = lora_targets(lo.targets)
        if model.mlp not in GATED:
            if "gate_proj" in lo.targets:
                raise UserError(no_gate(model))
            targets = tuple(t for t in targets if t != "gate_proj")
        if model.n_experts:
            named = [t for t in lo.targets if t in MLP_TARGETS or t == "mlp"]
            if named:
                raise UserError(no_expert_adapters(named))
            targets = tuple(t for t in targets if t not in MLP_TARGETS)
        return cls(lo.rank, float(lo.alpha), targets, lo.quantize, lo.dropout)

    def as_config(self) -> LoraConfig:
        """The [lora] section a run with these adapters records (config.resolved)."""
        return LoraConfig(True, self.rank, self.alpha, self.dropout, list(self.targets), self.quantize)

    def record(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": list(self.targets),
            "quantize": self.quantize,
            "dropout": self.dropout,
        }

    @classmethod
    def from_record(cls, d: dict, path: str) -> LoraSettings:
        try:
            settings = cls(
                int(d["rank"]), float(d["alpha"]), tuple(d["targets"]), str(d["quantize"]), float(d["dropout"])
            )
        except (KeyError, TypeError, ValueError):
            settings = None
        if settings is None or not set(settings.targets) <= set(PARTS) or settings.rank <= 0:
            raise UserError(f"{path}: its LoRA record is malformed (rank, alpha, targets, quantize, dropout)")
        return settings


# ---- the modules ------------------------------------------------------------------------------------


class Adapter(nn.Module):
    """B @ A, one low-rank update of `out_features` outputs."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's and PEFT's init of lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B)


class LoraLinear(nn.Module):
    """A frozen linear map (an nn.Linear, or a quantized one) with adapters on pieces of its output: piece i gets
    scaling * B A dropout(x) added. pieces: the output's widths (c_attn: q, k, v; else one)."""

    def __init__(
        self, base: nn.Module, pieces: list[int], adapted: dict[str, int], rank: int, scaling: float, p: float
    ):
        super().__init__()
        self.base = base
        self.pieces = pieces
        self.adapted = adapted  # target name -> its piece
        self.scaling = scaling
        self.adapters = nn.ModuleDict({name: Adapter(base.in_features, pieces[i], rank) for name, i in adapted.items()})
        self.dropout = nn.Dropout(p)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # cast once: the base and the adapters save the same copy
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = self.base(x)
        h = self.dropout(x) if self.dropout.p else x
        if len(self.pieces) == 1:
            return y + self.adapters[next(iter(self.adapted))](h) * self.scaling
        outs = list(y.split(self.pieces, dim=-1))
        for name, i in self.adapted.items():
            outs[i] = outs[i] + self.adapters[name](h) * self.scaling
        return torch.cat(outs, dim=-1)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The base's weight (dequantized) with every adapter's scaling * B @ A added, in fp32: (out, in)."""
        w = dense_weight(self.base).float().clone()
        starts = [sum(self.pieces[:i]) for i in range(len(self.pieces))]
        for name, i in self.adapted.items():
            a = self.adapters[name]
            w[starts[i] : starts[i] + self.pieces[i]] += self.scaling * (a.B.float() @ a.A.float())
        return w


class DequantizedLinear(torch.autograd.Function):
    """x @ W^T with W dequantized from its storage in the forward pass and again in the backward (for the gradient of
    x), never saved: a frozen base keeps only its quantized bytes between the passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: nn.Module) -> torch.Tensor:
        ctx.base = base
        return x @ base.dequantized(x.dtype).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.base.dequantized(grad.dtype), None


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear stored as int8 rows or NF4 blocks (buffers, not parameters: nothing to train), computed in
    the autocast precision (else the input's)."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.kind, self.in_features, self.out_features = kind, linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        codes, scale = quantize_int8(w) if kind == "int8" else quantize_nf4(w)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (out, in) in dtype."""
        if self.kind == "int8":
            return self.codes.to(dtype).mul_(self.scale.to(dtype)[:, None])
        return dequantize_nf4(self.codes, self.scale, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        y = DequantizedLinear.apply(x.to(dtype), self)
        return y if self.bias is None else y + self.bias.to(dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) fp32 -> int8 codes (out, in) and one absmax scale per row (out,)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) fp32 -> NF4 codes, two a byte (blocks, 32) uint8, and one absmax scale per block of 64 (blocks,);
    the flattened weight is padded with zeros to whole blocks."""
    flat = w.flatten()
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % NF4_BLOCK)]).view(-1, NF4_BLOCK)  # (blocks, 64)
    scale = flat.abs().amax(dim=1).clamp(min=1e-12)
    levels = torch.tensor(NF4_LEVELS)
    codes = torch.bucketize(flat / scale[:, None], (levels[1:] + levels[:-1]) / 2).to(torch.uint8)  # nearest level
    return (codes[:, 0::2] << 4) | codes[:, 1::2], scale


def dequantize_nf4(
    codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """NF4 blocks back to a (out, in) weight in dtype: each byte looked up as its two levels (a 256-row table)."""
    pairs = torch.tensor(NF4_LEVELS, dtype=dtype, device=codes.device)[BYTE_CODES.to(codes.device)]  # (256, 2)
    w = F.embedding(codes.int(), pairs).view(codes.size(0), -1)  # (blocks, 64)
    w.mul_(scale.to(dtype)[:, None])
    return w.view(-1)[: shape[0] * shape[1]].view(shape)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A frozen base linear map's weight (out, in), dequantized if it is stored quantized."""
    return linear.dequantized(torch.float32) if isinstance(linear, QuantizedLinear) else linear.weight


class GrownEmbedding(nn.Module):
    """The base's token embedding (frozen) with trainable rows for the ids from `start` on (tokens added to it)."""

    def __init__(self, base: nn.Embedding, rows: nn.Parameter):
        super().__init__()
        self.base, self.rows, self.start = base, rows, base.num_embeddings

    @property
    def weight(self) -> torch.Tensor:  # the base's: model.py reads its device and dtype (GPT.new_cache)
        return self.base.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        old = self.base(idx.clamp(max=self.start - 1))
        new = F.embedding((idx - self.start).clamp(min=0), self.rows)
        return torch.where((idx >= self.start).unsqueeze(-1), new, old)

    def full_weight(self) -> torch.Tensor:
        return torch.cat([self.base.weight, self.rows]).detach()


class GrownHead(nn.Module):
    """The base's output head (frozen) with trainable rows (the same ones as the embedding's when tied) for the
    logits of the ids from `start` on."""

    def __init__(self, base: nn.Linear, rows: nn.Parameter):
        super().__init__()
        self.base, self.rows = base, rows

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.base(x), F.linear(x, self.rows)], dim=-1)

    def full_weight(self) -> torch.Tensor:
        return torch.cat([self.base.weight, self.rows]).detach()


# ---- adding, saving, merging ------------------------------------------------------------------------


def add_adapters(
    model: GPT,
    settings: LoraSettings,
    vocab_size: int | None = None,
    base_dtype: torch.dtype = torch.float32,
) -> GPT:
    """Freeze the model and give it the settings' adapters (B = 0: it computes what it computed), in place. The
    model may come in its file's dtype (loading.load_model(as_stored=True)): its linear maps are converted one at a
    time (or quantized), the rest to fp32, so that a bf16 file never exists in fp32 whole.

    vocab_size above the model's gives the added ids trainable rows, starting as the mean of the base's (as
    run_model.grow_vocabulary starts them in a full fine-tune). base_dtype: the precision the frozen linear weights
    of the blocks are kept in when not quantized; a run in bf16 keeps them in bf16, as autocast would cast them at
    every use (the same numbers, half the memory). UserError for a target the model lacks (gate_proj without SwiGLU)."""
    for p in model.parameters():
        p.requires_grad_(False)
    if model.config.mlp not in GATED and "gate_proj" in settings.targets:
        raise UserError(no_gate(model.config))
    kept = set()  # the frozen linear maps' tensors, in base_dtype or quantized
    for block in model.transformer.h:
        untargeted = untargeted_linears(block, settings.targets)
        for path, names in linears_to_adapt(settings.targets).items():
            linear = block.get_submodule(path)
            pieces = list(block.attn.widths) if path == "attn.c_attn" else [linear.out_features]
            adapted = {name: PARTS[name][1] or 0 for name in names}
            base = frozen_base(linear, settings.quantize, base_dtype)
            kept.update(id(p) for p in base.parameters())
            block.set_submodule(
                path, LoraLinear(base, pieces, adapted, settings.rank, settings.scaling, settings.dropout)
            )
        for path in untargeted:
            base = frozen_base(block.get_submodule(path), settings.quantize, base_dtype)
            kept.update(id(p) for p in base.parameters())
            block.set_submodule(path, base)
    for p in model.parameters():  # the rest (embeddings, norms, head) in fp32, whatever dtype the base came in
        if id(p) not in kept and p.dtype != torch.float32:
            p.data = p.data.float()
    if vocab_size is not None and vocab_size > model.config.vocab_size:
        add_token_rows(model, vocab_size)
    model.lora = settings
    return model


MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def no_expert_adapters(named: list[str]) -> str:
    return (
        f"lora.targets: {', '.join(named)}: a mixture of experts' MLPs stay frozen, without adapters (PEFT maps "
        "gate_proj, up_proj and down_proj onto transformers' fused experts, which adapters here do not hold); "
        "target attention: q_proj, k_proj, v_proj, o_proj (all-linear takes those)"
    )


def no_gate(config: GPTConfig) -> str:
    return (
        f"lora.targets: gate_proj: this model's MLP ({config.mlp}) has no gate; its linear maps are "
        f"{', '.join(t for t in PARTS if t != 'gate_proj')}"
    )


def frozen_base(linear: nn.Linear, quantize: str, dtype: torch.dtype) -> nn.Module:
    return QuantizedLinear(linear, quantize) if quantize != "none" else linear.to(dtype)


def linears_to_adapt(targets: tuple[str, ...]) -> dict[str, list[str]]:
    """Each Linear of a block that gets adapters -> the targets on it (c_attn: several)."""
    out: dict[str, list[str]] = {}
    for name in targets:
        out.setdefault(PARTS[name][0], []).append(name)
    return out


def untargeted_linears(block: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The paths of a block's nn.Linear maps that get no adapter (QLoRA quantizes them too)."""
    adapted = {PARTS[name][0] for name in targets}
    return [name for name, m in block.named_modules() if isinstance(m, nn.Linear) and name not in adapted]


def add_token_rows(model: GPT, vocab_size: int) -> None:
    old = model.config.vocab_size
    tied = model.lm_head.weight is model.transformer.wte.weight

    def new_rows(weight: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(weight.detach().float().mean(0, keepdim=True).expand(vocab_size - old, -1).clone())

    rows = new_rows(model.transformer.wte.weight)
    model.transformer.wte = GrownEmbedding(model.transformer.wte, rows)
    model.lm_head = GrownHead(model.lm_head, rows if tied else new_rows(model.lm_head.weight))
    model.config = replace(model.config, vocab_size=vocab_size)


def is_lora(model: nn.Module) -> bool:
    return getattr(model, "lora", None) is not None


def adapter_state(model: GPT) -> dict[str, torch.Tensor]:
    """The trainable tensors by name (a tied row block once): what a LoRA checkpoint holds besides its pointer to
    the base."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model: GPT, state: dict, path: str) -> None:
    """Put a LoRA checkpoint's adapters into the model add_adapters made; UserError on any mismatch."""
    own = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not isinstance(state, dict) or set(state) != set(own):
        missing, unexpected = sorted(set(own) - set(state or {})), sorted(set(state or {}) - set(own))
        raise UserError(
            f"{path}: its adapters do not match the LoRA model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, p in own.items():
            t = state[name]
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise UserError(
                    f"{path}: adapter {name} is {shape}, the model needs {list(p.shape)} (adapters for another base?)"
                )
            p.copy_(t)


@torch.no_grad()
def merged(model: GPT) -> GPT:
    """A plain GPT computing what the LoRA model computes, in fp32 on the CPU: each adapted weight W + scaling * B @ A,
    quantized weights dequantized first (the base the adapters trained against; folding them into the quantized
    codes in place would round their update away, far below one quantization step), added token rows appended. The
    LoRA model is left as it is."""
    plain = GPT(model.config)
    modules = dict(model.named_modules())
    state = {}
    for key in plain.state_dict():
        owner, _, attr = key.rpartition(".")
        state[key] = merged_tensor(modules[owner], attr).detach().float().cpu()
    plain.load_state_dict(state)
    return plain


def merged_tensor(module: nn.Module, attr: str) -> torch.Tensor:
    """The plain model's `attr` of the module at the same place in the LoRA model."""
    if attr == "weight" and isinstance(module, LoraLinear):
        return module.merged_weight()
    if attr == "weight" and isinstance(module, QuantizedLinear):
        return module.dequantized(torch.float32)
    if attr == "weight" and isinstance(module, (GrownEmbedding, GrownHead)):
        return module.full_weight()
    return getattr(module.base if isinstance(module, LoraLinear) else module, attr)


def trainable_summary(model: GPT) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) + sum(
        m.codes.numel() * (2 if m.kind == "nf4" else 1) for m in model.modules() if isinstance(m, QuantizedLinear)
    )
    return f"{trainable / 1e6:.2f}M trainable of {total / 1e6:.2f}M ({trainable / total:.2%})"
