"""Turn a corpus into a token dataset: data/<dataset>/{train.bin, val.bin, tokenizer.json, meta.json}.

prepare.py is the command line over `prepare_dataset`.

Rules:
- Inputs (corpus.py): text files, directories (recursive, --glob), .jsonl/.jsonl.gz/.jsonl.zst and
  .parquet records (--text-field, default "text"), several of them in a row, or a hub dataset
  streamed by `datasets` (--hf-dataset). Known names need no input: shakespeare_char, shakespeare,
  pystdlib and the recipes in RECIPES.
- Documents end with the tokenizer's <|endoftext|> (GPT-2: 50256; a trained BPE's last id; a char
  vocabulary gets one id after its characters). --split docs puts a fixed fraction of whole documents
  in val.bin, chosen by a hash of each document's index and --split-seed, so the same input always
  splits the same way. --split tail is nanoGPT's rule for one text file (the default for a lone text
  file): the first int(n_bytes * (1 - val_fraction)) bytes are train, the rest val (the cut moved to
  the next character start), no <|endoftext|> and, for char, no extra id.
- Tokenizers: char (the corpus's characters, sorted; --vocab-size is an upper bound), bpe (byte-level
  BPE with --vocab-size ids, default 4096, trained on the first 64 MB of the train split), or a
  tiktoken encoding name such as gpt2.
- Work is done by --workers processes (default: the usable cores) on chunks of about 16 MB; results
  are written in input order, so the files are byte-identical for any number of workers. Memory stays
  bounded whatever the input size.
- A killed prepare, run again with the same arguments, continues from its last completed chunk (the
  partial files and progress.json wait in data/<dataset>/.prepare/) and ends with the files an
  uninterrupted run writes. A mistake in the input (a bad record, a missing field) stops it with one
  line and removes the partial work; the previous complete dataset, if any, stays as it was.
- train.bin / val.bin are flat token ids without a header, dtype meta["dtype"] (uint16, or uint32
  when vocab_size > 65535), little-endian: np.memmap(path, dtype=meta["dtype"], mode="r").
- meta.json is written last, so its presence means the dataset is complete. A complete dataset made
  for the same request is reused as is; a different request needs --reset.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from http.client import HTTPException
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from quillgpt import corpus
from quillgpt.corpus import Budget, Chunk, Source, TextSpan
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, atomic_write_json, fsync_dir, read_json, sha256_file
from quillgpt.machine import usable_cpus
from quillgpt.tokenizer import (
    Tokenizer,
    canonical_spec,
    char_tokenizer,
    codepoints,
    get_tiktoken,
    hf_tokenizer,
    load_tokenizer,
    resolve_vocab_size,
    save_tokenizer,
    split_text,
    tokenizer_from_dict,
    tokenizer_kind,
    tokenizer_label,
    train_tokenizer,
)

FORMAT_VERSION = 2
BPE_TRAIN_BYTES = 64 * 2**20
BPE_TRAIN_PIECE_CHARS = 2**20  # rustbpe counts the pieces of one buffer in parallel
PYSTDLIB_MAX_BYTES = 4_000_000
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DOWNLOAD_TIMEOUT_S = 10
WORK_DIR = ".prepare"
META_FIELDS = {"tokenizer": dict, "vocab_size": int, "train_tokens": int, "val_tokens": int}


@dataclass(frozen=True)
class Recipe:
    """A corpus users know by name, streamed from the Hugging Face hub."""

    hf_dataset: str
    hf_config: str | None
    tokenizer: str
    val_fraction: float
    expected: str  # published token counts, for the README and the start-up line


RECIPES = {
    "openwebtext": Recipe(
        "Skylion007/openwebtext",
        None,
        "gpt2",
        0.0005,
        "~9.04B train / ~4.4M val tokens from 8,013,769 documents (nanoGPT's openwebtext/prepare.py)",
    ),
    "fineweb-edu-10B": Recipe(
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "gpt2",
        0.01,
        "~10B tokens (build-nanogpt and llm.c write it as 100 shards of 100M)",
    ),
    "tinystories": Recipe(
        "roneneldan/TinyStories",
        None,
        "gpt2",
        0.01,
        "~470M train tokens (a nanoGPT port reports 471,650,941 for its train split)",
    ),
}
KNOWN_DATASETS = ("shakespeare_char", "shakespeare", "pystdlib", *RECIPES)


@dataclass
class Request:
    """What a dataset is made from and how: recorded in meta.json; a dataset is reused only for the same request.
    (The number of workers is not part of it: the output does not depend on it.)"""

    inputs: list[str] = field(default_factory=list)  # absolute paths; [] for a named dataset
    hf_dataset: str | None = None
    hf_config: str | None = None
    hf_split: str = "train"
    hf_revision: str | None = None
    glob: str | None = None
    text_field: str = "text"
    tokenizer: str = "char"
    vocab_size: int | None = None
    split: str = "docs"  # docs | tail
    val_fraction: float = 0.1
    split_seed: int = 0
    max_bytes: int | None = None
    skip_bad_records: bool = False


@dataclass
class Settings:
    """How a dataset is made, as opposed to what (Request): the output does not depend on these."""

    verbose: bool = True
    bpe_train_bytes: int = BPE_TRAIN_BYTES
    workers: int = 1
    chunk_bytes: int = corpus.CHUNK_BYTES


# ---- the entry point ----------------------------------------------------------------------------


def prepare_dataset(
    dataset: str,
    *,
    input_path: str | list[str] | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    val_fraction: float | None = None,
    reset: bool = False,
    data_dir: str | Path = "data",
    max_bytes: int | None = None,
    verbose: bool = True,
    bpe_train_bytes: int = BPE_TRAIN_BYTES,
    glob: str | None = None,
    text_field: str = "text",
    hf_dataset: str | None = None,
    hf_config: str | None = None,
    hf_split: str = "train",
    hf_revision: str | None = None,
    split: str = "auto",
    split_seed: int = 0,
    workers: int | None = None,
    skip_bad_records: bool = False,
    chunk_bytes: int = corpus.CHUNK_BYTES,
) -> Path:
    """Prepare (or reuse) data_dir/dataset with train.bin, val.bin, tokenizer.json and meta.json; returns that dir.

    tokenizer: "char", "bpe" or a tiktoken encoding name; None means gpt2 for "shakespeare" and the recipes,
    char otherwise. split: "auto" (tail for a lone text file, docs otherwise), "docs" or "tail"."""
    if not dataset or dataset in (".", "..") or "/" in dataset or os.sep in dataset:
        raise UserError(f"dataset name must be a plain folder name, got {dataset!r}")
    if bpe_train_bytes <= 0:
        raise UserError(f"bpe_train_bytes must be positive, got {bpe_train_bytes}")
    inputs = [input_path] if isinstance(input_path, str) else list(input_path or [])
    request = make_request(
        dataset,
        inputs,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        glob=glob,
        text_field=text_field,
        hf_dataset=hf_dataset,
        hf_config=hf_config,
        hf_split=hf_split,
        hf_revision=hf_revision,
        split=split,
        split_seed=split_seed,
        skip_bad_records=skip_bad_records,
    )
    out_dir = Path(data_dir) / dataset
    if (out_dir / "meta.json").exists() and not reset:
        meta = reusable(out_dir, request, sourced=bool(inputs) or hf_dataset is not None or dataset in KNOWN_DATASETS)
        if meta is not None:
            if verbose:
                print(f"reusing {out_dir} ({describe(meta)})")
            return out_dir
    if reset:
        shutil.rmtree(out_dir / WORK_DIR, ignore_errors=True)
    build(dataset, out_dir, request, Settings(verbose, bpe_train_bytes, workers or usable_cpus(), chunk_bytes))
    return out_dir


def make_request(
    dataset: str,
    inputs: list[str],
    *,
    tokenizer: str | None,
    vocab_size: int | None,
    val_fraction: float | None,
    max_bytes: int | None,
    split: str,
    **kw,
) -> Request:
    """The request, with the defaults of the named datasets and recipes resolved; UserError for contradictions."""
    for path in inputs:
        if not Path(path).exists():
            raise UserError(f"input not found: {path}")
    recipe = RECIPES.get(dataset) if not inputs and kw["hf_dataset"] is None else None
    if recipe is not None:
        kw.update(hf_dataset=recipe.hf_dataset, hf_config=recipe.hf_config)
    if inputs and kw["hf_dataset"] is not None:
        raise UserError("give --input files or --hf-dataset, not both")
    if val_fraction is None:
        val_fraction = recipe.val_fraction if recipe else 0.1
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes must be positive, got {max_bytes}")
    if dataset == "pystdlib" and not inputs and max_bytes is None:
        max_bytes = PYSTDLIB_MAX_BYTES
    spec = canonical_spec(tokenizer or (recipe.tokenizer if recipe else "gpt2" if dataset == "shakespeare" else "char"))
    vocab_size = resolve_vocab_size(tokenizer_kind(spec), vocab_size)
    one_text = (
        len(inputs) == 1 and not Path(inputs[0]).is_dir() and corpus.file_source(Path(inputs[0])).kind == "text"
    ) or (not inputs and kw["hf_dataset"] is None and dataset in ("shakespeare_char", "shakespeare"))
    if split == "auto":
        split = "tail" if one_text else "docs"
    if split not in ("tail", "docs"):
        raise UserError(f"split must be auto, docs or tail, got {split!r}")
    if split == "tail" and not one_text:
        raise UserError(
            "--split tail cuts one text file by bytes (nanoGPT's rule); a corpus of documents "
            "splits by document (--split docs)"
        )
    return Request(
        inputs=[str(Path(p).resolve()) for p in inputs],
        tokenizer=spec,
        vocab_size=vocab_size,
        split=split,
        val_fraction=val_fraction,
        max_bytes=max_bytes,
        **kw,
    )


def build(
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


def token_dtype(vocab_size: int) -> str:
    return "uint32" if vocab_size > 65535 else "uint16"


# ---- sources ------------------------------------------------------------------------------------

Span = tuple[str, int, int, str]  # (text file, start byte, end byte, split) of a corpus split by bytes


def resolve_sources(
    dataset: str, request: Request, out_dir: Path, verbose: bool
) -> tuple[list[Source], list[Span] | None]:
    """The sources to read; for a split by bytes also its spans (a tail split: its one file cut at
    int(n_bytes * (1 - val_fraction)); given splits: train.txt and val.txt)."""
    if request.split == "given":
        train, val = request.inputs
        return [Source("text", train), Source("text", val)], [
            (train, 0, os.path.getsize(train), "train"),
            (val, 0, os.path.getsize(val), "val"),
        ]
    if request.inputs:
        sources = corpus.local_sources(request.inputs, request.glob)
    elif request.hf_dataset is not None:
        sources = [corpus.hub_source(request.hf_dataset, request.hf_config, request.hf_split, request.hf_revision)]
    elif dataset in ("shakespeare_char", "shakespeare"):
        path = out_dir / "input.txt"
        download_shakespeare(path, verbose)
        sources = [Source("text", str(path.resolve()), url=SHAKESPEARE_URL)]
    elif dataset == "pystdlib":
        sources = [corpus.stdlib_source()]
    elif (out_dir / WORK_DIR).is_dir() or (out_dir / "train.bin").exists():
        raise UserError(
            f"{out_dir} is incomplete (no meta.json): run the prepare.py command that made it again "
            "to finish it, or pass --input FILE (data.input) to prepare it from a file"
        )
    else:
        raise UserError(
            f"unknown dataset {dataset!r}: pass --input FILE to prepare your own text, "
            f"or use one of {', '.join(KNOWN_DATASETS)}"
        )
    if request.split == "docs":
        return sources, None
    path = sources[0].path
    size = os.path.getsize(path)
    end = (
        size
        if request.max_bytes is None or request.max_bytes >= size
        else char_start_at_or_before(path, request.max_bytes)
    )
    if end == 0:
        raise UserError(f"input {path} is empty")
    cut = char_start_at_or_after(path, int(end * (1 - request.val_fraction)), end)
    return sources, [(path, 0, cut, "train"), (path, cut, end, "val")]


def is_char_start(byte: int) -> bool:
    return not 0x80 <= byte < 0xC0


def char_start_at_or_after(path: str, pos: int, end: int) -> int:
    with open(path, "rb") as f:
        f.seek(pos)
        following = f.read(min(4, end - pos))
    return pos + next((i for i, byte in enumerate(following) if is_char_start(byte)), len(following))


def char_start_at_or_before(path: str, pos: int) -> int:
    with open(path, "rb") as f:
        f.seek(pos)
        byte = f.read(1)
    return pos if not byte or is_char_start(byte[0]) else char_start_at_or_before(path, pos - 1)


def download_shakespeare(path: Path, verbose: bool) -> None:
    if path.is_file() and sha256_file(path) == SHAKESPEARE_SHA256:
        return
    offline_hint = "pass --input /path/to/tinyshakespeare.txt (train.py, bench.py: --data.input)"
    if verbose:
        print(f"downloading tiny Shakespeare to {path}")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except (urllib.error.URLError, HTTPException, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"cannot download tiny Shakespeare (no network? {reason}): {offline_hint}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise UserError(
            f"downloaded tiny Shakespeare has sha256 {digest}, expected {SHAKESPEARE_SHA256}: {offline_hint}"
        )
    with atomic_write(path) as f:
        f.write(data)


def chunk_stream(
    request: Request, sources: list[Source], spans: list[Span] | None, chunk_bytes: int, hub_state: dict | None = None
) -> Iterator[tuple[Chunk, dict | None]]:
    """(chunk, the hub stream's state after it or None) for every chunk of the corpus, in order; a hub stream
    starts from hub_state when given."""
    if spans is not None:  # already cut at max_bytes
        for path, lo, hi, split in spans:
            yield from ((chunk, None) for chunk in corpus.text_chunks(path, lo, hi, split, chunk_bytes))
        return
    how, budget = corpus.Reading(request.text_field, request.skip_bad_records, chunk_bytes), Budget(request.max_bytes)
    for source in sources:
        if source.kind == "hub":
            yield from corpus.hub_chunks(source, how, budget, hub_state)
        else:
            yield from ((chunk, None) for chunk in corpus.chunks_of(source, how, budget))


def total_bytes(sources: list[Source], request: Request, spans: list[Span] | None) -> int | None:
    """The input bytes the progress bar counts up to, where known (not for hub streams or compressed files)."""
    if spans is not None:
        return sum(hi - lo for _, lo, hi, _ in spans)
    if any(s.kind == "hub" or (s.kind == "jsonl" and not s.path.endswith(".jsonl")) for s in sources):
        return None
    total = 0
    for s in sources:
        if s.kind == "parquet":
            meta = corpus.parquet_file(s.path).metadata
            total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        else:
            total += sum(os.path.getsize(f) for f in (s.files or [s.path]))
    return total if request.max_bytes is None else min(total, request.max_bytes)


# ---- parallel work ------------------------------------------------------------------------------


@dataclass
class Done:
    """What the main process keeps of a chunk while a worker has it: not the chunk's data."""

    split: str | None  # a TextSpan's split; None for documents, whose split their index decides
    size: int  # input bytes (the progress bar's unit)
    state: dict | None  # a hub stream's state after the chunk


def done(item: tuple[Chunk, dict | None]) -> Done:
    chunk, state = item
    return Done(chunk.split if isinstance(chunk, TextSpan) else None, corpus.chunk_size(chunk), state)


def ordered_map(
    fn: Callable, items: Iterable, workers: int, initializer: Callable | None = None, initargs: tuple = ()
) -> Iterator[tuple[Done, Any]]:
    """(done(item), fn(item)) in the order of items, computed by `workers` forked processes (in this one for 1), at
    most 2 x workers items ahead of the consumer: memory stays bounded whatever the number of items."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from ((done(item), fn(item)) for item in items)
        return
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=start_pool_worker, initargs=(os.getpid(), initializer, initargs)
    ) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append((done(item), pool.submit(fn, item)))
                if len(pending) > 2 * workers:
                    kept, future = pending.popleft()
                    yield kept, future.result()
            while pending:
                kept, future = pending.popleft()
                yield kept, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def start_pool_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    """Die with the parent: a SIGKILLed prepare.py would otherwise leave its workers waiting forever on a queue
    that every one of them holds open (Linux: the kernel sends SIGKILL when the parent goes)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    if initializer is not None:
        initializer(*initargs)


_WORKER_TOKENIZER: Tokenizer | None = None


def start_worker(tokenizer: dict) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer_from_dict(tokenizer)


@dataclass
class Encoded:
    tokens: np.ndarray  # uint32, every document followed by <|endoftext|> (a TextSpan: its tokens alone)
    lengths: np.ndarray  # int64, tokens per document (a TextSpan: one entry)
    skipped: int
    replaced: int


def encode_chunk(item: tuple[Chunk, Any]) -> Encoded:
    """A chunk's documents as tokens (in a worker process, with start_worker's tokenizer)."""
    chunk = item[0]
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


def chunk_codepoints(item: tuple[Chunk, Any]) -> tuple[np.ndarray, int, int]:
    """The distinct characters of a chunk's documents (for a char vocabulary), its documents and its skipped records."""
    docs = corpus.read(item[0])
    points = np.unique(np.concatenate([codepoints(t) for t in docs.texts] or [np.zeros(0, np.uint32)]))
    return points, len(docs.texts), docs.skipped


def chunk_documents(item: tuple[Chunk, Any]) -> corpus.Documents:
    return corpus.read(item[0])


def in_validation(seed: int, first: int, n: int, fraction: float) -> np.ndarray:
    """Whether documents first .. first + n - 1 belong to the val split: a hash (splitmix64) of each document's
    index and the seed, below fraction of its range. The same index and seed always give the same answer."""
    with np.errstate(over="ignore"):
        x = np.arange(first, first + n, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


# ---- the tokenizer ------------------------------------------------------------------------------


def make_tokenizer(request: Request, sources: list[Source], spans: list[Span] | None, settings: Settings) -> Tokenizer:
    kind = tokenizer_kind(request.tokenizer)
    if kind in ("tiktoken", "hf"):
        tok = get_tiktoken(request.tokenizer) if kind == "tiktoken" else hf_tokenizer(request.tokenizer[3:])
        if request.vocab_size is not None and tok.vocab_size > request.vocab_size:
            raise UserError(
                f"the {request.tokenizer} tokenizer has {tok.vocab_size} tokens, more than the requested "
                f"vocab_size {request.vocab_size}"
            )
        if tok.eot_id is None and request.split == "docs":
            raise UserError(
                f"the {request.tokenizer} tokenizer has no end-of-sequence token to end each document with "
                "(its tokenizer_config.json names no eos_token)"
            )
        return tok
    chunks = chunk_stream(request, sources, spans, settings.chunk_bytes)
    if kind == "char":
        sets, documents, skipped = [], 0, 0
        with progress_bar(total_bytes(sources, request, spans), "characters", settings.verbose) as bar:
            for chunk, (points, n, bad) in ordered_map(chunk_codepoints, chunks, settings.workers):
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
    tok = train_tokenizer("bpe", (p for t in texts for p in split_text(t, BPE_TRAIN_PIECE_CHARS)), request.vocab_size)
    if settings.verbose:
        print(f"BPE trained in {time.perf_counter() - t0:.1f}s: {tok.vocab_size} tokens")
    return tok


def bpe_training_texts(chunks: Iterator, request: Request, workers: int, limit: int) -> list[str]:
    """The first `limit` bytes of the train split's text (whole documents, the last one cut)."""
    texts, size, index = [], 0, 0
    for chunk, docs in ordered_map(chunk_documents, chunks, workers):
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


# ---- encoding, with a journal to continue from -------------------------------------------------


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
    bins = PartialBins(work.path, token_dtype(tok.vocab_size), progress["train_bytes"], progress["val_bytes"])
    counts = progress["counts"]
    try:
        with progress_bar(
            total_bytes(sources, request, spans), "encoding", settings.verbose, initial=progress["read_bytes"]
        ) as bar:
            for chunk, enc in ordered_map(encode_chunk, chunks, settings.workers, start_worker, (tok.to_dict(),)):
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
    index hashes to (split None)."""
    if enc.tokens.size and int(enc.tokens.max()) >= vocab_size:
        raise UserError(f"token id {int(enc.tokens.max())} is outside the vocabulary (size {vocab_size})")
    counts["max_token_id"] = max(counts["max_token_id"], int(enc.tokens.max()) if enc.tokens.size else -1)
    counts["skipped_records"] += enc.skipped
    counts["invalid_utf8_replaced"] += enc.replaced
    if split is not None:
        bins.append(split, enc.tokens)
        counts[f"{split}_tokens"] += enc.tokens.size
        return
    first = counts["train_documents"] + counts["val_documents"]
    val = in_validation(request.split_seed, first, len(enc.lengths), request.val_fraction)
    in_val = np.repeat(val, enc.lengths)
    for split, mask, docs in (("train", ~in_val, ~val), ("val", in_val, val)):
        bins.append(split, enc.tokens[mask])
        counts[f"{split}_tokens"] += int(mask.sum())
        counts[f"{split}_documents"] += int(docs.sum())


def check_splits(counts: dict, request: Request) -> None:
    documents = counts["train_documents"] + counts["val_documents"]
    if request.split == "docs" and documents == 0:
        raise UserError(f"the corpus has no documents ({counts['skipped_records']} records skipped or empty)")
    if request.split == "docs" and (counts["val_documents"] == 0 or counts["train_documents"] == 0):
        raise UserError(
            f"none of the {documents} documents fell into the {'val' if counts['val_documents'] == 0 else 'train'} "
            f"split (val_fraction {request.val_fraction}): use more documents or another --val-fraction"
        )
    if min(counts["train_tokens"], counts["val_tokens"]) < 2:
        raise UserError(
            f"the input is too small for a validation split ({counts['train_tokens']} train / "
            f"{counts['val_tokens']} val tokens; each split needs at least 2)"
        )


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


class PartialBins:
    """train.bin and val.bin in the work directory, appended chunk by chunk. They are written directly, not
    through atomic_write: the journal records how much of each is complete, a restart cuts them back to
    that, and only finished files are moved into the dataset."""

    def __init__(self, directory: Path, dtype: str, train_bytes: int, val_bytes: int):
        self.dtype = np.dtype(dtype)
        self.files = {}
        for split, size in (("train", train_bytes), ("val", val_bytes)):
            path = directory / f"{split}.bin"
            f = open(path, "r+b" if path.exists() else "w+b")
            f.truncate(size)
            f.seek(size)
            self.files[split] = f

    def append(self, split: str, tokens: np.ndarray) -> None:
        self.files[split].write(np.ascontiguousarray(tokens, dtype=self.dtype).data)

    def sync(self) -> tuple[int, int]:
        """Flush both files to disk; returns their sizes in bytes."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        return self.files["train"].tell(), self.files["val"].tell()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


class WorkDir:
    """data/<dataset>/.prepare: the tokenizer, the partial bins and progress.json (the journal) of a prepare under
    way, and, once encoding is done, the final meta.json waiting to be moved into place."""

    def __init__(self, path: Path):
        self.path = path

    def resume(self, request: Request, chunk_bytes: int) -> dict | None:
        """The journal of an interrupted prepare of this request, or None when there is none. Another request's
        unfinished work is not thrown away unasked: UserError (--reset discards it)."""
        try:
            progress = read_json(self.path / "progress.json", "prepare progress")
        except UserError:  # no journal (or one torn by a crash before its first chunk): nothing to continue
            shutil.rmtree(self.path, ignore_errors=True)
            return None
        if progress.get("request") != asdict(request):
            raise UserError(
                f"{self.path.parent} holds an unfinished prepare of another request (from "
                f"{', '.join(progress.get('request', {}).get('inputs') or ['its named source'])}, with the "
                f"{progress.get('request', {}).get('tokenizer')} tokenizer): run that prepare.py command "
                "again to finish it, or pass --reset to discard it"
            )
        if progress.get("chunk_bytes") != chunk_bytes or not (self.path / "tokenizer.json").is_file():
            shutil.rmtree(self.path, ignore_errors=True)  # journaled in other units: start again
            return None
        return progress

    def start(self, request: Request, tok: Tokenizer, chunk_bytes: int) -> dict:
        """A fresh journal, with the tokenizer saved beside it; returns the journal."""
        self.path.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, self.path / "tokenizer.json")
        counts = {
            "train_tokens": 0,
            "val_tokens": 0,
            "train_documents": 0,
            "val_documents": 0,
            "max_token_id": -1,
            "skipped_records": 0,
            "invalid_utf8_replaced": 0,
        }
        progress = {
            "request": asdict(request),
            "chunk_bytes": chunk_bytes,
            "chunks": 0,
            "read_bytes": 0,
            "train_bytes": 0,
            "val_bytes": 0,
            "counts": counts,
            "hub_state": None,
            "budget_left": request.max_bytes,
            "finished": False,
        }
        self.journal(progress)
        return progress

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path / "tokenizer.json")

    def journal(self, progress: dict) -> None:
        atomic_write_json(self.path / "progress.json", progress)

    def finish(self, dataset: str, request: Request, tok: Tokenizer, sources: list[Source], extra: dict) -> None:
        """Write the final meta.json into the work directory and mark the encoding finished."""
        progress = read_json(self.path / "progress.json", "prepare progress")
        counts = progress["counts"]
        if counts["invalid_utf8_replaced"]:
            print(
                f"warning: the input has {counts['invalid_utf8_replaced']} invalid UTF-8 byte sequences; "
                "each became U+FFFD",
                file=sys.stderr,
            )
        documents = request.split == "docs"
        meta = {
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "tokenizer": {"kind": tok.kind, "name": tok.name, "file": "tokenizer.json"},
            "vocab_size": tok.vocab_size,
            "dtype": token_dtype(tok.vocab_size),
            "eot_id": tok.eot_id if documents else None,
            "train_tokens": counts["train_tokens"],
            "val_tokens": counts["val_tokens"],
            "train_documents": counts["train_documents"] if documents else None,
            "val_documents": counts["val_documents"] if documents else None,
            "max_token_id": counts["max_token_id"],
            "split": {
                "rule": request.split,
                "val_fraction": request.val_fraction,
                **({"seed": request.split_seed} if documents else {}),
            },
            "sources": [s.describe() for s in sources],
            "input_bytes": progress["read_bytes"],
            "skipped_records": counts["skipped_records"],
            "invalid_utf8_replaced": counts["invalid_utf8_replaced"],
            "request": asdict(request),
            **extra,
        }
        atomic_write_json(self.path / "meta.json", meta)
        self.journal({**progress, "finished": True})

    def commit(self, out_dir: Path) -> None:
        """Move the finished files into out_dir: its old meta.json goes first and the new one comes last, so the
        folder never passes for a complete dataset with a mix of files. Picks up where a killed commit stopped."""
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name in ("train.bin", "val.bin", "tokenizer.json"):
            if (self.path / name).exists():
                os.replace(self.path / name, out_dir / name)
        fsync_dir(out_dir)
        os.replace(self.path / "meta.json", out_dir / "meta.json")
        fsync_dir(out_dir)
        shutil.rmtree(self.path, ignore_errors=True)


