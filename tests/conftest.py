"""Shared pytest fixtures; the repo root is made importable so tests can `import prepare` etc."""

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def shakespeare_path() -> Path:
    path = (REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt").resolve()
    if not path.is_file():
        pytest.skip(f"tiny Shakespeare not found at {path}")
    return path


SHAKESPEARE = (REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt").resolve()


def tiny_corpus(n_bytes: int = 120_000) -> str:
    """The start of tiny Shakespeare when present, else deterministic word salad of the same size."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")[:n_bytes]
    import random
    rng = random.Random(0)
    words = "the king queen lord of and to my thou art not what say speak come go love death night".split()
    lines = []
    while sum(map(len, lines)) < n_bytes:
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))).capitalize() + ".\n")
    return "".join(lines)[:n_bytes]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared char dataset `tiny` (≈108k train / 12k val tokens) in a session-wide data dir."""
    from prepare import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    text_file = root / "tiny.txt"
    text_file.write_text(tiny_corpus(), encoding="utf-8")
    prepare_dataset("tiny", input_path=str(text_file), tokenizer="char", data_dir=root, verbose=False)
    return root


def tiny_overrides(data_dir: Path, out_dir: Path, **extra) -> dict:
    """Overrides for a tiny, fast CPU run on the `tiny` dataset (≈5 ms per step)."""
    base = {
        "data.dataset": "tiny", "data.data_dir": str(data_dir), "run.out_dir": str(out_dir), "run.name": "t",
        "run.device": "cpu", "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
        "model.dropout": 0.1, "training.batch_size": 4, "training.max_iters": 20, "training.eval_interval": 10,
        "training.eval_iters": 4, "training.log_interval": 1, "training.save_interval": 10,
        "optimizer.learning_rate": 3e-3, "optimizer.warmup_iters": 2, "logging.plot": False,
    }
    base.update(extra)
    return base
