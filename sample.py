"""Generate text from a checkpoint, decoding with the tokenizer recorded in it.

    python sample.py --ckpt checkpoints/base                     # a run dir: its ckpt_best.pt
    python sample.py --ckpt checkpoints/base/ckpt_last.pt --prompt "def main(" --max-new-tokens 300
    python sample.py --ckpt checkpoints/shakespeare-char-cpu --prompt "ROMEO:" --num-samples 3 --top-p 0.9 --seed 7
    python sample.py --ckpt checkpoints/base --stop "\\n\\n" --temperature 0      # greedy, stop at a blank line
    python sample.py --ckpt checkpoints/base --interactive      # a prompt loop
    python sample.py --ckpt checkpoints/base --prompt-file prompt.txt --verbose   # tokens/s at the end
    python sample.py --ckpt exports/base.safetensors --prompt "import "          # a file from export.py --safetensors
    python sample.py --ckpt gpt2 --prompt "Hello, I'm a language model,"         # OpenAI's GPT-2 (transformers, network once)
    python sample.py --ckpt checkpoints/base --compile --max-new-tokens 2000   # compiled once, kept for later runs

--ckpt also takes a Hugging Face model directory (GPT-2, Llama, Qwen2, Qwen3; config.json,
safetensors weights and tokenizer.json) or a hub name (downloaded once). A row ends at the
tokenizer's end-of-sequence token or a --stop text. Several samples are generated as one
batch. On a terminal a single sample streams as it is produced (force it with --stream, switch it
off with --no-stream). --seed makes the output repeatable. A prompt longer than the model's context
keeps its last block_size tokens, with a notice on stderr.

How it decodes is decided once, where the model loads, and --verbose shows it with its reasons (the decoding plan,
quillgpt/generate.py: the precision, the step, the product kernels). The rows decode through quillgpt/engine.py: the
KV cache is allocated once and each new token is one step over it. --compile compiles that step ahead of time on a
CPU (quillgpt/compiled_step.py: tens of seconds, once per model shape and cache length) and keeps it on disk; later
runs, of any checkpoint of that shape and a cache no longer than its, load it in a tenth of a second and use it with
no flag (--no-compile: eager). A CPU training run of 5 minutes or more keeps the step for its model as it ends
(train.py, training.keep_decoding_step). --dtype bf16 halves the bytes of weights each token reads, --dtype int8
(weight-only, CPU) quarters them. bench.py --vs-transformers measures this script against transformers' generate
and llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from model import GPT
from quillgpt.errors import UserError, run_main
from quillgpt.generate import (
    COMPILE_HELP,
    DEVICES,
    DTYPES,
    encode_prompt,
    generate_texts,
    load_for_sampling,
    sampling_error,
    unescape,
)
from quillgpt.tokenizer import Tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint file, run directory (its ckpt_best.pt), .safetensors file, or Hugging Face model directory or hub name",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="text to continue")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200, help="0 = off")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, e.g. 0.9")
    p.add_argument("--seed", type=int, default=None, help="make sampling deterministic")
    p.add_argument(
        "--stop",
        nargs="+",
        action="extend",
        default=[],
        help="stop a sample at any of these texts (--stop A B or --stop A --stop B; \\n escapes work)",
    )
    p.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: cuda, else mps, else cpu)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights' dtype while sampling (default auto: bf16 on a CUDA device that has it; on the CPU bf16 where "
        "decoding measures clearly faster in it (a row, and a 16-row batch), as chat.py and serve.py pick); int8: weight-only int8 on the "
        "CPU, its activations in the faster of them",
    )
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help=COMPILE_HELP)
    p.add_argument("--interactive", action="store_true", help="read prompts in a loop (one per line; \\n escapes work)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None, help="stream the first sample")
    p.add_argument("--verbose", action="store_true", help="print the decoding plan (and why), and tokens/s at the end")
    args = p.parse_args(argv)
    if why := sampling_error(
        args.temperature, args.top_p, args.top_k, args.seed, args.num_samples, args.max_new_tokens
    ):
        p.error(why)
    args.stop = [unescape(s) for s in args.stop]
    return args


def sample_prompt(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    args: argparse.Namespace,
    generator: torch.Generator,
    stream: bool,
    plan,
) -> None:
    """Generate and print the samples for one prompt."""
    ids = encode_prompt(tokenizer, prompt, model.config.block_size)
    t0 = time.perf_counter()
    if stream:
        sys.stdout.write(prompt)
    texts, n_tokens = generate_texts(
        model,
        tokenizer,
        ids,
        args.num_samples,
        args.max_new_tokens,
        args.temperature,
        args.top_k or None,
        args.top_p,
        args.stop,
        generator,
        stream=sys.stdout if stream else None,
        plan=plan,
    )
    dt = time.perf_counter() - t0
    for i, text in enumerate(texts):
        if stream and i == 0:
            print()  # the streamed sample is already on screen
        else:
            print(prompt + text)
        if args.num_samples > 1:
            print("---------------")
    sys.stdout.flush()
    if args.verbose:
        print(
            f"[{n_tokens} tokens in {dt:.2f}s: {n_tokens / max(dt, 1e-9):,.0f} tokens/s, {plan.label}]", file=sys.stderr
        )


def iter_prompts(first: str) -> Iterator[str]:
    """The --prompt (if any), then one prompt per line of stdin until EOF, 'exit' or 'quit'."""
    if first:
        yield first
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("prompt> " if tty else "")
        except EOFError:
            if tty:
                print()
            return
        if line.strip() in ("exit", "quit"):
            return
        yield unescape(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, tokenizer, plan = load_for_sampling(args.ckpt, args.device, args.dtype, args.compile)
    print(f"[sampling {plan.label}]", file=sys.stderr, flush=True)
    if args.verbose:
        print(plan.text(), file=sys.stderr, flush=True)
    first_prompt = args.prompt
    if args.prompt_file:
        try:
            first_prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
    stream = args.stream if args.stream is not None else (sys.stdout.isatty() and args.num_samples == 1)
    # one for the whole session: --seed fixes every prompt's samples
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(args.seed if args.seed is not None else torch.seed())
    if not args.interactive:
        sample_prompt(model, tokenizer, first_prompt, args, generator, stream, plan)
        return 0
    for prompt in iter_prompts(first_prompt):
        try:
            sample_prompt(model, tokenizer, prompt, args, generator, stream, plan)
        except UserError as e:  # a bad prompt should not end the session
            print(f"error: {e}", file=sys.stderr)
    return 0


def exit_without_teardown(code: int | str | None) -> None:
    """End the process once its output is flushed, skipping the interpreter's teardown: unloading torch (its modules,
    its libraries' destructors) is a noticeable share of a short sample's wall time, and sample.py leaves nothing to
    clean up (it writes no files and registers nothing to run at exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # `python sample.py ... | head` closed it: nothing more to show
            pass
    if isinstance(code, str):
        print(code, file=sys.stderr, flush=True)
    os._exit(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    try:
        run_main(main)
    except SystemExit as done:
        exit_without_teardown(done.code)
