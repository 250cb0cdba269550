"""The CPU preset against nanoGPT's own train.py, side by side: the same model, settings and data.

    python -m benchmarks.vs_nanogpt --nanogpt ~/nanoGPT [--precision fp32] [--isa avx2]   # a clone of karpathy/nanoGPT

Four arms, each a fresh process, the order turning each round: nanoGPT as its README trains the baby GPT on a CPU
(BABY_GPT, eager, fp32: it autocasts on CUDA only), the same compiled, the eager one with glibc keeping freed memory
as our trainer does (the gap without the allocator's share), and ours, cpu.toml with a host sync each step as
nanoGPT's log line makes, all on our shakespeare_char train.bin (nanoGPT's 90/10 split, byte for byte). An arm's
ms/iter is the median of what its trainer prints after --skip iterations; the matmul ceiling is measured each round.
"""

from __future__ import annotations

import argparse
import pickle
import re
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import CPU_PRESET, REPO, run_child
from benchmarks.conditions import ISA_ENV, SHAKESPEARE, load_average, run_on_isa
from quillgpt.config import build_config, load_toml
from quillgpt.data import Dataset, find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write
from quillgpt.machine import MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD
from quillgpt.metrics import matmul_ceiling

BABY_GPT = ["--device=cpu", "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4"]
BABY_GPT += ["--n_head=4", "--n_embd=128", "--lr_decay_iters=2000", "--dropout=0.0"]
NANOGPT_ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)
OUR_ITER = re.compile(r"^iter +(\d+)/\d+ \| loss [\d.]+ \|.*?\| ([\d.]+) ms \|", re.M)
ARMS = ("nanoGPT, eager (its README's CPU command)", "nanoGPT, compiled", "nanoGPT, eager, glibc keeping freed memory")
OURS = "ours, cpu.toml"
ARMS += (OURS,)
# what quillgpt.machine.keep_freed_memory sets in our process, given to nanoGPT's through glibc's environment
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD)}
KEEP_FREED["MALLOC_TRIM_THRESHOLD_"] = str(MALLOC_TRIM_THRESHOLD)


def iteration_ms(output: str, pattern: re.Pattern, skip: int) -> float:
    """The median per-iteration time a trainer printed, its first `skip` iterations left out."""
    times = [float(ms) for it, ms in pattern.findall(output) if int(it) > skip]
    if not times:
        raise SystemExit(f"no iteration lines after iteration {skip} in:\n{output[-2000:]}")
    return statistics.median(times)


