"""Soak test of serve.py: --requests requests (default 1,000) from --clients concurrent clients against one server,
a mix of completions and chats, streamed and not, some abandoned mid-stream; the server's RSS is printed at the
start, the middle and the end. Exit 1 when it grows by 5% or more from the middle to the end, or a slot is still taken
at the end: nothing of a request may outlive it.

    python -m benchmarks.soak_serve                          # a tiny random char model, made here
    python -m benchmarks.soak_serve --ckpt checkpoints/base --requests 2000 --clients 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

from benchmarks.serving_load import ServerProcess
from model import GPT, GPTConfig
from quillgpt.chat_template import with_chat_tokens
from quillgpt.checkpoint import save_checkpoint
from quillgpt.errors import run_main
from quillgpt.tokenizer import CharTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent

CHARS = list("\n abcdefghijklmnopqrstuvwxyz.,:?!'")
MAX_GROWTH = 0.05  # of the RSS at the middle: more from there to the end is a leak (exit 1)


def soak_checkpoint(directory: Path) -> Path:
    tokenizer = with_chat_tokens(CharTokenizer(CHARS, eot=True))
    torch.manual_seed(0)
    config = GPTConfig(block_size=128, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=64)
    path = directory / "ckpt_best.pt"
    model = GPT(config)
    save_checkpoint(
        path, {"model": model.state_dict(), "model_args": config.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    return path


def one_request(client, model: str, i: int) -> None:
    """Request i of the mix: completion or chat, whole, streamed, or streamed and dropped after two chunks."""
    kw = dict(model=model, max_tokens=24 + i % 17, temperature=(i % 3) * 0.5, seed=i)
    kind, style = i % 2, (i // 2) % 3
    if kind == 0:
        call = lambda **extra: client.completions.create(prompt=f"the king {'abcdefg'[i % 7]} ", **kw, **extra)  # noqa: E731
    else:
        messages = [{"role": "user", "content": "what say you, " + "abc"[i % 3]}]
        call = lambda **extra: client.chat.completions.create(messages=messages, **kw, **extra)  # noqa: E731
    if style == 0:
        call()
    elif style == 1:
        for _ in call(stream=True):
            pass
    else:
        stream = call(stream=True)
        for n, _ in enumerate(stream):
            if n == 1:
                break
        stream.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="serve this checkpoint (needs a chat template) instead of a tiny random model")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or soak_checkpoint(Path(tmp))
        with ServerProcess(ckpt, "--dtype", "fp32", "--max-batch", str(args.clients)) as server:
            process = psutil.Process(server.pid)
            client = server.client(timeout=120)
            model = client.models.list().data[0].id
            half = args.requests // 2
            t0 = time.perf_counter()
            rss = {}
            for phase, (lo, hi) in (("start", (0, 20)), ("middle", (20, half)), ("end", (half, args.requests))):
                with ThreadPoolExecutor(args.clients) as pool:
                    list(pool.map(lambda i: one_request(client, model, i), range(lo, hi)))
                rss[phase] = process.memory_info().rss / 1e6
                print(f"after {hi:5d} requests ({time.perf_counter() - t0:6.1f} s): server RSS {rss[phase]:7.1f} MB")
            health = server.health()
    grew = rss["end"] - rss["middle"]
    print(f"RSS from the middle to the end: {grew:+.1f} MB; slots in use at the end: {health['active']}")
    flat = grew < MAX_GROWTH * rss["middle"]
    return 0 if flat and health["active"] == 0 and health["queued"] == 0 else 1


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
