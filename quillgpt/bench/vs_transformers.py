"""--vs-transformers: batch-1 greedy decoding of the same exported model by transformers' `generate` and by
sample.py's default path (dtype auto, KV cache, eager step), start-up included: each side loads the Hugging Face
directory, then generates --new-tokens after a 16-token prompt; the best of --repeats, and whether the greedy tokens
are equal. The model is the config's (default: the GPU preset's char model) with random weights, exported as
export.py --hf writes it.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from model import GPT
from quillgpt.bench.common import GPU_PRESET, PROMPT_TOKENS, Mode, add_config, decoding_model_args, print_table
from quillgpt.errors import UserError
from quillgpt.hf import export_hf
from quillgpt.loading import load_model
from quillgpt.machine import load_average
from quillgpt.precision import PRECISIONS, inference_precision


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument(
        "--new-tokens", type=int, default=240, help="tokens generated per run, within the context (default %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per side; the best is reported (default %(default)s)")


def ours(directory: str, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor, str]:
    """sample.py's default path: load, pick the dtype by measurement, generate greedily with the KV cache."""
    t0 = time.perf_counter()
    model = load_model(directory).model.eval()
    dtype, _ = inference_precision("auto", torch.device("cpu"), model.config.n_embd, 1)
    model.to(PRECISIONS[dtype])
    out = model.generate(prompt, new_tokens, temperature=0)
    return time.perf_counter() - t0, out[:, prompt.size(1) :], dtype


def theirs(directory: str, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    import transformers

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return time.perf_counter() - t0, out[:, prompt.size(1) :]


def run(args: argparse.Namespace, cli: list[str]) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("--vs-transformers needs transformers: pip install -e '.[hf]'") from None
    margs = decoding_model_args(args.config, cli)
    if PROMPT_TOKENS + args.new_tokens > margs.block_size:
        raise UserError(
            f"--new-tokens {args.new_tokens} + a {PROMPT_TOKENS}-token prompt exceed the context {margs.block_size}"
        )
    torch.manual_seed(0)
    prompt = torch.randint(0, margs.vocab_size, (1, PROMPT_TOKENS))
    with tempfile.TemporaryDirectory(prefix="vs_transformers_") as directory, torch.no_grad():
        export_hf(GPT(margs), None, directory)
        best_ours, best_theirs = float("inf"), float("inf")
        for _ in range(args.repeats):  # alternating, so that drift hits both sides alike
            seconds, ours_ids, dtype = ours(directory, prompt, args.new_tokens)
            best_ours = min(best_ours, seconds)
            seconds, theirs_ids = theirs(directory, prompt, args.new_tokens)
            best_theirs = min(best_theirs, seconds)
    n = args.new_tokens
    same = torch.equal(ours_ids, theirs_ids)
    print(
        f"{margs.n_layer} layers, n_embd {margs.n_embd}, {n} new tokens after a {PROMPT_TOKENS}-token prompt, batch 1, "
        f"greedy, {torch.get_num_threads()} threads; load + generate, best of {args.repeats}"
    )
    print_table(
        ["decoder", "seconds", "tokens/s", "vs transformers"],
        [
            [
                f"sample.py's default ({dtype}, KV cache)",
                f"{best_ours:.2f}",
                f"{n / best_ours:,.0f}",
                f"{best_theirs / best_ours:.2f}x",
            ],
            ["transformers generate (fp32)", f"{best_theirs:.2f}", f"{n / best_theirs:,.0f}", "1.00x"],
        ],
        left=1,
    )
    print(f"greedy tokens equal: {same}" + ("" if same or dtype == "fp32" else f" (ours ran in {dtype})"))
    print(load_average())


MODE = Mode(
    "--vs-transformers",
    "batch-1 greedy decoding, load included: sample.py's default path against transformers' generate",
    __doc__,
    add_arguments,
    run,
)
