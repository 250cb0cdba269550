"""--gpu: one command that checks a GPU and races quillgpt against nanoGPT on it, for the first GPU at hand, its inputs
by path, never from the network: tiny Shakespeare (--data.input) and a nanoGPT checkout (--nanogpt).

    python bench.py --gpu --part 1|2 --nanogpt DIR --data.input input.txt   # ~7 min each on an H100 (an estimate)
    python bench.py --gpu --tiny --device cpu                               # the same code at toy shapes, on a CPU

Part 1: a. `pytest -m cuda`; c. GPT-2 124M's step, ours against nanoGPT's, each at the largest micro-batch that fits;
d. batch-1 decoding against transformers' generate, and serve.py with 1 and 16 clients. Part 2: b. tiny Shakespeare
to val 1.47 from launch, nanoGPT against gpu.toml and speedrun_gpu.toml; then, while the budget lasts, the levers off
until measured. docs/benchmarks.md ("On a GPU") gives each part's method and cost. Each part writes its tables, with
the device, torch and the commit, to --out as JSON; without --nanogpt the nanoGPT arms are left out. A step whose
estimated cost no longer fits in --budget-s is skipped, and the report says so: a part ends in ~8 minutes.
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

from benchmarks import serving_load, trainer_runs, vs_transformers
from benchmarks.common import GPU_PRESET, REPO, Mode, print_table, run_child
from benchmarks.conditions import SHAKESPEARE, load_average
from benchmarks.trainer_runs import NANOGPT, OURS, RaceResult, follow, race_result, stop_at
from benchmarks.vs_nanogpt import nanogpt_workdir
from model import GPT, GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.data import find_dataset, load_dataset
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write_json
from quillgpt.metrics import cuda_peak_flops, default_peak_flops

GPT2_PRESET = REPO / "configs" / "gpt2" / "124M.toml"
SPEEDRUN_GPU = REPO / "configs" / "shakespeare_char" / "speedrun_gpu.toml"
BATCH_LADDER = (1, 2, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
MEMORY_SHARE = 0.85  # of the free memory a micro-batch may plan to fill: compiled steps take less than eager ones


@dataclass(frozen=True)
class Scale:
    """The sizes the check runs at: a real GPU's (the defaults), or TINY's (--tiny), the same code in seconds."""

    shakespeare: tuple[str, ...] = ()  # our overrides for gpu.toml and speedrun_gpu.toml
    nanogpt_shakespeare: tuple[str, ...] = ()  # nanoGPT's for config/train_shakespeare_char.py
    target: float = 1.47
    arm_limit_s: float = 200  # a race arm still going after this is stopped
    gpt2: tuple[str, ...] = ()  # our overrides for configs/gpt2/124M.toml
    nanogpt_gpt2: tuple[str, ...] = ()  # nanoGPT's for config/train_gpt2.py
    gpt2_vocab: int = 50304
    gpt2_block: int = 1024
    gpt2_batch: int | None = None  # None: the largest that fits, measured
    gpt2_tokens: int = 20_000_000  # random local tokens in train.bin
    tokens_per_iter: int = 2**17  # grad_accum_steps = this over a micro-batch's tokens, the same rule for both sides
    warmup: int = 3
    iters: int = 20
    decoding: tuple[str, ...] = ()  # our overrides for the decoding and serving model (the GPU preset's)
    new_tokens: int = 256
    repeats: int = 2
    clients: tuple[int, ...] = (1, 16)
    requests: int = 3
    reply_tokens: int = 128
    tests_timeout_s: float = 240

    def accumulation(self, batch: int) -> int:
        """The accumulation that makes up tokens_per_iter at this micro-batch (the same rule for both sides)."""
        return max(1, round(self.tokens_per_iter / (batch * self.gpt2_block)))


def flags(prefix: str, values: dict) -> tuple[str, ...]:
    """Overrides: ("--model.n_layer", "2") for {"n_layer": 2} and "--model."; nanoGPT's "--n_layer=2" for "--"."""
    if prefix == "--":
        return tuple(f"--{k}={v}" for k, v in values.items())
    return tuple(a for k, v in values.items() for a in (f"{prefix}{k}", str(v)))


TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}
TINY_STEPS = {"max_iters": 40, "eval_interval": 10, "eval_iters": 4, "log_interval": 5, "batch_size": 16}
TINY_SIZES = dict(target=3.4, arm_limit_s=120, gpt2_vocab=512, gpt2_block=64, gpt2_batch=4, gpt2_tokens=100_000)
TINY_SIZES |= dict(tokens_per_iter=512, warmup=1, iters=3, new_tokens=16, repeats=1, clients=(1, 2), requests=1)
TINY_SIZES |= dict(reply_tokens=8, tests_timeout_s=300)
TINY = Scale(
    shakespeare=flags("--model.", TINY_MODEL)
    + flags("--training.", {**TINY_STEPS, "final_eval_iters": 4})
    + flags("--optimizer.", {"warmup_iters": 5, "lr_decay_iters": 40}),
    nanogpt_shakespeare=flags("--", {**TINY_MODEL, **TINY_STEPS, "warmup_iters": 5, "lr_decay_iters": 40}),
    gpt2=flags("--model.", TINY_MODEL),
    nanogpt_gpt2=flags("--", TINY_MODEL),
    decoding=flags("--model.", {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 64}),
    **TINY_SIZES,
)


@dataclass
class Check:
    """One run of the check: its settings, and what each part found, as the JSON report holds them."""

    args: argparse.Namespace
    cli: list[str]  # the command line's --section.key value pairs (--data.input)
    scale: Scale
    started: float = field(default_factory=time.perf_counter)
    report: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device, self.on_cpu = self.args.device, self.args.device == "cpu"
        self.nanogpt = self.args.nanogpt and self.args.nanogpt.resolve()  # nanoGPT runs in a scratch directory

    def time_left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def peak_flops(self) -> float:
        """The dense bf16 peak MFU is counted against: the card's, or on a CPU its nominal one (metrics)."""
        if self.on_cpu:
            return default_peak_flops(torch.device("cpu"), "bf16")[0]
        return self.report["machine"]["bf16_peak_tflops"] * 1e12

    def nanogpt_device(self) -> list[str]:
        """nanoGPT on the CPU: fp32 (it autocasts on CUDA only), eager; on CUDA its defaults: bf16, compiled."""
        return ["--device=cpu", "--compile=False"] if self.on_cpu else [f"--device={self.device}"]

    def our_device(self) -> list[str]:  # ours on the device; on the CPU eager (a toy run does not repay a compile)
        return ["--run.device", self.device] + (["--training.compile", "false"] if self.on_cpu else [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("1", "2", "all"), default="all", help="which part to run (default %(default)s)")
    p.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout (github.com/karpathy/nanoGPT)")
    p.add_argument("--device", default="cuda", help="where it all runs (default %(default)s; cpu with --tiny)")
    p.add_argument("--tiny", action="store_true", help="toy shapes and a few iterations: the same code in seconds")
    p.add_argument("--out", type=Path, default=None, help="the JSON report (default bench_out/gpu_check_part<N>.json)")
    p.add_argument("--commit", default=None, help="the commit the report names (default: git's, where this is a clone)")
    budget = "seconds from the start a step must fit in by its estimated cost, else it is skipped and reported so "
    budget += "(default %(default)s: a part in ~8 minutes; raise it for --part all)"
    p.add_argument("--budget-s", type=float, default=450, help=budget)


def run(args: argparse.Namespace, cli: list[str]) -> None:
    check = Check(args, cli, TINY if args.tiny else Scale())
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


PARTS = {"1": ["tests", "gpt2_124m", "decoding", "serving"], "2": ["shakespeare", "levers"]}
PARTS["all"] = PARTS["1"] + PARTS["2"]
# a step's cost on an H100, by estimate: one that no longer fits in --budget-s is skipped (the tests and race stop
# themselves)
STEP_COST_S = {"tests": 0, "gpt2_124m": 200, "decoding": 50, "serving": 30, "shakespeare": 0, "levers": 0}
SUMMARY = "the GPU check: pytest -m cuda, 124M and tiny Shakespeare against nanoGPT, decoding and serving"
MODE = Mode("--gpu", SUMMARY, __doc__, add_arguments, run)


def machine_facts(device: str, commit: str | None) -> dict:
    """The device line of the report: the card, its dense bf16 peak, torch, CUDA, the commit and the date."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:  # the checkout's commit, where it is a clone with git installed (a copy sent to a GPU may be neither)
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        git = ""
    facts = {"date": date, "commit": commit or git.strip() or "unknown (no git clone here: --commit)"}
    facts |= {"torch": torch.__version__, "python": platform.python_version()}
    if not device.startswith("cuda"):
        cpu = platform.processor() or platform.machine()
        return {**facts, "line": f"{cpu} CPU, torch {torch.__version__}, commit {facts['commit']}"}
    props = torch.cuda.get_device_properties(torch.device(device))
    peak, memory, cuda = cuda_peak_flops(props.name) / 1e12, round(props.total_memory / 1e9, 1), torch.version.cuda
    facts.update(card=props.name, memory_gb=memory, capability=f"{props.major}.{props.minor}", cuda=cuda)
    line = f"{props.name} ({memory} GB, sm_{props.major}{props.minor}, dense bf16 peak {peak:.0f} TFLOP/s), torch "
    line += f"{torch.__version__}, CUDA {cuda}, commit {facts['commit']}, {date}"
    return {**facts, "bf16_peak_tflops": peak, "line": line}


def cuda_tests(check: Check) -> dict:
    """`pytest -m cuda` in a fresh process: the counts, the failures' names and the time."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    t0, timeout = time.perf_counter(), check.scale.tests_timeout_s
    # a session of its own: at the time limit the tests' own children (torchrun, serve.py) go with pytest
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)  # pytest's report; plugins warn on stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(stopped after {timeout:.0f} s)"
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    seconds, command = round(time.perf_counter() - t0, 1), "python -m pytest -m cuda tests/test_cuda.py"
    print(f"\na. pytest -m cuda: {summary} ({seconds:.0f} s)" + "".join(f"\n   failed: {name}" for name in failed))
    return {"command": command, "counts": counts, "failed": failed, "seconds": seconds, "summary": summary}


