"""Checkpoints: plain-typed dicts written atomically, loaded with torch.load(weights_only=True).

A checkpoint holds only tensors, numbers, strings, lists, tuples, dicts and None, so it can be
inspected without this code and a hostile file cannot run code when loaded. Layout of a run:

    checkpoints/<run>/ckpt_last.pt        every save_interval and at the end
    checkpoints/<run>/ckpt_best.pt        whenever val loss improves (save_best)
    checkpoints/<run>/ckpt_step0001000.pt periodic, pruned to the newest keep_last
    checkpoints/<run>/latest              name of the newest checkpoint (what --resume loads)
    checkpoints/<run>/config.toml         the fully resolved config
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import random
import re
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from common import TEMP_SUFFIX, UserError, atomic_write, atomic_write_text, fsync_dir
from config import build_config
from model import GPT, GPTConfig

FORMAT = "quillgpt-checkpoint"
VERSION = 1
STEP_PATTERN = re.compile(r"ckpt_step(\d+)\.pt$")


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
        raise UserError(f"checkpoint {path} is corrupt: its record {bad} fails the CRC check (damaged on disk or in a copy)")


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
            raise UserError(f"refusing to load {path}: it contains objects other than plain tensors and data "
                            "(it could run code when unpickled); only quillgpt checkpoints are accepted") from None
        raise UserError(f"checkpoint {path} is corrupt: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, UnicodeDecodeError, KeyError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise UserError(f"checkpoint {path} is truncated or corrupt: {type(e).__name__} {first}".rstrip()) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a quillgpt checkpoint (no model weights and model_args)")
    return ckpt


def model_config_from_checkpoint(ckpt: dict, path: str | Path = "checkpoint") -> GPTConfig:
    args = ckpt["model_args"]
    if not isinstance(args, dict) or not isinstance(args.get("vocab_size"), int):
        raise UserError(f"{path}: model_args is not a complete model description (it needs an integer vocab_size)")
    build_config({"model": args}, source=f"{path} model_args")  # the config schema's type and range checks
    return GPTConfig.from_dict(args)


def load_model_weights(model: GPT, state: dict, path: str | Path = "checkpoint") -> None:
    """load_state_dict with a message that names the first mismatch instead of a traceback."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{path}: its model weights are not a dict of named tensors")
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UserError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UserError(f"{path} does not match the model: {k} is {list(v.shape)} in the checkpoint, "
                            f"{list(own[k].shape)} in the model (different architecture or vocabulary)")
    model.load_state_dict(state)


def model_from_checkpoint(ckpt: dict, path: str | Path = "checkpoint") -> GPT:
    model = GPT(model_config_from_checkpoint(ckpt, path))
    load_model_weights(model, ckpt["model"], path)
    return model


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
        for old in steps[:max(0, len(steps) - keep_last)]:
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
