"""The OpenAI-compatible HTTP API serve.py runs: POST /v1/completions, POST /v1/chat/completions (both streamed as
server-sent events with "stream": true), GET /v1/models, and GET /health (slots in use, requests waiting).

FastAPI (request models validated by pydantic) on uvicorn, streaming through sse-starlette, which cancels a stream
whose client has gone (its slot is freed at the engine's next step). Every refusal has OpenAI's error shape,
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
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse

from quillgpt.chat_template import ChatFormat, chat_format, check_messages
from quillgpt.engine import Engine, Finish, GenRequest, Handle, QueueFull
from quillgpt.errors import UserError
from quillgpt.generate import encode_prompt

MAX_STOP = 4  # OpenAI's limit on stop strings
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 1.0  # how often a waiting non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    block_size: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


class APIError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ---- requests -----------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints take. Unknown fields are refused (as OpenAI does), and types are strict: "0.5" is not a
    temperature. n, the penalties and user are accepted only at values that change nothing."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str = ""


class ChatRequest(SamplingFields):
    messages: list[Any]  # checked by chat_template.check_messages: one place for what a conversation is
    max_completion_tokens: int | None = Field(None, ge=1)  # newer clients' name for max_tokens


# ---- the app ------------------------------------------------------------------------------------------


def run_engine(server: uvicorn.Server, engine: Engine, sock: socket.socket) -> None:
    """The web server on a thread of its own, the engine on this one until the server ends or SIGTERM arrives.
    The model runs on the main thread because torch's OpenMP workers serve it fastest there: the same batch-1
    decoding step took 2.5 times as long on another thread (docs/LOG.md)."""
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="quillgpt-http", daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: engine.halt())
    web.start()
    try:
        engine.run(until=lambda: not web.is_alive())
    finally:
        server.should_exit = True
        web.join(timeout=10)


def build_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="quillgpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, settings=settings)
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(RequestValidationError, lambda request, e: validation_error(e, request).response())
    created = int(time.time())
    model_card = {"id": settings.model_name, "object": "model", "created": created, "owned_by": "quillgpt"}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **engine.counts()}

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
                engine.tokenizer, body.prompt, sys.maxsize
            )  # sample.py's encoding; length checked below
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from None
        eot = engine.tokenizer.eot_id
        gen = generation(body, ids, frozenset() if eot is None else {eot}, settings, "prompt", default_max_tokens=16)
        return await respond(engine, gen, body, request, CompletionShape(settings.model_name))

    chat = chat_or_why_not(engine)

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
        return await respond(engine, gen, body, request, ChatShape(settings.model_name))

    return app


def chat_or_why_not(engine: Engine) -> ChatFormat | str:
    """The tokenizer's chat format, or why it has none (the chat endpoint's 400)."""
    try:
        return chat_format(engine.tokenizer)
    except UserError as e:
        return str(e)


def check_model(name: str, settings: ServerSettings, status: int = 400) -> None:
    if name != settings.model_name:
        raise APIError(
            status,
            f"the model {name!r} does not exist: this server serves {settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


def generation(
    body: SamplingFields,
    prompt_ids: list[int],
    stop_ids: frozenset[int],
    settings: ServerSettings,
    prompt_param: str,
    default_max_tokens: int | None = None,
) -> GenRequest:
    """The engine's request: the prompt and max_tokens must fit the context (a reply is never cut short by it)."""
    room = settings.block_size - len(prompt_ids)
    if room < 1:
        raise APIError(
            400,
            f"the prompt is {len(prompt_ids)} tokens: this model's context is {settings.block_size}, with room "
            "for at least one new token needed",
            param=prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens or room)
    elif max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is {max_tokens} but the prompt's {len(prompt_ids)} tokens leave {room} of this model's "
            f"{settings.block_size}-token context",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop takes at most {MAX_STOP} strings, not {len(stop)}", param="stop")
    return GenRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p if body.top_p < 1 else None,
        stop=tuple(s for s in stop if s),
        stop_ids=frozenset(stop_ids),
        seed=body.seed,
        stream=body.stream,
    )


def validation_error(e: RequestValidationError, request: Request) -> APIError:
    """pydantic's first complaint as one OpenAI error: the field in `param`, malformed JSON said plainly."""
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        sent = request.headers.get("content-type", "")
        hint = f" (sent as {sent}: send Content-Type: application/json)" if "json" not in sent else ""
        return APIError(400, f"the body must be a JSON object{hint}")
    param = ".".join(loc)
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)


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


async def respond(engine: Engine, gen: GenRequest, body: SamplingFields, request: Request, shape: CompletionShape):
    try:
        handle = engine.submit(gen, asyncio.get_running_loop())
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
    by sse-starlette on a disconnect) the engine is told, so an abandoned request frees its slot."""
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
        if key is None or not scope["path"].startswith("/v1/"):
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
