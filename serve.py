"""Serve a checkpoint over an OpenAI-compatible HTTP API (docs/serving.md).

    python serve.py --ckpt checkpoints/base                              # http://127.0.0.1:8000/v1, the page at /
    python serve.py --ckpt checkpoints/chat --port 8080 --api-key s3cret    # requests need Authorization: Bearer s3cret
    python serve.py --ckpt exports/base.safetensors --host 0.0.0.0       # reachable from other machines
    python serve.py --ckpt checkpoints/base-chat --compile    # CPU: a lone request by the compiled step (kept)

Endpoints: POST /v1/chat/completions, POST /v1/completions (both stream with "stream": true), GET /v1/models,
GET /health, and a page at / to chat or complete in a browser (--no-page: the API only). Concurrent requests are
decoded together, one token for each per step (quillgpt/serve/batcher.py); greedy replies (temperature 0) are
sample.py's --temperature 0 replies. --ckpt takes what sample.py's does.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import psutil
import torch

from quillgpt.errors import UserError, run_main
from quillgpt.generate import DEVICES, DTYPES, load_for_sampling

try:
    import uvicorn

    from quillgpt.serve.app import build_app, run_server
    from quillgpt.serve.batcher import Batcher
    from quillgpt.serve.requests import ServerSettings
except ImportError as e:
    SERVE_EXTRA_MISSING = f"serve.py needs {e.name}: pip install '.[serve]'"
else:
    SERVE_EXTRA_MISSING = None


MAX_BATCH, MAX_QUEUE = 4096, 1 << 20  # the numbers --max-batch and --max-queue take at most


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="what sample.py's --ckpt takes")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("QUILLGPT_API_KEY"),
        help="require Authorization: Bearer KEY on /v1/ (default: $QUILLGPT_API_KEY, else no key)",
    )
    p.add_argument("--model-name", help="the model's id in the API (default: --ckpt's last path component, stem)")
    p.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: cuda, else mps, else cpu)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="as sample.py's: auto picks as sample.py and chat.py do, so greedy replies are theirs (the start-up "
        "line says which precision is in use)",
    )
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default %(default)s)")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on a CPU, decode a request that runs alone with the one-token step compiled ahead of time and kept on "
        "disk (compiled at start-up for the model's shape, tens of seconds, unless one is kept: chat.py --compile "
        "keeps the same); default: with a kept one where there is one; --no-compile: eagerly",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting for a slot before 503s (default %(default)s)"
    )
    p.add_argument(
        "--no-page",
        action="store_true",
        help="serve the API only, without the chat and completion page at / (docs/serving.md#the-page)",
    )
    p.add_argument("--max-body-kb", type=int, default=1024, help="largest request body (default %(default)s KiB)")
    p.add_argument(
        "--control-tokens-in-content",
        action="store_true",
        help="a message's text that spells a control token (<|im_end|>, ...) becomes that token, as in transformers' "
        "apply_chat_template, so a client can end its turn and write others' (default: it is encoded as text)",
    )
    args = p.parse_args(argv)
    if not (1 <= args.max_batch <= MAX_BATCH and 0 <= args.max_queue <= MAX_QUEUE and 1 <= args.max_body_kb <= 1 << 20):
        p.error(
            f"--max-batch must be in 1..{MAX_BATCH}, --max-queue in 0..{MAX_QUEUE} and --max-body-kb in 1..{1 << 20}"
        )
    if not 0 <= args.port < 65536:
        p.error("--port must be in 0..65535")
    return args


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is one line at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_slot_memory(model, slots: int) -> None:
    """The slot cache (a row of the whole context per --max-batch slot) must fit in the memory free now: one line
    naming the numbers, not an allocator's traceback."""
    c, p = model.config, next(model.parameters())
    needed = 2 * c.n_layer * slots * c.kv_heads * c.block_size * c.head_width * p.element_size()
    free = psutil.virtual_memory().available if p.device.type == "cpu" else torch.cuda.mem_get_info(p.device)[0]
    if needed > free:
        raise UserError(
            f"--max-batch {slots}: the KV cache's {slots} rows of {c.block_size} positions need {needed / 1e9:.2f} GB, "
            f"and {free / 1e9:.2f} GB are free: serve fewer requests at once"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if SERVE_EXTRA_MISSING:
        raise UserError(SERVE_EXTRA_MISSING)
    sock = listen(args.host, args.port)
    model, tokenizer, plan = load_for_sampling(args.ckpt, args.device, args.dtype, args.compile)
    name = args.model_name or Path(args.ckpt.rstrip("/")).stem
    settings = ServerSettings(
        name, model.config.block_size, args.api_key, args.max_body_kb * 1024, args.control_tokens_in_content
    )
    check_slot_memory(model, args.max_batch)
    batcher = Batcher(model, tokenizer, args.max_batch, args.max_queue, plan)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(batcher, settings, page=not args.no_page), log_level="warning", timeout_graceful_shutdown=5
        )
    )

    host, port = sock.getsockname()[:2]
    root = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    lone = "; a lone request by the compiled step" if batcher.lone else ""
    # one line that scripts read the API's address from (its last word), with the decoding plan
    print(f"serving {name} ({plan.label}{lone}) {plan.describe()} on {root}/v1", flush=True)
    if not args.no_page:
        print(f"the page: {root}/", flush=True)
    run_server(server, batcher, sock)
    return 0


if __name__ == "__main__":
    run_main(main, exit_at_once=True)  # Ctrl-C ends the server at once, however busy the machine (errors.run_main)
