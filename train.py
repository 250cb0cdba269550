"""Train a GPT from a TOML config.

    # the main job: the offline default corpus (Python's stdlib sources), char tokenizer, CPU, ~3 min
    python train.py --config configs/base/base.toml

    # a tiny CPU smoke run
    python train.py --config configs/base/base.toml --max-iters 20 --training.eval_interval 10 --run.name smoke

    # tiny Shakespeare (nanoGPT's CPU preset), from a local copy of the text
    python train.py --config configs/shakespeare_char/cpu.toml --data.input ../shared/data/tinyshakespeare.txt

    # resume the run named in the config (or pass a run directory / checkpoint)
    python train.py --config configs/shakespeare_char/cpu.toml --resume

    # check a config and its feasibility without training
    python train.py --config configs/gpt2/124M.toml --validate

    # data-parallel: torchrun, or let train.py launch torchrun itself
    torchrun --standalone --nproc_per_node 2 train.py --config configs/base/base.toml
    python train.py --config configs/base/base.toml --nproc-per-node 2

Any config key can be overridden: --section.key value (or --section.key=value), plus the short
flags --max-iters, --device and --tokenizer. From Python:

    from train import train
    result = train("configs/base/base.toml", overrides={"training.max_iters": 50})
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

import distributed as dist_utils
from checkpoint import (RunDir, link_or_copy, load_checkpoint, load_model_weights, model_config_from_checkpoint, rng_state,
                        save_checkpoint, set_rng_state)
from common import UserError, WriteError, atomic_write_text, format_duration, report, run_main
from config import Config, build_config, load_toml, parse_overrides, summary, to_toml
from data import BatchSource, Dataset, check_fits, load_dataset, tokenizer_label
from metrics import MetricsLog, default_peak_flops, format_step_line, rss_mb
from model import GPT, GPTConfig

T = TypeVar("T")
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class TrainResult:
    final_loss: float | None
    best_val_loss: float
    total_tokens: int
    checkpoint_path: str | None
    iterations: int
    stop_reason: str


@dataclass
class TrainState:
    """Everything a checkpoint must carry besides weights and optimizer state to resume exactly."""
    iter_num: int = 0
    best_val_loss: float = float("inf")
    bad_evals: int = 0
    tokens_seen: int = 0
    nonfinite_streak: int = 0
    wandb_run_id: str | None = None
    last_loss: float | None = None
    stop_reason: str = ""
    stop_requested: bool = False


@dataclass
class Runtime:
    """The resolved setup a training loop needs (device, precision, parallelism)."""
    cfg: Config
    device: torch.device
    precision: str
    autocast: object
    dist: dist_utils.DistInfo
    run: RunDir
    peak_flops: float
    tokens_per_step: int = 0
    log: MetricsLog | None = None
    signals: list = field(default_factory=list)  # (signal, previous handler) pairs, restored when training ends
    last_saved: str | None = None  # "ckpt_last.pt (iter N)" of the newest successful save, for error messages


# ---- setup ----------------------------------------------------------------------------------------

def resolve_device(name: str, dist: dist_utils.DistInfo) -> torch.device:
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


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("training.precision = 'bf16' but this GPU has no bf16 support: use fp16 or auto")
    return requested


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls several times faster than fp32 (without them bf16 is emulated, usually slower)."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def has_cxx_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


def make_runtime(cfg: Config, device: torch.device, precision: str, dist: dist_utils.DistInfo, run: RunDir) -> Runtime:
    """Resolve the compile default, seed the RNG and pick the MFU peak (shared by train() and bench.py)."""
    if cfg.model.compile is None:
        cfg.model.compile = device.type == "cuda"
    if cfg.model.compile and device.type == "cpu" and not has_cxx_compiler():
        raise UserError("model.compile = true needs a C++ compiler on the CPU (inductor builds C++ kernels); "
                        "install g++ or set --model.compile false")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":
        # Same seed, same losses, compiled too: inductor's CPU embedding backward otherwise adds rows with
        # atomics in thread order. No slower on the CPU preset (measured); warn_only: never an error.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # we never read torch.empty's contents
    torch.manual_seed(cfg.run.seed + dist.rank)
    peak = cfg.logging.peak_tflops * 1e12 if cfg.logging.peak_tflops else default_peak_flops(device, precision)
    return Runtime(cfg, device, precision, autocast_context(device, precision), dist, run, peak)


def make_optimizers(raw_model: GPT, cfg: Config, device: torch.device) -> list[torch.optim.Optimizer]:
    o = cfg.optimizer
    return raw_model.configure_optimizers(o.weight_decay, o.learning_rate, (o.beta1, o.beta2), device.type,
                                          optimizer=o.name, fused=o.fused, muon_lr=o.muon_lr,
                                          muon_momentum=o.muon_momentum)


def lr_multiplier(it: int, cfg: Config) -> float:
    """Linear warmup, cosine decay to min_lr over lr_decay_iters, then constant; as a fraction of peak."""
    o = cfg.optimizer
    if not o.decay_lr:
        return 1.0
    decay_iters = o.lr_decay_iters or cfg.training.max_iters
    floor = o.min_lr / o.learning_rate
    if it < o.warmup_iters:
        return (it + 1) / (o.warmup_iters + 1)
    if it >= decay_iters:
        return floor
    ratio = (it - o.warmup_iters) / max(1, decay_iters - o.warmup_iters)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float) -> float:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
    return optimizers[-1].param_groups[0]["lr"]


def on_every_rank(fn: Callable[[], T], dist: dist_utils.DistInfo) -> T:
    """Run fn on every rank (checks whose outcome is the same on each); a UserError on any rank is printed
    once, by rank 0, before any rank exits, and raised on every rank, so all exit 2."""
    try:
        return_value, error = fn(), None
    except UserError as e:
        if not dist.enabled:
            raise
        return_value, error = None, str(e)
    if dist.enabled:
        errors = [e for e in dist_utils.gather_objects(error, dist) if e is not None]
        if errors:
            if dist.is_main:
                report(UserError(errors[0]))
            dist_utils.barrier(dist)  # nobody exits (and so has torchrun stop the rest) before rank 0 has printed
            raise UserError(errors[0], reported_elsewhere=True)
    return return_value


def on_main_then_share(fn: Callable[[], object], dist: dist_utils.DistInfo) -> None:
    """Run fn on rank 0 while the others wait; a UserError there is handled as on_every_rank's."""
    on_every_rank(lambda: fn() if dist.is_main else None, dist)


