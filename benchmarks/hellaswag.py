"""--hellaswag: seconds per 1,000 HellaSwag items (scoring.score_hellaswag: 4 endings per forward pass, 4 items at
once) for the config's model (default: the GPU preset's char model, random weights), with a matmul ceiling beside it.

Items come from --hellaswag-file, or are made in HellaSwag's format from tiny Shakespeare: a 200-character context
and four 120-character endings, near the real set's lengths in characters.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks.common import GPU_PRESET, Mode, add_config
from benchmarks.conditions import SHAKESPEARE, load_average
from model import GPT, GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.machine import keep_freed_memory
from quillgpt.metrics import matmul_flops
from quillgpt.precision import PRECISIONS
from quillgpt.precision import autocast as precision_autocast
from quillgpt.scoring import HellaSwagItem, hellaswag_items, score_hellaswag
from quillgpt.tokenizer import Tokenizer, train_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--items", type=int, default=1000, help="items scored (default %(default)s)")
    p.add_argument("--hellaswag-file", help="HellaSwag's jsonl (default: items made from tiny Shakespeare)")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    cfg = build_config(load_toml(args.config), parse_overrides(cli), source=args.config)
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else "".join(chr(32 + i % 90) for i in range(200_000))
    tokenizer = train_tokenizer("char", [text], None)
    if args.hellaswag_file:
        items, _ = hellaswag_items(args.hellaswag_file, tokenizer, args.items, allow_unknown=True)
    else:
        items = items_from_text(text, args.items)
    margs = GPTConfig.from_dict({**cfg.model_args(), "vocab_size": tokenizer.vocab_size, "dropout": 0.0})
    torch.manual_seed(0)
    model = GPT(margs).eval()  # random weights: the speed does not depend on them
    keep_freed_memory()  # as eval.py on the CPU
    precision = "fp32" if cfg.training.precision == "auto" else cfg.training.precision
    autocast = precision_autocast("cpu", precision)
    score_hellaswag(model, tokenizer, items[:4], autocast)  # warm-up
    t0 = time.perf_counter()
    score = score_hellaswag(model, tokenizer, items, autocast, progress=True)
    seconds = time.perf_counter() - t0
    tokens = scored_tokens(items, score.tokens, tokenizer, margs.block_size)
    flops = matmul_flops(margs.n_embd, 4 * tokens // len(items), PRECISIONS[precision], torch.device("cpu"))
    print(
        f"HellaSwag scoring: {model.num_params() / 1e6:.2f}M parameters, block {margs.block_size}, {precision}, "
        f"{torch.get_num_threads()} threads, {score.items:,} items ({tokens / score.items / 4:.0f} tokens a row)"
    )
    print(
        f"{seconds / score.items * 1000:.1f} s per 1,000 items ({tokens / seconds:,.0f} tokens/s forward); matmul "
        f"ceiling here {flops / 1e9:,.0f} GFLOP/s -> at most {flops / (model.flops_per_token() / 3):,.0f} tokens/s "
        "forward"
    )
    print(load_average())


MODE = Mode(
    "--hellaswag",
    "seconds per 1,000 HellaSwag items (the GPU preset's model, random weights)",
    __doc__,
    add_arguments,
    run,
)


def items_from_text(text: str, n: int) -> list[HellaSwagItem]:
    """n items in HellaSwag's format cut from random places of `text`: a 200-character context, then four
    120-character endings (the first the right one, as the text goes on)."""
    starts = np.random.default_rng(0).integers(0, len(text) - 700, size=n)
    return [
        HellaSwagItem(text[s : s + 200], [text[s + 200 + 120 * k : s + 320 + 120 * k] for k in range(4)], 0)
        for s in starts
    ]


def scored_tokens(items: list[HellaSwagItem], ending_tokens: list, tokenizer: Tokenizer, block_size: int) -> int:
    """Tokens the forward passes read: each row is an item's context and one ending, cut at the block size."""
    return sum(
        min(len(tokenizer.encode(item.context)) + n, block_size) for item, row in zip(items, ending_tokens) for n in row
    )
