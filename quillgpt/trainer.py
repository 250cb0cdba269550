"""The training loop: from a config to a trained model, each stage a small function.

    rt = setup(cfg, dist, ckpt and ckpt.resolution())   # device, precision, compile, process group, seed, MFU peak
    dataset = find_dataset(cfg, dist)                 # data.py: located (or prepared) and checked
    tr = build_trainer(cfg, rt, dataset, run_dir, ckpt)       # model, wrapping, optimizers, scaler, objective
    state = restore(tr, ckpt) if ckpt else TrainState()
    log = start_run(tr, state, resumed=ckpt is not None)
    with StopRequest() as stop:
        outcome = fit(tr, state, log, stop)           # step, log, evaluate, save

train.py is that sequence; bench.py and feasibility.py (--validate) build the same Trainer and time its
train_step. What differs between language modelling, DPO and RL is the run's objective (quillgpt/objective.py:
its loss, batches, evaluation and figures), chosen once in build_trainer; the loop is one. The config flows down: build_trainer() returns the config the run records (config.resolved),
and nothing here writes into the one it was given. Optimizers and the LR schedule live in
optim.py, checkpoint contents and run directories in checkpoint.py, telemetry in metrics.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn

from model import GPT
from quillgpt import distributed
from quillgpt.checkpoint import Resolution, RunDir, TrainingCheckpoint, TrainState, rng_state, set_rng_state
from quillgpt.config import NO_CAP, Config, EvalConfig, TrainingConfig, resolved, summary, to_toml
from quillgpt.core_eval import core_score, find_bundle, read_bundle
from quillgpt.data import BatchSource, Dataset
from quillgpt.distributed import DistInfo
from quillgpt.dpo import build_preference_pairs
from quillgpt.errors import UserError
from quillgpt.files import atomic_write_text
from quillgpt.kernels import use_cpu_training_kernels
from quillgpt.lora import adapter_state, trainable_summary
from quillgpt.machine import keep_freed_memory
from quillgpt.metrics import MetricsLog, default_peak_flops, rss_mb
from quillgpt.moe import RouterTally, moe_line
from quillgpt.objective import LanguageModeling, Objective
from quillgpt.optim import lr_multiplier, make_optimizers, set_lr
from quillgpt.precision import (
    PRECISIONS,
    MatmulRates,
    cuda_has_native_bf16,
    emulation_warning,
    measure_cpu_rates,
)
from quillgpt.precision import autocast as precision_autocast
from quillgpt.rl import build_rl
from quillgpt.run_model import ModelPlan, build_model, plan_model
from quillgpt.scoring import HellaSwagItem, hellaswag_items

# ---- setup --------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where and how this process computes, resolved once from the config and torchrun's environment."""

    device: torch.device
    precision: str  # fp32 / fp16 / bf16 ("auto" resolved)
    dist: DistInfo
    compile: bool  # training.compile resolved (None: on for CUDA)
    peak_flops: float  # the peak FLOP/s of all ranks' devices together, for MFU (tokens/s are counted over all ranks)
    autocast: object  # the autocast context of the precision (a null context for fp32)
    matmul_rates: MatmulRates | None = None  # fp32 and bf16 measured at the model's shape (CPU, auto or bf16)
    requested_precision: str = ""  # training.precision as configured (auto, or what precision was forced to)
    requested_compile: bool | None = None  # training.compile as configured (None: on for CUDA)
    precision_kept: bool = False  # resumed on the device type it began on: the precision it resolved to then
    peak_source: str = ""  # what one device's peak_flops is (the device line says it)


def setup(cfg: Config, dist: DistInfo, resumed: Resolution | None = None) -> Runtime:
    """Resolve device, precision and compile, start the process group, configure the backends and seed torch.

    resumed: how the checkpoint a resumed run continues resolved precision and compile. On the same type of device,
    for the same request, the run keeps what it resolved to (a CPU's auto is not measured again: exact resume); on
    another type of device (begun on a CPU, resumed on a GPU) both are resolved again here, with one line saying so."""
    device = resolve_device(cfg.run.device, dist)
    t = cfg.training
    kept = resumed if resumed is not None and resumed.device_type == device.type else None
    if resumed is not None and kept is None and dist.is_main:
        print(
            f"resuming on {device.type} a run that began on {resumed.device_type}: precision and compile are resolved "
            f"again for {device.type} (training.precision = {t.precision}, training.compile = "
            f"{'none' if t.compile is None else str(t.compile).lower()})",
            flush=True,
        )
    if kept is not None and t.compile == kept.requested_compile:
        compile = kept.compile
    else:
        compile = t.compile if t.compile is not None else device.type == "cuda"
    if compile and device.type == "cpu" and not has_cxx_compiler():
        raise UserError(
            "training.compile = true needs a C++ compiler on the CPU (inductor builds C++ kernels); "
            "install g++ or set --training.compile false"
        )
    distributed.init_process_group(dist, device, cfg.distributed.backend, cfg.distributed.timeout_s)
    rates = probe_matmuls(cfg, device, dist)
    precision_kept = kept is not None and t.precision == kept.requested_precision
    if precision_kept:
        precision = kept.precision
    else:
        precision = resolve_precision(t.precision, device, rates)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    deterministic = cfg.run.deterministic if cfg.run.deterministic is not None else device.type == "cpu"
    if deterministic:
        use_deterministic_algorithms(device)
    if device.type == "cpu":
        keep_freed_memory()  # steps re-allocate the same tensors: reuse them, not fresh zeroed pages (docs/LOG.md)
    torch.manual_seed(cfg.run.seed + dist.rank)
    peak, peak_source = mfu_peak(cfg, device, precision)
    autocast = precision_autocast(device.type, precision)
    return Runtime(
        device,
        precision,
        dist,
        compile,
        peak * dist.world_size,
        autocast,
        rates,
        t.precision,
        t.compile,
        precision_kept,
        peak_source,
    )


