"""Turn a corpus into a token dataset: data/<dataset>/{train.bin, val.bin, tokenizer.json, meta.json}.

`prepare_dataset` is the entry (prepare.py is its command line; train.py calls it for a missing dataset);
`prepare_txt_dir` is the entry of nanoGPT's data/processed layout. How a dataset is made, and where each rule lives:

    recipes         the datasets known by name: tiny Shakespeare, pystdlib, the hub recipes (RECIPES)
    request         what a dataset is made from (Request) and how (Settings); the defaults a request takes
    corpus          the inputs: text files, directories, jsonl(.gz/.zst), parquet, hub datasets, cut into chunks
    sources         a request's sources and their chunks, in input order
    splits          documents and their <|endoftext|>; the docs, tail and given splits
    pipeline        the tokenizer (char, bpe, tiktoken, hf) and the encoding into train.bin / val.bin
    pool            the worker processes: results in input order, so any number of workers writes the same files
    workdir         the work under way in data/<dataset>/.prepare, resuming after a kill; the files' format
    reuse           when a complete dataset answers a request, and when it needs --reset
    nanogpt_layout  data/processed: train.txt and val.txt, or train.npy and val.npy
"""

from __future__ import annotations

import os
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

from quillgpt.errors import UserError
from quillgpt.prepare.nanogpt_layout import prepare_txt_dir
from quillgpt.prepare.pipeline import encode_dataset
from quillgpt.prepare.request import Request, Settings, resolve
from quillgpt.prepare.reuse import reusable, with_prepared_choices
from quillgpt.prepare.workdir import WORK_DIR, describe

__all__ = ["prepare_dataset", "prepare_txt_dir", "WORK_DIR"]
REQUEST_OPTIONS = ({f.name for f in fields(Request)} - {"inputs"}) | {"input_path"}  # input_path: a path or a list
SETTINGS_OPTIONS = {f.name for f in fields(Settings)}


def prepare_dataset(
    dataset: str,
    *,
    data_dir: str | Path = "data",
    reset: bool = False,
    asked_as: dict[str, str] | None = None,
    **options: Any,
) -> Path:
    """Prepare (or reuse) data_dir/dataset with train.bin, val.bin, tokenizer.json and meta.json; returns that dir.

    options, by name: input_path (a path or a list of them: Request.inputs), the other fields of Request (what the
    dataset is made from: tokenizer, vocab_size, split, val_fraction, max_bytes, glob, text_field, hf_dataset, ...;
    those not given take the dataset's defaults) and those of Settings (how: verbose, workers, chunk_bytes,
    bpe_train_bytes). reset: prepare again even if a dataset is there, discarding unfinished work. A complete dataset
    is reused where it answers the request, the choices the request leaves open made as it made them; asked_as names
    the options as the caller's user gives them (train.py: data.max_bytes), for the line that refuses one."""
    if not dataset or dataset in (".", "..") or "/" in dataset or os.sep in dataset:
        raise UserError(f"dataset name must be a plain folder name, got {dataset!r}")
    asked, settings = request_and_settings(options)
    out_dir = Path(data_dir) / dataset
    if not reset:
        asked = with_prepared_choices(out_dir, asked)
    request = resolve(dataset, asked)
    if (out_dir / "meta.json").exists() and not reset:
        meta = reusable(out_dir, dataset, request, asked_as)
        if meta is not None:
            if settings.verbose:
                print(f"reusing {out_dir} ({describe(meta)})")
            return out_dir
    if reset:
        shutil.rmtree(out_dir / WORK_DIR, ignore_errors=True)
    encode_dataset(dataset, out_dir, request, settings)
    return out_dir


def request_and_settings(options: dict[str, Any]) -> tuple[Request, Settings]:
    """prepare_dataset's keyword options as the Request they ask for and the Settings."""
    unknown = sorted(options.keys() - REQUEST_OPTIONS - SETTINGS_OPTIONS)
    if unknown:
        raise TypeError(f"prepare_dataset() got an unexpected keyword argument {unknown[0]!r}")
    asked = {name: value for name, value in options.items() if name in REQUEST_OPTIONS}
    given = asked.pop("input_path", None)
    inputs = [given] if isinstance(given, (str, os.PathLike)) else list(given or [])
    settings = Settings(**{name: value for name, value in options.items() if name in SETTINGS_OPTIONS})
    return Request(inputs=[str(p) for p in inputs], **asked), settings
