"""Benchmarks: how fast this machine trains, samples and prepares data, and how much memory it takes.

Without a mode flag, bench.py times the real training step (trainer.train_step on the Trainer train.py builds):
    python bench.py --config configs/shakespeare_char/cpu.toml                # ms/iter, tokens/s, MFU, peak memory
    python bench.py --config configs/shakespeare_char/cpu.toml --baseline     # ... and the speed-up over all-off
    python bench.py --config configs/shakespeare_char/gpu.toml --training.batch_size 8 --training.precision bf16
    python bench.py --config configs/shakespeare_char/cpu.toml --profile      # + a chrome trace in bench_out/
A mode flag picks another benchmark, one at a time:
    python bench.py --against HEAD~1 --rounds 6   # this checkout's training step vs a commit's, ABBA rounds
    python bench.py --kernels --iters 50          # the compiled step's time per kernel, by clock
    python bench.py --sample             # batch-1 decoding tokens/s: no cache, KV cache, compiled; fp32, bf16, int8
    python bench.py --hellaswag --training.precision bf16   # seconds per 1,000 HellaSwag items (GPU preset's model)
    python bench.py --prepare            # BPE training time; prepare.py on a 1 GB jsonl: MB/s with 1 and 2 workers, RSS
    python bench.py --memory             # training RSS on a 1 GB train.bin vs tiny Shakespeare's
    python bench.py --precision-curves --training.batch_size 8   # val loss of fp32 vs bf16 training, 300 iters
    python bench.py --chat --rows 120    # chat: masked vs unmasked loss step time; packed vs padded rows, 120 s each
    python bench.py --dpo                # DPO on the chat demo's model: held-out accuracy and margin, before and after
    python bench.py --muon               # Muon's step: a Newton-Schulz chain per matrix vs one per shape
    python bench.py --moe                # MoE vs dense at equal active FLOPs: a layer's dispatch cost; 3 seeds each
    python bench.py --finetune           # SmolLM2-135M's shape (random): fine-tuning tokens/s and RSS vs --validate
    python bench.py --lora               # LoRA, QLoRA vs full: peak RSS, s/step (SmolLM2-135M, a 1B shape) vs --validate
    python bench.py --lora --part demo   # the CPU chat demo: LoRA rank 8 and 32 vs the full SFT in the same wall time

    python bench.py --probe              # the CPU path: capability, oneDNN's ISA, fp32 vs bf16 matmul rates
    python bench.py --vs-transformers    # batch-1 greedy decoding, load included: sample.py's default vs HF generate
    python bench.py --serve              # serve.py: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients
    python bench.py --gpu --part 1 --nanogpt DIR --data.input input.txt   # the GPU check (docs/benchmarks.md)
Each mode is a module of benchmarks/ with its own flags and defaults (`python bench.py --sample --help`); any
other --section.key value pair overrides the config. --isa avx2, with any mode, runs it on this CPU's AVX2-only path
(oneDNN, MKL and ATen capped at AVX2: bf16 matmuls are emulated there, as on most laptops).
"""

from __future__ import annotations

import argparse
import difflib
import sys

from benchmarks import (
    against,
    chat_rows,
    decoding,
    dpo,
    finetune,
    gpu_check,
    hellaswag,
    kernel_times,
    lora,
    memory,
    moe,
    muon,
    precision_curves,
    prepare_speed,
    probe,
    serving_load,
    training_step,
    vs_transformers,
)
from benchmarks.common import Mode
from benchmarks.conditions import ISA_ENV, run_on_isa
from quillgpt.config import SHORT_FLAGS, parse_overrides
from quillgpt.errors import UserError, run_main

DEFAULT = training_step.MODE  # no mode flag: the training step
MODES = [
    m.MODE
    for m in (
        against,
        kernel_times,
        decoding,
        hellaswag,
        prepare_speed,
        memory,
        precision_curves,
        muon,
        moe,
        finetune,
        lora,
        chat_rows,
        dpo,
        probe,
        vs_transformers,
        serving_load,
        gpu_check,
    )
]


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("modes (one at a time; without one, bench.py times the training step)")
    exclusive = group.add_mutually_exclusive_group()
    for mode in MODES:
        if mode.metavar:
            exclusive.add_argument(mode.flag, metavar=mode.metavar, help=mode.summary)
        else:
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
    mode = next((m for m in MODES if getattr(picked, m.dest) not in (None, False)), DEFAULT)
    args, rest = mode_parser(mode).parse_known_args(rest, namespace=picked)
    check_the_rest(mode, rest)
    mode.run(args, rest)
    return 0


if __name__ == "__main__":
    run_main(main)
