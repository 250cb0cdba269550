"""Small pieces every script shares: the user-error convention, atomic file writes, a few machine facts, and the
malloc setting CPU training and evaluation run with.

A user's mistake (bad config, missing data, corrupt checkpoint) raises UserError; the entry
scripts wrap main() in `run_main`, which prints one line to stderr and exits 2, no traceback.
Every file we write goes through `atomic_write`: temp file in the same directory, fsync, rename,
fsync of the directory, so a crash at any moment leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import hashlib
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator
from urllib.parse import urlparse

EXIT_USER_ERROR = 2
# Where our machines keep tiny Shakespeare, which tests and benchmarks read (never a committed copy).
SHAKESPEARE = Path(__file__).resolve().parent.parent / "shared" / "data" / "tinyshakespeare.txt"
TEMP_SUFFIX = ".tmp"  # atomic_write's temp files are ".<name>.<random>.tmp" beside their target
_UMASK = os.umask(0)
os.umask(_UMASK)


class UserError(Exception):
    """A mistake the user can fix; reported as one line, exit code 2.

    reported_elsewhere: the error has been printed already (by rank 0 of a distributed job), so
    this process exits 2 without printing it again."""

    def __init__(self, message: str = "", reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class WriteError(UserError):
    """A file could not be written (disk full, read-only, no permission); the previous file is untouched."""


def report(e: UserError) -> None:
    for line in str(e).splitlines() or ["unknown error"]:
        print(f"error: {line}", file=sys.stderr, flush=True)


def run_main(main: Callable[[], int | None]) -> None:
    """Run an entry point; turn UserError and Ctrl-C into a one-line message and an exit code."""
    try:
        code = main()
    except UserError as e:
        if not e.reported_elsewhere:
            report(e)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # e.g. `python sample.py ... | head`
        sys.exit(0)
    sys.exit(code or 0)


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


def check_hub_reachable(what: str, offline: str) -> None:
    """One line at once instead of the hub client's minute of retries when there is no network.
    what: the sentence's subject ("the dataset X streams from the Hugging Face hub"); offline: what to do instead."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", ""):
        raise UserError(f"{what}, but HF_HUB_OFFLINE is set; {offline}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy: let the hub client try
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as e:
        raise UserError(f"{what} and needs the network ({endpoint.hostname}: {e.strerror or e}); {offline}") from None


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# glibc's malloc settings CPU training runs with (see keep_freed_memory), in bytes
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap, not fresh mmaps
MALLOC_TRIM_THRESHOLD = 1 << 30  # free memory the heap keeps at its top before handing it back


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS (Linux; False elsewhere).

    A CPU training step frees and re-allocates the same multi-MB tensors every step. By default glibc serves
    such blocks with fresh mmaps (above a threshold that only rises with what was freed) and trims the heap's
    top, so every step faults the same pages in again, zero-filled by the kernel: writing a (8, 6, 256, 256)
    bf16 dropout mask into a new tensor took 2.5 ms against 0.34 with these settings. Evaluation's batches do the
    same (HellaSwag scoring: 1.15x the items per second). Process-wide and for good:
    glibc cannot go back to its dynamic threshold once one is set."""
    import ctypes

    if sys.platform != "linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except AttributeError:  # not glibc (musl has no mallopt)
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def usable_cpus() -> int:
    """Cores this process may run on (Linux: respects taskset and container CPU limits)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> str:
    """The line every benchmark table ends with: above the core count, someone else was computing too."""
    return f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def with_shakespeare_input(cli: list[str]) -> list[str]:
    """Command-line overrides with tiny Shakespeare's local copy as data.input unless one is given, so the
    shakespeare_char presets prepare their dataset offline."""
    given = any(a.split("=")[0] == "--data.input" for a in cli)
    return cli if given or not SHAKESPEARE.is_file() else ["--data.input", str(SHAKESPEARE), *cli]


def sha256_file(path: Path) -> str:
    """The file's SHA-256, read in 4 MB blocks (memory stays flat for a multi-GB checkpoint or corpus)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**22):
            digest.update(block)
    return digest.hexdigest()
