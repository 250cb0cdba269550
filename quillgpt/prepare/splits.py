"""Documents, and how a corpus splits into train.bin and val.bin.

- docs: every document ends with the tokenizer's <|endoftext|> (GPT-2: 50256; a trained BPE's last id; a char
  vocabulary gets one id after its characters), and a fixed fraction of whole documents goes to val, chosen by a
  hash of each document's index and the split seed (`in_validation`): the same input always splits the same way.
- tail: nanoGPT's rule for one text file (the default for a lone text file): the first
  int(n_bytes * (1 - val_fraction)) bytes are train, the rest val, the cut moved to the next character start; no
  <|endoftext|> and, for char, no extra id.
- given: train.txt and val.txt of the data/processed layout, each whole (nanogpt_layout).
Each split needs at least 2 tokens, and a split by documents at least one document in each (`check_splits`).
"""

from __future__ import annotations

import os

import numpy as np

from quillgpt.errors import UserError
from quillgpt.prepare.request import Request

Span = tuple[str, int, int, str]  # (text file, start byte, end byte, split) of a corpus split by bytes


def in_validation(seed: int, first: int, n: int, fraction: float) -> np.ndarray:
    """Whether documents first .. first + n - 1 belong to the val split: a hash (splitmix64) of each document's
    index and the seed, below fraction of its range. The same index and seed always give the same answer."""
    with np.errstate(over="ignore"):
        x = np.arange(first, first + n, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


def tail_spans(path: str, max_bytes: int | None, val_fraction: float) -> list[Span]:
    """One text file (its first max_bytes) cut at int(n_bytes * (1 - val_fraction)), at character starts."""
    size = os.path.getsize(path)
    end = size if max_bytes is None or max_bytes >= size else char_start_at_or_before(path, max_bytes)
    if end == 0:
        raise UserError(
            f"input {path} is empty" if size == 0 else f"the first {max_bytes} bytes of {path} hold no whole character"
        )
    cut = char_start_at_or_after(path, int(end * (1 - val_fraction)), end)
    return [(path, 0, cut, "train"), (path, cut, end, "val")]


def given_spans(train: str, val: str) -> list[Span]:
    return [(train, 0, os.path.getsize(train), "train"), (val, 0, os.path.getsize(val), "val")]


def is_char_start(byte: int) -> bool:
    return not 0x80 <= byte < 0xC0


def char_start_at_or_after(path: str, pos: int, end: int) -> int:
    with open(path, "rb") as f:
        f.seek(pos)
        following = f.read(min(4, end - pos))
    return pos + next((i for i, byte in enumerate(following) if is_char_start(byte)), len(following))


def char_start_at_or_before(path: str, pos: int) -> int:
    if pos <= 0:  # the file's first byte starts its first character, whatever it is
        return 0
    with open(path, "rb") as f:
        f.seek(pos)
        byte = f.read(1)
    return pos if not byte or is_char_start(byte[0]) else char_start_at_or_before(path, pos - 1)


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
