"""What serve.py's API accepts: the request bodies (pydantic models, strict), the server's settings, OpenAI's error
shape, and a validated body turned into the batcher's GenRequest. A request names only the model being served: no
field names a file, checkpoint or template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from quillgpt.generate import SEED_MAX, SEED_MIN
from quillgpt.serve.batcher import GenRequest

MAX_STOP = 4  # OpenAI's limit on stop strings


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    block_size: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    control_tokens_in_content: bool = False  # a message that spells a control token gets the token, not its text


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
    top_k: int | None = Field(None, ge=0)  # not OpenAI's (vLLM's and llama.cpp's servers take it): 0 or null is off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # a 64-bit word, as torch's generators take
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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: str | None = None
    messages: list[Any] | None = None


# ---- from a request to the batcher's GenRequest --------------------------------------------------------


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
        top_k=body.top_k or None,
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
