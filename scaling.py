"""A scaling law on this machine: IsoFLOP curves (Chinchilla's approach 2, as nanochat's runs/scaling_laws.sh).

    python scaling.py                                    # the offline corpus, depths 2-5, three FLOP budgets
    python scaling.py --depths 2 3 4 5 6 --flops 1e12 3e12 1e13 --out bench_out/scaling
    python scaling.py --config configs/shakespeare_char/speedrun_cpu.toml --data.input path/to/input.txt

Each point is its own train.py process: the size dial at one depth (model.depth), trained to one FLOP budget
(training.target_flops, so the horizon is the budget's) with the warmdown ending there (optimizer.schedule wsd),
then scored on the validation split in bits per byte. For each budget the bits per byte of the depths are fitted by a
parabola in log(parameters), whose lowest point is the compute-optimal size N* there; D* is the tokens such a model
reads within the budget. The optima are fitted by power laws in the budget C: val bpb = a C^-b, N* = k C^e, and the
tokens per parameter D*/N* they give is this corpus's compute-optimal ratio (nanochat's --target-param-data-ratio).
The figure (--png) shows the IsoFLOP curves and the frontier with its fit; --json keeps the numbers.

Parameters are the scaling parameters nanochat counts (the blocks' matrices and the head); FLOPs are the training
FLOPs per token MFU counts (6N and attention). Run it on an idle machine: it takes about as long as the budgets' FLOPs
take at this machine's rate, depths x the sum of --flops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from quillgpt.checkpoint import load_checkpoint
from quillgpt.config import GPTConfig
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write_json
from quillgpt.metrics import save_png
from quillgpt.run_model import scaling_params

REPO = Path(__file__).resolve().parent


def run_point(config: str, depth: int, flops: float, extra: list[str], out_dir: str) -> dict:
    """One train.py run: the depth at the FLOP budget; its final val bits per byte, parameters and tokens."""
    name = f"d{depth}-{flops:.0e}"
    cmd = [sys.executable, "train.py", "--config", config, "--run.out_dir", out_dir, "--run.name", name, "--force"]
    cmd += ["--model.depth", str(depth), "--training.target_flops", str(flops), "--optimizer.schedule", "wsd"]
    cmd += ["--training.eval_interval", "0", "--training.save_interval", "0", "--training.save_best", "false"]
    cmd += ["--logging.plot", "false", "--training.keep_decoding_step", "false", *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        raise UserError(
            f"train.py at depth {depth}, {flops:.1e} FLOPs failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    history = json.loads((Path(out_dir) / name / "train_log.json").read_text())["history"]
    final = [r for r in history if r["kind"] == "eval"][-1]
    ckpt = load_checkpoint(Path(out_dir) / name / "ckpt_last.pt")
    params, per_token = scaling_params(GPTConfig.from_dict(ckpt["model_args"]))
    point = {
        "depth": depth,
        "flops": flops,
        "params": params,
        "tokens": ckpt["tokens_seen"],
        "flops_run": per_token * ckpt["tokens_seen"],
        "val_bpb": final["val_bpb"],
        "seconds": time.perf_counter() - started,
    }
    print(
        f"  d{depth} at {flops:.1e} FLOPs: {params:,} params, {point['tokens']:,} tokens "
        f"({point['tokens'] / params:.1f} a param), val {final['val_bpb']:.4f} bits/byte, {point['seconds']:.0f}s",
        flush=True,
    )
    return point


def fit(points: list[dict]) -> dict:
    """Each budget's optimum (a parabola in log N through its depths' val bpb), then the power laws through them."""
    optima = []
    for flops in sorted({p["flops"] for p in points}):
        row = sorted((p for p in points if p["flops"] == flops), key=lambda p: p["params"])
        x = np.log([p["params"] for p in row])
        y = np.array([p["val_bpb"] for p in row])
        a, b, c = np.polyfit(x, y, 2)
        best = int(np.argmin(y))
        # the vertex where the curve bends up and lies within the depths run; else the best depth (an edge)
        inside = a > 0 and x[0] <= -b / (2 * a) <= x[-1]
        log_n = -b / (2 * a) if inside else x[best]
        loss = float(np.polyval([a, b, c], log_n)) if inside else float(y[best])
        log_d = np.interp(log_n, x, np.log([p["tokens"] for p in row]))
        optima.append(
            {
                "flops": flops,
                "params": math.exp(log_n),
                "tokens": math.exp(log_d),
                "val_bpb": loss,
                "interior": bool(inside),
            }
        )
    c = np.log([o["flops"] for o in optima])
    out = {"optima": optima}
    if len(optima) >= 2:
        slope, intercept = np.polyfit(c, np.log([o["val_bpb"] for o in optima]), 1)
        out["loss_law"] = {"a": math.exp(intercept), "b": -slope}  # val bpb = a C^-b
        slope, intercept = np.polyfit(c, np.log([o["params"] for o in optima]), 1)
        out["params_law"] = {"k": math.exp(intercept), "e": slope}  # N* = k C^e
    out["ratios"] = [o["tokens"] / o["params"] for o in optima]
    return out


def draw(points: list[dict], fitted: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for flops in sorted({p["flops"] for p in points}):
        row = sorted((p for p in points if p["flops"] == flops), key=lambda p: p["params"])
        left.plot([p["params"] for p in row], [p["val_bpb"] for p in row], "o-", label=f"{flops:.2g} FLOPs")
        for p in row:
            left.annotate(
                f"d{p['depth']}", (p["params"], p["val_bpb"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    for o in fitted["optima"]:
        left.plot(o["params"], o["val_bpb"], "k*", markersize=10)
    left.set(xscale="log", xlabel="scaling parameters", ylabel="val bits per byte", title="IsoFLOP curves (* optimum)")
    left.legend(fontsize=8)
    right.scatter([p["flops_run"] for p in points], [p["val_bpb"] for p in points], c="grey", s=12, label="runs")
    c = np.array([o["flops"] for o in fitted["optima"]])
    right.plot(c, [o["val_bpb"] for o in fitted["optima"]], "k*", markersize=10, label="optima")
    if "loss_law" in fitted:
        law = fitted["loss_law"]
        grid = np.geomspace(c.min() / 2, c.max() * 2, 50)
        right.plot(grid, law["a"] * grid ** -law["b"], "r-", label=f"{law['a']:.3g} C^-{law['b']:.3f}")
    right.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="val bits per byte", title="frontier")
    right.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/base/base.toml", help="the run's preset (default: the offline corpus)")
    # extend: `--depths 2 3` and `--depths 2 --depths 3` alike; the defaults are filled in after parsing, as extend would
    # add to a default list rather than replace it
    p.add_argument(
        "--depths", nargs="+", action="extend", type=int, help="model.depth of each point (default: 2 3 4 5)"
    )
    p.add_argument("--flops", nargs="+", action="extend", type=float, help="the FLOP budgets (default: 1e12 3e12 9e12)")
    p.add_argument("--png", default="bench_out/scaling/scaling_law.png", help="the figure")
    p.add_argument("--json", default="bench_out/scaling/scaling_law.json", help="the points and the fit")
    args, extra = p.parse_known_args(argv)
    args.depths = args.depths or [2, 3, 4, 5]
    args.flops = args.flops or [1e12, 3e12, 9e12]
    if len(args.depths) < 3:
        raise UserError("--depths: at least 3, for a parabola through each budget's points")
    points = []
    with tempfile.TemporaryDirectory(prefix="scaling_") as out_dir:
        for flops in args.flops:
            for depth in args.depths:
                points.append(run_point(args.config, depth, flops, extra, out_dir))
    fitted = fit(points)
    for o, ratio in zip(fitted["optima"], fitted["ratios"]):
        where = "" if o["interior"] else " (at the edge of the depths run: widen --depths)"
        print(
            f"{o['flops']:.1e} FLOPs: optimum {o['params']:,.0f} params, {o['tokens']:,.0f} tokens, {ratio:.1f} tokens "
            f"a param, val {o['val_bpb']:.4f} bits/byte{where}"
        )
    if "loss_law" in fitted:
        law, n = fitted["loss_law"], fitted["params_law"]
        print(f"fit: val bpb = {law['a']:.4g} C^-{law['b']:.4f}; N* = {n['k']:.4g} C^{n['e']:.3f}")
    title = f"{args.config} {' '.join(extra)}: depths {args.depths}"
    draw(points, fitted, Path(args.png), title)
    atomic_write_json(args.json, {"points": points, **fitted})
    print(f"wrote {args.png} and {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