def use_deterministic_algorithms(device: torch.device) -> None:
    """Same seed, same losses, compiled too (run.deterministic). On the CPU it costs nothing measurable on the presets,
    and without it inductor's embedding backward adds rows with atomics in thread order. warn_only: a kernel with no
    deterministic form (on CUDA: SDPA's flash and memory-efficient backward) warns once and runs, so a GPU run repeats
    to within its rounding, not bit for bit. cuBLAS needs its workspace fixed before its first matmul."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # we never read torch.empty's contents


def resolve_device(name: str, dist: DistInfo) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"run.device = {name!r} but this machine has no CUDA device (use --device cpu)")
        index = int(name[5:]) if ":" in name else dist.local_rank
        if index >= torch.cuda.device_count():
            raise UserError(f"run.device = {name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("run.device = 'mps' but MPS is not available here (use --device cpu)")
    return torch.device(name)


def probe_matmuls(cfg: Config, device: torch.device, dist: DistInfo) -> MatmulRates | None:
    """On the CPU: fp32 and bf16 matmul rates at the model's MLP shape, rank 0's for every rank (so that all ranks
    run the same precision). auto decides by them, and MFU is measured against the rate of the precision in use."""
    if device.type != "cpu":
        return None
    rows = cfg.training.batch_size * cfg.model.block_size
    rates = measure_cpu_rates(cfg.model.n_embd, rows) if dist.is_main else None
    return distributed.broadcast_object(rates, dist)


def mfu_peak(cfg: Config, device: torch.device, precision: str) -> tuple[float, str]:
    """One device's peak FLOP/s for MFU, and what it is: logging.peak_tflops, else the device's nominal peak
    (metrics.default_peak_flops: on a CPU from its vector units and clock, never from a measurement of the moment)."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    return default_peak_flops(device, precision)


def resolve_precision(requested: str, device: torch.device, rates: MatmulRates | None = None) -> str:
    """auto: bf16 on a CUDA device that runs it in hardware, else fp16 (with a GradScaler: on a pre-Ampere card
    emulated bf16 is slower); on the CPU whichever of fp32 and bf16 the probe measured faster."""
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if cuda_has_native_bf16() else "fp16"
        return rates.faster if rates else "fp32"
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("training.precision = 'bf16' but this GPU has no bf16 support: use fp16 or auto")
    return requested


def has_cxx_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


@contextmanager
def callers_determinism_restored() -> Iterator[None]:
    """setup() switches on deterministic algorithms (run.deterministic: by default on the CPU); a Python caller gets
    its own setting back."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


# ---- build ----------------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """What an evaluation scores besides the loss, read once when the run is built: the bytes of each token (bits per
    byte), eval.hellaswag's items and the CORE bundle (found and checked before the first step)."""

    token_bytes: torch.Tensor  # UTF-8 bytes of each token id, on the run's device
    hellaswag: list[HellaSwagItem] | None  # the first eval.hellaswag_limit items; None: eval.hellaswag is off
    core: Path | None = None  # the CORE bundle when eval.core_every is on

    @classmethod
    def load(cls, cfg: EvalConfig, dataset: Dataset, device: torch.device) -> Evaluation:
        token_bytes = torch.as_tensor(dataset.tokenizer.token_bytes(), device=device)
        hellaswag = None
        if cfg.hellaswag:
            hellaswag = hellaswag_items(cfg.hellaswag, dataset.tokenizer, cfg.hellaswag_limit, cfg.map_unknown)[0]
        core = None
        if cfg.core_every:
            core = find_bundle(cfg.core_bundle)
            read_bundle(core)  # a missing or malformed bundle stops the run here, in one line
        return cls(token_bytes, hellaswag, core)


