"""--probe: which CPU path this process runs, and what it does to matmuls: torch's CPU capability, the ISA oneDNN
picked for a bf16 matmul, and fp32 and bf16 matmul rates at a model's MLP shape, as training's `auto` measures them.
With --isa avx2 (a flag of bench.py), the same on the AVX2-only path of this machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch

from benchmarks.common import Mode
from benchmarks.conditions import load_average
from quillgpt.precision import CPU_PATH_ENV, measure_cpu_rates

ONEDNN_ISA = re.compile(r"onednn_verbose.*?isa:([^,\n]+)", re.IGNORECASE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--width", type=int, default=384, help="the model width n_embd (default %(default)s)")
    p.add_argument("--rows", type=int, default=256, help="batch_size x block_size, at most 256 (default %(default)s)")


def onednn_isa() -> str:
    """The ISA oneDNN reports for a bf16 matmul, in a child's verbose log (it prints from C, reads the setting once)."""
    code = "import torch; a = torch.randn(64, 64, dtype=torch.bfloat16); a @ a"
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    found = ONEDNN_ISA.search(out)
    return found.group(1).strip() if found else "none: oneDNN took no bf16 matmul (ATen's own fallback runs it)"


def run(args: argparse.Namespace, cli: list[str]) -> None:
    rates = measure_cpu_rates(args.width, args.rows)
    caps = {k: os.environ[k] for k in CPU_PATH_ENV if k in os.environ}
    print(f"ATen CPU capability: {torch.backends.cpu.get_cpu_capability()}; oneDNN ISA (bf16 matmul): {onednn_isa()}")
    print(f"caps from the environment: {caps or 'none'}; {torch.get_num_threads()} threads")
    print(f"{rates.describe()}; bf16/fp32 {rates.bf16 / rates.fp32:.2f}; training.precision auto picks {rates.faster}")
    print(load_average())


SUMMARY = "the CPU path this process runs: capability, oneDNN's ISA, fp32 vs bf16 matmul rates"
MODE = Mode("--probe", SUMMARY, __doc__, add_arguments, run, takes_overrides=False)
