"""What a dataset is made from (Request) and how the work is done (Settings).

A Request is first what the user asks for: None (and split "auto") leaves a choice to the dataset. `resolve` makes
every choice (the named datasets' and recipes' defaults, absolute input paths, the tokenizer's canonical name and
vocabulary size, the split rule) and refuses contradictions; the resolved request is what meta.json records, and a
complete dataset is reused only for the same resolved request. Settings do not change the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from quillgpt import corpus
from quillgpt.errors import UserError
from quillgpt.machine import usable_cpus
from quillgpt.prepare.recipes import PYSTDLIB_MAX_BYTES, RECIPES, SHAKESPEARES
from quillgpt.tokenizer import canonical_spec, resolve_vocab_size, tokenizer_kind

BPE_TRAIN_BYTES = 64 * 2**20
DEFAULT_VAL_FRACTION = 0.1


@dataclass
class Request:
    """The source, tokenizer and split of a dataset. (The fields' order is the order meta.json lists them in.)"""

    inputs: list[str] = field(default_factory=list)  # paths (resolved: absolute); [] for a named dataset
    hf_dataset: str | None = None  # a hub dataset, streamed (resolved: a recipe's)
    hf_config: str | None = None
    hf_split: str = "train"
    hf_revision: str | None = None
    glob: str | None = None  # in directories, the files to read
    text_field: str | None = None  # the records' text field or column (resolved: "messages" for chat, else "text";
    # preference pairs: "chosen", the one field every form has)
    chat: bool = False  # records are conversations, rendered with the chat template, with a loss mask (chat.py)
    preference: bool = False  # records are preference pairs, two conversations each (preference.py; resolved: chat)
    tokenizer: str | None = None  # char, bpe, a tiktoken encoding or hf:DIR; None: gpt2 for shakespeare and the
    # recipes, char otherwise (resolved: the canonical name)
    tokenizer_from: str | None = None  # chat: a checkpoint whose tokenizer to use (resolved: its file; a Hugging
    # Face model directory or hub name resolves to tokenizer hf:DIR instead)
    vocab_size: int | None = None  # bpe's size (default 4096); an upper bound for the others
    split: str = "auto"  # auto: tail for a lone text file, docs otherwise (resolved: docs, tail, or given)
    val_fraction: float | None = None  # None: 0.1, a recipe's own
    split_seed: int = 0
    max_bytes: int | None = None  # read at most this much input (pystdlib: 4 MB unless given)
    skip_bad_records: bool = False


@dataclass
class Settings:
    """How a dataset is made, as opposed to what (Request): the output does not depend on these."""

    verbose: bool = True
    bpe_train_bytes: int = BPE_TRAIN_BYTES  # BPE trains on this many bytes of the train split
    workers: int | None = None  # None: the usable cores
    chunk_bytes: int = corpus.CHUNK_BYTES  # input bytes per unit of work

    def __post_init__(self) -> None:
        if self.bpe_train_bytes <= 0:
            raise UserError(f"bpe_train_bytes must be positive, got {self.bpe_train_bytes}")
        if self.workers is None:
            self.workers = usable_cpus()


def resolve(dataset: str, asked: Request) -> Request:
    """The request with every choice made; UserError for contradictions."""
    inputs = asked.inputs
    for path in inputs:
        if not Path(path).exists():
            raise UserError(f"input not found: {path}")
    recipe = RECIPES.get(dataset) if not inputs and asked.hf_dataset is None else None
    if inputs and asked.hf_dataset is not None:
        raise UserError("give --input files or --hf-dataset, not both")
    val_fraction = asked.val_fraction
    if val_fraction is None:
        val_fraction = recipe.val_fraction if recipe else DEFAULT_VAL_FRACTION
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    max_bytes = asked.max_bytes
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes must be positive, got {max_bytes}")
    if dataset == "pystdlib" and not inputs and max_bytes is None:
        max_bytes = PYSTDLIB_MAX_BYTES
    default_tokenizer = recipe.tokenizer if recipe else "gpt2" if dataset == "shakespeare" else "char"
    chat = asked.chat or asked.preference
    if asked.preference and asked.text_field is not None:
        raise UserError(
            "--preference reads the fields prompt (or messages), chosen and rejected by their names: drop --text-field"
        )
    tokenizer_from = None
    if asked.tokenizer_from is not None:
        if not chat:
            raise UserError(
                "--tokenizer-from takes a model's tokenizer for chat data: it goes with --chat or --preference"
            )
        if asked.tokenizer is not None:
            raise UserError("give --tokenizer or --tokenizer-from, not both")
        default_tokenizer, tokenizer_from = tokenizer_of_model(asked.tokenizer_from)
    spec = canonical_spec(asked.tokenizer or default_tokenizer)
    vocab_size = resolve_vocab_size(tokenizer_kind(spec), asked.vocab_size)
    one_text = (
        len(inputs) == 1 and not Path(inputs[0]).is_dir() and corpus.file_source(Path(inputs[0])).kind == "text"
    ) or (not inputs and asked.hf_dataset is None and dataset in SHAKESPEARES)
    if chat and (one_text or asked.split == "tail"):
        raise UserError(
            "--chat reads records with a list of messages (.jsonl or .parquet files, a folder of them, or a hub "
            "dataset), split by whole conversations; not a text file"
        )
    return replace(
        asked,
        inputs=[str(Path(p).resolve()) for p in inputs],
        chat=chat,
        text_field=asked.text_field or ("chosen" if asked.preference else "messages" if chat else "text"),
        tokenizer_from=tokenizer_from,
        hf_dataset=recipe.hf_dataset if recipe else asked.hf_dataset,
        hf_config=recipe.hf_config if recipe else asked.hf_config,
        tokenizer=spec,
        vocab_size=vocab_size,
        split=split_rule(asked.split, one_text),
        val_fraction=val_fraction,
        max_bytes=max_bytes,
    )


def split_rule(asked: str, one_text: bool) -> str:
    """tail or docs: auto is tail for one text file (nanoGPT's rule), docs for a corpus of documents."""
    split = ("tail" if one_text else "docs") if asked == "auto" else asked
    if split not in ("tail", "docs"):
        raise UserError(f"split must be auto, docs or tail, got {asked!r}")
    if split == "tail" and not one_text:
        raise UserError(
            "--split tail cuts one text file by bytes (nanoGPT's rule); a corpus of documents "
            "splits by document (--split docs)"
        )
    return split


def tokenizer_of_model(source: str) -> tuple[str, str | None]:
    """--tokenizer-from: (the tokenizer spec, the checkpoint file holding the tokenizer or None). A Hugging Face
    model directory (or hub name, downloaded once) is hf:DIR; a checkpoint or run directory gives the tokenizer it
    records (its spec is the tokenizer's name without the chat additions)."""
    from quillgpt import hf
    from quillgpt.checkpoint import resolve_checkpoint
    from quillgpt.tokenizer import tokenizer_label

    if (Path(source) / "config.json").is_file() or hf.is_hub_name(source):
        directory = Path(source) if Path(source).is_dir() else hf.download(source)
        return f"hf:{directory}", None
    path = resolve_checkpoint(source, prefer="best").resolve()
    return tokenizer_label({**checkpoint_tokenizer(path), "chat_tokens": None}), str(path)


def checkpoint_tokenizer(path: str | Path) -> dict:
    """The tokenizer (to_dict) a checkpoint records; UserError when it records none."""
    from quillgpt.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(path).get("tokenizer")
    if not isinstance(tokenizer, dict):
        raise UserError(f"{path} records no tokenizer: prepare its data with --tokenizer instead")
    return tokenizer
