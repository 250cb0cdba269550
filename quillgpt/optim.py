"""Optimizers and the learning-rate schedule: AdamW (decay on matrices and embeddings, not on 1-D
parameters; fused where the device has it), Muon for the 2-D hidden matrices, and linear warmup +
cosine decay. Every param group carries `base_lr`; the schedule scales all of them by one factor.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn

from quillgpt.config import Config, OptimizerConfig


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(2-D hidden matrices, embeddings + head, 1-D params) of a GPT: Muon takes the first group only. Embeddings
    are every nn.Embedding's table (tokens, positions, value embeddings) and the head."""
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} | {id(model.lm_head.weight)}
    hidden, embed, flat = [], [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        if id(p) in embed_ids:
            embed.append(p)
        elif p.dim() >= 2:
            hidden.append(p)
        else:
            flat.append(p)
    return hidden, embed, flat


def make_optimizers(
    model: nn.Module, o: OptimizerConfig, device_type: str, matmul_dtype: torch.dtype = torch.bfloat16
) -> list[torch.optim.Optimizer]:
    """[AdamW] for optimizer.name = adamw; [Muon for the hidden matrices, AdamW for the rest] for muon.

    fused = None picks fused AdamW where the device has it (CUDA and CPU)."""
    hidden, embed, flat = param_groups(model)
    fused = o.fused
    if fused is None:
        fused = device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters
    betas = (o.beta1, o.beta2)
    adam_kw = dict(betas=betas, fused=True) if fused else dict(betas=betas, foreach=False, fused=False)
    lr = o.learning_rate
    if o.name == "adamw":
        groups = [
            {"params": hidden + embed, "weight_decay": o.weight_decay, "base_lr": lr},
            {"params": flat, "weight_decay": 0.0, "base_lr": lr},
        ]
        return [torch.optim.AdamW(groups, lr=lr, **adam_kw)]
    if o.name == "muon":
        groups = [
            {"params": embed, "weight_decay": o.weight_decay, "base_lr": lr},
            {"params": flat, "weight_decay": 0.0, "base_lr": lr},
        ]
        adam = torch.optim.AdamW(groups, lr=lr, **adam_kw)
        muon = make_muon(
            [{"params": hidden, "base_lr": o.muon_lr}],
            lr=o.muon_lr,
            momentum=o.muon_momentum,
            weight_decay=o.weight_decay,
            ns_dtype=matmul_dtype,
            polar_express=o.muon_coefficients == "polar_express",
            normuon=o.normuon,
        )
        return [muon, adam]
    raise ValueError(f"unknown optimizer {o.name!r}")


def lr_multiplier(it: int, cfg: Config, seconds: float = 0.0) -> float:
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, or (schedule "wsd") the peak held and a linear
    warmdown to min_lr over the last warmdown_ratio of lr_decay_iters; then constant; as a fraction of peak. Under
    training.time_budget_s the decay runs over the budget's seconds instead (`seconds` of it spent), warmup in steps."""
    o = cfg.optimizer
    if not o.decay_lr:
        return 1.0
    decay_iters = o.lr_decay_iters or cfg.training.max_iters
    floor = o.min_lr / o.learning_rate
    if it < o.warmup_iters:
        return (it + 1) / (o.warmup_iters + 1)
    if cfg.training.time_budget_s > 0:
        spent = min(1.0, seconds / cfg.training.time_budget_s)
        left = (
            min(1.0, (1.0 - spent) / o.warmdown_ratio)
            if o.schedule == "wsd"
            else 0.5 * (1.0 + math.cos(math.pi * spent))
        )
        return floor + left * (1.0 - floor)
    if it >= decay_iters:
        return floor
    if o.schedule == "wsd":
        warmdown = max(1, round(o.warmdown_ratio * decay_iters))
        left = min(1.0, (decay_iters - it) / warmdown)  # 1 until the warmdown starts, then down to 0 at decay_iters
        return floor + left * (1.0 - floor)
    ratio = (it - o.warmup_iters) / max(1, decay_iters - o.warmup_iters)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    """Scale every group's base_lr; returns the last optimizer's first group's lr (AdamW's, for the log)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
    return optimizers[-1].param_groups[0]["lr"]


# ---- Muon ----------------------------------------------------------------------------------------


def make_muon(
    groups: list[dict],
    lr: float,
    momentum: float,
    weight_decay: float,
    ns_dtype: torch.dtype = torch.bfloat16,
    polar_express: bool = False,
    normuon: bool = False,
) -> torch.optim.Optimizer:
    return Muon(
        groups,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        ns_dtype=ns_dtype,
        polar_express=polar_express,
        normuon=normuon,
    )


QUINTIC = [(3.4445, -4.7750, 2.0315)] * 5  # Keller Jordan's, the same each step
# Polar Express (Amsel et al., arXiv 2505.16932): a coefficient triple per step, for 5 steps (safety factor 2e-2,
# cushion 2), as nanochat's and modded-nanogpt's Muon have them
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
NORMUON_BETA2 = 0.9  # nanochat's


def zeropower_via_newtonschulz(
    G: torch.Tensor,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: list[tuple[float, float, float]] = QUINTIC,
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of G (G, m, n) in `dtype`: Keller Jordan's quintic Newton-Schulz
    iteration, as torch.optim.Muon runs it for one matrix, here for a batch of same-shape matrices at once; or with
    Polar Express's coefficients (the norm divided with 1% to spare, as nanochat does, since its first steps are
    steep)."""
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT  # (G, n, m): the Gram matrix on the short side
    if coefficients is QUINTIC:
        X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    else:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    for a, b, c in coefficients[:steps]:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return X.mT if tall else X


def variance_reduced(ortho: torch.Tensor, buffers: list[torch.Tensor], weight) -> torch.Tensor:
    """NorMuon (arXiv 2510.05491, as nanochat runs it): each row (a tall matrix: each column) of an orthogonalised
    update (G, m, n) scaled by 1/sqrt of a running mean of its squared entries, then the whole matrix rescaled to its
    norm before; buffers: each matrix's running mean, (m, 1) or (1, n), moved by `weight` (1 - beta2, times 0 for a
    skipped step)."""
    dim = -1 if ortho.size(-2) >= ortho.size(-1) else -2
    u = ortho.float()
    mean = u.square().mean(dim=dim, keepdim=True)  # (G, m, 1) or (G, 1, n)
    stacked = torch.stack(buffers)
    stacked.lerp_(mean, weight)
    torch._foreach_copy_(buffers, list(stacked.unbind(0)))
    scaled = u * stacked.clamp_min(1e-10).rsqrt()
    norm = u.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return (scaled * norm).to(ortho.dtype)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update (Nesterov momentum, bf16 quintic Newton-Schulz, Moonshot's match_rms_adamw scale
    0.2 * sqrt(max(m, n)) so AdamW's learning rates carry over, decoupled weight decay), with the Newton-Schulz
    iterations of same-shape matrices batched: one chain of bmm per shape instead of one of mm per matrix. State and
    checkpoints are torch.optim.Muon's (a momentum_buffer per matrix), so either resumes the other's.

    Like fused AdamW, it honours GradScaler's protocol: a `found_inf` tensor set on the optimizer (by GradScaler, or by
    the trainer for a non-finite gradient) makes the step leave weights and buffers as they are, decided on the device,
    so the host never waits for the flag."""

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.bfloat16,
        polar_express: bool = False,
        normuon: bool = False,
    ):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        self.ns_dtype = ns_dtype  # bf16 as torch.optim.Muon; fp32 where bf16 matmuls are emulated
        self.coefficients = POLAR_EXPRESS if polar_express else QUINTIC
        self.normuon = normuon  # a second_momentum_buffer per matrix besides torch.optim.Muon's momentum_buffer

    @torch.no_grad()
    def step(self, closure=None):
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        keep = None if found_inf is None else 1.0 - found_inf.float()  # 0-dim: 0 skips the step
        for group in self.param_groups:
            batches: dict[tuple, list[torch.nn.Parameter]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    batches.setdefault((p.shape, p.dtype), []).append(p)
            for params in batches.values():
                grads = [p.grad for p in params]
                if grad_scale is not None:  # GradScaler left the gradients scaled
                    grads = torch._foreach_div(grads, grad_scale)
                if keep is not None:  # a skipped step's gradients may hold NaN, which no mask can multiply away
                    grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
                self.update(params, grads, group, keep)

    def update(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor], group: dict, keep=None) -> None:
        lr, momentum = group["lr"], group["momentum"]
        bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        # keep (0-dim, on the device) goes in as one weight per tensor: as a single tensor weight, _foreach_lerp_ would
        # read it back to the host (a sync per shape group on a GPU)
        torch._foreach_lerp_(bufs, grads, 1 - momentum if keep is None else [(1 - momentum) * keep] * len(bufs))
        # Nesterov, written straight into the batch: stacking an (m, n) matrix with transposed (n, m) ones (to share a
        # chain) needs a transposing copy that costs more than the chain it saves (docs/LOG.md)
        update = grads[0].new_empty((len(params), *params[0].shape))  # (G, m, n)
        for grad, buf, out in zip(grads, bufs, update.unbind(0)):
            torch.lerp(grad, buf, momentum, out=out)
        # a stack of matrices (an MoE's experts, (E, m, n)) is orthogonalised matrix by matrix: (G * E, m, n)
        flat = update.flatten(0, -3)  # (G * E, m, n)
        ortho = zeropower_via_newtonschulz(flat, group["ns_steps"], dtype=self.ns_dtype, coefficients=self.coefficients)
        if self.normuon:
            m, n = flat.shape[-2:]
            shape = (m, 1) if m >= n else (1, n)
            state = [
                self.state[p].setdefault("second_momentum_buffer", flat.new_zeros(*p.shape[:-2], *shape))
                for p in params
            ]
            second = [view for b in state for view in b.view(-1, *shape).unbind(0)]  # one per matrix of flat
            weight = 1 - NORMUON_BETA2 if keep is None else (1 - NORMUON_BETA2) * keep
            ortho = variance_reduced(ortho, second, weight)
        ortho = ortho.view_as(update).to(params[0].dtype)
        scale = 0.2 * math.sqrt(max(params[0].shape[-2:]))
        if keep is None:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for p, u in zip(params, ortho.unbind(0)):
                p.add_(u, alpha=-lr * scale)
        else:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"] * keep)
            step = -lr * scale * keep
            for p, u in zip(params, ortho.unbind(0)):
                p.addcmul_(u, step)
