"""How a model is scored: bits per byte on text, HellaSwag, and the continuation log-probabilities both rest on.

- Bits per byte: the nats of every scored token / ln 2 / the UTF-8 bytes those tokens stand for.
  Unlike a loss per token it ranks a char model, a 4k BPE and GPT-2 on the same text. Texts longer
  than the context are scored in windows of block_size tokens, each new window moving `stride`
  tokens on and scoring only the tokens the previous one did not (so each has at least
  block_size - stride tokens of context). A tokenizer with <|endoftext|> puts it before every
  document, so that the first token is scored too; <|endoftext|> itself is never scored (0 bytes).
- HellaSwag, 0-shot, completion style (as llm.c and build-nanogpt score it): each of the 4 endings,
  with a space before it, is scored by the model's log-probability of its tokens after the context;
  acc picks the ending with the highest sum, acc_norm the highest mean per token. All 4 endings of
  an item go through the model in one forward pass (several items at once).
- continuation_logprobs: the log-probability of a continuation after a context, and whether it is
  the greedy one, for any batch of (context, continuation) pairs: HellaSwag's scorer and the
  lm-evaluation-harness adapter (lm_harness.py) both use it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from model import GPT
from quillgpt.errors import UserError
from quillgpt.tokenizer import CharTokenizer, Tokenizer

LOGITS_BUDGET = 2**22  # floats of logits per forward pass on the CPU (16 MiB in fp32): fewer rows for big vocabularies
GPU_MEMORY_SHARE = 8  # on a GPU a pass's logits and activations take at most this fraction of its free memory
ACTIVATION_WIDTHS = 16  # a token's activations in a pass, in floats of the model's width (q, k, v, MLP, residual...)


# ---- text: loss, perplexity, bits per byte ------------------------------------------------------


@dataclass
class TextScore:
    nats: float  # summed over the scored tokens
    tokens: int  # scored tokens (<|endoftext|> is not scored)
    bytes: int  # UTF-8 bytes of the scored tokens

    @property
    def loss(self) -> float:
        return self.nats / max(1, self.tokens)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.loss, 50))

    @property
    def bpb(self) -> float:
        return self.nats / math.log(2) / max(1, self.bytes)


def document_streams(tokenizer: Tokenizer, documents: Iterable[str]) -> list[np.ndarray]:
    """Token streams to score: with <|endoftext|>, one stream of every document after it (nothing goes unscored);
    without it, each document alone (its first token has no context and is not scored). A tokenizer's BOS starts
    every document, as in training."""
    bos = np.array([tokenizer.bos_id] if tokenizer.bos_id is not None else [], dtype=np.int64)
    encoded = [np.concatenate([bos, tokenizer.encode_array(d).astype(np.int64)]) for d in documents if d]
    if tokenizer.eot_id is None:
        return encoded
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    return [np.concatenate([piece for doc in encoded for piece in (eot, doc)] or [eot])]


def rows_per_pass(model: GPT, device: torch.device) -> int:
    """Windows of block_size tokens one forward pass scores. On the CPU as many as LOGITS_BUDGET holds the logits of
    (cache-sized); on a CUDA device as many as fit in 1/GPU_MEMORY_SHARE of its free memory with their activations,
    so that GPT-2's 1,024 x 50,304 logits go several windows to a pass, not one."""
    cfg = model.config
    if device.type != "cuda":
        return max(1, LOGITS_BUDGET // (cfg.block_size * cfg.vocab_size))
    free, _ = torch.cuda.mem_get_info(device)
    floats = cfg.block_size * (cfg.vocab_size + ACTIVATION_WIDTHS * cfg.n_embd)  # a window's, in fp32
    return max(1, free // GPU_MEMORY_SHARE // 4 // floats)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch built on the host, on the device: to a CUDA device from pinned memory without waiting for its queue
    (a plain copy waits for the passes before it to finish)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def windows(n: int, block: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) of the windows over a stream of n tokens: inputs ids[start:end] predict
    targets start+1 .. end, and those from `first` on are scored (the earlier ones were, by the window before)."""
    out, done = [], 0  # targets 1..done are scored
    while done < n - 1:
        end = min(n - 1, done + (block if done == 0 else stride))
        out.append((max(0, end - block), end, done + 1))
        done = end
    return out


@torch.inference_mode()
def score_text(
    model: GPT,
    streams: list[np.ndarray],
    token_bytes: np.ndarray,
    stride: int | None = None,
    autocast=None,
    progress: bool = False,
) -> TextScore:
    """Loss, perplexity and bits per byte of token streams under the model (see the module docstring). The sums stay
    on the device until every window is scored: the host reads them once, at the end."""
    block = model.config.block_size
    stride = stride or block // 2
    if not 0 < stride <= block:
        raise UserError(f"stride {stride} must be between 1 and the model's context, {block}")
    device = next(model.parameters()).device
    byte_table = torch.as_tensor(token_bytes, device=device)
    jobs = [(s, start, end, first) for s in streams for start, end, first in windows(len(s), block, stride)]
    rows = rows_per_pass(model, device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)
    model.eval()
    for i in tqdm(range(0, len(jobs), rows), desc="text", leave=False, disable=None if progress else True):
        batch = jobs[i : i + rows]
        width = max(end - start for _, start, end, _ in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        y = torch.zeros(len(batch), width, dtype=torch.long)
        scored = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, (stream, start, end, first) in enumerate(batch):
            x[row, : end - start] = torch.from_numpy(stream[start:end])
            y[row, : end - start] = torch.from_numpy(stream[start + 1 : end + 1])
            scored[row, first - 1 - start : end - start] = True
        x, y, scored = (to_device(t, device) for t in (x, y, scored))
        with autocast or nullcontext():
            logits, _ = model(x)
        token_nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        target_bytes = byte_table[y]
        counted = scored & (target_bytes > 0)
        nats += torch.where(counted, token_nats.double(), 0.0).sum()
        tokens += counted.sum()
        nbytes += torch.where(counted, target_bytes, 0).sum()
    if int(tokens) == 0:
        raise UserError("the text is shorter than 2 tokens: nothing to score")
    return TextScore(float(nats), int(tokens), int(nbytes))


def unknown_characters(tokenizer: Tokenizer, texts: Sequence[str]) -> list[str]:
    """The characters of texts a char tokenizer has no id for (none for byte-level tokenizers)."""
    if not isinstance(tokenizer, CharTokenizer):
        return []
    return sorted(set().union(*map(set, texts)) - set(tokenizer.chars))


def map_unknown(tokenizer: Tokenizer, texts: list[str], allow: bool, what: str) -> tuple[list[str], str]:
    """texts with characters a char model has never seen replaced, when allowed (UserError otherwise); returns
    them and a note for the report."""
    table, note = unknown_table(tokenizer, texts, allow, what)
    return ([t.translate(table) for t in texts] if table else texts), note


def unknown_table(tokenizer: Tokenizer, texts: list[str], allow: bool, what: str) -> tuple[dict | None, str]:
    """The str.translate table that maps the characters of texts a char model has never seen to a stand-in, when
    allowed (UserError otherwise), and a note for the report; (None, "") when every character is known."""
    unknown = unknown_characters(tokenizer, texts)
    if not unknown:
        return None, ""
    stand_in = next(c for c in ("\ufffd", " ", tokenizer.chars[0]) if c in tokenizer.chars)
    shown = "".join(unknown[:20]) + ("..." if len(unknown) > 20 else "")
    if not allow:
        raise UserError(
            f"{what} has {len(unknown)} characters the model's char vocabulary lacks ({shown!r}): "
            f"pass --map-unknown to score them as {stand_in!r}"
        )
    table = str.maketrans({c: stand_in for c in unknown})
    return table, f"{len(unknown)} unknown characters ({shown!r}) scored as {stand_in!r}"


# ---- continuations: HellaSwag and the harness ---------------------------------------------------


@dataclass
class Continuation:
    logprob: float  # sum of the continuation tokens' log-probabilities
    tokens: int
    greedy: bool  # every continuation token is the model's most likely one


@torch.inference_mode()
def continuation_logprobs(
    model: GPT, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], autocast=None, rows: int | None = None
) -> list[Continuation]:
    """Score each (context ids, continuation ids) pair, several in one forward pass. A context and continuation
    longer than the model's context keep their last block_size + 1 tokens. Each target's log-probability and
    whether it is the argmax are picked on the device: the host reads those (rows, T), never the (rows, T, V)
    log-probabilities."""
    block = model.config.block_size
    device = next(model.parameters()).device
    rows = rows or rows_per_pass(model, device)
    out = []
    model.eval()
    for i in range(0, len(pairs), rows):
        seqs = [(list(ctx) + list(cont))[-(block + 1) :] for ctx, cont in pairs[i : i + rows]]
        lengths = [min(len(cont), len(s) - 1) for (_, cont), s in zip(pairs[i : i + rows], seqs)]
        width = max(len(s) - 1 for s in seqs)
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        y = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            x[row, : len(s) - 1] = torch.tensor(s[:-1])
            y[row, : len(s) - 1] = torch.tensor(s[1:])
        with autocast or nullcontext():
            logits, _ = model(to_device(x, device))
        logprobs = F.log_softmax(logits.float(), dim=-1)  # (rows, T, V)
        targets = to_device(y, device)[..., None]  # (rows, T, 1)
        picked = logprobs.gather(-1, targets)[..., 0]  # (rows, T)
        hits = (logprobs.argmax(-1, keepdim=True) == targets)[..., 0]  # (rows, T)
        picked, hits = torch.stack((picked, hits.float())).cpu()  # the batch's one read
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            positions = slice(len(s) - 1 - n, len(s) - 1)
            greedy = bool(hits[row, positions].all())
            out.append(Continuation(float(picked[row, positions].double().sum()), n, greedy))
    return out


@dataclass
class HellaSwagItem:
    context: str
    endings: list[str]
    label: int


@dataclass
class HellaSwagScore:
    right: list[bool]  # per item: the ending with the highest summed log-probability is the label
    right_norm: list[bool]  # ... the ending with the highest mean log-probability per token
    logprobs: list[list[float]]  # per item, per ending: summed log-probability of the ending's tokens
    tokens: list[list[int]]

    @property
    def items(self) -> int:
        return len(self.right)

    @property
    def acc(self) -> float:
        return sum(self.right) / max(1, self.items)

    @property
    def acc_norm(self) -> float:
        return sum(self.right_norm) / max(1, self.items)


def load_hellaswag(path: str | Path) -> list[HellaSwagItem]:
    """HellaSwag's own jsonl (rowanz/hellaswag, data/hellaswag_val.jsonl): ctx, 4 endings, label per line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the HellaSwag file {path}: {e}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not a JSON object ({e}); expected HellaSwag's format") from None
        items.append(hellaswag_item(record, where))
    if not items:
        raise UserError(f"{path} holds no HellaSwag items")
    return items


def hellaswag_items(path: str | Path, tokenizer: Tokenizer, limit: int | None, allow_unknown: bool) -> tuple[list, str]:
    """The first `limit` items of a HellaSwag file, their text mapped for a char model when allowed (map_unknown);
    and the note about it, if any."""
    items = load_hellaswag(path)[: limit or None]
    texts, note = map_unknown(
        tokenizer, [t for item in items for t in (item.context, *item.endings)], allow_unknown, str(path)
    )
    return [HellaSwagItem(texts[5 * k], texts[5 * k + 1 : 5 * k + 5], item.label) for k, item in enumerate(items)], note


def hellaswag_item(record: object, where: str) -> HellaSwagItem:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a {type(record).__name__}, not a HellaSwag object (ctx, endings, label)")
    ctx, endings, label = record.get("ctx"), record.get("endings"), record.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise UserError(f"{where}: field 'ctx' is missing or not a non-empty string")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) and e for e in endings):
        raise UserError(f"{where}: field 'endings' must be a list of 4 non-empty strings")
    if isinstance(label, str) and label.isdigit():  # the hub's copy stores it as text
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 4:
        raise UserError(f"{where}: field 'label' must be 0, 1, 2 or 3")
    return HellaSwagItem(ctx, endings, label)


