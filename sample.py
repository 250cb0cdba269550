"""Generate text from a checkpoint, decoding with the tokenizer recorded in it.

    python sample.py --ckpt checkpoints/base                     # a run dir: its ckpt_best.pt
    python sample.py --ckpt checkpoints/base/ckpt_last.pt --prompt "def main(" --max-new-tokens 300
    python sample.py --ckpt checkpoints/shakespeare-char --prompt "ROMEO:" --num-samples 3 --top-p 0.9 --seed 7
    python sample.py --ckpt checkpoints/base --stop "\\n\\n" --temperature 0      # greedy, stop at a blank line
    python sample.py --ckpt checkpoints/base --interactive      # a prompt loop
    python sample.py --ckpt checkpoints/base --prompt-file prompt.txt --verbose   # tokens/s at the end

Several samples are generated as one batch. On a terminal a single sample streams as it is
produced (force it with --stream, switch it off with --no-stream).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from checkpoint import load_checkpoint, model_from_checkpoint, resolve_checkpoint
from common import UserError, run_main
from model import GPT
from tokenizer import Tokenizer, tokenizer_from_dict


def load_for_sampling(ckpt_path: str | Path, device: str) -> tuple[GPT, Tokenizer, Path]:
    path = resolve_checkpoint(ckpt_path, prefer="best")
    ckpt = load_checkpoint(path, map_location="cpu")
    if "tokenizer" not in ckpt:
        raise UserError(f"{path} records no tokenizer, so its ids can't be decoded")
    tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    model = model_from_checkpoint(ckpt, path)
    model.eval().to(device)
    return model, tokenizer, path


def encode_prompt(tokenizer: Tokenizer, prompt: str, block_size: int, quiet: bool = False) -> list[int]:
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:  # generation needs at least one token: start from a newline, or token 0
        try:
            ids = tokenizer.encode("\n")
        except UserError:
            ids = []
        ids = ids or [0]
    if len(ids) > block_size:
        if not quiet:
            print(f"[prompt is {len(ids)} tokens, longer than block_size {block_size}: keeping the last {block_size}]",
                  file=sys.stderr)
        ids = ids[-block_size:]
    return ids


def generate_texts(model: GPT, tokenizer: Tokenizer, prompt_ids: list[int], num_samples: int, max_new_tokens: int,
                   temperature: float = 0.8, top_k: int | None = 200, top_p: float | None = None,
                   stop: list[str] | None = None, seed: int | None = None, stream=None) -> tuple[list[str], int]:
    """Sample num_samples continuations as one batch. Returns (texts, tokens generated).

    A row ends at the first stop sequence (which is not included). stream, a text file, receives
    the first row's text as it is produced."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    idx = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)
    rows: list[list[int]] = [[] for _ in range(num_samples)]
    texts = [""] * num_samples
    done = [False] * num_samples
    shown = 0
    steps = 0
    for token in model.generate_stream(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       generator=generator, vocab_limit=tokenizer.vocab_size):
        steps += 1
        for i, t in enumerate(token[:, 0].tolist()):
            if done[i]:
                continue
            rows[i].append(t)
            texts[i] = tokenizer.decode(rows[i])
            for s in stop or []:
                if s and s in texts[i]:
                    texts[i] = texts[i][:texts[i].index(s)]
                    done[i] = True
        if stream is not None and not texts[0].endswith("\ufffd"):  # don't print half a UTF-8 character
            stream.write(texts[0][shown:])
            stream.flush()
            shown = len(texts[0])
        if all(done):
            break
    if stream is not None:
        stream.write(texts[0][shown:])
        stream.flush()
    return texts, steps * num_samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file, or run directory (its ckpt_best.pt)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="text to continue")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200, help="0 = off")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, e.g. 0.9")
    p.add_argument("--seed", type=int, default=None, help="make sampling deterministic")
    p.add_argument("--stop", action="append", default=[], help="stop a sample at this text (repeatable; \\n escapes work)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    p.add_argument("--interactive", action="store_true", help="read prompts in a loop")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None, help="stream the first sample")
    p.add_argument("--verbose", action="store_true", help="print tokens/s at the end")
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 0:
        p.error("--num-samples must be >= 1 and --max-new-tokens >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    args.stop = [s.encode("utf-8").decode("unicode_escape") if "\\" in s else s for s in args.stop]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device} but this machine has no CUDA device")
    model, tokenizer, path = load_for_sampling(args.ckpt, args.device)
    prompt = args.prompt
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
    stream = args.stream if args.stream is not None else (sys.stdout.isatty() and args.num_samples == 1)
    prompts = iter_prompts(prompt) if args.interactive else [prompt]
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, model.config.block_size)
        t0 = time.perf_counter()
        if stream:
            sys.stdout.write(prompt)
        texts, n_tokens = generate_texts(model, tokenizer, ids, args.num_samples, args.max_new_tokens, args.temperature,
                                         args.top_k or None, args.top_p, args.stop, args.seed,
                                         stream=sys.stdout if stream else None)
        dt = time.perf_counter() - t0
        for i, text in enumerate(texts):
            if not (stream and i == 0):
                print(prompt + text)
            else:
                print()
            if args.num_samples > 1:
                print("---------------")
        if args.verbose:
            print(f"[{n_tokens} tokens in {dt:.2f}s: {n_tokens / dt:,.0f} tokens/s, {path}]", file=sys.stderr)
    return 0


def iter_prompts(first: str):
    if first:
        yield first
    while True:
        try:
            line = input("prompt> ")
        except EOFError:
            print()
            return
        if line.strip() in ("exit", "quit"):
            return
        yield line.replace("\\n", "\n")


if __name__ == "__main__":
    run_main(main)
