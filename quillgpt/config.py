"""The training configuration: one typed schema, loaded from TOML, overridden from the command line.

Precedence: schema defaults < TOML file < command line (`--section.key value`, `--section.key=value`,
and the short flags --max-iters, --device, --tokenizer). Every field has its type, default and a
one-line description here, in one place; the config reference, docs/config.md, is generated from it:

    python -m quillgpt.config --markdown        # print the reference table
    python -m quillgpt.config configs/base/base.toml --training.max_iters 10   # print the resolved config

Every mistake is collected and reported together, one line each, as a ConfigError (exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from quillgpt.errors import UserError, run_main
from quillgpt.tokenizer import DEFAULT_BPE_VOCAB_SIZE, MIN_BPE_VOCAB_SIZE
from quillgpt.typecheck import coerce, type_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UserError):
    """One or more config mistakes, one per line."""


def _f(default, help: str, **kw):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GPTConfig:
    """Model arguments. Stored in every checkpoint as a plain dict; rebuilds the model."""

    depth: int = _f(
        0,
        "the one size dial (nanochat's --depth; see 'the size dial' below): n_layer = depth, n_embd = depth x aspect_ratio "
        "rounded up to a multiple of the head width (head_dim, else 128), n_head = n_embd / head width, and the "
        "learning rates scaled by 1/sqrt(n_embd); a key set in the file or on the command line wins (0: off)",
    )
    aspect_ratio: int = _f(64, "the dial's width per layer (nanochat's 64)")
    block_size: int = _f(1024, "context length in tokens")
    vocab_size: int | None = _f(
        None, "vocabulary size; None takes the dataset's exactly (set a larger multiple of 64 yourself for speed)"
    )
    n_layer: int = _f(12, "number of transformer blocks")
    n_head: int = _f(12, "attention heads per block")
    n_embd: int = _f(768, "model width")
    dropout: float = _f(0.0, "dropout probability in [0, 1)")
    bias: bool = _f(True, "bias in Linear and norm layers (GPT-2: true)")
    pos_emb: str = _f("learned", "position encoding: learned | rope", choices=("learned", "rope"))
    norm: str = _f("layernorm", "normalisation: layernorm | rmsnorm", choices=("layernorm", "rmsnorm"))
    qk_norm: bool = _f(False, "normalise queries and keys before attention")
    mlp: str = _f(
        "gelu",
        "MLP activation: gelu | relu2 | swiglu | geglu (gated as swiglu, with gelu_approx's GELU: Gemma)",
        choices=("gelu", "relu2", "swiglu", "geglu"),
    )
    gelu_approx: str = _f(
        "none", "GELU form: none (exact erf) | tanh (OpenAI GPT-2's gelu_new)", choices=("none", "tanh")
    )
    tie_embeddings: bool = _f(True, "share the token embedding and output head weights")
    logit_softcap: float = _f(0.0, "soft-cap logits at this value with tanh (0 = off)")
    zero_init_proj: bool = _f(False, "zero-initialise the attention/MLP output projections and the head")
    rope_theta: float = _f(10000.0, "rotary base frequency (pos_emb = rope)")
    n_kv_head: int | None = _f(None, "key/value heads, for grouped-query attention (None: n_head)")
    head_dim: int | None = _f(None, "width of an attention head (None: n_embd / n_head)")
    mlp_hidden: int | None = _f(None, "MLP hidden width (None: 4 x n_embd; swiglu: 2/3 of that, rounded up to 64)")
    qkv_bias: bool = _f(False, "bias on the query, key and value projections only (Qwen2)")
    norm_eps: float = _f(1e-5, "epsilon of LayerNorm and RMSNorm")
    rope_scaling: str = _f(
        "none",
        "rotary frequency scaling: none / llama3 (Llama 3.1-3.2's long context) / linear (positions divided by "
        "rope_factor: Gemma 3's global layers) / longrope (each frequency divided by its rope_factors entry, "
        "cos and sin times rope_attention_factor: Phi-3/4's short factors, and past rope_original_context its "
        "rope_long_factors)",
        choices=("none", "llama3", "linear", "longrope"),
    )
    rope_factor: float = _f(8.0, "llama3 and linear rope scaling: factor")
    rope_low_freq_factor: float = _f(1.0, "llama3 rope scaling: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 rope scaling: high_freq_factor")
    rope_original_context: int = _f(8192, "llama3 and longrope scaling: original_max_position_embeddings")
    rope_factors: list[float] = _f([], "longrope scaling: one divisor per rotary frequency (Phi's short_factor)")
    rope_long_factors: list[float] = _f(
        [],
        "longrope scaling: the divisors a forward pass reaching past rope_original_context takes (Phi's "
        "long_factor, as transformers switches to them; empty: rope_factors everywhere)",
    )
    rope_attention_factor: float = _f(1.0, "longrope scaling: cos and sin multiplied by this")
    rope_fraction: float = _f(1.0, "the share of each head's width that rotates (Phi's partial_rotary_factor)")
    rope_theta_local: float | None = _f(
        None, "rotary base of the sliding-window layers, unscaled (None: rope_theta and its scaling; Gemma 3: 10000)"
    )
    nope_layers: list[int] = _f([], "layers without rotary positions (SmolLM3: every 4th)")
    sliding_window: int = _f(0, "attend to at most this many latest positions, the token's own included (0: all)")
    global_layers: list[int] = _f(
        [], "with sliding_window: the layers that attend to the whole context all the same (Gemma 3: every 6th)"
    )
    attn_scale: float | None = _f(
        None, "attention scores' scale (None: 1 / sqrt(head width); Gemma 3: 1 / sqrt(query_pre_attn_scalar))"
    )
    qk_norm_scope: str = _f(
        "head",
        "qk_norm over each head's query and key (Qwen3, Gemma 3) or over all heads' at once (OLMo 2)",
        choices=("head", "all"),
    )
    norm_plus_one: bool = _f(False, "RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma)")
    embed_scale: bool = _f(False, "token embeddings multiplied by sqrt(n_embd) (Gemma)")
    pre_norm: bool = _f(True, "normalise the input of attention and of the MLP (GPT-2, Llama; OLMo 2: false)")
    post_norm: bool = _f(False, "normalise the output of attention and of the MLP before the residual (Gemma, OLMo 2)")
    hf_family: str | None = _f(
        None,
        "the Hugging Face family the weights came from (run.init_from; quillgpt/families.py): export.py writes that "
        "family again (None: the family the switches say)",
    )
    value_embeds: bool = _f(
        False,
        "value embeddings (ResFormer's value residual, as nanochat has them): every other layer, the last included, "
        "adds a token embedding of its own to its values, gated per head by its input; no Hugging Face family or "
        "GGUF architecture has them",
    )
    backout: bool = _f(
        False,
        "nanochat's skips: each layer's input a learned mix of the residual and the embeddings (x0), and the head "
        "reading the residual less a learned share of the middle layer's; no Hugging Face family or GGUF has them",
    )
    smear: bool = _f(
        False,
        "nanochat's smear: each token's embedding plus a share of the previous token's, gated by its own first 24 "
        "channels (a bigram's worth of context before the first layer); no Hugging Face family or GGUF has it",
    )
    n_experts: int = _f(0, "experts in each mixture-of-experts layer (0: dense MLPs; quillgpt/moe.py)")
    experts_per_token: int = _f(2, "experts each token is routed to (top-k)")
    expert_hidden: int | None = _f(None, "hidden width of each expert's MLP (None: the dense MLP's rule)")
    shared_experts: int = _f(0, "experts every token goes through besides its routed ones (DeepSeek, Qwen-style)")
    dense_layers: int = _f(0, "the first this many layers keep a dense MLP in an MoE model (DeepSeek's first_k_dense)")
    router_renormalize: bool = _f(
        True, "rescale the chosen experts' weights to sum to 1 (Mixtral, Qwen3-MoE's norm_topk_prob; OLMoE: false)"
    )
    balance: str = _f(
        "aux_loss",
        "expert load balancing: aux_loss (Switch/Mixtral's auxiliary loss) | bias (DeepSeek-V3's auxiliary-loss-free "
        "per-expert bias, updated after each step) | none",
        choices=("aux_loss", "bias", "none"),
    )
    aux_loss_coef: float = _f(0.01, "weight of the load-balancing auxiliary loss (balance = aux_loss)")
    router_z_loss_coef: float = _f(0.001, "weight of the router z-loss (ST-MoE): keeps router logits small (0: off)")
    bias_update_rate: float = _f(
        0.001, "balance = bias: how far each step moves an expert's bias (DeepSeek-V3's gamma)"
    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model arguments: {sorted(unknown)}")
        return cls(**d)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


@dataclass
class RunConfig:
    name: str | None = _f(None, "run name: checkpoints go to out_dir/name (None: generated from dataset and time)")
    out_dir: str = _f("checkpoints", "root directory of run directories")
    seed: int = _f(1337, "seed for weights, dropout and the data stream")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N | mps (under torchrun: cuda, each rank its LOCAL_RANK's GPU)")
    deterministic: bool | None = _f(
        None,
        "deterministic algorithms, so the same seed repeats its losses bit for bit (None: on for the CPU, where they "
        "cost nothing measurable; off on a GPU, where some kernels are slower; true sets CUBLAS_WORKSPACE_CONFIG)",
    )
    init_from: str = _f(
        "scratch",
        "scratch | a checkpoint, run dir or .safetensors file | a Hugging Face model dir "
        "(GPT-2, Llama, Qwen2, Qwen3) or hub name such as gpt2 (its context is cropped to "
        "model.block_size when that is shorter)",
    )


@dataclass
class DataConfig:
    dataset: str = _f(
        "pystdlib",
        "dataset name: data/<dataset>/ (pystdlib, shakespeare_char, shakespeare, openwebtext, "
        "fineweb-edu-10B, tinystories, or your own)",
    )
    input: str | None = _f(
        None,
        "what to prepare data/<dataset>/ from when it is missing: a text file, a directory, "
        "a .jsonl(.gz/.zst) or .parquet file (prepare.py takes several, and hub datasets)",
    )
    tokenizer: str = _f(
        "char", "char | bpe | a tiktoken encoding name such as gpt2 | hf:DIR (a Hugging Face tokenizer.json)"
    )
    bpe_vocab_size: int | None = _f(
        None,
        f"vocabulary size the bpe tokenizer is trained to (none: an existing dataset's own, else {DEFAULT_BPE_VOCAB_SIZE})",
    )
    data_dir: str = _f("data", "root directory of prepared datasets")
    processed_dir: str | None = _f(
        None,
        "read train/val from this directory instead of data_dir/dataset (the data/processed layout: train.bin/val.bin, or train.txt/val.txt with data_format = txt)",
    )
    data_format: str = _f(
        "bin", "bin (token memmaps) | txt (train.txt/val.txt tokenized once and cached)", choices=("bin", "txt")
    )
    val_fraction: float | None = _f(
        None,
        "fraction of the documents (of a lone text file: of its bytes, at the end) held out for validation when "
        "preparing (none: an existing dataset's own, else 0.1)",
    )
    max_bytes: int | None = _f(
        None,
        "cap on the bytes of raw text read when preparing (none: an existing dataset's own, else all; pystdlib: 4 MB)",
    )
    chat: bool = _f(
        False,
        "data.input holds conversations (records with a messages list): prepared with the chat template (with "
        "run.init_from, its model's tokenizer), and the loss counts the assistant's tokens only (docs/chat.md)",
    )
    chat_rows: str = _f(
        "packed",
        "chat data: rows start at a conversation and go on into the following ones, each attending only within "
        "itself, its positions from 0 (packed), or count the first conversation's targets only (padded); packed "
        "measured better at equal wall time (docs/LOG.md)",
        choices=("packed", "padded"),
    )
    document_mask: bool = _f(
        False,
        "text data: each document of a row (as prepared: ending with the end-of-text token) attends only within "
        "itself, its positions from 0, as modded-nanogpt trains (docs/data.md); needs a dataset of documents",
    )
    preference: bool = _f(
        False,
        "data.input holds preference pairs (records with prompt or messages, chosen and rejected: TRL's forms), "
        "prepared with the chat template of run.init_from's model; training is then DPO ([dpo]; docs/chat.md)",
    )


@dataclass
class TrainingConfig:
    batch_size: int = _f(12, "micro-batch size per step and rank")
    grad_accum_steps: int = _f(1, "micro-steps accumulated per optimizer step")
    global_batch_size: int | None = _f(None, "if set, must equal batch_size * grad_accum_steps * world_size")
    batch_ramp_iters: int = _f(
        0,
        "grow each micro-batch from batch_ramp_start rows to batch_size over these first optimizer steps, linearly in "
        "whole rows, as modded-nanogpt schedules its batch (language modelling only; the evaluations keep batch_size; "
        "0: off)",
    )
    batch_ramp_start: int = _f(4, "the rows of a micro-batch at step 0 of a batch ramp (training.batch_ramp_iters)")
    max_iters: int = _f(
        5000, "optimizer steps to train for (set, it wins over target_flops and target_param_data_ratio)"
    )
    target_param_data_ratio: float | None = _f(
        None,
        "the horizon from data: max_iters = this x the scaling parameters (the blocks' matrices and the head, as "
        "nanochat counts them) / tokens a step (nanochat's 12; Chinchilla's 20; None: off)",
    )
    target_flops: float | None = _f(
        None,
        "the horizon from compute: max_iters = this / (training FLOPs a token x tokens a step); before "
        "target_param_data_ratio (None: off)",
    )
    time_budget_s: float = _f(
        0.0,
        "end training after this many seconds of training steps (evaluations and saves not counted), the decay laid "
        "over the time instead of the steps so that the warmdown ends at the budget, then the final evaluation; a "
        "resumed run has the budget that was left; max_iters caps it only where set (0: off)",
    )
    precision: str = _f(
        "auto", "fp32 | fp16 | bf16 | auto (bf16/fp16 on CUDA, fp32 on CPU)", choices=("fp32", "fp16", "bf16", "auto")
    )
    gradient_checkpointing: bool = _f(
        False, "recompute each block in backward to save activation memory (PEFT's activation checkpointing)"
    )
    compile: bool | None = _f(None, "torch.compile the model (None: on for CUDA, off for CPU)")
    compile_mode: str = _f(
        "default",
        "torch.compile's mode: default | reduce-overhead (CUDA graphs) | max-autotune (Triton matmul templates, "
        "and CUDA graphs) | max-autotune-no-cudagraphs; the others are unmeasured on a GPU (bench.py --gpu measures "
        "them)",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    keep_decoding_step: bool | None = _f(
        None,
        "at the end of the run, compile the one-token decoding step sample.py, chat.py and serve.py decode this model "
        "with on this machine's CPU (sample.py --compile's) and keep it, so that they use it from their first run: "
        "true, false, or none (auto): where the run took 5 minutes or more (the compile takes 15-30 s on 2 cores) "
        "and sample.py decodes on the CPU here; never after a stop by a signal or by non-finite losses, nor in a run "
        "of several processes (its ranks' threads are not sample.py's)",
    )
    loss_chunks: int = _f(
        1,
        "compute the output head and the cross-entropy in this many chunks of rows, each recomputed in the backward "
        "pass, so the (batch, block, vocab) fp32 logits never exist whole: less memory for a larger batch_size at the "
        "cost of a second head matmul (1: off; unmeasured on a GPU)",
    )
    eval_interval: int = _f(250, "evaluate every this many steps (0: only at the end)")
    eval_iters: int = _f(200, "batches per split in each evaluation")
    final_eval_iters: int = _f(
        0,
        "batches per split in the evaluation at max_iters (0: eval_iters); the in-run batches are its first eval_iters",
    )
    eval_only: bool = _f(False, "evaluate once and exit")
    log_interval: int = _f(10, "console/JSON log line every this many steps")
    save_interval: int = _f(
        250, "write ckpt_last.pt and a step checkpoint every this many steps (0: only at evals and the end)"
    )
    keep_last: int = _f(3, "step checkpoints kept (older ones pruned; 0 keeps none)")
    save_best: bool = _f(True, "write ckpt_best.pt whenever best_metric improves by early_stopping_min_delta")
    best_metric: str = _f(
        "val_loss",
        "the evaluation figure that picks ckpt_best.pt and early stopping: val_loss / "
        "bpb (val bits per byte) / hellaswag (acc_norm; needs eval.hellaswag) / task_acc (accuracy on the tasks' validation items; rl)",
        choices=("val_loss", "bpb", "hellaswag", "task_acc"),
    )
    early_stopping: bool = _f(False, "stop when best_metric stops improving")
    early_stopping_patience: int = _f(3, "evaluations without sufficient improvement before stopping")
    early_stopping_min_delta: float = _f(0.0, "minimum improvement of best_metric that counts")
    max_nonfinite_steps: int = _f(10, "consecutive non-finite losses tolerated (steps skipped) before stopping")


@dataclass
class EvalConfig:
    hellaswag: str | None = _f(None, "HellaSwag validation jsonl scored at every evaluation (acc, acc_norm; none: off)")
    hellaswag_limit: int = _f(500, "HellaSwag items scored per evaluation (0: all)")
    core_every: int = _f(
        0,
        "score DCLM's CORE (as nanochat computes it; eval.py --core) at the evaluations every this many steps and at "
        "the last (0: off); a multiple of training.eval_interval",
    )
    core_max_per_task: int = _f(500, "CORE items per task during training (nanochat's 500; 0: all)")
    core_bundle: str | None = _f(
        None, "the CORE bundle directory (None: $QUILLGPT_EVAL_BUNDLE, else data/eval_bundle, downloaded once there)"
    )
    map_unknown: bool = _f(False, "score characters a char model lacks as a stand-in instead of stopping")


@dataclass
class OptimizerConfig:
    name: str = _f("adamw", "adamw | muon (Muon for 2-D hidden weights, AdamW for the rest)", choices=("adamw", "muon"))
    learning_rate: float = _f(6e-4, "peak learning rate (AdamW)")
    min_lr: float = _f(6e-5, "learning rate at the end of the decay (cosine's or the warmdown's)")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices and embeddings")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip gradients to this global L2 norm (0: off)")
    decay_lr: bool = _f(True, "decay the learning rate after warmup (false: constant learning_rate)")
    schedule: str = _f(
        "cosine",
        "after warmup: cosine decay to min_lr at lr_decay_iters, or wsd (warmup, stable, decay): the peak held, then "
        "a linear warmdown to min_lr over the last warmdown_ratio of lr_decay_iters (nanochat's)",
        choices=("cosine", "wsd"),
    )
    warmdown_ratio: float = _f(0.65, "wsd: the share of lr_decay_iters spent in the final linear warmdown")
    final_lr_frac: float | None = _f(
        None, "min_lr as this fraction of learning_rate (None: min_lr as set; under model.depth: 0.05, nanochat's)"
    )
    warmup_iters: int = _f(100, "linear warmup steps")
    lr_decay_iters: int | None = _f(None, "steps the decay ends at (None: max_iters)")
    muon_lr: float = _f(0.02, "Muon learning rate (name = muon)")
    muon_momentum: float = _f(0.95, "Muon momentum")
    muon_coefficients: str = _f(
        "quintic",
        "Muon's orthogonalisation: quintic (Keller Jordan's Newton-Schulz, torch.optim.Muon's) | polar_express (a "
        "coefficient triple per step: Amsel et al., as nanochat and modded-nanogpt run it)",
        choices=("quintic", "polar_express"),
    )
    normuon: bool = _f(
        False,
        "NorMuon: each row of Muon's update scaled by a running second moment (beta2 0.9), its norm kept (nanochat's)",
    )
    fused: bool | None = _f(None, "fused AdamW kernel (None: where the device supports it)")


@dataclass
class LoggingConfig:
    json_log: bool = _f(True, "write train_log.json in the run directory")
    plot: bool = _f(True, "write loss_curve.png in the run directory at each evaluation")
    wandb_project: str | None = _f(None, "log to this Weights & Biases project (needs the wandb extra)")
    wandb_run_name: str | None = _f(None, "wandb run name (None: the run name)")
    peak_tflops: float | None = _f(
        None,
        "device peak TFLOP/s for MFU (None: on a CPU the best matmul rate of the run's precision this machine has "
        "shown, kept in ~/.cache/quillgpt; a GPU's default)",
    )


@dataclass
class DistributedConfig:
    backend: str | None = _f(None, "nccl | gloo (None: nccl on CUDA, gloo on CPU)")
    fsdp: bool = _f(False, "shard weights and optimizer state with FSDP2 (fully_shard) instead of DDP")
    timeout_s: int = _f(300, "seconds a collective may wait for a dead or stuck rank before the job fails")


# LoRA's target modules, by the names PEFT users give them (a Llama layer's): each is one linear map of a block
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGET_GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all-linear": LORA_TARGETS,  # PEFT's name: every linear map of the blocks (not the output head)
}


@dataclass
class LoraConfig:
    enabled: bool = _f(
        False,
        "train low-rank adapters on the frozen model run.init_from gives, instead of every weight (LoRA, docs/finetune.md)",
    )
    rank: int = _f(8, "rank r of each adapter: its update B (out x r) @ A (r x in) has rank r")
    alpha: float = _f(16.0, "an adapter's update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = _f(0.0, "dropout on the adapters' input, in [0, 1) (PEFT's lora_dropout)")
    targets: list[str] = _f(
        ["all-linear"],
        "the linear maps that get adapters, by PEFT's Llama names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj, or the groups attention, mlp, all-linear (a GPT-2 MLP's c_fc is up_proj, its c_proj down_proj)",
    )
    quantize: str = _f(
        "none",
        "QLoRA: the frozen base's linear weights stored as int8 (one scale per row) or nf4 (4-bit NormalFloat, blocks "
        "of 64), dequantized in the forward pass; the adapters stay in the training precision",
        choices=("none", "int8", "nf4"),
    )
    adapters: str | None = _f(
        None,
        "start from a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) made for run.init_from: "
        "its rank, alpha and targets replace the ones above",
    )


@dataclass
class DPOConfig:
    """DPO on preference data (data.preference): TRL's DPOTrainer loss, with its names."""

    beta: float = _f(
        0.1,
        "how far the tuned model may move from the reference: the loss is -log sigmoid(beta x the chosen reply's "
        "log-prob gain over the reference minus the rejected one's); higher stays closer (TRL's beta)",
    )
    loss_type: str = _f(
        "sigmoid",
        "sigmoid (DPO) | robust (rDPO, for labels flipped with probability label_smoothing), as TRL's loss_type",
        choices=("sigmoid", "robust"),
    )
    label_smoothing: float = _f(
        0.0,
        "loss_type = robust: the probability that a pair's preference is flipped, in [0, 0.5) (TRL's "
        "label_smoothing; the sigmoid loss has none)",
    )
    sft_weight: float = _f(
        0.0,
        "add this times an SFT loss on the chosen replies (their tokens' mean negative log-likelihood) to the DPO "
        "loss, so that the chosen replies stay likely (TRL: loss_type = [sigmoid, sft], loss_weights = [1, this]; "
        "RPO); 0: off",
    )
    reference: str = _f(
        "precomputed",
        "the reference model's log-probs (run.init_from's model): precomputed once and stored beside the data "
        "(data/<dataset>/reference/) | on_the_fly (the reference kept in memory, one more forward per step)",
        choices=("precomputed", "on_the_fly"),
    )


