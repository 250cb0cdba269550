"""--lora: LoRA and QLoRA against a full fine-tune, in memory, time and quality.

--part memory (the default): SmolLM2-135M's shape and a 1B-class shape (Llama-3.2-1B's), random weights written as a
Hugging Face directory in bf16 as the hub's are (no download), fine-tuned on tiny Shakespeare's char tokens. For each
variant, train.py --validate's estimate beside a measured run of the real training step in its own bench.py process
(its peak RSS, s/step): full (with and without gradient checkpointing), LoRA (with and without), QLoRA int8 and nf4.
SmolLM2's variants are configs/finetune/smollm2_135m.toml and configs/finetune/smollm2_135m_lora.toml; the 1B shape
takes the LoRA preset's settings at batch 2 x 512 (one accumulation step), its full fine-tune --validate only: it
does not fit, which --validate says in one line.

--part kernels: one frozen linear map's forward and backward (the gradient of its input) at the 1B shape's MLP, in
bf16: the weight stored bf16, int8 or NF4 (ours, dequantized in the pass), and torchao's NF4 and bitsandbytes' 4-bit
where they are installed: the measurement behind lora.quantize's implementation (docs/finetune.md).

--part demo: the CPU chat demo (configs/chat/base_chat.toml on the Quickstart's base model, trained here first when
--base is not given): the full SFT against LoRA SFTs of rank 8 and 32 given the same wall time (steps = the full
run's steps x its s/step / theirs, each measured by a bench.py child), and QLoRA int8 and nf4 at rank 8 given the
same steps (the same data) as LoRA's rank-8 run, whose val loss theirs is compared with; held-out reverse, count and
arithmetic accuracy (eval.py --chat-task, greedy) and the best val loss of each.

--tiny runs every part at toy sizes (seconds), to check that it works.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, Mode, child_step_flags, child_step_timing, print_table, run_child
from benchmarks.conditions import load_average, with_shakespeare_input
from benchmarks.finetune import SMOLLM2_135M
from model import GPT, GPTConfig
from quillgpt.errors import UserError
from quillgpt.hf import export_hf
from quillgpt.lora import QuantizedLinear
from quillgpt.machine import usable_cpus

FULL_PRESET = REPO / "configs" / "finetune" / "smollm2_135m.toml"
LORA_PRESET = REPO / "configs" / "finetune" / "smollm2_135m_lora.toml"
CHAT_PRESET = REPO / "configs" / "chat" / "base_chat.toml"
BASE_PRESET = REPO / "configs" / "base" / "base.toml"
# meta-llama/Llama-3.2-1B's config.json, as model.py's switches (1.24B parameters, the embedding tied)
LLAMA_3_2_1B = GPTConfig(
    block_size=131072,
    vocab_size=128256,
    n_layer=16,
    n_head=32,
    n_kv_head=8,
    n_embd=2048,
    mlp_hidden=8192,
    bias=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
    rope_theta=500000.0,
    norm_eps=1e-5,
    rope_scaling="llama3",
    rope_factor=32.0,
    rope_original_context=8192,
)
# google/gemma-3-270m's config.json, as model.py's switches (268M parameters, the embedding tied)
GEMMA3_270M = GPTConfig(
    block_size=32768,
    vocab_size=262144,
    n_layer=18,
    n_head=4,
    n_kv_head=1,
    head_dim=256,
    n_embd=640,
    mlp_hidden=2048,
    bias=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="geglu",
    gelu_approx="tanh",
    norm_plus_one=True,
    embed_scale=True,
    post_norm=True,
    qk_norm=True,
    sliding_window=512,
    global_layers=[5, 11, 17],
    rope_theta=1_000_000.0,
    rope_theta_local=10_000.0,
    attn_scale=256**-0.5,
    norm_eps=1e-6,
    hf_family="gemma3",
)
TINY = GPTConfig(
    block_size=256,
    vocab_size=512,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    mlp_hidden=128,
    bias=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
)
# variant -> (preset, overrides)
VARIANTS = {
    "full": (FULL_PRESET, []),
    "full, no checkpointing": (FULL_PRESET, ["--training.gradient_checkpointing", "false"]),
    "LoRA": (LORA_PRESET, ["--training.gradient_checkpointing", "false"]),
    "LoRA + checkpointing": (LORA_PRESET, []),
    "QLoRA int8": (LORA_PRESET, ["--lora.quantize", "int8"]),
    "QLoRA nf4": (LORA_PRESET, ["--lora.quantize", "nf4"]),
}
BIG = ["--model.block_size", "512", "--training.batch_size", "2", "--training.grad_accum_steps", "1"]
BIG += ["--training.loss_chunks", "8", "--training.eval_iters", "2"]
GEMMA3_LORA_PRESET = REPO / "configs" / "finetune" / "gemma3_270m_lora.toml"
# shape -> (its switches, flags, the variants measured, the LoRA preset they run)
SHAPES = {
    "smollm2-135m": (SMOLLM2_135M, [], list(VARIANTS), LORA_PRESET),
    "llama-3.2-1b": (LLAMA_3_2_1B, BIG, list(VARIANTS)[2:], LORA_PRESET),
    "gemma3-270m": (GEMMA3_270M, [], ["LoRA + checkpointing"], GEMMA3_LORA_PRESET),
}
TINY_FLAGS = ["--model.block_size", "64", "--training.batch_size", "2", "--training.grad_accum_steps", "1"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("memory", "kernels", "demo"), default="memory", help="(default %(default)s)")
    p.add_argument(
        "--shapes", default="smollm2-135m,llama-3.2-1b", help=f"memory: of {', '.join(SHAPES)} (default %(default)s)"
    )
    p.add_argument("--variants", help=f"memory: comma-separated, a subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--warmup", type=int, default=1, help="memory: untimed steps first (default %(default)s)")
    p.add_argument("--iters", type=int, default=2, help="memory: timed steps (default %(default)s)")
    p.add_argument("--base", type=Path, help="demo: the base run (default: configs/base/base.toml, trained here)")
    p.add_argument("--ranks", default="8,32", help="demo: the LoRA ranks (default %(default)s)")
    p.add_argument(
        "--lora-lr", type=float, default=3e-3, help="demo: the LoRA runs' learning rate (default %(default)s)"
    )
    p.add_argument("--chat-items", type=int, default=200, help="demo: held-out items per task (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="toy sizes: check that the part runs (seconds)")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    {"memory": memory, "kernels": kernels, "demo": demo}[args.part](args, cli)
    print(load_average())


# ---- memory and time ----------------------------------------------------------------------------------------


def memory(args: argparse.Namespace, cli: list[str]) -> None:
    cli = with_shakespeare_input(cli)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        for name in args.shapes.split(","):
            shape, flags, variants, lora_preset = SHAPES[name]
            if args.tiny:
                shape, flags = TINY, TINY_FLAGS
            model_dir = write_random_model(shape, Path(tmp) / name)
            common = [
                *("--run.init_from", str(model_dir), "--data.dataset", "shakespeare_char"),
                *("--data.tokenizer", "char", "--run.out_dir", str(Path(tmp) / "runs"), *flags, *cli),
            ]
            if name == "llama-3.2-1b" and not args.tiny:
                rows.append([name, "full", refused(FULL_PRESET, common, Path(tmp)), "", "", "", ""])
            full = None
            for variant in [v for v in variants if not args.variants or v in args.variants.split(",")]:
                preset, extra = VARIANTS[variant]
                preset = lora_preset if preset == LORA_PRESET else preset
                measured = measure(preset, [*common, *extra], args, Path(tmp))
                full = full or measured
                rows.append(
                    [
                        name,
                        variant,
                        f"{measured['estimate_gb']:.2f} GB",
                        f"{measured['peak_gb']:.2f} GB",
                        f"{measured['estimate_s']:.1f} s",
                        f"{measured['step_s']:.1f} s",
                        f"{measured['peak_gb'] / full['peak_gb']:.0%} / {measured['step_s'] / full['step_s']:.0%}",
                    ]
                )
            shutil_rmtree(model_dir)
    print(f"LoRA and QLoRA against a full fine-tune, random weights of each shape, {usable_cpus()} cores")
    header = ["shape", "variant", "--validate RSS", "peak RSS", "--validate step", "step", "vs the first"]
    print_table(header, rows, left=2)


def write_random_model(shape: GPTConfig, directory: Path) -> Path:
    """A random model of the shape as a Hugging Face directory, in bf16 as the hub's files are (half the bytes)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(shape)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    export_hf(model.to(torch.bfloat16), None, directory)
    return directory


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def measure(preset: Path, flags: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    """train.py --validate's expected peak RSS and step, and a bench.py child's measured ones."""
    log = tmp / "validate.log"
    run_child([sys.executable, "train.py", "--config", str(preset), *flags, "--validate"], log)
    text = log.read_text()
    estimate_gb = float(re.search(r"expected peak RSS: ([\d.]+) GB", text)[1])
    estimate_s = float(re.search(r"measured: ([\d.]+) ms/iter", text)[1]) / 1e3
    log = tmp / "bench.log"
    _, peak_mb = run_child(
        [sys.executable, "bench.py", "--config", str(preset), *flags, *child_step_flags(args.warmup, args.iters)], log
    )
    timing = child_step_timing(log)
    return {
        "estimate_gb": estimate_gb,
        "estimate_s": estimate_s,
        "peak_gb": peak_mb / 1e3,
        "step_s": timing["ms_median"] / 1e3,
    }


def refused(preset: Path, flags: list[str], tmp: Path) -> str:
    """train.py --validate's one line for a run that would not fit (exit 2)."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "train.py", "--config", str(preset), *flags, "--validate"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if result.returncode != 2:
        raise UserError(f"the full fine-tune's --validate was expected to refuse (exit 2), got {result.returncode}")
    return result.stderr.strip().splitlines()[-1]


# ---- the frozen linear map's pass -----------------------------------------------------------------------------


def kernels(args: argparse.Namespace, cli: list[str]) -> None:
    out_f, in_f, rows_n = (128, 64, 64) if args.tiny else (LLAMA_3_2_1B.mlp_hidden, LLAMA_3_2_1B.n_embd, 1024)
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    x0 = torch.randn(rows_n, in_f, dtype=torch.bfloat16)
    grad = torch.randn(rows_n, out_f, dtype=torch.bfloat16)
    reference = x0.float() @ linear.weight.t()
    candidates = {
        "bf16 weight (LoRA)": lambda x: F.linear(x, linear.weight.to(torch.bfloat16)),
        "int8, ours": quantized(linear, "int8"),
        "NF4, ours": quantized(linear, "nf4"),
        **third_party(linear),
    }
    rows = []
    for name, fn in candidates.items():
        seconds = pass_seconds(fn, x0, grad)
        error = ((fn(x0).float() - reference).norm() / reference.norm()).item()
        rows.append([name, f"{seconds * 1e3:.1f} ms", f"{error:.4f}"])
    print(f"a frozen ({out_f} x {in_f}) linear map, {rows_n} rows, bf16: forward + the input's gradient")
    print_table(["weight stored as", "forward + backward", "relative error of the output"], rows)


def quantized(linear: torch.nn.Linear, kind: str):
    module = QuantizedLinear(linear, kind)
    return lambda x: module(x)


def third_party(linear: torch.nn.Linear) -> dict:
    """torchao's NF4 (torchtune's QLoRA) and bitsandbytes' 4-bit, where installed."""
    out = {}
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

        weight = to_nf4(linear.weight.detach().to(torch.bfloat16))
        out["NF4, torchao"] = lambda x: linear_nf4(x, weight)
    except ImportError:
        pass
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16)
        layer.weight = bnb.nn.Params4bit(linear.weight.detach().clone(), requires_grad=False, quant_type="nf4")
        layer = layer.to("cpu")
        out["NF4, bitsandbytes"] = layer
    except ImportError:
        pass
    return out