def shakespeare_race(check: Check) -> list[dict]:
    """nanoGPT's train_shakespeare_char, our gpu.toml and speedrun_gpu.toml, one after the other, each to the target;
    gpu.toml's dataset prepared first from the local copy, as train.py would (byte for byte nanoGPT's 90/10 split)."""
    s, results, arms = check.scale, [], []  # arms: (name, command, working directory, how it prints)
    data_input = Path(dict(parse_overrides(check.cli)).get("data.input") or SHAKESPEARE)  # ours, or our machines'
    if not data_input.is_file():
        raise UserError(f"tiny Shakespeare not found at {data_input}: give a local copy with --data.input")
    with tempfile.TemporaryDirectory(prefix="gpu_check_shakespeare_") as tmp:
        data = [("data.input", str(data_input)), ("data.data_dir", f"{tmp}/data")]
        dataset = find_dataset(build_config(load_toml(GPU_PRESET), data, source=str(GPU_PRESET)), DistInfo())
        if check.nanogpt:
            cmd = [sys.executable, str(check.nanogpt / "train.py"), "config/train_shakespeare_char.py"]
            cmd += [f"--out_dir={tmp}/nanogpt_out", *check.nanogpt_device(), *s.nanogpt_shakespeare]
            workdir = nanogpt_workdir(check.nanogpt, dataset, Path(tmp) / "nanogpt")
            arms.append(("nanoGPT, train_shakespeare_char.py", cmd, workdir, NANOGPT))
        ours = [*(a for k, v in data for a in (f"--{k}", v)), "--run.out_dir", f"{tmp}/runs", *check.our_device()]
        ours += ["--force", "--logging.plot", "false", "--training.save_interval", "0", *s.shakespeare]
        for config in (GPU_PRESET, SPEEDRUN_GPU):
            cmd = [sys.executable, "train.py", "--config", str(config), *ours]
            arms.append((f"ours, {config.name}", cmd, REPO, OURS))
        for arm, cmd, cwd, dialect in arms:
            timeline = follow(cmd, cwd, s.arm_limit_s, stop_at(dialect, s.target))
            results.append(race_result(arm, timeline, dialect, s.target))
            print(f"  {arm}: best val {results[-1].best_val}, wall {timeline.wall:.0f} s", flush=True)
    print_race(results, check)
    return [asdict(r) for r in results]


