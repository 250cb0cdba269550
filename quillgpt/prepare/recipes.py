"""The datasets known by name, which need no input: tiny Shakespeare (shakespeare_char with a char vocabulary,
shakespeare with GPT-2's), this Python's standard library (pystdlib, each .py file a document, 4 MB) and the
recipes: corpora users know by name, streamed from the Hugging Face hub (RECIPES).

Tiny Shakespeare is downloaded once into data/<dataset>/input.txt and checked against its sha256; offline, the
error names the flag that gives a local copy.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from quillgpt import corpus
from quillgpt.corpus import Source
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, sha256_file

SHAKESPEARES = ("shakespeare_char", "shakespeare")  # one text file each, split by bytes as nanoGPT does
PYSTDLIB_MAX_BYTES = 4_000_000
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DOWNLOAD_TIMEOUT_S = 10


@dataclass(frozen=True)
class Recipe:
    """A corpus users know by name, streamed from the Hugging Face hub."""

    hf_dataset: str
    hf_config: str | None
    tokenizer: str
    val_fraction: float
    expected: str  # published token counts, for docs/data.md and the start-up line


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
KNOWN_DATASETS = (*SHAKESPEARES, "pystdlib", *RECIPES)


def named_source(dataset: str, out_dir: Path, verbose: bool) -> Source | None:
    """The local source of a dataset known by name (tiny Shakespeare, downloaded into out_dir once; the standard
    library), or None for any other name."""
    if dataset in SHAKESPEARES:
        path = out_dir / "input.txt"
        download_shakespeare(path, verbose)
        return Source("text", str(path.resolve()), url=SHAKESPEARE_URL)
    if dataset == "pystdlib":
        return corpus.stdlib_source()
    return None


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
