"""train.py and the training loop (trainer.py): the loop's promises, on tiny real runs."""

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, TINY_COMPILED, resume_in_subprocess, tiny_overrides, train_until_sigterm
from make_run_fixture import DATASET, fixture_text, prepare_fixture_data

from quillgpt.checkpoint import RunDir, load_checkpoint, save_checkpoint
from quillgpt.config import GPTConfig, build_config
from quillgpt.data import Batch, find_dataset
from train import train


def losses(run_dir: Path) -> dict[int, float]:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    return {p["iter"]: p["loss"] for p in history if p["kind"] == "train"}


def test_train_api_writes_checkpoints_log_curve_and_eval_metrics(tiny_data, tmp_path):
    """train() leaves last and best checkpoints, config, log, latest and a PNG curve; evals carry ppl and accuracy."""
    result = train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"logging.plot": True}))
    run = tmp_path / "t"
    assert result.iterations == 20 and result.total_tokens == 20 * 4 * 32
    assert result.checkpoint_path == str(run / "ckpt_best.pt")
    assert math.isfinite(result.final_loss) and result.best_val_loss < math.log(65)
    for name in ("ckpt_last.pt", "ckpt_best.pt", "config.toml", "train_log.json", "latest", "loss_curve.png"):
        assert (run / name).is_file(), name
    ckpt = load_checkpoint(run / "ckpt_last.pt")
    assert ckpt["iter_num"] == 20 and ckpt["model_args"]["n_layer"] == 2
    assert ckpt["tokenizer"]["kind"] == "char"
    # the loss curve is a real PNG
    png = (run / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(run / "loss_curve.png").shape[0] > 100
    # eval points carry perplexity and accuracy
    evals = [p for p in json.loads((run / "train_log.json").read_text())["history"] if p["kind"] == "eval"]
    assert [p["iter"] for p in evals] == [0, 10, 20]
    assert all(0 <= p["val_acc"] <= 1 and p["val_ppl"] == pytest.approx(math.exp(p["val_loss"])) for p in evals)


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.xdist_group("compiled_step")])]
)
def test_same_seed_same_losses(tiny_data, tmp_path, compiled):
    """Bit for bit, also compiled in bf16 as the CPU preset runs (inductor's embedding backward
    was nondeterministic there until train.py switched on deterministic algorithms on the CPU)."""
    extra = {"training.max_iters": 16 if compiled else 8}
    if compiled:
        extra.update(TINY_COMPILED)
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "a", **extra))
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "b", **extra))
    assert losses(tmp_path / "a" / "t") == losses(tmp_path / "b" / "t")


def test_final_evaluation_runs_over_final_eval_iters_batches(tiny_data, tmp_path):
    """final_eval_iters = 12 with eval_iters = 2: the in-run evaluations are those of a run with eval_iters = 2, the
    final one is exactly that of a run evaluating 12 batches every time (evaluation draws no random numbers)."""

    def evals(name: str, **extra) -> list[float]:
        train(
            None,
            overrides=tiny_overrides(
                tiny_data, tmp_path / name, **{"training.max_iters": 10, "training.save_interval": 0, **extra}
            ),
        )
        history = json.loads((tmp_path / name / "t" / "train_log.json").read_text())["history"]
        return [p["val_loss"] for p in history if p["kind"] == "eval"]

    few, many = evals("few", **{"training.eval_iters": 2}), evals("many", **{"training.eval_iters": 12})
    final = evals("final", **{"training.eval_iters": 2, "training.final_eval_iters": 12})
    assert final[:-1] == few[:-1] and final[-1] == many[-1] != few[-1]


def test_train_gives_the_caller_its_determinism_settings_back(tiny_data, tmp_path):
    """train() runs with deterministic algorithms on the CPU, but a Python caller's own setting survives it."""
    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2}))
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


def test_resume_reproduces_uninterrupted_losses(tiny_data, tmp_path):
    """k iterations, stop, resume to 2k == 2k straight (dropout on, so RNG state must be restored)."""
    common = {"optimizer.lr_decay_iters": 24, "training.save_interval": 6}
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "straight", **common, **{"training.max_iters": 24}))
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "split", **common, **{"training.max_iters": 12}))
    train(None, overrides={"training.max_iters": 24}, resume=str(tmp_path / "split" / "t"))
    a, b = losses(tmp_path / "straight" / "t"), losses(tmp_path / "split" / "t")
    assert sorted(a) == sorted(b) == list(range(1, 25))
    assert a == b  # exact, not approximate


