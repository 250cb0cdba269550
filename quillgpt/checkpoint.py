"""Checkpoints: what a training checkpoint holds, how it is written and read, and the run directories they live in.

A checkpoint is a plain dict (tensors, numbers, strings, lists, dicts, None) written atomically and
loaded with torch.load(weights_only=True): it can be inspected without this code, and a hostile
file cannot run code when loaded. TrainingCheckpoint below is the one definition of its contents.
Layout of a run:

    checkpoints/<run>/ckpt_last.pt        every save_interval and at the end
    checkpoints/<run>/ckpt_best.pt        whenever val loss improves (save_best)
    checkpoints/<run>/ckpt_step0001000.pt periodic, pruned to the newest keep_last
    checkpoints/<run>/latest              name of the newest checkpoint (what --resume loads)
    checkpoints/<run>/config.toml         the fully resolved config

resolve_run decides which run a train.py invocation is: a new one (never silently overwriting
checkpoints) or the one --resume names, whose checkpoint's config then replaces the TOML.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import random
import re
import shutil
import sys
import time
import zipfile
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from quillgpt.config import Config, build_config, layer_from_dict, load_toml, lookup, parse_overrides
from quillgpt.errors import UserError, WriteError
from quillgpt.files import TEMP_SUFFIX, atomic_write, atomic_write_text, fsync_dir
from quillgpt.typecheck import OPTIONAL, wrong_fields

FORMAT = "quillgpt-checkpoint"
VERSION = 1
STEP_PATTERN = re.compile(r"ckpt_step(\d+)\.pt$")


# ---- what a training checkpoint holds ---------------------------------------------------------------

# Fields marked OPTIONAL may be missing from a checkpoint: written only by some runs, or added after the first ones.


@dataclass
class TrainState:
    """Training progress: the counters that let a resumed run continue exactly where it stopped."""

    iter_num: int = 0
    best_val_loss: float = math.inf
    best_score: float = field(default=math.inf, metadata=OPTIONAL)  # training.best_metric's best, lower is better
    bad_evals: int = 0  # evaluations in a row without an improvement of early_stopping_min_delta
    tokens_seen: int = 0
    nonfinite_streak: int = field(default=0, metadata=OPTIONAL)  # optimizer steps in a row skipped as non-finite
    train_seconds: float = field(default=0.0, metadata=OPTIONAL)  # seconds of training steps (training.time_budget_s)
    wandb_run_id: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class Resolution:
    """What a run asked for in precision and compile, what they resolved to, and on which type of device: a resumed
    run keeps what was resolved where the same request meets the same type of device, and resolves it again on
    another (a run begun on a CPU, resumed on a GPU)."""

    device_type: str  # "cpu", "cuda", "mps"
    requested_precision: str  # training.precision as asked: auto, fp32, bf16, fp16
    precision: str  # what it resolved to
    requested_compile: bool | None  # training.compile as asked (None: on for CUDA)
    compile: bool


@dataclass
class TrainingCheckpoint:
    """Everything a training checkpoint holds: trainer.save writes it, trainer.restore reads it, from_dict checks it.

    On disk it is a plain dict of these keys, with TrainState's fields at the top level."""

    model: dict  # the full weights (gathered from the shards under FSDP)
    model_args: dict  # GPTConfig.to_dict(): rebuilds the model without the config
    optimizers: list  # one state dict per optimizer; None each under FSDP, whose state is in `sharded`
    config: dict  # the run's resolved Config.to_dict()
    rng: list  # one RNG state per rank
    state: TrainState
    scaler: dict | None = field(default=None, metadata=OPTIONAL)  # the fp16 GradScaler's state
    tokenizer: dict | None = field(default=None, metadata=OPTIONAL)  # Tokenizer.to_dict() of the dataset
    world_size: int | None = field(default=None, metadata=OPTIONAL)  # ranks that wrote it
    sharded: str | None = field(default=None, metadata=OPTIONAL)  # FSDP: its sharded_stepNNNNNNN directory
    # training.precision and training.compile as the run asked for them ({"precision": "auto", "compile": None}):
    # config holds what they resolved to, on a device of type resolved_on ("cpu", "cuda")
    requested: dict | None = field(default=None, metadata=OPTIONAL)
    resolved_on: str | None = field(default=None, metadata=OPTIONAL)
    # a LoRA run: {"settings": LoraSettings.record(), "base": loading.base_record()}; `model` then holds the trainable
    # tensors only (the adapters), the base being the file the record points to
    lora: dict | None = field(default=None, metadata=OPTIONAL)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
        for optional in ("sharded", "lora"):
            if d[optional] is None:
                del d[optional]
        return {**d, **asdict(self.state)}

    def resolution(self) -> Resolution | None:
        """How the run's precision and compile were resolved; None for a checkpoint written before runs recorded it."""
        if self.requested is None or self.resolved_on is None:
            return None
        t = self.config["training"]
        return Resolution(
            self.resolved_on,
            self.requested.get("precision"),
            t["precision"],
            self.requested.get("compile"),
            t["compile"],
        )

    @classmethod
    def from_dict(cls, ckpt: dict, path: str | Path) -> TrainingCheckpoint:
        """A loaded checkpoint as a TrainingCheckpoint; UserError when it lacks what --resume needs
        (written by another tool, or edited)."""
        wrong = wrong_fields(ckpt, cls, exclude=("state",)) + wrong_fields(ckpt, TrainState)
        config = ckpt.get("config")
        if not wrong and not (
            isinstance(config.get("run"), dict) and all(isinstance(t, dict) for t in config.values())
        ):
            wrong = ["config"]
        if wrong:
            raise UserError(
                f"{path} cannot be resumed: its training state is missing or malformed ({', '.join(wrong)}); "
                "start a new run from its weights with run.init_from instead"
            )
        # a checkpoint from before best_metric existed chose its best by val loss
        state = TrainState(**{f.name: ckpt.get(f.name, f.default) for f in fields(TrainState)})
        if "best_score" not in ckpt:
            state.best_score = state.best_val_loss
        return cls(**{f.name: ckpt.get(f.name, f.default) for f in fields(cls) if f.name != "state"}, state=state)


