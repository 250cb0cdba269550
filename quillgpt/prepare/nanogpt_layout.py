"""nanoGPT's data/processed layout, the second way data comes in: train.txt and val.txt (each split whole), or
train.npy and val.npy of token ids, with an optional meta.json naming the tokenizer (ours, or nanoGPT's itos/stoi
char vocabulary). `prepare_txt_dir` turns the folder into a dataset in data/processed/cache, through the same build
and work directory as prepare_dataset, and reuses it until the files change.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from quillgpt import corpus
from quillgpt.corpus import Source
from quillgpt.errors import UserError
from quillgpt.files import read_json
from quillgpt.prepare.pipeline import encode_dataset
from quillgpt.prepare.request import DEFAULT_VAL_FRACTION, Request, Settings
from quillgpt.prepare.splits import check_splits
from quillgpt.prepare.workdir import WORK_DIR, PartialBins, WorkDir, describe, token_dtype
from quillgpt.tokenizer import (
    Tokenizer,
    get_tiktoken,
    load_tokenizer,
    resolve_vocab_size,
    tokenizer_from_dict,
    tokenizer_kind,
)


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
        val_fraction=DEFAULT_VAL_FRACTION,  # unused by a given split; recorded, so existing caches stay reusable
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
        encode_dataset(src.name, cache, request, Settings(verbose, workers=workers), tok, fingerprint)
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
