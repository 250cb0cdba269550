"""The work directory, data/<dataset>/.prepare: a prepare under way keeps its tokenizer, its partial train.bin and
val.bin and a journal (progress.json) there, written after each chunk, and finally the dataset's meta.json.

A killed prepare, run again with the same request, continues from its last completed chunk (a hub stream from its
saved state) and ends with the files an uninterrupted run writes. `commit` moves the finished files into the dataset
folder with meta.json last, so meta.json's presence means the dataset is complete:
- train.bin / val.bin: flat token ids without a header, dtype meta["dtype"] (uint16, or uint32 when
  vocab_size > 65535), little-endian: np.memmap(path, dtype=meta["dtype"], mode="r");
- a chat dataset (meta["chat"]) also has <split>.mask.bin and <split>.starts.bin (CHAT_FILES; prepare/chat.py);
  preference pairs (meta["preference"]) are such a dataset with two conversations a pair (prepare/preference.py);
- tokenizer.json: the tokenizer, rebuilt by quillgpt.tokenizer.load_tokenizer;
- meta.json: the tokenizer, token and document counts, the split, the sources and the request that made it.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from quillgpt.corpus import Source
from quillgpt.errors import UserError
from quillgpt.files import atomic_write_json, fsync_dir, read_json
from quillgpt.prepare.request import Request
from quillgpt.tokenizer import Tokenizer, load_tokenizer, save_tokenizer, tokenizer_label

WORK_DIR = ".prepare"
FORMAT_VERSION = 2
# a chat dataset's files besides train.bin and val.bin, with their dtypes (little-endian, no header): per token
# 1 where the loss counts it (an assistant token), and per conversation the offset of its first token
CHAT_FILES = {
    "train.mask.bin": np.dtype("<u1"),
    "val.mask.bin": np.dtype("<u1"),
    "train.starts.bin": np.dtype("<i8"),
    "val.starts.bin": np.dtype("<i8"),
}


def token_dtype(vocab_size: int) -> str:
    return "uint32" if vocab_size > 65535 else "uint16"


def describe(meta: dict) -> str:
    """A dataset's meta.json in a line."""
    return (
        f"{tokenizer_label(meta['tokenizer'])} tokenizer, vocab {meta['vocab_size']}, {meta['train_tokens']:,} train / "
        f"{meta['val_tokens']:,} val tokens"
    )


class PartialBins:
    """train.bin and val.bin in the work directory (and a chat dataset's mask and starts files), appended chunk by
    chunk. They are written directly, not through atomic_write: the journal records how much of each is complete, a
    restart cuts them back to that, and only finished files are moved into the dataset."""

    def __init__(
        self, directory: Path, dtype: str, train_bytes: int, val_bytes: int, extra: dict[str, int] | None = None
    ):
        """extra: the other files' names -> their complete sizes in bytes (CHAT_FILES, from the journal's counts)."""
        self.dtype = np.dtype(dtype)
        self.files = {}
        for name, size in {"train.bin": train_bytes, "val.bin": val_bytes, **(extra or {})}.items():
            path = directory / name
            f = open(path, "r+b" if path.exists() else "w+b")
            f.truncate(size)
            f.seek(size)
            self.files[name] = f

    def append(self, split: str, tokens: np.ndarray) -> None:
        self.files[f"{split}.bin"].write(np.ascontiguousarray(tokens, dtype=self.dtype).data)

    def append_to(self, name: str, values: np.ndarray) -> None:
        """Append to one of the extra files, values in that file's dtype (CHAT_FILES)."""
        self.files[name].write(np.ascontiguousarray(values, dtype=CHAT_FILES[name]).data)

    def sync(self) -> tuple[int, int]:
        """Flush every file to disk; returns the sizes of train.bin and val.bin in bytes."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        return self.files["train.bin"].tell(), self.files["val.bin"].tell()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def chat_file_sizes(progress: dict, itemsize: int) -> dict[str, int]:
    """The complete sizes of a chat dataset's mask and starts files, from the journal: a mask byte per token, an
    int64 per conversation."""
    counts = progress["counts"]
    return {
        "train.mask.bin": progress["train_bytes"] // itemsize,
        "val.mask.bin": progress["val_bytes"] // itemsize,
        "train.starts.bin": counts["train_documents"] * 8,
        "val.starts.bin": counts["val_documents"] * 8,
    }


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
            "train_assistant_tokens": 0,
            "val_assistant_tokens": 0,
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
        if counts["skipped_records"]:
            kind = "conversations" if request.chat else "records"
            print(
                f"{counts['skipped_records']:,} records skipped (bad {kind} with --skip-bad-records, or empty)",
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
            **(chat_meta(counts, tok, request.preference) if request.chat else {}),
            **extra,
        }
        atomic_write_json(self.path / "meta.json", meta)
        self.journal({**progress, "finished": True})

    def commit(self, out_dir: Path) -> None:
        """Move the finished files into out_dir: its old meta.json goes first and the new one comes last, so the
        folder never passes for a complete dataset with a mix of files. Picks up where a killed commit stopped."""
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name in ("train.bin", "val.bin", "tokenizer.json", *CHAT_FILES):
            if (self.path / name).exists():
                os.replace(self.path / name, out_dir / name)
        fsync_dir(out_dir)
        os.replace(self.path / "meta.json", out_dir / "meta.json")
        fsync_dir(out_dir)
        shutil.rmtree(self.path, ignore_errors=True)


def chat_meta(counts: dict, tok: Tokenizer, preference: bool = False) -> dict:
    """What meta.json says of a chat dataset: that it is one, its conversations' files, how many tokens the loss
    counts, and the template's end-of-turn tokens; of preference pairs (two conversations each), that they are."""
    from quillgpt.chat_template import chat_format

    return {
        "chat": True,
        **({"preference": True} if preference else {}),
        "chat_files": list(CHAT_FILES),
        "train_assistant_tokens": counts["train_assistant_tokens"],
        "val_assistant_tokens": counts["val_assistant_tokens"],
        "stop_ids": sorted(chat_format(tok).stop_ids),
    }
