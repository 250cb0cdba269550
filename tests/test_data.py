"""data.py: dataset loading rules, the data/processed layouts (bin and txt), reproducible batches."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_overrides

from quillgpt.data import BatchSource, batch_rng, gather_rows, load_dataset, micro_batch_index
from quillgpt.errors import UserError
from train import train


def test_batches_are_a_pure_function_of_seed_split_index(tiny_data):
    ds = load_dataset(tiny_data / "tiny")
    a = BatchSource(ds, 16, 4, seed=1, device=torch.device("cpu"), prefetch=True)
    b = BatchSource(ds, 16, 4, seed=1, device=torch.device("cpu"), prefetch=False)
    x1, y1, _ = a.get("train", 7, next_index=8)
    x2, y2, _ = b.get("train", 7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(a.get("train", 8)[0], b.get("train", 8)[0])  # the prefetched batch is the right one
    assert not torch.equal(a.get("train", 9)[0], x1)
    assert not torch.equal(BatchSource(ds, 16, 4, seed=2, device=torch.device("cpu")).get("train", 7)[0], x1)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are inputs shifted by one


def test_gathered_rows_are_the_file_slices(tiny_data):
    ds = load_dataset(tiny_data / "tiny")
    starts = batch_rng(0, "train", 3).integers(0, ds.lengths["train"] - 33, size=6)
    rows = gather_rows(ds.path("train"), ds.dtype, starts, 32)
    data = np.memmap(ds.path("train"), dtype=ds.dtype, mode="r")
    assert rows.dtype == np.int64 and rows.shape == (6, 33)
    for row, s in zip(rows, starts):
        assert np.array_equal(row, data[s : s + 33])


def test_a_train_bin_cut_short_after_loading_is_a_user_error(tmp_path, tiny_data):
    ds = load_dataset(tiny_data / "tiny")
    short = tmp_path / "train.bin"
    short.write_bytes(ds.path("train").read_bytes()[:100])  # 50 tokens
    with pytest.raises(UserError, match="ended before token 61"):
        gather_rows(short, ds.dtype, np.array([0, 28]), 32)


def test_two_ranks_accum_one_see_one_rank_accum_two(tiny_data):
    """Each optimizer step, 2 ranks x 1 accumulation step draw the very batches 1 rank x 2 steps draws (the
    micro-batch index train_step uses), and no step repeats another's."""
    source = BatchSource(load_dataset(tiny_data / "tiny"), 16, 4, seed=1, device=torch.device("cpu"))

    def step_batches(step: int, world: int, accum: int) -> list[torch.Tensor]:
        return [
            source.get("train", micro_batch_index(step, rank, micro, accum, world))[0]
            for rank in range(world)
            for micro in range(accum)
        ]

    seen = []
    for step in range(4):
        two_ranks, one_rank = step_batches(step, 2, 1), step_batches(step, 1, 2)
        assert all(torch.equal(a, b) for a, b in zip(two_ranks, one_rank))
        seen += two_ranks
    assert len({tuple(x.flatten().tolist()) for x in seen}) == len(seen) == 8


def test_processed_dir_falls_back_to_parent_in_bin_mode(tiny_data, tmp_path):
    """data.processed_dir = <root>/data/processed finds train.bin in <root>/data/."""
    root = tmp_path / "data"
    shutil.copytree(tiny_data / "tiny", root)
    (root / "processed").mkdir()
    over = tiny_overrides(
        tiny_data,
        tmp_path / "ck",
        **{"data.processed_dir": str(root / "processed"), "training.max_iters": 2, "training.eval_interval": 0},
    )
    result = train(None, overrides=over)
    assert result.iterations == 2


def test_txt_mode_tokenizes_once_and_caches(tmp_path):
    processed = tmp_path / "data" / "processed"
    processed.mkdir(parents=True)
    text = "To be, or not to be, that is the question:\n" * 300
    (processed / "train.txt").write_text(text[: len(text) * 9 // 10])
    (processed / "val.txt").write_text(text[len(text) * 9 // 10 :])
    over = tiny_overrides(
        tmp_path,
        tmp_path / "ck",
        **{
            "data.data_format": "txt",
            "data.processed_dir": str(processed),
            "model.block_size": 16,
            "training.max_iters": 2,
            "training.eval_interval": 0,
        },
    )
    train(None, overrides=over)
    meta = json.loads((processed / "cache" / "meta.json").read_text())
    assert meta["vocab_size"] == len(set(text)) and meta["train_tokens"] + meta["val_tokens"] == len(text)
    stamp = (processed / "cache" / "train.bin").stat().st_mtime_ns
    train(None, overrides={**over, "run.name": "again"})
    assert (processed / "cache" / "train.bin").stat().st_mtime_ns == stamp  # reused, not re-tokenized


def test_tokenizer_mismatch_with_config_is_refused(tiny_data, tmp_path):
    from quillgpt.errors import UserError

    with pytest.raises(UserError, match="prepared with the char tokenizer but the config asks for bpe"):
        load_dataset(tiny_data / "tiny", expect_tokenizer="bpe")


def test_neighbouring_batches_share_no_random_draws():
    """A regression test: keying Philox's counter by the index made batch i+1 reuse most of batch i."""
    a = set(batch_rng(0, "train", 5).integers(0, 10**9, size=64))
    b = set(batch_rng(0, "train", 6).integers(0, 10**9, size=64))
    c = set(batch_rng(0, "val", 5).integers(0, 10**9, size=64))
    assert not a & b and not a & c