def test_a_wsd_run_logs_its_schedule_and_resumes_exactly(tiny_data, tmp_path):
    """A real run with schedule "wsd": the logged learning rates hold the peak, then fall on the warmdown's line to
    min_lr at the last step; stopped halfway and resumed, the losses equal the straight run's."""
    common = {
        "optimizer.schedule": "wsd",
        "optimizer.warmdown_ratio": 0.5,
        "optimizer.warmup_iters": 2,
        "optimizer.learning_rate": 1e-3,
        "optimizer.min_lr": 1e-4,
        "optimizer.lr_decay_iters": 16,
        "training.save_interval": 8,
    }
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "straight", **common, **{"training.max_iters": 16}))
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "split", **common, **{"training.max_iters": 8}))
    train(None, overrides={"training.max_iters": 16}, resume=str(tmp_path / "split" / "t"))
    assert losses(tmp_path / "straight" / "t") == losses(tmp_path / "split" / "t")
    history = json.loads((tmp_path / "straight" / "t" / "train_log.json").read_text())["history"]
    lr = {r["iter"]: r["lr"] for r in history if r["kind"] == "train"}
    # iter i logs the learning rate its step (i - 1) ran with: held to the warmdown's start at step 8, then a line
    # that would reach min_lr at step 16
    assert lr[4] == lr[9] == pytest.approx(1e-3)
    assert lr[13] == pytest.approx(1e-4 + 0.5 * 9e-4) and lr[16] == pytest.approx(1e-4 + 9e-4 / 8)


def test_existing_run_is_not_overwritten(tiny_data, tmp_path, capsys):
    from quillgpt.errors import UserError

    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2}))
    with pytest.raises(UserError, match="--resume.*--force"):
        train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2}))
    result = train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 3}), force=True)
    assert result.iterations == 3


def test_early_stopping_waits_for_patience(tiny_data, tmp_path):
    # a min_delta no real improvement can meet: every eval after the first counts as "no improvement"
    result = train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{
                "training.max_iters": 100,
                "training.eval_interval": 5,
                "training.early_stopping": True,
                "training.early_stopping_patience": 3,
                "training.early_stopping_min_delta": 100.0,
            },
        ),
    )
    assert result.iterations == 15  # evals at 0 (best), 5, 10, 15 -> 3 without improvement
    assert "early stopping" in result.stop_reason
    ckpt = load_checkpoint(tmp_path / "t" / "ckpt_last.pt")
    assert ckpt["iter_num"] == 15 and ckpt["bad_evals"] == 3


def test_best_checkpoint_holds_the_best_val_loss_and_keep_last_prunes(tiny_data, tmp_path):
    train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{
                "training.max_iters": 30,
                "training.eval_interval": 5,
                "training.save_interval": 4,
                "training.keep_last": 2,
            },
        ),
    )
    run = RunDir(tmp_path / "t")
    history = json.loads((run.path / "train_log.json").read_text())["history"]
    evals = {p["iter"]: p["val_loss"] for p in history if p["kind"] == "eval" and p["iter"] > 0}
    best_iter = min(evals, key=evals.get)
    best = load_checkpoint(run.best)
    assert best["best_val_loss"] == pytest.approx(evals[best_iter])
    assert best["iter_num"] == best_iter
    assert [p.name for p in run.step_checkpoints()] == ["ckpt_step0000024.pt", "ckpt_step0000028.pt"]
    assert run.latest() == run.last and load_checkpoint(run.latest())["iter_num"] == 30


def test_fp16_on_cpu_trains_to_a_finite_loss_and_saves_its_grad_scaler(tiny_data, tmp_path):
    result = train(
        None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.precision": "fp16", "training.max_iters": 6})
    )
    assert math.isfinite(result.final_loss)
    ckpt = load_checkpoint(tmp_path / "t" / "ckpt_last.pt")
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0


def test_bf16_autocast_on_cpu_trains_to_a_finite_loss(tiny_data, tmp_path):
    result = train(
        None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.precision": "bf16", "training.max_iters": 6})
    )
    assert math.isfinite(result.final_loss)