@dataclass
class RLConfig:
    enabled: bool = _f(
        False,
        "reinforcement learning with verifiable rewards (GRPO) from run.init_from's chat model, instead of the "
        "next-token loss: sampled replies to task prompts, scored, and a policy-gradient step (docs/chat.md)",
    )
    tasks: list[str] = _f(["count", "reverse"], "synthetic tasks whose questions are the prompts (tasks.py)")
    questions: str = _f(
        "made_up",
        "made_up: reverse and count on made-up words (never a held-out word; arithmetic from its training split) | "
        "train: each task's training split (a chat model answers most of those from memory: little to learn)",
        choices=("made_up", "train"),
    )
    prompts_per_step: int = _f(8, "prompts per optimizer step")
    group_size: int = _f(8, "replies sampled per prompt (G); each reply's advantage is its reward against its group's")
    max_new_tokens: int = _f(32, "the longest reply, in tokens (the calculator's outputs count)")
    temperature: float = _f(1.0, "sampling temperature of the replies (1: the policy itself)")
    top_k: int = _f(0, "sample among the top k tokens only (0: all)")
    scale_advantages: bool = _f(
        True, "divide the advantage (reward - group mean) by the group's standard deviation (GRPO); false: do not"
    )
    kl_coef: float = _f(
        0.0, "weight of a KL penalty to the reference model (run.init_from's weights), per reply token; 0: none"
    )
    reward: str | None = _f(
        None,
        "your reward function instead of the task's grader (exact answer: 1, else 0): 'file.py:function' or "
        "'module:function', called as function(question, reply, answer) -> float",
    )
    eval_items: int = _f(
        100,
        "validation items per task answered (greedy) at each evaluation: task_acc (never a test item: eval.py grades those)",
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_args(self) -> dict:
        """The plain model-argument dict stored in checkpoints."""
        return self.model.to_dict()


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]
# Keys that moved to another section, old name -> new name. A checkpoint written before the move (one users may hold:
# tests/fixtures/run_14e5811) still loads, with one line naming the new one; a config file or command line that uses
# an old name is an error naming the new one.
RENAMED = {"training.data_format": "data.data_format", "model.compile": "training.compile"}
SHORT_FLAGS = {"--max-iters": "training.max_iters", "--device": "run.device", "--tokenizer": "data.tokenizer"}


