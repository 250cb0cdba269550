"""`python train.py --config X --validate`: will this run fit, and how long will it take?

train.py calls check_memory once config, device and data have passed their checks and the model is planned
(run_model.plan_model), before the model exists (a model too large for the machine is refused without allocating
it), and
report_feasibility once the Trainer is built: the measured time of a few real optimizer steps and
the projected total time and tokens. Exit 0 when the run fits, 2 (UserError) when it would not.
"""

from __future__ import annotations

import time

import psutil
import torch

from model import GATED, GPT, mlp_hidden_width
from quillgpt.config import Config
from quillgpt.errors import UserError
from quillgpt.lora import trainable_summary
from quillgpt.metrics import format_duration, rss_mb
from quillgpt.run_model import ModelPlan, meta_model
from quillgpt.trainer import Runtime, Trainer, tokens_per_step, train_step

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LINEAR_BYTES = {"int8": 1 + 4 / 64, "nf4": 0.5 + 4 / 64}  # a quantized weight, its scales counted generously
ALLOCATOR_SLACK = 0.15


def memory_estimate(cfg: Config, model: GPT, precision: str, world_size: int) -> dict[str, float]:
    """Bytes per rank the training step adds to the process: fp32 weights, gradients and optimizer state, the
    16-bit weight copies autocast makes, activations and the logits (rough upper bounds, checked against measured
    peak RSS: docs/LOG.md, "benchmarks/ trimmed to its living modes"). A LoRA model (meta_model's) has gradients and
    optimizer state for its adapters only, and its frozen linear weights in the bytes lora.quantize gives them."""
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    c = model.config
    B, T, C, L, H, V = cfg.training.batch_size, c.block_size, c.n_embd, c.n_layer, c.n_head, c.vocab_size
    act_bytes = BYTES[precision]
    # per layer: the values its backward keeps (layer_activations: GPT-2's come to Korthikanti et al. 2022's 34 bytes
    # per token and width in 16-bit), and the attention scores, 5 bytes per head and pair of positions in 16-bit
    per_layer = B * T * (layer_activations(c) * act_bytes + 5 * H * T * act_bytes / 2)
    if cfg.training.gradient_checkpointing:
        activations = (
            L * B * T * C * 4 + per_layer
        )  # the fp32 residual stream at each block's input + one block recomputed
    else:
        activations = L * per_layer
    # the logits: in 16-bit, their fp32 copy, log-softmax and its gradient in fp32, the 16-bit gradient
    logits = B * T * V * (12 + (2 * act_bytes if act_bytes == 2 else 0))
    opt_states = 2 if cfg.optimizer.name == "adamw" else 1.5
    frozen_linear = [m.weight.numel() for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    frozen_linear = frozen_linear if trainable < n else []
    linear_bytes = LINEAR_BYTES.get(cfg.lora.quantize, act_bytes if cfg.lora.enabled else 4)
    est = {
        "weights": (n - sum(frozen_linear)) * 4.0 + sum(frozen_linear) * linear_bytes,
        "gradients": trainable * 4.0,
        "optimizer": trainable * 4.0 * opt_states,
        "autocast copies": trainable * 2.0 if act_bytes == 2 else 0.0,
        "activations": float(activations),
        "logits": float(logits),
    }
    if c.n_experts:
        est["routed"] = routed_bytes(c, B * T, act_bytes)
    if cfg.lora.quantize != "none" and frozen_linear:  # one linear map's weight dequantized at a time
        est["autocast copies"] += max(frozen_linear) * act_bytes
    if cfg.distributed.fsdp:
        for k in ("weights", "gradients", "optimizer"):
            est[k] /= max(1, world_size)
    # freed blocks the allocator keeps: SmolLM2-135M's fine-tune peaked above the sum by about ALLOCATOR_SLACK
    # (docs/LOG.md)
    est["allocator"] = ALLOCATOR_SLACK * sum(est.values())
    est["total"] = sum(est.values())
    return est


def layer_activations(c) -> int:
    """Values per token one block keeps for its backward, by the family's own widths: each norm's input (before
    and, or, after attention and the MLP), attention's input, queries, keys and values (grouped-query heads are
    fewer), its output and the projection's; the MLP's input, hidden values (a gated MLP keeps its gate, its up
    projection, the activation and their product) and output. A mixture of experts keeps each routed copy."""
    attention_width, kv_width = c.n_head * c.head_width, 2 * c.kv_heads * c.head_width
    norms = 2 * (c.pre_norm + c.post_norm) * c.n_embd
    attention = c.n_embd + attention_width + kv_width + attention_width + c.n_embd
    hidden = mlp_hidden_width(c) if not c.n_experts else (c.expert_hidden or mlp_hidden_width(c))
    copies = c.experts_per_token + c.shared_experts if c.n_experts else 1
    mlp = copies * (c.n_embd + (4 if c.mlp in GATED else 2) * hidden) + c.n_embd
    return norms + attention + mlp


def routed_bytes(c, tokens: int, act_bytes: int) -> float:
    """What a mixture of experts keeps beyond layer_activations' copies of the MLP (quillgpt/moe.py, read off its
    saved tensors): per layer and token, each routed copy's weighted output, under autocast an fp32 copy of its
    gathered rows too, and the router's logits and fp32 probabilities; and once, in the backward, one layer's expert
    gradients in the compute dtype (the looped matmul's) with their fp32 cast."""
    copies, layers = c.experts_per_token, c.n_layer - c.dense_layers
    per_token = copies * c.n_embd * (act_bytes + (4 if act_bytes == 2 else 0)) + c.n_experts * (4 + act_bytes)
    hidden = c.expert_hidden or mlp_hidden_width(c)
    expert_weights = c.n_experts * hidden * c.n_embd * (3 if c.mlp in GATED else 2)
    return float(layers * tokens * per_token + expert_weights * (act_bytes + 4))


def free_memory(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    return float(psutil.virtual_memory().available)


def check_memory(cfg: Config, rt: Runtime, plan: ModelPlan) -> dict:
    """Print parameters, tokens per step and the memory estimate of the planned model; UserError when it can't
    fit. Returns what it checked: the model's arguments and parameters, and the estimate."""
    t, world = cfg.training, rt.dist.world_size
    model = meta_model(plan)
    est = memory_estimate(cfg, model, rt.precision, world)
    free = free_memory(rt.device)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    block = model.config.block_size
    active = model.active_params()  # an MoE's FLOPs count the experts a token is routed to; its memory, all of them
    routed = f" ({active / 1e6:.2f}M active per token)" if active < model.num_params() else ""
    print(f"model: {model.num_params() / 1e6:.2f}M parameters{routed}, block {block}, vocab {model.config.vocab_size}")
    if plan.lora is not None:
        quantized = f", the base's linear weights {cfg.lora.quantize}" if cfg.lora.quantize != "none" else ""
        print(f"lora: {trainable_summary(model)} (rank {plan.lora.settings.rank}){quantized}")
    print(
        f"tokens per optimizer step: {tokens_per_step(t, world, block):,} "
        f"({t.batch_size} x {t.grad_accum_steps} accum x {world} ranks x {block})"
    )
    print(
        "memory estimate per rank: "
        + ", ".join(f"{k} {gb(v)}" for k, v in est.items())
        + f" | free on {rt.device.type}: {gb(free)}"
    )
    if rt.device.type == "cpu":
        print(
            f"expected peak RSS: {gb(est['total'] + rss_mb() * 1e6)} (this process now, {rss_mb() / 1e3:.2f} GB, + the estimate)"
        )
    if est["total"] > free:
        raise UserError(
            f"would not fit: the estimated {gb(est['total'])} exceed the {gb(free)} free on {rt.device}; "
            "lower training.batch_size (raise grad_accum_steps), enable training.gradient_checkpointing, "
            "use distributed.fsdp, or train adapters on the frozen model (lora.enabled; lora.quantize: QLoRA)"
        )
    return {"model_args": model.config.to_dict(), "parameters": model.num_params(), "memory": est}


def time_steps(tr: Trainer, steps: int = 3) -> float:
    """Seconds per optimizer step, measured on real batches (the first step is warm-up)."""
    times = []
    for it in range(steps):
        t0 = time.perf_counter()
        loss, _, _ = train_step(tr, it)
        float(loss)  # wait for the device
        times.append(time.perf_counter() - t0)
    return min(times[1:]) if len(times) > 1 else times[0]


def report_feasibility(tr: Trainer, checked: dict) -> dict:
    """Time a few real steps and project the whole run (after check_memory passed); what check_memory checked, with
    the measured step and projected run time."""
    t = tr.cfg.training
    step_s = time_steps(tr)
    steps = min(t.max_iters, round(t.time_budget_s / step_s)) if t.time_budget_s > 0 else t.max_iters
    evals = steps // t.eval_interval + 1 if t.eval_interval else 1
    eval_s = evals * 2 * t.eval_iters * step_s / (3 * t.grad_accum_steps)  # a forward is ~1/3 of a step
    total = steps * step_s + eval_s
    print(
        f"measured: {step_s * 1000:.1f} ms/iter ({tr.tokens_per_step / step_s:,.0f} tokens/s) on {tr.rt.device}, "
        f"{tr.rt.precision}"
    )
    print(
        f"estimated run: {steps:,} iters{' in the time budget' if t.time_budget_s > 0 else ''}, "
        f"{steps * tr.tokens_per_step:,} tokens, "
        f"about {format_duration(total)} (evaluation {format_duration(eval_s)})"
    )
    print("ok: this config would run")
    return {**checked, "step_s": step_s, "total_s": total}
