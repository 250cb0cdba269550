"""The conditions a measurement runs under: the CPU path (native, or capped at an AVX2-only CPU's), the load line
every table ends with, where our machines keep tiny Shakespeare and nanoGPT, and whether llama.cpp is installed."""

from __future__ import annotations

import getpass
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Where our machines keep tiny Shakespeare for tests and benchmarks (never a committed copy): beside the clone in
# shared/, or where QUILLGPT_SHAKESPEARE says; a path with no file means "absent" (CI's test of the fallback corpus).
SHARED = Path(__file__).resolve().parents[2] / "shared"
SHAKESPEARE = Path(os.environ.get("QUILLGPT_SHAKESPEARE") or SHARED / "data" / "tinyshakespeare.txt")

# A nanoGPT checkout (never committed) for bench.py --gpu: QUILLGPT_NANOGPT, else the clone's ignored .gpu_inputs/
NANOGPT = Path(os.environ.get("QUILLGPT_NANOGPT") or Path(__file__).resolve().parents[1] / ".gpu_inputs" / "nanoGPT")

# Environment caps under which this CPU runs the code paths of an AVX2-only one: oneDNN's (bf16) and MKL's (fp32)
# matmuls, ATen's own kernels and the code inductor generates (it follows ATen's capability). torch reads them when it
# loads its kernels, so they are set before the process starts. The capped path keeps its own inductor cache: the caps
# are not in inductor's cache key, and kernels compiled for the native path crashed when loaded on the capped one.
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
AVX2["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_avx2_{getpass.getuser()}")
ISA_ENV = {"native": {}, "avx2": AVX2}


def run_on_isa(isa: str, script: str, argv: list[str]) -> int | None:
    """`script argv` again in a process whose environment caps the CPU path (ISA_ENV), as the caps must be set before
    torch loads its kernels; its exit code. None when this process already runs on that path. A script inside this
    package is run as a module (`python -m benchmarks.x`), as it was started."""
    caps = ISA_ENV[isa]
    if all(os.environ.get(k) == v for k, v in caps.items()):
        return None
    print(f"{os.path.basename(script)} on the {isa} path: {' '.join(f'{k}={v}' for k, v in caps.items())}", flush=True)
    path = Path(script).resolve()
    inside = path.parent == Path(__file__).resolve().parent
    command = [sys.executable, *(["-m", f"{__package__}.{path.stem}"] if inside else [str(path)]), *argv]
    return subprocess.call(command, env={**os.environ, **caps})


def load_average() -> str:
    """The line every benchmark table ends with: above the core count, someone else was computing too."""
    return f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def with_shakespeare_input(cli: list[str]) -> list[str]:
    """The overrides with tiny Shakespeare's local copy as data.input unless one is given: the presets' data offline."""
    given = any(a.split("=")[0] == "--data.input" for a in cli)
    return cli if given or not SHAKESPEARE.is_file() else ["--data.input", str(SHAKESPEARE), *cli]


def llama_cpp_installed(module: str = "llama_cpp") -> bool:
    """Whether llama-cpp-python's `module` imports (llama_cpp.server.app: [server]); a broken build reads as missing."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError):
        return False
    return True