# ---- types ----------------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_cli_value(text: str) -> Any:
    """A command-line value: TOML syntax when it parses (4, 1e-3, true, [1, 2], "s"), else a bare string."""
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false", "yes", "no", "on", "off"):
        return text.lower() in ("true", "yes", "on")
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# ---- building -----------------------------------------------------------------------------------


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _apply(cfg: Config, section: str, key: str, value: Any, source: str, errors: list[str]) -> None:
    if section not in SECTIONS:
        errors.append(f"{source}: unknown section [{section}]{_suggest(section, list(SECTIONS))}")
        return
    sec_cls = SECTIONS[section]
    types_ = _field_types(sec_cls)
    if key not in types_:
        flat = [f"{s}.{k}" for s, c in SECTIONS.items() for k in _field_types(c)]
        hint = _suggest(key, list(types_)) or _suggest(f"{section}.{key}", flat)
        if f"{section}.{key}" in RENAMED:
            hint = f" (it is now {RENAMED[f'{section}.{key}']})"
        errors.append(f"{source}: unknown key '{section}.{key}'{hint}")
        return
    if isinstance(value, str) and not _is_utf8(value):  # invalid UTF-8 on the command line (surrogate escapes)
        errors.append(f"{source}: {section}.{key} is not valid UTF-8 text")
        return
    try:
        value = coerce(value, types_[key])
    except TypeError:
        errors.append(f"{source}: {section}.{key} = {value!r} has the wrong type, expected {type_name(types_[key])}")
        return
    setattr(getattr(cfg, section), key, value)


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a TOML file: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """['--training.max_iters', '10', '--model.bias=false', '--max-iters', '5'] -> [(dotted key, value)]."""
    out, errors, i = [], [], 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if not name.startswith("--"):
            errors.append(f"unexpected argument '{arg}' (overrides look like --section.key value)")
            i += 1
            continue
        key = SHORT_FLAGS.get(name, name[2:])
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                errors.append(f"{name} needs a value")
                break
            value = args[i + 1]
            i += 1
        i += 1
        if "." not in key:
            flat = [f"{s}.{k}" for s, c in SECTIONS.items() for k in _field_types(c)]
            errors.append(f"unknown option '{name}'{_suggest(key, flat + [f[2:] for f in SHORT_FLAGS])}")
            continue
        out.append((key, parse_cli_value(value)))
    if errors:
        raise ConfigError("\n".join(errors))
    return out


