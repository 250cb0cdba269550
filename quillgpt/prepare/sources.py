"""What a resolved request reads: its sources (the inputs, a hub dataset or a named dataset's own), the spans of a
corpus split by bytes, and its chunks of work, in input order (corpus.py reads each kind of source).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from quillgpt import corpus
from quillgpt.corpus import Budget, Chunk, Source
from quillgpt.errors import UserError
from quillgpt.prepare.chat import record_reader
from quillgpt.prepare.recipes import KNOWN_DATASETS, named_source
from quillgpt.prepare.request import Request
from quillgpt.prepare.splits import Span, given_spans, tail_spans
from quillgpt.prepare.workdir import WORK_DIR


def resolve_sources(
    dataset: str, request: Request, out_dir: Path, verbose: bool
) -> tuple[list[Source], list[Span] | None]:
    """The sources to read; for a split by bytes also its spans (a tail split: its one file cut at
    int(n_bytes * (1 - val_fraction)); given splits: train.txt and val.txt)."""
    if request.split == "given":
        train, val = request.inputs
        return [Source("text", train), Source("text", val)], given_spans(train, val)
    if request.inputs:
        sources = corpus.local_sources(request.inputs, request.glob)
    elif request.hf_dataset is not None:
        sources = [corpus.hub_source(request.hf_dataset, request.hf_config, request.hf_split, request.hf_revision)]
    elif (named := named_source(dataset, out_dir, verbose)) is not None:
        sources = [named]
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
    if request.chat:
        check_records(sources)
    if request.split == "docs":
        return sources, None
    return sources, tail_spans(sources[0].path, request.max_bytes, request.val_fraction)


def check_records(sources: list[Source]) -> None:
    """Chat data comes in records: a text file (or a folder's text files) is refused, naming the first."""
    text = next((s for s in sources if s.kind not in ("jsonl", "parquet", "hub")), None)
    if text is not None:
        path = (text.files or [text.path])[0]
        raise UserError(
            f"--chat reads records with a list of messages (.jsonl, .parquet or a hub dataset); {path} is a text "
            "file (in a folder, --glob picks the record files)"
        )


def chunk_stream(
    request: Request, sources: list[Source], spans: list[Span] | None, chunk_bytes: int, hub_state: dict | None = None
) -> Iterator[tuple[Chunk, dict | None]]:
    """(chunk, the hub stream's state after it or None) for every chunk of the corpus, in order; a hub stream
    starts from hub_state when given."""
    if spans is not None:  # already cut at max_bytes
        for path, lo, hi, split in spans:
            yield from ((chunk, None) for chunk in corpus.text_chunks(path, lo, hi, split, chunk_bytes))
        return
    record = record_reader(request.preference) if request.chat else corpus.record_text
    how = corpus.Reading(request.text_field, request.skip_bad_records, chunk_bytes, record)
    budget = Budget(request.max_bytes)
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