def prepare_data(cfg: Config, dist: dist_utils.DistInfo) -> Dataset:
    """Find (or, on rank 0, prepare) the dataset the config names, then open and check it."""
    from prepare import prepare_dataset, prepare_txt_dir

    d = cfg.data
    if cfg.training.data_format == "txt":
        processed = Path(d.processed_dir or "data/processed")
        on_main_then_share(lambda: prepare_txt_dir(processed, tokenizer=d.tokenizer,
                                                   vocab_size=d.bpe_vocab_size if d.tokenizer == "bpe" else None), dist)
        directory = processed / "cache"
    elif d.processed_dir is not None:
        # the seed's rule: data/processed falls back to its parent data/ for train.bin/val.bin
        directory = Path(d.processed_dir)
        if not (directory / "train.bin").exists() and directory.name == "processed":
            directory = directory.parent
        if not (directory / "train.bin").exists():
            raise UserError(f"no train.bin in data.processed_dir = {d.processed_dir} (or its parent)")
    else:
        on_main_then_share(lambda: prepare_dataset(d.dataset, input_path=d.input, tokenizer=d.tokenizer,
                                                   vocab_size=d.bpe_vocab_size if d.tokenizer == "bpe" else None,
                                                   val_fraction=d.val_fraction, data_dir=d.data_dir,
                                                   max_bytes=d.max_bytes), dist)
        directory = Path(d.data_dir) / d.dataset
    expect = d.tokenizer if d.processed_dir is None and cfg.training.data_format == "bin" else None
    return on_every_rank(lambda: load_dataset(directory, expect_tokenizer=expect), dist)


def resolve_run_dir(cfg: Config, resume: bool | str, force: bool) -> RunDir:
    if isinstance(resume, str):
        path = Path(resume)
        run = RunDir(path.parent if path.is_file() else path)
    else:
        name = cfg.run.name or f"{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg.run.name = name
        run = RunDir(Path(cfg.run.out_dir) / name)
    if resume:
        if not run.has_checkpoints():
            raise UserError(f"--resume: no checkpoint in {run.path} to resume from")
    elif run.has_checkpoints() and not force and not cfg.training.eval_only:
        raise UserError(f"{run.path} already holds checkpoints: pass --resume to continue it, --force to start over, "
                        "or choose another --run.name")
    return run