class FixedBatches:
    """Serves rows of one fixed (8, T) batch: micro-batch i of size b gets rows [i*b, (i+1)*b)."""

    def __init__(self, x, y, b):
        self.x, self.y, self.b = x, y, b

    def get(self, split, index, next_index=None, rows=None):
        s = slice(index * self.b, index * self.b + (rows or self.b))
        return Batch(self.x[s], self.y[s], None)


def test_accumulation_matches_one_big_batch(tiny_data, tmp_path):
    """4 micro-steps of B/4 update the weights exactly like one step of B (the Trainer train.py builds, with a
    plain SGD optimizer and one fixed batch)."""
    from quillgpt.distributed import DistInfo
    from quillgpt.trainer import build_trainer, setup, train_step

    vocab_size = json.loads((tiny_data / "tiny" / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    x = torch.randint(0, vocab_size, (8, 16))
    y = torch.randint(0, vocab_size, (8, 16))
    deltas = []
    for batch, accum in ((8, 1), (2, 4)):
        cfg = build_config(
            None,
            tiny_overrides(
                tiny_data,
                tmp_path,
                **{
                    "training.batch_size": batch,
                    "training.grad_accum_steps": accum,
                    "optimizer.grad_clip": 0.0,
                    "model.dropout": 0.0,
                    "model.block_size": 16,
                },
            ),
        )
        rt = setup(cfg, DistInfo())  # seeds torch: both trainers start from the same weights
        tr = build_trainer(cfg, rt, find_dataset(cfg, DistInfo()))
        tr.objective.batches = FixedBatches(x, y, batch)
        tr = replace(tr, optimizers=[torch.optim.SGD(tr.model.parameters(), lr=1.0)])
        before = [p.detach().clone() for p in tr.model.parameters()]
        train_step(tr, 0)
        deltas.append([p.detach() - b for p, b in zip(tr.model.parameters(), before)])
    for a, b in zip(*deltas):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_nonfinite_loss_stops_with_last_good_checkpoint(tiny_data, tmp_path):
    result = train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{
                "optimizer.learning_rate": 1e30,
                "optimizer.warmup_iters": 0,
                "optimizer.grad_clip": 0.0,
                "training.max_iters": 50,
                "training.max_nonfinite_steps": 3,
                "training.save_interval": 1,
            },
        ),
    )
    assert "non-finite" in result.stop_reason
    assert result.iterations < 50
    load_checkpoint(RunDir(tmp_path / "t").latest())  # still loadable


def test_eval_only_from_init_from_evaluates_and_writes_nothing(tiny_data, tmp_path):
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 4}))
    result = train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{"training.eval_only": True, "run.init_from": str(tmp_path / "t"), "run.name": "eval"},
        ),
    )
    assert result.iterations == 0 and math.isfinite(result.best_val_loss)
    assert not (tmp_path / "eval").exists()  # evaluating writes nothing


def test_eval_only_of_a_run_leaves_it_untouched(tiny_data, tmp_path):
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 4}))
    run = tmp_path / "t"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    result = train(
        None,
        overrides=tiny_overrides(tiny_data, tmp_path, **{"training.eval_only": True, "training.eval_iters": 7}),
        resume=True,
    )
    assert result.iterations == 4 and math.isfinite(result.best_val_loss)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_sigterm_saves_and_resumes_exactly(tiny_data, tmp_path):
    """SIGTERM mid-run: the step finishes, ckpt_last is saved, exit 0, and --resume matches a straight run."""
    over = tiny_overrides(
        tiny_data,
        tmp_path,
        **{
            "training.max_iters": 400,
            "training.save_interval": 1000,
            "training.eval_interval": 0,
            "optimizer.lr_decay_iters": 400,
        },
    )
    out = train_until_sigterm(over, 30)
    assert "resume with" in out
    run = RunDir(tmp_path / "t")
    stopped_at = load_checkpoint(run.latest())["iter_num"]
    assert 30 <= stopped_at < 400
    resume_in_subprocess(run.path, 60)
    straight = tmp_path / "straight"
    train(None, overrides={**over, "run.out_dir": str(straight), "training.max_iters": 60})
    a, b = losses(straight / "t"), losses(run.path)
    assert max(b) == 60 and a == b