@dataclass
class Trainer:
    """Everything the loop works with, built once by build_trainer()."""

    cfg: Config  # the resolved config: what the run records
    rt: Runtime
    dataset: Dataset
    raw_model: GPT
    model: nn.Module  # raw_model as the step calls it: FSDP- or DDP-wrapped and compiled as configured
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    objective: Objective  # what the run trains on: its loss, batches, evaluation (quillgpt/objective.py)
    run_dir: RunDir | None  # None: a measurement that saves nothing (bench.py)
    tokenizer: dict  # the dataset's tokenizer.to_dict(), stored in every checkpoint
    evaluation: Evaluation  # what the evaluation scores besides the loss
    lora: dict | None = None  # a LoRA run: its adapters' settings and its base (run_model.LoraPlan.record)

    @property
    def batches(self):
        return self.objective.batches

    @property
    def block_size(self) -> int:
        return self.raw_model.config.block_size

    @property
    def tokens_per_step(self) -> int:
        return self.objective.tokens_per_step(self)

    def tokens_at(self, it: int) -> int:
        """Tokens step `it` trains on (fewer than tokens_per_step during a batch ramp)."""
        return self.objective.tokens_per_step(self, it)


def muon_dtype(cfg: Config, rt: Runtime) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz matmuls: bf16, as torch.optim.Muon runs them, except on a CPU where bf16
    measures slower than fp32 (emulated): there bf16 would make the optimizer the step's slowest part."""
    if rt.device.type != "cpu" or cfg.optimizer.name != "muon" or rt.matmul_rates is None:
        return torch.bfloat16
    return PRECISIONS[rt.matmul_rates.faster]


def tokens_per_step(t: TrainingConfig, world_size: int, block_size: int) -> int:
    """Tokens per optimizer step over all ranks: batch_size x grad_accum_steps x world_size x block_size."""
    return t.batch_size * t.grad_accum_steps * world_size * block_size


def build_trainer(
    cfg: Config,
    rt: Runtime,
    dataset: Dataset,
    run_dir: RunDir | None = None,
    resume: TrainingCheckpoint | None = None,
    plan: ModelPlan | None = None,
) -> Trainer:
    """The planned model (run_model.plan_model: resumed, from run.init_from, or new) on its device, wrapped for
    DDP/FSDP and compiled as configured, its optimizers, the GradScaler and the batch source; with the config the run
    records."""
    plan = plan or distributed.on_every_rank(plan_model, rt.dist, cfg, dataset, resume)
    raw_model = distributed.on_every_rank(build_model, rt.dist, plan, resume, PRECISIONS[rt.precision])
    raw_model.to(rt.device)
    if rt.device.type == "cpu":
        use_cpu_training_kernels(raw_model)  # the faster dropout mask and attention paths (quillgpt/kernels.py)
    raw_model.gradient_checkpointing = cfg.training.gradient_checkpointing
    # DPO's and RL's reference, run.init_from's model: before wrapping, a new run's model is it
    reference = None
    if dataset.preference or cfg.rl.enabled and cfg.rl.kl_coef > 0:
        reference = raw_model if plan.reference is None else build_model(plan.reference).to(rt.device)
    preference = None
    if dataset.preference:
        preference = distributed.on_every_rank(
            build_preference_pairs,
            rt.dist,
            cfg.dpo,
            cfg.training,
            cfg.run.seed,
            dataset,
            reference,
            reference is raw_model,
            rt,
        )
    lora = plan.lora.settings.as_config() if plan.lora else None
    name = run_dir.path.name if run_dir else cfg.run.name
    cfg = resolved(cfg, name, raw_model.config, rt.compile, rt.precision, lora)
    if cfg.distributed.fsdp and rt.dist.enabled and cfg.optimizer.name == "muon":
        raise UserError(
            "distributed.fsdp does not support optimizer.name = 'muon' (Muon orthogonalises whole "
            "matrices, FSDP shards them): use adamw, or DDP"
        )
    raw_model.loss_chunks = cfg.training.loss_chunks
    model = distributed.wrap_model(
        raw_model,
        rt.dist,
        rt.device,
        rt.compile,
        cfg.distributed.fsdp,
        cfg.training.gradient_checkpointing,
        rt.precision,
        cfg.training.compile_mode,
    )
    # after wrapping: FSDP swaps the parameters. Muon's Newton-Schulz matmuls run in bf16 only where the run does
    optimizers = make_optimizers(raw_model, cfg.optimizer, rt.device.type, muon_dtype(cfg, rt))
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.precision == "fp16")
    objective = preference or language_objective(cfg, rt, dataset, raw_model, reference)
    return Trainer(
        cfg,
        rt,
        dataset,
        raw_model,
        model,
        optimizers,
        scaler,
        objective,
        run_dir,
        dataset.tokenizer.to_dict(),  # on chat data: with its chat template, so sample.py and export.py have it
        Evaluation.load(cfg.eval, dataset, rt.device),
        plan.lora.record() if plan.lora else None,
    )


