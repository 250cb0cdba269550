"""Files we write and read: every write goes through `atomic_write` (temp file in the same directory, fsync, rename,
fsync of the directory), so a crash at any moment leaves either the old file or the new one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from quillgpt.errors import UserError, WriteError

TEMP_SUFFIX = ".tmp"  # atomic_write's temp files are ".<name>.<random>.tmp" beside their target
_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse to open directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temp file beside `path`; on success fsync it and rename it over `path`.

    On any exception the temp file is removed and `path` is untouched. A disk-full or
    read-only directory surfaces as WriteError (a UserError) naming the file.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give ours the usual permissions
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise WriteError(f"cannot write {path}: {e.strerror or e} (the previous file, if any, is untouched)") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """Read a JSON object, turning a missing or malformed file into a UserError."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is unreadable or malformed: {e}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} is malformed: expected a JSON object")
    return obj


def sha256_file(path: Path) -> str:
    """The file's SHA-256, read in 4 MB blocks (memory stays flat for a multi-GB checkpoint or corpus)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**22):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> Path:
    """What quillgpt keeps between runs on this machine (the best matmul rates, compiled decoding steps):
    $QUILLGPT_CACHE, else $XDG_CACHE_HOME/quillgpt, else ~/.cache/quillgpt."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("QUILLGPT_CACHE") or Path(cache) / "quillgpt")
