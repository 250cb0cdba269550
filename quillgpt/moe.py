"""A mixture-of-experts MLP: the block's feed-forward part as n_experts small MLPs, each token sent to k of them.

One module, read top to bottom:
    routing    a linear router scores the experts; softmax, top-k, optionally renormalised (as transformers' Qwen3-MoE,
               Mixtral and OLMoE route, ties included, so their weights load unchanged);
    dispatch   dropless: the (token, expert) pairs sorted by expert, each expert run on its contiguous block of rows
               (torch._grouped_mm on CUDA in bf16; a loop over the experts elsewhere), the outputs scaled by the
               routing weights and added back to their tokens. No Python loop over tokens, no token dropped;
    balancing  the Switch/Mixtral auxiliary loss or DeepSeek-V3's auxiliary-loss-free bias (config.balance), and
               ST-MoE's router z-loss.
The block builds it from the config in place of the dense MLP (model.make_mlp) and does not know which it holds. GPT
adds the layers' router losses to the training loss; the trainer keeps their balance over each step (RouterTally),
moves the biases and reports both. Expert parallelism (experts on different devices) is out of scope: under DDP and
FSDP every rank holds every expert. docs/moe.md has the switches, docs/benchmarks.md the measurements.

References: Shazeer et al. 2017 (sparsely-gated MoE); Switch Transformer (Fedus et al. 2021) for the auxiliary loss;
ST-MoE (Zoph et al. 2022) for the z-loss; DeepSeek-V3 (2024) for the bias; MegaBlocks (Gale et al. 2022) for dropless
dispatch by sorting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

from quillgpt.config import GPTConfig


class Routing(NamedTuple):
    """Where one forward sends its N tokens."""

    logits: torch.Tensor  # (N, E) the router's scores, in the compute dtype
    probs: torch.Tensor  # (N, E) their softmax in fp32
    experts: torch.Tensor  # (N, k) the chosen experts, best first
    weights: torch.Tensor  # (N, k) their weights, in the compute dtype


class MoE(nn.Module):
    """(B, T, C) -> (B, T, C): each token through its top-k of n_experts MLPs (and through the shared experts, if any),
    weighted by the router. The experts are of the dense MLP's kind: model.make_mlp, which builds this layer for the
    block, gives their hidden width, activation, whether they are gated (swiglu, geglu: act(x W_gate) * x W_up) and
    the shared experts' MLP.

    After each forward the layer keeps, for the trainer: router_loss (the weighted aux and z-losses, with their
    gradient: GPT adds it to the training loss), and detached for reporting load (E,) (tokens per expert), aux_loss and
    z_loss (unweighted)."""

    grouped_mm: bool | None = None  # None: torch._grouped_mm where it runs (CUDA, bf16); True/False force it (tests)

    def __init__(
        self,
        config: GPTConfig,
        hidden: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        gated: bool,
        shared: nn.Module | None = None,
    ):
        super().__init__()
        E, C, H = config.n_experts, config.n_embd, hidden
        self.n_experts, self.k, self.hidden = E, config.experts_per_token, H
        self.renormalize, self.balance = config.router_renormalize, config.balance
        self.aux_loss_coef, self.z_loss_coef = config.aux_loss_coef, config.router_z_loss_coef
        self.bias_update_rate = config.bias_update_rate
        self.act = act  # the dense MLP's: gelu, relu2, or the gate's silu (swiglu) or gelu (geglu)
        self.router = nn.Linear(C, E, bias=False)
        # the experts' weights stacked, each (out, in) as nn.Linear stores it: transformers' layout
        if gated:
            self.w_gate = nn.Parameter(torch.empty(E, H, C))
        self.w_up = nn.Parameter(torch.empty(E, H, C))
        self.w_down = nn.Parameter(torch.empty(E, C, H))
        self.shared = shared  # DeepSeek's shared experts: one dense MLP every token goes through, unweighted
        # DeepSeek-V3's e_score_correction_bias: moves the choice of experts only, never their weights. A persistent
        # buffer: checkpoints keep it, so a resumed run chooses as the straight run does
        self.register_buffer("router_bias", torch.zeros(E) if config.balance == "bias" else None)
        self.dropout = nn.Dropout(config.dropout)
        self.init_experts(config)

    @torch.no_grad()
    def init_experts(self, config: GPTConfig) -> None:
        """As GPT._init_weights initialises an nn.Linear (which these stacked weights are not): N(0, 0.02), the output
        projection scaled by 1/sqrt(2 * n_layer), or zero with zero_init_proj. Not on the meta device (model.building_on_meta)."""
        if self.w_up.is_meta:
            return
        for w in (getattr(self, "w_gate", None), self.w_up):
            if w is not None:
                nn.init.normal_(w, std=0.02)
        nn.init.normal_(self.w_down, std=0.02 / (2 * config.n_layer) ** 0.5)
        if config.zero_init_proj:
            nn.init.zeros_(self.w_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C): routing and dispatch see tokens, not sequences
        routing = self.route(flat)
        out, load = self.dispatch(flat, routing)
        if self.training:  # what training reads (its loss, the trainer's tally); inference keeps nothing, computes less
            self.keep_balance(routing, load)
        out = self.dropout(out)
        if self.shared is not None:
            out = out + self.shared(flat)  # every token, unweighted (DeepSeek's shared experts)
        return out.view(B, T, C)

    # ---- routing ------------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """x (N, C) -> the top-k experts of each token and their weights, as transformers computes them: softmax in
        fp32, torch.topk on the probabilities (so ties break alike), renormalised if configured, cast to the logits'
        dtype (x's, or the autocast dtype). With the bias, the top-k of probs + bias choose; the weights are the
        chosen experts' unbiased probabilities."""
        logits = self.router(x)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.router_bias is None:
            weights, experts = torch.topk(probs, self.k, dim=-1)  # (N, k)
        else:
            experts = torch.topk(probs + self.router_bias, self.k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, experts, weights.to(logits.dtype))

    # ---- dispatch -----------------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C) -> (the weighted sum of each token's experts' outputs (N, C), tokens per expert (E,)).

        The N*k (token, expert) pairs are sorted by expert (stably: each block keeps its tokens in order), so expert
        e's rows are one contiguous block, ending where searchsorted says: one gather in, one matmul per expert and
        weight (or one grouped matmul for all), one index_add back."""
        pair_expert = routing.experts.reshape(-1)  # (S,), S = N*k pairs, token-major
        order = torch.argsort(pair_expert, stable=True)  # (S,) the pairs by expert
        pair_token = order // self.k  # (S,) each sorted pair's token
        everyone = torch.arange(self.n_experts, device=x.device)
        ends = torch.searchsorted(pair_expert[order], everyone, right=True)  # (E,) where each expert's block ends
        y = self.run_experts(x[pair_token], ends, routing.logits.dtype)  # (S, C)
        y = y * routing.weights.reshape(-1)[order, None]  # (S, C), each row times its pair's weight
        out = torch.zeros_like(x).index_add(0, pair_token, y.to(x.dtype))  # (N, C): a token's k rows summed
        return out, torch.diff(ends, prepend=ends.new_zeros(1))

    def run_experts(self, rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows (S, C), sorted by expert, through their experts' MLPs -> (S, C), in `dtype` (the compute dtype)."""
        matmul = self.expert_matmul(rows, dtype)
        rows = rows.to(dtype)
        if hasattr(self, "w_gate"):
            h = self.act(matmul(rows, self.w_gate.to(dtype), ends)) * matmul(rows, self.w_up.to(dtype), ends)
        else:
            h = self.act(matmul(rows, self.w_up.to(dtype), ends))  # (S, H)
        return matmul(h, self.w_down.to(dtype), ends)

    def expert_matmul(self, rows: torch.Tensor, dtype: torch.dtype) -> Callable:
        """grouped_matmul where torch._grouped_mm runs (CUDA, bf16: its kernel's; widths multiples of 8 for its
        16-byte alignment), else looped_matmul. Either way (S, in) rows by (E, out, in) weights -> (S, out)."""
        grouped = self.grouped_mm
        if grouped is None:
            aligned = rows.size(-1) % 8 == 0 and self.hidden % 8 == 0
            grouped = rows.is_cuda and dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm")
        return grouped_matmul if grouped else looped_matmul

    # ---- balancing ----------------------------------------------------------------------------------

    def keep_balance(self, routing: Routing, load: torch.Tensor) -> None:
        """The router's losses of this forward and its tokens per expert. aux: the Switch/Mixtral loss, E * sum_e
        (share of the tokens routed to e) * (mean probability of e), transformers' load_balancing_loss_func for one
        layer (k when perfectly balanced, at most E * k). z: ST-MoE's mean squared logsumexp of the router's logits,
        which keeps them small. The aux loss trains the router only when balance = aux_loss; it is reported anyway."""
        tokens = routing.probs.size(0)
        aux = self.n_experts * (load.float() / tokens * routing.probs.mean(dim=0)).sum()
        z = torch.logsumexp(routing.logits.float(), dim=-1).square().mean()
        self.router_loss = self.z_loss_coef * z
        if self.balance == "aux_loss":
            self.router_loss = self.router_loss + self.aux_loss_coef * aux
        self.load, self.aux_loss, self.z_loss = load.detach().float(), aux.detach(), z.detach()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, keep: torch.Tensor | float = 1.0) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's bias moves by
        bias_update_rate, up if it got fewer tokens than the mean over the step, down if more. load (E,): the
        step's tokens per expert (all micro-steps, all ranks: every rank moves its copy alike); keep 0 leaves the
        bias as it is (a step skipped for a non-finite gradient)."""
        self.router_bias += self.bias_update_rate * torch.sign(load.mean() - load) * keep

    def inactive_params(self) -> int:
        """The parameters a token does not use: the experts it is not routed to (FLOPs count the rest)."""
        # from the shapes alone: under FSDP indexing a sharded weight would be a collective
        stacked = sum(w.numel() for w in (getattr(self, "w_gate", None), self.w_up, self.w_down) if w is not None)
        return (self.n_experts - self.k) * stacked // self.n_experts


# ---- the per-expert matmul: grouped, or a loop over the experts' blocks ---------------------------------------------


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows (S, in) sorted by expert, weights (E, out, in), ends (E,) -> (S, out): one kernel for every expert's block
    (torch._grouped_mm takes the weights as (E, in, out) and the blocks' ends as int32 offsets)."""
    return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=ends.to(torch.int32))


