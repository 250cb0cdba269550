"""The OpenAI-compatible HTTP API serve.py runs: POST /v1/completions, POST /v1/chat/completions (both streamed as
server-sent events with "stream": true), GET /v1/models, and GET /health (slots in use, requests waiting); and, unless
turned off, a page at / that chats or completes through that same API (add_page; its files are in page/).

FastAPI (request models validated by pydantic) on uvicorn, streaming through sse-starlette, which cancels a stream
whose client has gone (its slot is freed at the batcher's next step). Every refusal has OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}: a bad request 400, a missing or wrong API key 401, a full queue
503 with Retry-After. A request names only the model being served: no field names a file, checkpoint or template.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from quillgpt.chat_template import ChatFormat, chat_format, check_messages
from quillgpt.errors import UserError
from quillgpt.generate import encode_prompt
from quillgpt.serve.batcher import Batcher, Finish, GenRequest, Handle, QueueFull
from quillgpt.serve.requests import (
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    ServerSettings,
    TokenizeRequest,
    check_model,
    generation,
    validation_error,
)

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 1.0  # how often a waiting non-streamed request checks that its client is still there


# ---- the app ------------------------------------------------------------------------------------------


def run_server(server: uvicorn.Server, batcher: Batcher, sock: socket.socket) -> None:
    """The web server on a thread of its own, the batcher on this one until the server ends or SIGTERM arrives.
    The model runs on the main thread because torch's OpenMP workers serve it fastest there: the same batch-1
    decoding step took 2.5 times as long on another thread (docs/LOG.md)."""
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="quillgpt-http", daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: batcher.halt())
    web.start()
    batcher.run(until=lambda: not web.is_alive())
    # SIGTERM (or the web server ending) lets the web server close gracefully. Ctrl-C (KeyboardInterrupt) and errors
    # skip this wait and leave at once (run_main ends the process; the web thread is a daemon): waiting up to 10 s
    # here for the web thread's shutdown was the slow part of Ctrl-C on a loaded machine.
    server.should_exit = True
    web.join(timeout=10)


def build_app(batcher: Batcher, settings: ServerSettings, page: bool = True) -> FastAPI:
    app = FastAPI(title="quillgpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, settings=settings)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(RequestValidationError, lambda request, e: validation_error(e, request).response())
    chat = chat_or_why_not(batcher, settings.control_tokens_in_content)
    # OpenAI's model object, with fields of ours (extra fields keep its shape) that the page shows and decides by:
    # the context, whether the chat endpoint answers, and whether a reply's calculator calls go back as parts
    model_card = {
        "id": settings.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "quillgpt",
        "context_length": settings.block_size,
        "chat": not isinstance(chat, str),
        "tools": ["calculator"] if not isinstance(chat, str) and chat.tools else [],
    }
    if page:
        add_page(app, settings)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **batcher.counts()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, settings, status=404)
        return model_card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, settings)
        try:
            ids = encode_prompt(
                batcher.tokenizer, body.prompt, sys.maxsize
            )  # sample.py's encoding; length checked below
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from None
        eot = batcher.tokenizer.eot_id
        gen = generation(body, ids, frozenset() if eot is None else {eot}, settings, "prompt", default_max_tokens=16)
        return await respond(batcher, gen, body, request, CompletionShape(settings.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model, settings)
        if isinstance(chat, str):
            raise APIError(400, f"this model can't chat: {chat}", param="messages")
        try:
            ids = chat.prompt_ids(check_messages(body.messages, "messages"))
        except UserError as e:
            raise APIError(400, str(e), param="messages") from None
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        gen = generation(body, ids, chat.stop_ids, settings, "messages")
        return await respond(batcher, gen, body, request, ChatShape(settings.model_name))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the ids a prompt, or a conversation rendered as the chat endpoint renders it (the
        assistant's turn opened), comes to, and the model's context. The page fits a conversation by it."""
        check_model(body.model, settings)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "tokenize takes a prompt or messages, one of them", param="prompt")
        try:
            if body.messages is None:
                ids = encode_prompt(batcher.tokenizer, body.prompt, sys.maxsize)
            elif isinstance(chat, str):
                raise APIError(400, f"this model can't chat: {chat}", param="messages")
            else:
                ids = chat.prompt_ids(check_messages(body.messages, "messages"))
        except UserError as e:
            raise APIError(400, str(e), param="prompt" if body.messages is None else "messages") from None
        return {"count": len(ids), "max_model_len": settings.block_size, "tokens": ids}

    return app


# ---- the page: a chat and completion page at / (quillgpt/serve/page), static, through the same API ---------------

PAGE_DIR = Path(__file__).resolve().parent / "page"
PAGE_FILES = {  # route: (file in PAGE_DIR, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page/page.css": ("page.css", "text/css; charset=utf-8"),
    "/page/page.js": ("page.js", "text/javascript; charset=utf-8"),
}
# The page shows untrusted text (the model's, a user's paste): besides rendering it as text, forbid what an injection
# would need, inline script and any other origin, so a slip in page.js still runs nothing and sends nothing away
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a restarted server's new page is fetched, not a stale copy
}


