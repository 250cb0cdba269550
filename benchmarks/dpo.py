"""--dpo: the CPU demo of DPO (docs/chat.md). configs/chat/base_dpo.toml tunes the chat demo's model
(configs/chat/base_chat.toml's checkpoints/base-chat) on preference pairs made from the synthetic tasks' train items
(tasks.py --preference: the right answer chosen, a near miss rejected; --made-up: reverse and count on made-up words),
of --tasks (--tool: arithmetic and count through the calculator, as the chat model answers them), in its own train.py
process; then the model before and after is measured on held-out items, never trained on in any
phrasing:

- greedy accuracy per task, on eval.py --chat-task's items and grading (quillgpt.evaluate.run_chat_tasks);
- on held-out pairs (test-split items, each with a near miss): how often the model gives the chosen reply the higher
  log-prob (its preference accuracy) and the mean log-prob margin, log p(chosen) - log p(rejected), in nats.

Needs checkpoints/base-chat (or the config's run.init_from): the README's "From base model to chat" commands make it.
The run goes to a temporary directory unless --keep names one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO, Mode, print_table
from benchmarks.conditions import load_average
from model import GPT
from quillgpt.chat_template import chat_format
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.dpo import sequence_logps
from quillgpt.errors import UserError
from quillgpt.evaluate import run_chat_tasks
from quillgpt.files import atomic_write_json, atomic_write_text
from quillgpt.loading import load_model
from quillgpt.prepare.preference import encode_pair, pair_of
from quillgpt.tasks import TASKS, parse_tasks, preference_pairs
from quillgpt.tokenizer import Tokenizer, tokenizer_from_dict

DPO_PRESET = REPO / "configs" / "chat" / "base_dpo.toml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DPO_PRESET, help="the DPO config run (default %(default)s)")
    p.add_argument("--pairs", type=int, default=20_000, help="training pairs (default %(default)s)")
    p.add_argument(
        "--tasks",
        default="arithmetic,reverse,count",
        help="the tasks of the pairs, trained and held out (default %(default)s)",
    )
    p.add_argument(
        "--tool",
        action="store_true",
        help="arithmetic and count pairs through the calculator (tasks.py --preference --tool), as the chat model "
        "answers them: without it the pairs answer directly and teach the model to drop the calculator",
    )
    p.add_argument("--turns", type=int, default=1, help="at most this many turns in a pair's prompt (default 1)")
    p.add_argument(
        "--made-up",
        action="store_true",
        help="reverse and count pairs on made-up words (tasks.py --preference --made-up): new to the chat model",
    )
    p.add_argument("--chat-items", type=int, default=200, help="held-out items per task (default %(default)s)")
    p.add_argument("--held-out-pairs", type=int, default=600, help="held-out pairs (default %(default)s)")
    p.add_argument("--keep", type=Path, help="a directory for the pairs, the dataset and the run (default: temporary)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")


def pair_rows(tokenizer: Tokenizer, records: list[dict], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), (2N, block_size) each: the pairs' chosen rows then their rejected rows, targets outside the reply -1."""
    fmt = chat_format(tokenizer)
    sides: list[list] = [[], []]
    for record in records:
        chosen, chosen_mask, rejected, rejected_mask = encode_pair(fmt, pair_of(record, "held-out pair"))
        sides[0].append((chosen, chosen_mask))
        sides[1].append((rejected, rejected_mask))
    x = np.zeros((2 * len(records), block_size), dtype=np.int64)
    y = np.full((2 * len(records), block_size), -1, dtype=np.int64)
    for row, (ids, mask) in enumerate(sides[0] + sides[1]):
        ids, mask = np.array(ids[: block_size + 1]), np.array(mask[: block_size + 1])
        x[row, : len(ids) - 1] = ids[:-1]
        y[row, : len(ids) - 1] = np.where(mask[1:] == 1, ids[1:], -1)
    return torch.from_numpy(x), torch.from_numpy(y)


