"""--moe: a mixture of experts against the dense model at the same active FLOPs per token, on this machine (--part
dispatch|train; both by default, as docs/benchmarks.md reports them). (a) dispatch: one MoE layer's forward+backward against
the dense MLP as wide as its active experts together, a few shapes, the MoE's time split into routing, the experts'
matmuls and the dispatch (sort, gather, weighting, scatter-add), and the layer on torch._grouped_mm where this torch
has a CPU kernel for it. (b) train: base.toml against base_moe.toml, each trained by train.py for the same wall time
(--seconds: each config's max_iters from its measured step time, the LR schedule fitted to them) with each seed; the
final evaluation's val loss and bits per byte, and tokens/s. Any --section.key value pair applies to both configs.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import REPO, Bench, Mode, print_table, time_training, trainer_for
from benchmarks.conditions import load_average
from model import MLP, GPTConfig, make_mlp
from quillgpt.config import load_config, parse_overrides
from quillgpt.errors import UserError
from quillgpt.moe import MoE

DENSE_PRESET = REPO / "configs" / "base" / "base.toml"
MOE_PRESET = REPO / "configs" / "base" / "base_moe.toml"
# (tokens, n_embd, n_experts, experts_per_token, expert width): the preset's layer (a step's 16 x 128 tokens), top-1
# of fewer wider experts, more smaller ones, and the GPU preset's width
SHAPES = [(2048, 128, 8, 2, 256), (2048, 128, 4, 1, 512), (2048, 128, 16, 4, 128), (2048, 384, 8, 2, 768)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("all", "dispatch", "train"), default="all", help="(default %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="(a) timed forward+backward passes (default %(default)s)")
    p.add_argument("--seconds", type=float, default=240, help="(b) training wall time per run (default %(default)s)")
    p.add_argument("--seeds", type=int, default=3, help="(b) runs of each config, seeds 1.. (default %(default)s)")
    p.add_argument("--eval-iters", type=int, default=50, help="(b) final evaluation's batches (default %(default)s)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench_out" / "moe", help="(b) the runs' directories")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    if args.part in ("all", "dispatch"):
        print(
            f"(a) one layer's forward+backward, median of {args.repeats} (ms), {torch.get_num_threads()} threads, fp32"
        )
        header = ["layer", "dense MLP", "MoE", "MoE / dense", "routing", "experts' matmuls", "dispatch (the rest)"]
        print_table([*header, "MoE with torch._grouped_mm"], [layer_row(shape, args.repeats) for shape in SHAPES])
    if args.part in ("all", "train"):
        moe_against_dense(args, cli)
    print(load_average())


SUMMARY = "mixture of experts vs dense at equal active FLOPs: one layer's dispatch overhead; base_moe.toml vs base.toml"
MODE = Mode("--moe", SUMMARY, __doc__, add_arguments, run)


def layer_row(shape: tuple[int, int, int, int, int], repeats: int) -> list[str]:
    """One shape's row: the dense MLP of the active width, the MoE layer and its parts, the MoE on grouped_mm; timed
    in turns, so that a shared machine's load falls on each alike."""
    tokens, C, E, k, H = shape
    torch.manual_seed(0)
    common = dict(n_embd=C, mlp="gelu", bias=False, dropout=0.0)
    dense = MLP(GPTConfig(**common), hidden=k * H)
    moe = make_mlp(GPTConfig(**common, n_experts=E, experts_per_token=k, expert_hidden=H), 0)
    x = torch.randn(1, tokens, C, requires_grad=True)
    forwards = {"dense": lambda: dense(x), "moe": lambda: moe(x), **moe_parts(moe, x.detach().view(tokens, C))}
    if hasattr(torch, "_grouped_mm"):  # the same layer, its weights shared, on torch._grouped_mm as on CUDA
        on_grouped_mm = copy.copy(moe)
        on_grouped_mm.grouped_mm = True
        forwards["grouped"] = lambda: on_grouped_mm(x)
    ms = fwd_bwd_ms(forwards, repeats)
    name = f"{tokens} tokens, C {C}, {E} experts, top-{k} of width {H}"
    head = [name, f"{ms['dense']:.2f} (width {k * H})", f"{ms['moe']:.2f}", f"{ms['moe'] / ms['dense']:.2f}x"]
    parts = [ms["routing"], ms["experts"], ms["moe"] - ms["routing"] - ms["experts"], ms.get("grouped", float("nan"))]
    return head + [f"{v:.2f}" for v in parts]