# ---- reuse ----------------------------------------------------------------------------------------


def check_meta_fields(meta: dict, path: Path) -> None:
    """The fields that reuse decisions and messages read must have their types (meta.json may be hand-edited)."""
    for key, kind in META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"{path} is malformed: {key!r} is missing or not a {kind.__name__}; pass --reset to re-prepare it"
            )


def tokenizer_request_label(spec: str, vocab_size: int | None) -> str:
    return f"the {spec} tokenizer" + (f" (vocab {vocab_size})" if vocab_size is not None else "")


def reusable(out_dir: Path, request: Request, sourced: bool) -> dict | None:
    """The existing meta if out_dir holds a complete dataset made for this request; UserError on a conflict.

    Without a source (no input, hub dataset or known name: train.py on a dataset prepared by hand), only the
    tokenizer and max_bytes must agree; with one, every setting of the request must."""
    meta = read_json(out_dir / "meta.json", "dataset metadata")
    if any(not (out_dir / name).is_file() for name in ("train.bin", "val.bin", "tokenizer.json")):
        return None
    check_meta_fields(meta, out_dir / "meta.json")
    old = meta.get("request")
    if not isinstance(old, dict) or meta.get("format_version") not in (1, FORMAT_VERSION):
        raise UserError(f"{out_dir} was prepared by another version of prepare.py; pass --reset to re-prepare it")
    made_with = tokenizer_request_label(old.get("tokenizer"), meta.get("vocab_size"))
    wanted = tokenizer_request_label(request.tokenizer, request.vocab_size)
    if old.get("tokenizer") != request.tokenizer or (
        request.tokenizer == "bpe" and old.get("vocab_size") != request.vocab_size
    ):
        raise UserError(f"{out_dir} was prepared with {made_with}; pass --reset to re-prepare it with {wanted}")
    if request.tokenizer != "bpe" and request.vocab_size is not None and meta["vocab_size"] > request.vocab_size:
        raise UserError(
            f"{out_dir} was prepared with {made_with}, more than vocab_size {request.vocab_size}; "
            "pass --reset to re-prepare it"
        )
    if old.get("max_bytes") != request.max_bytes:
        raise UserError(
            f"{out_dir} was prepared from max_bytes={old.get('max_bytes')}; "
            f"pass --reset to re-prepare it with max_bytes={request.max_bytes}"
        )
    check_same_inputs(out_dir, meta, request)
    if not sourced:
        return meta
    if meta["format_version"] == 1:  # every dataset of the first format was split by bytes, into tail splits
        old = {**asdict(request), "split": "tail", "val_fraction": meta.get("val_fraction")}
    differ = [
        k
        for k, v in asdict(request).items()
        if k not in ("inputs", "tokenizer", "vocab_size", "max_bytes") and old.get(k) != v
    ]
    if differ:
        k = differ[0]
        raise UserError(
            f"{out_dir} was prepared with {k} = {old.get(k)!r}; pass --reset to re-prepare it with "
            f"{k} = {getattr(request, k)!r}"
        )
    return meta


