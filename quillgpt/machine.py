"""Facts about the machine a run is on: usable cores, load, the malloc setting CPU training runs with, and where our
machines keep tiny Shakespeare."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Where our machines keep tiny Shakespeare, which tests and benchmarks read (never a committed copy): beside the
# clone in shared/, or wherever QUILLGPT_SHAKESPEARE says. A path with no file there means "absent", which is how
# CI proves the tests' fallback corpus in a clone that has the real one beside it.
SHAKESPEARE = Path(
    os.environ.get("QUILLGPT_SHAKESPEARE")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
)

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
