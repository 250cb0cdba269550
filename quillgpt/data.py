"""Prepared datasets on disk -> checked token memmaps -> reproducible (x, y) batches.

find_dataset locates the dataset a config names (preparing it on rank 0 when missing) and checks
it. Each micro-batch is drawn from a counter-based generator keyed by (seed, split, global index),
where the global index of a training micro-batch is step * slots + slot and slot = rank *
grad_accum_steps + micro_step (micro_batch_index). Resuming is therefore "restore the step
counter", and N ranks x accumulation 1 see exactly the batches of 1 rank x accumulation N.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from quillgpt.config import DOCUMENT_MASK_ON_CHAT, Config, TrainingConfig
from quillgpt.distributed import DistInfo, on_every_rank, on_main
from quillgpt.errors import UserError
from quillgpt.files import read_json
from quillgpt.prepare import WORK_DIR, prepare_dataset, prepare_txt_dir
from quillgpt.tokenizer import Tokenizer, canonical_spec, load_tokenizer, same_tokenizer, tokenizer_label

SPLIT_IDS = {"train": 0, "val": 1}
# a dataset's settings as train.py's config names them (prepare_dataset's refusals name them so)
DATA_KEYS = {
    "inputs": "data.input",
    "tokenizer": "data.tokenizer",
    "vocab_size": "data.bpe_vocab_size",
    "val_fraction": "data.val_fraction",
    "max_bytes": "data.max_bytes",
    "chat": "data.chat",
    "preference": "data.preference",
}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class Dataset:
    directory: Path
    meta: dict
    tokenizer: Tokenizer
    dtype: np.dtype
    lengths: dict[str, int]  # tokens per split
    starts: dict[str, np.ndarray] | None = None  # chat: per split, the offset of each conversation's first token

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def chat(self) -> bool:
        """Conversations with a loss mask (prepare.py --chat): the loss counts the assistant's tokens only."""
        return self.starts is not None

    @property
    def preference(self) -> bool:
        """Preference pairs (prepare.py --preference): chat data whose conversations 2k and 2k + 1 are pair k's chosen
        and rejected sides, masked on their replies; training is DPO (dpo.py)."""
        return self.chat and bool(self.meta.get("preference"))

    def path(self, split: str) -> Path:
        return self.directory / f"{split}.bin"

    def mask_path(self, split: str) -> Path:
        return self.directory / f"{split}.mask.bin"

    def conversation_ends(self, split: str) -> np.ndarray:
        """Where each conversation of a split ends (the next one's start; the split's end for the last)."""
        return np.append(self.starts[split][1:], self.lengths[split])


def find_dataset(cfg: Config, dist: DistInfo) -> Dataset:
    """The dataset the config names, opened and checked on every rank: data_dir/dataset (rank 0 prepares it
    first when it is missing), data.processed_dir with train.bin/val.bin (or in its parent), or
    with data.data_format = "txt" its train.txt/val.txt tokenized once into processed_dir/cache."""
    d = cfg.data
    vocab_size = d.bpe_vocab_size if d.tokenizer == "bpe" else None
    expect = None  # the tokenizer the dataset must have been made with, when the config decides it
    if d.data_format == "txt":
        processed = Path(d.processed_dir or "data/processed")
        on_main(prepare_txt_dir, dist, processed, tokenizer=d.tokenizer, vocab_size=vocab_size)
        directory = processed / "cache"
    elif d.processed_dir is not None:
        # data/processed falls back to its parent data/ for train.bin/val.bin (a common layout of prepared data)
        directory = Path(d.processed_dir)
        if not (directory / "train.bin").exists() and directory.name == "processed":
            directory = directory.parent
        if not (directory / "train.bin").exists():
            raise UserError(f"no train.bin in data.processed_dir = {d.processed_dir} (or its parent)")
    else:
        # chat data for a model fine-tuned from run.init_from takes that model's tokenizer (and chat template)
        model_tokenizer = (d.chat or d.preference) and cfg.run.init_from != "scratch"
        on_main(
            prepare_dataset,
            dist,
            d.dataset,
            input_path=d.input,
            tokenizer=None if model_tokenizer else d.tokenizer,
            tokenizer_from=cfg.run.init_from if model_tokenizer else None,
            chat=d.chat,
            preference=d.preference,
            vocab_size=None if model_tokenizer else vocab_size,
            val_fraction=d.val_fraction,
            data_dir=d.data_dir,
            max_bytes=d.max_bytes,
            asked_as=DATA_KEYS,
        )
        directory, expect = Path(d.data_dir) / d.dataset, None if model_tokenizer else d.tokenizer
    dataset = on_every_rank(load_dataset, dist, directory, expect)
    if d.chat and not dataset.chat:  # (a chat dataset needs no data.chat: its meta.json says what it is)
        raise UserError(
            f"data.chat = true but {directory} holds text, not conversations: prepare it with prepare.py --chat "
            "(--reset), or name another data.dataset"
        )
    if d.document_mask:
        check_documents(dataset)
    if dataset.preference and cfg.run.init_from == "scratch":
        raise UserError(
            f"{directory} holds preference pairs: DPO tunes a model, set run.init_from to it (its weights are also the "
            "reference)"
        )
    if d.preference and not dataset.preference:
        raise UserError(
            f"data.preference = true but {directory} holds no preference pairs: prepare it with prepare.py "
            "--preference (--reset), or name another data.dataset"
        )
    return dataset