def check_same_inputs(out_dir: Path, meta: dict, request: Request) -> None:
    """Given inputs must be those the dataset was made from, unchanged (by size); none given: any."""
    if not request.inputs:
        return
    first_format_source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    old_inputs = meta["request"].get("inputs") or [first_format_source.get("path")]
    if old_inputs != request.inputs:
        raise UserError(
            f"{out_dir} was prepared from {', '.join(map(str, old_inputs))}; pass --reset to re-prepare it "
            f"from {', '.join(request.inputs)}"
        )
    recorded = meta.get("sources", [meta.get("source")])
    size = (
        recorded[0].get("bytes") if isinstance(recorded, list) and recorded and isinstance(recorded[0], dict) else None
    )
    if (
        request.max_bytes is None
        and len(request.inputs) == 1
        and Path(request.inputs[0]).is_file()
        and size != os.path.getsize(request.inputs[0])
    ):
        raise UserError(
            f"{request.inputs[0]} changed since {out_dir} was prepared from it; pass --reset to re-prepare it"
        )


def describe(meta: dict) -> str:
    return (
        f"{tokenizer_label(meta['tokenizer'])} tokenizer, vocab {meta['vocab_size']}, {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val tokens"
    )


# ---- the data/processed layout: train.txt and val.txt, or train.npy and val.npy -----------------


