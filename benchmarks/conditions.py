"""The conditions a measurement runs under: the CPU path (native, or capped at an AVX2-only CPU's), the load line
every table ends with, and where our machines keep tiny Shakespeare."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Where our machines keep tiny Shakespeare, which tests and benchmarks read (never a committed copy): beside the
# clone in shared/, or wherever QUILLGPT_SHAKESPEARE says. A path with no file there means "absent", which is how
# CI proves the tests' fallback corpus in a clone that has the real one beside it.
SHAKESPEARE = Path(
    os.environ.get("QUILLGPT_SHAKESPEARE")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
)

# A nanoGPT checkout for the measurements against it (bench.py --gpu, benchmarks/vs_nanogpt.py), never committed:
# where QUILLGPT_NANOGPT says, else in the clone's ignored .gpu_inputs/ (docs/benchmarks.md, "On a GPU").
NANOGPT = Path(os.environ.get("QUILLGPT_NANOGPT") or Path(__file__).resolve().parents[1] / ".gpu_inputs" / "nanoGPT")

# Environment caps under which this CPU runs the code paths of an AVX2-only one: oneDNN's (bf16) and MKL's (fp32)
# matmuls, ATen's own kernels and the code inductor generates (it follows ATen's capability). They are read when
# torch loads its kernels, so they must be set before the process starts. The capped
# path keeps its own inductor cache: the caps are not part of inductor's cache key, and kernels compiled for the
# native path crashed when loaded on the capped one.
ISA_ENV = {
    "native": {},
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_avx2_{getpass.getuser()}"),
    },
}


def run_on_isa(isa: str, script: str, argv: list[str]) -> int | None:
    """`script argv` again in a process whose environment caps the CPU path (ISA_ENV), as the caps must be set before
    torch loads its kernels; its exit code. None when this process already runs on that path. A script inside this
    package is run as a module (`python -m benchmarks.x`), as it was started."""
    caps = ISA_ENV[isa]
    if all(os.environ.get(k) == v for k, v in caps.items()):
        return None
    print(f"{os.path.basename(script)} on the {isa} path: {' '.join(f'{k}={v}' for k, v in caps.items())}", flush=True)
    path = Path(script).resolve()
    if path.parent == Path(__file__).resolve().parent:
        command = [sys.executable, "-m", f"{__package__}.{path.stem}", *argv]
    else:
        command = [sys.executable, str(path), *argv]
    return subprocess.call(command, env={**os.environ, **caps})


def load_average() -> str:
    """The line every benchmark table ends with: above the core count, someone else was computing too."""
    return f"load average (1 min) {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def with_shakespeare_input(cli: list[str]) -> list[str]:
    """Command-line overrides with tiny Shakespeare's local copy as data.input unless one is given, so the
    shakespeare_char presets prepare their dataset offline."""
    given = any(a.split("=")[0] == "--data.input" for a in cli)
    return cli if given or not SHAKESPEARE.is_file() else ["--data.input", str(SHAKESPEARE), *cli]
