"""Benchmarks: how fast this machine trains, decodes and serves, against nanoGPT, transformers and llama.cpp.

Without a mode flag, bench.py times the real training step (trainer.train_step on the Trainer train.py builds):
    python bench.py --config configs/shakespeare_char/cpu.toml                # ms/iter, tokens/s, MFU, peak memory
    python bench.py --config configs/shakespeare_char/cpu.toml --baseline     # ... and the speed-up over all-off
    python bench.py --config configs/shakespeare_char/gpu.toml --training.batch_size 8 --training.precision bf16
A mode flag picks another benchmark, one at a time:
    python bench.py --moe                # MoE vs dense at equal active FLOPs: a layer's dispatch cost; 3 seeds each
    python bench.py --probe              # the CPU path: capability, oneDNN's ISA, fp32 vs bf16 matmul rates
    python bench.py --vs-transformers    # greedy decoding, load included: sample.py vs HF generate (and llama.cpp)
    python bench.py --serve              # serve.py: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients
    python bench.py --gpu --part 1 --nanogpt DIR --data.input input.txt   # the GPU check (docs/benchmarks.md)
Each mode is a module of benchmarks/ with its own flags and defaults (`python bench.py --serve --help`); any
other --section.key value pair overrides the config. --isa avx2, with any mode, runs it on this CPU's AVX2-only path
(oneDNN, MKL and ATen capped at AVX2: bf16 matmuls are emulated there, as on most laptops). On their own:
python -m benchmarks.vs_nanogpt (the CPU preset against nanoGPT's train.py), python -m benchmarks.chat_demo.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from benchmarks import gpu_check, moe, probe, serving_load, training_step, vs_transformers
from benchmarks.common import Mode
from benchmarks.conditions import ISA_ENV, run_on_isa
from quillgpt.config import SHORT_FLAGS, parse_overrides
from quillgpt.errors import UserError, run_main

DEFAULT = training_step.MODE  # no mode flag: the training step
MODES = [m.MODE for m in (moe, probe, vs_transformers, serving_load, gpu_check)]


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("modes (one at a time; without one, bench.py times the training step)")
    exclusive = group.add_mutually_exclusive_group()
    for mode in MODES:
        exclusive.add_argument(mode.flag, action="store_true", help=mode.summary)
    p.add_argument(
        "--isa",
        choices=list(ISA_ENV),
        default="native",
        help="with any mode: run it on this CPU's AVX2-only path (oneDNN, MKL and ATen capped at AVX2)",
    )


def mode_parser(mode: Mode) -> argparse.ArgumentParser:
    """The mode's own flags; the training step's parser, bench.py's own --help, also lists the modes."""
    p = argparse.ArgumentParser(
        prog=mode.command,
        allow_abbrev=False,  # a flag is spelled out: a prefix of another mode's flag would pick it silently
        description=__doc__ if mode is DEFAULT else mode.doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --section.key value pair overrides the config." if mode.takes_overrides else None,
    )
    mode.add_arguments(p)
    if mode is DEFAULT:
        add_mode_flags(p)
    return p


def flags_of(mode: Mode) -> set[str]:
    p = argparse.ArgumentParser(add_help=False)
    mode.add_arguments(p)
    return {flag for action in p._actions for flag in action.option_strings}


def check_the_rest(mode: Mode, rest: list[str]) -> None:
    """What the mode's flags left must be --section.key value overrides: another mode's flag is one line saying whose
    it is, a misspelt flag one line with the nearest of the mode's, and anything else one line from parse_overrides."""
    for arg in rest:
        name = arg.split("=")[0]
        if not name.startswith("--") or "." in name or name in SHORT_FLAGS:
            continue  # an override, its value, or something parse_overrides reports
        owners = [m.name for m in [DEFAULT, *MODES] if m is not mode and name in flags_of(m)]
        if owners:
            raise UserError(
                f"{name} is a flag of {', '.join(owners)}, not of {mode.name} "
                f"(python {mode.command} --help lists its flags)"
            )
        near = difflib.get_close_matches(name, flags_of(mode), n=1)
        if near:
            raise UserError(f"{mode.name} has no flag {name}: did you mean {near[0]}?")
    if rest and not mode.takes_overrides:
        raise UserError(f"{mode.name} takes no config overrides: {' '.join(rest)}")
    parse_overrides(rest)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    picker = argparse.ArgumentParser(prog="bench.py", add_help=False, allow_abbrev=False)
    add_mode_flags(picker)
    picked, rest = picker.parse_known_args(argv)
    if picked.isa != "native" and (code := run_on_isa(picked.isa, __file__, argv)) is not None:
        return code
    mode = next((m for m in MODES if getattr(picked, m.dest)), DEFAULT)
    args, rest = mode_parser(mode).parse_known_args(rest, namespace=picked)
    check_the_rest(mode, rest)
    mode.run(args, rest)
    return 0


if __name__ == "__main__":
    run_main(main)
