"""--finetune: configs/finetune/smollm2_135m.toml on a random model of exactly SmolLM2-135M's shape, written as a
Hugging Face Llama directory (no download), fine-tuned on tiny Shakespeare's char tokens (the speed does not depend
on which ids): train.py --validate's estimate beside a measured run of the real training step (its own bench.py
process, for its peak RSS), then KV-cache decoding at batch 1 in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import deque
from pathlib import Path

import torch

from benchmarks.common import (
    REPO,
    Mode,
    child_step_flags,
    child_step_timing,
    print_table,
    run_child,
    time_generation,
)
from benchmarks.conditions import load_average, with_shakespeare_input
from model import GPT, GPTConfig
from quillgpt.config import build_config, load_toml, parse_overrides
from quillgpt.hf import export_hf
from quillgpt.loading import load_model
from quillgpt.machine import usable_cpus
from quillgpt.metrics import matmul_flops

FINETUNE_PRESET = REPO / "configs" / "finetune" / "smollm2_135m.toml"
# HuggingFaceTB/SmolLM2-135M's config.json, as model.py's switches
SMOLLM2_135M = GPTConfig(
    block_size=8192,
    vocab_size=49152,
    n_layer=30,
    n_head=9,
    n_kv_head=3,
    n_embd=576,
    mlp_hidden=1536,
    bias=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
    rope_theta=100000.0,
    norm_eps=1e-5,
)
# the lines of train.py --validate's report that hold its estimate
ESTIMATE_LINES = ("model:", "tokens per", "memory", "expected", "measured")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        type=Path,
        default=FINETUNE_PRESET,
        help="the fine-tuning config timed (default %(default)s; configs/chat/smollm2_135m_sft.toml is chat SFT: "
        "add --data.chat false, as the text it trains on here has no conversations; the assistant-only loss costs "
        "what bench.py --chat measures)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed fine-tuning steps first (default %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="timed fine-tuning steps (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=100, help="tokens decoded per run (default %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=2, help="decoding runs per dtype; the best is reported (default %(default)s)"
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    cli = with_shakespeare_input(cli)
    preset = args.preset.resolve()
    cfg = build_config(load_toml(preset), parse_overrides(cli), source=str(preset))
    with tempfile.TemporaryDirectory(prefix="bench_finetune_") as tmp:
        model_dir = Path(tmp) / "SmolLM2-135M-random"
        torch.manual_seed(0)
        export_hf(GPT(SMOLLM2_135M), None, model_dir)
        train_args = [
            *("--config", str(preset), "--run.init_from", str(model_dir)),
            *("--data.dataset", "shakespeare_char", "--data.tokenizer", "char"),
            *("--run.out_dir", str(Path(tmp) / "runs")),
            *cli,
        ]
        log = Path(tmp) / "validate.log"
        run_child([sys.executable, "train.py", *train_args, "--validate"], log)
        estimate = [line for line in log.read_text().splitlines() if line.startswith(ESTIMATE_LINES)]
        log = Path(tmp) / "bench.log"
        _, process_peak = run_child(
            [sys.executable, "bench.py", *train_args, *child_step_flags(args.warmup, args.iters)], log
        )
        timing = child_step_timing(log)
        model = load_model(model_dir).model.eval()
    print(f"fine-tuning {preset.relative_to(REPO)} on a random SmolLM2-135M-shaped model, {usable_cpus()} cores")
    print("train.py --validate:\n  " + "\n  ".join(estimate))
    print(
        f"measured: {timing['ms_median'] / 1e3:.1f} s/step, {timing['tokens_per_s']:,.0f} tokens/s, MFU "
        f"{timing['mfu'] * 100:.1f}%, peak RSS {process_peak:,.0f} MB ({args.iters} steps after {args.warmup} warm-up)"
    )
    block = cfg.model.block_size
    model.crop_block_size(block)  # as the preset trains it: the attention FLOPs grow with the context
    ceiling = matmul_flops(SMOLLM2_135M.n_embd, cfg.training.batch_size * block, torch.bfloat16, torch.device("cpu"))
    achieved = timing["tokens_per_s"] * model.flops_per_token()
    print(
        f"model FLOPs {achieved / 1e9:,.0f} GFLOP/s (recomputation not counted) = {achieved / ceiling:.0%} of the bf16 "
        f"matmul ceiling measured now, {ceiling / 1e9:,.0f} GFLOP/s at the MLP's shape"
    )
    prompt = torch.zeros((1, 1), dtype=torch.long)
    deque(model.generate_stream(prompt, 4), maxlen=0)  # warm-up
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16 weights", torch.bfloat16)):
        seconds, _ = time_generation(model.to(dtype), args.new_tokens, True, args.repeats)
        rows.append([name, f"{args.new_tokens / seconds:,.1f}", f"{seconds / args.new_tokens * 1e3:.1f}"])
    print_table(["decoding, batch 1, KV cache", "tokens/s", "ms/token"], rows)
    print(load_average())


MODE = Mode(
    "--finetune",
    "SmolLM2-135M's shape (random weights): fine-tuning tokens/s and RSS beside --validate's estimate; decoding",
    __doc__,
    add_arguments,
    run,
)