@pytest.mark.slow
def test_wandb_offline_run_writes_files(tiny_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(
        None,
        overrides=tiny_overrides(
            tiny_data, tmp_path, **{"training.max_iters": 4, "logging.wandb_project": "quillgpt-test"}
        ),
    )
    run = tmp_path / "t"
    offline = list((run / "wandb").glob("offline-run-*"))
    assert offline and any(f.suffix == ".wandb" for f in offline[0].iterdir())
    assert load_checkpoint(run / "ckpt_last.pt")["wandb_run_id"] in offline[0].name


@pytest.mark.slow
def test_cli_user_errors_exit_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", str(tmp_path / "missing.toml")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "config file not found" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_short_run_learns(tiny_data, tmp_path):
    """200 steps of the tiny model take the val loss at least 1.2 nats below its start (ln 61 = 4.11 for
    uniform guessing over the characters; it ends near 2.5)."""
    train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{
                "training.max_iters": 200,
                "training.eval_interval": 200,
                "training.eval_iters": 20,
                "training.log_interval": 50,
                "training.batch_size": 16,
                "model.dropout": 0.0,
                "optimizer.learning_rate": 1e-2,
            },
        ),
    )
    evals = {
        p["iter"]: p["val_loss"]
        for p in json.loads((tmp_path / "t" / "train_log.json").read_text())["history"]
        if p["kind"] == "eval"
    }
    assert sorted(evals) == [0, 200]
    assert evals[200] < evals[0] - 1.2


FIXTURES = REPO_ROOT / "tests" / "fixtures"
FIXTURE_RUN = FIXTURES / "run_14e5811"
TODAYS_FIXTURE_RUN = FIXTURES / "run_029bf66"  # written by tests/make_run_fixture.py


def assert_losses_as_expected(got: dict[int, float], fixture: Path) -> None:
    """The losses of the steps after a fixture's checkpoint are those its expected.json records: equal on the
    machine that wrote them; 1e-4 leaves room for another CPU's kernels."""
    expected = json.loads((fixture / "expected.json").read_text())["losses_after_resume"]
    for it, loss in expected.items():
        assert got[int(it)] == pytest.approx(loss, abs=1e-4)


def test_a_checkpoint_written_before_trainer_py_existed_resumes_exactly(tmp_path, capsys):
    """tests/fixtures/run_14e5811 holds the checkpoint that the code at commit 14e5811 (before trainer.py existed)
    wrote after 4 of 8 steps of a tiny char run with dropout. Resumed by today's code, steps 5-8 give the losses
    that the old code logs resuming it (with today's dropout-mask generator patched in: expected.json says how):
    same format, same optimizer, RNG and data position. Its stored config names model.compile and
    training.data_format, since renamed: one note each, and the resumed run stores the new names."""
    data_dir = prepare_fixture_data(tmp_path / "data")
    run = tmp_path / "v1"
    shutil.copytree(FIXTURE_RUN, run)
    train(None, overrides={"training.max_iters": 8, "data.data_dir": str(data_dir)}, resume=str(run))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: {run}/config: training.data_format is now data.data_format (read as that)",
        f"note: {run}/config: model.compile is now training.compile (read as that)",
    ]
    stored = load_checkpoint(run / "ckpt_last.pt")["config"]
    assert stored["data"]["data_format"] == "bin" and stored["training"]["compile"] is False
    assert "compile" not in stored["model"] and "data_format" not in stored["training"]
    got = losses(run)
    assert sorted(got) == [5, 6, 7, 8]
    assert_losses_as_expected(got, FIXTURE_RUN)