def build_config(
    toml: dict | None = None,
    overrides: list[tuple[str, Any]] | dict | None = None,
    source: str = "config",
    world_size: int = 1,
    stored: bool = False,
) -> Config:
    """Defaults < TOML dict < overrides; then validate. Raises ConfigError listing every problem.

    source names the TOML layer in messages; stored: it is a checkpoint's stored config, not a file the user edits,
    and a key under its old name (RENAMED) sets the new one, with a note on stderr saying so."""
    cfg, errors = Config(), []
    toml, renamed = move_renamed(toml or {}, source, errors) if stored else (toml or {}, [])
    notes = [f"note: {source}: {old} is now {RENAMED[old]} (read as that)" for old in renamed]
    for section, table in toml.items():
        if not isinstance(table, dict):
            if section in SECTIONS:
                errors.append(f"{source}: [{section}] must be a table of keys")
            else:
                hint = _suggest(section, [f"{s}.{k}" for s, c in SECTIONS.items() for k in _field_types(c)])
                errors.append(
                    f"{source}: top-level key '{section}' is not a section{hint or ' (put it under a [section])'}"
                )
            continue
        for key, value in table.items():
            _apply(cfg, section, key, value, source, errors)
    items = overrides.items() if isinstance(overrides, dict) else (overrides or [])
    for dotted, value in items:
        section, _, key = dotted.partition(".")
        _apply(cfg, section, key, value, "command line", errors)
    if not errors:  # the dial computes from values of the right type
        notes += apply_dial(cfg, explicit_keys(toml, items))
    errors += validate(cfg, world_size)  # fields with type errors kept their defaults, so this is safe
    print_notes(notes)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def move_renamed(toml: dict, source: str, errors: list[str]) -> tuple[dict, list[str]]:
    """The TOML layer with the keys it has under an old name (RENAMED) moved to their new place, and those old
    names. The old and the new name of one key both set is a mistake."""
    toml = {section: dict(table) if isinstance(table, dict) else table for section, table in toml.items()}
    used = []
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        table = toml.get(old_section)
        if not isinstance(table, dict) or old_key not in table:
            continue
        target = toml.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # build_config reports a section that is not a table
        if new_key in target:
            errors.append(f"{source}: {old} and {new} are both set, but {old} is the old name of {new}: keep {new}")
            continue
        target[new_key] = table.pop(old_key)
        used.append(old)
    return toml, used


