"""Corpora as documents: every kind of input prepare.py reads, cut into chunks of work.

    text file          one document; with --split tail (the default for a lone text file) a stream of
                       text split by bytes, nanoGPT's rule
    directory          every file under it that --glob matches (default: all; hidden ones skipped),
                       sorted by path: .jsonl(.gz/.zst) and .parquet files are read as records, any
                       other file is one document
    .jsonl .jsonl.gz .jsonl.zst   one JSON object per line; its --text-field is the document
    .parquet           one row per document, the --text-field column (pyarrow, a row group at a time)
    hub dataset        --hf-dataset NAME, streamed with the `datasets` library (also a local directory
                       of data files that `datasets` reads), never held in memory
    pystdlib           this Python's standard library, each .py file a document

A chunk is one worker's unit of work, about chunk_bytes of input (16 MiB by default). Its bounds depend on the input
alone, so any number of workers see the same chunks, and a restarted prepare can skip the chunks
it finished. Text is read as UTF-8; invalid bytes become U+FFFD (counted). Empty documents are
skipped. Optional libraries are imported where needed, with a one-line error naming the extra.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from quillgpt.errors import UserError
from quillgpt.network import check_hub_reachable
from quillgpt.tokenizer import safe_split_index

CHUNK_BYTES = 16 * 2**20  # the default size of a chunk
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


# ---- what to read -------------------------------------------------------------------------------


@dataclass
class Source:
    """One input. kind: text | files | jsonl | parquet | hub | pystdlib."""

    kind: str
    path: str | None = None  # a file or directory (absolute), or the hub dataset's name
    files: list[str] = field(default_factory=list)  # files: every document file, in order
    config: str | None = None  # hub: the dataset's configuration (subset)
    split: str = "train"  # hub: the split read
    revision: str | None = None  # hub: a branch, tag or commit
    url: str | None = None  # where a downloaded file came from

    def describe(self) -> dict:
        """What meta.json records about this source: what it is, its size and the sha256 of its bytes (of its
        files' bytes in order, for a directory)."""
        if self.kind == "hub":
            return {
                "kind": "hub",
                "dataset": self.path,
                "config": self.config,
                "split": self.split,
                "revision": self.revision,
            }
        files = self.files or [self.path]
        digest = hashlib.sha256()
        for path in files:
            with open(path, "rb") as f:
                while block := f.read(2**22):
                    digest.update(block)
        d = {
            "kind": self.kind,
            "path": self.path,
            "bytes": sum(os.path.getsize(p) for p in files),
            "sha256": digest.hexdigest(),
        }
        return {**d, "files": len(self.files)} if self.files else {**d, "url": self.url} if self.url else d


def local_sources(paths: list[str], glob: str | None) -> list[Source]:
    """--input paths: files by their suffix, directories walked with glob (each record file a source of its own)."""
    sources: list[Source] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise UserError(f"input not found: {path}")
        if path.is_dir():
            sources += directory_sources(path, glob or "*")
        elif glob is not None:
            raise UserError(f"--glob selects files in a directory, but --input {path} is a file")
        else:
            sources.append(file_source(path))
    return sources


def file_source(path: Path) -> Source:
    kind = next((s.strip(".").split(".")[0] for s in RECORD_SUFFIXES if path.name.endswith(s)), "text")
    if path.name.endswith(".zst"):
        kind = "jsonl"
    return Source(kind, str(path.resolve()))


def directory_sources(directory: Path, glob: str) -> list[Source]:
    """The files under directory matching glob, sorted by path; record files are sources of their own and the
    documents between them (every other file) are grouped, so the order of documents is the order of paths."""
    found = sorted(
        p
        for p in directory.rglob(glob)
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    if not found:
        raise UserError(f"--glob {glob!r} matches no file under {directory}")
    sources: list[Source] = []
    for path in found:
        if path.name.endswith(RECORD_SUFFIXES):
            sources.append(file_source(path))
        elif sources and sources[-1].kind == "files" and sources[-1].path == str(directory.resolve()):
            sources[-1].files.append(str(path.resolve()))
        else:
            sources.append(Source("files", str(directory.resolve()), [str(path.resolve())]))
    return sources


def stdlib_source() -> Source:
    """The running interpreter's standard library .py files (not site-packages), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return Source("pystdlib", str(root), [str(p) for p in sorted(files, key=lambda p: p.relative_to(root).as_posix())])


def hub_source(name: str, config: str | None, split: str, revision: str | None) -> Source:
    """A dataset streamed by `datasets`: a hub name (the network is checked at once) or a local directory."""
    if not Path(name).is_dir():
        check_hub_reachable(
            f"the dataset {name} streams from the Hugging Face hub",
            "offline: copy its data files (parquet or jsonl) to this machine and pass them with --input",
        )
    return Source(
        "hub",
        name if not Path(name).is_dir() else str(Path(name).resolve()),
        config=config,
        split=split,
        revision=revision,
    )


# ---- chunks: units of work --------------------------------------------------------------------------


@dataclass
class TextSpan:
    """Bytes [start, end) of a text file, read as one stream of text (tail split: no documents)."""

    path: str
    start: int
    end: int
    split: str  # train | val


@dataclass
class Files:
    """Whole files, one document each; limits cut a file at a byte count (the --max-bytes budget)."""

    paths: list[str]
    limits: list[int | None]


@dataclass
class JsonLines:
    """Complete lines of a .jsonl file, the first being line number first_line."""

    path: str
    first_line: int
    data: bytes
    field: str
    skip_bad: bool


@dataclass
class ParquetRows:
    """One row group of a .parquet file."""

    path: str
    row_group: int
    field: str
    skip_bad: bool


@dataclass
class Texts:
    """Documents already read (from a hub stream); skipped: records that had no usable text."""

    texts: list[str]
    skipped: int = 0


Chunk = TextSpan | Files | JsonLines | ParquetRows | Texts


@dataclass
class Documents:
    texts: list[str]  # the chunk's documents in order (a TextSpan: its text, one piece)
    skipped: int = 0  # records left out (--skip-bad-records) or empty
    replaced: int = 0  # invalid UTF-8 sequences that became U+FFFD


def read(chunk: Chunk) -> Documents:
    """The documents of a chunk (in a worker process)."""
    if isinstance(chunk, TextSpan):
        with open(chunk.path, "rb") as f:
            f.seek(chunk.start)
            text, replaced = decode(f.read(chunk.end - chunk.start))
        return Documents([text], 0, replaced)
    if isinstance(chunk, Files):
        return read_files(chunk)
    if isinstance(chunk, JsonLines):
        return read_json_lines(chunk)
    if isinstance(chunk, ParquetRows):
        return read_parquet_rows(chunk)
    return keep_documents(chunk.texts, chunk.skipped)


def decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 with invalid sequences replaced by U+FFFD; also the number of replacements."""
    text = raw.decode("utf-8", "replace")
    if "\ufffd" not in text:
        return text, 0
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def keep_documents(texts: list[str], skipped: int, replaced: int = 0) -> Documents:
    kept = [t for t in texts if t]
    return Documents(kept, skipped + len(texts) - len(kept), replaced)


def read_files(chunk: Files) -> Documents:
    texts, replaced = [], 0
    for path, limit in zip(chunk.paths, chunk.limits):
        with open(path, "rb") as f:
            text, bad = decode(f.read() if limit is None else without_cut_character(f.read(limit)))
        texts.append(text)
        replaced += bad
    return keep_documents(texts, 0, replaced)


def without_cut_character(data: bytes) -> bytes:
    """data (a read stopped at a byte count) without the incomplete character it may end with."""
    lead = len(data) - 1
    while lead >= max(0, len(data) - 4) and 0x80 <= data[lead] < 0xC0:  # continuation bytes
        lead -= 1
    if lead < 0 or data[lead] < 0xC0:
        return data
    needed = 4 if data[lead] >= 0xF0 else 3 if data[lead] >= 0xE0 else 2
    return data if len(data) - lead >= needed else data[:lead]


def read_json_lines(chunk: JsonLines) -> Documents:
    texts, skipped = [], 0
    for number, line in enumerate(chunk.data.split(b"\n"), chunk.first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            if not chunk.skip_bad:
                raise UserError(
                    f"{chunk.path}:{number}: not a JSON object ({e}); fix it, or pass "
                    "--skip-bad-records to count and skip such records"
                ) from None
            skipped += 1
            continue
        text = record_text(record, chunk.field, f"{chunk.path}:{number}", chunk.skip_bad)
        if text is None:
            skipped += 1
        else:
            texts.append(text)
    return keep_documents(texts, skipped)


def record_text(record: object, name: str, where: str, skip_bad: bool) -> str | None:
    """The record's text field; None (skip it) or a UserError when it has none or it is not a string."""
    value = record.get(name) if isinstance(record, dict) else None
    if isinstance(value, str):
        return value
    if skip_bad:
        return None
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: the record is a {type(record).__name__}, not an object with a {name!r} field; "
            "--skip-bad-records counts and skips such records"
        )
    if name not in record:
        raise UserError(
            f"{where}: the record has no {name!r} field (it has {', '.join(map(repr, list(record)[:8]))}); "
            "name the text field with --text-field, or --skip-bad-records"
        )
    raise UserError(f"{where}: field {name!r} is a {type(value).__name__}, not a string; --skip-bad-records skips it")


def parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install '.[data]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow reports a damaged file as ArrowInvalid, OSError or others
        raise UserError(f"{path} is not a readable parquet file: {str(e).splitlines()[0]}") from None


def read_parquet_rows(chunk: ParquetRows) -> Documents:
    table = parquet_file(chunk.path).read_row_group(chunk.row_group, columns=[chunk.field])
    column = table.column(0)
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise UserError(f"{chunk.path}: column {chunk.field!r} holds {column.type}, not strings")
    values = column.to_pylist()
    nulls = sum(v is None for v in values)
    if nulls and not chunk.skip_bad:
        raise UserError(
            f"{chunk.path}: row group {chunk.row_group} has {nulls} rows without a {chunk.field!r} value; "
            "--skip-bad-records skips them"
        )
    return keep_documents([v for v in values if v is not None], nulls)


# ---- the chunks of each source ------------------------------------------------------------------


@dataclass
class Budget:
    """--max-bytes: how many more input bytes may be read (None: no limit)."""

    left: int | None

    def take(self, n: int) -> int:
        """Of n bytes, how many may be read."""
        if self.left is None:
            return n
        n = min(n, self.left)
        self.left -= n
        return n

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0


@dataclass
class Reading:
    """How records are read: the text field, whether bad records are skipped, the size of a chunk, and what a hub
    record's field becomes (record_text; prepare.py --chat: its checked conversation)."""

    text_field: str = "text"
    skip_bad: bool = False
    chunk_bytes: int = CHUNK_BYTES
    record: Callable = record_text


def chunks_of(source: Source, how: Reading, budget: Budget) -> Iterator[Chunk]:
    """A local source's chunks, in order. (A hub source's come from hub_chunks, which can resume mid-stream.)"""
    if source.kind == "text":
        size = os.path.getsize(source.path)
        yield Files([source.path], [None if budget.left is None else budget.take(size)])
    elif source.kind in ("files", "pystdlib"):
        yield from file_chunks(source.files, budget, how.chunk_bytes)
    elif source.kind == "jsonl":
        yield from json_line_chunks(source.path, how, budget)
    elif source.kind == "parquet":
        yield from parquet_chunks(source.path, how, budget)


def text_chunks(path: str, start: int, end: int, split: str, chunk_bytes: int) -> Iterator[TextSpan]:
    """Bytes [start, end) of a text file as TextSpans, cut where tokenization is unaffected (a split by bytes)."""
    with open(path, "rb") as f:
        pos = start
        while pos < end:
            f.seek(pos)
            block = f.read(min(chunk_bytes, end - pos) + 4)  # a little beyond: a character may straddle the cut
            cut = end if pos + chunk_bytes >= end else pos + safe_split_index(block, chunk_bytes // 2, chunk_bytes)
            yield TextSpan(path, pos, cut, split)
            pos = cut


def file_chunks(paths: list[str], budget: Budget, chunk_bytes: int) -> Iterator[Files]:
    batch: list[str] = []
    limits: list[int | None] = []
    size = 0
    for path in paths:
        if budget.spent:
            break
        n = os.path.getsize(path)
        allowed = budget.take(n)
        batch.append(path)
        limits.append(None if allowed == n else allowed)
        size += allowed
        if size >= chunk_bytes:
            yield Files(batch, limits)
            batch, limits, size = [], [], 0
    if batch:
        yield Files(batch, limits)


def open_records(path: str) -> io.BufferedIOBase:
    """A .jsonl file, decompressed as it is read (.gz: gzip, .zst: zstandard)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"reading {path} needs the zstandard package: pip install '.[data]'") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def json_line_chunks(path: str, how: Reading, budget: Budget) -> Iterator[JsonLines]:
    """About chunk_bytes of complete lines at a time (and a last line without a newline)."""
    line, carry = 1, b""
    try:
        with open_records(path) as f:
            while not budget.spent:
                block = f.read(how.chunk_bytes)
                data = carry + block
                cut = data.rfind(b"\n") + 1 if block else len(data)  # at the end of the file: all that is left
                data, carry = data[:cut], data[cut:]
                if budget.left is not None and len(data) > budget.left:  # whole records only, then stop
                    data = data[: data.rfind(b"\n", 0, budget.left) + 1]
                    budget.left = 0
                else:
                    budget.take(len(data))
                if data:
                    yield JsonLines(path, line, data, how.text_field, how.skip_bad)
                    line += data.count(b"\n")
                if not block:
                    return
    except (OSError, EOFError) as e:  # a damaged .gz or .zst
        raise UserError(f"cannot read {path}: {e}") from None


def parquet_chunks(path: str, how: Reading, budget: Budget) -> Iterator[ParquetRows]:
    """One row group at a time (a parquet writer's row groups are its units of reading)."""
    pf = parquet_file(path)
    names = pf.schema_arrow.names
    if how.text_field not in names:
        raise UserError(
            f"{path} has no column {how.text_field!r} (it has {', '.join(map(repr, names[:8]))}); "
            "name the text column with --text-field"
        )
    for group in range(pf.metadata.num_row_groups):
        if budget.spent:
            return
        budget.take(pf.metadata.row_group(group).total_byte_size)
        yield ParquetRows(path, group, how.text_field, how.skip_bad)


def chunk_size(chunk: Chunk) -> int:
    """The input bytes a chunk stands for (the progress bar's unit)."""
    if isinstance(chunk, TextSpan):
        return chunk.end - chunk.start
    if isinstance(chunk, Files):
        return sum(limit if limit is not None else os.path.getsize(p) for p, limit in zip(chunk.paths, chunk.limits))
    if isinstance(chunk, JsonLines):
        return len(chunk.data)
    if isinstance(chunk, ParquetRows):
        return parquet_file(chunk.path).metadata.row_group(chunk.row_group).total_byte_size
    return sum(len(t) for t in chunk.texts)


def hub_chunks(source: Source, how: Reading, budget: Budget, state: dict | None) -> Iterator[tuple[Texts, dict]]:
    """A hub (or local) dataset streamed by `datasets`, about chunk_bytes of text a chunk, each with the stream's
    state after it: a restarted prepare continues from a saved state instead of streaming the corpus again."""
    stream = open_hub_stream(source)
    if state is not None:
        stream.load_state_dict(state)
    texts, size, seen, skipped = [], 0, 0, 0
    for record in stream:
        seen += 1
        text = how.record(record, how.text_field, f"{source.path} record {seen}", how.skip_bad)
        if text is None:
            skipped += 1
            continue
        whole = not isinstance(text, str)  # a conversation (or a preference pair) is read whole or not at all
        allowed = budget.take(content_chars(text))
        texts.append(text[:allowed] if not whole else text)
        size += allowed
        if size >= how.chunk_bytes or budget.spent:
            yield Texts(texts, skipped), stream.state_dict()
            texts, size, skipped = [], 0, 0
            if budget.spent:
                return
    if texts or skipped:
        yield Texts(texts, skipped), stream.state_dict()


def content_chars(value: str | dict | list | tuple) -> int:
    """The characters of a record's text: a string's, a message's content, or those of a conversation's messages (a
    preference pair's conversations)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return len(value["content"])
    return sum(content_chars(v) for v in value)


def open_hub_stream(source: Source):
    try:
        import datasets
    except ImportError:
        raise UserError(
            "--hf-dataset needs the datasets library: pip install '.[data]' (or pass local files with --input)"
        ) from None
    import huggingface_hub

    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()  # its warnings are not errors
    try:
        return datasets.load_dataset(
            source.path, source.config, split=source.split, streaming=True, revision=source.revision
        )
    except Exception as e:  # unknown dataset, config or split, unreachable hub: datasets raises many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--hf-dataset {source.path}: {first}") from None
