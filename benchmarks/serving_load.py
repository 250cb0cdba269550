"""--serve: serve.py under load: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients (the openai client, one
thread each, each sending --requests completions of --max-tokens tokens one after another) against one server, and
whether every level's replies equal the single client's. The model is the config's (default: the GPU preset's char
model) with random weights and a tokenizer without an end-of-text id, so every reply is --max-tokens long; or
--ckpt's. ServerProcess, serve.py in a subprocess, is what the tests and benchmarks/soak_serve.py start too.

--vs-llama-cpp: the same levels against llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`,
pip install 'llama-cpp-python[server]') on export.py --gguf's f32 file of the same model, with torch's thread count.
That server answers one request at a time (llama.cpp's own C++ llama-server batches; the Python package's does not),
queued: --interrupt_requests False, so that a new request does not cut short the one under way.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import GPU_PRESET, REPO, Mode, add_config, decoding_model_args, llama_cpp_installed, print_table
from benchmarks.conditions import load_average
from model import GPT
from quillgpt.checkpoint import save_checkpoint
from quillgpt.errors import UserError
from quillgpt.tokenizer import CharTokenizer

BENCH_CHARS = list("\n !',.:;?" + string.ascii_letters + "0123")  # 65, as tiny Shakespeare's vocabulary


class ServerProcess:
    """serve.py in a subprocess on 127.0.0.1 with a port it picks itself (--port 0), ready once /health answers;
    api_key None serves without a key."""

    def __init__(self, ckpt: str | Path, *flags: str, api_key: str | None = "bench", startup_timeout: float = 120):
        import httpx

        self.api_key = api_key
        key = [] if api_key is None else ["--api-key", api_key]
        self.proc = subprocess.Popen(
            [sys.executable, "serve.py", "--ckpt", str(ckpt), "--port", "0", *key, *flags],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT (close) prints every thread's stack
        )
        line = self.proc.stdout.readline()  # "serving NAME (...) on http://127.0.0.1:PORT/v1" once the model is loaded
        if not line.startswith("serving "):
            self.proc.wait(timeout=30)
            raise UserError(f"serve.py did not start: {self.proc.stderr.read().strip() or line.strip()}")
        self.started = line.strip()  # what it serves, how, and where
        self.base = line.rsplit(" on ", 1)[1].strip()
        self.root = self.base.removesuffix("/v1")
        self.pid = self.proc.pid
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                if httpx.get(f"{self.root}/health").status_code == 200:
                    return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.root}/health").json()

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base, api_key=self.api_key, max_retries=0, **kw)

    def close(self) -> None:
        """SIGTERM, as a service manager ends serve.py. One still running a minute later is sent SIGABRT, which prints
        where each of its threads was (PYTHONFAULTHANDLER) before it dies: that goes to stderr here, and the
        measurements taken stand."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            stacks = self.proc.communicate(timeout=30)[1]
            print(f"serve.py had not ended 60 s after SIGTERM; its threads were at:\n{stacks}", file=sys.stderr)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server on a GGUF file (its context the model's: --n_ctx 0), on 127.0.0.1,
    ready once /v1/models answers; the same client() and context manager as ServerProcess."""

    def __init__(self, gguf: str | Path, threads: int, startup_timeout: float = 120):
        import httpx

        with socket.socket() as s:  # a free port (llama_cpp.server takes no --port 0)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.api_key = "bench"
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "gguf"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "0", "--api_key", self.api_key]
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
        cmd += ["--interrupt_requests", "False"]
        # its log (a timing report per request) goes to a file: a pipe nobody reads fills up and stops the server
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.base = f"http://127.0.0.1:{port}/v1"
        headers = {"Authorization": f"Bearer {self.api_key}"}
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise UserError(f"llama_cpp.server did not start: {self.log.read().strip()[-500:]}")
            try:
                if httpx.get(f"{self.base}/models", headers=headers).status_code == 200:
                    return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.1)

    client = ServerProcess.client

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> LlamaCppServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--ckpt", help="serve this checkpoint instead of the config's model with random weights")
    p.add_argument("--clients", default="1,8,16", help="concurrency levels, comma-separated (default %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per client (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (default %(default)s)")
    p.add_argument("--dtype", default="fp32", help="serve.py's --dtype (default %(default)s)")
    p.add_argument("--device", default="cpu", help="serve.py's --device (default %(default)s)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve.py --compile: a lone request decoded by the compiled step, compiled at start-up unless one is "
        "kept (default: --no-compile, every step eager)",
    )
    p.add_argument(
        "--vs-llama-cpp",
        action="store_true",
        help="the same levels against llama-cpp-python's server on the model's f32 GGUF (pip install "
        "'llama-cpp-python[server]')",
    )


def bench_checkpoint(config: str, cli: list[str], directory: Path) -> Path:
    margs = decoding_model_args(config, cli)
    torch.manual_seed(0)
    model = GPT(margs)
    tokenizer = CharTokenizer(BENCH_CHARS)  # no end-of-text id: a reply never ends before max_tokens
    path = directory / "ckpt_best.pt"
    save_checkpoint(
        path, {"model": model.state_dict(), "model_args": margs.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    return path


def prompts(n: int) -> list[str]:
    """n different prompts (their first letters differ), in the bench tokenizer's characters."""
    return [f"{BENCH_CHARS[10 + i % 52]}he king said " for i in range(n)]


def load(server: ServerProcess, model: str, clients: int, requests: int, max_tokens: int) -> tuple[float, list[str]]:
    """Aggregate completion tokens/s of `clients` concurrent clients, and each client's last reply."""
    client = server.client(timeout=600)

    def run(prompt: str) -> tuple[int, str]:
        tokens, text = 0, ""
        for _ in range(requests):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            tokens, text = tokens + r.usage.completion_tokens, r.choices[0].text
        return tokens, text

    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(run, prompts(clients)))
        seconds = time.perf_counter() - t0
    return sum(tokens for tokens, _ in results) / seconds, [text for _, text in results]


