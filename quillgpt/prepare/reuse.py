"""Whether a complete dataset already answers a request: one made for the same request is reused as is; one made
for a different request (another tokenizer, other inputs, inputs that changed, another split...) is refused with a
line naming the difference, and --reset re-prepares it. meta.json may be hand-edited or come from the first format
(version 1, every dataset split by bytes): the fields read here are checked before use.
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path

from quillgpt.errors import UserError
from quillgpt.files import read_json
from quillgpt.prepare.recipes import KNOWN_DATASETS
from quillgpt.prepare.request import Request
from quillgpt.prepare.workdir import FORMAT_VERSION
from quillgpt.tokenizer import canonical_spec

META_FIELDS = {"tokenizer": dict, "vocab_size": int, "train_tokens": int, "val_tokens": int}
# request fields added since datasets were first made: an older meta.json's request lacks them, meaning these
ADDED_FIELDS = {"chat": False, "tokenizer_from": None, "preference": False}


def reprepare(out_dir: Path, how: str = "") -> str:
    """How to re-prepare a dataset that cannot be reused, for prepare.py's user and train.py's alike."""
    return f"re-prepare it{how}: prepare.py --reset, or remove {out_dir} and train.py prepares it again"


def check_meta_fields(meta: dict, path: Path) -> None:
    """The fields that reuse decisions and messages read must have their types (meta.json may be hand-edited)."""
    for key, kind in META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"{path} is malformed: {key!r} is missing or not a {kind.__name__}; {reprepare(path.parent)}"
            )


def tokenizer_request_label(spec: str, vocab_size: int | None) -> str:
    return f"the {spec} tokenizer" + (f" (vocab {vocab_size})" if vocab_size is not None else "")


def reusable(out_dir: Path, dataset: str, request: Request) -> dict | None:
    """The existing meta if out_dir holds a complete dataset made for this (resolved) request; UserError on a
    conflict.

    Without a source (no input, hub dataset or known name: train.py on a dataset prepared by hand), only the
    tokenizer and max_bytes must agree; with one, every setting of the request must."""
    sourced = bool(request.inputs) or request.hf_dataset is not None or dataset in KNOWN_DATASETS
    meta = read_json(out_dir / "meta.json", "dataset metadata")
    if any(not (out_dir / name).is_file() for name in ("train.bin", "val.bin", "tokenizer.json")):
        return None
    check_meta_fields(meta, out_dir / "meta.json")
    old = meta.get("request")
    if not isinstance(old, dict) or meta.get("format_version") not in (1, FORMAT_VERSION):
        raise UserError(f"{out_dir} was prepared by another version of prepare.py; {reprepare(out_dir)}")
    made_with = tokenizer_request_label(old.get("tokenizer"), meta.get("vocab_size"))
    wanted = tokenizer_request_label(request.tokenizer, request.vocab_size)
    if old.get("tokenizer") != request.tokenizer or (
        request.tokenizer == "bpe" and old.get("vocab_size") != request.vocab_size
    ):
        raise UserError(f"{out_dir} was prepared with {made_with}; {reprepare(out_dir, f' with {wanted}')}")
    if request.tokenizer != "bpe" and request.vocab_size is not None and meta["vocab_size"] > request.vocab_size:
        raise UserError(
            f"{out_dir} was prepared with {made_with}, more than vocab_size {request.vocab_size}; {reprepare(out_dir)}"
        )
    if old.get("max_bytes") != request.max_bytes:
        raise UserError(
            f"{out_dir} was prepared from max_bytes={old.get('max_bytes')}; "
            f"{reprepare(out_dir, f' with max_bytes={request.max_bytes}')}"
        )
    check_same_inputs(out_dir, meta, request)
    if not sourced:
        return meta
    if meta["format_version"] == 1:  # every dataset of the first format was split by bytes, into tail splits
        old = {**asdict(request), "split": "tail", "val_fraction": meta.get("val_fraction")}
    differ = [
        k
        for k, v in asdict(request).items()
        if k not in ("inputs", "tokenizer", "vocab_size", "max_bytes") and old.get(k, ADDED_FIELDS.get(k)) != v
    ]
    if differ:
        k = differ[0]
        raise UserError(
            f"{out_dir} was prepared with {k} = {old.get(k)!r}; "
            f"{reprepare(out_dir, f' with {k} = {getattr(request, k)!r}')}"
        )
    return meta


def check_same_inputs(out_dir: Path, meta: dict, request: Request) -> None:
    """Given inputs must be those the dataset was made from, unchanged (by size); none given: any."""
    if not request.inputs:
        return
    first_format_source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    old_inputs = meta["request"].get("inputs") or [first_format_source.get("path")]
    if old_inputs != request.inputs:
        inputs = ", ".join(request.inputs)
        raise UserError(
            f"{out_dir} was prepared from {', '.join(map(str, old_inputs))}; {reprepare(out_dir, f' from {inputs}')}"
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
        raise UserError(f"{request.inputs[0]} changed since {out_dir} was prepared from it; {reprepare(out_dir)}")


def with_prepared_vocab_size(out_dir: Path, asked: Request) -> Request:
    """The request with, where it gives no vocabulary size, the one out_dir's dataset was prepared with: `prepare.py
    --tokenizer bpe --vocab-size 2048` once, then `train.py --data.tokenizer bpe` (no size) reuses that dataset
    rather than asking for the 4096 bpe defaults to. Only a real conflict (another size given) is refused."""
    if asked.vocab_size is not None or not (out_dir / "meta.json").is_file():
        return asked
    try:
        old = read_json(out_dir / "meta.json", "dataset metadata").get("request")
    except UserError:
        return asked  # reusable() reports what is wrong with it
    if not isinstance(old, dict) or not isinstance(old.get("vocab_size"), int) or isinstance(old["vocab_size"], bool):
        return asked
    if old.get("tokenizer") != "bpe":
        return asked  # the size is bpe's; for the others it is only an upper bound
    if asked.tokenizer is not None and canonical_spec(asked.tokenizer) != old.get("tokenizer"):
        return asked  # another tokenizer: reusable() refuses it, naming both
    return replace(asked, vocab_size=old["vocab_size"])