@torch.library.custom_op("quillgpt::looped_matmul", mutates_args=())
def looped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """grouped_matmul as E matmuls, one per expert's block. The blocks' lengths are data, read to the host once: an
    opaque op (with its backward below), so that torch.compile (fullgraph too) sees fixed shapes around it."""
    out = rows.new_empty(rows.size(0), weights.size(1))  # (S, out): the blocks cover every row
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(rows[start:end], weights[e].t(), out=out[start:end])
        start = end
    return out


@torch.library.custom_op("quillgpt::looped_matmul_backward", mutates_args=())
def looped_matmul_backward(
    rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of looped_matmul's rows (S, in) and weights (E, out, in) from the output's grad (S, out)."""
    grad_rows, grad_weights = torch.empty_like(rows), torch.zeros_like(weights)  # an expert without rows: zero
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(grad[start:end], weights[e], out=grad_rows[start:end])
        if end > start:
            torch.mm(grad[start:end].t(), rows[start:end], out=grad_weights[e])
        start = end
    return grad_rows, grad_weights


@looped_matmul.register_fake
def _(rows, weights, ends):
    return rows.new_empty(rows.size(0), weights.size(1))


@looped_matmul_backward.register_fake
def _(rows, weights, ends, grad):
    return torch.empty_like(rows), torch.empty_like(weights)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _looped_matmul_grad(ctx, grad: torch.Tensor):
    rows, weights, ends = ctx.saved_tensors
    return (*looped_matmul_backward(rows, weights, ends, grad.contiguous()), None)


looped_matmul.register_autograd(_looped_matmul_grad, setup_context=_save_inputs)


# ---- the trainer's side ---------------------------------------------------------------------------------------------


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_line(model: nn.Module) -> str:
    """The start-up line of an MoE GPT: its experts, routing and balancing, and the share of the weights a token uses
    (what FLOPs and MFU count)."""
    c, layers = model.config, moe_layers(model)
    shared = f" + {c.shared_experts} shared" if c.shared_experts else ""
    dense = f" (the first {c.dense_layers} dense)" if c.dense_layers else ""
    balance = {
        "aux_loss": f"aux loss x {c.aux_loss_coef:g}",
        "bias": f"bias, {c.bias_update_rate:g} a step",
        "none": "none",
    }[c.balance]
    return (
        f"moe: {len(layers)} layers{dense} of {c.n_experts} experts{shared}, width {layers[0].hidden}, top-"
        f"{c.experts_per_token}{' renormalised' if c.router_renormalize else ''} | balance: {balance}, z-loss x "
        f"{c.router_z_loss_coef:g} | {model.active_params() / 1e6:.2f}M of {model.num_params() / 1e6:.2f}M "
        "parameters active per token"
    )


class RouterTally:
    """The MoE layers' routing over each optimizer step, for the trainer: add() after each micro-step's backward,
    end_step() after the optimizer's, figures() when the step is logged. Everything stays on the device until then."""

    def __init__(self, layers: list[MoE], reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.layers, self.reduce = layers, reduce  # reduce: a sum over the ranks (distributed.all_reduce_sum)
        self.sums: torch.Tensor | None = None  # (L, E + 3): per layer tokens per expert, aux, z, forwards counted
        self.last: torch.Tensor | None = None  # the last step's sums, over all ranks

    @classmethod
    def of(cls, model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor]) -> RouterTally | None:
        """The tally of a model's MoE layers; None for a dense model."""
        layers = moe_layers(model)
        return cls(layers, reduce) if layers else None

    def add(self) -> torch.Tensor:
        """Count the last forward of every layer; returns the router loss that forward added to the training loss
        (detached), which the trainer takes out of the loss it reports."""
        one = self.layers[0].load.new_ones(1)
        rows = torch.stack([torch.cat([m.load, m.aux_loss[None], m.z_loss[None], one]) for m in self.layers])
        self.sums = rows if self.sums is None else self.sums + rows
        return sum(m.router_loss.detach() for m in self.layers)

    def end_step(self, skipped: torch.Tensor) -> None:
        """After the optimizer step: sum the step over the ranks and, for balance = bias, move each layer's bias by
        its load (not for a step skipped for a non-finite gradient: skipped is 1.0 then)."""
        sums, self.sums = self.reduce(self.sums), None
        for layer, row in zip(self.layers, sums):
            if layer.router_bias is not None:
                layer.update_bias(row[: layer.n_experts], 1.0 - skipped)
        self.last = sums

    def figures(self) -> dict[str, float]:
        """The last step's balance, for the step line and train_log.json: expert_load, the most tokens an expert got
        over the mean (the worst layer's; 1 is perfect balance), and aux_loss and z_loss, the layers' mean
        (unweighted: the training loss added them times aux_loss_coef and router_z_loss_coef)."""
        E = self.layers[0].n_experts
        load, aux, z, forwards = self.last[:, :E], self.last[:, E], self.last[:, E + 1], self.last[:, E + 2]
        worst = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).max()
        figures = torch.stack([worst, (aux / forwards).mean(), (z / forwards).mean()]).tolist()
        return dict(zip(("expert_load", "aux_loss", "z_loss"), figures))