def prepare_txt_dir(
    processed_dir: str | Path,
    *,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    verbose: bool = True,
    workers: int | None = None,
) -> Path:
    """Tokenize processed_dir/{train,val}.txt (or take token ids from {train,val}.npy) into processed_dir/cache.

    The tokenizer comes from processed_dir/meta.json when it has one (our "tokenizer" section or
    nanoGPT's itos/stoi char meta); otherwise `tokenizer` is built from the text (char vocabulary
    over train + val, or BPE trained on train). The cache has the same layout as a prepare_dataset
    directory and is reused until the source files change (size or mtime) or the request changes.
    """
    src = Path(processed_dir)
    if not src.is_dir():
        raise UserError(f"processed data directory not found: {src}")
    names = (
        ("train.txt", "val.txt")
        if (src / "train.txt").is_file() or (src / "val.txt").is_file()
        else ("train.npy", "val.npy")
    )
    missing = [name for name in names if not (src / name).is_file()]
    if missing:
        raise UserError(
            f"{src} needs train.txt and val.txt (or train.npy and val.npy of token ids); missing {', '.join(missing)}"
        )
    found = tokenizer_from_processed_meta(src)
    spec = found if isinstance(found, str) else found.kind if isinstance(found, Tokenizer) else tokenizer
    request = Request(
        inputs=[str((src / n).resolve()) for n in names],
        tokenizer=spec,
        split="given",
        vocab_size=resolve_vocab_size(tokenizer_kind(spec), vocab_size) if not isinstance(found, Tokenizer) else None,
    )
    cache, fingerprint = src / "cache", {"fingerprint": files_fingerprint(src, (*names, "meta.json"))}
    meta = read_json(cache / "meta.json", "cache metadata") if (cache / "meta.json").is_file() else {}
    complete = all((cache / name).is_file() for name in ("train.bin", "val.bin", "tokenizer.json"))
    if complete and meta.get("request") == asdict(request) and meta.get("fingerprint") == fingerprint["fingerprint"]:
        if verbose:
            print(f"reusing {cache} ({describe(meta)})")
        return cache
    tok = found if isinstance(found, Tokenizer) else None
    if names[0].endswith(".npy"):
        if tok is None:
            if tokenizer_kind(spec) != "tiktoken":
                raise UserError(
                    f"{src}/train.npy holds token ids, so {src}/meta.json must say which tokenizer made them"
                )
            tok = get_tiktoken(spec)
        write_token_arrays(cache, request, tok, [load_ids(src / n) for n in names], fingerprint)
    else:
        for name in names:
            if (src / name).stat().st_size == 0:
                raise UserError(f"{src / name} is empty")
        build(src.name, cache, request, Settings(verbose, workers=workers or usable_cpus()), tok, fingerprint)
    return cache


