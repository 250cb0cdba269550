"""Write synthetic chat tasks as conversations: questions with checkable answers (quillgpt/tasks.py), the data of the
CPU chat demo (docs/chat.md).

    python tasks.py --out data/chat_tasks.jsonl                        # 20,000 training conversations
    python tasks.py --out data/chat_test.jsonl --split test --n 300    # held-out items
    python tasks.py --out data/sums.jsonl --tasks arithmetic --turns 2 --seed 1
    python tasks.py --out data/chat_prefs.jsonl --preference --seed 1   # DPO pairs: the answer chosen, a near miss rejected
    python tasks.py --out data/chat_tasks.jsonl --turns 3 --tool       # sums and letter counts through the calculator
    python tasks.py --out data/chat_prefs.jsonl --preference --made-up --tool  # on made-up words, through the tool

Each line is {"messages": [...]}, the form prepare.py --chat reads; with --preference {"prompt": [...], "chosen":
[...], "rejected": [...]}, TRL's conversational preference form that prepare.py --preference reads. Held-out items (--split test) are never in the
train split in any phrasing; eval.py --chat-task grades a model on them.
"""

from __future__ import annotations

import argparse
import json
import sys

from quillgpt.errors import run_main
from quillgpt.files import atomic_write
from quillgpt.tasks import SPLITS, TASKS, conversations, parse_tasks, preference_pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the jsonl file to write")
    p.add_argument("--n", type=int, default=20_000, help="conversations (default 20,000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="train",
        help="train, val (what runs evaluate on in training) or test (eval.py's held-out items); disjoint",
    )
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated (default {','.join(TASKS)})")
    p.add_argument("--turns", type=int, default=1, help="at most this many question-answer turns a conversation")
    p.add_argument(
        "--preference",
        action="store_true",
        help="write preference pairs for DPO: the last question's answer chosen, a near miss rejected",
    )
    p.add_argument(
        "--made-up",
        action="store_true",
        help="reverse and count on made-up words (never a held-out word): questions the tasks' words do not hold",
    )
    p.add_argument(
        "--tool",
        action="store_true",
        help="answer arithmetic and count with the calculator tool: the reply calls it (17+25, "
        "'night'.count('g')), then gives its output (docs/chat.md)",
    )
    args = p.parse_args(argv)
    if args.n < 1 or args.turns < 1:
        p.error("--n and --turns must be at least 1")
    if args.made_up and args.split != "train":
        p.error("--made-up writes training questions: the val and test splits are the tasks' own words")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = parse_tasks(args.tasks)
    if args.preference:
        pairs = preference_pairs(tasks, args.split, args.n, args.seed, args.turns, args.made_up, args.tool)
        rows, kind = pairs, "preference pairs"
    else:
        conversed = conversations(tasks, args.split, args.n, args.seed, args.turns, args.tool, args.made_up)
        rows, kind = [{"messages": m} for m in conversed], "conversations"
    with atomic_write(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    called = [t for t in tasks if TASKS[t].call]
    form = f"; {' and '.join(called)} with the calculator" if args.tool and called else ""
    form += "; reverse and count on made-up words" if args.made_up else ""
    print(f"wrote {len(rows):,} {kind} ({', '.join(tasks)}; {args.split} split{form}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