def print_race(results: list[RaceResult], check: Check) -> None:
    base = next((r for r in results if r.arm.startswith("nanoGPT") and r.reached_s), None)
    print(f"\nb. tiny Shakespeare to val {check.scale.target}, from launch (start-up and compiling count):")
    rows = [
        [r.arm, cell(r.reached_s, "{:.1f}", "not reached"), str(r.reached_iter or "—")]
        + [f"{r.reached_s / base.reached_s:.2f}" if base and r.reached_s else "—", cell(r.best_val, "{:.4f}")]
        + [cell(r.ms_per_iter, "{:.1f}"), f"{r.wall_s:.0f}"]
        for r in results
    ]
    print_table(["arm", "to target (s)", "at iter", "vs nanoGPT", "best val", "ms/iter", "wall (s)"], rows)
    for r in (r for r in results if r.error):
        print(f"  {r.arm} failed: {r.error[-600:]}")
    if not check.nanogpt:
        print("nanoGPT: not run (no --nanogpt DIR)")


def cell(value: float | None, spec: str, missing: str = "—") -> str:
    """A table cell: the value formatted, or `missing` where there is none."""
    return spec.format(value) if value else missing


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

    def rate(self, check: Check, tokens_per_s: float) -> None:
        self.tokens_per_s, self.mfu = tokens_per_s, tokens_per_s * flops_per_token(check) / check.peak_flops()


LEVERS = {"loss_chunks 8": ["--training.loss_chunks", "8"]}
LEVERS["compile_mode reduce-overhead (CUDA graphs)"] = ["--training.compile_mode", "reduce-overhead"]
LEVER_COST_S = 90  # a lever's run, start-up, probe and compile included (an estimate for an H100)
STEP_LIMIT_S = 240  # one timed 124M run, its compile included, is stopped after this