def test_todays_checkpoint_samples_and_resumes_exactly(tmp_path, capsys):
    """tests/fixtures/run_029bf66 is a run directory that tests/make_run_fixture.py wrote with the config's keys as
    they are named now (4 of 8 steps of a tiny char run). Later code still reads it: sample.py continues a prompt
    from it, and resumed it logs the losses of steps 5-8 that the code that wrote it logged, continuing its
    train_log.json, without a note."""
    stored = load_checkpoint(TODAYS_FIXTURE_RUN / "ckpt_last.pt")
    assert "data_format" in stored["config"]["data"] and "compile" in stored["config"]["training"]
    assert "compile" not in stored["config"]["model"] and "compile" not in stored["model_args"]
    data_dir = prepare_fixture_data(tmp_path / "data")
    run = tmp_path / "run"
    shutil.copytree(TODAYS_FIXTURE_RUN, run)
    sampled = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(run), "--prompt", "to be", "--max-new-tokens", "30", "--seed", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sampled.returncode == 0, sampled.stderr
    said = sampled.stderr.splitlines()  # one line: what it loaded, in which precision, on which device
    assert len(said) == 1 and said[0].startswith(f"[sampling {run / 'ckpt_last.pt'}, ") and said[0].endswith(" on cpu]")
    text = sampled.stdout.removesuffix("\n")
    assert text.startswith("to be") and len(text) == len("to be") + 30 and set(text) <= set(fixture_text())
    capsys.readouterr()
    train(None, overrides={"training.max_iters": 8, "data.data_dir": str(data_dir)}, resume=str(run))
    assert "note:" not in capsys.readouterr().err
    got = losses(run)
    assert sorted(got) == list(range(1, 9))  # steps 1-4 from the fixture's own log
    assert_losses_as_expected(got, TODAYS_FIXTURE_RUN)


@pytest.mark.parametrize("fixture", [FIXTURE_RUN, TODAYS_FIXTURE_RUN], ids=["14e5811", "today"])
def test_a_fixture_checkpoint_starts_a_new_run_with_init_from(fixture, tmp_path):
    """run.init_from reads a checkpoint's weights and model_args only: an old one's, whose config has the old key
    names, as well as today's. The new run's model is the fixture's with the config's dropout (model_args of the
    14e5811 fixture lack the fields added since, which take their defaults)."""
    data_dir = prepare_fixture_data(tmp_path / "data")
    over = {
        "run.init_from": str(fixture),
        "run.out_dir": str(tmp_path / "runs"),
        "run.name": "ft",
        "run.device": "cpu",
        "data.dataset": DATASET,
        "data.data_dir": str(data_dir),
        "training.batch_size": 4,
        "training.max_iters": 2,
        "training.eval_interval": 2,
        "training.eval_iters": 1,
        "logging.plot": False,
    }
    result = train(None, overrides=over)
    assert result.iterations == 2 and math.isfinite(result.final_loss)
    written = load_checkpoint(fixture / "ckpt_last.pt")["model_args"]
    assert load_checkpoint(tmp_path / "runs" / "ft" / "ckpt_last.pt")["model_args"] == {
        **GPTConfig().to_dict(),
        **written,
        "dropout": 0.0,
    }