def add_page(app: FastAPI, settings: ServerSettings) -> None:
    """GET / and its two assets, read once here (a missing file fails at start, not at a user's visit), and
    GET /page/server.json: whether the API wants a key, so the page asks for one before it tries. None of them needs
    the key: they hold no data and run nothing; the API they call stays guarded."""
    files = {route: ((PAGE_DIR / name).read_bytes(), media) for route, (name, media) in PAGE_FILES.items()}

    def endpoint(route: str) -> Callable[[], Response]:
        content, media = files[route]
        return lambda: Response(content, media_type=media, headers=PAGE_HEADERS)

    for route in files:
        app.add_api_route(route, endpoint(route), methods=["GET"], include_in_schema=False)

    @app.get("/page/server.json", include_in_schema=False)
    async def page_server() -> JSONResponse:
        return JSONResponse({"api_key_required": settings.api_key is not None}, headers=PAGE_HEADERS)


def chat_or_why_not(batcher: Batcher, control_tokens_in_content: bool) -> ChatFormat | str:
    """The tokenizer's chat format, or why it has none (the chat endpoint's 400)."""
    try:
        return chat_format(batcher.tokenizer, control_tokens_in_content)
    except UserError as e:
        return str(e)


# ---- responses ----------------------------------------------------------------------------------------


class CompletionShape:
    """/v1/completions' objects: text_completion, streamed as text_completion chunks."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model_name: str):
        self.model_name = model_name

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    chunk_choice = choice

    def first_chunk(self) -> dict | None:
        return None


class ChatShape(CompletionShape):
    """/v1/chat/completions' objects: chat.completion with a message, streamed as chat.completion.chunk deltas (the
    first carries the role)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        return {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": finish_reason,
        }

    def first_chunk(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


async def respond(batcher: Batcher, gen: GenRequest, body: SamplingFields, request: Request, shape: CompletionShape):
    try:
        handle = batcher.submit(gen, asyncio.get_running_loop())
    except QueueFull:
        raise APIError(
            503,
            "the server is busy: every slot is taken and the queue is full; retry shortly",
            type="server_error",
            code="server_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from None
    rid, created = f"{shape.id_prefix}{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": rid, "object": shape.object, "created": created, "model": shape.model_name}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = stream_chunks(handle, request, shape, {**head, "object": shape.chunk_object}, include_usage)
        return EventSourceResponse(chunks, ping=15)
    text, finish = "", None
    async for item in events(handle, request, poll_disconnect=True):
        if isinstance(item, Finish):
            finish = item
        else:
            text += item
    if finish is None:  # the client went away: nobody to answer
        return JSONResponse({}, status_code=499)
    if finish.reason == "error":
        raise APIError(500, f"generation failed: {finish.error}", type="server_error")
    return {**head, "choices": [shape.choice(text, finish.reason)], "usage": usage(finish)}


def usage(finish: Finish) -> dict:
    total = finish.prompt_tokens + finish.completion_tokens
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens, "total_tokens": total}


async def events(handle: Handle, request: Request, poll_disconnect: bool) -> AsyncIterator[str | Finish]:
    """The request's text deltas, then its Finish. However it ends (finished, the client gone, the stream cancelled
    by sse-starlette on a disconnect) the batcher is told, so an abandoned request frees its slot."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(handle.queue.get(), timeout=DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if poll_disconnect and await request.is_disconnected():
                    return
                continue
            yield item
            if isinstance(item, Finish):
                return
    finally:
        handle.cancel()  # nothing to do for a finished request: it has left its slot already


async def stream_chunks(
    handle: Handle, request: Request, shape: CompletionShape, head: dict, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shape, ending with data: [DONE]. sse-starlette watches for the client's
    disconnect itself (polling here would read the same receive channel)."""
    first = shape.first_chunk()
    if first is not None:
        yield json.dumps({**head, "choices": [first]})
    async for item in events(handle, request, poll_disconnect=False):
        if isinstance(item, Finish):
            if item.reason == "error":
                yield json.dumps(APIError(500, f"generation failed: {item.error}", type="server_error").body())
                return
            chunk = {**head, "choices": [shape.chunk_choice("", item.reason)]}
            yield json.dumps({**chunk, "usage": None} if include_usage else chunk)
            if include_usage:
                yield json.dumps({**head, "choices": [], "usage": usage(item)})
        else:
            chunk = {**head, "choices": [shape.chunk_choice(item, None)]}
            yield json.dumps({**chunk, "usage": None} if include_usage else chunk)
    yield "[DONE]"


# ---- the guard: API key and body size, before anything reads the request -------------------------------


class Guard:
    """ASGI middleware: with an API key, /v1/ requests must carry it as a bearer token (401 otherwise); a body over
    max_body_bytes is refused with a 400 before the app parses it (it is read here, up to the limit, and replayed)."""

    def __init__(self, app: Callable, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check_key(scope)
        body = b""
        if refusal is None:
            body, refusal = await self.read_body(scope, receive)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def check_key(self, scope: dict) -> APIError | None:
        key = self.settings.api_key
        if key is None or not (scope["path"].startswith("/v1/") or scope["path"] == "/tokenize"):
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer ") and hmac.compare_digest(given[len("Bearer ") :].encode(), key.encode()):
            return None
        what = "a wrong API key" if given else "no API key (Authorization: Bearer KEY)"
        return APIError(401, f"the request carries {what}", code="invalid_api_key")

    async def read_body(self, scope: dict, receive: Callable) -> tuple[bytes, APIError | None]:
        limit = self.settings.max_body_bytes
        too_big = APIError(
            400, f"the request body is over this server's limit of {limit:,} bytes", code="body_too_large"
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return b"", too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_big
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None