def check_documents(dataset: Dataset) -> None:
    """data.document_mask needs text made of documents, each ending with <|endoftext|> (meta.json's eot_id)."""
    if dataset.chat:
        raise UserError(DOCUMENT_MASK_ON_CHAT)
    if dataset.meta.get("eot_id") is None:
        raise UserError(
            f"data.document_mask = true but {dataset.directory} is one text, not documents ending with "
            "<|endoftext|>: prepare it from a corpus of documents (a folder, .jsonl or .parquet records), or leave "
            "data.document_mask off"
        )


def load_dataset(directory: str | Path, expect_tokenizer: str | None = None) -> Dataset:
    """Open and check a prepared dataset directory (train.bin, val.bin, meta.json, tokenizer.json)."""
    directory = Path(directory)
    if not (directory / "meta.json").exists() and (directory / WORK_DIR).is_dir():
        raise UserError(
            f"{directory} is incomplete: prepare.py stopped before finishing it; run the same prepare.py "
            "command again to continue from its last completed chunk"
        )
    meta = read_json(directory / "meta.json", "dataset metadata")
    try:
        dtype = np.dtype(DTYPES[meta["dtype"]])
        vocab_size = int(meta["vocab_size"])
        tok_meta = meta["tokenizer"]
        tok_file = directory / tok_meta.get("file", "tokenizer.json")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(
            f"{directory / 'meta.json'} is malformed (missing or bad field {e}); re-run prepare.py with --reset"
        ) from None
    if expect_tokenizer is not None and tokenizer_label(tok_meta) != canonical_spec(expect_tokenizer):
        raise UserError(
            f"{directory} was prepared with the {tokenizer_label(tok_meta)} tokenizer but the config asks for "
            f"{expect_tokenizer}: re-prepare it (prepare.py --tokenizer {expect_tokenizer} --reset) or change data.tokenizer"
        )
    tokenizer = load_tokenizer(tok_file)
    if tokenizer.vocab_size != vocab_size:
        raise UserError(
            f"{directory / 'meta.json'} says vocab_size {vocab_size} but {tok_file} has {tokenizer.vocab_size} "
            "tokens: they come from different preparations; re-run prepare.py with --reset"
        )
    lengths = {}
    for split in ("train", "val"):
        path = directory / f"{split}.bin"
        if not path.exists():
            raise UserError(f"{path} is missing: re-run prepare.py")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise UserError(
                f"{path} has {size} bytes, not a multiple of its dtype {meta['dtype']} ({dtype.itemsize} bytes): the file is truncated or corrupt"
            )
        lengths[split] = size // dtype.itemsize
        if lengths[split] == 0:
            raise UserError(
                f"{path} is empty: the {split} split has no tokens (use a larger input or another data.val_fraction)"
            )
        check_token_ids(path, dtype, vocab_size)
    starts = load_chat_files(directory, meta, lengths) if meta.get("chat") else None
    return Dataset(directory, meta, tokenizer, dtype, lengths, starts)