def nanogpt_workdir(nanogpt: Path, dataset: Dataset, root: Path, name: str = "shakespeare_char") -> Path:
    """nanoGPT reads its configurator, config/ and data/<name>/ (the dataset its config names) from the working
    directory: a scratch one, whose data/<name>/ links our dataset's train.bin and val.bin."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in ("configurator.py", "config"):
        (root / entry).symlink_to(nanogpt / entry)
    data = root / "data" / name
    data.mkdir(parents=True)
    for split in ("train", "val"):
        (data / f"{split}.bin").symlink_to(dataset.path(split).resolve())
    with atomic_write(data / "meta.pkl") as f:  # nanoGPT takes the vocabulary size from here (50304 without it)
        pickle.dump({"vocab_size": dataset.vocab_size}, f)
    return root


def arm_commands(nanogpt: Path, workdir: Path, iters: int, precision: str, caps: dict) -> dict[str, tuple]:
    """Each arm's (command, working directory, environment, the pattern of its iteration lines)."""
    nano = [sys.executable, str(nanogpt / "train.py"), "config/train_shakespeare_char.py", *BABY_GPT]
    nano += [f"--max_iters={iters}", f"--eval_interval={iters + 1000}", f"--out_dir={workdir / 'out'}"]
    ours = [sys.executable, "train.py", "--config", str(CPU_PRESET), "--max-iters", str(iters), "--force"]
    ours += ["--training.log_interval", "1", "--training.eval_interval", "0", "--training.save_interval", "0"]
    ours += ["--run.out_dir", str(workdir / "ours"), "--logging.plot", "false", "--data.input", str(SHAKESPEARE)]
    ours += ["--training.precision", precision]
    ours += ["--training.keep_decoding_step", "false"]  # nanoGPT compiles nothing after its loop: neither do we here
    return {
        ARMS[0]: ([*nano, "--compile=False"], workdir, caps, NANOGPT_ITER),
        ARMS[1]: ([*nano, "--compile=True"], workdir, caps, NANOGPT_ITER),
        ARMS[2]: ([*nano, "--compile=False"], workdir, {**caps, **KEEP_FREED}, NANOGPT_ITER),
        OURS: (ours, REPO, caps, OUR_ITER),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a clone of github.com/karpathy/nanoGPT")
    p.add_argument("--iters", type=int, default=150, help="iterations per arm and round")
    p.add_argument("--skip", type=int, default=20, help="first iterations left out of the median (compile, warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="ours (default: auto)")
    p.add_argument("--isa", choices=list(ISA_ENV), default="native", help="run every arm on this CPU path")
    args = p.parse_args(argv)
    # the ceiling too must be measured under the caps, which torch reads when it loads: this script again, capped
    if args.isa != "native" and (code := run_on_isa(args.isa, __file__, argv or sys.argv[1:])) is not None:
        raise SystemExit(code)
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "configurator.py").is_file():
        raise UserError(f"--nanogpt {args.nanogpt}: not a nanoGPT clone (no train.py and configurator.py)")
    if not SHAKESPEARE.is_file():
        raise UserError(f"tiny Shakespeare not found at {SHAKESPEARE}")
    # the preset's dataset, located (or prepared) as train.py does from the repository root
    data = [("data.input", str(SHAKESPEARE)), ("data.data_dir", str(REPO / "data"))]
    cfg = build_config(load_toml(CPU_PRESET), data, source=str(CPU_PRESET))
    dataset = find_dataset(cfg, DistInfo())
    ms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    ceilings = []
    with tempfile.TemporaryDirectory(prefix="vs_nanogpt_") as tmp:
        workdir = nanogpt_workdir(args.nanogpt.resolve(), dataset, Path(tmp))
        commands = arm_commands(args.nanogpt.resolve(), workdir, args.iters, args.precision, ISA_ENV[args.isa])
        for r in range(args.rounds):
            ceiling, precision = matmul_ceiling(args.precision)
            ceilings.append(ceiling)
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            for arm in order:
                cmd, cwd, env, pattern = commands[arm]
                ms[arm].append(iteration_ms(run_child(cmd, env, cwd=cwd)[1], pattern, args.skip))
                print(f"round {r + 1}, {arm}: {ms[arm][-1]:.1f} ms/iter", flush=True)
    print_table(ms, ceilings, cfg.training.batch_size * cfg.model.block_size, precision)


def print_table(ms: dict[str, list[float]], ceilings: list[float], tokens_per_iter: int, precision: str) -> None:
    ours = ms[OURS]
    print("\n| arm | ms/iter (median of rounds) | tokens/s | ours faster by (median of rounds, range) |")
    print("| --- | ---: | ---: | ---: |")
    for arm, times in ms.items():
        median = statistics.median(times)
        ratios = [t / o for t, o in zip(times, ours)]
        ratio = "—" if arm == OURS else (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {arm} | {median:.1f} | {tokens_per_iter / median * 1e3:,.0f} | {ratio} |")
    spread = f"median of {len(ceilings)}, {min(ceilings) / 1e9:,.0f}-{max(ceilings) / 1e9:,.0f}, one before each round"
    print(f"{precision} matmul ceiling: {statistics.median(ceilings) / 1e9:,.0f} GFLOP/s ({spread}); {load_average()}")


if __name__ == "__main__":
    run_main(main)
