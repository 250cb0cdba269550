"""The encoding pipeline: a resolved request's corpus -> its tokenizer -> train.bin and val.bin in the work directory
-> the dataset folder.

Tokenizers: char (the corpus's characters, sorted; the vocabulary size is an upper bound), bpe (byte-level BPE with
vocab_size ids, default 4096, trained on the first 64 MB of the train split), a tiktoken encoding name such as gpt2,
or hf:DIR (a Hugging Face tokenizer.json). Work is done by the workers of pool.py on chunks of about 16 MB and
written in input order; each chunk is journaled in the work directory (workdir.py), so a killed run continues.
A mistake in the input stops a new run with one line and removes its partial work; the previous complete dataset,
if any, stays as it was.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from quillgpt import corpus
from quillgpt.chat_template import ChatFormat, chat_format, with_chat_tokens
from quillgpt.corpus import Chunk, Source, TextSpan
from quillgpt.errors import UserError
from quillgpt.files import read_json
from quillgpt.prepare.chat import (
    conversation_documents,
    encode_conversations,
    encode_pairs,
    read_conversations,
    record_reader,
)
from quillgpt.prepare.pool import ordered_map
from quillgpt.prepare.request import Request, Settings, checkpoint_tokenizer
from quillgpt.prepare.sources import chunk_stream, resolve_sources, total_bytes
from quillgpt.prepare.splits import Span, check_splits, in_validation
from quillgpt.prepare.workdir import WORK_DIR, PartialBins, WorkDir, chat_file_sizes, describe, token_dtype
from quillgpt.tokenizer import (
    BPE_PIECE_CHARS,
    Tokenizer,
    char_tokenizer,
    codepoints,
    get_tiktoken,
    hf_tokenizer,
    split_text,
    tokenizer_from_dict,
    tokenizer_kind,
    train_tokenizer,
)


def encode_dataset(
    dataset: str,
    out_dir: Path,
    request: Request,
    settings: Settings,
    given: Tokenizer | None = None,
    extra_meta: dict | None = None,
) -> None:
    """Encode the request's corpus into out_dir/.prepare (continuing an interrupted run of the same request), then
    move the files into out_dir, meta.json last. given: a tokenizer to use instead of making one.

    A mistake found in the input (a bad record, a missing field) stops a new run with one line and removes its
    partial work; an interrupted run's work stays, to continue once the cause is fixed (or to drop with --reset)."""
    work = WorkDir(out_dir / WORK_DIR)
    progress = work.resume(request, settings.chunk_bytes)
    fresh = progress is None
    try:
        if progress is None or not progress["finished"]:
            sources, spans = resolve_sources(dataset, request, out_dir, settings.verbose)
            if settings.verbose:
                print(
                    f"{'continuing' if progress else 'preparing'} {out_dir} from {', '.join(s.path for s in sources)} "
                    f"({request.split} split, {settings.workers} worker{'s' * (settings.workers > 1)})"
                )
            if progress is None:
                tok = given or make_tokenizer(request, sources, spans, settings)
                progress = work.start(request, tok, settings.chunk_bytes)
            tok = work.tokenizer()
            encode(work, progress, tok, request, sources, spans, settings)
            work.finish(dataset, request, tok, sources, extra_meta or {})
    except UserError:
        if fresh:
            shutil.rmtree(work.path, ignore_errors=True)
        raise
    work.commit(out_dir)
    if settings.verbose:
        print(f"wrote {out_dir} ({describe(read_json(out_dir / 'meta.json'))})")


# ---- the tokenizer ------------------------------------------------------------------------------


def make_tokenizer(request: Request, sources: list[Source], spans: list[Span] | None, settings: Settings) -> Tokenizer:
    """The request's tokenizer; for chat data with the chat template (its own, or ChatML and its two tokens)."""
    if request.tokenizer_from is not None:
        tok = tokenizer_from_dict(checkpoint_tokenizer(request.tokenizer_from))
    else:
        tok = base_tokenizer(request, sources, spans, settings)
    return with_chat_tokens(tok) if request.chat else tok