def pass_seconds(fn, x0: torch.Tensor, grad: torch.Tensor, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        x = x0.clone().requires_grad_()
        t0 = time.perf_counter()
        fn(x).backward(grad)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


# ---- the chat demo ---------------------------------------------------------------------------------------------


def demo(args: argparse.Namespace, cli: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_lora_demo_") as tmp:
        tmp = Path(tmp)
        out = ["--run.out_dir", str(tmp / "runs"), "--data.data_dir", str(tmp / "data")]
        tiny = (
            ["--max-iters", "40", "--training.eval_interval", "20", "--training.eval_iters", "2"] if args.tiny else []
        )
        base = args.base or train_base(tmp, out, tiny)
        tasks = tmp / "chat_tasks.jsonl"
        run_child([sys.executable, "tasks.py", "--out", str(tasks), "--turns", "3"], tmp / "tasks.log")
        common = [*out, "--run.init_from", str(base), "--data.input", str(tasks), *tiny, *cli]
        runs = {"full SFT": ["--run.name", "full"]}
        for rank in map(int, args.ranks.split(",")):
            runs[f"LoRA r{rank}"] = lora_flags(rank, args.lora_lr, f"lora{rank}")
        first = int(args.ranks.split(",")[0])
        for kind in ("int8", "nf4"):
            runs[f"QLoRA {kind} r{first}"] = [*lora_flags(first, args.lora_lr, f"q{kind}"), "--lora.quantize", kind]
        full_steps = int(iters_of(common, tiny))
        rows, full_step, done = [], None, {}
        for name, flags in runs.items():
            step = step_seconds([*common, *flags], tmp)
            full_step = full_step or step
            steps = max(1, round(full_steps * full_step / step))
            if name.startswith("QLoRA"):  # the same data as LoRA's run of its rank: val loss against val loss
                steps = done[f"LoRA r{first}"]
            done[name] = steps
            run_flags = [*common, *flags, "--training.max_iters", str(steps), "--optimizer.lr_decay_iters", str(steps)]
            seconds, _ = run_child(
                [sys.executable, "train.py", "--config", str(CHAT_PRESET), *run_flags], tmp / "t.log"
            )
            run_dir = tmp / "runs" / flags[flags.index("--run.name") + 1]
            history = json.loads((run_dir / "train_log.json").read_text())["history"]
            val = min(p["val_loss"] for p in history if p["kind"] == "eval")
            scores = chat_scores(run_dir, args.chat_items, tmp)
            rows.append(
                [
                    name,
                    f"{steps:,}",
                    f"{step * 1e3:.1f} ms",
                    f"{seconds:.0f} s",
                    f"{val:.4f}",
                    *(f"{scores[t]:.0%}" for t in ("reverse", "count", "arithmetic")),
                ]
            )
    print("the CPU chat demo in the full SFT's wall time: LoRA against full")
    print_table(["run", "steps", "step", "wall", "best val loss", "reverse", "count", "arithmetic"], rows)


def lora_flags(rank: int, lr: float, name: str) -> list[str]:
    return [
        *("--run.name", name, "--lora.enabled", "true", "--lora.rank", str(rank)),
        *("--lora.alpha", str(2.0 * rank), "--optimizer.learning_rate", str(lr), "--optimizer.min_lr", str(lr / 10)),
    ]


def train_base(tmp: Path, out: list[str], tiny: list[str]) -> Path:
    run_child(
        [sys.executable, "train.py", "--config", str(BASE_PRESET), *out, "--run.name", "base", *tiny], tmp / "base.log"
    )
    return tmp / "runs" / "base"


def iters_of(common: list[str], tiny: list[str]) -> int:
    if tiny:
        return int(tiny[1])
    from quillgpt.config import load_toml

    return load_toml(CHAT_PRESET)["training"]["max_iters"]


def step_seconds(flags: list[str], tmp: Path) -> float:
    """A bench.py child's median step of the run these flags describe (its data prepared by then)."""
    log = tmp / "step.log"
    run_child([sys.executable, "bench.py", "--config", str(CHAT_PRESET), *flags, *child_step_flags(3, 5)], log)
    return child_step_timing(log)["ms_median"] / 1e3


def chat_scores(run_dir: Path, items: int, tmp: Path) -> dict[str, float]:
    report = tmp / "chat.json"
    run_child(
        [
            *(sys.executable, "eval.py", "--ckpt", str(run_dir), "--chat-task", "reverse,count,arithmetic"),
            *("--chat-items", str(items), "--json", str(report)),
        ],
        tmp / "eval.log",
    )
    tasks = json.loads(report.read_text())["chat_tasks"]["tasks"]
    return {name: task["acc"] for name, task in tasks.items()}


MODE = Mode(
    "--lora",
    "LoRA and QLoRA vs a full fine-tune: peak RSS and s/step (SmolLM2-135M, a 1B shape) vs --validate; the chat demo",
    __doc__,
    add_arguments,
    run,
)
