"""Decoding: every way a model writes text goes through one Engine (as nanochat's does), over one KV cache with a row
per sequence. sample.py's samples, chat.py's conversation, serve.py's concurrent requests, RL's groups of replies
and eval.py's chat tasks are all rows of it.

    engine = Engine(model, tokenizer, plan)          # plan: precision, step, products (quillgpt.generate)
    engine.add([Row(prompt_ids, Sampling(0.8, 200), max_new=500)])   # prefill: the prompt's keys and values
    while engine.rows:
        for row in engine.step():                    # one token for every row still going
            ...row.new[-1], row.text, row.finish

A step first takes each row's next token from the logits it has (greedy, or drawn among the top-k / top-p; a
calculator's output goes in unsampled, quillgpt/tools.py), ends the rows that stop (an end id, a stop string, their
length), then runs the model once on the last token of every row still going: rows at one position (a lone request,
sample.py's samples) attend over the filled prefix of the cache, rows at their own positions (continuous batching)
over the whole span with a mask. A lone row decodes with the compiled step where the plan has one
(quillgpt/compiled_step.py), which writes the same cache. A finished row leaves at once; the last row takes its
place, so the rows in use are always the first ones.

Rows that share a torch.Generator (Draws) draw one number each per step, the finished ones too: a row's draws never
depend on when the others end, so a seed repeats a reply alone or in a batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from model import visible_keys
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import Calculator

# a prefill of several prompts holds at most this much fp32 logits a pass (one prompt at least)
PROMPT_LOGITS_BYTES = 64 << 20


# ---- the cache -------------------------------------------------------------------------------------------------


def cache_length(needed: int, block_size: int) -> int:
    """A power of two >= needed (and >= 64), at most block_size: few distinct lengths, so few compiled graphs and
    allocations the allocator can reuse."""
    return min(block_size, max(64, 1 << (max(needed, 1) - 1).bit_length()))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One query per row and head against keys (B or 1, nkv, S, hs), `visible` (B or 1, S) masking the rest: q (B, nh,
    1, hs) -> (B, nh, 1, hs). Written out rather than SDPA so that torch.compile fuses it (SDPA's CPU flash kernel
    with a mask stood out in the compiled step's profile: docs/LOG.md)."""
    B, nh, _, hs = q.shape
    nkv = k.size(1)
    q = q.view(B, nkv, nh // nkv, hs)  # (B, nkv, group, hs): grouped-query attention without copying k, v
    # (B, nkv, group, S). A bf16 batched matmul copies a transposed operand (k's, the big one), so there k comes
    # first; fp32's (MKL) takes it as it is, and is slow with a one-column second operand (docs/LOG.md)
    if q.dtype == torch.float32:
        scores = q @ k.transpose(-2, -1)
    else:
        scores = (k @ q.transpose(-2, -1)).transpose(-2, -1)
    scores = scores.float() * hs**-0.5
    probs = scores.masked_fill(~visible.view(-1, 1, 1, visible.size(-1)), float("-inf")).softmax(-1).to(v.dtype)
    return (probs @ v).view(B, nh, 1, hs)


class KVCache:
    """Keys and values of `rows` sequences, `length` positions each, one (rows, nkv, length, hs) buffer per layer, and
    each row's position (how many of its positions are written). Zero-filled: the compiled step attends over a whole
    row with the unwritten part masked, and a masked NaN would still poison the output (0 * NaN).

    Before a forward pass the engine says what it holds (prepare): the first B rows, and T new tokens each; the model
    then asks the cache for its positional tables (pick, reach) and, in every layer, to store and attend (attend)."""

    def __init__(self, n_layer: int, rows: int, kv_heads: int, length: int, head_dim: int, device, dtype):
        shape = (rows, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.ids = torch.zeros((rows, length), dtype=torch.long, device=device)  # each position's token (smear's)
        self.length = length
        self.positions = [0] * rows  # positions written, per row (host ints: read without waiting for the device)
        self.prepare(1, 1)

    @classmethod
    def for_model(cls, model, rows: int, length: int) -> KVCache:
        """A cache for the model, in the dtype its keys and values come in: the weights', or under autocast (RL's
        sampler) autocast's, which holds them exactly and is attended without converting the cache every step (a
        quarter of RL's sampling time when the cache was fp32: docs/LOG.md)."""
        c, p = model.config, model.transformer.wte.weight  # the head may be int8
        autocast = torch.amp.is_autocast_available(p.device.type) and torch.is_autocast_enabled(p.device.type)
        dtype = torch.get_autocast_dtype(p.device.type) if autocast else p.dtype
        return cls(c.n_layer, rows, c.kv_heads, min(length, c.block_size), c.head_width, p.device, dtype)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def prepare(self, batch: int, tokens: int) -> None:
        """The next forward pass: `tokens` new tokens for each of the first `batch` rows, after what each holds. Rows
        at one position (shared) read the filled prefix; rows at their own, one token each, read the span up to the
        furthest of them, masked row by row."""
        starts = self.positions[:batch]
        self.batch, self.tokens, self.start = batch, tokens, starts[0]
        self.shared = all(s == starts[0] for s in starts)
        assert self.shared or tokens == 1, "rows at different positions take one token each"
        assert max(starts) + tokens <= self.length, "the cache is full"
        if not self.shared:
            self.span = max(starts) + 1
            self.at = torch.tensor(starts, device=self.device)  # (B,)
            self.rows = torch.arange(batch, device=self.device)
            self.visible = torch.arange(self.span, device=self.device) <= self.at[:, None]  # (B, span)

    def advance(self) -> None:
        for i in range(self.batch):
            self.positions[i] += self.tokens

    def pick(self, table: torch.Tensor) -> torch.Tensor:
        """The rows of a per-position table (T_max, d) at the new tokens' positions: (T, d), or (B, 1, d) for rows
        at their own positions."""
        if self.shared:
            return table[self.start : self.start + self.tokens]
        return table[self.at].unsqueeze(1)

    def reach(self):
        """The furthest position the pass reads, per row where the rows differ (B, 1, 1): LongRoPE's switch."""
        return self.start + self.tokens - 1 if self.shared else self.at.view(-1, 1, 1)

    def previous(self, idx: torch.Tensor) -> torch.Tensor:
        """Keep the new tokens idx (B, T) and give the token before each (B, T), -1 before a row's first (smear)."""
        if not self.shared:
            self.ids[self.rows, self.at] = idx[:, 0]
            before = self.ids[self.rows, (self.at - 1).clamp(min=0)].masked_fill(self.at == 0, -1)
            return before.unsqueeze(1)  # (B, 1)
        B, start, end = self.batch, self.start, self.start + self.tokens
        self.ids[:B, start:end] = idx
        first = self.ids[:B, start - 1 : start] if start > 0 else torch.full_like(idx[:, :1], -1)
        return torch.cat([first, idx[:, :-1]], dim=1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        """Store the new keys and values (B, nkv, T, hs) and attend the queries (B, nh, T, hs) over what the rows hold:
        the filled prefix (a window's part of it), causally among the new tokens."""
        kb, vb = self.k[layer], self.v[layer]
        B, T = self.batch, self.tokens
        if not self.shared:
            kb[self.rows, :, self.at] = k[:, :, 0].to(kb.dtype)  # (B, nkv, hs) at (row, :, its position)
            vb[self.rows, :, self.at] = v[:, :, 0].to(vb.dtype)
            visible = self.visible
            if window:
                visible = visible & (torch.arange(self.span, device=q.device) > self.at[:, None] - window)
            return masked_attention(q, kb[:B, :, : self.span].to(q.dtype), vb[:B, :, : self.span].to(q.dtype), visible)
        start, end = self.start, self.start + T
        kb[:B, :, start:end] = k
        vb[:B, :, start:end] = v
        first = max(0, end - window) if window and T == 1 else 0  # one new token: only its window is read
        keys, values = kb[:B, :, first:end].to(q.dtype), vb[:B, :, first:end].to(q.dtype)
        grouped = k.size(1) != q.size(1)
        if T == 1 or (start == 0 and not window):  # the prefix or the prompt alone: no mask but causality
            return F.scaled_dot_product_attention(q, keys, values, is_causal=T > 1, enable_gqa=grouped)
        mask = visible_keys(torch.arange(start, end, device=q.device), end, window)[:, first:]  # (T, S)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)

    # ---- rows: filled from a prefill, moved, grown ----

    def fill(self, slot: int, read: KVCache, i: int, copies: int, length: int) -> None:
        """Row i of a prefill's cache `read` (its first `length` positions) into `copies` rows from `slot` on (a group
        of replies to one prompt)."""
        for buffers, new in ((self.k, read.k), (self.v, read.v)):
            for buffer, kv in zip(buffers, new):
                buffer[slot : slot + copies, :, :length] = kv[i : i + 1, :, :length]
        self.ids[slot : slot + copies, :length] = read.ids[i : i + 1, :length]
        self.positions[slot : slot + copies] = [length] * copies

    def copy_row(self, src: int, dst: int) -> None:
        """Row src into row dst, whole."""
        for buffer in (*self.k, *self.v, self.ids):
            buffer[dst] = buffer[src]
        self.positions[dst] = self.positions[src]


class GraphCache:
    """The compiled step's view of one row of a KVCache (batch 1): the whole row is attended with its unwritten
    positions masked, so that every position runs one graph, and the position is a tensor on the device (an
    exported graph would be specialised to a host int). quillgpt/compiled_step.py exports the model over it."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], position: torch.Tensor, ids=None):
        self.k, self.v, self.position, self.ids = k, v, position, ids  # (1, nkv, L, hs) each, (1,), (1, L) for smear
        self.length = k[0].size(2)
        self.visible = torch.arange(self.length, device=position.device) <= position  # (L,)

    def pick(self, table: torch.Tensor) -> torch.Tensor:
        return table.index_select(0, self.position)  # (1, d)

    def reach(self) -> torch.Tensor:
        return self.position

    def previous(self, idx: torch.Tensor) -> torch.Tensor:
        self.ids.index_copy_(1, self.position, idx)
        before = self.ids.index_select(1, (self.position - 1).clamp(min=0))  # (1, 1)
        return before.masked_fill(self.position == 0, -1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        self.k[layer].index_copy_(2, self.position, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, self.position, v.to(self.v[layer].dtype))
        visible = self.visible
        if window:
            visible = visible & (torch.arange(self.length, device=q.device) > self.position - window)
        keys, values = self.k[layer].to(q.dtype), self.v[layer].to(q.dtype)
        return masked_attention(q, keys, values, visible.view(1, -1))


# ---- sampling --------------------------------------------------------------------------------------------------


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """(B, V) logits -> (B, 1) token ids; temperature 0 (or no uniforms) is greedy. uniforms (B, 1) in [0, 1): one
    number a row, from its generator (Draws).

    The draw is made among the candidates only (the top-k, then the top-p of them), not over the whole vocabulary
    with the rest masked: the same distribution, but a draw's cost grows with the tensor it is given, and over a
    GPT-2 vocabulary it cost more than a small model's whole step. Off the CPU nothing is read back to the host:
    there the top-p candidates are masked among the top-k, not cut out (the same distribution again)."""
    if temperature <= 0 or uniforms is None:
        return logits.argmax(dim=-1, keepdim=True)
    vocab = logits.size(-1)
    k = min(top_k, vocab) if top_k is not None and top_k > 0 else vocab
    nucleus = top_p is not None and 0 < top_p < 1
    if k == vocab and not nucleus:
        return draw(F.softmax(logits / temperature, dim=-1), uniforms)
    logits, ids = torch.topk(logits, k)  # (B, k), best first (a temperature keeps the order: applied after)
    logits = logits / temperature
    if nucleus:
        probs = logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(drop, -float("inf"))
        if logits.device.type == "cpu":
            # the widest row's nucleus: the columns after it hold no candidate. On the CPU its width costs nothing to
            # read and narrows the draw; on a GPU reading it would wait for the device, so the draw keeps all k
            keep = int((~drop).sum(dim=-1).max())
            logits, ids = logits[:, :keep], ids[:, :keep]
    return ids.gather(-1, draw(F.softmax(logits, dim=-1), uniforms))


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One column per row of probs (B, n) -> (B, 1), by inverse CDF from the row's uniform number: on a CPU,
    multinomial draws an exponential number per entry, slowly (most of a rollout's sampling: 144 rows of a
    130-token vocabulary). The sums are in float64 (but on Apple's MPS, which has none), so that the last columns'
    mass is not lost to rounding; the search finds the first column whose sum passes the draw, never a column of
    mass 0."""
    cdf = probs.to(torch.float32 if probs.device.type == "mps" else torch.float64).cumsum(-1)  # (B, n)
    return torch.searchsorted(cdf, uniforms.to(cdf.dtype) * cdf[:, -1:], right=True)  # u * the total stays below it


class Draws:
    """A generator shared by `size` rows (a sample.py batch, an RL step's replies): each step it gives each of them a
    number, rows that have ended included (uniforms), so that a row's draws do not depend on when others end."""

    def __init__(self, generator: torch.Generator | None, size: int = 1):
        self.generator, self.size = generator, size
        self.step, self.numbers = -1, None

    def uniforms(self, step: int, device: torch.device) -> torch.Tensor:
        if self.step != step:
            self.step = step
            dtype = torch.float32 if device.type == "mps" else torch.float64  # draw's sums' dtype
            self.numbers = torch.rand(self.size, 1, generator=self.generator, device=device, dtype=dtype)
        return self.numbers


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None  # None or 0: all
    top_p: float | None = None  # None or 1: all


GREEDY = Sampling(0.0)


# ---- text as it grows ------------------------------------------------------------------------------------------


def showable_length(text: str, stop: list[str] | tuple[str, ...]) -> int:
    """How much of a growing text can be shown: not a cut-off UTF-8 character, nor what may begin a stop string."""
    n = len(text.rstrip("\ufffd"))
    held = max((k for s in stop for k in range(1, len(s)) if text[:n].endswith(s[:k])), default=0)
    return n - held


class RowText:
    """The text of a growing row of ids, decoded as it grows: each token's text is decoded after the 8 ids before
    it (context enough for a sentencepiece space, as for the prompt) and kept once it ends in a whole character, so
    a token costs the decoding of a few ids, not of the whole row."""

    CONTEXT = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-self.CONTEXT :])  # the ids before the pending ones
        self.pending: list[int] = []  # ids whose text may still end in a cut-off UTF-8 character
        self.kept = ""

    def add(self, token: int) -> str:
        """Append one id; returns the row's whole text (U+FFFD where a character is not complete yet)."""
        self.pending.append(token)
        tail = self.tokenizer.decode_after(self.context, self.pending)
        if tail.endswith("\ufffd"):
            return self.kept + tail
        self.kept += tail
        self.context = (self.context + self.pending)[-self.CONTEXT :]
        self.pending = []
        return self.kept


# ---- rows and the engine ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Row:
    """One sequence being decoded: its prompt, how it samples and when it ends; the engine fills in the rest."""

    prompt: list[int]
    sampling: Sampling = GREEDY
    max_new: int = 256  # tokens it may take, a calculator's output and the ending id included
    stop_ids: frozenset[int] = frozenset()  # ids that end it (eot, a chat's end of turn): in new, not in text
    stop: tuple[str, ...] = ()  # texts that end it, left out of its text
    draws: Draws | None = None  # where its random numbers come from (None: its own unseeded generator, if sampling)
    draw_index: int = 0  # its place among the rows of draws
    calculator: Calculator | None = None  # the tool's state, where the tokenizer has it
    text: RowText | None = None  # its text as it grows (Engine.add gives one where stop strings need it)
    # filled in as it decodes
    new: list[int] = field(default_factory=list)  # the ids it took, sampled or inserted
    sampled: list[bool] = field(default_factory=list)  # per id of new: sampled (False: a calculator output)
    shown: str = ""  # its text so far, stop strings cut (row.text's, where it has one)
    finish: str | None = None  # "stop" (an end id or stop string) or "length"
    inserted: collections.deque[int] = field(default_factory=collections.deque)  # a tool output's ids, next
    slot: int = -1  # its row of the cache

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.new


class Engine:
    """The decoding loop: rows join (add: their prompts prefilled), each step() gives every row its next token, and a
    row leaves when it ends or is dropped. plan (quillgpt.generate.DecodingPlan): the step it decodes with; None:
    eager. capacity: rows at once; length: positions a row may hold (the cache's; the model's context at most);
    vocab_size: the tokenizer's, the ids that may be sampled."""

    def __init__(self, model, plan=None, capacity: int = 1, length: int | None = None, vocab_size: int | None = None):
        self.model, self.plan = model, plan
        self.device = model.transformer.wte.weight.device
        self.block_size = model.config.block_size
        self.capacity = capacity
        # the ids that may be sampled: the tokenizer's (a vocabulary padded for speed has ids with no text)
        self.vocab = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.rows: list[Row] = []  # rows[i] is in row i of the cache
        self.logits: torch.Tensor | None = None  # (rows, V): each row's next-token logits
        self.steps = 0
        self.cache, self.lone = self.new_cache(length or self.block_size)

    def new_cache(self, length: int) -> tuple[KVCache, Callable | None]:
        """The cache and the plan's compiled step for a lone row over its first row, where the plan has one (a kept
        package's cache length becomes the cache's): (token (1, 1), cache) -> logits (1, V), the position advanced."""
        if self.plan is not None and (made := self.plan.lone_step(self.model, self.capacity, length)) is not None:
            return made
        return KVCache.for_model(self.model, self.capacity, length), None

    # ---- rows joining and leaving ----

    @torch.inference_mode()
    def add(self, rows: list[Row]) -> None:
        """Prefill the rows' prompts into free rows of the cache (rows given the same prompt list, a group of replies
        to it, read it once); their first tokens come at the next step. A prompt is cut to its last block_size ids
        (the caller says so, where it matters); a row whose text matters (stop strings, streaming) brings its RowText."""
        assert len(self.rows) + len(rows) <= self.capacity, "more rows than the engine holds"
        by_prompt: dict[int, list[Row]] = {}
        for row in rows:
            by_prompt.setdefault(id(row.prompt), []).append(row)
        groups = list(by_prompt.values())
        for group in groups:
            prompt = group[0].prompt[-self.block_size :] or [0]
            for row in group:
                row.prompt = prompt
        needed = max(len(r.prompt) + r.max_new for r in rows)
        if needed > self.cache.length and self.cache.length < self.block_size:
            self.resize(cache_length(needed, self.block_size))
        logits = [self.logits] if self.logits is not None else []
        done = 0
        for (read, last), chunk in self.read([group[0].prompt for group in groups]):
            for i, prompt in enumerate(chunk):
                group, slot = groups[done + i], len(self.rows)
                self.cache.fill(slot, read, i, len(group), len(prompt))
                for j, row in enumerate(group):
                    row.slot = slot + j
                    self.rows.append(row)
                logits.append(last[i : i + 1].expand(len(group), -1))
            done += len(chunk)
        self.logits = torch.cat(logits)

    def read(self, prompts: list[list[int]]) -> Iterator[tuple[tuple[KVCache, torch.Tensor], list[list[int]]]]:
        """The prompts' cache (keys, values, tokens) and last logits, in passes of prompts right-padded to the longest
        (causal attention keeps a prompt blind to the padding after it), each pass's fp32 logits at most
        PROMPT_LOGITS_BYTES."""
        width = max(map(len, prompts))
        per_pass = max(1, PROMPT_LOGITS_BYTES // (4 * width * self.model.config.vocab_size))
        for start in range(0, len(prompts), per_pass):
            chunk = prompts[start : start + per_pass]
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, prompt in enumerate(chunk):
                ids[i, : len(prompt)] = torch.tensor(prompt)
            read = KVCache.for_model(self.model, len(chunk), width)
            read.prepare(len(chunk), width)
            logits, _ = self.model(ids.to(self.device), cache=read)  # (n, width, V)
            last = torch.stack([logits[i, len(p) - 1] for i, p in enumerate(chunk)])
            yield (read, last), chunk

    def drop(self, row: Row) -> None:
        """The row leaves: the last row moves into its place (rows 0..n-1 stay the ones in use)."""
        i = self.rows.index(row)
        last = len(self.rows) - 1
        if i != last:
            self.cache.copy_row(last, i)
            self.logits[i] = self.logits[last]
            self.rows[i] = self.rows[last]
            self.rows[i].slot = i
        self.rows.pop()
        self.logits = self.logits[: len(self.rows)]
        row.slot = -1

    def resize(self, length: int, rows: int | None = None) -> None:
        """A longer cache holding the first `rows` rows (default: those in use) as they are (chat's conversation
        growing, a prompt longer than the cache)."""
        old, n = self.cache, len(self.rows) if rows is None else rows
        self.cache, self.lone = self.new_cache(length)
        held = min(old.length, self.cache.length)
        for new, kept in zip(self.cache.k + self.cache.v, old.k + old.v):
            new[:n, :, :held] = kept[:n, :, :held]
        self.cache.ids[:n, :held] = old.ids[:n, :held]
        self.cache.positions = list(old.positions)

    # ---- one step ----

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """Every row's next token: sampled from its logits (or a calculator output put in), added, and the rows that
        end dropped; then the model reads the token of every row still going. Returns the rows that took a token."""
        rows = list(self.rows)
        tokens = self.pick(rows)
        for row, token in zip(rows, tokens):
            forced = bool(row.inserted)
            token = row.inserted.popleft() if forced else token
            self.take(row, token, not forced)
        for row in [r for r in rows if r.finish]:
            self.drop(row)
        if self.rows:
            self.feed([row.new[-1] for row in self.rows])
        self.steps += 1
        return rows

    def pick(self, rows: list[Row]) -> list[int]:
        """Each row's next token from its logits, read back in one go: argmax for the greedy rows, and each group of
        rows drawing from one generator sampled together with its numbers, all on the device."""
        logits = self.logits[:, : self.vocab].float()
        chosen = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.sampling.temperature > 0:
                row.draws = row.draws or Draws(None)
                groups.setdefault(id(row.draws), []).append(i)
        for members in groups.values():
            first = rows[members[0]]
            numbers = first.draws.uniforms(self.steps, self.device)  # (size, 1)
            places = [rows[i].draw_index for i in members]
            if places != list(range(numbers.size(0))):  # some of the group's rows have ended, or it is not in order
                numbers = numbers[torch.tensor(places, device=self.device)]
            s = first.sampling
            if len(members) == len(rows):  # every row draws from this generator, in order: no gather
                chosen = sample_next(logits, s.temperature, s.top_k, s.top_p, numbers)
            else:
                at = torch.tensor(members, device=self.device)
                chosen[at] = sample_next(logits[at], s.temperature, s.top_k, s.top_p, numbers)
        return chosen[:, 0].tolist()

    def take(self, row: Row, token: int, sampled: bool) -> None:
        """Add one token to the row and decide whether it ends there."""
        row.new.append(token)
        row.sampled.append(sampled)
        if token in row.stop_ids:
            row.finish = "stop"
            return
        if row.calculator is not None:
            row.inserted.extend(row.calculator.after(token))
        if row.text is not None:
            row.shown = row.text.add(token)
            hits = [row.shown.index(s) for s in row.stop if s in row.shown]
            if hits:
                row.shown, row.finish = row.shown[: min(hits)], "stop"
                return
        if len(row.new) >= row.max_new:
            row.finish = "length"

    def feed(self, tokens: list[int]) -> None:
        """The model reads one token for each row in use: the compiled step for a lone row where there is one, else
        the eager step over the rows' cache. A row whose cache is full first starts again from its last
        block_size / 2 ids (learned positions make a sliding window impossible)."""
        if any(p >= self.cache.length for p in self.cache.positions[: len(self.rows)]):
            self.refill()
        B = len(self.rows)
        x = torch.tensor(tokens, device=self.device).view(B, 1)
        if B == 1 and self.lone is not None:
            self.logits = self.lone(x, self.cache)  # (1, V), the row's position advanced
            return
        self.cache.prepare(B, 1)
        logits, _ = self.model(x, cache=self.cache)
        self.cache.advance()
        self.logits = logits[:, -1, :]

    def refill(self) -> None:
        """Rows whose cache is full: a longer cache where the context allows, else (sample.py past block_size) each
        such row's last block_size / 2 ids, tokens taken so far, read again from position 0."""
        if self.cache.length < self.block_size:
            return self.resize(cache_length(self.cache.length + 1, self.block_size))
        full = [row for row in self.rows if self.cache.positions[row.slot] >= self.cache.length]
        recent = [row.ids[-(self.block_size // 2) : -1] for row in full]  # the last id is fed by this step
        done = 0
        for (read, _), chunk in self.read(recent):
            for i, ids in enumerate(chunk):
                self.cache.fill(full[done + i].slot, read, i, 1, len(ids))
            done += len(chunk)

    # ---- conversations: one row kept across turns ----

    @torch.inference_mode()
    def extend(self, row: Row, ids: list[int], keep: int, room: int | None = None) -> None:
        """The row, the engine's only one in row 0 of the cache, keeping its first `keep` positions and reading
        `ids` after them in one pass, with room for `room` tokens more (default: its max_new): a conversation's next
        turn, after what its cache already holds. Its next token comes at the next step."""
        assert all(r is row or r.finish for r in self.rows), "a conversation is the engine's only row"
        self.rows, row.slot = [row], 0
        needed = keep + len(ids) + (row.max_new if room is None else room)
        if needed > self.cache.length:
            self.resize(cache_length(needed, self.block_size), rows=1)
        self.cache.positions[0] = keep
        self.cache.prepare(1, len(ids))
        logits, _ = self.model(torch.tensor([ids], device=self.device), cache=self.cache, last_only=True)
        self.cache.advance()
        self.logits = logits[:, -1, :]


@torch.inference_mode()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    vocab_limit: int | None = None,
    plan=None,
) -> torch.Tensor:
    """(B, T) prompts -> (B, T' + max_new_tokens), each row continued through the engine, no row ever stopping (the
    prompts cropped to their last block_size ids); nanoGPT's model.generate. vocab_limit: the ids that may be drawn
    (a vocabulary padded for speed)."""

    block = model.config.block_size
    prompts = [idx[i, -block:].tolist() for i in range(idx.size(0))]
    shared = [prompts[0]] * len(prompts) if all(p == prompts[0] for p in prompts) else prompts  # read once
    draws = Draws(generator, len(prompts))
    rows = [
        Row(p, Sampling(temperature, top_k, top_p), max_new_tokens, draws=draws, draw_index=i)
        for i, p in enumerate(shared)
    ]
    length = cache_length(len(prompts[0]) + max_new_tokens, block)
    engine = Engine(model, plan, capacity=len(rows), length=length, vocab_size=vocab_limit)
    engine.add(rows)
    while engine.rows:
        engine.step()
    return torch.tensor([row.ids for row in rows], device=idx.device)