def fwd_bwd_ms(forwards: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """The median milliseconds of each forward() and its backward (a fixed random gradient), each timed once per
    round, in turns, after a warm-up round."""
    grads = {name: torch.randn_like(forward()) for name, forward in forwards.items()}
    times: dict[str, list[float]] = {name: [] for name in forwards}
    for round in range(repeats + 1):
        for name, forward in forwards.items():
            t0 = time.perf_counter()
            torch.autograd.backward(forward(), grads[name])
            if round:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def moe_parts(moe: MoE, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Forwards of the layer's routing (with its losses) and of its experts alone, on x (N, C) sorted as dispatch is."""
    x = x.requires_grad_()

    def routing() -> torch.Tensor:
        r = moe.route(x)
        moe.keep_balance(r, torch.ones(moe.n_experts))
        return r.weights.sum(-1) + moe.router_loss

    with torch.no_grad():
        experts = moe.route(x).experts.reshape(-1)
        order = torch.argsort(experts, stable=True)
        ends = torch.searchsorted(experts[order], torch.arange(moe.n_experts), right=True)
        rows = x[order // moe.k].clone()
    rows.requires_grad_()
    return {"routing": routing, "experts": lambda: moe.run_experts(rows, ends, x.dtype)}


def moe_against_dense(args: argparse.Namespace, cli: list[str]) -> None:
    configs = {"dense (base.toml)": DENSE_PRESET, "MoE (base_moe.toml)": MOE_PRESET}
    steps, precision = steps_in(args.seconds, configs, cli)
    cli = [*cli, "--training.precision", precision]  # what auto chose for the first, for every run: a fair race
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for seed in range(1, args.seeds + 1):  # seed by seed, the two configs in turn: the same moments of the machine
        for name, config in configs.items():
            run_dir = train_for(config, steps[name], seed, args, cli)
            results[name].append(final_figures(run_dir, steps[name]))
    steps_line = ", ".join(f"{n}: {s} steps" for n, s in steps.items())
    print(f"(b) {args.seconds:g} s of training a run ({steps_line}), {precision}, seeds 1-{args.seeds}; the final")
    print(f"evaluation's val loss and bits per byte ({args.eval_iters} batches)")
    cells = "{steps}|{train_s:.0f}|{tokens_per_s:,.0f}|{val_loss:.4f}|{val_bpb:.4f}"
    runs = [(name, seed, r) for name, runs in results.items() for seed, r in enumerate(runs, 1)]
    rows = [[name, str(seed), *cells.format(**r).split("|")] for name, seed, r in runs]
    print_table(["model", "seed", "steps", "training s", "tokens/s", "val loss", "val bits/byte"], rows)
    median = lambda runs: f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f}"
    rows = [[name, median(runs), spread(runs, "val_loss"), spread(runs, "val_bpb")] for name, runs in results.items()]
    print_table(["model", "tokens/s", "val loss", "val bits/byte"], rows)
    print(f"the MoE runs' router balance: {args.out_dir}/moe-seed*/router_balance.png")


def steps_in(seconds: float, configs: dict[str, Path], cli: list[str]) -> tuple[dict[str, int], str]:
    """How many optimizer steps each config takes in `seconds` here (a few steps of each timed in turn), and the
    precision they all run in: the first config's (training.precision auto is resolved once, not per run)."""
    overrides, benches = parse_overrides(cli), {}
    for name, config in configs.items():
        benches[name] = Bench(trainer_for(str(config), overrides))
        overrides = [*overrides, ("training.precision", benches[name].tr.rt.precision)]
    timings, _ = time_training(benches, warmup=3, iters=10, repeats=2)
    for t in timings:
        print(f"calibration: {t.name} {t.ms_median:.1f} ms per step ({t.tokens_per_s:,.0f} tokens/s)")
    return {t.name: max(1, int(seconds * 1e3 / t.ms_median)) for t in timings}, overrides[-1][1]


def train_for(config: Path, steps: int, seed: int, args: argparse.Namespace, cli: list[str]) -> Path:
    """train.py on the config for `steps` steps (its LR schedule over them), evaluated once at the end."""
    name = f"{'moe' if config == MOE_PRESET else 'dense'}-seed{seed}"
    warmup = min(load_config(config).optimizer.warmup_iters, steps // 10)
    flags = [f"--run.seed={seed}", f"--run.out_dir={args.out_dir}", f"--run.name={name}", "--training.eval_interval=0"]
    flags += [f"--training.max_iters={steps}", f"--optimizer.lr_decay_iters={steps}", "--training.save_best=false"]
    flags += [f"--optimizer.warmup_iters={warmup}", f"--training.eval_iters={args.eval_iters}"]
    flags += [f"--training.log_interval={max(1, steps // 50)}", "--training.save_interval=0"]
    if train_in_child(["--config", str(config), "--force", *cli, *flags]):
        raise SystemExit(f"stopped by a signal during {name}")
    return args.out_dir / name


def train_in_child(args: list[str]) -> bool:
    """python train.py ARGS, printing to our stdout; SIGINT or SIGTERM sent to us is passed on once (train.py then
    saves and stops). Returns whether that happened; a failed run is a UserError."""
    sys.stdout.flush()
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, start_new_session=True)  # Ctrl-C: ours only
    received = []

    def forward(signum, frame):
        received.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code and not received:
        raise UserError(f"train.py {' '.join(args)} failed with exit code {code}")
    return bool(received)


def final_figures(run_dir: Path, steps: int) -> dict:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    final = [p for p in history if p["kind"] == "eval"][-1]
    ms = statistics.median(p["ms_per_iter"] for p in history if p["kind"] == "train")
    tokens_per_s = statistics.median(p["tokens_per_s"] for p in history if p["kind"] == "train")
    figures = {"steps": steps, "train_s": steps * ms / 1e3, "tokens_per_s": tokens_per_s}
    return {**figures, "val_loss": final["val_loss"], "val_bpb": final["val_bpb"]}


def spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"
