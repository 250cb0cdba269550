"""--moe: a mixture of experts against the dense model at the same active FLOPs per token, on this machine.

    python bench.py --moe                                   # both parts, as docs/moe.md reports them
    python bench.py --moe --part dispatch                   # (a) one layer, MoE against the dense MLP
    python bench.py --moe --part train --seconds 240 --seeds 3   # (b) base.toml against base_moe.toml

(a) Dispatch overhead: forward+backward of one MoE layer against the dense MLP whose width is its active experts'
together (experts_per_token x expert width: the same FLOPs), on random tokens, for a few shapes; the MoE's time split
into routing (router, softmax, top-k, balancing losses), the experts' matmuls (on rows already sorted) and the rest,
the dispatch itself (sort, gather, weighting, scatter-add back); and the same layer with torch._grouped_mm in place
of the loop over experts, where this torch has a CPU kernel for it.
(b) MoE against dense: configs/base/base.toml and configs/base/base_moe.toml, each trained for the same wall time
(--seconds: each config's max_iters from its measured step time, the LR schedule fitted to them) with each seed, by
train.py in a child process; the final evaluation's val loss and bits per byte (over --eval-iters batches), and
tokens/s. Any --section.key value pair applies to both configs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import REPO, Bench, Mode, print_table, time_training, trainer_for
from benchmarks.conditions import load_average
from benchmarks.precision_curves import train_in_child
from model import MLP, GPTConfig, make_mlp
from quillgpt.config import load_config, parse_overrides
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
    p.add_argument(
        "--eval-iters", type=int, default=50, help="(b) batches per split in the final evaluation (default %(default)s)"
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=REPO / "bench_out" / "moe",
        help="(b) the runs' directories (default %(default)s)",
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    if args.part in ("all", "dispatch"):
        dispatch_overhead(args.repeats)
    if args.part in ("all", "train"):
        moe_against_dense(args, cli)
    print(load_average())


MODE = Mode(
    "--moe",
    "mixture of experts vs dense at equal active FLOPs: one layer's dispatch overhead; base_moe.toml vs base.toml",
    __doc__,
    add_arguments,
    run,
)


# ---- (a) one layer ------------------------------------------------------------------------------------------------


def dispatch_overhead(repeats: int) -> None:
    print(f"(a) one layer's forward+backward, median of {repeats} (ms), {torch.get_num_threads()} threads, fp32")
    header = ["layer", "dense MLP", "MoE", "MoE / dense", "routing", "experts' matmuls", "dispatch (the rest)"]
    print_table([*header, "MoE with torch._grouped_mm"], [layer_row(shape, repeats) for shape in SHAPES])


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
    if hasattr(torch, "_grouped_mm"):
        forwards["grouped"] = lambda: grouped(moe, x)
    ms = fwd_bwd_ms(forwards, repeats)
    return [
        f"{tokens} tokens, C {C}, {E} experts, top-{k} of width {H}",
        f"{ms['dense']:.2f} (width {k * H})",
        f"{ms['moe']:.2f}",
        f"{ms['moe'] / ms['dense']:.2f}x",
        f"{ms['routing']:.2f}",
        f"{ms['experts']:.2f}",
        f"{ms['moe'] - ms['routing'] - ms['experts']:.2f}",
        f"{ms.get('grouped', float('nan')):.2f}",
    ]


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


def grouped(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with torch._grouped_mm for the experts, as on CUDA (its backward is in the graph)."""
    moe.grouped_mm = True
    try:
        return moe(x)
    finally:
        moe.grouped_mm = None


def moe_parts(moe: MoE, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Forwards of the layer's routing (with its losses) and of its experts alone, on the rows as dispatch sorts
    them; x (N, C)."""
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


# ---- (b) training at equal wall time ------------------------------------------------------------------------------


def moe_against_dense(args: argparse.Namespace, cli: list[str]) -> None:
    configs = {"dense (base.toml)": DENSE_PRESET, "MoE (base_moe.toml)": MOE_PRESET}
    steps, precision = steps_in(args.seconds, configs, cli)
    cli = [*cli, "--training.precision", precision]  # what auto chose for the first, for every run: a fair race
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for seed in range(1, args.seeds + 1):  # seed by seed, the two configs in turn: the same moments of the machine
        for name, config in configs.items():
            run_dir = train_for(config, steps[name], seed, args, cli)
            results[name].append(final_figures(run_dir, steps[name]))
    print(
        f"(b) {args.seconds:g} s of training per run ({', '.join(f'{n}: {s} steps' for n, s in steps.items())}), "
        f"{precision}, seeds 1-{args.seeds}; val loss and bits per byte of the final evaluation ({args.eval_iters} "
        "batches)"
    )
    rows = [
        [name, str(seed), str(r["steps"]), f"{r['train_s']:.0f}", f"{r['tokens_per_s']:,.0f}", f"{r['val_loss']:.4f}"]
        + [f"{r['val_bpb']:.4f}"]
        for name, runs in results.items()
        for seed, r in enumerate(runs, 1)
    ]
    print_table(["model", "seed", "steps", "training s", "tokens/s", "val loss", "val bits/byte"], rows)
    print_table(
        ["model", "tokens/s", "val loss", "val bits/byte"],
        [
            [name, f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f}", spread(runs, "val_loss")]
            + [spread(runs, "val_bpb")]
            for name, runs in results.items()
        ],
    )
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
    overrides = {
        "run.seed": seed,
        "run.out_dir": args.out_dir,
        "run.name": name,
        "training.max_iters": steps,
        "optimizer.lr_decay_iters": steps,
        "optimizer.warmup_iters": warmup,
        "training.eval_interval": 0,
        "training.eval_iters": args.eval_iters,
        "training.log_interval": max(1, steps // 50),
        "training.save_interval": 0,
        "training.save_best": "false",
    }
    flags = [f"--{k}={v}" for k, v in overrides.items()]
    if train_in_child(["--config", str(config), "--force", *cli, *flags]):
        raise SystemExit(f"stopped by a signal during {name}")
    return args.out_dir / name


def final_figures(run_dir: Path, steps: int) -> dict:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    final = [p for p in history if p["kind"] == "eval"][-1]
    ms = statistics.median(p["ms_per_iter"] for p in history if p["kind"] == "train")
    return {
        "steps": steps,
        "train_s": steps * ms / 1e3,
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in history if p["kind"] == "train"),
        "val_loss": final["val_loss"],
        "val_bpb": final["val_bpb"],
    }


def spread(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"
