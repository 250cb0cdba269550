"""Turn raw text into a token dataset: data/<dataset>/{train.bin, val.bin, tokenizer.json, meta.json}.

Examples:
    python prepare.py --dataset shakespeare_char --input ../shared/data/tinyshakespeare.txt
    python prepare.py --dataset shakespeare_char          # downloads tiny Shakespeare once (needs network)
    python prepare.py --dataset shakespeare --input ../shared/data/tinyshakespeare.txt   # gpt2 tokenizer
    python prepare.py --dataset pystdlib                  # offline: this Python's standard library, 4 MB
    python prepare.py --dataset pystdlib --tokenizer bpe --vocab-size 8192 --max-bytes 20000000
    python prepare.py --dataset mybook --input book.txt --tokenizer bpe --reset

Rules:
- Datasets: any text file via --input (the dataset name is then just the output folder name);
  shakespeare_char / shakespeare (tiny Shakespeare, downloaded once unless --input is given; default
  tokenizers char / gpt2); pystdlib (the .py files of the running interpreter's standard library,
  sorted by relative path, skipping site-packages and files that are not valid UTF-8, each after a
  "# file: <relpath>" line, cut at --max-bytes, default 4 MB).
  Every other dataset uses the char tokenizer unless --tokenizer says otherwise.
- Text is read as UTF-8. Invalid byte sequences become U+FFFD, one per maximal invalid subsequence as
  Python's "replace" decoding does (one warning line gives the count); NUL bytes are kept as characters.
  --max-bytes keeps only the first N bytes of the input (fewer when byte N is inside a character: the
  cut moves back to that character's start).
- Split (nanoGPT's rule): the first int(n_bytes * (1 - val_fraction)) bytes are train, the rest val
  (the cut moves forward to the next character start in non-ASCII text). Each split is encoded separately.
- char: the vocabulary is every character of train + val, sorted; --vocab-size is only an upper bound.
  bpe: byte-level BPE with --vocab-size tokens (default 4096, at least 256) trained on the first
  64 MB of the train split (`bpe_train_bytes`).
- The input is streamed in 16 MB chunks, so memory stays bounded for inputs of any size.
- train.bin / val.bin are flat token ids without a header, dtype meta["dtype"] (uint16, or uint32
  when vocab_size > 65535), little-endian: np.memmap(path, dtype=meta["dtype"], mode="r").
- meta.json is written last, so its presence means the dataset is complete. A complete dataset made
  with the same tokenizer request is reused as is; a different request needs --reset.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from tqdm import tqdm

from common import UserError, atomic_write, atomic_write_json, read_json, run_main
from tokenizer import (
    Tokenizer,
    get_tiktoken,
    load_tokenizer,
    resolve_vocab_size,
    safe_split_index,
    save_tokenizer,
    split_text,
    tokenizer_kind,
    tokenizer_label,
    tokenizer_from_dict,
    train_tokenizer,
)

FORMAT_VERSION = 1
CHUNK_BYTES = 16 * 2**20
BPE_TRAIN_BYTES = 64 * 2**20
BPE_TRAIN_PIECE_CHARS = 2**20  # rustbpe counts the pieces of one buffer in parallel
PYSTDLIB_MAX_BYTES = 4_000_000
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DOWNLOAD_TIMEOUT_S = 10
KNOWN_DATASETS = ("shakespeare_char", "shakespeare", "pystdlib")
META_FIELDS = {"tokenizer": dict, "vocab_size": int, "train_tokens": int, "val_tokens": int, "source": dict}


@dataclass
class _Span:
    """Bytes [start, end) of a file."""

    path: Path
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class _Reading:
    """What the encoding pass learns about the source bytes as it streams them."""

    sha256: Any = field(default_factory=hashlib.sha256)
    bytes: int = 0
    replaced: int = 0


def _meta_fields(tok: Tokenizer, n_train: int, n_val: int, max_id: int) -> dict:
    """The meta.json fields that describe the encoded token files."""
    return {
        "tokenizer": {"kind": tok.kind, "name": tok.name, "file": "tokenizer.json"},
        "vocab_size": tok.vocab_size,
        "dtype": token_dtype(tok.vocab_size),
        "train_tokens": n_train,
        "val_tokens": n_val,
        "max_token_id": max_id,
    }


def token_dtype(vocab_size: int) -> str:
    return "uint32" if vocab_size > 65535 else "uint16"


def _tokenizer_label(spec: str, vocab_size: int | None) -> str:
    return f"the {spec} tokenizer" + (f" (vocab {vocab_size})" if vocab_size is not None else "")


def _is_char_start(byte: int) -> bool:
    return not 0x80 <= byte < 0xC0


def _char_start_at_or_after(path: Path, pos: int, end: int) -> int:
    with open(path, "rb") as f:
        f.seek(pos)
        following = f.read(min(4, end - pos))
    for i, byte in enumerate(following):
        if _is_char_start(byte):
            return pos + i
    return pos + len(following)


def _char_start_at_or_before(path: Path, pos: int) -> int:
    lo = max(0, pos - 3)  # a UTF-8 character is at most 4 bytes
    with open(path, "rb") as f:
        f.seek(lo)
        window = f.read(pos - lo + 1)
    for p in range(pos, lo - 1, -1):
        if p - lo >= len(window) or _is_char_start(window[p - lo]):
            return p
    return pos


def _iter_chunks(span: _Span) -> Iterator[bytes]:
    """The span's bytes in chunks of about CHUNK_BYTES, cut where tokenization is unaffected."""
    with open(span.path, "rb") as f:
        f.seek(span.start)
        remaining, carry = span.size, b""
        while remaining > 0:
            block = f.read(min(CHUNK_BYTES, remaining))
            if not block:
                raise UserError(f"{span.path} shrank while being read")
            remaining -= len(block)
            buf = carry + block
            if remaining == 0:
                yield buf
                return
            cut = safe_split_index(buf, len(buf) // 2, len(buf))
            yield buf[:cut]
            carry = buf[cut:]


def _decode(raw: bytes) -> tuple[str, int]:
    """UTF-8 with invalid sequences replaced by U+FFFD; also the number of replacements."""
    text = raw.decode("utf-8", "replace")
    if "\ufffd" not in text:
        return text, 0
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def _progress(total: int, desc: str, verbose: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not verbose, leave=False)


def _texts(spans: Iterable[_Span], bar: tqdm | None = None) -> Iterator[str]:
    for span in spans:
        for raw in _iter_chunks(span):
            if bar is not None:
                bar.update(len(raw))
            yield _decode(raw)[0]


def _bpe_training_texts(span: _Span, limit: int) -> Iterator[str]:
    end = _char_start_at_or_before(span.path, min(span.end, span.start + limit))
    for text in _texts([_Span(span.path, span.start, end)]):
        yield from split_text(text, BPE_TRAIN_PIECE_CHARS)


def _make_tokenizer(
    spec: str, vocab_size: int | None, train: _Span, val: _Span, bpe_train_bytes: int, verbose: bool
) -> Tokenizer:
    if spec == "char":
        with _progress(train.size + val.size, "char vocabulary", verbose) as bar:
            return train_tokenizer("char", _texts([train, val], bar), vocab_size)
    if spec == "bpe":
        used = min(train.size, bpe_train_bytes)
        if verbose:
            print(f"training a byte-level BPE with {vocab_size} tokens on {used / 1e6:.1f} MB of text...")
        t0 = time.perf_counter()
        tok = train_tokenizer("bpe", _bpe_training_texts(train, bpe_train_bytes), vocab_size)
        if verbose:
            print(f"BPE trained in {time.perf_counter() - t0:.1f}s: {tok.vocab_size} tokens")
        return tok
    return _fixed_tokenizer(spec, vocab_size)


def _encoded(tok: Tokenizer, span: _Span, reading: _Reading, bar: tqdm) -> Iterator[np.ndarray]:
    for raw in _iter_chunks(span):
        reading.sha256.update(raw)
        reading.bytes += len(raw)
        text, replaced = _decode(raw)
        reading.replaced += replaced
        yield tok.encode_array(text)
        bar.update(len(raw))


def _write_bins(
    out_dir: Path, vocab_size: int, splits: tuple[Iterable[np.ndarray], Iterable[np.ndarray]], what: str
) -> tuple[int, int, int]:
    """Stream token arrays into train.bin and val.bin; neither file appears unless both are complete."""
    dtype = token_dtype(vocab_size)
    counts, max_id = [0, 0], -1
    with atomic_write(out_dir / "train.bin") as train_file, atomic_write(out_dir / "val.bin") as val_file:
        for i, (f, arrays) in enumerate(zip((train_file, val_file), splits)):
            for ids in arrays:
                if ids.size == 0:
                    continue
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= vocab_size:
                    raise UserError(f"{what} has token id {lo if lo < 0 else hi}, outside the vocabulary (size {vocab_size})")
                max_id = max(max_id, hi)
                f.write(np.ascontiguousarray(ids, dtype=dtype).data)
                counts[i] += ids.size
        if min(counts) < 2:
            raise UserError(
                f"{what} is too small for a validation split ({counts[0]} train / {counts[1]} val tokens; "
                "each split needs at least 2)"
            )
    return counts[0], counts[1], max_id


def _build(
    out_dir: Path, tok: Tokenizer, train: _Span, val: _Span, what: str, verbose: bool
) -> tuple[dict, _Reading]:
    """Encode both spans into out_dir; returns the meta fields about tokens and what was read."""
    save_tokenizer(tok, out_dir / "tokenizer.json")
    reading = _Reading()
    with _progress(train.size + val.size, "encoding", verbose) as bar:
        n_train, n_val, max_id = _write_bins(
            out_dir, tok.vocab_size, (_encoded(tok, train, reading, bar), _encoded(tok, val, reading, bar)), what
        )
    if reading.replaced:
        print(f"warning: {what} has {reading.replaced} invalid UTF-8 byte sequences; each became U+FFFD", file=sys.stderr)
    return _meta_fields(tok, n_train, n_val, max_id), reading


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**20):
            digest.update(block)
    return digest.hexdigest()