def gpt2_rows(check: Check, levers: bool = False) -> list[dict]:
    """Ours and nanoGPT's 124M step (part 1), or ours with each lever while the budget lasts (part 2)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_124m_") as tmp:
        data = trainer_runs.random_token_dataset(Path(tmp) / "tokens", check.scale.gpt2_vocab, check.scale.gpt2_tokens)
        for name, overrides in LEVERS.items() if levers else ():
            if check.on_cpu and "compile_mode" in name:
                continue  # CUDA graphs: nothing to measure on a CPU
            if check.time_left() < LEVER_COST_S:
                rows.append(StepRow(f"ours + {name}", error="skipped: the part's time budget is spent"))
            else:
                rows.append(our_step(check, data, f"ours + {name}", overrides))
        if not levers:
            rows.append(our_step(check, data, "ours, 124M.toml", []))
            if check.nanogpt:
                rows.append(nanogpt_step(check, data, Path(tmp)))
    print_steps(rows, check)
    return [asdict(r) for r in rows]


def fitted_batch(check: Check, side: str, chunks: int = 1) -> StepRow:
    """A row at the largest micro-batch of the ladder that the memory of two measured eager bf16 steps says fits."""
    s = check.scale
    if s.gpt2_batch is not None:
        batch, how = s.gpt2_batch, "fixed (--tiny)"
    else:
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "probe", side, str(s.gpt2_block), str(chunks)]
        cmd += [str(check.nanogpt or "")]
        m = json.loads(run_child(cmd, timeout=120)[1].strip().splitlines()[-1])
        fits = math.floor((MEMORY_SHARE * m["free"] - m["fixed"]) / m["per_row"])
        batch = max([b for b in BATCH_LADDER if b <= fits], default=1)
        how = f"{m['per_row'] / 1e9:.2f} GB a row + {m['fixed'] / 1e9:.1f} GB, {m['free'] / 1e9:.0f} GB free"
    return StepRow("", batch, s.accumulation(batch), fitted=how)


def our_step(check: Check, data: Path, arm: str, overrides: list[str]) -> StepRow:
    """bench.py's timed step on configs/gpt2/124M.toml; a smaller micro-batch tried if the first runs out of memory."""
    s, chunks = check.scale, int(dict(zip(overrides[::2], overrides[1::2])).get("--training.loss_chunks", 1))
    try:
        fitted = fitted_batch(check, "ours", chunks)
    except UserError as e:
        return StepRow(arm, error=str(e))
    for attempt in (fitted.micro_batch, *[b for b in BATCH_LADDER if b < fitted.micro_batch][-1:]):
        row = StepRow(arm, attempt, s.accumulation(attempt), fitted=fitted.fitted)
        cmd = [sys.executable, "bench.py", "--config", str(GPT2_PRESET), "--json", "--repeats", "1", "--warmup"]
        cmd += [str(s.warmup), "--iters", str(s.iters), "--data.processed_dir", str(data)]
        cmd += ["--training.batch_size", str(attempt), "--training.grad_accum_steps", str(row.grad_accum)]
        cmd += ["--model.vocab_size", str(s.gpt2_vocab), *check.our_device(), *s.gpt2, *overrides]  # nanoGPT's vocab
        try:
            timing = json.loads(run_child(cmd, timeout=STEP_LIMIT_S)[1].strip().splitlines()[-1])[0]
        except UserError as e:
            row.error = str(e)
            if "out of memory" not in row.error.lower():
                return row
            fitted.fitted += f"; {attempt} ran out of memory"
            continue
        row.rate(check, timing["tokens_per_s"])
        row.ms_per_iter, row.peak_memory_gb = timing["ms_median"], timing["peak_mb"] / 1e3
        return row
    return row


def nanogpt_step(check: Check, data: Path, tmp: Path) -> StepRow:
    """nanoGPT's train.py with config/train_gpt2.py's shape on the same local tokens: the median of its iterations
    after warm-up, each timed by the lines it prints after reading its loss back (log_interval 1)."""
    try:
        row = fitted_batch(check, "nanogpt")
    except UserError as e:
        return StepRow("nanoGPT, train_gpt2.py", error=str(e))
    row.arm, s, nanogpt = "nanoGPT, train_gpt2.py", check.scale, check.nanogpt
    workdir = nanogpt_workdir(nanogpt, load_dataset(data), tmp / "nanogpt", "openwebtext")
    cmd = [sys.executable, str(nanogpt / "train.py"), "config/train_gpt2.py", "--wandb_log=False", "--log_interval=1"]
    cmd += [f"--batch_size={row.micro_batch}", f"--gradient_accumulation_steps={row.grad_accum}"]
    cmd += [f"--max_iters={s.warmup + s.iters}", "--eval_interval=100000", "--eval_iters=1", f"--out_dir={tmp}/out"]
    timeline = follow([*cmd, *check.nanogpt_device(), *s.nanogpt_gpt2], workdir, limit_s=STEP_LIMIT_S)
    ms = trainer_runs.steady_ms_per_iter(timeline, NANOGPT, after=s.warmup)
    if ms is None or timeline.returncode != 0:
        row.error = f"exit {timeline.returncode}: {timeline.tail()}"
        return row
    row.ms_per_iter = ms
    row.rate(check, row.micro_batch * row.grad_accum * s.gpt2_block / (ms / 1e3))
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
    rows = [
        [r.arm, f"{r.micro_batch} x {r.grad_accum}" if r.micro_batch else "—"]
        + [cell(r.tokens_per_s, "{:,.0f}", r.error.splitlines()[-1][:80] if r.error else "—")]
        + [f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and r.tokens_per_s else "—", cell(r.mfu, "{:.1%}")]
        + [cell(r.ms_per_iter, "{:.0f}"), cell(r.peak_memory_gb, "{:.1f}"), r.fitted or "—"]
        for r in rows
    ]
    header = ["arm", "micro-batch x accum", "tokens/s", "vs nanoGPT", "MFU", "ms/iter", "peak GB", "micro-batch from"]
    print_table(header, rows)


