"""Turn a corpus into a token dataset: data/<dataset>/{train.bin, val.bin, tokenizer.json, meta.json}.

    python prepare.py --dataset shakespeare_char --input path/to/input.txt
    python prepare.py --dataset shakespeare_char          # downloads tiny Shakespeare once (needs network)
    python prepare.py --dataset shakespeare --input path/to/input.txt   # gpt2 tokenizer
    python prepare.py --dataset pystdlib                  # offline: this Python's standard library, 4 MB
    python prepare.py --dataset notes --input notes/ --glob "*.md" --tokenizer bpe --vocab-size 8192
    python prepare.py --dataset web --input shard-0.jsonl.zst shard-1.parquet --tokenizer gpt2 --workers 8
    python prepare.py --dataset tales --hf-dataset roneneldan/TinyStories --tokenizer gpt2
    python prepare.py --dataset openwebtext               # named recipes: openwebtext, fineweb-edu-10B, tinystories
    python prepare.py --dataset chat --chat --input talks.jsonl --tokenizer-from checkpoints/base   # conversations
    python prepare.py --dataset prefs --preference --input pairs.jsonl --tokenizer-from checkpoints/base-chat  # DPO

Several inputs (--input a b, or --input a --input b) are read in that order into one dataset. A dataset made for the
same arguments is reused; other arguments need --reset. A killed prepare, run again, continues where it stopped.
The rules (inputs, documents, splits, tokenizers, workers, resuming): docs/data.md, and the modules that
quillgpt/prepare/__init__.py lists.
"""

from __future__ import annotations

import argparse

from quillgpt import corpus
from quillgpt.errors import run_main
from quillgpt.prepare import prepare_dataset
from quillgpt.prepare.recipes import KNOWN_DATASETS
from quillgpt.prepare.request import BPE_TRAIN_BYTES


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class GivenOnce(argparse.Action):
    """A single-valued flag whose repetition would read as a list: a second one is an error, not a silent
    replacement of the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} takes one pattern, given twice; list further files with --input")
        setattr(namespace, self.dest, values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, help=f"output folder name; {', '.join(KNOWN_DATASETS)} need no input")
    source = p.add_argument_group("input (default: the named dataset's)")
    source.add_argument(
        "--input",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="text files, directories, .jsonl(.gz/.zst) and .parquet files",
    )
    source.add_argument(
        "--glob",
        action=GivenOnce,
        help="in directories, the files to read (default: all but hidden ones), e.g. '*.md'",
    )
    source.add_argument("--text-field", help="the records' text field or column (default: text; with --chat: messages)")
    source.add_argument(
        "--chat",
        action="store_true",
        help="records are conversations (a list of {role, content} messages), rendered with the chat template; "
        "the loss counts the assistant's tokens only (docs/chat.md)",
    )
    source.add_argument(
        "--preference",
        action="store_true",
        help="records are preference pairs: prompt (or messages), chosen and rejected, TRL's forms, each side "
        "rendered with the chat template; train.py then runs DPO (docs/chat.md)",
    )
    source.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="count and skip records that are not JSON or lack a string text field (with --chat: a bad "
        "conversation) (default: stop)",
    )
    source.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face hub dataset, streamed (needs '.[data]')")
    source.add_argument("--hf-config", metavar="NAME", help="the hub dataset's configuration (subset)")
    source.add_argument("--hf-split", default="train", help="the hub dataset's split (default: train)")
    source.add_argument("--hf-revision", metavar="REV", help="a branch, tag or commit of the hub dataset")
    p.add_argument(
        "--tokenizer",
        help="char, bpe, a tiktoken encoding such as gpt2, or hf:DIR for the tokenizer.json of a "
        "Hugging Face model directory (default: gpt2 for shakespeare and the recipes, else char)",
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="MODEL",
        help="with --chat: the tokenizer of the model to fine-tune (a checkpoint, run directory, Hugging Face "
        "directory or hub name), with the chat template added when it has none",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        help="bpe vocabulary size (default: the existing dataset's, else 4096); an upper bound for char",
    )
    p.add_argument(
        "--split",
        choices=("auto", "docs", "tail"),
        default="auto",
        help="docs: whole documents to val by hash; tail: the last bytes of one text file (auto: tail for one "
        "text file, else docs)",
    )
    p.add_argument("--val-fraction", type=float, help="share of documents (or bytes) for validation (default 0.1)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the document hash that picks the val split")
    p.add_argument("--max-bytes", type=positive_int, help="read at most N bytes of input (pystdlib default 4000000)")
    p.add_argument("--workers", type=positive_int, help="worker processes (default: the usable cores)")
    p.add_argument(
        "--chunk-bytes",
        type=positive_int,
        default=corpus.CHUNK_BYTES,
        help="input bytes per unit of work (default 16 MiB); the output does not depend on it",
    )
    p.add_argument("--reset", action="store_true", help="re-prepare even if the dataset exists")
    p.add_argument("--data-dir", default="data", help="parent folder of the dataset folders")
    p.add_argument(
        "--bpe-train-bytes", type=positive_int, default=BPE_TRAIN_BYTES, help="BPE trains on this many bytes of train"
    )
    return p.parse_args(argv)


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
        glob=args.glob,
        text_field=args.text_field,
        chat=args.chat,
        preference=args.preference,
        tokenizer_from=args.tokenizer_from,
        hf_dataset=args.hf_dataset,
        hf_config=args.hf_config,
        hf_split=args.hf_split,
        hf_revision=args.hf_revision,
        split=args.split,
        split_seed=args.split_seed,
        workers=args.workers,
        skip_bad_records=args.skip_bad_records,
        chunk_bytes=args.chunk_bytes,
    )


if __name__ == "__main__":
    run_main(main)