def build_model(cfg: Config, dataset: Dataset, resume_ckpt: dict | None) -> tuple[GPT, dict | None]:
    """The model for scratch, resume or init_from; returns it with the checkpoint it came from."""
    init = cfg.run.init_from
    source = resume_ckpt
    if resume_ckpt is not None:
        margs = model_config_from_checkpoint(resume_ckpt)
        if margs.to_dict() != cfg.model_args():
            diff = [k for k, v in margs.to_dict().items() if cfg.model_args()[k] != v]
            raise UserError(f"--resume: the config's model differs from the checkpoint's in {diff}; "
                            "resume with the run's own config, or fine-tune with run.init_from instead")
        check_vocab_compatible(margs.vocab_size, resume_ckpt.get("tokenizer"), dataset, "the checkpoint")
    elif init == "scratch":
        margs = GPTConfig.from_dict(cfg.model_args())
    elif init.startswith("gpt2") or (Path(init).is_dir() and (Path(init) / "config.json").is_file()):
        from export import load_gpt2
        model = load_gpt2(init, dropout=cfg.model.dropout)
        check_vocab_compatible(model.config.vocab_size, {"kind": "tiktoken", "name": "gpt2"}, dataset, init)
        check_fits(dataset, model.config.block_size, model.config.vocab_size)
        for k, v in model.config.to_dict().items():  # the config (and so --resume) records what was loaded
            setattr(cfg.model, k, v)
        return model, None
    else:
        from checkpoint import resolve_checkpoint
        path = resolve_checkpoint(init, prefer="best")
        source = load_checkpoint(path)
        margs = model_config_from_checkpoint(source, path)
        margs.dropout = cfg.model.dropout
        check_vocab_compatible(margs.vocab_size, source.get("tokenizer"), dataset, str(path))
    cfg.model.vocab_size = margs.vocab_size = margs.vocab_size or dataset.vocab_size
    check_fits(dataset, margs.block_size, margs.vocab_size)
    model = GPT(margs)
    if source is not None:
        load_model_weights(model, source["model"], init if resume_ckpt is None else "checkpoint")
    for k, v in margs.to_dict().items():  # the config records what was actually built
        setattr(cfg.model, k, v)
    return model, source


def check_vocab_compatible(model_vocab: int, tokenizer: dict | None, dataset: Dataset, source: str) -> None:
    data_tok = dataset.tokenizer.to_dict()
    if tokenizer is not None and tokenizer.get("kind") == "tiktoken" and data_tok.get("kind") == "tiktoken":
        same = tokenizer.get("name") == data_tok.get("name")
    else:
        same = tokenizer is None or tokenizer == data_tok
    if not same or model_vocab < dataset.vocab_size:
        ours = tokenizer_label(tokenizer) if tokenizer else "?"
        missing = sorted(set(data_tok.get("chars", [])) - set((tokenizer or {}).get("chars", [])))
        hint = f" (the dataset has characters the checkpoint lacks: {''.join(missing[:10])!r})" if ours == "char" and missing else ""
        raise UserError(f"vocabulary mismatch: {source} was trained with a {ours} tokenizer of {model_vocab} tokens, "
                        f"the dataset {dataset.directory} uses {tokenizer_label(data_tok)} with {dataset.vocab_size}{hint}: "
                        "prepare the dataset with the checkpoint's tokenizer")


# ---- one optimizer step -----------------------------------------------------------------------------