def load_chat_files(directory: Path, meta: dict, lengths: dict[str, int]) -> dict[str, np.ndarray]:
    """A chat dataset's masks (one byte per token) and conversation starts (int64, from 0, increasing, within the
    split, as many as meta.json's documents), checked; returns the starts of each split."""
    starts = {}
    for split, n in lengths.items():
        mask, first = directory / f"{split}.mask.bin", directory / f"{split}.starts.bin"
        for path in (mask, first):
            if not path.is_file():
                raise UserError(f"{path} is missing but meta.json says this is a chat dataset: re-run prepare.py")
        if mask.stat().st_size != n:
            raise UserError(
                f"{mask} has {mask.stat().st_size} bytes but {split}.bin has {n} tokens (one mask byte each): "
                "they come from different preparations; re-run prepare.py with --reset"
            )
        if first.stat().st_size % 8:
            raise UserError(f"{first} has {first.stat().st_size} bytes, not a multiple of 8 (int64): it is truncated")
        starts[split] = np.fromfile(first, dtype="<i8")
        s = starts[split]
        expected = meta.get(f"{split}_documents")
        if not s.size or s[0] != 0 or (np.diff(s) <= 0).any() or s[-1] >= n or (expected not in (None, s.size)):
            raise UserError(
                f"{first} does not hold increasing conversation starts from 0 within the {n} tokens of "
                f"{split}.bin ({s.size} starts, meta.json says {expected}): re-run prepare.py with --reset"
            )
    return starts