FAULTS_SCRIPT = """
import resource, sys
sys.path.insert(0, {repo!r})
from quillgpt import trainer
from quillgpt.config import build_config
from quillgpt.data import find_dataset
from quillgpt.distributed import DistInfo

if sys.argv[1] == "glibc-default":
    trainer.keep_freed_memory = lambda: False
cfg = build_config({{}}, list({overrides!r}.items()), source="test")
rt = trainer.setup(cfg, DistInfo())
tr = trainer.build_trainer(cfg, rt, find_dataset(cfg, DistInfo()))
for it in range(12):  # the heap grows to its steady size over the first few steps
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.train_step(tr, it)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again(tiny_data, tmp_path):
    """A CPU step frees and re-allocates the same multi-MB tensors; trainer.setup has glibc keep freed memory, so
    steps after the first few take few page faults, where glibc's defaults fault thousands (its adaptive threshold
    settles after a varying number of steps, and a step of ours now and then faults a few hundred: compare sums)."""
    overrides = tiny_overrides(
        tiny_data,
        tmp_path,
        **{
            "model.n_embd": 256,
            "model.n_head": 4,
            "model.block_size": 128,
            "training.batch_size": 8,
            "model.dropout": 0.1,
        },
    )
    script = FAULTS_SCRIPT.format(repo=str(REPO_ROOT), overrides=overrides)
    faults = {
        arm: sum(
            map(
                int,
                subprocess.run(
                    [sys.executable, "-c", script, arm], cwd=REPO_ROOT, capture_output=True, text=True, check=True
                ).stdout.split()[-9:],
            )
        )
        for arm in ("glibc-default", "ours")
    }  # page faults in steps 3-11
    assert faults["glibc-default"] > 4 * faults["ours"] and faults["glibc-default"] > 2000, faults


def test_an_evaluation_takes_one_cross_entropy_per_batch_and_reports_their_mean(tiny_data, tmp_path):
    """Each evaluated batch costs one cross-entropy over its logits (at GPT-2's size a second one and its fp32 copy of
    the logits were ~5 GB), and the losses are the mean per-token ones of the batches, computed here directly."""
    from torch.overrides import TorchFunctionMode

    from quillgpt import trainer
    from quillgpt.distributed import DistInfo

    class CrossEntropies(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CrossEntropies.calls += func is torch.nn.functional.cross_entropy
            return func(*args, **(kwargs or {}))

    cfg = build_config(None, tiny_overrides(tiny_data, tmp_path))
    tr = trainer.build_trainer(cfg, trainer.setup(cfg, DistInfo()), find_dataset(cfg, DistInfo()))
    with CrossEntropies():
        metrics = trainer.eval_metrics(tr, batches=3)
    assert CrossEntropies.calls == 2 * 3
    tr.model.eval()
    with torch.no_grad():
        for split in ("train", "val"):
            nats = [
                torch.nn.functional.cross_entropy(tr.model(x)[0].flatten(0, 1), y.flatten())
                for x, y, _ in (tr.batches.get(split, k) for k in range(3))
            ]
            assert metrics[f"{split}_loss"] == pytest.approx(torch.stack(nats).mean().item(), rel=1e-5)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
    ],
)
def test_mfu_takes_the_dense_bf16_peak_of_the_card_by_its_name(name, tflops):
    """The H100's PCIe and NVL cards are slower than the SXM one whose name theirs contain, as the L40S is not an L4."""
    from quillgpt.metrics import cuda_peak_flops

    assert cuda_peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunked_loss_has_the_loss_and_gradients_of_the_whole_one(chat):
    """training.loss_chunks > 1: the head and cross-entropy by slices of rows, recomputed in backward, give the loss
    and every gradient of the whole computation (chat: with uncounted targets, -1, in some slices only)."""
    from model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, logit_softcap=15.0))
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    if chat:
        y[:, :5] = -1
    results = []
    for chunks in (1, 3):
        model.loss_chunks = chunks
        model.zero_grad()
        logits, loss = model(x, y)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert (logits is None) == (chunks > 1)
    (whole, whole_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, whole)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b)


def test_a_run_resumed_on_another_type_of_device_resolves_precision_and_compile_again(tiny_data, tmp_path, capsys):
    """The checkpoint records what the run asked for (precision auto, compile unset) beside what it resolved to and
    where. Resumed on the same type of device it keeps what it resolved to, silently; a run that began on a GPU
    (fp16 and compiled, as a GPU without bf16 resolves them) resumed on the CPU gets the CPU's choices, with one line."""
    over = tiny_overrides(tiny_data, tmp_path, **{"training.precision": "auto", "training.max_iters": 4})
    del over["training.precision"]  # asked: the schema's auto
    train(None, overrides=over)
    path = tmp_path / "t" / "ckpt_last.pt"
    ckpt = load_checkpoint(path)
    assert ckpt["requested"] == {"precision": "auto", "compile": None} and ckpt["resolved_on"] == "cpu"
    assert (
        ckpt["config"]["training"]["precision"] in ("fp32", "bf16") and ckpt["config"]["training"]["compile"] is False
    )
    capsys.readouterr()
    train(resume=str(tmp_path / "t"), overrides={"training.max_iters": 6})
    assert "resolved again" not in capsys.readouterr().out

    ckpt = load_checkpoint(path)
    ckpt["resolved_on"] = "cuda"
    ckpt["config"]["training"].update(precision="fp16", compile=True)
    save_checkpoint(path, ckpt)
    train(resume=str(tmp_path / "t"), overrides={"training.max_iters": 8})
    out = capsys.readouterr().out
    assert (
        "resuming on cpu a run that began on cuda: precision and compile are resolved again for cpu "
        "(training.precision = auto, training.compile = none)" in out
    )
    ckpt = load_checkpoint(path)
    assert ckpt["iter_num"] == 8 and ckpt["resolved_on"] == "cpu"
    assert ckpt["requested"] == {"precision": "auto", "compile": None}
    assert (
        ckpt["config"]["training"]["precision"] in ("fp32", "bf16") and ckpt["config"]["training"]["compile"] is False
    )
    assert "first step took" not in out  # not compiled
