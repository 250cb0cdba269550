"""Continuous batching for serve.py: the main thread owns the model (app.run_server; the web server runs on another)
and decodes one token for every active request per step; new requests join between steps (their prompt prefilled
alone, then their row added to the batch) and a finished or cancelled one leaves at once, so a short reply never
waits for a long one.

The KV cache is one buffer per layer with a row per slot (SlotCache). The active requests keep rows 0..B-1: a
request that leaves hands its row to the last one (a copy of that row's filled positions), so each step runs on the
contiguous first B rows (GPT.decode_rows) and attends only up to the furthest position among them. A request alone
(row 0) is decoded by the compiled one-token step where there is one (serve.py --compile, or one kept by an earlier
`chat.py --compile` of the model's shape: quillgpt/compiled_step.py), over row 0 itself, so the rows' step takes it
over mid-reply when a second request arrives, and gives it back when that one leaves.

A request's tokens follow sample.py's rules (quillgpt.generate): the same prompt encoding, the same sampling
(model.sample_next), the end-of-turn ids and stop strings left out of the text, and text streamed only as far as it
can't yet be the start of a stop string (showable_length).

With a tokenizer that has the calculator tool's tokens, a request's calls are answered as chat.py answers them
(quillgpt/tools.py): after <|python_end|> the output's ids are the row's next tokens, put in one a step in place of
what was sampled, and the text (which spells the tool's tokens) streams them as it streams the rest.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model import GPT, sample_next
from quillgpt.compiled_step import NotLoaded, compiled_step, kept_package
from quillgpt.generate import RowText, showable_length
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import Calculator, calculator_for


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


@dataclass
class Slot:
    """A request being decoded: its row of the cache holds positions 0..position-1; next_token goes at position."""

    handle: Handle
    generator: torch.Generator | None
    row: RowText  # the reply's text, decoded as it grows
    position: int = 0
    next_token: int = 0
    kept: int = 0  # tokens of the reply (an ending id not counted)
    text: str = ""
    shown: int = 0  # characters of text already sent
    sampled: int = 0  # tokens sampled, an ending id included (the usage's completion_tokens)
    calculator: Calculator | None = None  # the tool's state, where the tokenizer has it
    inserted: collections.deque[int] = dataclasses.field(default_factory=collections.deque)  # a tool output's ids


class SlotCache:
    """A KV cache with a row per slot (n_layer buffers of (slots, nkv, length, hs)), for GPT.decode_rows: write()
    puts row i's new k, v at positions[i] and returns rows 0..B-1 up to `length`, the step's attended span."""

    def __init__(self, model: GPT, slots: int, length: int | None = None):
        # the server's: block_size long, so a request never outgrows it (the server checks); a batch of replies
        # whose lengths are known at the start (quillgpt/replies.py) takes no more than it needs
        full = model.new_cache(slots, length)
        self.k, self.v = full.k, full.v
        self.length = full.length

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(k.size(0), device=k.device)
        # k (B, nkv, 1, hs) -> (B, nkv, hs) at (row, :, position), in the cache's dtype (GPT.new_cache's)
        self.k[layer][rows, :, positions] = k[:, :, 0].to(self.k[layer].dtype)
        self.v[layer][rows, :, positions] = v[:, :, 0].to(self.v[layer].dtype)
        B = k.size(0)
        return self.k[layer][:B, :, : self.length], self.v[layer][:B, :, : self.length]

    def fill(self, first: int, k: list[torch.Tensor], v: list[torch.Tensor], each: int = 1) -> None:
        """Prefilled prompts' per-layer k, v (n, nkv, T, hs) into positions 0..T-1 of the rows from `first` on, each
        prompt into `each` rows in a row (a group of replies to it: quillgpt/replies.py)."""
        for layer in range(len(self.k)):
            n, _, T, _ = k[layer].shape
            for buffer, new in ((self.k[layer], k[layer]), (self.v[layer], v[layer])):
                rows = buffer[first : first + n * each]  # (n * each, nkv, L, hs)
                rows.view(n, each, *rows.shape[1:])[:, :, :, :T] = new.unsqueeze(1)  # (n, each, nkv, L, hs)

    def relocate_row(self, src: int, dst: int) -> None:
        """Row src into row dst, whole: mid-step, src may hold one position more than its slot has counted yet."""
        for layer in range(len(self.k)):
            self.k[layer][dst] = self.k[layer][src]
            self.v[layer][dst] = self.v[layer][src]


@dataclass
class FirstRow:
    """Row 0 of a SlotCache's buffers as a batch-1 cache (views, not copies: what the compiled step writes there, the
    rows' step reads, and the other way round)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @staticmethod
    def of(cache: SlotCache) -> FirstRow:
        return FirstRow([b[:1] for b in cache.k], [b[:1] for b in cache.v])


