"""--sample: batch-1 decoding of the config's model (default: the GPU preset's char model, random weights): no cache,
the KV cache with the eager one-token step, and the compiled step, with fp32, bf16 and int8 (weight-only) weights;
the time to the first token; the bf16 matmul rate beside it.

--where: where an eager decode step's time goes instead, per token and per kind of work (torch.profiler's self
times of the ops: the matmuls, attention, writing the cache, the other ops), and what is left of the wall time
(Python and dispatch between the ops), in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import deque

import torch

from benchmarks.common import (
    GPU_PRESET,
    PROMPT_TOKENS,
    Mode,
    add_config,
    decoding_model_args,
    print_table,
    time_generation,
)
from benchmarks.conditions import load_average
from model import GPT, quantize_int8
from quillgpt.metrics import matmul_flops

# (weights, KV cache, compiled step), in the table's order
PATHS = [
    ("fp32", False, False),
    ("fp32", True, False),
    ("fp32", True, True),
    ("bf16", True, False),
    ("bf16", True, True),
    ("int8", True, False),
    ("int8", True, True),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--new-tokens", type=int, default=500, help="tokens generated per run (default %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed generations per path; the best is reported (default %(default)s)"
    )
    p.add_argument("--where", action="store_true", help="where an eager decode step's time goes, by kind of work")
    p.add_argument(
        "--compile-decoding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the compiled decoding step (a one-off compile per dtype)",
    )


# torch.profiler's op names -> the kind of work a decode step spends them on
KINDS = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::mv"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"),
    "cache writes": ("aten::index_copy_", "aten::copy_"),
}


def where_time_goes(model: GPT, new_tokens: int) -> dict[str, float]:
    """ms per token of an eager KV-cache generation by kind of work (KINDS; the rest of the ops' self time as
    "other ops"), and "Python and dispatch": the wall time no op's self time accounts for."""
    deque(model.generate_stream(torch.zeros((1, PROMPT_TOKENS), dtype=torch.long), 8), maxlen=0)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        deque(model.generate_stream(torch.zeros((1, PROMPT_TOKENS), dtype=torch.long), new_tokens), maxlen=0)
        wall = time.perf_counter() - t0
    spent = dict.fromkeys([*KINDS, "other ops"], 0.0)
    for event in prof.key_averages():
        kind = next((k for k, names in KINDS.items() if event.key in names), "other ops")
        spent[kind] += event.self_cpu_time_total / 1e6
    spent["Python and dispatch"] = wall - sum(spent.values())
    return {k: v / new_tokens * 1e3 for k, v in {**spent, "wall": wall}.items()}


def where(args: argparse.Namespace, margs) -> None:
    torch.manual_seed(0)
    fp32 = GPT(margs).eval()
    rows = {
        name: where_time_goes(m, args.new_tokens)
        for name, m in (("fp32", fp32), ("bf16", copy.deepcopy(fp32).to(torch.bfloat16)))
    }
    kinds = list(next(iter(rows.values())))
    print(
        f"an eager decode step, ms per token ({args.new_tokens} tokens, {torch.get_num_threads()} threads; the profiler adds its own time)"
    )
    print_table(["weights", *kinds], [[name, *(f"{r[k]:.3f}" for k in kinds)] for name, r in rows.items()], left=1)


def run(args: argparse.Namespace, cli: list[str]) -> None:
    margs = decoding_model_args(args.config, cli)
    if args.where:
        where(args, margs)
        print(load_average())
        return
    torch.manual_seed(0)
    fp32 = GPT(margs).eval()  # random weights: the speed does not depend on them
    models = {"fp32": fp32, "bf16": copy.deepcopy(fp32).to(torch.bfloat16), "int8": quantize_int8(copy.deepcopy(fp32))}
    n = args.new_tokens
    print(
        f"generation: {fp32.num_params() / 1e6:.2f}M parameters, block {margs.block_size}, {n} new tokens after a "
        f"{PROMPT_TOKENS}-token prompt, batch 1, {torch.get_num_threads()} threads, best of {args.repeats}",
        flush=True,
    )
    rows = []
    for dtype, cache, compile in [p for p in PATHS if args.compile_decoding or not p[2]]:
        model = models[dtype]
        t0 = time.perf_counter()
        time_generation(model, n, cache, 1, compile, PROMPT_TOKENS)  # warm-up, compiling for this cache length
        warmup = time.perf_counter() - t0
        seconds, first = time_generation(model, n, cache, args.repeats, compile, PROMPT_TOKENS)
        rows.append((dtype, cache, compile, seconds, first, warmup))
        print(
            f"  {dtype} cache {'on' if cache else 'off'} compile {'on' if compile else 'off'}: {n / seconds:,.0f} "
            f"tokens/s",
            flush=True,
        )
    base = rows[1][3]  # the eager KV-cache path in fp32: what sample.py does by default
    print_table(
        [
            "weights",
            "KV cache",
            "compiled step",
            "tokens/s",
            "ms/token",
            "vs eager cached fp32",
            "first token (ms)",
            "warm-up incl. compile (s)",
        ],
        [
            [
                dtype,
                "on" if cache else "off",
                "yes" if compile else "no",
                f"{n / seconds:,.0f}",
                f"{seconds / n * 1e3:.2f}",
                f"{base / seconds:.2f}x",
                f"{first * 1e3:.1f}",
                f"{warmup:.1f}",
            ]
            for dtype, cache, compile, seconds, first, warmup in rows
        ],
        left=3,
    )
    flops = matmul_flops(margs.n_embd, 2048, torch.bfloat16, torch.device("cpu"))
    print(
        f"bf16 matmul ceiling here: {flops / 1e9:,.0f} GFLOP/s (at 2,048 rows; one token's matmuls are vector-matrix "
        f"products, bound by reading {fp32.num_params() * 4 / 1e6:.0f} MB of fp32 weights per token)"
    )
    print(load_average())


MODE = Mode(
    "--sample",
    "batch-1 decoding tokens/s: no cache, KV cache, compiled step; fp32, bf16 and int8 weights",
    __doc__,
    add_arguments,
    run,
)