def base_tokenizer(request: Request, sources: list[Source], spans: list[Span] | None, settings: Settings) -> Tokenizer:
    kind = tokenizer_kind(request.tokenizer)
    if kind in ("tiktoken", "hf"):
        tok = get_tiktoken(request.tokenizer) if kind == "tiktoken" else hf_tokenizer(request.tokenizer[3:])
        if request.vocab_size is not None and tok.vocab_size > request.vocab_size:
            raise UserError(
                f"the {request.tokenizer} tokenizer has {tok.vocab_size} tokens, more than the requested "
                f"vocab_size {request.vocab_size}"
            )
        if tok.eot_id is None and request.split == "docs" and not request.chat:
            raise UserError(
                f"the {request.tokenizer} tokenizer has no end-of-sequence token to end each document with "
                "(its tokenizer_config.json names no eos_token)"
            )
        return tok
    chunks = chunk_stream(request, sources, spans, settings.chunk_bytes)
    if kind == "char":
        sets, documents, skipped = [], 0, 0
        with progress_bar(total_bytes(sources, request, spans), "characters", settings.verbose) as bar:
            reader = partial(chunk_codepoints, chat=request.chat, preference=request.preference)
            for chunk, (points, n, bad) in ordered_map(reader, chunks, settings.workers):
                sets.append(points)
                documents, skipped = documents + n, skipped + bad
                bar.update(chunk.size)
        if documents == 0:
            raise UserError(f"the corpus has no documents ({skipped} records skipped or empty)")
        return char_tokenizer(sets, request.vocab_size, eot=request.split == "docs")
    if settings.verbose:
        print(
            f"training a byte-level BPE with {request.vocab_size} tokens on up to "
            f"{settings.bpe_train_bytes / 2**20:.0f} MiB of the train split..."
        )
    t0 = time.perf_counter()
    texts = bpe_training_texts(chunks, request, settings.workers, settings.bpe_train_bytes)
    if not texts:
        raise UserError("the corpus has no documents in its train split to train a BPE on")
    tok = train_tokenizer("bpe", (p for t in texts for p in split_text(t, BPE_PIECE_CHARS)), request.vocab_size)
    if settings.verbose:
        print(f"BPE trained in {time.perf_counter() - t0:.1f}s: {tok.vocab_size} tokens")
    return tok


def bpe_training_texts(chunks: Iterator, request: Request, workers: int, limit: int) -> list[str]:
    """The first `limit` bytes of the train split's text (whole documents, the last one cut)."""
    texts, size, index = [], 0, 0
    reader = partial(chunk_documents, chat=request.chat, preference=request.preference)
    for chunk, docs in ordered_map(reader, chunks, workers):
        if chunk.split is not None:
            train = [chunk.split == "train"] * len(docs.texts)
        else:
            train = ~in_validation(request.split_seed, index, len(docs.texts), request.val_fraction)
            index += len(docs.texts)
        for text, is_train in zip(docs.texts, train):
            if is_train:
                raw = text.encode()[: limit - size]
                texts.append(raw.decode("utf-8", "ignore"))
                size += len(raw)
        if size >= limit:
            break
    return texts


# ---- the workers' side --------------------------------------------------------------------------


_WORKER_TOKENIZER: Tokenizer | None = None
# chat data: the template, whether bad records are skipped, and whether records are preference pairs
_WORKER_CHAT: tuple[ChatFormat, bool, bool] | None = None


def start_worker(tokenizer: dict, chat: bool = False, skip_bad: bool = False, preference: bool = False) -> None:
    global _WORKER_TOKENIZER, _WORKER_CHAT
    _WORKER_TOKENIZER = tokenizer_from_dict(tokenizer)
    _WORKER_CHAT = (chat_format(_WORKER_TOKENIZER), skip_bad, preference) if chat else None


@dataclass
class Encoded:
    tokens: np.ndarray  # uint32, every document followed by <|endoftext|> (a TextSpan: its tokens alone; a
    # conversation: its rendering alone, the template ends every turn)
    lengths: np.ndarray  # int64, tokens per document (a TextSpan: one entry)
    skipped: int
    replaced: int
    mask: np.ndarray | None = None  # chat: uint8 per token, 1 on the assistant's tokens


def encode_chunk(item: tuple[Chunk, Any]) -> Encoded:
    """A chunk's documents as tokens (in a worker process, with start_worker's tokenizer)."""
    chunk = item[0]
    if _WORKER_CHAT is not None:
        return encode_chat_chunk(chunk, *_WORKER_CHAT)
    docs = corpus.read(chunk)
    tok = _WORKER_TOKENIZER
    parts = [tok.encode_array(text).astype(np.uint32) for text in docs.texts]
    if not isinstance(chunk, TextSpan):  # documents: [BOS, when the tokenizer prepends one] tokens <|endoftext|>
        bos = np.array([tok.bos_id] if tok.bos_id is not None else [], dtype=np.uint32)
        eot = np.array([tok.eot_id], dtype=np.uint32)
        lengths = np.array([len(bos) + len(p) + 1 for p in parts], dtype=np.int64)
        parts = [piece for part in parts for piece in (bos, part, eot)]
    else:
        lengths = np.array([len(parts[0])], dtype=np.int64)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    return Encoded(tokens, lengths, docs.skipped, docs.replaced)


def encode_chat_chunk(chunk: Chunk, fmt: ChatFormat, skip_bad: bool, preference: bool = False) -> Encoded:
    """A chunk's conversations as tokens and assistant masks, rendered by the chat template (preference pairs: two
    conversations each, masked on their replies)."""
    encoder = encode_pairs if preference else encode_conversations
    ids, masks, skipped = encoder(fmt, read_conversations(chunk, record_reader(preference)), skip_bad)
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    tokens = np.concatenate([np.array(i, dtype=np.uint32) for i in ids]) if ids else np.zeros(0, np.uint32)
    mask = np.concatenate([np.array(m, dtype=np.uint8) for m in masks]) if masks else np.zeros(0, np.uint8)
    return Encoded(tokens, lengths, skipped, 0, mask)