def _download_shakespeare(path: Path, verbose: bool) -> None:
    if path.is_file() and _sha256_file(path) == SHAKESPEARE_SHA256:
        return
    offline_hint = "pass --input /path/to/tinyshakespeare.txt"
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
        raise UserError(f"downloaded tiny Shakespeare has sha256 {digest}, expected {SHAKESPEARE_SHA256}: {offline_hint}")
    with atomic_write(path) as f:
        f.write(data)


def _stdlib_files() -> tuple[Path, list[tuple[str, Path]]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in names:
            if name.endswith(".py"):
                path = Path(directory, name)
                files.append((path.relative_to(root).as_posix(), path))
    return root, sorted(files)


def _utf8_prefix(data: bytes, n: int) -> bytes:
    """The first n bytes of data, shortened so no character is cut."""
    if n >= len(data):
        return data
    while n > 0 and not _is_char_start(data[n]):
        n -= 1
    return data[:n]


def _write_pystdlib(path: Path, max_bytes: int) -> Path:
    """Concatenate the stdlib's UTF-8 .py files (sorted by relative path) into path; returns the stdlib dir."""
    root, files = _stdlib_files()
    written = 0
    with atomic_write(path) as out:
        for relpath, file in files:
            if written >= max_bytes:
                break
            try:
                data = file.read_bytes()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if data and not data.endswith(b"\n"):
                data += b"\n"
            piece = _utf8_prefix(f"# file: {relpath}\n".encode() + data, max_bytes - written)
            out.write(piece)
            written += len(piece)
    return root


def _resolve_source(
    dataset: str, input_path: str | None, out_dir: Path, max_bytes: int | None, verbose: bool
) -> tuple[_Span, dict]:
    """The bytes to prepare and the meta["source"] fields known before reading them."""
    if input_path is not None:
        path = Path(input_path)
        if not path.exists():
            raise UserError(f"input file not found: {path}")
        if not path.is_file():
            raise UserError(f"input {path} is not a file")
        source = {"path": str(path.resolve()), "kind": "file"}
    elif dataset in ("shakespeare_char", "shakespeare"):
        path = out_dir / "input.txt"
        _download_shakespeare(path, verbose)
        source = {"path": str(path.resolve()), "kind": "download", "url": SHAKESPEARE_URL}
    elif dataset == "pystdlib":
        path = out_dir / "input.txt"
        root = _write_pystdlib(path, max_bytes if max_bytes is not None else PYSTDLIB_MAX_BYTES)
        source = {"path": str(root), "kind": "pystdlib"}
    elif (out_dir / "train.bin").exists():
        raise UserError(f"{out_dir} has no meta.json, so it is incomplete or was not made by prepare.py: "
                        "pass --input FILE (data.input) to prepare it again")
    else:
        raise UserError(
            f"unknown dataset {dataset!r}: pass --input FILE to prepare your own text, "
            f"or use one of {', '.join(KNOWN_DATASETS)}"
        )
    size = path.stat().st_size
    end = size if max_bytes is None or max_bytes >= size else _char_start_at_or_before(path, max_bytes)
    if end == 0:
        raise UserError(f"input {path} is empty")
    return _Span(path, 0, end), source


def _split(span: _Span, val_fraction: float) -> tuple[_Span, _Span]:
    cut = span.start + int(span.size * (1 - val_fraction))
    cut = _char_start_at_or_after(span.path, cut, span.end)
    return _Span(span.path, span.start, cut), _Span(span.path, cut, span.end)


def _default_tokenizer(dataset: str) -> str:
    return "gpt2" if dataset == "shakespeare" else "char"


def _fixed_tokenizer(name: str, vocab_size: int | None) -> Tokenizer:
    tok = get_tiktoken(name)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise UserError(f"the {name} tokenizer has {tok.vocab_size} tokens, more than the requested vocab_size {vocab_size}")
    return tok


def _check_meta_fields(meta: dict, path: Path) -> None:
    """The fields that reuse decisions and messages read must have their types (meta.json may be hand-edited)."""
    for key, kind in META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(f"{path} is malformed: {key!r} is missing or not a {kind.__name__}; pass --reset to re-prepare it")


def _reusable(out_dir: Path, request: dict, input_path: str | None) -> dict | None:
    """The existing meta if out_dir holds a complete dataset made for this request; UserError on a conflict."""
    meta = read_json(out_dir / "meta.json", "dataset metadata")
    if any(not (out_dir / name).is_file() for name in ("train.bin", "val.bin", "tokenizer.json")):
        return None
    _check_meta_fields(meta, out_dir / "meta.json")
    old = meta.get("request")
    if not isinstance(old, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{out_dir} was prepared by another version of prepare.py; pass --reset to re-prepare it")
    spec, vocab_size = request["tokenizer"], request["vocab_size"]
    made_with = _tokenizer_label(old.get("tokenizer"), meta.get("vocab_size"))
    wanted = _tokenizer_label(spec, vocab_size)
    if old.get("tokenizer") != spec:
        raise UserError(f"{out_dir} was prepared with {made_with}; pass --reset to re-prepare it with {wanted}")
    if spec == "bpe" and old.get("vocab_size") != vocab_size:
        raise UserError(f"{out_dir} was prepared with {made_with}; pass --reset to re-prepare it with {wanted}")
    if spec != "bpe" and vocab_size is not None and meta.get("vocab_size", 0) > vocab_size:
        raise UserError(f"{out_dir} was prepared with {made_with}, more than vocab_size {vocab_size}; pass --reset to re-prepare it")
    if old.get("max_bytes") != request["max_bytes"]:
        raise UserError(
            f"{out_dir} was prepared from max_bytes={old.get('max_bytes')}; "
            f"pass --reset to re-prepare it with max_bytes={request['max_bytes']}"
        )
    source = meta.get("source", {})
    if input_path is not None:
        path = Path(input_path).resolve()
        if source.get("kind") != "file" or source.get("path") != str(path):
            raise UserError(f"{out_dir} was prepared from {source.get('path')}; pass --reset to re-prepare it from {path}")
        if request["max_bytes"] is None and path.is_file() and path.stat().st_size != source.get("bytes"):
            raise UserError(f"{path} changed since {out_dir} was prepared from it; pass --reset to re-prepare it")
    return meta


def _describe(meta: dict) -> str:
    return f"{tokenizer_label(meta['tokenizer'])} tokenizer, vocab {meta['vocab_size']}, {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens"


def prepare_dataset(
    dataset: str,
    *,
    input_path: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    reset: bool = False,
    data_dir: str | Path = "data",
    max_bytes: int | None = None,
    verbose: bool = True,
    bpe_train_bytes: int = BPE_TRAIN_BYTES,
) -> Path:
    """Prepare (or reuse) data_dir/dataset with train.bin, val.bin, tokenizer.json and meta.json; returns that dir.

    tokenizer: "char", "bpe" or a tiktoken encoding name; None means gpt2 for "shakespeare", char otherwise.
    """
    if not dataset or dataset in (".", "..") or "/" in dataset or os.sep in dataset:
        raise UserError(f"dataset name must be a plain folder name, got {dataset!r}")
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes must be positive, got {max_bytes}")
    if bpe_train_bytes <= 0:
        raise UserError(f"bpe_train_bytes must be positive, got {bpe_train_bytes}")
    spec = tokenizer or _default_tokenizer(dataset)
    kind = tokenizer_kind(spec)
    if dataset == "pystdlib" and input_path is None and max_bytes is None:
        max_bytes = PYSTDLIB_MAX_BYTES
    request = {"tokenizer": spec, "vocab_size": resolve_vocab_size(kind, vocab_size), "max_bytes": max_bytes}

    out_dir = Path(data_dir) / dataset
    meta_path = out_dir / "meta.json"
    if meta_path.exists() and not reset:
        try:
            meta = _reusable(out_dir, request, input_path)
        except UserError as e:
            if "--reset" in str(e):
                raise
            raise UserError(f"{e}; pass --reset to re-prepare it") from None
        if meta is not None:
            if verbose:
                print(f"reusing {out_dir} ({_describe(meta)})")
            return out_dir
    meta_path.unlink(missing_ok=True)  # from here on the old files may be replaced one by one

    tok = _fixed_tokenizer(spec, request["vocab_size"]) if kind == "tiktoken" else None  # fail fast when offline
    span, source = _resolve_source(dataset, input_path, out_dir, max_bytes, verbose)
    train, val = _split(span, val_fraction)
    if verbose:
        print(f"preparing {out_dir} from {source['path']} ({span.size:,} bytes)")
    if tok is None:
        tok = _make_tokenizer(spec, request["vocab_size"], train, val, bpe_train_bytes, verbose)
    fields, reading = _build(out_dir, tok, train, val, f"input {span.path}", verbose)
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        **fields,
        "source": {
            **source,
            "bytes": reading.bytes,
            "sha256": reading.sha256.hexdigest(),
            "invalid_utf8_replaced": reading.replaced,
        },
        "val_fraction": val_fraction,
        "request": request,
    }
    atomic_write_json(meta_path, meta)
    if verbose:
        print(f"wrote {out_dir} ({_describe(meta)})")
    return out_dir


def _tokenizer_from_processed_meta(processed_dir: Path) -> Tokenizer | str | None:
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
        return _nanogpt_char_tokenizer(meta, path)
    return None


def _nanogpt_char_tokenizer(meta: dict, path: Path) -> Tokenizer:
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


def _fingerprint(processed_dir: Path, names: Iterable[str]) -> dict:
    fingerprint = {}
    for name in names:
        path = processed_dir / name
        if path.is_file():
            st = path.stat()
            fingerprint[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return fingerprint


def _load_ids(path: Path) -> np.ndarray:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read token ids from {path}: {e}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise UserError(f"{path} must hold a 1-D integer array of token ids, got shape {ids.shape} ({ids.dtype})")
    return ids


def _array_chunks(ids: np.ndarray, reading: _Reading) -> Iterator[np.ndarray]:
    step = CHUNK_BYTES // 4
    for start in range(0, len(ids), step):
        chunk = np.asarray(ids[start : start + step])
        reading.sha256.update(chunk.tobytes())
        reading.bytes += chunk.nbytes
        yield chunk


def prepare_txt_dir(
    processed_dir: str | Path, *, tokenizer: str = "char", vocab_size: int | None = None, verbose: bool = True
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
    if (src / "train.txt").is_file() or (src / "val.txt").is_file():
        names = ("train.txt", "val.txt")
    else:
        names = ("train.npy", "val.npy")
    missing = [name for name in names if not (src / name).is_file()]
    if missing:
        raise UserError(f"{src} needs train.txt and val.txt (or train.npy and val.npy of token ids); missing {', '.join(missing)}")
    cache = src / "cache"
    request = {"tokenizer": tokenizer, "vocab_size": vocab_size, "files": _fingerprint(src, (*names, "meta.json"))}
    cache_meta_path = cache / "meta.json"
    if cache_meta_path.is_file():
        try:
            meta = read_json(cache_meta_path, "cache metadata")
            _check_meta_fields(meta, cache_meta_path)
        except UserError:
            meta = {}
        complete = all((cache / name).is_file() for name in ("train.bin", "val.bin", "tokenizer.json"))
        if meta.get("request") == request and meta.get("format_version") == FORMAT_VERSION and complete:
            if verbose:
                print(f"reusing {cache} ({_describe(meta)})")
            return cache
        cache_meta_path.unlink()

    found = _tokenizer_from_processed_meta(src)
    spec = found if isinstance(found, str) else tokenizer
    tok = found if isinstance(found, Tokenizer) else None
    reading = _Reading()
    if names[0].endswith(".npy"):
        if tok is None:
            if tokenizer_kind(spec) != "tiktoken":
                raise UserError(f"{src}/train.npy holds token ids, so {src}/meta.json must say which tokenizer made them")
            tok = get_tiktoken(spec)
        train_ids, val_ids = _load_ids(src / "train.npy"), _load_ids(src / "val.npy")
        save_tokenizer(tok, cache / "tokenizer.json")
        n_train, n_val, max_id = _write_bins(
            cache, tok.vocab_size, (_array_chunks(train_ids, reading), _array_chunks(val_ids, reading)), f"{src}"
        )
        fields = _meta_fields(tok, n_train, n_val, max_id)
    else:
        train = _Span(src / "train.txt", 0, (src / "train.txt").stat().st_size)
        val = _Span(src / "val.txt", 0, (src / "val.txt").stat().st_size)
        if train.size == 0 or val.size == 0:
            raise UserError(f"{train.path if train.size == 0 else val.path} is empty")
        if tok is None:
            vocab_size = resolve_vocab_size(tokenizer_kind(spec), vocab_size)
            tok = _make_tokenizer(spec, vocab_size, train, val, BPE_TRAIN_BYTES, verbose)
        fields, reading = _build(cache, tok, train, val, f"{src}", verbose)
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": src.name,
        **fields,
        "source": {
            "path": str(src.resolve()),
            "kind": "txt_dir",
            "bytes": reading.bytes,
            "sha256": reading.sha256.hexdigest(),
            "invalid_utf8_replaced": reading.replaced,
        },
        "val_fraction": round(fields["val_tokens"] / (fields["train_tokens"] + fields["val_tokens"]), 6),
        "request": request,
    }
    atomic_write_json(cache_meta_path, meta)
    if verbose:
        print(f"wrote {cache} ({_describe(meta)})")
    return cache


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="output folder name; shakespeare_char, shakespeare and pystdlib need no --input")
    parser.add_argument("--input", help="a UTF-8 text file to prepare")
    parser.add_argument("--tokenizer", help="char, bpe or a tiktoken encoding such as gpt2 (default: gpt2 for shakespeare, else char)")
    parser.add_argument("--vocab-size", type=_positive_int, help="bpe vocabulary size (default 4096); an upper bound for char")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of the text (the end) used for validation")
    parser.add_argument("--reset", action="store_true", help="re-prepare even if the dataset exists")
    parser.add_argument("--max-bytes", type=_positive_int, help="use only the first N bytes of the input (pystdlib default 4000000)")
    parser.add_argument("--data-dir", default="data", help="parent folder of the dataset folders")
    parser.add_argument("--bpe-train-bytes", type=_positive_int, default=BPE_TRAIN_BYTES, help="BPE trains on this many bytes of train")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    prepare_dataset(
        args.dataset,
        input_path=args.input,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        reset=args.reset,
        data_dir=args.data_dir,
        max_bytes=args.max_bytes,
        bpe_train_bytes=args.bpe_train_bytes,
    )


if __name__ == "__main__":
    run_main(main)