def print_notes(notes: list[str]) -> None:
    """One line each on stderr, from one process of a torchrun job (rank 0: RANK is torchrun's variable)."""
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(note, file=sys.stderr, flush=True)


def lookup(toml: dict, overrides: list[tuple[str, Any]] | dict | None, dotted: str, source: str = "config") -> Any:
    """The value one key takes under defaults < TOML < overrides, type-checked, without building a whole Config
    (--resume reads only the run's name and out_dir from the user's config)."""
    section, _, key = dotted.partition(".")
    cfg, errors = Config(), []
    table = (toml or {}).get(section)
    if isinstance(table, dict) and key in table:
        _apply(cfg, section, key, table[key], source, errors)
    for name, value in overrides.items() if isinstance(overrides, dict) else (overrides or []):
        if name == dotted:
            _apply(cfg, section, key, value, "command line", errors)
    if errors:
        raise ConfigError("\n".join(errors))
    return getattr(getattr(cfg, section), key)


def resolved(
    cfg: Config, run_name: str, model: GPTConfig, compile: bool, precision: str, lora: LoraConfig | None = None
) -> Config:
    """The config a run records: cfg with what was resolved from it downstream, namely the run's name, the
    model as built (from a checkpoint or GPT-2 its architecture comes from the weights), whether it is
    compiled, the precision auto chose (a resumed run keeps it rather than measuring again) and the adapters as
    built (lora.adapters' rank, alpha and targets). cfg itself is left as it is."""
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, name=run_name),
        model=dataclasses.replace(model),
        training=dataclasses.replace(cfg.training, compile=compile, precision=precision),
        lora=dataclasses.replace(lora or cfg.lora),
    )


def load_config(path: str | Path | None, cli_args: list[str] | None = None, world_size: int = 1) -> Config:
    toml = load_toml(path) if path else {}
    return build_config(toml, parse_overrides(cli_args or []), source=str(path or "config"), world_size=world_size)


# ---- the size dial ----------------------------------------------------------------------------
# As nanochat sizes its miniseries (scripts/base_train.py), applied as a config is built (build_config).
#
# One number, model.depth, sets the shape: n_layer = depth, n_embd = depth x aspect_ratio rounded up to a multiple of
# the head width (model.head_dim, else nanochat's 128), n_head = n_embd / head width. It sets the learning rates too,
# scaled by 1/sqrt(width) from the width they were tuned at here (REFERENCE_WIDTH, speedrun_cpu.toml's). A key set
# in the config file or on the command line at the dial's layer or above wins (apply_dial is told which were set).
#
# The horizon: training.target_flops, else training.target_param_data_ratio, gives max_iters (run_model.horizon,
# once the vocabulary is known); an explicit training.max_iters wins over both, which apply_dial settles here.
#
# What the dial leaves as set: the batch (nanochat sizes it from the horizon, Bopt ~ D^0.383 from its d12's 2^19
# tokens, which a CPU batch of 10^3 tokens is three orders of magnitude below) and with it the weight decay, which
# nanochat scales by that batch rule (docs/training.md, "The size dial").
DIAL_HEAD_DIM = 128  # nanochat's --head-dim
REFERENCE_WIDTH = 128  # the width plain Muon's rates were tuned at (speedrun_cpu.toml's before NorMuon; docs/LOG.md)
REFERENCE_LR = 3e-3  # AdamW (embeddings, head, norms) at REFERENCE_WIDTH
REFERENCE_MUON_LR = 2.5e-3  # Muon (hidden matrices) at REFERENCE_WIDTH; our Muon's update RMS is AdamW's at any width
DIAL_FINAL_LR_FRAC = 0.05  # nanochat's --final-lr-frac
NO_CAP = 10**9  # max_iters under a time budget that sets no step count: the budget ends the run


