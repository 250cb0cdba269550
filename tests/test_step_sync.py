"""A training step ready for a GPU: a step that doesn't log never makes the host wait for the device, and a non-finite
gradient is skipped on the device without a bad update ever reaching the weights."""

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny_overrides
from torch.overrides import TorchFunctionMode

from model import GPT, GPTConfig
from quillgpt import trainer
from quillgpt.config import build_config
from quillgpt.data import BatchSource, find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.objective import LanguageModeling
from quillgpt.optim import make_optimizers
from quillgpt.precision import autocast as precision_autocast
from train import train

# the calls that make the host wait for the device's queue to drain
SYNCING = {"item", "__bool__", "tolist", "cpu", "nonzero", "numpy", "__int__", "__float__"}


class SyncCalls(TorchFunctionMode):
    """Records each syncing call with the training step that was running (the last train_step to start).

    On a CPU run every tensor is on the host, so `.to(device)` can't tell a move to the run's device from one to the
    host: device-generic code (ours, torch's clipping and AdamW) passes a torch.device, so a `.to("cpu")` spelt as a
    string is what counts as a move to the host here, with `.cpu()`."""

    def __init__(self):
        super().__init__()
        self.step: int | None = None
        self.calls: list[tuple[int | None, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and "cpu" in [a for a in (*args[1:], *kwargs.values()) if isinstance(a, str)]
        if name in SYNCING or to_host:
            self.calls.append((self.step, name))
        return func(*args, **kwargs)


@pytest.mark.parametrize("optimizer,precision", [("adamw", "fp32"), ("muon", "fp32"), ("adamw", "fp16")])
def test_a_step_that_does_not_log_never_waits_for_the_device(tiny_data, tmp_path, monkeypatch, optimizer, precision):
    """Ten steps, a log line every fourth, evaluation and saving only at the end: steps 1-3, 5-7 and 9 make no
    call that syncs (item, bool, tolist, cpu, nonzero...), counted by a TorchFunctionMode around the real loop.
    fp16 runs GradScaler (on the CPU as on CUDA), which skips inf steps on the device too."""
    mode = SyncCalls()
    real_step = trainer.train_step

    def tagged_step(tr, it):
        mode.step = it + 1  # the step number the loop logs
        return real_step(tr, it)

    monkeypatch.setattr(trainer, "train_step", tagged_step)
    over = tiny_overrides(
        tiny_data,
        tmp_path,
        **{
            "training.max_iters": 10,
            "training.log_interval": 4,
            "training.eval_interval": 0,
            "training.save_interval": 0,
            "training.grad_accum_steps": 2,
            "optimizer.name": optimizer,
            "training.precision": precision,
        },
    )
    with mode:
        result = train(None, overrides=over)
    assert result.iterations == 10
    steps_that_read = {4, 8, 10}
    quiet = [(step, name) for step, name in mode.calls if step is not None and step not in steps_that_read]
    assert quiet == [], f"syncing calls in steps that don't log: {quiet}"
    assert any(step in steps_that_read for step, _ in mode.calls)  # the mode does see the log steps' reads


def nan_gradient_once(model: torch.nn.Module, at_call: int):
    """A hook that makes the first parameter's gradient NaN on the at_call-th backward pass."""
    calls = {"n": 0}
    param = next(model.parameters())

    def hook(grad):
        calls["n"] += 1
        return torch.full_like(grad, float("nan")) if calls["n"] == at_call else grad

    return param.register_hook(hook)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_nonfinite_gradient_leaves_weights_and_optimizer_state_untouched(tiny_data, tmp_path, optimizer):
    """Step 2's gradient is NaN: the weights and every optimizer state tensor after it are those after step 1,
    bit for bit, the step reports skipped, and the next step trains on from there."""
    cfg = build_config(None, tiny_overrides(tiny_data, tmp_path, **{"optimizer.name": optimizer}))
    rt = trainer.setup(cfg, DistInfo())
    tr = trainer.build_trainer(cfg, rt, find_dataset(cfg, DistInfo()))
    handle = nan_gradient_once(tr.raw_model, at_call=2)
    _, _, skipped = trainer.train_step(tr, 0)
    assert skipped.item() == 0
    weights = [p.detach().clone() for p in tr.raw_model.parameters()]
    states = [{k: v.clone() for k, v in s.items()} for opt in tr.optimizers for s in opt.state.values()]
    _, norm, skipped = trainer.train_step(tr, 1)
    assert skipped.item() == 1 and not torch.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(weights, tr.raw_model.parameters()))
    after = [s for opt in tr.optimizers for s in opt.state.values()]
    assert all(torch.equal(v, s[k]) for before, s in zip(states, after) for k, v in before.items())
    _, norm, skipped = trainer.train_step(tr, 2)
    handle.remove()
    assert skipped.item() == 0 and torch.isfinite(norm)
    assert not all(torch.equal(a, p) for a, p in zip(weights, tr.raw_model.parameters()))


def test_skipped_steps_are_reported_in_one_line_at_the_next_log_step(tiny_data, tmp_path, monkeypatch, capsys):
    """A NaN gradient at step 3 of a run that logs every 5: one line at step 5 names the span and the count, the
    run goes on to the end, and its loss stays finite."""
    real_build = trainer.build_trainer

    def build_with_nan(*args, **kwargs):
        tr = real_build(*args, **kwargs)
        nan_gradient_once(tr.raw_model, at_call=3)
        return tr

    monkeypatch.setattr(trainer, "build_trainer", build_with_nan)
    monkeypatch.setattr("train.build_trainer", build_with_nan)
    over = tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 10, "training.log_interval": 5})
    result = train(None, overrides=over)
    out = capsys.readouterr().out
    assert (
        "iters 1-5: 1 step(s) skipped for a non-finite loss or gradient, no update applied (1 in a row at most)" in out
    )
    assert result.iterations == 10 and result.stop_reason == "finished"
    assert torch.isfinite(torch.tensor(result.final_loss))


