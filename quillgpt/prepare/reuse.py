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


# the choices a prepared dataset answers where a request leaves them open (None: the dataset's choice), name -> the
# types meta.json's value must have (it may be hand-edited). The split rule and the files read follow from the inputs
OPEN_CHOICES = {"max_bytes": int, "val_fraction": (int, float)}


def reprepare(out_dir: Path, how: str = "") -> str:
    """How to re-prepare a dataset that cannot be reused, for prepare.py's user and train.py's alike."""
    return f"re-prepare it{how}: prepare.py --reset, or remove {out_dir} and train.py prepares it again"


def differs(out_dir: Path, key: str, made, asked, asked_as: dict[str, str]) -> UserError:
    """A request that names a setting other than the one out_dir was prepared with: the key as the caller names it
    (train.py's data.max_bytes, prepare.py's --max-bytes), and both ways on."""
    name = asked_as.get(key, f"--{key.replace('_', '-')}")
    return UserError(
        f"{out_dir} was prepared with {key} = {made!r}, and {name} asks for {asked!r}: use it as it was prepared "
        f"(leave {name} out, or give {made!r}), or {reprepare(out_dir, f' with {asked!r}')}"
    )


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


def reusable(out_dir: Path, dataset: str, request: Request, asked_as: dict[str, str] | None = None) -> dict | None:
    """The existing meta if out_dir holds a complete dataset made for this (resolved) request; UserError on a
    conflict, naming the key as the caller names it (asked_as: setting -> its name; else prepare.py's flag).

    Without a source (no input, hub dataset or known name: train.py on a dataset prepared by hand), only the
    tokenizer and max_bytes must agree; with one, every setting of the request must. The choices a request left
    open were taken from the dataset first (with_prepared_choices)."""
    asked_as = asked_as or {}
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
        raise differs(out_dir, "max_bytes", old.get("max_bytes"), request.max_bytes, asked_as)
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
        raise differs(out_dir, k, old.get(k, ADDED_FIELDS.get(k)), getattr(request, k), asked_as)
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


def with_prepared_choices(out_dir: Path, asked: Request) -> Request:
    """The request with each choice it leaves open (OPEN_CHOICES, and bpe's vocabulary size) made as out_dir's
    dataset made it: a dataset the user prepared (`prepare.py --max-bytes 3000000 --tokenizer bpe --vocab-size 512`)
    is used as prepared by a request that names none of them (`train.py --data.tokenizer bpe`), rather than refused
    for the defaults it would have had. Only a setting the request names, and names otherwise, is a conflict."""
    if not (out_dir / "meta.json").is_file():
        return asked
    try:
        old = read_json(out_dir / "meta.json", "dataset metadata").get("request")
    except UserError:
        return asked  # reusable() reports what is wrong with it
    if not isinstance(old, dict):
        return asked
    taken = {
        k: old[k]
        for k, kinds in OPEN_CHOICES.items()
        if getattr(asked, k) is None and k in old and (old[k] is None or isinstance(old[k], kinds))
    }
    taken = {k: v for k, v in taken.items() if type(v) is not bool}
    same_tokenizer = asked.tokenizer is None or canonical_spec(asked.tokenizer) == old.get("tokenizer")
    size = old.get("vocab_size")
    if asked.vocab_size is None and old.get("tokenizer") == "bpe" and same_tokenizer and type(size) is int:
        taken["vocab_size"] = size  # bpe's size; for the other tokenizers it is only an upper bound
    return replace(asked, **taken)