# ---- files ------------------------------------------------------------------------------------------


def save_checkpoint(path: str | Path, state: dict) -> None:
    with atomic_write(path, "wb") as f:
        try:
            torch.save({"format": FORMAT, "version": VERSION, **state}, f)
        except RuntimeError as e:
            # a write that fails (disk full) can be masked by the zip writer's own RuntimeError while it closes
            # the archive; re-raise the OSError so atomic_write reports it as a WriteError
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


def link_or_copy(src: Path, dst: Path) -> None:
    """Make dst the same file as src, atomically: a hard link where the filesystem allows, else a copy
    (through atomic_write, so the copy is fsynced and a failure is a WriteError)."""
    tmp = dst.with_name(f".{dst.name}.link{TEMP_SUFFIX}")
    try:
        tmp.unlink(missing_ok=True)
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with open(src, "rb") as f_src, atomic_write(dst) as f_dst:
            shutil.copyfileobj(f_src, f_dst)
        return
    fsync_dir(dst.parent)


def verify_crc(path: Path) -> None:
    """torch.load ignores the CRC-32 the zip format keeps for every record, so flipped bits in the weights
    would load silently; zipfile's testzip checks them (at disk speed)."""
    if not zipfile.is_zipfile(path):
        return  # truncated, legacy or not a checkpoint at all: torch.load reports it
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as e:
        raise UserError(f"checkpoint {path} is corrupt: {e}") from None
    if bad is not None:
        raise UserError(
            f"checkpoint {path} is corrupt: its record {bad} fails the CRC check (damaged on disk or in a copy)"
        )


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Load safely; every failure is a one-line UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    verify_crc(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported" in str(e) or "global" in str(e).lower():
            raise UserError(
                f"refusing to load {path}: it contains objects other than plain tensors and data "
                "(it could run code when unpickled); only quillgpt checkpoints are accepted"
            ) from None
        raise UserError(f"checkpoint {path} is corrupt: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, UnicodeDecodeError, KeyError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise UserError(f"checkpoint {path} is truncated or corrupt: {type(e).__name__} {first}".rstrip()) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a quillgpt checkpoint (no model weights and model_args)")
    return ckpt


# ---- RNG state as plain types ----------------------------------------------------------------------


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]) + [random.getstate()[0]],
        "python_gauss": random.getstate()[2],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[-1], tuple(py[:-1]), state["python_gauss"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- run directories -------------------------------------------------------------------------------


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.last_saved: str | None = None  # "ckpt_last.pt (iter N)" of this process's newest successful save

    def save(
        self, kind: str, ckpt: TrainingCheckpoint, save_interval: int, keep_last: int, final: bool = False
    ) -> None:
        """Write ckpt_best.pt (kind "best") or ckpt_last.pt ("last"), atomically. A last checkpoint also
        becomes `latest`; on a save_interval step it is hard-linked as that step's checkpoint, keeping the
        newest keep_last; FSDP's sharded directories that no checkpoint names any more are deleted.

        A full disk or a read-only directory leaves every file already there intact and costs only this
        checkpoint: one warning line (the next save retries), or, for the final save, a UserError naming
        the last good checkpoint."""
        try:
            self._write(kind, ckpt, save_interval, keep_last)
        except WriteError as e:
            good = self.last_saved or self.latest()
            where = f"the last good checkpoint is {good}" if good else "no checkpoint has been saved yet"
            if final:
                raise UserError(f"the final checkpoint was not saved: {e}; {where}") from None
            print(
                f"warning: {kind} checkpoint of iter {ckpt.state.iter_num} not saved: {e}; {where}; "
                "training continues and the next save retries",
                file=sys.stderr,
                flush=True,
            )

    def _write(self, kind: str, ckpt: TrainingCheckpoint, save_interval: int, keep_last: int) -> None:
        path = self.best if kind == "best" else self.last
        save_checkpoint(path, ckpt.to_dict())
        if kind != "last":
            return
        it = ckpt.state.iter_num
        self.last_saved = f"{path} (iter {it})"
        self.set_latest(path)
        if save_interval and it % save_interval == 0 and keep_last > 0:
            link_or_copy(path, self.step(it))
            self.prune(keep_last)
        if ckpt.sharded:
            self.prune_sharded(ckpt.sharded)

    @property
    def last(self) -> Path:
        return self.path / "ckpt_last.pt"

    @property
    def best(self) -> Path:
        return self.path / "ckpt_best.pt"

    def step(self, it: int) -> Path:
        return self.path / f"ckpt_step{it:07d}.pt"

    def step_checkpoints(self) -> list[Path]:
        return sorted(p for p in self.path.glob("ckpt_step*.pt") if STEP_PATTERN.search(p.name))

    def has_checkpoints(self) -> bool:
        return self.path.is_dir() and any(self.path.glob("ckpt_*.pt"))

    def set_latest(self, ckpt: Path) -> None:
        atomic_write_text(self.path / "latest", ckpt.name + "\n")

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the `latest` pointer, else ckpt_last, else the newest step file."""
        pointer = self.path / "latest"
        if pointer.is_file():
            candidate = self.path / pointer.read_text().strip()
            if candidate.is_file():
                return candidate
        if self.last.is_file():
            return self.last
        steps = self.step_checkpoints()
        return steps[-1] if steps else None

    def remove_temp_files(self) -> list[Path]:
        """Delete the half-written temp files a killed run leaves behind (never a complete file); returns them."""
        stale = [p for p in self.path.glob(f".*{TEMP_SUFFIX}") if p.is_file()]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale

    def prune(self, keep_last: int) -> None:
        steps = self.step_checkpoints()
        for old in steps[: max(0, len(steps) - keep_last)]:
            old.unlink(missing_ok=True)

    def sharded(self, it: int) -> Path:
        """FSDP's directory of per-rank model and optimizer shards at step `it`; the checkpoints of that step name it."""
        return self.path / f"sharded_step{it:07d}"

    def prune_sharded(self, current: str) -> None:
        """Delete the sharded directories no checkpoint names: ckpt_last names `current`, a step checkpoint its step's."""
        keep = {current} | {p.name.replace("ckpt_", "sharded_").removesuffix(".pt") for p in self.step_checkpoints()}
        stale = [d for d in self.path.glob("sharded_step*") if d.name not in keep]
        for d in stale + list(self.path.glob(f".sharded_step*{TEMP_SUFFIX}")):  # temp dirs: left by a crash mid-save
            shutil.rmtree(d, ignore_errors=True)


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint file, or a run directory (its best checkpoint, or the latest for prefer='latest')."""
    path = Path(path)
    if path.is_dir():
        run = RunDir(path)
        if prefer == "best" and run.best.is_file():
            return run.best
        found = run.latest()
        if found is None:
            raise UserError(f"no checkpoint in run directory {path}")
        return found
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    return path


# ---- which run --------------------------------------------------------------------------------------


def resolve_run(
    config: str | Path | None, overrides: dict | list | None, resume: bool | str, force: bool, world_size: int
) -> tuple[Config, RunDir, TrainingCheckpoint | None]:
    """The config, run directory and (on resume) checkpoint of a train.py invocation.

    A new run: defaults < TOML < overrides, in out_dir/name, which must not hold checkpoints already
    (unless force, or eval_only, which writes nothing). A resumed run continues its checkpoint with
    the config stored in it: defaults < that config < overrides. resume is True (the run the TOML and
    overrides name), a run directory (its newest complete checkpoint) or a checkpoint file (that one)."""
    toml = load_toml(config) if config else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    source = str(config or "config")
    if not resume:
        cfg = build_config(toml, overrides, source=source, world_size=world_size)
        return cfg, new_run_dir(cfg, force), None
    if resume is True:
        name, out_dir = lookup(toml, overrides, "run.name", source), lookup(toml, overrides, "run.out_dir", source)
        if name is None:
            raise UserError("--resume needs run.name in the config, or a run directory: --resume checkpoints/<run>")
        resume = str(Path(out_dir) / name)
    run, path = run_to_resume(Path(resume))
    ckpt = load_resumable(run, path)
    saved = layer_from_dict(ckpt.config)
    saved["run"].update(name=run.path.name, out_dir=str(run.path.parent))
    training = saved.setdefault("training", {})
    if ckpt.requested is not None:
        # what the run asked for; trainer.setup keeps what it resolved to where the same request meets the same type
        # of device (ckpt.resolution()), and resolves it again on another
        for key in ("precision", "compile"):
            training.pop(key, None)  # asked as None: the schema's default
            if ckpt.requested.get(key) is not None:
                training[key] = ckpt.requested[key]
    elif training.get("precision") == "auto" and not torch.cuda.is_available():
        # written before runs recorded what auto chose, when the CPU's auto meant fp32: the run goes on as it began
        training["precision"] = "fp32"
    cfg = build_config(saved, overrides, source=f"{run.path}/config", world_size=world_size, stored=True)
    return cfg, run, ckpt


def new_run_dir(cfg: Config, force: bool) -> RunDir:
    """out_dir/name (a name from the dataset and the time when the config gives none)."""
    run = RunDir(Path(cfg.run.out_dir) / (cfg.run.name or f"{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"))
    if run.has_checkpoints() and not force and not cfg.training.eval_only:
        raise UserError(
            f"{run.path} already holds checkpoints: pass --resume to continue it, --force to start over, "
            "or choose another --run.name"
        )
    return run


def run_to_resume(path: Path) -> tuple[RunDir, Path]:
    """A run directory (its newest complete checkpoint) or a checkpoint file (that one): (run, checkpoint path)."""
    run = RunDir(path.parent if path.is_file() else path)
    found = path if path.is_file() else run.latest()
    if found is None:
        raise UserError(f"--resume: no checkpoint in {run.path} to resume from")
    return run, found


def load_resumable(run: RunDir, path: Path) -> TrainingCheckpoint:
    """The checkpoint at path, checked for what --resume needs; a damaged file's error names an older one."""
    try:
        ckpt = load_checkpoint(path)
    except UserError as e:
        older = [p for p in run.step_checkpoints() if not os.path.samefile(p, path)]  # step files may be hard links
        raise UserError(
            f"{e}; an older checkpoint can be resumed with --resume {older[-1]}" if older else str(e)
        ) from None
    return TrainingCheckpoint.from_dict(ckpt, path)