@dataclass
class Level:
    """One concurrency level's aggregate tokens/s, and whether every client's reply equals its prompt's reply alone."""

    clients: int
    tokens_per_s: float
    same_text: bool


def measure(
    ckpt: str | Path, levels: list[int], requests: int, max_tokens: int, dtype: str, device: str = "cpu", *flags: str
) -> tuple[list[Level], list[str]]:
    """serve.py on ckpt, with these flags too (measure_server)."""
    common = ("--dtype", dtype, "--device", device, "--max-batch", str(max(levels)))
    with ServerProcess(ckpt, *common, *flags, startup_timeout=600) as server:
        return measure_server(server, levels, requests, max_tokens)


def measure_server(
    server: ServerProcess | LlamaCppServer, levels: list[int], requests: int, max_tokens: int
) -> tuple[list[Level], list[str]]:
    """A started server, warmed up, then each level of concurrent greedy clients in turn; and each prompt's reply
    with the server to itself."""
    model = server.client().models.list().data[0].id
    load(server, model, 1, 1, 8)  # warm-up: first-call costs out of the timings
    client = server.client(timeout=600)
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
        for p in prompts(max(levels))
    ]
    rows = []
    for clients in levels:
        rate, texts = load(server, model, clients, requests, max_tokens)
        rows.append(Level(clients, rate, texts == alone[:clients]))
    return rows, alone


def measure_llama_cpp(
    ckpt: Path, directory: Path, levels: list[int], requests: int, max_tokens: int
) -> tuple[list[Level], list[str]]:
    """llama-cpp-python's server on export.py --gguf's f32 file of ckpt, with torch's threads."""
    gguf = directory / "model-f32.gguf"
    export = [sys.executable, "export.py", "--ckpt", str(ckpt), "--gguf", str(gguf), "--outtype", "f32"]
    done = subprocess.run(export, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"export.py --gguf failed: {done.stderr.strip()[-500:]}")
    with LlamaCppServer(gguf, torch.get_num_threads()) as server:
        return measure_server(server, levels, requests, max_tokens)


def print_levels(rows: list[Level]) -> None:
    base = rows[0].tokens_per_s
    print_table(
        ["clients", "tokens/s", "vs first row", "greedy text = 1 client's"],
        [
            [str(r.clients), f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base:.2f}x", "yes" if r.same_text else "NO"]
            for r in rows
        ],
    )


def print_against_llama_cpp(ours: list[Level], theirs: list[Level], same_replies: bool) -> None:
    print_table(
        ["clients", "serve.py tokens/s", "llama_cpp.server tokens/s", "serve.py / llama.cpp", "its text = 1 client's"],
        [
            [
                str(a.clients),
                f"{a.tokens_per_s:,.0f}",
                f"{b.tokens_per_s:,.0f}",
                f"{a.tokens_per_s / b.tokens_per_s:.2f}x",
                "yes" if b.same_text else "NO",
            ]
            for a, b in zip(ours, theirs)
        ],
    )
    print(f"greedy replies of the two servers equal: {'yes' if same_replies else 'no (f32 rounding near ties)'}")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    if args.vs_llama_cpp and not llama_cpp_installed("llama_cpp.server.app"):
        raise UserError("--vs-llama-cpp needs llama-cpp-python's server: pip install 'llama-cpp-python[server]'")
    if args.vs_llama_cpp and (args.device != "cpu" or args.dtype != "fp32"):
        raise UserError("--vs-llama-cpp compares fp32 on the CPU (the f32 GGUF): leave --device and --dtype out")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or bench_checkpoint(args.config, cli, Path(tmp))
        compile_flag = "--compile" if args.compile else "--no-compile"
        rows, ours_alone = measure(ckpt, levels, args.requests, args.max_tokens, args.dtype, args.device, compile_flag)
        if args.vs_llama_cpp:
            theirs, theirs_alone = measure_llama_cpp(Path(ckpt), Path(tmp), levels, args.requests, args.max_tokens)
    print(
        f"serve.py --dtype {args.dtype} --device {args.device} {compile_flag}: {args.requests} requests per client, "
        f"{args.max_tokens} tokens each, greedy; {load_average()}"
    )
    print_levels(rows)
    if args.vs_llama_cpp:
        print(f"\nllama_cpp.server on the f32 GGUF, {torch.get_num_threads()} threads, the same clients:")
        print_against_llama_cpp(rows, theirs, ours_alone == theirs_alone)


MODE = Mode(
    "--serve",
    "serve.py under load: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients",
    __doc__,
    add_arguments,
    run,
)