@pytest.fixture
def fused_adamw_on_meta(monkeypatch):
    """Fused AdamW accepts parameters of the devices in a list that has CUDA and the CPU: meta joins it here (its
    meta kernel exists), so that the step runs as it would on CUDA."""
    import torch.optim.optimizer as optimizer_module

    supported = optimizer_module._get_fused_kernels_supported_devices()
    monkeypatch.setattr(optimizer_module, "_get_fused_kernels_supported_devices", lambda: [*supported, "meta"])


@pytest.mark.parametrize("optimizer,chat", [("adamw", False), ("muon", False), ("muon", True)])
def test_a_training_step_reads_nothing_back_on_the_meta_device(
    tiny_data, tmp_path, fused_adamw_on_meta, optimizer, chat
):
    """The meta device stands in for CUDA: a tensor there has no values, so any read back to the host (.item(), int(),
    a Python bool, a tensor weight that a kernel takes as a number) raises, and so does a CPU tensor mixed in. The
    real train_step with accumulation and the non-finite guard runs there, as the optimizers are built for CUDA."""
    cfg = build_config(
        None,
        tiny_overrides(
            tiny_data, tiny_data, **{"optimizer.name": optimizer, "training.grad_accum_steps": 2, "data.chat": False}
        ),
    )
    meta = torch.device("meta")
    dataset = find_dataset(cfg, DistInfo())
    if chat:  # conversations of 40 tokens whose every other target counts: -1 targets, as chat rows have
        shutil.copytree(dataset.directory, tmp_path / "chat")
        for split, n in dataset.lengths.items():
            (np.arange(n) % 2).astype(np.uint8).tofile(tmp_path / "chat" / f"{split}.mask.bin")
        starts = {split: np.arange(0, n - 40, 40) for split, n in dataset.lengths.items()}
        dataset = replace(dataset, directory=tmp_path / "chat", starts=starts)
    model = GPT(GPTConfig.from_dict({**cfg.model_args(), "vocab_size": dataset.vocab_size})).to(meta)
    rt = trainer.Runtime(meta, "fp32", DistInfo(), False, 1e12, precision_autocast("cpu", "fp32"))
    batches = BatchSource(dataset, cfg.model.block_size, cfg.training.batch_size, cfg.run.seed, meta, prefetch=True)
    evaluation = trainer.Evaluation(torch.ones(dataset.vocab_size, dtype=torch.long, device=meta), None)
    optimizers = make_optimizers(model, cfg.optimizer, "cuda")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objective = LanguageModeling(batches, None)
    tr = trainer.Trainer(cfg, rt, dataset, model, model, optimizers, scaler, objective, None, {}, evaluation)
    guard = trainer.NonfiniteGuard(meta, 0)
    for it in range(2):
        loss, norm, skipped = trainer.train_step(tr, it)
        guard.record(skipped, it)
    assert loss.device == norm.device == skipped.device == meta


def test_the_step_clock_counts_the_time_the_device_takes_to_drain_its_queue():
    """A device that queues work, as a GPU does: queueing a step takes no time, running it takes 10 ms, paid when the
    host waits (synchronize). The clock reads 10 ms a step at every log step (every 10th), and the first step, timed
    alone, 10 ms too; a clock around each step's queueing alone would read 0."""
    device = {"now": 0.0, "queued": 0}

    def synchronize():
        device["now"] += 0.010 * device["queued"]
        device["queued"] = 0

    clock = trainer.StepClock(synchronize, now=lambda: device["now"])
    for step in range(1, 41):
        device["queued"] += 1
        clock.tick()
        if step % 10 == 0:
            clock.settle()
            assert clock.seconds_per_step == pytest.approx(0.010)
    assert clock.first == pytest.approx(0.010)
    device["now"] += 5.0  # an evaluation, then a window opened after it: left out
    clock.restart()
    device["queued"] += 3
    for _ in range(3):
        clock.tick()
    clock.settle()
    assert clock.seconds_per_step == pytest.approx(0.010)