def check_token_ids(path: Path, dtype: np.dtype, vocab_size: int, chunk: int = 1 << 24) -> None:
    """A vectorised scan for ids >= vocab_size, reading the file in blocks (not through a memmap: its page faults
    made the scan of a sparse file several times slower (docs/LOG.md), and its pages stay in this process's RSS)."""
    block = np.empty(chunk, dtype=dtype)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            top = int(block[: n // dtype.itemsize].max())
            if top >= vocab_size:
                raise UserError(
                    f"{path} holds token id {top} but the vocabulary has {vocab_size} entries: "
                    "the data and meta.json come from different tokenizers; re-run prepare.py with --reset"
                )


def check_fits(dataset: Dataset, block_size: int, model_vocab_size: int) -> None:
    """Rows of block_size + 1 tokens fit in each split (a chat dataset's rows start at a conversation and are padded
    at the split's end: any length fits), and the model has ids for the whole vocabulary."""
    for split, n in dataset.lengths.items():
        if n < block_size + 1 and not dataset.chat:
            raise UserError(
                f"the {split} split of {dataset.directory} has {n} tokens, fewer than block_size + 1 = "
                f"{block_size + 1}: lower model.block_size or use more data"
            )
    if model_vocab_size < dataset.vocab_size:
        raise UserError(
            f"model.vocab_size = {model_vocab_size} is smaller than the dataset's vocabulary ({dataset.vocab_size})"
        )


def check_vocab_compatible(model_vocab: int, tokenizer: dict | None, dataset: Dataset, source: str) -> None:
    """A model (of model_vocab ids, trained with `tokenizer`, from `source`) can train on the dataset: same tokenizer
    (any recorded one when the model records none) and enough ids; UserError naming both otherwise."""
    data_tok = dataset.tokenizer.to_dict()
    same = tokenizer is None or same_tokenizer(tokenizer, data_tok)
    if not same or model_vocab < dataset.vocab_size:
        ours = tokenizer_label(tokenizer) if tokenizer else "?"
        missing = sorted(set(data_tok.get("chars", [])) - set((tokenizer or {}).get("chars", [])))
        hint = (
            f" (the dataset has characters the checkpoint lacks: {''.join(missing[:10])!r})"
            if ours == "char" and missing
            else ""
        )
        raise UserError(
            f"vocabulary mismatch: {source} was trained with a {ours} tokenizer of {model_vocab} tokens, "
            f"the dataset {dataset.directory} uses {tokenizer_label(data_tok)} with {dataset.vocab_size}{hint}: "
            "prepare the dataset with the checkpoint's tokenizer"
        )


def micro_batch_index(step: int, rank: int, micro: int, accum: int, world_size: int) -> int:
    """The global index of the training micro-batch a rank draws at one accumulation micro-step of a step:
    step * slots + rank * accum + micro, with slots = accum * world_size micro-batches per optimizer step."""
    return (step * world_size + rank) * accum + micro


def micro_batch_rows(t: TrainingConfig, step: int) -> int:
    """The rows of each micro-batch of optimizer step `step`: batch_size, or under a batch ramp
    (training.batch_ramp_iters) batch_ramp_start at step 0, growing linearly in whole rows to batch_size at step
    batch_ramp_iters. A micro-batch of fewer rows is the first rows of the one batch_size would draw, so the data stays
    a pure function of the step."""
    if step >= t.batch_ramp_iters:
        return t.batch_size
    return t.batch_ramp_start + (t.batch_size - t.batch_ramp_start) * step // t.batch_ramp_iters


def batch_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator for one micro-batch: a pure function of (seed, split, index).

    The index goes in a high word of Philox's 256-bit counter: drawing advances the low word, so
    neighbouring indices never share random numbers (counter=index would overlap batch i+1 with i)."""
    key = [seed & 0xFFFFFFFFFFFFFFFF, SPLIT_IDS[split]]
    return np.random.Generator(np.random.Philox(key=key, counter=[0, 0, index, 0]))


def gather_rows(path: Path, dtype: np.dtype, starts: np.ndarray, block_size: int, pad: bool = False) -> np.ndarray:
    """(B,) start offsets -> (B, block_size + 1) int64 tokens, read row by row from the file; pad: a row that runs
    past the end of the file is filled with zeros (a chat row starting at one of the last conversations).

    Read, not mapped: the process maps none of the file, so RSS does not grow with the dataset (nanoGPT re-opens a
    memmap per batch for that), and a batch costs less than a memmap's, which maps the file and faults its pages in
    every batch (docs/LOG.md)."""
    rows = np.empty((len(starts), block_size + 1), dtype=dtype)
    with open(path, "rb", buffering=0) as f:
        for row, start in zip(rows, starts):
            f.seek(int(start) * rows.itemsize)
            got = f.readinto(row)
            if got != row.nbytes and pad:
                row[got // rows.itemsize :] = 0
            elif got != row.nbytes:
                raise UserError(
                    f"{path} ended before token {int(start) + block_size + 1:,}: it changed after it was "
                    "checked; prepare the dataset again"
                )
    return rows.astype(np.int64)


class Batch(NamedTuple):
    """One micro-batch: inputs x and targets y (B, T) each (a target of -1 is not counted), and positions, each
    token's position in its document (B, T), 0 at a document's first token, when a row holds several documents kept
    apart: the model then confines attention to each document and restarts its positions with it (GPT.forward).
    None: a row is one sequence, its positions 0..T-1."""

    x: torch.Tensor
    y: torch.Tensor
    positions: torch.Tensor | None


def positions_from_starts(first: np.ndarray) -> np.ndarray:
    """(B, T) bool, True where a document starts (the row's first token always starts one) -> (B, T) int64, each
    token's position in its document."""
    t = np.arange(first.shape[1])
    return t - np.maximum.accumulate(np.where(first, t, 0), axis=1)


class BatchSource:
    """Reproducible batches for training and evaluation, optionally prefetched on a thread.

    On chat data every row starts at a conversation (drawn at random) and the targets the mask leaves out are -1,
    which the loss ignores: rows "padded" count the first conversation's targets only, rows "packed" go on into the
    conversations that follow, each conversation attending only within itself (docs/LOG.md has the measurements).
    On text data, document_mask keeps the documents of a row apart the same way (each ends with <|endoftext|>)."""

    def __init__(
        self,
        dataset: Dataset,
        block_size: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        prefetch: bool | None = None,
        chat_rows: str = "packed",
        document_mask: bool = False,
    ):
        self.dataset, self.block_size, self.batch_size, self.seed = dataset, block_size, batch_size, seed
        self.chat_rows = chat_rows
        # rows of several documents, each attending only within itself: packed conversations, or masked documents
        self.isolated = chat_rows == "packed" if dataset.chat else document_mask
        self.device = device
        self.pin = device.type == "cuda"
        # By default only for accelerators, whose host thread would otherwise wait: on the CPU the
        # loading thread takes a core from the matmuls, and the step gets slower (docs/LOG.md).
        self.prefetch = device.type != "cpu" if prefetch is None else prefetch
        self._next: tuple[tuple, threading.Thread, list] | None = None

    def starts(self, split: str, index: int) -> np.ndarray:
        if self.dataset.chat:
            return self.dataset.starts[split][self.conversations(split, index)]
        high = self.dataset.lengths[split] - self.block_size
        return batch_rng(self.seed, split, index).integers(0, high, size=self.batch_size)

    def conversations(self, split: str, index: int) -> np.ndarray:
        """Chat data: the conversation each row of the batch starts with."""
        return batch_rng(self.seed, split, index).integers(0, len(self.dataset.starts[split]), size=self.batch_size)

    def _load(self, split: str, index: int) -> Batch:
        if self.dataset.chat:
            inputs, targets = self.chat_rows_of(split, index)
        else:
            rows = gather_rows(self.dataset.path(split), self.dataset.dtype, self.starts(split, index), self.block_size)
            inputs, targets = rows[:, :-1], rows[:, 1:]
        arrays = (inputs, targets, self.positions_of(split, index, inputs)) if self.isolated else (inputs, targets)
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]  # (B, T) each
        if self.pin:
            tensors = [t.pin_memory() for t in tensors]
        return Batch(*tensors, *([None] * (3 - len(tensors))))

    def positions_of(self, split: str, index: int, inputs: np.ndarray) -> np.ndarray:
        """Each input token's position in its document (B, T): in its conversation (chat data), or in its document as
        prepare.py wrote it, [BOS] tokens <|endoftext|>, so a new one starts after each <|endoftext|> (text)."""
        if self.dataset.chat:
            starts = self.dataset.starts[split]
            offsets = self.starts(split, index)[:, None] + np.arange(inputs.shape[1])  # (B, T) offsets in the split
            return offsets - starts[np.searchsorted(starts, offsets, side="right") - 1]
        first = np.zeros(inputs.shape, dtype=bool)
        first[:, 1:] = inputs[:, :-1] == self.dataset.meta["eot_id"]
        return positions_from_starts(first)

    def chat_rows_of(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), (B, block_size) each, of rows read from conversation starts; a target the loss does not
        count (the mask's zeros; padded rows: all after the first conversation) is -1, which the loss ignores."""
        conv = self.conversations(split, index)
        starts = self.dataset.starts[split][conv]
        rows = gather_rows(self.dataset.path(split), self.dataset.dtype, starts, self.block_size, pad=True)
        counted = gather_rows(self.dataset.mask_path(split), np.dtype(np.uint8), starts, self.block_size, pad=True)
        if self.chat_rows == "padded":
            length = self.dataset.conversation_ends(split)[conv] - starts  # (B,)
            counted[np.arange(self.block_size + 1)[None, :] >= length[:, None]] = 0
        return rows[:, :-1], np.where(counted[:, 1:] == 1, rows[:, 1:], -1)

    def get(self, split: str, index: int, next_index: int | None = None, rows: int | None = None) -> Batch:
        """The batch for (split, index), or its first `rows` rows (a batch ramp); with next_index, start loading that
        one in the background."""
        key = (split, index)
        if self._next is not None and self._next[0] == key:
            _, thread, box = self._next
            thread.join()
            batch = box[0]
        else:
            batch = self._load(split, index)
        self._next = None
        if self.prefetch and next_index is not None:
            box: list = []
            thread = threading.Thread(target=lambda: box.append(self._load(split, next_index)), daemon=True)
            thread.start()
            self._next = ((split, next_index), thread, box)
        return Batch(*(None if t is None else t[:rows].to(self.device, non_blocking=True) for t in batch))