def read_documents(chunk: Chunk, chat: bool, preference: bool = False) -> corpus.Documents:
    return conversation_documents(chunk, preference) if chat else corpus.read(chunk)


def chunk_codepoints(
    item: tuple[Chunk, Any], chat: bool = False, preference: bool = False
) -> tuple[np.ndarray, int, int]:
    """The distinct characters of a chunk's documents (for a char vocabulary), its documents and its skipped records."""
    docs = read_documents(item[0], chat, preference)
    points = np.unique(np.concatenate([codepoints(t) for t in docs.texts] or [np.zeros(0, np.uint32)]))
    return points, len(docs.texts), docs.skipped


def chunk_documents(item: tuple[Chunk, Any], chat: bool = False, preference: bool = False) -> corpus.Documents:
    return read_documents(item[0], chat, preference)


# ---- encoding, chunk by chunk into the work directory -------------------------------------------


def encode(
    work: WorkDir,
    progress: dict,
    tok: Tokenizer,
    request: Request,
    sources: list[Source],
    spans: list[Span] | None,
    settings: Settings,
) -> None:
    """Encode every chunk not yet done into the work directory's train.bin and val.bin, journaling each one."""
    if any(s.kind == "hub" for s in sources):  # a stream continues from its saved state (and --max-bytes budget)
        chunks = chunk_stream(
            replace(request, max_bytes=progress["budget_left"]),
            sources,
            spans,
            settings.chunk_bytes,
            progress["hub_state"],
        )
    else:  # local chunks are derived again: skip the ones written
        chunks = islice(chunk_stream(request, sources, spans, settings.chunk_bytes), progress["chunks"], None)
    dtype = token_dtype(tok.vocab_size)
    extra = chat_file_sizes(progress, np.dtype(dtype).itemsize) if request.chat else None
    bins = PartialBins(work.path, dtype, progress["train_bytes"], progress["val_bytes"], extra)
    counts = progress["counts"]
    try:
        with progress_bar(
            total_bytes(sources, request, spans), "encoding", settings.verbose, initial=progress["read_bytes"]
        ) as bar:
            init = (tok.to_dict(), request.chat, request.skip_bad_records, request.preference)
            for chunk, enc in ordered_map(encode_chunk, chunks, settings.workers, start_worker, init):
                write_chunk(bins, enc, chunk.split, request, counts, tok.vocab_size)
                progress.update(
                    chunks=progress["chunks"] + 1,
                    read_bytes=progress["read_bytes"] + chunk.size,
                    hub_state=chunk.state,
                    budget_left=None if request.max_bytes is None else max(0, progress["budget_left"] - chunk.size),
                )
                progress["train_bytes"], progress["val_bytes"] = bins.sync()
                work.journal(progress)
                bar.update(chunk.size)
                bar.set_postfix(
                    docs=f"{counts['train_documents'] + counts['val_documents']:,}",
                    tokens=f"{counts['train_tokens'] + counts['val_tokens']:,}",
                    refresh=False,
                )
    finally:
        bins.close()
    check_splits(counts, request)


def write_chunk(
    bins: PartialBins, enc: Encoded, split: str | None, request: Request, counts: dict, vocab_size: int
) -> None:
    """Append a chunk's tokens to train.bin and val.bin: a TextSpan's to its split, each document to the split its
    index hashes to (split None; a preference pair's two conversations together, by the pair's index)."""
    if enc.tokens.size and int(enc.tokens.max()) >= vocab_size:
        raise UserError(f"token id {int(enc.tokens.max())} is outside the vocabulary (size {vocab_size})")
    counts["max_token_id"] = max(counts["max_token_id"], int(enc.tokens.max()) if enc.tokens.size else -1)
    counts["skipped_records"] += enc.skipped
    counts["invalid_utf8_replaced"] += enc.replaced
    if split is not None:
        bins.append(split, enc.tokens)
        counts[f"{split}_tokens"] += enc.tokens.size
        return
    per = 2 if request.preference else 1  # documents per unit of the split: a pair's are its two conversations
    first = (counts["train_documents"] + counts["val_documents"]) // per
    val = np.repeat(in_validation(request.split_seed, first, len(enc.lengths) // per, request.val_fraction), per)
    in_val = np.repeat(val, enc.lengths)
    for split, mask, docs in (("train", ~in_val, ~val), ("val", in_val, val)):
        if enc.mask is not None:  # chat: the loss mask, and where each conversation starts in the split
            starts = counts[f"{split}_tokens"] + np.cumsum(enc.lengths[docs]) - enc.lengths[docs]
            bins.append_to(f"{split}.mask.bin", enc.mask[mask])
            bins.append_to(f"{split}.starts.bin", starts)
            counts[f"{split}_assistant_tokens"] += int(enc.mask[mask].sum())
        bins.append(split, enc.tokens[mask])
        counts[f"{split}_tokens"] += int(mask.sum())
        counts[f"{split}_documents"] += int(docs.sum())


def progress_bar(total: int | None, desc: str, verbose: bool, initial: int = 0) -> tqdm:
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="B",
        unit_scale=True,
        disable=None if verbose else True,
        leave=False,
        dynamic_ncols=True,
    )
