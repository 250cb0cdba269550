"""The CPU chat demo end to end, timed: the calculator tool (issue 38 §4) and RL with verifiable rewards (§1).

    python -m benchmarks.chat_demo --out bench_out/chat_demo.json [--skip-base]   # --skip-base: checkpoints/base is

Each stage a fresh process of the scripts a user runs, timed from launch to exit: the Quickstart's base model,
tasks.py (the two configs' datasets from an earlier file removed), SFT, eval.py of the chat model, RL (whose wall time
is the figure the target is for, <= 10 minutes), eval.py of RL's best checkpoint (picked on the tasks' validation
items, never a test item) and of its last. The report (--out) holds each stage's seconds and the accuracies; the RL
run's loss_curve.png is copied beside it as rl_curve.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.conditions import load_average
from quillgpt.config import load_config
from quillgpt.errors import UserError, run_main
from quillgpt.files import atomic_write, atomic_write_json

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS = "arithmetic,reverse,count"
SFT, RL = "configs/chat/base_chat.toml", "configs/chat/base_chat_rl.toml"


def timed(*args: str) -> float:
    """Run a script of the repository to its end; its wall seconds. A failure is one line naming the command."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise UserError(f"`python {' '.join(args)}` failed (exit {proc.returncode})")
    return time.perf_counter() - t0


def accuracies(ckpt: str, report: Path, items: int) -> tuple[dict[str, float], float]:
    seconds = timed("eval.py", "--ckpt", ckpt, "--chat-task", TASKS, "--chat-items", str(items), "--json", str(report))
    tasks = json.loads(report.read_text())["chat_tasks"]["tasks"]
    return {name: r["acc"] for name, r in tasks.items()}, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON report; rl_curve.png goes beside it")
    p.add_argument("--skip-base", action="store_true", help="checkpoints/base exists: don't train it again")
    p.add_argument("--items", type=int, default=200, help="held-out items per task in each evaluation")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    load_before = load_average()
    if not args.skip_base:
        seconds["base"] = timed("train.py", "--config", "configs/base/base.toml", "--force")
    seconds["tasks"] = timed("tasks.py", "--out", "data/chat_tasks.jsonl", "--turns", "3", "--tool")
    for config in (SFT, RL):
        data = load_config(str(REPO_ROOT / config), []).data
        shutil.rmtree(REPO_ROOT / data.data_dir / data.dataset, ignore_errors=True)
    seconds["sft"] = timed("train.py", "--config", SFT, "--force")
    before, seconds["eval_chat"] = accuracies("checkpoints/base-chat", out.with_suffix(".chat.json"), args.items)
    seconds["rl"] = timed("train.py", "--config", RL, "--force")
    best = "checkpoints/base-chat-rl/ckpt_best.pt"
    after, seconds["eval_rl"] = accuracies(best, out.with_suffix(".rl.json"), args.items)
    last, _ = accuracies("checkpoints/base-chat-rl/ckpt_last.pt", out.with_suffix(".rl_last.json"), args.items)
    with atomic_write(out.with_name("rl_curve.png")) as f:
        f.write((REPO_ROOT / "checkpoints" / "base-chat-rl" / "loss_curve.png").read_bytes())
    load = [load_before, load_average()]
    report = {"seconds": seconds, "chat_model": before, "rl_model": after, "rl_last": last, "load": load}
    atomic_write_json(out, report)
    print("| task | chat model (SFT, with the tool) | after RL (best on val) | after RL (last) |")
    print("| --- | ---: | ---: | ---: |")
    for task in before:
        print(f"| {task} | {before[task]:.1%} | {after[task]:.1%} | {last[task]:.1%} |")
    print(f"stages (s): {json.dumps({k: round(v, 1) for k, v in seconds.items()})}; report {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
