"""--gpu: one command that checks a GPU and races quillgpt against nanoGPT on it, for the first GPU at hand. Its
inputs come by path, never from the network: tiny Shakespeare (--data.input) and a nanoGPT checkout (--nanogpt).

    python bench.py --gpu --part 1 --nanogpt DIR --data.input input.txt   # ~7 min on an H100 (an estimate)
    python bench.py --gpu --part 2 --nanogpt DIR --data.input input.txt   # ~7.5 min on an H100 (an estimate)
    python bench.py --gpu --tiny --device cpu                             # the same code at toy shapes, on a CPU

Part 1: a. `pytest -m cuda` (tests/test_cuda.py), its counts; c. GPT-2 124M's step, ours (configs/gpt2/124M.toml)
against nanoGPT's train.py with config/train_gpt2.py's shape, compiled and in bf16 both, 1,024-token rows, each at the
largest micro-batch that fits (measured: two eager bf16 steps at two batch sizes give each side's memory per row), on
random local tokens, 20 timed iterations after warm-up: tokens/s and MFU against the card's dense bf16 peak;
d. batch-1 decoding, sample.py's defaults against transformers' generate on the same export (256 tokens), and
serve.py's aggregate tokens/s with 1 and 16 concurrent greedy clients.
Part 2: b. tiny Shakespeare to val 1.47: nanoGPT's config/train_shakespeare_char.py, our gpu.toml (the same settings)
and speedrun_gpu.toml, each from launch (start-up and compiling count), stopped at the target: the wall time to it and
ms/iter; then, while the part's time budget lasts, the levers that are off until measured: 124M with
training.loss_chunks (a larger micro-batch) and with compile_mode reduce-overhead (CUDA graphs), and sample.py
--compile.

Each part prints its tables and writes them, with the device, torch and the commit, to --out as JSON. Without
--nanogpt the nanoGPT arms are left out (the report says so). --tiny runs every step at toy shapes and a few
iterations; with --device cpu it runs on a CPU (tests/test_gpu_check.py does). A step whose estimated cost (on an
H100) no longer fits in --budget-s since the start is skipped, and the report says so: each part ends in ~8 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks import serving_load, vs_transformers
from benchmarks.common import GPU_PRESET, REPO, Mode, print_table
from benchmarks.conditions import SHAKESPEARE, load_average
from benchmarks.trainer_runs import (
    NANOGPT,
    OURS,
    RaceResult,
    follow,
    race_result,
    random_token_dataset,
    steady_ms_per_iter,
    stop_at,
)
from benchmarks.vs_nanogpt import nanogpt_workdir
from model import GPT, GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import Dataset, find_dataset, load_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write_json
from quillgpt.metrics import cuda_peak_flops, default_peak_flops

GPT2_PRESET = REPO / "configs" / "gpt2" / "124M.toml"
SPEEDRUN_GPU = REPO / "configs" / "shakespeare_char" / "speedrun_gpu.toml"
TARGET = 1.47
BATCH_LADDER = (1, 2, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
MEMORY_SHARE = 0.85  # of the free memory a micro-batch may plan to fill: compiled steps take less than eager ones


@dataclass(frozen=True)
class Scale:
    """The sizes the check runs at: a real GPU's, or toy ones (--tiny) that run the same code in seconds."""

    shakespeare: list[str]  # our overrides for gpu.toml and speedrun_gpu.toml
    nanogpt_shakespeare: list[str]  # nanoGPT's for config/train_shakespeare_char.py
    target: float
    arm_limit_s: float  # a race arm still going after this is stopped
    gpt2: list[str]  # our overrides for configs/gpt2/124M.toml
    nanogpt_gpt2: list[str]  # nanoGPT's for config/train_gpt2.py
    gpt2_vocab: int
    gpt2_block: int
    gpt2_batch: int | None  # None: the largest that fits, measured
    gpt2_tokens: int  # random local tokens in train.bin
    tokens_per_iter: int  # grad_accum_steps = this over a micro-batch's tokens, the same rule for both sides
    warmup: int
    iters: int
    decoding: list[str]  # our overrides for the decoding and serving model (the GPU preset's)
    new_tokens: int
    repeats: int
    clients: list[int]
    requests: int
    reply_tokens: int
    tests_timeout_s: float


