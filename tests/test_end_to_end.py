"""The user's path, as typed: prepare.py -> train.py -> sample.py, as real subprocesses."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_ROOT, tiny_corpus


def run(*args, timeout=300):
    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    return proc


@pytest.mark.slow
def test_prepared_data_trains_a_run_that_samples_deterministically(tmp_path):
    """prepare.py (BPE) -> train.py (checkpoints, log, curve) -> sample.py twice with one seed gives the same text."""
    text = tmp_path / "corpus.txt"
    text.write_text(tiny_corpus(60_000), encoding="utf-8")
    data, ckpts = tmp_path / "data", tmp_path / "checkpoints"

    run(
        "prepare.py",
        "--dataset",
        "mini",
        "--input",
        str(text),
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "300",
        "--data-dir",
        str(data),
    )
    meta = json.loads((data / "mini" / "meta.json").read_text())
    train_ids = np.memmap(data / "mini" / "train.bin", dtype=meta["dtype"], mode="r")
    assert len(train_ids) == meta["train_tokens"] and train_ids.max() < meta["vocab_size"] == 300

    out = run(
        "train.py",
        "--config",
        "configs/base/base.toml",
        "--tokenizer",
        "bpe",
        "--max-iters",
        "40",
        "--data.dataset",
        "mini",
        "--data.data_dir",
        str(data),
        "--data.bpe_vocab_size",
        "300",
        "--run.out_dir",
        str(ckpts),
        "--run.name",
        "e2e",
        "--model.n_layer",
        "2",
        "--model.block_size",
        "32",
        "--training.eval_interval",
        "20",
        "--training.eval_iters",
        "5",
        "--training.log_interval",
        "10",
    ).stdout
    assert "iter     40/40" in out and "tok/s" in out and "mfu" in out and "eta" in out
    assert "tokens per optimizer step" in out
    run_dir = ckpts / "e2e"
    for name in ("ckpt_last.pt", "ckpt_best.pt", "train_log.json", "config.toml", "loss_curve.png"):
        assert (run_dir / name).is_file(), name

    sample = run(
        "sample.py",
        "--ckpt",
        str(run_dir),
        "--prompt",
        "The ",
        "--max-new-tokens",
        "60",
        "--seed",
        "1",
        "--num-samples",
        "2",
    ).stdout
    assert sample.count("The ") >= 2 and len(sample) > 60
    again = run(
        "sample.py",
        "--ckpt",
        str(run_dir),
        "--prompt",
        "The ",
        "--max-new-tokens",
        "60",
        "--seed",
        "1",
        "--num-samples",
        "2",
    ).stdout
    assert again == sample  # deterministic under a seed


@pytest.mark.slow
def test_main_command_prepares_the_offline_default_corpus(tmp_path):
    """The README's main command, shortened: no data dir exists, train.py prepares pystdlib itself."""
    out = run(
        "train.py",
        "--config",
        "configs/base/base.toml",
        "--max-iters",
        "10",
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.max_bytes",
        "300000",
        "--run.out_dir",
        str(tmp_path / "ck"),
        "--training.eval_iters",
        "2",
        "--training.log_interval",
        "5",
    ).stdout
    assert (tmp_path / "data" / "pystdlib" / "meta.json").is_file()
    assert "finished: 10 iters" in out
    sample = run(
        "sample.py", "--ckpt", str(tmp_path / "ck" / "base"), "--prompt", "def ", "--max-new-tokens", "30"
    ).stdout
    assert sample.startswith("def ")