@torch.no_grad()
def pair_figures(model: GPT, tokenizer: Tokenizer, records: list[dict], batch: int = 64) -> dict[str, float]:
    """Preference accuracy (log p(chosen) > log p(rejected)) and the mean log-prob margin on the pairs."""
    x, y = pair_rows(tokenizer, records, model.config.block_size)
    logps = torch.cat([sequence_logps(model, x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)])
    chosen, rejected = logps.chunk(2)
    return {"preference_acc": (chosen > rejected).float().mean().item(), "margin": (chosen - rejected).mean().item()}


def measure(source: str, held_out: list[dict], items: int) -> dict:
    loaded = load_model(source)
    model, tokenizer = loaded.model.eval(), tokenizer_from_dict(loaded.tokenizer)
    tasks = run_chat_tasks(model, tokenizer, list(TASKS), items)["tasks"]
    return {
        "source": loaded.source,
        **pair_figures(model, tokenizer, held_out),
        "tasks": {name: {k: t[k] for k in ("items", "correct", "acc")} for name, t in tasks.items()},
    }


def train_dpo(config: Path, work: Path, args: argparse.Namespace, cli: list[str]) -> tuple[str, float]:
    """Write the pairs and run train.py on them in its own process; (its run directory, seconds)."""
    source = work / "prefs.jsonl"
    records = preference_pairs(parse_tasks(args.tasks), "train", args.pairs, 1, args.turns, args.made_up, args.tool)
    atomic_write_text(source, "".join(json.dumps(r) + "\n" for r in records))
    args = [sys.executable, "train.py", "--config", str(config), "--data.input", str(source)]
    args += ["--data.data_dir", str(work / "data"), "--run.out_dir", str(work / "runs"), "--run.name", "dpo", *cli]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    lines = proc.stdout.splitlines()
    if proc.returncode:
        raise UserError(f"train.py exited {proc.returncode}: {lines[-1] if lines else 'no output'}")
    print("\n".join(line for line in lines if line.startswith(("dpo:", "eval ", "finished"))), flush=True)
    return str(work / "runs" / "dpo"), seconds


def run(args: argparse.Namespace, cli: list[str]) -> None:
    config = args.config.resolve()
    cfg = build_config(load_toml(config), parse_overrides(cli), source=str(config))
    start = cfg.run.init_from
    if not (REPO / start).exists() and not Path(start).exists():
        raise UserError(
            f"{start} is missing: make the chat demo's model first (README, 'From base model to chat'), or pass "
            "--run.init_from"
        )
    held_out = preference_pairs(parse_tasks(args.tasks), "test", args.held_out_pairs, 0, tool=args.tool)
    before = measure(start, held_out, args.chat_items)
    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run_dir, seconds = train_dpo(config, work, args, cli)
        after = measure(run_dir, held_out, args.chat_items)
    words = ("; on made-up words" if args.made_up else "") + ("; through the calculator" if args.tool else "")
    print(
        f"DPO: {config.relative_to(REPO)} from {start}, {args.pairs:,} pairs of {args.tasks}{words}; "
        f"train.py took {seconds:.0f}s"
    )
    rows = [
        ["held-out pairs: chosen preferred", f"{before['preference_acc']:.1%}", f"{after['preference_acc']:.1%}"],
        ["held-out pairs: log-prob margin (nats)", f"{before['margin']:+.3f}", f"{after['margin']:+.3f}"],
    ]
    for name in TASKS:
        b, a = before["tasks"][name], after["tasks"][name]
        rows.append(
            [
                f"{name}, greedy",
                f"{b['correct']}/{b['items']} ({b['acc']:.0%})",
                f"{a['correct']}/{a['items']} ({a['acc']:.0%})",
            ]
        )
    print_table(["held out", "before (chat model)", "after DPO"], rows)
    print(load_average())
    if args.json:
        atomic_write_json(args.json, {"config": str(config), "seconds": seconds, "before": before, "after": after})


MODE = Mode(
    "--dpo",
    "the DPO demo: base-chat tuned on task pairs, held-out accuracy and chosen/rejected margin before and after",
    __doc__,
    add_arguments,
    run,
)