def train_step(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler,
               batches: BatchSource, rt: Runtime, it: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Forward/backward over grad_accum_steps micro-batches, clip, step. Returns (loss, grad norm, stepped)."""
    t = rt.cfg.training
    accum, slots = t.grad_accum_steps, t.grad_accum_steps * rt.dist.world_size
    total_loss = torch.zeros((), device=rt.device)
    for micro in range(accum):
        index = it * slots + rt.dist.rank * accum + micro
        nxt = index + 1 if micro + 1 < accum else (it + 1) * slots + rt.dist.rank * accum
        x, y = batches.get("train", index, next_index=nxt)
        with dist_utils.no_sync(model, last=micro == accum - 1):
            with rt.autocast:
                _, loss = model(x, y)
                loss = loss / accum
            scaler.scale(loss).backward()
        total_loss += loss.detach()
    for opt in optimizers:
        scaler.unscale_(opt)
    clip = rt.cfg.optimizer.grad_clip
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
    norm = dist_utils.full_tensor(norm)
    # non-finite gradients: GradScaler skips the step under fp16; otherwise we skip it ourselves
    finite = bool(torch.isfinite(norm)) if not scaler.is_enabled() else True
    if finite:
        for opt in optimizers:
            scaler.step(opt)
    scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.update()
    if scaler.is_enabled():
        finite = scaler.get_scale() >= scale_before
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return total_loss, norm, finite


@torch.no_grad()  # not inference_mode: FSDP's unsharded weights made here are reused by training
def evaluate(model: torch.nn.Module, batches: BatchSource, rt: Runtime) -> dict[str, float]:
    """Mean loss, perplexity and next-token accuracy over eval_iters batches per split (the same batches every time).

    The batches are dealt round-robin to the ranks, so the result does not depend on the world size.
    Every rank runs the same number of forwards (FSDP gathers weights collectively); padding batches count zero."""
    from tqdm import tqdm

    model.eval()
    out = {}
    n, world = rt.cfg.training.eval_iters, rt.dist.world_size
    for split in ("train", "val"):
        sums = torch.zeros(3, device=rt.device)  # loss, correct, count
        for k in tqdm(range(rt.dist.rank, math.ceil(n / world) * world, world), desc=f"eval {split}", leave=False,
                      disable=None if rt.dist.is_main else True):
            x, y = batches.get(split, k)
            with rt.autocast:
                logits, loss = model(x, y)
            sums += (k < n) * torch.stack([loss.float(), (logits.argmax(-1) == y).sum().float() / y.numel(),
                                           torch.ones((), device=rt.device)])
        sums = dist_utils.all_reduce_sum(sums, rt.dist)
        loss = (sums[0] / sums[2]).item()
        out[f"{split}_loss"] = loss
        out[f"{split}_ppl"] = math.exp(min(loss, 50))
        out[f"{split}_acc"] = (sums[1] / sums[2]).item()
    model.train()
    return out


# ---- checkpoints ------------------------------------------------------------------------------------

def checkpoint_state(raw_model: GPT, optimizers, scaler, state: TrainState, rt: Runtime, tokenizer: dict) -> dict:
    """Collective: every rank calls it (RNG states are gathered, FSDP weights unsharded); rank 0 saves the result."""
    return {
        "model": dist_utils.model_state_dict(raw_model),
        "model_args": raw_model.config.to_dict(),
        "optimizers": [dist_utils.optimizer_state_dict(raw_model, o) for o in optimizers],
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "config": rt.cfg.to_dict(),
        "iter_num": state.iter_num,
        "best_val_loss": state.best_val_loss,
        "bad_evals": state.bad_evals,
        "tokens_seen": state.tokens_seen,
        "nonfinite_streak": state.nonfinite_streak,
        "wandb_run_id": state.wandb_run_id,
        "rng": dist_utils.gather_objects(rng_state(), rt.dist),  # one per rank
        "tokenizer": tokenizer,
        "world_size": rt.dist.world_size,
    }


def save(kind: str, ckpt: dict, rt: Runtime) -> Path:
    """kind: 'last' (ckpt_last + a pruned step checkpoint on save_interval) or 'best'."""
    run, t = rt.run, rt.cfg.training
    path = run.best if kind == "best" else run.last
    save_checkpoint(path, ckpt)
    if kind == "last":
        rt.last_saved = f"{path} (iter {ckpt['iter_num']})"
        run.set_latest(path)
        if t.save_interval and ckpt["iter_num"] % t.save_interval == 0 and t.keep_last > 0:
            link_or_copy(path, run.step(ckpt["iter_num"]))
            run.prune(t.keep_last)
        if ckpt.get("sharded"):
            run.prune_sharded(ckpt["sharded"])
    return path


def save_or_warn(kind: str, ckpt: dict, rt: Runtime, final: bool = False) -> None:
    """save(), surviving a full disk or a read-only run directory. The files already there stay intact; a failed
    periodic save costs only that checkpoint (one warning line, training goes on, the next save retries); a failed
    final save is a UserError naming the last good checkpoint."""
    try:
        save(kind, ckpt, rt)
    except WriteError as e:
        good = rt.last_saved or rt.run.latest()
        where = f"the last good checkpoint is {good}" if good else "no checkpoint has been saved yet"
        if final:
            raise UserError(f"the final checkpoint was not saved: {e}; {where}") from None
        print(f"warning: {kind} checkpoint of iter {ckpt['iter_num']} not saved: {e}; {where}; "
              "training continues and the next save retries", file=sys.stderr, flush=True)


def save_everywhere(kind: str, raw_model: GPT, optimizers, scaler, state: TrainState, rt: Runtime, tokenizer: dict,
                    final: bool = False) -> None:
    """Every rank takes part (gathers, FSDP shards); rank 0 writes the checkpoint file, after the shards it names."""
    ckpt = checkpoint_state(raw_model, optimizers, scaler, state, rt, tokenizer)
    if kind == "last" and dist_utils.is_sharded(raw_model):
        ckpt["sharded"] = dist_utils.save_sharded(raw_model, optimizers, rt.run.sharded(state.iter_num), rt.dist).name
    dist_utils.save_on_main(lambda: save_or_warn(kind, ckpt, rt, final), rt.dist)


def restore(ckpt: dict, optimizers, scaler, raw_model: GPT, rt: Runtime) -> TrainState:
    """Optimizer, scaler, RNG and counters from a checkpoint whose weights the (wrapped) model already holds.

    On the world size it was written with, a run continues exactly: the data stream is a pure
    function of the step (data.py) and every rank gets back its own RNG state (dropout). On another
    world size the data streams are re-derived from the step counter for the new layout: keep
    batch_size x grad_accum_steps x world_size constant (2 ranks x 1 -> 1 rank x 2 accumulation
    steps) and every optimizer step draws exactly the micro-batches it would have drawn; each rank's
    RNG is then seeded afresh from (seed, rank, step). An FSDP checkpoint (sharded optimizer state)
    resumes on any world size, with or without FSDP; other checkpoints can't be resumed under FSDP.
    """
    if ckpt.get("sharded"):
        dist_utils.load_sharded(raw_model, optimizers, rt.run.path / ckpt["sharded"])
    elif dist_utils.is_sharded(raw_model):
        raise UserError("--resume with distributed.fsdp needs a checkpoint written under FSDP: resume this one without "
                        "FSDP, or start a new run from its weights with run.init_from")
    else:
        if len(ckpt.get("optimizers", [])) != len(optimizers):
            raise UserError("--resume: the checkpoint's optimizer differs from the config's (optimizer.name)")
        for opt, sd in zip(optimizers, ckpt["optimizers"]):
            opt.load_state_dict(sd)
    if ckpt.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt["rng"] if isinstance(ckpt["rng"], list) else [ckpt["rng"]]  # older checkpoints: rank 0's state only
    if len(rng) == rt.dist.world_size:
        set_rng_state(rng[rt.dist.rank])
    else:
        torch.manual_seed(hash((rt.cfg.run.seed, rt.dist.rank, ckpt["iter_num"])) & 0xFFFF_FFFF)
        if rt.dist.is_main:
            print(f"resuming a {ckpt.get('world_size')}-rank checkpoint on {rt.dist.world_size} ranks: "
                  "data streams are re-derived from the step counter for the new world size, RNG streams re-seeded")
    return TrainState(iter_num=ckpt["iter_num"], best_val_loss=ckpt["best_val_loss"], bad_evals=ckpt["bad_evals"],
                      tokens_seen=ckpt["tokens_seen"], nonfinite_streak=ckpt.get("nonfinite_streak", 0),
                      wandb_run_id=ckpt.get("wandb_run_id"))


# ---- the loop ---------------------------------------------------------------------------------------

def install_signal_handlers(state: TrainState) -> list:
    """Returns the (signal, previous handler) pairs, so train() called from Python can put them back."""
    def handler(signum, frame):
        if state.stop_requested:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        state.stop_requested = True
        print(f"\n{signal.Signals(signum).name} received: finishing this step, saving, exiting", flush=True)

    return [(sig, signal.signal(sig, handler)) for sig in (signal.SIGINT, signal.SIGTERM)]


def after_eval(metrics: dict, state: TrainState, rt: Runtime) -> bool:
    """Update best loss and early-stopping counters; returns True when the val loss improved enough."""
    t = rt.cfg.training
    improved = metrics["val_loss"] < state.best_val_loss - t.early_stopping_min_delta
    if improved:
        state.best_val_loss = metrics["val_loss"]
        state.bad_evals = 0
    else:
        state.bad_evals += 1
        if t.early_stopping and state.bad_evals >= t.early_stopping_patience:
            state.stop_reason = (f"early stopping: val loss has not improved by {t.early_stopping_min_delta} for "
                                 f"{state.bad_evals} evaluations (best {state.best_val_loss:.4f})")
    return improved


def run_loop(model, raw_model: GPT, optimizers, scaler, batches: BatchSource, state: TrainState, rt: Runtime,
             tokenizer: dict) -> TrainState:
    t = rt.cfg.training
    log, main = rt.log, rt.dist.is_main
    checkpoint = lambda kind, final=False: save_everywhere(kind, raw_model, optimizers, scaler, state, rt, tokenizer, final)  # noqa: E731

    def do_eval() -> None:
        metrics = evaluate(model, batches, rt)
        improved = after_eval(metrics, state, rt)
        if main:
            print(f"eval {state.iter_num}: train {metrics['train_loss']:.4f} | val {metrics['val_loss']:.4f} "
                  f"(ppl {metrics['val_ppl']:.2f}, acc {metrics['val_acc']:.3f})" + (" *best" if improved else ""), flush=True)
            log.record({"kind": "eval", "iter": state.iter_num, **metrics, "tokens": state.tokens_seen})
        if improved and t.save_best and state.iter_num > 0 and not t.eval_only:
            checkpoint("best")
        if main:
            log.flush()

    if t.eval_only:
        do_eval()
        return state
    if state.iter_num == 0 and t.eval_interval:
        do_eval()
    model.train()
    step_times: list[float] = []
    t_last = time.perf_counter()
    first = True
    while state.iter_num < t.max_iters and not state.stop_reason:
        it = state.iter_num
        lr = set_lr(optimizers, lr_multiplier(it, rt.cfg))
        loss, norm, stepped = train_step(model, optimizers, scaler, batches, rt, it)
        state.iter_num = it + 1
        state.tokens_seen += rt.tokens_per_step
        if stepped:
            state.nonfinite_streak = 0
        else:
            state.nonfinite_streak += 1
            if main:
                print(f"iter {it}: non-finite loss or gradient, step skipped ({state.nonfinite_streak} in a row)", flush=True)
            if state.nonfinite_streak >= t.max_nonfinite_steps:
                state.stop_reason = (f"stopped: {state.nonfinite_streak} consecutive non-finite steps; the last good "
                                     "checkpoint is intact (lower the learning rate or use bf16/fp32)")
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        if first:
            first = False
            if main and rt.cfg.model.compile:
                print(f"first step took {dt:.1f}s (torch.compile); later steps are fast", flush=True)
        else:
            step_times = (step_times + [dt])[-20:]
        if t.log_interval and state.iter_num % t.log_interval == 0:
            lossf = dist_utils.mean_over_ranks(loss, rt.dist)
            state.last_loss = lossf
            if main:
                avg = sum(step_times) / len(step_times) if step_times else dt
                tps = rt.tokens_per_step / avg
                mfu = raw_model.estimate_mfu(tps, rt.peak_flops)
                print(format_step_line(state.iter_num, t.max_iters, lossf, lr, float(norm), avg, tps, mfu,
                                       (t.max_iters - state.iter_num) * avg), flush=True)
                log.record({"kind": "train", "iter": state.iter_num, "loss": lossf, "lr": lr, "grad_norm": float(norm),
                            "ms_per_iter": avg * 1000, "tokens_per_s": tps, "mfu": mfu, "tokens": state.tokens_seen})
        # not assigned back to state.stop_requested: a signal handled while any_rank waits would be overwritten
        # (and lost); it is agreed on at the next step instead
        stop_signal = dist_utils.any_rank(state.stop_requested, rt.dist)
        done = state.iter_num >= t.max_iters
        if not stop_signal and ((t.eval_interval and state.iter_num % t.eval_interval == 0) or done):
            do_eval()
        state.stop_reason = state.stop_reason or ("signal" if stop_signal else "")
        if done or state.stop_reason or (t.save_interval and state.iter_num % t.save_interval == 0):
            checkpoint("last", final=done or bool(state.stop_reason))
            if main:
                log.flush()
        t_last = time.perf_counter()  # exclude eval and checkpoint time from the next step's timing
    if state.last_loss is None:
        state.last_loss = dist_utils.mean_over_ranks(loss, rt.dist) if state.iter_num else None
    return state


# ---- entry points -----------------------------------------------------------------------------------

def train(config: str | Path | None = None, overrides: dict | list | None = None, resume: bool | str = False,
          force: bool = False, validate_only: bool = False) -> TrainResult:
    """Train from a TOML file plus overrides ({"training.max_iters": 10} or CLI-style list). Python API."""
    dist = dist_utils.from_env()
    try:
        with dist_utils.reporting_peer_failures(dist), callers_determinism_restored():
            return _train(config, overrides, resume, force, validate_only, dist)
    finally:
        dist_utils.shutdown(dist)


@contextmanager
def callers_determinism_restored() -> Iterator[None]:
    """make_runtime switches on deterministic algorithms for the CPU; a Python caller gets its own setting back."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


RESUME_FIELDS = {"config": dict, "optimizers": list, "iter_num": int, "best_val_loss": (int, float), "bad_evals": int,
                 "tokens_seen": int, "rng": (dict, list)}


def check_resumable(ckpt: dict, path: Path) -> None:
    """A loadable checkpoint may still lack the training state --resume needs (e.g. one written by another tool)."""
    wrong = [k for k, kind in RESUME_FIELDS.items() if not isinstance(ckpt.get(k), kind) or isinstance(ckpt.get(k), bool)]
    config = ckpt.get("config")
    if not wrong and not (isinstance(config.get("run"), dict) and all(isinstance(t, dict) for t in config.values())):
        wrong = ["config"]
    if wrong:
        raise UserError(f"{path} cannot be resumed: its training state is missing or malformed ({', '.join(wrong)}); "
                        "start a new run from its weights with run.init_from instead")


def load_run_config(config, overrides, resume: bool | str, force: bool, world_size: int) -> tuple[Config, RunDir, dict | None]:
    """Config (defaults < TOML < overrides) and run directory; on resume the checkpoint's config replaces the TOML."""
    toml = load_toml(config) if config else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    source = str(config or "config")
    if not resume:
        cfg = build_config(toml, overrides, source=source, world_size=world_size)
        return cfg, resolve_run_dir(cfg, False, force), None
    if resume is True:
        probe = build_config(toml, overrides, source=source, world_size=world_size)
        if probe.run.name is None:
            raise UserError("--resume needs run.name in the config, or a run directory: --resume checkpoints/<run>")
        resume = str(Path(probe.run.out_dir) / probe.run.name)
    run = resolve_run_dir(Config(), resume, force)
    path = Path(resume) if Path(resume).is_file() else run.latest()  # --resume FILE resumes that very checkpoint
    try:
        ckpt = load_checkpoint(path)
    except UserError as e:
        older = [p for p in run.step_checkpoints() if not os.path.samefile(p, path)]  # step files may be hard links
        raise UserError(f"{e}; an older checkpoint can be resumed with --resume {older[-1]}" if older else str(e)) from None
    check_resumable(ckpt, path)
    saved = {s: {k: v for k, v in t.items() if v is not None} for s, t in ckpt["config"].items()}
    saved["run"].update(name=run.path.name, out_dir=str(run.path.parent))
    return build_config(saved, overrides, source=f"{run.path}/config", world_size=world_size), run, ckpt


def _train(config, overrides, resume, force, validate_only, dist) -> TrainResult:
    # config
    cfg, run, resume_ckpt = load_run_config(config, overrides, resume, force or validate_only, dist.world_size)

    # setup
    device = resolve_device(cfg.run.device, dist)
    precision = resolve_precision(cfg.training.precision, device)
    dist_utils.init_process_group(dist, device, cfg.distributed.backend, cfg.distributed.timeout_s)
    run = dist_utils.broadcast_object(run, dist)  # an unnamed run is named by each rank's clock: use rank 0's
    rt = make_runtime(cfg, device, precision, dist, run)

    # data
    dataset = prepare_data(cfg, dist)

    if validate_only:
        from validate import check_memory
        check_memory(cfg, rt, dataset)

    # model
    model, source = on_every_rank(lambda: build_model(cfg, dataset, resume_ckpt), dist)
    model.to(device)
    model.gradient_checkpointing = cfg.training.gradient_checkpointing
    raw_model = model
    t = cfg.training
    rt.tokens_per_step = t.batch_size * t.grad_accum_steps * dist.world_size * model.config.block_size

    if validate_only:
        from validate import report_feasibility
        return report_feasibility(cfg, rt, model, dataset)

    # optimizer (after wrapping: FSDP replaces the parameters with sharded ones)
    model = dist_utils.wrap_model(model, cfg, dist, device)
    optimizers = make_optimizers(raw_model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    state = TrainState()
    if resume_ckpt is not None:
        state = restore(resume_ckpt, optimizers, scaler, raw_model, rt)

    if dist.is_main:
        print_startup(cfg, rt, raw_model, dataset, state)
        evaluating_only = cfg.training.eval_only  # reads a run, never rewrites its config, log or plot
        if not evaluating_only:
            atomic_write_text(run.path / "config.toml", to_toml(cfg))  # creates the run directory; WriteError if it can't
            run.remove_temp_files()  # left by a run killed mid-write
        kw = dict(json_log=cfg.logging.json_log and not evaluating_only, plot=cfg.logging.plot and not evaluating_only)
        rt.log = MetricsLog.resume(run.path, state.iter_num, **kw) if resume_ckpt else MetricsLog(run.path, **kw)
        if cfg.logging.wandb_project:
            state.wandb_run_id = rt.log.start_wandb(cfg.logging.wandb_project, cfg.logging.wandb_run_name or cfg.run.name,
                                                    state.wandb_run_id, cfg.to_dict())
    batches = BatchSource(dataset, model_block(raw_model), t.batch_size, cfg.run.seed, device)
    rt.signals = install_signal_handlers(state)
    try:
        state = run_loop(model, raw_model, optimizers, scaler, batches, state, rt, dataset.tokenizer.to_dict())
    finally:
        for sig, previous in rt.signals:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    ckpt_path = run.best if run.best.is_file() else run.last
    if dist.is_main:
        reason = state.stop_reason or "finished"
        if state.stop_reason == "signal":
            print(f"saved {run.last}; resume with: python train.py --resume {run.path}", flush=True)
        elif state.stop_reason:
            print(state.stop_reason, flush=True)
        print(f"{reason}: {state.iter_num} iters, {state.tokens_seen:,} tokens, best val loss {state.best_val_loss:.4f}; "
              f"checkpoints in {run.path}", flush=True)
        rt.log.finish()
    return TrainResult(final_loss=state.last_loss, best_val_loss=state.best_val_loss, total_tokens=state.tokens_seen,
                       checkpoint_path=str(ckpt_path) if ckpt_path.exists() else None, iterations=state.iter_num,
                       stop_reason=state.stop_reason or "finished")


def model_block(model: GPT) -> int:
    return model.config.block_size


def print_startup(cfg: Config, rt: Runtime, model: GPT, dataset: Dataset, state: TrainState) -> None:
    t = cfg.training
    print(summary(cfg))
    print(f"data: {dataset.directory} | {dataset.tokenizer.kind} tokenizer, vocab {dataset.vocab_size} | "
          f"train {dataset.lengths['train']:,} / val {dataset.lengths['val']:,} tokens")
    print(f"model: {model.num_params() / 1e6:.2f}M parameters | {model.flops_per_token() / 1e6:.1f} MFLOPs/token")
    print(f"batch: {t.batch_size} x {t.grad_accum_steps} accum x {rt.dist.world_size} ranks = "
          f"{t.batch_size * t.grad_accum_steps * rt.dist.world_size} sequences, {rt.tokens_per_step:,} tokens per optimizer step")
    if rt.device.type == "cpu" and rt.precision == "fp32":
        print(f"device: cpu, fp32 ({torch.get_num_threads()} threads; set training.precision = \"bf16\" for bf16 autocast)")
    elif rt.device.type == "cpu" and rt.precision == "bf16" and not cpu_has_native_bf16():
        print("device: cpu, bf16 (emulated: this CPU has no AVX512-BF16/AMX, so fp32 is faster: --training.precision fp32)")
    else:
        print(f"device: {rt.device}, {rt.precision}" + (" with GradScaler" if rt.precision == "fp16" else ""))
    if state.iter_num:
        print(f"resuming {rt.run.path} at iter {state.iter_num} (best val loss {state.best_val_loss:.4f})")
    print(f"run: {rt.run.path} | rss {rss_mb():.0f} MB", flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other --section.key value pair overrides the config.")
    p.add_argument("--config", help="TOML config file (e.g. configs/base/base.toml)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR_OR_CKPT",
                   help="continue the config's run (or the given run directory / checkpoint)")
    p.add_argument("--force", action="store_true", help="start over in an existing run directory")
    p.add_argument("--validate", action="store_true", help="check the config and its feasibility; don't train")
    p.add_argument("--nproc-per-node", type=int, default=None, help="relaunch under torchrun with N processes")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.nproc_per_node is not None:
        if args.config:  # config mistakes: one message here rather than one per worker
            build_config(load_toml(args.config), parse_overrides(rest), source=args.config, world_size=args.nproc_per_node)
        return dist_utils.relaunch_with_torchrun(args.nproc_per_node, sys.argv[1:] if argv is None else argv,
                                                 script=os.path.abspath(__file__))
    try:
        train(args.config, overrides=rest, resume=args.resume, force=args.force, validate_only=args.validate)
    except dist_utils.PeerFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