def language_objective(
    cfg: Config, rt: Runtime, dataset: Dataset, raw_model: GPT, reference: GPT | None
) -> LanguageModeling:
    """The objective of a text or chat run: language modelling over its batches, or with rl.enabled RL, whose
    rollouts step (quillgpt/rl.py) and whose evaluation adds the tasks' accuracy; reference: its KL penalty's."""
    batches = BatchSource(
        dataset,
        raw_model.config.block_size,
        cfg.training.batch_size,
        cfg.run.seed,
        rt.device,
        chat_rows=cfg.data.chat_rows,
        document_mask=cfg.data.document_mask,
    )
    routing = RouterTally.of(raw_model, distributed.all_reduce_sum)
    if cfg.rl.enabled:
        if reference is raw_model:  # a new run: the model as it starts, kept apart
            reference = copy.deepcopy(raw_model)
        return build_rl(cfg.rl, cfg.run.seed, dataset, reference, batches, routing)
    return LanguageModeling(batches, routing)


def restore(tr: Trainer, ckpt: TrainingCheckpoint) -> TrainState:
    """Optimizer, scaler and RNG state from the checkpoint whose weights build_trainer() loaded; returns its progress.

    On the world size it was written with, a run continues exactly: the data stream is a pure
    function of the step (data.py) and every rank gets back its own RNG state (dropout). On another
    world size the data streams are re-derived from the step counter for the new layout: keep
    batch_size x grad_accum_steps x world_size constant (2 ranks x 1 -> 1 rank x 2 accumulation
    steps) and every optimizer step draws exactly the micro-batches it would have drawn; each rank's
    RNG is then seeded afresh from (seed, rank, step). An FSDP checkpoint (sharded optimizer state)
    resumes on any world size, with or without FSDP; other checkpoints can't be resumed under FSDP.
    """
    dist = tr.rt.dist
    if ckpt.sharded:
        distributed.load_sharded(tr.raw_model, tr.optimizers, tr.run_dir.path / ckpt.sharded)
    elif distributed.is_sharded(tr.raw_model):
        raise UserError(
            "--resume with distributed.fsdp needs a checkpoint written under FSDP: resume this one without "
            "FSDP, or start a new run from its weights with run.init_from"
        )
    else:
        if len(ckpt.optimizers) != len(tr.optimizers):
            raise UserError("--resume: the checkpoint's optimizer differs from the config's (optimizer.name)")
        for opt, sd in zip(tr.optimizers, ckpt.optimizers):
            opt.load_state_dict(sd)
    if ckpt.scaler and tr.scaler.is_enabled():
        tr.scaler.load_state_dict(ckpt.scaler)
    if len(ckpt.rng) == dist.world_size:
        set_rng_state(ckpt.rng[dist.rank])
    else:
        torch.manual_seed(hash((tr.cfg.run.seed, dist.rank, ckpt.state.iter_num)) & 0xFFFF_FFFF)
        if dist.is_main:
            print(
                f"resuming a {ckpt.world_size}-rank checkpoint on {dist.world_size} ranks: "
                "data streams are re-derived from the step counter for the new world size, RNG streams re-seeded"
            )
    return replace(ckpt.state)


# ---- the run directory and the log --------------------------------------------------------------


def start_run(tr: Trainer, state: TrainState, resumed: bool) -> MetricsLog | None:
    """On rank 0: print the start-up lines, write config.toml, remove the temp files a killed run left, and open
    the metrics log (continuing train_log.json on resume) and wandb. eval_only reads a run and writes nothing.
    The other ranks log nothing: None."""
    if not tr.rt.dist.is_main:
        return None
    cfg, run_dir = tr.cfg, tr.run_dir
    print_startup(tr, state)
    evaluating_only = cfg.training.eval_only
    if not evaluating_only:
        atomic_write_text(
            run_dir.path / "config.toml", to_toml(cfg)
        )  # creates the run directory; WriteError if it can't
        run_dir.remove_temp_files()
    kw = dict(
        json_log=cfg.logging.json_log and not evaluating_only,
        plot=cfg.logging.plot and not evaluating_only,
        assistant_only=tr.dataset.chat,
        dpo=tr.objective.name == "dpo",
        loss_name=tr.objective.loss_name if tr.objective.loss_name != "loss" else None,
    )
    log = MetricsLog.resume(run_dir.path, state.iter_num, **kw) if resumed else MetricsLog(run_dir.path, **kw)
    if cfg.logging.wandb_project:
        state.wandb_run_id = log.start_wandb(
            cfg.logging.wandb_project, cfg.logging.wandb_run_name or cfg.run.name, state.wandb_run_id, cfg.to_dict()
        )
    return log


