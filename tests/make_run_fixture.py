"""Write a run directory fixture with today's code: what tests/test_train.py checks later code still reads.

    python tests/make_run_fixture.py            # writes tests/fixtures/run_<HEAD's short hash>/

A tiny char run (1 layer, n_embd 16, dropout 0.1) trains 4 of its 8 steps on FIXTURE_TEXT's dataset; the fixture
is what a run directory holds after that (ckpt_last.pt, latest, config.toml, train_log.json; no ckpt_best.pt, to
keep it small), and expected.json the losses of steps 5-8 that this code logs resuming a copy of it. Run it on a
clean checkout, so that the directory's name is the commit that wrote it.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATASET = "fixture"
FILES = ("ckpt_last.pt", "latest", "config.toml", "train_log.json")
WRITTEN_STEPS, ALL_STEPS = 4, 8


def fixture_text() -> str:
    """The text the fixture runs train on (their char dataset is prepared again from it): 103 kB, 21 characters."""
    rng = random.Random(1234)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))) + ".\n" for _ in range(3000))


def prepare_fixture_data(data_dir: Path) -> Path:
    """The fixture runs' char dataset, prepared in data_dir/fixture; returns data_dir."""
    from quillgpt.files import atomic_write_text
    from quillgpt.prepare import prepare_dataset

    data_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(data_dir / "text.txt", fixture_text())
    prepare_dataset(DATASET, input_path=str(data_dir / "text.txt"), tokenizer="char", data_dir=data_dir, verbose=False)
    return data_dir


def run_overrides(data_dir: Path, out_dir: Path) -> dict:
    return {
        "run.name": "fixture",
        "run.out_dir": str(out_dir),
        "run.device": "cpu",
        "data.dataset": DATASET,
        "data.data_dir": str(data_dir),
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.block_size": 16,
        "model.dropout": 0.1,
        "training.batch_size": 4,
        "training.max_iters": WRITTEN_STEPS,
        "training.eval_interval": WRITTEN_STEPS,
        "training.eval_iters": 2,
        "training.log_interval": 1,
        "training.save_interval": WRITTEN_STEPS,
        "training.keep_last": 0,
        "optimizer.warmup_iters": 2,
        "optimizer.lr_decay_iters": ALL_STEPS,
        "logging.plot": False,
    }


def train_losses(run_dir: Path) -> dict[int, float]:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    return {p["iter"]: p["loss"] for p in history if p["kind"] == "train"}


def main() -> None:
    from quillgpt.checkpoint import link_or_copy
    from quillgpt.files import atomic_write_json
    from train import train

    commit = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    fixture = REPO_ROOT / "tests" / "fixtures" / f"run_{commit}"
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = prepare_fixture_data(Path(tmp) / "data")
        train(None, overrides=run_overrides(data_dir, Path(tmp) / "runs"))
        written = Path(tmp) / "runs" / "fixture"
        fixture.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            link_or_copy(written / name, fixture / name)
        resumed = Path(tmp) / "resumed"
        shutil.copytree(fixture, resumed)
        train(None, overrides={"training.max_iters": ALL_STEPS, "data.data_dir": str(data_dir)}, resume=str(resumed))
        losses = train_losses(resumed)
    atomic_write_json(
        fixture / "expected.json",
        {
            "written_by": f"commit {commit}: tests/make_run_fixture.py, {WRITTEN_STEPS} of the {ALL_STEPS} steps of a "
            "tiny char run with dropout 0.1",
            "losses_after_resume": {str(it): losses[it] for it in range(WRITTEN_STEPS + 1, ALL_STEPS + 1)},
        },
    )
    print(f"wrote {fixture}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere; pytest puts the root on the path itself
    main()
