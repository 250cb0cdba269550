"""Continuous batching for serve.py: the main thread owns the model (app.run_server; the web server runs on another)
and runs the engine (quillgpt/engine.py), one token for every active request per step; new requests join between
steps (their prompt prefilled into a free row of the cache) and a finished or cancelled one leaves at once, so a
short reply never waits for a long one. A request alone is decoded by the compiled step where the plan has one
(serve.py --compile, or one kept for the model's shape), over row 0 of the same cache, so the rows' step takes it
over mid-reply when a second request arrives, and gives it back when that one leaves.

A request's tokens follow sample.py's rules: the same prompt encoding, the same sampling (engine.sample_next, a
generator of its own: a seed gives the same reply whatever else is in the batch), the end-of-turn ids and stop
strings left out of the text, calculator calls answered as chat.py answers them, and text streamed only as far as
it can't yet be the start of a stop string (engine.showable_length).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model import GPT
from quillgpt.engine import Draws, Engine, Row, RowText, Sampling, showable_length
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import calculator_for


class QueueFull(Exception):
    """Every slot is taken and max_queue requests wait already: the server answers 503 with Retry-After."""


@dataclass(frozen=True)
class GenRequest:
    """One completion to generate: prompt_ids fit the context with max_tokens to spare (the server checks)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()  # ids that end the reply, left out of its text (eot, a chat's end of turn)
    seed: int | None = None
    stream: bool = True  # send text as it is made; False: only the whole text, at the end (one wake-up of the server)


@dataclass
class Finish:
    reason: str  # "stop" (an end id or stop string), "length" (max_tokens) or "error"
    prompt_tokens: int
    completion_tokens: int
    error: str = ""


class Handle:
    """The server's side of a request: text deltas then a Finish arrive on `queue`, put there from the batcher's
    thread through the event loop (call_soon_threadsafe). cancel() frees the request's slot at the next step."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[str | Finish] = asyncio.Queue()
        self.cancelled = False

    def put(self, item: str | Finish) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass

    def cancel(self) -> None:
        self.cancelled = True


class Batcher:
    """The decoding loop (run, on the main thread: quillgpt.serve.app.run_server). submit() is called from the event
    loop. plan: the loaded model's decoding plan (generate.plan_decoding; None: eager)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, max_batch: int = 16, max_queue: int = 64, plan=None):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = next(model.parameters()).device
        self.calculator = calculator_for(tokenizer)  # None: no tool tokens, no tool
        # the whole context a row, so that no request outgrows it (the server checks)
        self.engine = Engine(model, plan, capacity=max_batch, vocab_size=tokenizer.vocab_size)
        self.handles: dict[int, Handle] = {}  # id(row) -> its request's handle
        self.sent: dict[int, int] = {}  # id(row) -> characters of its text sent
        self.pending: collections.deque[Handle] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.running = True

    @property
    def lone(self) -> bool:
        """Whether a request alone decodes with a compiled step."""
        return self.engine.lone is not None

    # ---- the event loop's side ----------------------------------------------------------------------

    def submit(self, request: GenRequest, loop: asyncio.AbstractEventLoop) -> Handle:
        handle = Handle(request, loop)
        with self.lock:  # waiting beyond the free slots is what the queue bounds
            if len(self.pending) >= self.max_queue + self.max_batch - len(self.engine.rows):
                raise QueueFull
            self.pending.append(handle)
        self.wake.set()
        return handle

    def counts(self) -> dict[str, int]:
        """Requests holding a slot and requests waiting for one (the rows' count read as it is: one list's length)."""
        with self.lock:
            return {"active": len(self.engine.rows), "queued": len(self.pending)}

    def halt(self) -> None:
        """End run() after its current step (from a signal handler or another thread)."""
        self.running = False
        self.wake.set()

    # ---- the decoding loop ------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Decode until halt() or until() says so (checked at least every half second)."""
        while self.running and not until():
            self.drop_cancelled()
            self.admit()
            if not self.engine.rows:
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a failed step fails its requests, not the server
                for row in list(self.engine.rows):
                    self.finish(row, "error", f"{type(e).__name__}: {e}")

    def drop_cancelled(self) -> None:
        for row in [r for r in self.engine.rows if self.handles[id(r)].cancelled]:
            self.release(row)
        with self.lock:
            self.pending = collections.deque(h for h in self.pending if not h.cancelled)

    def admit(self) -> None:
        """Prefill waiting requests into free rows, one forward pass each (as sample.py's prompt pass)."""
        while len(self.engine.rows) < self.max_batch:
            with self.lock:
                if not self.pending:
                    return
                handle = self.pending.popleft()
            r = handle.request
            generator = None
            if r.temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(r.seed if r.seed is not None else secrets.randbits(63))
            row = Row(
                r.prompt_ids,
                Sampling(r.temperature, r.top_k, r.top_p),
                r.max_tokens,
                stop_ids=r.stop_ids,
                stop=r.stop,
                draws=Draws(generator),
                calculator=self.calculator() if self.calculator else None,
                text=RowText(self.tokenizer, r.prompt_ids),
            )
            try:
                self.engine.add([row])
            except Exception as e:
                handle.put(Finish("error", len(r.prompt_ids), 0, f"{type(e).__name__}: {e}"))
                continue
            self.handles[id(row)], self.sent[id(row)] = handle, 0

    def step(self) -> None:
        """One token for every active request; a request that ends gets the rest of its text and its Finish."""
        for row in self.engine.step():
            handle = self.handles[id(row)]
            if row.finish:
                self.finish(row, row.finish)
            elif handle.request.stream:
                end = showable_length(row.shown, handle.request.stop)
                if end > self.sent[id(row)]:
                    handle.put(row.shown[self.sent[id(row)] : end])
                    self.sent[id(row)] = end

    def finish(self, row: Row, reason: str, error: str = "") -> None:
        handle = self.handles.pop(id(row))
        sent = self.sent.pop(id(row))
        if sent < len(row.shown) and reason != "error":
            handle.put(row.shown[sent:])
        handle.put(Finish(reason, len(handle.request.prompt_ids), len(row.new), error))
        if row.slot >= 0:  # an error mid-step: still holding its row
            self.engine.drop(row)

    def release(self, row: Row) -> None:
        """A cancelled request leaves: its row goes to the last one's (rows 0..B-1 stay the ones in use)."""
        self.handles.pop(id(row), None)
        self.sent.pop(id(row), None)
        self.engine.drop(row)