def tokenizer_from_processed_meta(processed_dir: Path) -> Tokenizer | str | None:
    """The tokenizer described by processed_dir/meta.json: a Tokenizer, a tokenizer name, or None."""
    path = processed_dir / "meta.json"
    if not path.is_file():
        return None
    meta = read_json(path, "processed data metadata")
    section = meta.get("tokenizer")
    if isinstance(section, str):
        return section
    if isinstance(section, dict) and "file" in section:
        return load_tokenizer(processed_dir / str(section["file"]))
    if isinstance(section, dict) and "kind" in section:
        return tokenizer_from_dict(section)
    if "itos" in meta or "stoi" in meta:  # nanoGPT's char meta, as JSON
        return nanogpt_char_tokenizer(meta, path)
    return None


def nanogpt_char_tokenizer(meta: dict, path: Path) -> Tokenizer:
    itos, stoi = meta.get("itos"), meta.get("stoi")
    try:
        if isinstance(itos, list):
            chars = itos
        elif isinstance(itos, dict):
            chars = [itos[str(i)] for i in range(len(itos))]  # JSON turns the int keys into strings
        else:
            by_id = sorted((int(i), c) for c, i in stoi.items())
            chars = [c for _, c in by_id]
            if [i for i, _ in by_id] != list(range(len(by_id))):
                raise ValueError("ids are not 0..n-1")
        tok = tokenizer_from_dict({"kind": "char", "chars": chars})
    except (KeyError, TypeError, ValueError, AttributeError, UserError) as e:
        raise UserError(f"{path}: cannot read its itos/stoi char vocabulary ({e})") from None
    if meta.get("vocab_size", tok.vocab_size) != tok.vocab_size:
        raise UserError(f"{path}: vocab_size {meta['vocab_size']} does not match its {tok.vocab_size} characters")
    return tok


