"""--serve: serve.py under load: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients (the openai client, one
thread each, --requests completions of --max-tokens tokens one after another), and whether every level's replies
equal the single client's. The model is the config's with random weights and a tokenizer without an end-of-text id
(every reply --max-tokens long), or --ckpt's. ServerProcess, serve.py in a subprocess, is what the tests start too.
--vs-llama-cpp: the same levels against llama-cpp-python's OpenAI server on export.py --gguf's f32 file, torch's
threads; it answers one request at a time (llama.cpp's C++ llama-server batches; the Python package's does not),
queued (--interrupt_requests False: a new request does not cut short the one under way).
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

from benchmarks.common import GPU_PRESET, REPO, Mode, add_config, bench_model_args, print_table, run_child
from benchmarks.conditions import llama_cpp_installed, load_average
from model import GPT
from quillgpt.checkpoint import save_checkpoint
from quillgpt.errors import UserError
from quillgpt.tokenizer import CharTokenizer

BENCH_CHARS = list("\n !',.:;?" + string.ascii_letters + "0123")  # 65, as tiny Shakespeare's vocabulary


class Server:
    """A server in a subprocess on 127.0.0.1, its OpenAI API at `base` (api_key); a context manager that closes it."""

    def wait_until_up(self, url: str, timeout: float, headers: dict | None = None) -> bool:
        """Poll url until it answers 200 (True) or the process ends (False); past timeout, its error is raised."""
        import httpx

        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            try:
                if httpx.get(url, headers=headers).status_code == 200:
                    return True
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return False

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base, api_key=self.api_key, max_retries=0, **kw)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServerProcess(Server):
    """serve.py on a port it picks (--port 0), ready once /health answers; api_key None serves without a key."""

    def __init__(self, ckpt: str | Path, *flags: str, api_key: str | None = "bench", startup_timeout: float = 120):
        self.api_key = api_key
        cmd = [sys.executable, "serve.py", "--ckpt", str(ckpt), "--port", "0", *flags]
        cmd += [] if api_key is None else ["--api-key", api_key]
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT (close) prints every thread's stack
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # "serving NAME (...) on http://127.0.0.1:PORT/v1" once the model is loaded
        if not line.startswith("serving "):
            self.proc.wait(timeout=30)
            raise UserError(f"serve.py did not start: {self.proc.stderr.read().strip() or line.strip()}")
        self.started = line.strip()  # what it serves, how, and where
        self.base = line.rsplit(" on ", 1)[1].strip()
        self.root, self.pid = self.base.removesuffix("/v1"), self.proc.pid
        if not self.wait_until_up(f"{self.root}/health", startup_timeout):
            raise UserError(f"serve.py ended before it answered: {self.proc.stderr.read().strip()[-500:]}")

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.root}/health").json()

    def close(self) -> None:
        """SIGTERM, as a service manager ends serve.py; one still running a minute later gets SIGABRT, which prints
        where its threads were (PYTHONFAULTHANDLER) to stderr here before it dies; the measurements taken stand."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            stacks = self.proc.communicate(timeout=30)[1]
            print(f"serve.py had not ended 60 s after SIGTERM; its threads were at:\n{stacks}", file=sys.stderr)
        self.proc.stdout.close()
        self.proc.stderr.close()