def lone_request_step(model: GPT, cache: SlotCache, compile: bool | None) -> tuple[FirstRow, Callable] | None:
    """The compiled one-token step over row 0 of the slot cache, for a request decoded alone, on a CPU: the kept
    package of the model's shape at batch 1 and the cache's whole length (block_size, as `chat.py --compile` keeps),
    compiled first where compile is True; None where compile is False, none is kept, or the model is not on a CPU."""
    if compile is False or next(model.parameters()).device.type != "cpu":
        return None
    # the slot cache is block_size long, and no kept package of the model is longer: a kept one has this length
    path = kept_package(model, 1, cache.k[0].size(2), build=bool(compile))
    if path is None:
        return None
    row = FirstRow.of(cache)
    try:
        return row, compiled_step(path, model, row)
    except NotLoaded as e:
        print(f"[{e}: decoding eagerly]", file=sys.stderr, flush=True)
        return None


class Batcher:
    """The decoding loop (run, on the main thread: quillgpt.serve.app.run_server). submit() is called from the event
    loop. compile: decode a lone request with the compiled step (lone_request_step; None: only a kept one)."""

    def __init__(
        self, model: GPT, tokenizer: Tokenizer, max_batch: int = 16, max_queue: int = 64, compile: bool | None = None
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = next(model.parameters()).device
        self.calculator = calculator_for(tokenizer)  # None: no tool tokens, no tool
        self.cache = SlotCache(model, max_batch)
        self.lone = lone_request_step(model, self.cache, compile)  # (row 0, its compiled step), or None
        self.active: list[Slot] = []  # active[i] owns row i of the cache
        self.pending: collections.deque[Handle] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.running = True

    # ---- the event loop's side ----------------------------------------------------------------------

    def submit(self, request: GenRequest, loop: asyncio.AbstractEventLoop) -> Handle:
        handle = Handle(request, loop)
        with self.lock:  # waiting beyond the free slots is what the queue bounds
            if len(self.pending) >= self.max_queue + self.max_batch - len(self.active):
                raise QueueFull
            self.pending.append(handle)
        self.wake.set()
        return handle

    def counts(self) -> dict[str, int]:
        """Requests holding a slot and requests waiting for one."""
        with self.lock:
            return {"active": len(self.active), "queued": len(self.pending)}

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
            if not self.active:
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # a failed step fails its requests, not the server
                for slot in list(self.active):
                    self.finish(slot, "error", f"{type(e).__name__}: {e}")

    def drop_cancelled(self) -> None:
        for slot in [s for s in self.active if s.handle.cancelled]:
            self.release(slot)
        with self.lock:
            self.pending = collections.deque(h for h in self.pending if not h.cancelled)

    def admit(self) -> None:
        """Prefill waiting requests into free slots, one forward pass each (as sample.py's prompt pass)."""
        while len(self.active) < self.max_batch:
            with self.lock:
                if not self.pending:
                    return
                handle = self.pending.popleft()
            try:
                self.prefill(handle)
            except Exception as e:
                handle.put(Finish("error", len(handle.request.prompt_ids), 0, f"{type(e).__name__}: {e}"))

    def prefill(self, handle: Handle) -> None:
        request = handle.request
        generator = None
        if request.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        idx = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
        cache = self.model.new_cache(1, idx.size(1))
        logits, _ = self.model(idx, cache=cache, last_only=True)
        slot = Slot(handle, generator, RowText(self.tokenizer, request.prompt_ids), position=idx.size(1))
        slot.calculator = self.calculator() if self.calculator else None
        with self.lock:
            self.active.append(slot)
        self.cache.fill(len(self.active) - 1, cache.k, cache.v)
        self.advance(slot, self.pick(logits[:, -1, :], [slot])[0])

    def step(self) -> None:
        """One token for every active request. The host reads the device once (pick's new tokens): the positions and
        the furthest of them are known here, not read back."""
        tokens = torch.tensor([[s.next_token] for s in self.active], device=self.device)  # (B, 1)
        positions = torch.tensor([s.position for s in self.active], device=self.device)  # (B,)
        if len(self.active) == 1 and self.lone is not None:
            row, compiled = self.lone
            logits = compiled(tokens, positions, row)  # (1, V)
        else:
            self.cache.length = max(s.position for s in self.active) + 1
            logits = self.model.decode_rows(tokens, positions, self.cache)
        for slot, token in zip(list(self.active), self.pick(logits, self.active)):
            slot.position += 1
            self.advance(slot, slot.inserted.popleft() if slot.inserted else token)

    def pick(self, logits: torch.Tensor, slots: list[Slot]) -> list[int]:
        """Each row's next token (B, V) -> B ids, read back in one go: argmax for every row, and over each sampling
        row's, sample_next with its own generator (so a seed gives the same reply whatever else is in the batch),
        all on the device."""
        logits = logits.float()
        if self.tokenizer.vocab_size < logits.size(-1):  # a vocabulary padded for speed: ids with no text
            logits[:, self.tokenizer.vocab_size :] = -float("inf")
        chosen = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        for i, slot in enumerate(slots):
            r = slot.handle.request
            if r.temperature > 0:
                chosen[i] = sample_next(logits[i : i + 1], r.temperature, r.top_k, r.top_p, slot.generator)[0]
        return chosen[:, 0].tolist()

    def advance(self, slot: Slot, token: int) -> None:
        """Take one sampled token: end the reply, or add its text and send what is safe to show."""
        r = slot.handle.request
        slot.sampled += 1
        if token in r.stop_ids:
            self.finish(slot, "stop")
            return
        slot.kept += 1
        slot.next_token = token
        if slot.calculator is not None:
            slot.inserted.extend(slot.calculator.after(token))
        slot.text = slot.row.add(token)
        hits = [slot.text.index(s) for s in r.stop if s in slot.text]
        if hits:
            slot.text = slot.text[: min(hits)]
            self.finish(slot, "stop")
        elif slot.kept >= r.max_tokens:
            self.finish(slot, "length")
        elif r.stream:
            end = showable_length(slot.text, list(r.stop))
            if end > slot.shown:
                slot.handle.put(slot.text[slot.shown : end])
                slot.shown = end

    def finish(self, slot: Slot, reason: str, error: str = "") -> None:
        r = slot.handle.request
        if slot.shown < len(slot.text) and reason != "error":
            slot.handle.put(slot.text[slot.shown :])
        slot.handle.put(Finish(reason, len(r.prompt_ids), slot.sampled, error))
        self.release(slot)

    def release(self, slot: Slot) -> None:
        """Free the slot's row: the last active request moves into it, so rows 0..B-1 stay the active ones."""
        with self.lock:
            row = self.active.index(slot)
            last = self.active.pop()
            if last is not slot:
                self.active[row] = last
        if last is not slot:
            self.cache.relocate_row(len(self.active), row)