def hellaswag_pairs(tokenizer: Tokenizer, item: HellaSwagItem) -> list[tuple[list[int], list[int]]]:
    """The 4 (context, ending) token pairs of an item; each ending gets a space before it, as in the original."""
    return [encode_pair(tokenizer, item.context, " " + ending) for ending in item.endings]


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the model reads the two together (lm-evaluation-harness's rule): the
    context's trailing spaces move to the continuation, whose ids are those the whole text has after the
    context's (a sentencepiece tokenizer encodes a lone " word" differently). The context starts with the
    tokenizer's BOS, if it has one; an empty context is <|endoftext|>."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = tokenizer.encode(context) if context else []
    whole = tokenizer.encode(context + continuation)
    cont = whole[len(ctx) :] if ctx and whole[: len(ctx)] == ctx else tokenizer.encode(continuation)
    if tokenizer.bos_id is not None:
        ctx = [tokenizer.bos_id] + ctx
    elif not ctx and tokenizer.eot_id is not None:
        ctx = [tokenizer.eot_id]
    return ctx, cont


def score_hellaswag(
    model: GPT,
    tokenizer: Tokenizer,
    items: Sequence[HellaSwagItem],
    autocast=None,
    items_per_pass: int = 4,
    progress: bool = False,
) -> HellaSwagScore:
    score = HellaSwagScore([], [], [], [])
    for i in tqdm(
        range(0, len(items), items_per_pass),
        desc="hellaswag",
        unit="item",
        unit_scale=items_per_pass,
        leave=False,
        disable=None if progress else True,
    ):
        batch = items[i : i + items_per_pass]
        scores = continuation_logprobs(
            model, [p for item in batch for p in hellaswag_pairs(tokenizer, item)], autocast, rows=4 * len(batch)
        )
        for k, item in enumerate(batch):
            endings = scores[4 * k : 4 * k + 4]
            sums = [e.logprob for e in endings]
            means = [e.logprob / max(1, e.tokens) for e in endings]
            score.right.append(int(np.argmax(sums)) == item.label)
            score.right_norm.append(int(np.argmax(means)) == item.label)
            score.logprobs.append(sums)
            score.tokens.append([e.tokens for e in endings])
    return score