def files_fingerprint(directory: Path, names: Iterable[str]) -> dict:
    return {
        name: {"size": (directory / name).stat().st_size, "mtime_ns": (directory / name).stat().st_mtime_ns}
        for name in names
        if (directory / name).is_file()
    }


def load_ids(path: Path) -> np.ndarray:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read token ids from {path}: {e}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise UserError(f"{path} must hold a 1-D integer array of token ids, got shape {ids.shape} ({ids.dtype})")
    return ids


def write_token_arrays(out_dir: Path, request: Request, tok: Tokenizer, arrays: list[np.ndarray], extra: dict) -> None:
    """Token ids that are already made (train, val) as a dataset directory, through the same work directory."""
    work = WorkDir(out_dir / WORK_DIR)
    shutil.rmtree(work.path, ignore_errors=True)
    progress = work.start(request, tok, corpus.CHUNK_BYTES)
    counts = progress["counts"]
    bins = PartialBins(work.path, token_dtype(tok.vocab_size), 0, 0)
    try:
        for split, ids in zip(("train", "val"), arrays):
            for start in range(0, len(ids), corpus.CHUNK_BYTES // 4):
                part = np.asarray(ids[start : start + corpus.CHUNK_BYTES // 4])
                if part.size and (int(part.min()) < 0 or int(part.max()) >= tok.vocab_size):
                    raise UserError(
                        f"{request.inputs[split == 'val']} has token id {int(part.max())}, outside the "
                        f"vocabulary (size {tok.vocab_size})"
                    )
                bins.append(split, part)
                counts[f"{split}_tokens"] += part.size
                counts["max_token_id"] = max(counts["max_token_id"], int(part.max()) if part.size else -1)
        progress["train_bytes"], progress["val_bytes"] = bins.sync()
    finally:
        bins.close()
    check_splits(counts, request)
    work.journal(progress)
    work.finish(out_dir.parent.name, request, tok, [Source("npy", p) for p in request.inputs], extra)
    work.commit(out_dir)