def decoding(check: Check, compile_step: bool = False) -> dict:
    """sample.py's eager step (compile_step: its compiled step, the first run and kept) against transformers'."""
    s = check.scale
    try:
        c = vs_transformers.compare(str(GPU_PRESET), s.decoding, s.new_tokens, s.repeats, compile_step, check.device)
    except UserError as e:
        print(f"\nd. decoding: {e}")
        return {"error": str(e)}
    print("\nd. batch-1 greedy decoding, fresh processes:")
    vs_transformers.print_comparison(c)
    sides = [{**asdict(side), "tokens_per_s": c.new_tokens / side.generation} for side in c.sides]
    for side in sides:
        side["vs_transformers"] = c.theirs.generation / side["generation"]
    return {"new_tokens": c.new_tokens, "sides": sides, "same_text": c.same_text}


def serving(check: Check) -> dict:
    s, dtype = check.scale, "fp32" if check.on_cpu else "auto"
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_serve_") as tmp:
            ckpt = serving_load.bench_checkpoint(str(GPU_PRESET), s.decoding, Path(tmp))
            levels, _ = serving_load.measure(ckpt, s.clients, s.requests, s.reply_tokens, dtype, check.device)
    except (UserError, ImportError) as e:
        print(f"\nd. serving: {e}")
        return {"error": str(e)}
    print(
        f"\nd. serve.py --device {check.device} --dtype {dtype}, {s.requests} requests of {s.reply_tokens} tokens each:"
    )
    serving_load.print_levels(levels)
    return {"dtype": dtype, "levels": [asdict(level) for level in levels]}


def levers(check: Check) -> dict:
    """What is off until a GPU measures it, while the budget lasts: 124M with each lever, then sample.py --compile."""
    found = {"gpt2_124m": gpt2_rows(check, levers=True)}
    if check.on_cpu:
        found["decoding_compiled"] = {"error": "skipped: on a CPU, bench.py --vs-transformers --with-compile times it"}
    elif check.time_left() > LEVER_COST_S:
        found["decoding_compiled"] = decoding(check, compile_step=True)
    else:
        found["decoding_compiled"] = {"error": "skipped: the part's time budget is spent"}
        print("\nsample.py --compile: skipped (the part's time budget is spent)")
    return found


# what each step of a part runs: its entry in the report
STEPS = {"tests": cuda_tests, "gpt2_124m": gpt2_rows, "decoding": decoding, "serving": serving}
STEPS |= {"shakespeare": shakespeare_race, "levers": levers}


def probe(side: str, block: int, chunks: int, nanogpt: str) -> dict:
    """`python -m benchmarks.gpu_check probe ...` (fitted_batch): peak CUDA memory of eager bf16 steps of the 124M shape
    at 2 and 4 rows: the memory a row adds, the fixed rest (weights, gradients, optimizer state) and the free memory."""
    free, peaks = torch.cuda.mem_get_info()[0], {}
    shape = dict(block_size=block, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
    if side == "ours":
        from quillgpt.config import OptimizerConfig
        from quillgpt.optim import make_optimizers

        model = GPT(GPTConfig(**shape)).cuda()
        model.loss_chunks = chunks
        optimizer = make_optimizers(model, OptimizerConfig(), "cuda")[0]
    else:  # nanoGPT's model with its own optimizer (configure_optimizers: fused AdamW)
        spec = importlib.util.spec_from_file_location("nanogpt_model", Path(nanogpt) / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.GPT(module.GPTConfig(**shape)).cuda()
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
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


def main(argv: list[str]) -> None:
    if argv[:1] != ["probe"] or len(argv) != 5:
        raise UserError("usage: python -m benchmarks.gpu_check probe ours|nanogpt BLOCK CHUNKS NANOGPT_DIR")
    print(json.dumps(probe(argv[1], int(argv[2]), int(argv[3]), argv[4])))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