def dial_shape(depth: int, aspect_ratio: int, head_dim: int | None) -> dict[str, int]:
    """n_layer, n_embd and n_head of a depth, as nanochat's build_model_meta: the width nudged up to a multiple of
    the head width so that every head has exactly that width."""
    width = head_dim or DIAL_HEAD_DIM
    n_embd = math.ceil(depth * aspect_ratio / width) * width
    return {"n_layer": depth, "n_embd": n_embd, "n_head": n_embd // width}


def dial_values(cfg: Config) -> dict[str, tuple[object, str]]:
    """Every key the dial sets, with the value it gives and why (the shape from model.*, then the rates)."""
    m = cfg.model
    shape = dial_shape(m.depth, m.aspect_ratio, m.head_dim)
    width = m.head_dim or DIAL_HEAD_DIM
    why_width = f"depth {m.depth} x aspect_ratio {m.aspect_ratio}, up to a multiple of head width {width}"
    out: dict[str, tuple[object, str]] = {
        "model.n_layer": (shape["n_layer"], f"depth {m.depth}"),
        "model.n_embd": (shape["n_embd"], why_width),
    }
    n_embd = cfg.model.n_embd  # the width the model has (the dial's, or one set)
    out["model.n_head"] = (max(1, n_embd // width), f"n_embd {n_embd} / head width {width}")
    scale = (n_embd / REFERENCE_WIDTH) ** -0.5
    why = f"x (n_embd {n_embd} / {REFERENCE_WIDTH})^-0.5 = {scale:.3f}"
    out["optimizer.learning_rate"] = (REFERENCE_LR * scale, f"{REFERENCE_LR:g} {why}")
    out["optimizer.muon_lr"] = (REFERENCE_MUON_LR * scale, f"{REFERENCE_MUON_LR:g} {why}")
    return out


def apply_dial(cfg: Config, layers: dict[str, int]) -> list[str]:
    """Set what model.depth and the horizon keys decide, on a config being built. layers: the dotted keys the config
    file (1) and the command line (2) set; the higher layer wins, and of one layer the key set outright (a dial key:
    `--model.depth 6` on the command line resizes a file's model, a file's own n_embd beside its depth stays).
    Returns the notes for the user (a target that an explicit max_iters overrides)."""
    t, o, notes = cfg.training, cfg.optimizer, []
    depth_layer = layers.get("model.depth", 0)
    if cfg.model.depth > 0:
        for key in dial_values(cfg):  # in order, each from those before: the heads from the width, the rates too
            if layers.get(key, 0) < depth_layer:
                section, _, name = key.partition(".")
                setattr(getattr(cfg, section), name, dial_values(cfg)[key][0])
        if o.final_lr_frac is None and layers.get("optimizer.min_lr", 0) < depth_layer:
            o.final_lr_frac = DIAL_FINAL_LR_FRAC
    if o.final_lr_frac is not None:
        o.min_lr = o.learning_rate * o.final_lr_frac
    steps_layer = layers.get("training.max_iters", 0)
    targets = [k for k in ("target_flops", "target_param_data_ratio") if getattr(t, k) is not None]
    target_layer = max((layers.get(f"training.{k}", 0) for k in targets), default=0)
    if targets and steps_layer >= target_layer:
        notes.append(f"note: training.max_iters = {t.max_iters} is set, so training.{targets[0]} is not used")
        t.target_flops = t.target_param_data_ratio = None
    elif t.time_budget_s > 0 and not targets and steps_layer < layers.get("training.time_budget_s", 0):
        t.max_iters = NO_CAP  # unless set beside the budget or above it, no step count caps the budget
    return notes


def explicit_keys(toml: dict, overrides) -> dict[str, int]:
    """The dotted keys a TOML layer (1) and the overrides (2) set, each with the highest layer that set it."""
    keys = {f"{s}.{k}": 1 for s, table in toml.items() if isinstance(table, dict) for k in table}
    items = overrides.items() if isinstance(overrides, dict) else (overrides or [])
    return keys | {dotted: 2 for dotted, _ in items}


def plan_lines(cfg: Config) -> list[str]:
    """The dial's keys as the run has them, each with where its value came from: the dial's rule, or set."""
    if cfg.model.depth <= 0:
        return []
    lines = []
    for key, (value, why) in dial_values(cfg).items():
        section, _, name = key.partition(".")
        have = getattr(getattr(cfg, section), name)
        same = have == value if isinstance(have, int) else math.isclose(have, value, rel_tol=1e-9)
        source = f"the dial: {why}" if same else f"set; the dial's is {value:.4g}"
        lines.append(f"{key} = {have:.4g} ({source})" if isinstance(have, float) else f"{key} = {have} ({source})")
    o = cfg.optimizer
    if o.final_lr_frac is not None:
        lines.append(f"optimizer.min_lr = {o.min_lr:.4g} (learning_rate x final_lr_frac {o.final_lr_frac:g})")
    return lines


# ---- validation ---------------------------------------------------------------------------------


DOCUMENT_MASK_ON_CHAT = (
    "data.document_mask is for text datasets: on chat data, data.chat_rows = 'packed' keeps the conversations apart"
)


Problems = list[tuple[str, str]]  # (the key a rule is about, its one-line message)


def validate(cfg: Config, world_size: int = 1) -> list[str]:
    """Every rule that can be checked from the config alone, one section at a time (CHECKS), and one line per key:
    its first problem (a NaN beta is not finite, and says nothing more). The rules that need the data are data.py's
    (find_dataset, check_fits), those that need the device trainer.setup's."""
    first: dict[str, str] = {}
    for section, sec_cls in SECTIONS.items():
        for f in fields(sec_cls):
            choices = f.metadata.get("choices")
            value = getattr(getattr(cfg, section), f.name)
            if choices and value is not None and value not in choices:
                first.setdefault(
                    f"{section}.{f.name}", f"{section}.{f.name} = {value!r} must be one of {' | '.join(choices)}"
                )
            elif isinstance(value, float) and not math.isfinite(value):  # TOML and the command line accept nan, inf
                first.setdefault(f"{section}.{f.name}", f"{section}.{f.name} = {value} must be a finite number")
    for check in CHECKS.values():
        for key, message in check(cfg, world_size):
            first.setdefault(key, message)
    return list(first.values())


def rules(*pairs: tuple[str, bool, str]) -> Problems:
    """(key, message) of each (key, ok, message) whose rule fails."""
    return [(key, message) for key, ok, message in pairs if not ok]


def check_training(cfg: Config, world_size: int) -> Problems:
    t = cfg.training
    positive = ("batch_size", "grad_accum_steps", "max_iters", "eval_iters", "max_nonfinite_steps", "loss_chunks")
    counts = (
        "eval_interval",
        "final_eval_iters",
        "log_interval",
        "save_interval",
        "keep_last",
        "early_stopping_patience",
        "batch_ramp_iters",
    )
    problems = [
        (f"training.{k}", f"training.{k} = {getattr(t, k)} must be positive") for k in positive if getattr(t, k) <= 0
    ]
    problems += [(f"training.{k}", f"training.{k} = {getattr(t, k)} must be >= 0") for k in counts if getattr(t, k) < 0]
    problems += rules(
        (
            "training.early_stopping_min_delta",
            t.early_stopping_min_delta >= 0,
            f"training.early_stopping_min_delta = {t.early_stopping_min_delta} must be >= 0",
        ),
        (
            "training.best_metric",
            t.best_metric != "hellaswag" or cfg.eval.hellaswag is not None,
            "training.best_metric = 'hellaswag' needs eval.hellaswag, a HellaSwag validation jsonl",
        ),
        (
            "training.best_metric",
            t.best_metric != "task_acc" or cfg.rl.enabled,
            "training.best_metric = 'task_acc' is the validation accuracy of an RL run: it needs rl.enabled",
        ),
    )
    problems += rules(
        *(
            (
                f"training.{k}",
                getattr(t, k) is None or getattr(t, k) > 0,
                f"training.{k} = {getattr(t, k)} must be positive",
            )
            for k in ("target_param_data_ratio", "target_flops")
        ),
        ("training.time_budget_s", t.time_budget_s >= 0, f"training.time_budget_s = {t.time_budget_s} must be >= 0"),
        (
            "training.batch_ramp_start",
            t.batch_ramp_iters == 0 or 1 <= t.batch_ramp_start <= t.batch_size,
            f"training.batch_ramp_start = {t.batch_ramp_start} must be in [1, batch_size {t.batch_size}]",
        ),
        (
            "training.batch_ramp_iters",
            t.batch_ramp_iters == 0 or not cfg.rl.enabled,
            "training.batch_ramp_iters ramps language-model batches: rl.enabled steps on its own rollouts",
        ),
        (
            "training.batch_ramp_iters",
            t.batch_ramp_iters == 0 or not cfg.data.preference,
            "training.batch_ramp_iters ramps language-model batches, not DPO's pairs (data.preference)",
        ),
    )
    if t.global_batch_size is not None and t.batch_size > 0 and t.grad_accum_steps > 0:
        g, got = t.global_batch_size, t.batch_size * t.grad_accum_steps * world_size
        problems += rules(
            ("training.global_batch_size", g > 0, f"training.global_batch_size = {g} must be positive"),
            (
                "training.global_batch_size",
                t.batch_size <= g,
                f"training.batch_size = {t.batch_size} exceeds training.global_batch_size = {g}",
            ),
            (
                "training.global_batch_size",
                got == g or g <= 0 or t.batch_size > g,
                f"training.global_batch_size = {g} but batch_size {t.batch_size} x grad_accum_steps "
                f"{t.grad_accum_steps} x world_size {world_size} = {got}",
            ),
        )
    return problems


def check_eval(cfg: Config, world_size: int) -> Problems:
    e, interval = cfg.eval, cfg.training.eval_interval
    return rules(
        (
            "eval.hellaswag_limit",
            e.hellaswag_limit >= 0,
            f"eval.hellaswag_limit = {e.hellaswag_limit} must be >= 0 (0: all)",
        ),
        ("eval.core_every", e.core_every >= 0, f"eval.core_every = {e.core_every} must be >= 0 (0: off)"),
        (
            "eval.core_every",
            e.core_every <= 0 or (interval > 0 and e.core_every % interval == 0),
            f"eval.core_every = {e.core_every} must be a multiple of training.eval_interval = {interval}: CORE is "
            "scored at evaluations",
        ),
        (
            "eval.core_max_per_task",
            e.core_max_per_task >= 0,
            f"eval.core_max_per_task = {e.core_max_per_task} must be >= 0 (0: all)",
        ),
    )


def check_optimizer(cfg: Config, world_size: int) -> Problems:
    o = cfg.optimizer
    problems = rules(
        (
            "optimizer.learning_rate",
            o.learning_rate > 0,
            f"optimizer.learning_rate = {o.learning_rate} must be positive",
        ),
        (
            "optimizer.min_lr",
            o.min_lr >= 0 and (o.min_lr <= o.learning_rate or not o.decay_lr),
            f"optimizer.min_lr = {o.min_lr} must be in [0, learning_rate]",
        ),
        (
            "optimizer.grad_clip",
            o.grad_clip >= 0,
            f"optimizer.grad_clip = {o.grad_clip} must be >= 0 (0 disables clipping)",
        ),
        ("optimizer.weight_decay", o.weight_decay >= 0, f"optimizer.weight_decay = {o.weight_decay} must be >= 0"),
        ("optimizer.warmup_iters", o.warmup_iters >= 0, f"optimizer.warmup_iters = {o.warmup_iters} must be >= 0"),
        (
            "optimizer.lr_decay_iters",
            o.lr_decay_iters is None or o.lr_decay_iters > 0,
            f"optimizer.lr_decay_iters = {o.lr_decay_iters} must be positive",
        ),
        ("optimizer.muon_lr", o.muon_lr > 0, f"optimizer.muon_lr = {o.muon_lr} must be positive"),
        (
            "optimizer.final_lr_frac",
            o.final_lr_frac is None or 0 <= o.final_lr_frac <= 1,
            f"optimizer.final_lr_frac = {o.final_lr_frac} must be in [0, 1]",
        ),
        (
            "optimizer.warmdown_ratio",
            0 < o.warmdown_ratio <= 1,
            f"optimizer.warmdown_ratio = {o.warmdown_ratio} must be in (0, 1]",
        ),
    )
    return problems + [
        (f"optimizer.{k}", f"optimizer.{k} = {getattr(o, k)} must be in [0, 1)")
        for k in ("beta1", "beta2", "muon_momentum")
        if not 0 <= getattr(o, k) < 1
    ]


def check_model(cfg: Config, world_size: int) -> Problems:
    m = cfg.model
    problems = [
        (f"model.{k}", f"model.{k} = {getattr(m, k)} must be positive")
        for k in ("n_layer", "n_head", "n_embd", "block_size")
        if getattr(m, k) <= 0
    ]
    problems += rules(
        ("model.depth", m.depth >= 0, f"model.depth = {m.depth} must be >= 0 (0: the dial off)"),
        ("model.aspect_ratio", m.aspect_ratio > 0, f"model.aspect_ratio = {m.aspect_ratio} must be positive"),
    )
    problems += [
        (f"model.{k}", f"model.{k} = {getattr(m, k)} must be positive")
        for k in ("vocab_size", "n_kv_head", "head_dim", "mlp_hidden")
        if getattr(m, k) is not None and getattr(m, k) <= 0
    ]
    if m.n_head > 0 and m.n_embd > 0:
        divisible = m.head_dim is not None or m.n_embd % m.n_head == 0
        problems += rules(
            ("model.n_embd", divisible, f"model.n_embd = {m.n_embd} is not divisible by model.n_head = {m.n_head}"),
            (
                "model.n_kv_head",
                not m.n_kv_head or m.n_kv_head <= 0 or m.n_head % m.n_kv_head == 0,
                f"model.n_head = {m.n_head} is not a multiple of model.n_kv_head = {m.n_kv_head}",
            ),
        )
        if m.pos_emb == "rope" and (m.head_dim or 0) >= 0 and divisible:
            width = m.head_dim or m.n_embd // m.n_head
            problems += rules(
                ("model.pos_emb", width % 2 == 0, f"model.pos_emb = 'rope' needs an even head size, got {width}")
            )
    problems += rules(
        ("model.norm_eps", m.norm_eps > 0, f"model.norm_eps = {m.norm_eps} must be positive"),
        (
            "model.rope_scaling",
            m.rope_scaling == "none"
            or (
                m.rope_factor > 0
                and m.rope_high_freq_factor > m.rope_low_freq_factor > 0
                and m.rope_original_context > 0
            ),
            "model.rope_scaling = 'llama3' needs rope_factor > 0, rope_high_freq_factor > rope_low_freq_factor > 0 "
            "and rope_original_context > 0",
        ),
        ("model.dropout", 0 <= m.dropout < 1, f"model.dropout = {m.dropout} must be in [0, 1)"),
        ("model.logit_softcap", m.logit_softcap >= 0, f"model.logit_softcap = {m.logit_softcap} must be >= 0 (0: off)"),
        ("model.rope_theta", m.rope_theta > 0, f"model.rope_theta = {m.rope_theta} must be positive"),
    )
    return problems + check_moe(m)


def check_data(cfg: Config, world_size: int) -> Problems:
    d = cfg.data
    return rules(
        (
            "data.val_fraction",
            d.val_fraction is None or 0 < d.val_fraction < 1,
            f"data.val_fraction = {d.val_fraction} must be in (0, 1)",
        ),
        (
            "data.bpe_vocab_size",
            d.bpe_vocab_size is None or d.bpe_vocab_size >= MIN_BPE_VOCAB_SIZE,
            f"data.bpe_vocab_size = {d.bpe_vocab_size} must be >= {MIN_BPE_VOCAB_SIZE} (256 bytes and <|endoftext|>)",
        ),
        ("data.max_bytes", d.max_bytes is None or d.max_bytes > 0, f"data.max_bytes = {d.max_bytes} must be positive"),
        ("data.document_mask", not (d.chat and d.document_mask), DOCUMENT_MASK_ON_CHAT),
        (
            "data.preference",
            not d.preference or cfg.run.init_from != "scratch",
            "data.preference = true tunes a model with DPO: set run.init_from to it (its weights are also the reference)",
        ),
    )


def check_dpo(cfg: Config, world_size: int) -> Problems:
    p = cfg.dpo
    return rules(
        ("dpo.beta", p.beta > 0, f"dpo.beta = {p.beta} must be positive"),
        ("dpo.sft_weight", p.sft_weight >= 0, f"dpo.sft_weight = {p.sft_weight} must be >= 0 (0: off)"),
        (
            "dpo.label_smoothing",
            0 <= p.label_smoothing < 0.5,
            f"dpo.label_smoothing = {p.label_smoothing} must be in [0, 0.5) (the probability a label is flipped)",
        ),
        (
            "dpo.label_smoothing",
            p.label_smoothing == 0 or p.loss_type == "robust",
            f"dpo.label_smoothing = {p.label_smoothing} needs dpo.loss_type = 'robust' (TRL's sigmoid loss has no "
            "label smoothing)",
        ),
    )


def check_distributed(cfg: Config, world_size: int) -> Problems:
    dist = cfg.distributed
    return rules(
        ("distributed.timeout_s", dist.timeout_s > 0, f"distributed.timeout_s = {dist.timeout_s} must be positive"),
        (
            "distributed.backend",
            dist.backend in (None, "nccl", "gloo"),
            f"distributed.backend = {dist.backend!r} must be nccl or gloo",
        ),
    )


def check_run(cfg: Config, world_size: int) -> Problems:
    device = cfg.run.device
    return rules(
        (
            "run.device",
            device in ("auto", "cpu", "mps", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()),
            f"run.device = {device!r} must be auto | cpu | cuda | cuda:N | mps",
        ),
        (
            "run.device",
            world_size == 1 or not device.startswith("cuda:"),
            f"run.device = {device!r} would put all {world_size} ranks on one GPU: use run.device = 'cuda' under "
            "torchrun (each rank takes its LOCAL_RANK's GPU; CUDA_VISIBLE_DEVICES picks which GPUs)",
        ),
    )


def check_lora(cfg: Config, world_size: int) -> Problems:
    """The [lora] section's rules: its values, and what a LoRA run needs of the rest of the config."""
    lo = cfg.lora
    known = [*LORA_TARGETS, *LORA_TARGET_GROUPS]
    problems = rules(
        ("lora.rank", lo.rank > 0, f"lora.rank = {lo.rank} must be positive"),
        ("lora.alpha", lo.alpha > 0, f"lora.alpha = {lo.alpha} must be positive"),
        ("lora.dropout", 0 <= lo.dropout < 1, f"lora.dropout = {lo.dropout} must be in [0, 1)"),
        (
            "lora.targets",
            bool(lo.targets),
            f"lora.targets is empty: name the modules that get adapters ({', '.join(known)})",
        ),
    )
    problems += [
        (
            "lora.targets",
            f"lora.targets: unknown target module {name!r}{_suggest(name, known)} (known: {', '.join(known)})",
        )
        for name in lo.targets
        if name not in known
    ]
    if not lo.enabled:
        return problems + rules(
            (
                "lora.enabled",
                lo.adapters is None and lo.quantize == "none",
                "lora.adapters and lora.quantize need lora.enabled = true",
            )
        )
    return problems + rules(
        (
            "run.init_from",
            cfg.run.init_from != "scratch",
            "lora.enabled needs run.init_from: the model whose frozen weights the adapters train on",
        ),
        (
            "optimizer.name",
            cfg.optimizer.name == "adamw",
            f"lora.enabled trains with optimizer.name = 'adamw' (not {cfg.optimizer.name!r}: Muon orthogonalises "
            "whole weight matrices, which a rank-r adapter is not)",
        ),
        (
            "distributed.fsdp",
            not cfg.distributed.fsdp,
            "lora.enabled does not shard with distributed.fsdp: the frozen base is not trained; use DDP",
        ),
    )


def lora_targets(names: list[str]) -> tuple[str, ...]:
    """lora.targets with its groups expanded, in LORA_TARGETS' order."""
    chosen = {t for name in names for t in LORA_TARGET_GROUPS.get(name, (name,))}
    return tuple(t for t in LORA_TARGETS if t in chosen)


def check_rl(cfg: Config, world_size: int) -> Problems:
    """The rules of an RL run ([rl])."""
    r = cfg.rl
    if not r.enabled:
        return []
    from quillgpt.tasks import TASKS  # the task names (tasks.py needs no torch)

    problems = [
        (f"rl.{k}", f"rl.{k} = {getattr(r, k)} must be positive")
        for k in ("prompts_per_step", "group_size", "max_new_tokens", "eval_items")
        if getattr(r, k) <= 0
    ]
    return problems + rules(
        (
            "rl.tasks",
            bool(r.tasks) and all(t in TASKS for t in r.tasks),
            f"rl.tasks = {r.tasks} must name tasks among {', '.join(TASKS)}",
        ),
        (
            "rl.temperature",
            r.temperature > 0,
            f"rl.temperature = {r.temperature} must be positive (replies are sampled)",
        ),
        ("rl.top_k", r.top_k >= 0, f"rl.top_k = {r.top_k} must be >= 0 (0: all)"),
        ("rl.kl_coef", r.kl_coef >= 0, f"rl.kl_coef = {r.kl_coef} must be >= 0 (0: no KL penalty)"),
        (
            "rl.group_size",
            r.group_size >= 2,
            f"rl.group_size = {r.group_size}: a group needs at least 2 replies to compare",
        ),
        (
            "rl.reward",
            r.reward is None or ":" in r.reward,
            f"rl.reward = {r.reward!r} must be 'file.py:function' or 'module:function'",
        ),
        ("rl.enabled", world_size == 1, f"rl.enabled runs in one process, not {world_size} ranks"),
        (
            "data.preference",
            not cfg.data.preference,
            "rl.enabled samples its own replies: it takes chat data, not preference pairs (data.preference)",
        ),
        (
            "run.init_from",
            cfg.run.init_from != "scratch",
            "rl.enabled starts from a chat model: set run.init_from (a chat fine-tune, e.g. checkpoints/base-chat)",
        ),
    )


def check_moe(m: GPTConfig) -> Problems:
    """The rules of mixture-of-experts layers (model.n_experts > 0; quillgpt/moe.py)."""
    if m.n_experts == 0:
        return []
    if m.n_experts < 0:
        return [("model.n_experts", f"model.n_experts = {m.n_experts} must be >= 0 (0: dense MLPs)")]
    problems = rules(
        (
            "model.experts_per_token",
            1 <= m.experts_per_token <= m.n_experts,
            f"model.experts_per_token = {m.experts_per_token} must be in [1, n_experts = {m.n_experts}]",
        ),
        (
            "model.expert_hidden",
            m.expert_hidden is None or m.expert_hidden > 0,
            f"model.expert_hidden = {m.expert_hidden} must be positive",
        ),
        ("model.shared_experts", m.shared_experts >= 0, f"model.shared_experts = {m.shared_experts} must be >= 0"),
        (
            "model.dense_layers",
            0 <= m.dense_layers < m.n_layer,
            f"model.dense_layers = {m.dense_layers} must be in [0, n_layer = {m.n_layer}): at least one layer is an MoE",
        ),
    )
    return problems + [
        (f"model.{k}", f"model.{k} = {getattr(m, k)} must be >= 0")
        for k in ("aux_loss_coef", "router_z_loss_coef", "bias_update_rate")
        if getattr(m, k) < 0
    ]


# each section's rules, in the order their lines print
CHECKS = {
    "run": check_run,
    "data": check_data,
    "model": check_model,
    "training": check_training,
    "eval": check_eval,
    "optimizer": check_optimizer,
    "distributed": check_distributed,
    "lora": check_lora,
    "dpo": check_dpo,
    "rl": check_rl,
}


# ---- output -------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # JSON's string escapes are valid TOML ones; TOML also forbids a raw DEL
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values are omitted: they are every such field's default; so is max_iters
    while a horizon target decides it, which a file holding both would give to max_iters)."""
    t, lines = cfg.training, []
    targeted = t.target_flops is not None or t.target_param_data_ratio is not None
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for k, v in dataclasses.asdict(getattr(cfg, section)).items():
            if v is not None and not (targeted and section == "training" and k == "max_iters"):
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def layer_from_dict(d: dict) -> dict:
    """Config.to_dict() output (as stored in checkpoints) as a layer for build_config: None values are left
    out, being every such field's default."""
    return {s: {k: v for k, v in t.items() if v is not None} for s, t in d.items()}


def summary(cfg: Config) -> str:
    """Compact one-line-per-section view of the values that differ from the defaults."""
    default = Config()
    parts = []
    for section in SECTIONS:
        cur, ref = getattr(cfg, section), getattr(default, section)
        diff = [f"{f.name}={getattr(cur, f.name)}" for f in fields(cur) if getattr(cur, f.name) != getattr(ref, f.name)]
        if diff:
            parts.append(f"  [{section}] " + " ".join(diff))
    return "config (non-default values):\n" + ("\n".join(parts) if parts else "  (all defaults)")


def markdown_reference() -> str:
    """The config reference (docs/config.md, between its markers), generated from the schema."""
    out = []
    for section, sec_cls in SECTIONS.items():
        hints = _field_types(sec_cls)
        out.append(f"#### [{section}]\n\n| key | type | default | description |\n| --- | --- | --- | --- |")
        for f in fields(sec_cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "none" if default is None else _toml_value(default)
            out.append(
                f"| `{f.name}` | {type_name(hints[f.name])} | `{shown}` | {f.metadata.get('help', '').replace('|', '/')} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--markdown"]:
        print(markdown_reference(), end="")
        return
    path = args[0] if args and not args[0].startswith("--") else None
    cfg = load_config(path, args[1:] if path else args)
    print(to_toml(cfg), end="")


if __name__ == "__main__":
    run_main(main)