REAL = Scale(
    shakespeare=[],
    nanogpt_shakespeare=[],
    target=TARGET,
    arm_limit_s=200,
    gpt2=[],
    nanogpt_gpt2=[],
    gpt2_vocab=50304,
    gpt2_block=1024,
    gpt2_batch=None,
    gpt2_tokens=20_000_000,
    tokens_per_iter=2**17,
    warmup=3,
    iters=20,
    decoding=[],
    new_tokens=256,
    repeats=2,
    clients=[1, 16],
    requests=3,
    reply_tokens=128,
    tests_timeout_s=240,
)
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64}
TINY_STEPS = {"max_iters": 40, "eval_interval": 10, "eval_iters": 4, "log_interval": 5, "warmup_iters": 5}
TINY = Scale(
    shakespeare=[
        *(a for k, v in TINY_MODEL.items() for a in (f"--model.{k}", str(v))),
        *("--model.block_size", "64", "--training.batch_size", "16", "--training.final_eval_iters", "4"),
        *(a for k, v in TINY_STEPS.items() if k != "warmup_iters" for a in (f"--training.{k}", str(v))),
        *("--optimizer.warmup_iters", "5", "--optimizer.lr_decay_iters", "40"),
    ],
    nanogpt_shakespeare=[
        *(f"--{k}={v}" for k, v in {**TINY_MODEL, **TINY_STEPS}.items()),
        *("--block_size=64", "--batch_size=16", "--lr_decay_iters=40"),
    ],
    target=3.4,
    arm_limit_s=120,
    gpt2=[*(a for k, v in TINY_MODEL.items() for a in (f"--model.{k}", str(v))), "--model.block_size", "64"],
    nanogpt_gpt2=[*(f"--{k}={v}" for k, v in TINY_MODEL.items()), "--block_size=64"],
    gpt2_vocab=512,
    gpt2_block=64,
    gpt2_batch=4,
    gpt2_tokens=100_000,
    tokens_per_iter=512,
    warmup=1,
    iters=3,
    decoding=["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "64"],
    new_tokens=16,
    repeats=1,
    clients=[1, 2],
    requests=1,
    reply_tokens=8,
    tests_timeout_s=300,
)


@dataclass
class Check:
    """One run of the check: its settings, and what each part found, as the JSON report holds them."""

    args: argparse.Namespace
    cli: list[str]  # the command line's --section.key value pairs (--data.input)
    scale: Scale
    started: float = field(default_factory=time.perf_counter)
    report: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.args.device

    @property
    def on_cpu(self) -> bool:
        return self.args.device == "cpu"

    def time_left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("1", "2", "all"), default="all", help="which part to run (default %(default)s)")
    p.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout (github.com/karpathy/nanoGPT)")
    p.add_argument("--device", default="cuda", help="where it all runs (default %(default)s; cpu with --tiny)")
    p.add_argument("--tiny", action="store_true", help="toy shapes and a few iterations: the same code in seconds")
    p.add_argument("--out", type=Path, default=None, help="the JSON report (default bench_out/gpu_check_part<N>.json)")
    p.add_argument("--commit", default=None, help="the commit the report names (default: git's, where this is a clone)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="seconds from the start a step must fit in by its estimated cost, else it is skipped and reported so "
        "(default %(default)s: a part in ~8 minutes; raise it for --part all)",
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    check = Check(args, cli, TINY if args.tiny else REAL)
    if args.nanogpt is not None and not (args.nanogpt / "train.py").is_file():
        raise UserError(f"--nanogpt {args.nanogpt}: not a nanoGPT checkout (no train.py)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("bench.py --gpu: no CUDA device here (--tiny --device cpu runs the check's code on the CPU)")
    check.report["machine"] = machine_facts(args.device, args.commit)
    print(f"bench.py --gpu --part {args.part}{' --tiny' if args.tiny else ''}: {check.report['machine']['line']}")
    for step in PARTS[args.part]:
        if check.time_left() < STEP_COST_S[step]:
            check.report[step] = {"skipped": f"the time budget (--budget-s {args.budget_s:.0f}) is spent"}
            print(f"\n{step}: skipped, {check.report[step]['skipped']}")
            continue
        check.report[step] = STEPS[step](check)
    check.report["seconds"] = time.perf_counter() - check.started
    out = args.out or REPO / "bench_out" / f"gpu_check_part{args.part}.json"
    atomic_write_json(out, check.report)
    print(f"report: {out} ({check.report['seconds']:.0f} s); {load_average()}")


STEPS = {
    "tests": lambda check: cuda_tests(check),
    "gpt2_124m": lambda check: [asdict(r) for r in gpt2_rows(check, levers=False)],
    "decoding": lambda check: decoding(check, compile_step=False),
    "serving": lambda check: serving(check),
    "shakespeare": lambda check: [asdict(r) for r in shakespeare_race(check)],
    "levers": lambda check: levers(check),
}
PARTS = {"1": ["tests", "gpt2_124m", "decoding", "serving"], "2": ["shakespeare", "levers"]}
PARTS["all"] = PARTS["1"] + PARTS["2"]
# What a step costs on an H100, by estimate: one that would not fit in what is left of --budget-s is skipped (and
# reported so), so that a part ends within its budget. The tests and the race bound themselves (timeouts, limits).
STEP_COST_S = {"tests": 0, "gpt2_124m": 200, "decoding": 50, "serving": 30, "shakespeare": 0, "levers": 0}

MODE = Mode(
    "--gpu",
    "the GPU check: pytest -m cuda, 124M and tiny Shakespeare against nanoGPT, decoding and serving",
    __doc__,
    add_arguments,
    run,
)


# ---- the machine ----------------------------------------------------------------------------------------------------


def machine_facts(device: str, commit: str | None) -> dict:
    """The device line of the report: the card, its dense bf16 peak, torch, CUDA, the commit and the date."""
    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or this_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        facts.update(
            card=props.name,
            memory_gb=round(props.total_memory / 1e9, 1),
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            bf16_peak_tflops=cuda_peak_flops(props.name) / 1e12,
        )
        facts["line"] = (
            f"{props.name} ({facts['memory_gb']} GB, sm_{props.major}{props.minor}, dense bf16 peak "
            f"{facts['bf16_peak_tflops']:.0f} TFLOP/s), torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"commit {facts['commit']}, {facts['date']}"
        )
    else:
        facts["line"] = (
            f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}, commit {facts['commit']}"
        )
    return facts


def this_commit() -> str:
    """The checkout's commit, where it is a git clone with git installed (a copy sent to a GPU machine may be neither)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown (no git here: --commit)"
    return done.stdout.strip() or "unknown (not a clone: --commit)"


def peak_flops(check: Check) -> float:
    """The dense bf16 peak MFU is counted against: the card's, or on a CPU its nominal one (metrics)."""
    if check.on_cpu:
        return default_peak_flops(torch.device("cpu"), "bf16")[0]
    return check.report["machine"]["bf16_peak_tflops"] * 1e12


# ---- a. the CUDA tests ----------------------------------------------------------------------------------------------


def cuda_tests(check: Check) -> dict:
    """`pytest -m cuda` in a fresh process: the counts, the failures' names and the time."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    t0 = time.perf_counter()
    # a session of its own: at the time limit the tests' own children (torchrun, serve.py) go with pytest
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=check.scale.tests_timeout_s)  # pytest's report; plugins warn on stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(stopped after {check.scale.tests_timeout_s:.0f} s)"
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    result = {
        "command": "python -m pytest -m cuda tests/test_cuda.py",
        "counts": counts,
        "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M),
        "seconds": round(time.perf_counter() - t0, 1),
        "summary": summary,
    }
    print(f"\na. pytest -m cuda: {summary} ({result['seconds']:.0f} s)")
    for name in result["failed"]:
        print(f"   failed: {name}")
    return result


# ---- b. tiny Shakespeare to val 1.47 --------------------------------------------------------------------------------


def shakespeare_race(check: Check) -> list[RaceResult]:
    """nanoGPT's train_shakespeare_char, our gpu.toml and speedrun_gpu.toml, one after the other, each to the target."""
    s = check.scale
    data_input = input_text(check.cli)
    device = ["--run.device", check.device] + (["--training.compile", "false"] if check.on_cpu else [])
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_shakespeare_") as tmp:
        data_dir = Path(tmp) / "data"
        dataset = shakespeare_char(data_input, data_dir)  # prepared before any clock starts
        ours = [
            *("--data.input", str(data_input), "--data.data_dir", str(data_dir), "--run.out_dir", f"{tmp}/runs"),
            *("--force", "--logging.plot", "false", "--training.save_interval", "0", *device, *s.shakespeare),
        ]
        if check.args.nanogpt:
            results.append(nanogpt_shakespeare(check, Path(tmp), dataset))
        for config in (GPU_PRESET, SPEEDRUN_GPU):
            cmd = [sys.executable, "train.py", "--config", str(config), *ours]
            timeline = follow(cmd, REPO, s.arm_limit_s, stop_at(OURS, s.target))
            results.append(race_result(f"ours, {config.name}", timeline, OURS, s.target))
            print_race_row(results[-1])
    print_race(results, check)
    return results


def input_text(cli: list[str]) -> Path:
    """--data.input from the command line, else tiny Shakespeare where our machines keep it."""
    given = dict(parse_overrides(cli)).get("data.input")
    path = Path(given) if given else SHAKESPEARE
    if not path.is_file():
        raise UserError(f"tiny Shakespeare not found at {path}: give a local copy with --data.input")
    return path


def shakespeare_char(data_input: Path, data_dir: Path) -> Dataset:
    """gpu.toml's dataset, prepared from the local copy as train.py would (byte for byte nanoGPT's 90/10 split)."""
    overrides = [("data.input", str(data_input)), ("data.data_dir", str(data_dir))]
    return find_dataset(build_config(load_toml(GPU_PRESET), overrides, source=str(GPU_PRESET)), DistInfo())


def nanogpt_shakespeare(check: Check, tmp: Path, dataset: Dataset) -> RaceResult:
    """nanoGPT's config/train_shakespeare_char.py on our prepared shakespeare_char."""
    s = check.scale
    workdir = nanogpt_workdir(check.args.nanogpt.resolve(), dataset, tmp / "nanogpt")
    cmd = [sys.executable, str(check.args.nanogpt.resolve() / "train.py"), "config/train_shakespeare_char.py"]
    cmd += [f"--out_dir={tmp / 'nanogpt_out'}", *nanogpt_device(check), *s.nanogpt_shakespeare]
    timeline = follow(cmd, workdir, s.arm_limit_s, stop_at(NANOGPT, s.target))
    result = race_result("nanoGPT, train_shakespeare_char.py", timeline, NANOGPT, s.target)
    print_race_row(result)
    return result


def nanogpt_device(check: Check) -> list[str]:
    """nanoGPT on the CPU: fp32 (it autocasts on CUDA only), eager; on CUDA its defaults: bf16, compiled."""
    return ["--device=cpu", "--compile=False"] if check.on_cpu else [f"--device={check.device}"]


def print_race_row(r: RaceResult) -> None:
    reached = f"val {r.target} at {r.reached_s:.1f} s (iter {r.reached_iter})" if r.reached_s else "target not reached"
    print(f"  {r.arm}: {reached}; best val {r.best_val}; {r.ms_per_iter or 0:.1f} ms/iter; wall {r.wall_s:.0f} s")
    if r.error:
        print(f"  {r.arm} failed: {r.error[-600:]}")


def print_race(results: list[RaceResult], check: Check) -> None:
    base = next((r for r in results if r.arm.startswith("nanoGPT") and r.reached_s), None)
    print(f"\nb. tiny Shakespeare to val {check.scale.target}, from launch (start-up and compiling count):")
    print_table(
        ["arm", "to target (s)", "at iter", "vs nanoGPT", "best val", "ms/iter", "wall (s)"],
        [
            [
                r.arm,
                f"{r.reached_s:.1f}" if r.reached_s else "not reached",
                str(r.reached_iter or "—"),
                f"{r.reached_s / base.reached_s:.2f}" if base and r.reached_s else "—",
                f"{r.best_val:.4f}" if r.best_val is not None else "—",
                f"{r.ms_per_iter:.1f}" if r.ms_per_iter else "—",
                f"{r.wall_s:.0f}",
            ]
            for r in results
        ],
    )
    if not check.args.nanogpt:
        print("nanoGPT: not run (no --nanogpt DIR)")


# ---- c. GPT-2 124M --------------------------------------------------------------------------------------------------


@dataclass
class StepRow:
    """One side's 124M step: its micro-batch and accumulation, and how fast it ran."""

    arm: str
    micro_batch: int = 0
    grad_accum: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    ms_per_iter: float | None = None
    peak_memory_gb: float | None = None
    fitted: str = ""  # how the micro-batch was chosen
    error: str = ""


LEVERS = {
    "loss_chunks 8": ["--training.loss_chunks", "8"],
    "compile_mode reduce-overhead (CUDA graphs)": ["--training.compile_mode", "reduce-overhead"],
}
LEVER_COST_S = 90  # a lever's run, start-up, probe and compile included (an estimate for an H100)
STEP_LIMIT_S = 240  # one timed 124M run, its compile included, is stopped after this


def gpt2_rows(check: Check, levers: bool) -> list[StepRow]:
    """Ours and nanoGPT's 124M step (part 1), or ours with each lever while the budget lasts (part 2)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_124m_") as tmp:
        data = random_token_dataset(Path(tmp) / "tokens", check.scale.gpt2_vocab, check.scale.gpt2_tokens)
        if levers:
            for name, overrides in LEVERS.items():
                if check.on_cpu and "compile_mode" in name:
                    continue  # CUDA graphs: nothing to measure on a CPU
                if check.time_left() < LEVER_COST_S:
                    rows.append(StepRow(f"ours + {name}", error="skipped: the part's time budget is spent"))
                    continue
                rows.append(our_step(check, data, f"ours + {name}", overrides))
        else:
            rows.append(our_step(check, data, "ours, 124M.toml", []))
            if check.args.nanogpt:
                rows.append(nanogpt_step(check, data, Path(tmp)))
    print_steps(rows, check)
    return rows


def fitted_batch(check: Check, side: str, chunks: int = 1) -> tuple[int, str]:
    """The largest micro-batch of the ladder that the memory of two measured eager bf16 steps says fits."""
    if check.scale.gpt2_batch is not None:
        return check.scale.gpt2_batch, "fixed (--tiny)"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "probe", side, str(check.scale.gpt2_block), str(chunks)]
    cmd += [str(check.args.nanogpt.resolve()) if check.args.nanogpt else ""]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError(f"the memory probe of {side} took over 120 s") from None
    if done.returncode:
        raise UserError(f"the memory probe of {side} failed: {done.stderr.strip()[-400:]}")
    m = json.loads(done.stdout.strip().splitlines()[-1])
    fits = math.floor((MEMORY_SHARE * m["free"] - m["fixed"]) / m["per_row"])
    batch = max([b for b in BATCH_LADDER if b <= fits], default=1)
    return batch, f"{m['per_row'] / 1e9:.2f} GB a row + {m['fixed'] / 1e9:.1f} GB, {m['free'] / 1e9:.0f} GB free"


def accumulation(check: Check, batch: int) -> int:
    return max(1, round(check.scale.tokens_per_iter / (batch * check.scale.gpt2_block)))


def our_step(check: Check, data: Path, arm: str, overrides: list[str]) -> StepRow:
    """bench.py's timed step on configs/gpt2/124M.toml; one smaller micro-batch tried if the first runs out of memory."""
    chunks = int(dict(zip(overrides[::2], overrides[1::2])).get("--training.loss_chunks", 1))
    try:
        batch, how = fitted_batch(check, "ours", chunks)
    except UserError as e:
        return StepRow(arm, error=str(e))
    for attempt in (batch, *[b for b in BATCH_LADDER if b < batch][-1:]):
        row = StepRow(arm, attempt, accumulation(check, attempt), fitted=how)
        cmd = [sys.executable, "bench.py", "--config", str(GPT2_PRESET), "--json", "--repeats", "1"]
        cmd += [
            "--warmup",
            str(check.scale.warmup),
            "--iters",
            str(check.scale.iters),
            "--data.processed_dir",
            str(data),
        ]
        cmd += ["--training.batch_size", str(attempt), "--training.grad_accum_steps", str(row.grad_accum)]
        cmd += ["--run.device", check.device, *(["--training.compile", "false"] if check.on_cpu else [])]
        cmd += ["--model.vocab_size", str(check.scale.gpt2_vocab)]  # nanoGPT's: its meta.pkl's
        try:
            done = subprocess.run(
                [*cmd, *check.scale.gpt2, *overrides], cwd=REPO, capture_output=True, text=True, timeout=STEP_LIMIT_S
            )
        except subprocess.TimeoutExpired:
            row.error = f"stopped after {STEP_LIMIT_S} s"
            return row
        if done.returncode == 0:
            timing = json.loads(done.stdout.strip().splitlines()[-1])[0]
            row.tokens_per_s, row.ms_per_iter = timing["tokens_per_s"], timing["ms_median"]
            row.mfu = timing["tokens_per_s"] * flops_per_token(check) / peak_flops(check)
            row.peak_memory_gb = timing["peak_mb"] / 1e3
            return row
        row.error = (done.stdout + done.stderr).strip()[-600:]
        if "out of memory" not in row.error.lower():
            return row
        how += f"; {attempt} ran out of memory"
    return row


def nanogpt_step(check: Check, data: Path, tmp: Path) -> StepRow:
    """nanoGPT's train.py with config/train_gpt2.py's shape on the same local tokens: the median of its iterations
    after warm-up, each timed by the lines it prints after reading its loss back (log_interval 1)."""
    arm = "nanoGPT, train_gpt2.py"
    try:
        batch, how = fitted_batch(check, "nanogpt")
    except UserError as e:
        return StepRow(arm, error=str(e))
    row = StepRow(arm, batch, accumulation(check, batch), fitted=how)
    workdir = nanogpt_workdir(check.args.nanogpt.resolve(), load_dataset(data), tmp / "nanogpt", "openwebtext")
    s = check.scale
    cmd = [sys.executable, str(check.args.nanogpt.resolve() / "train.py"), "config/train_gpt2.py", "--wandb_log=False"]
    cmd += [f"--batch_size={batch}", f"--gradient_accumulation_steps={row.grad_accum}", "--log_interval=1"]
    cmd += [f"--max_iters={s.warmup + s.iters}", "--eval_interval=100000", "--eval_iters=1", f"--out_dir={tmp}/out"]
    timeline = follow([*cmd, *nanogpt_device(check), *s.nanogpt_gpt2], workdir, limit_s=STEP_LIMIT_S)
    ms = steady_ms_per_iter(timeline, NANOGPT, after=s.warmup)
    if ms is None or timeline.returncode != 0:
        row.error = f"exit {timeline.returncode}: {timeline.tail()}"
        return row
    row.ms_per_iter = ms
    row.tokens_per_s = batch * row.grad_accum * s.gpt2_block / (ms / 1e3)
    row.mfu = row.tokens_per_s * flops_per_token(check) / peak_flops(check)
    return row


def flops_per_token(check: Check) -> float:
    """Training FLOPs per token of the 124M shape (nanoGPT's and ours alike: 6N + attention, PaLM's count)."""
    cfg = build_config(load_toml(GPT2_PRESET), parse_overrides(check.scale.gpt2), source=str(GPT2_PRESET))
    with torch.device("meta"):
        return GPT(GPTConfig.from_dict({**cfg.model_args(), "vocab_size": check.scale.gpt2_vocab})).flops_per_token()


def print_steps(rows: list[StepRow], check: Check) -> None:
    base = next((r for r in rows if r.arm.startswith("nanoGPT") and r.tokens_per_s), None)
    s = check.scale
    print(f"\nc. 124M's step, {s.gpt2_block}-token rows, {s.iters} iterations after {s.warmup} of warm-up:")
    print_table(
        ["arm", "micro-batch x accum", "tokens/s", "vs nanoGPT", "MFU", "ms/iter", "peak GB", "micro-batch from"],
        [
            [
                r.arm,
                f"{r.micro_batch} x {r.grad_accum}" if r.micro_batch else "—",
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else r.error.splitlines()[-1][:80] if r.error else "—",
                f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and r.tokens_per_s else "—",
                f"{r.mfu:.1%}" if r.mfu else "—",
                f"{r.ms_per_iter:.0f}" if r.ms_per_iter else "—",
                f"{r.peak_memory_gb:.1f}" if r.peak_memory_gb else "—",
                r.fitted or "—",
            ]
            for r in rows
        ],
    )


# ---- d. decoding and serving ----------------------------------------------------------------------------------------


def decoding(check: Check, compile_step: bool) -> dict:
    """sample.py's eager step (and with compile_step, the compiled step: its first run and kept) against
    transformers' generate."""
    s = check.scale
    try:
        c = vs_transformers.compare(str(GPU_PRESET), s.decoding, s.new_tokens, s.repeats, compile_step, check.device)
    except UserError as e:
        print(f"\nd. decoding: {e}")
        return {"error": str(e)}
    print("\nd. batch-1 greedy decoding, fresh processes:")
    vs_transformers.print_comparison(c)
    theirs = c.theirs
    return {
        "new_tokens": c.new_tokens,
        "sides": [
            {
                **asdict(side),
                "tokens_per_s": c.new_tokens / side.generation,
                "vs_transformers": theirs.generation / side.generation,
            }
            for side in c.sides
        ],
        "same_text": c.same_text,
    }


def serving(check: Check) -> dict:
    s = check.scale
    dtype = "fp32" if check.on_cpu else "auto"
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_serve_") as tmp:
            ckpt = serving_load.bench_checkpoint(str(GPU_PRESET), s.decoding, Path(tmp))
            levels, _ = serving_load.measure(ckpt, s.clients, s.requests, s.reply_tokens, dtype, check.device)
    except (UserError, ImportError) as e:
        print(f"\nd. serving: {e}")
        return {"error": str(e)}
    print(
        f"\nd. serve.py --device {check.device} --dtype {dtype}, {s.requests} requests of {s.reply_tokens} tokens a client:"
    )
    serving_load.print_levels(levels)
    return {"dtype": dtype, "levels": [asdict(level) for level in levels]}


# ---- part 2's levers ------------------------------------------------------------------------------------------------


def levers(check: Check) -> dict:
    """What is off until a GPU measures it, while the part's budget lasts: 124M with each training lever, then
    sample.py --compile against transformers."""
    found = {"gpt2_124m": [asdict(r) for r in gpt2_rows(check, levers=True)]}
    if check.on_cpu:  # bench.py --sample times compiled decoding on a CPU
        found["decoding_compiled"] = {"error": "skipped: on a CPU, bench.py --sample times it"}
    elif check.time_left() > LEVER_COST_S:
        found["decoding_compiled"] = decoding(check, compile_step=True)
    else:
        found["decoding_compiled"] = {"error": "skipped: the part's time budget is spent"}
        print("\nsample.py --compile: skipped (the part's time budget is spent)")
    return found


# ---- the memory probe: python -m benchmarks.gpu_check probe ours|nanogpt BLOCK CHUNKS [NANOGPT_DIR] --------------------


def probe(side: str, block: int, chunks: int, nanogpt: str) -> dict:
    """Peak CUDA memory of eager bf16 training steps of the 124M shape at 2 and 4 rows: the memory a row adds, the
    fixed rest (weights, gradients, optimizer state, the allocator's), and the memory free before the model."""
    free = torch.cuda.mem_get_info()[0]
    model, optimizer = probe_model(side, block, chunks, nanogpt)
    peaks = {}
    for rows in (2, 4):
        for _ in range(2):  # the second step has the optimizer's state from the first
            torch.cuda.reset_peak_memory_stats()
            x = torch.randint(0, 50304, (rows, block), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks[rows] = torch.cuda.max_memory_allocated()
    per_row = (peaks[4] - peaks[2]) / 2
    return {"free": free, "per_row": per_row, "fixed": peaks[2] - 2 * per_row, "peaks": peaks}


def probe_model(side: str, block: int, chunks: int, nanogpt: str):
    """The 124M model of one side on CUDA, with its optimizer (nanoGPT's: its configure_optimizers, fused AdamW)."""
    shape = dict(block_size=block, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
    if side == "ours":
        from quillgpt.config import OptimizerConfig
        from quillgpt.optim import make_optimizers

        model = GPT(GPTConfig(**shape)).cuda()
        model.loss_chunks = chunks
        return model, make_optimizers(model, OptimizerConfig(), "cuda")[0]
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(nanogpt) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.GPT(module.GPTConfig(**shape)).cuda()
    return model, model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")


def main(argv: list[str]) -> None:
    if argv[:1] != ["probe"] or len(argv) != 5:
        raise UserError("usage: python -m benchmarks.gpu_check probe ours|nanogpt BLOCK CHUNKS NANOGPT_DIR")
    side, block, chunks, nanogpt = argv[1], int(argv[2]), int(argv[3]), argv[4]
    print(json.dumps(probe(side, block, chunks, nanogpt)))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