def print_startup(tr: Trainer, state: TrainState) -> None:
    rt, model, dataset = tr.rt, tr.raw_model, tr.dataset
    print(summary(tr.cfg))
    print(
        f"data: {dataset.directory} | {dataset.tokenizer.kind} tokenizer, vocab {dataset.vocab_size} | "
        f"train {dataset.lengths['train']:,} / val {dataset.lengths['val']:,} tokens"
    )
    if line := tr.objective.data_line(tr):
        print(line)
    print(f"model: {model.num_params() / 1e6:.2f}M parameters | {model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    if tr.lora:
        print(lora_line(tr))
    if model.config.n_experts:
        print(moe_line(model))
    print(tr.objective.batch_line(tr))
    print(device_line(rt))
    if rt.matmul_rates and rt.precision == "bf16" and rt.matmul_rates.faster == "fp32":
        print(emulation_warning(rt.matmul_rates), flush=True)
    if state.iter_num:
        print(f"resuming {tr.run_dir.path} at iter {state.iter_num} (best val loss {state.best_val_loss:.4f})")
    print(f"run: {tr.run_dir.path} | rss {rss_mb():.0f} MB", flush=True)


def lora_line(tr: Trainer) -> str:
    """What a LoRA run trains and on what: its adapters, the share of the weights they are, the frozen base."""
    lo, base = tr.cfg.lora, tr.lora["base"]
    quantized = f", base stored {lo.quantize}" if lo.quantize != "none" else ""
    return (
        f"lora: rank {lo.rank}, alpha {lo.alpha:g} on {', '.join(lo.targets)}{quantized} | "
        f"{trainable_summary(tr.raw_model)} | base {base['path']} (sha256 {base['sha256'][:12]})"
    )


def device_line(rt: Runtime) -> str:
    """`device: cpu, bf16 (auto: ...)`: the precision, how it was chosen, and the rates behind the choice."""
    line = f"device: {rt.device}, {rt.precision}" + (" with GradScaler" if rt.precision == "fp16" else "")
    if rt.device.type == "cpu":
        line += f" ({torch.get_num_threads()} threads"
        if rt.matmul_rates:
            settled = bool(rt.matmul_rates.settled_by)  # a busy machine: describe() says what decided instead
            if rt.precision_kept:
                chosen = "as the run began (the checkpoint's), not measured again"
            elif rt.requested_precision == "auto":
                chosen = "auto picked" if settled else "auto picked the faster"
            else:
                chosen = "as configured"
            line += f"; {chosen}: {rt.matmul_rates.describe()}"
        line += ")"
    if rt.peak_source:
        line += f"; MFU against {rt.peak_flops / rt.dist.world_size / 1e9:,.1f} GFLOP/s: {rt.peak_source}"
    return line


# ---- one optimizer step -------------------------------------------------------------------------


def train_step(tr: Trainer, it: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step of the run's objective: (loss, grad norm, skipped), tensors on the device (Objective.step)."""
    return tr.objective.step(tr, it)


def eval_metrics(tr: Trainer, batches: int | None = None) -> dict[str, float]:
    """The run's evaluation over `batches` (default eval_iters) batches per split (Objective.evaluate)."""
    return tr.objective.evaluate(tr, batches or tr.cfg.training.eval_iters)


def evaluate_and_track(tr: Trainer, state: TrainState, log: MetricsLog | None, final: bool = False) -> str:
    """Evaluate (the final evaluation over final_eval_iters batches), log it, keep the best checkpoint and count
    evaluations without improvement. Returns why training should stop early, or ""."""
    t = tr.cfg.training
    metrics = eval_metrics(tr, t.final_eval_iters if final else None)
    if core_due(tr, state.iter_num, final):
        metrics.update(core_metrics(tr))
    state.best_val_loss = min(state.best_val_loss, metrics["val_loss"])
    score = best_metric_score(metrics, t.best_metric)
    improved = score < state.best_score - t.early_stopping_min_delta
    if improved:
        state.best_score, state.bad_evals = score, 0
    else:
        state.bad_evals += 1
    if log:
        log.evaluation(state.iter_num, metrics, improved, state.tokens_seen)
    if improved and t.save_best and state.iter_num > 0 and not t.eval_only:
        save(tr, state, "best")
    if log:
        log.flush()
    if not improved and t.early_stopping and state.bad_evals >= t.early_stopping_patience:
        return (
            f"early stopping: {t.best_metric} has not improved by {t.early_stopping_min_delta} for "
            f"{state.bad_evals} evaluations (best {best_metric_value(state.best_score, t.best_metric):.4f})"
        )
    return ""


def core_due(tr: Trainer, it: int, final: bool) -> bool:
    """CORE at the evaluations every eval.core_every steps (not the one before the first step), at the last, and
    at an eval_only run's one."""
    every = tr.cfg.eval.core_every
    return bool(tr.evaluation.core) and (final or tr.cfg.training.eval_only or (it > 0 and it % every == 0))


def core_metrics(tr: Trainer) -> dict[str, float]:
    """CORE and each task's centred score (core_<label>), over eval.core_max_per_task items a task, the items dealt
    to the ranks (core_eval.core_score sums their results, so every rank logs one process's figures)."""
    e, dist = tr.cfg.eval, tr.rt.dist
    core = core_score(
        tr.raw_model,
        tr.dataset.tokenizer,
        tr.evaluation.core,
        e.core_max_per_task or None,
        tr.rt.device,
        dist.rank,
        dist.world_size,
        autocast=tr.rt.autocast,
        map_unknown=e.map_unknown,
    )
    return {"core": core["core"], **{f"core_{label}": t["centered"] for label, t in core["tasks"].items()}}


def best_metric_score(metrics: dict[str, float], name: str) -> float:
    """training.best_metric as a score where lower is better (accuracies, HellaSwag's and RL's, are negated)."""
    if name == "task_acc":
        return -metrics.get("task_acc", 0.0)
    if name in ("val_loss", "bpb"):
        return metrics["val_loss" if name == "val_loss" else "val_bpb"]
    return -metrics.get("hellaswag_acc_norm", 0.0)


def best_metric_value(score: float, name: str) -> float:
    return -score if name in ("hellaswag", "task_acc") else score


# ---- checkpoints ----------------------------------------------------------------------------------


def save(tr: Trainer, state: TrainState, kind: str, final: bool = False) -> None:
    """Save a checkpoint: "last" (ckpt_last.pt, `latest` and a pruned step checkpoint) or "best" (ckpt_best.pt).

    Collective: every rank takes part (RNG states are gathered; under FSDP the weights are gathered and every
    rank writes its shards first); rank 0 writes the file (RunDir.save: a failed periodic save is a warning,
    a failed final one a UserError naming the last good checkpoint)."""
    ckpt = TrainingCheckpoint(
        model=adapter_state(tr.raw_model) if tr.lora else distributed.model_state_dict(tr.raw_model),
        model_args=tr.raw_model.config.to_dict(),
        optimizers=[distributed.optimizer_state_dict(tr.raw_model, o) for o in tr.optimizers],
        config=tr.cfg.to_dict(),
        rng=distributed.gather_objects(rng_state()),
        state=state,
        scaler=tr.scaler.state_dict() if tr.scaler.is_enabled() else None,
        tokenizer=tr.tokenizer,
        world_size=tr.rt.dist.world_size,
        requested={"precision": tr.rt.requested_precision, "compile": tr.rt.requested_compile},
        resolved_on=tr.rt.device.type,
        lora=tr.lora,
    )
    if kind == "last" and distributed.is_sharded(tr.raw_model):
        directory = tr.run_dir.sharded(state.iter_num)
        ckpt.sharded = distributed.save_sharded(tr.raw_model, tr.optimizers, directory, tr.rt.dist).name
    t = tr.cfg.training
    distributed.on_main(tr.run_dir.save, tr.rt.dist, kind, ckpt, t.save_interval, t.keep_last, final)


# ---- the loop -------------------------------------------------------------------------------------


class StopRequest:
    """SIGINT or SIGTERM during training: finish the step, save, stop with reason "signal"; a second Ctrl-C aborts.
    A context manager: the previous handlers are back afterwards (train() may be called from Python)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: list = []

    def __enter__(self) -> StopRequest:
        self._previous = [(sig, signal.signal(sig, self._handle)) for sig in (signal.SIGINT, signal.SIGTERM)]
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name} received: finishing this step, saving, exiting", flush=True)


class StepClock:
    """Seconds per optimizer step, timed from one moment the device has finished its queued work to the next.

    On a GPU a step that reads nothing back only queues its work: a clock around it would time the queueing, and the
    wait at the next step that reads would fall outside every window, so tok/s and MFU would read high. So the
    window closes where the loop waits anyway (settle(), at the steps that log, evaluate or save) and opens again
    after evaluating or saving (restart(), which leaves them out). The first step is timed alone (it may compile:
    the one extra wait of a run); the mean covers the last 20 steps or so."""

    RECENT = 20

    def __init__(self, synchronize: Callable[[], None], now: Callable[[], float] = time.perf_counter) -> None:
        self.synchronize, self.now = synchronize, now
        self.steps = 0  # steps taken
        self.first: float | None = None  # seconds of the first step
        self.windows: list[tuple[float, int]] = []  # (seconds, steps) of the latest windows, RECENT steps or a few more
        self.pending = 0  # steps queued since the window opened
        self.total = 0.0  # seconds of all closed windows, the first step's included
        self.restart()

    def tick(self) -> None:
        """A step was queued."""
        self.steps += 1
        self.pending += 1
        if self.steps == 1:
            self.settle()

    def settle(self) -> None:
        """Wait for the device and close the window: its steps' time counts."""
        self.synchronize()
        now = self.now()
        if self.pending:
            self.total += now - self._start
        if self.pending and self.first is None:
            self.first = now - self._start
        elif self.pending:
            self.windows.append((now - self._start, self.pending))
            while sum(n for _, n in self.windows[1:]) >= self.RECENT:
                self.windows.pop(0)
        self._start, self.pending = now, 0

    def restart(self) -> None:
        """Open a window now, the device idle (after evaluating or saving, which are not steps)."""
        self.synchronize()
        self._start, self.pending = self.now(), 0

    @property
    def seconds_per_step(self) -> float:
        steps = sum(n for _, n in self.windows)
        return sum(t for t, _ in self.windows) / steps if steps else self.first or 0.0


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on it (a no-op on the CPU, where nothing is queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Budget:
    """training.time_budget_s on a clock every rank agrees on. The seconds of training steps (evaluations and saves
    left out: StepClock's) are measured where the loop reads back anyway, and rank 0's are agreed on there (agree);
    between those steps they are projected from the agreed seconds per step, so that every rank sets the same rate
    and stops at the same step with no read-back per step. A resumed run starts from the seconds its checkpoint
    spent (TrainState.train_seconds): the budget left is exactly what was left."""

    def __init__(self, seconds: float, spent: float, it: int) -> None:
        self.seconds, self.begun = seconds, spent  # the budget; what earlier sessions of the run spent
        self.spent, self.mark, self.rate = spent, it, 0.0  # agreed at step `mark`; seconds a step since

    def at(self, it: int) -> float:
        """The seconds spent by the start of step `it` (projected past the last agreement)."""
        return self.spent + (it - self.mark) * self.rate

    def over(self, it: int) -> bool:
        return self.seconds > 0 and self.at(it) >= self.seconds

    def agree(self, it: int, clock: StepClock, state: TrainState, info: distributed.DistInfo) -> None:
        """Rank 0's measured seconds and rate, on every rank (a collective): stored in state for the checkpoint."""
        measured = [self.begun + clock.total, clock.seconds_per_step]
        self.spent, self.rate = distributed.broadcast_object(measured, info)
        self.mark, state.train_seconds = it, self.spent

    def remaining(self) -> float:
        return max(0.0, self.seconds - self.spent)


@dataclass
class Outcome:
    state: TrainState
    last_loss: float | None  # the last logged training loss (mean over ranks)
    stop_reason: str  # "" when max_iters was reached


def fit(tr: Trainer, state: TrainState, log: MetricsLog | None, stop: StopRequest) -> Outcome:
    """Train from state.iter_num to max_iters, or until early stopping, a signal or too many non-finite steps;
    evaluate at the start, every eval_interval and at the end; save every save_interval and at the end.

    Only steps that log, evaluate or save read anything back from the device (as nanoGPT's loop does): a plain
    step queues its work and goes on. Skipped non-finite steps are counted on the device and reported at the next
    step that reads; signals are agreed on between ranks there too (a single process stops at once)."""
    t = tr.cfg.training
    if t.eval_only:
        return Outcome(state, None, evaluate_and_track(tr, state, log))
    reason = evaluate_and_track(tr, state, log) if state.iter_num == 0 and t.eval_interval else ""
    tr.model.train()
    clock, last_loss, loss = StepClock(lambda: synchronize(tr.rt.device)), None, None
    guard = NonfiniteGuard(tr.rt.device, state.nonfinite_streak)
    single = tr.rt.dist.world_size == 1
    budget = Budget(t.time_budget_s, state.train_seconds, state.iter_num)
    while state.iter_num < t.max_iters and not budget.over(state.iter_num) and not reason:
        lr = set_lr(tr.optimizers, lr_multiplier(state.iter_num, tr.cfg, budget.at(state.iter_num)))
        loss, norm, skipped = train_step(tr, state.iter_num)
        guard.record(skipped, state.iter_num)
        state.tokens_seen += tr.tokens_at(state.iter_num)
        state.iter_num += 1
        clock.tick()
        if clock.steps == 1 and log and tr.rt.compile:
            print(f"first step took {clock.first:.1f}s (torch.compile); later steps are fast", flush=True)
        done = state.iter_num >= t.max_iters or budget.over(state.iter_num)
        logging = bool(t.log_interval and state.iter_num % t.log_interval == 0)
        due = done or logging or evaluation_due(state.iter_num, t, done) or save_due(state.iter_num, t, False)
        measuring = budget.seconds > 0 and clock.steps <= 3  # the first step may compile: the rate needs the next ones
        if not (due or measuring or (single and stop.requested)):
            continue
        clock.settle()
        if budget.seconds > 0:
            budget.agree(state.iter_num, clock, state, tr.rt.dist)
            done = done or budget.over(state.iter_num)
        reason = guard.settle(state, t.max_nonfinite_steps, tr.rt.dist.is_main)
        if logging:
            last_loss = log_step(tr, state, log, loss, lr, norm, clock, budget)
        # every rank agrees; not stored back in stop.requested: a signal that arrives while any_rank
        # waits would be overwritten (and lost), whereas this way it is agreed on at the next such step
        signalled = distributed.any_rank(stop.requested)
        if not signalled and evaluation_due(state.iter_num, t, done):
            reason = evaluate_and_track(tr, state, log, final=done) or reason
        reason = reason or ("signal" if signalled else "")
        if save_due(state.iter_num, t, ending=done or bool(reason)):
            save(tr, state, "last", final=done or bool(reason))
            if log:
                log.flush()
        if done:  # a budget's end once projected stays the end: its final evaluation was just taken
            break
        clock.restart()
    if last_loss is None and loss is not None:
        last_loss = distributed.mean_over_ranks(loss, tr.rt.dist)
    return Outcome(state, last_loss, reason)


class NonfiniteGuard:
    """Skipped (non-finite) steps, counted on the device so that a step which doesn't log never waits for it;
    settle() reads the counts at the next step that reads anyway and reports them in one line. No skipped step
    changes the weights (step_unless_nonfinite), so reading late loses nothing."""

    def __init__(self, device: torch.device, streak: int) -> None:
        self.streak = torch.tensor(float(streak), device=device)  # skipped steps in a row, now
        self.worst = self.streak.clone()  # the longest run of them since the last settle
        self.skipped = torch.zeros((), device=device)  # skipped steps since the last settle
        self.first: int | None = None  # the first step since the last settle

    def record(self, skipped: torch.Tensor, it: int) -> None:
        self.streak = (self.streak + skipped) * skipped  # back to 0 after a good step
        self.worst = torch.maximum(self.worst, self.streak)
        self.skipped += skipped
        self.first = it if self.first is None else self.first

    def settle(self, state: TrainState, limit: int, main: bool) -> str:
        """Update state.nonfinite_streak; the reason to stop once `limit` steps in a row were skipped, else ""."""
        skipped, streak, worst = (int(v) for v in torch.stack([self.skipped, self.streak, self.worst]).tolist())
        state.nonfinite_streak = streak
        if skipped and main:
            print(
                f"iters {self.first + 1}-{state.iter_num}: {skipped} step(s) skipped for a non-finite loss or "
                f"gradient, no update applied ({worst} in a row at most)",
                flush=True,
            )
        self.skipped.zero_()
        self.worst = self.streak.clone()
        self.first = None
        if worst < limit:
            return ""
        return (
            f"stopped: {worst} consecutive non-finite steps; the last good checkpoint is intact "
            "(lower the learning rate or use bf16/fp32)"
        )


def evaluation_due(it: int, t: TrainingConfig, done: bool) -> bool:
    return done or bool(t.eval_interval and it % t.eval_interval == 0)


def save_due(it: int, t: TrainingConfig, ending: bool) -> bool:
    return ending or bool(t.save_interval and it % t.save_interval == 0)


def log_step(
    tr: Trainer,
    state: TrainState,
    log: MetricsLog | None,
    loss: torch.Tensor,
    lr: float,
    norm: torch.Tensor,
    clock: StepClock,
    budget: Budget,
) -> float:
    """The step's loss averaged over the ranks (a collective); rank 0 prints and records it with lr, gradient
    norm, speed, MFU and ETA."""
    mean_loss = distributed.mean_over_ranks(loss, tr.rt.dist)
    if log:
        seconds = clock.seconds_per_step
        tokens_per_s = tr.tokens_at(state.iter_num - 1) / seconds
        max_iters = tr.cfg.training.max_iters
        eta = None
        if budget.seconds > 0:
            eta = min(budget.remaining(), (max_iters - state.iter_num) * seconds)
            max_iters = None if max_iters == NO_CAP else max_iters
        log.step(
            state.iter_num,
            max_iters,
            mean_loss,
            lr,
            float(norm),
            seconds,
            tokens_per_s,
            tr.raw_model.estimate_mfu(tokens_per_s, tr.rt.peak_flops),
            state.tokens_seen,
            tr.objective.figures(),
            eta,
        )
    return mean_loss


def step_figures(tr: Trainer) -> dict[str, float] | None:
    """The step line's figures besides the loss: an RL run's rewards, an MoE's router balance."""
    return tr.objective.figures()