class LlamaCppServer(Server):
    """llama-cpp-python's OpenAI server on a GGUF file (the model's context: --n_ctx 0), ready once /v1/models is."""

    def __init__(self, gguf: str | Path, threads: int, startup_timeout: float = 120):
        with socket.socket() as s:  # a free port (llama_cpp.server takes no --port 0)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.api_key, self.base = "bench", f"http://127.0.0.1:{port}/v1"
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "gguf", "--n_ctx", "0"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--api_key", self.api_key, "--interrupt_requests", "False"]
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
        # its log (a timing report per request) goes to a file: a pipe nobody reads fills up and stops the server
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        try:
            up = self.wait_until_up(f"{self.base}/models", startup_timeout, {"Authorization": "Bearer bench"})
        except Exception:
            self.close()
            raise
        if not up:
            self.log.seek(0)
            raise UserError(f"llama_cpp.server did not start: {self.log.read().strip()[-500:]}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--ckpt", help="serve this checkpoint instead of the config's model with random weights")
    p.add_argument("--clients", default="1,8,16", help="concurrency levels, comma-separated (default %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="requests per client (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (default %(default)s)")
    p.add_argument("--dtype", default="fp32", help="serve.py's --dtype (default %(default)s)")
    p.add_argument("--device", default="cpu", help="serve.py's --device (default %(default)s)")
    compile_help = "serve.py --compile: a lone request decoded by the compiled step, compiled at start-up unless one"
    compile_help += " is kept (default: --no-compile, every step eager)"
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help=compile_help)
    llama_help = "the same levels against llama-cpp-python's server on the model's f32 GGUF (pip install "
    p.add_argument("--vs-llama-cpp", action="store_true", help=llama_help + "'llama-cpp-python[server]')")


def bench_checkpoint(config: str, cli: list[str], directory: Path) -> Path:
    """The config's model with random weights; BENCH_CHARS have no end-of-text id: no reply ends before max_tokens."""
    margs, path = bench_model_args(config, cli), directory / "ckpt_best.pt"
    torch.manual_seed(0)
    checkpoint = {"model": GPT(margs).state_dict(), "model_args": margs.to_dict()}
    save_checkpoint(path, {**checkpoint, "tokenizer": CharTokenizer(BENCH_CHARS).to_dict()})
    return path


def prompts(n: int) -> list[str]:
    """n different prompts (their first letters differ), in the bench tokenizer's characters."""
    return [f"{BENCH_CHARS[10 + i % 52]}he king said " for i in range(n)]


def load(server: Server, model: str, clients: int, requests: int, max_tokens: int) -> tuple[float, list[str]]:
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

    def same(self) -> str:
        return "yes" if self.same_text else "NO"


def measure(
    ckpt: str | Path, levels: list[int], requests: int, max_tokens: int, dtype: str, device: str = "cpu", *flags: str
) -> tuple[list[Level], list[str]]:
    """serve.py on ckpt, with these flags too (measure_server)."""
    common = ("--dtype", dtype, "--device", device, "--max-batch", str(max(levels)))
    with ServerProcess(ckpt, *common, *flags, startup_timeout=600) as server:
        return measure_server(server, levels, requests, max_tokens)


def measure_server(server: Server, levels: list[int], requests: int, max_tokens: int) -> tuple[list[Level], list[str]]:
    """A started server, warmed up, each level of concurrent greedy clients in turn; and each prompt's reply alone."""
    model = server.client().models.list().data[0].id
    load(server, model, 1, 1, 8)  # warm-up: first-call costs out of the timings
    client, rows = server.client(timeout=600), []
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
        for p in prompts(max(levels))
    ]
    for clients in levels:
        rate, texts = load(server, model, clients, requests, max_tokens)
        rows.append(Level(clients, rate, texts == alone[:clients]))
    return rows, alone


def print_levels(rows: list[Level]) -> None:
    base = rows[0].tokens_per_s
    cells = [[str(r.clients), f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base:.2f}x", r.same()] for r in rows]
    print_table(["clients", "tokens/s", "vs first row", "greedy text = 1 client's"], cells)


def print_against_llama_cpp(ours: list[Level], theirs: list[Level], same_replies: bool) -> None:
    header = ["clients", "serve.py tokens/s", "llama_cpp.server tokens/s", "serve.py / llama.cpp"]
    rows = [
        [str(a.clients), f"{a.tokens_per_s:,.0f}", f"{b.tokens_per_s:,.0f}", f"{a.tokens_per_s / b.tokens_per_s:.2f}x"]
        for a, b in zip(ours, theirs)
    ]
    print_table([*header, "its text = 1 client's"], [row + [b.same()] for row, b in zip(rows, theirs)])
    print(f"greedy replies of the two servers equal: {'yes' if same_replies else 'no (f32 rounding near ties)'}")


def run(args: argparse.Namespace, cli: list[str]) -> None:
    levels = [int(c) for c in args.clients.split(",")]
    if args.vs_llama_cpp and not llama_cpp_installed("llama_cpp.server.app"):
        raise UserError("--vs-llama-cpp needs llama-cpp-python's server: pip install 'llama-cpp-python[server]'")
    if args.vs_llama_cpp and (args.device != "cpu" or args.dtype != "fp32"):
        raise UserError("--vs-llama-cpp compares fp32 on the CPU (the f32 GGUF): leave --device and --dtype out")
    compile_flag = "--compile" if args.compile else "--no-compile"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or bench_checkpoint(args.config, cli, Path(tmp))
        rows, ours_alone = measure(ckpt, levels, args.requests, args.max_tokens, args.dtype, args.device, compile_flag)
        if args.vs_llama_cpp:  # llama-cpp-python's server on export.py --gguf's f32 file, with torch's threads
            gguf = Path(tmp) / "model-f32.gguf"
            run_child([sys.executable, "export.py", "--ckpt", str(ckpt), "--gguf", str(gguf), "--outtype", "f32"])
            with LlamaCppServer(gguf, torch.get_num_threads()) as server:
                theirs, theirs_alone = measure_server(server, levels, args.requests, args.max_tokens)
    print(
        f"serve.py --dtype {args.dtype} --device {args.device} {compile_flag}: {args.requests} requests per client, "
        f"{args.max_tokens} tokens each, greedy; {load_average()}"
    )
    print_levels(rows)
    if args.vs_llama_cpp:
        print(f"\nllama_cpp.server on the f32 GGUF, {torch.get_num_threads()} threads, the same clients:")
        print_against_llama_cpp(rows, theirs, ours_alone == theirs_alone)


SUMMARY = "serve.py under load: aggregate tokens/s of 1, 8 and 16 concurrent greedy clients"
MODE = Mode("--serve", SUMMARY, __doc__, add_arguments, run)
