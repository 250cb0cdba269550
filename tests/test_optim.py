"""optim.py: parameter groups, AdamW and Muon, the learning-rate schedule."""

import copy
import math

import pytest
import torch
from test_model import MODERN, tiny

from quillgpt.config import OptimizerConfig, build_config
from quillgpt.optim import Muon, lr_multiplier, make_optimizers


def test_adamw_decays_matrices_only_and_holds_every_parameter():
    model = tiny()
    (adamw,) = make_optimizers(model, OptimizerConfig(weight_decay=0.1, learning_rate=1e-3), "cpu")
    decay, no_decay = adamw.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in adamw.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())


def test_muon_takes_hidden_matrices_only():
    model = tiny(**MODERN)
    muon, adamw = make_optimizers(model, OptimizerConfig(name="muon", weight_decay=0.0, learning_rate=1e-3), "cpu")
    hidden = {id(p) for p in muon.param_groups[0]["params"]}
    assert id(model.transformer.wte.weight) not in hidden and id(model.lm_head.weight) not in hidden
    assert all(p.dim() == 2 for p in muon.param_groups[0]["params"])
    x = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(15):
        _, loss = model(x, x)
        loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_batched_muon_equals_torch_muon_and_resumes_its_state():
    """Same-shape matrices orthogonalised in one batch (transposed ones in their own) give torch.optim.Muon's weights exactly, and
    each optimizer loads the other's state_dict (checkpoints written before the batching resume)."""
    torch.manual_seed(0)
    shapes = [(128, 384), (384, 128), (128, 128), (320, 128), (128, 320), (320, 128), (7, 5)]
    ours = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=2.5e-3, momentum=0.95, weight_decay=0.1)
    a = Muon([{"params": ours}], **kw)
    b = torch.optim.Muon([{"params": theirs}], nesterov=True, adjust_lr_fn="match_rms_adamw", **kw)

    def step(steps: int) -> None:
        for _ in range(steps):
            for p, q in zip(ours, theirs):
                p.grad = torch.randn(p.shape)
                q.grad = p.grad.clone()
            a.step()
            b.step()

    step(4)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    a.load_state_dict(copy.deepcopy(b.state_dict()))  # as from a checkpoint file: buffers of its own
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    step(2)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def test_lr_warms_up_decays_by_cosine_to_min_lr_and_stays_there():
    """Warmup (it + 1) / (warmup_iters + 1), the peak at warmup_iters, a cosine down to halfway at the middle, min_lr
    from lr_decay_iters on; decay_lr off keeps the peak."""
    cfg = build_config(
        None,
        {
            "optimizer.learning_rate": 1.0,
            "optimizer.min_lr": 0.1,
            "optimizer.warmup_iters": 10,
            "optimizer.lr_decay_iters": 110,
            "training.max_iters": 200,
        },
    )
    assert lr_multiplier(0, cfg) == pytest.approx(1 / 11)
    assert lr_multiplier(9, cfg) == pytest.approx(10 / 11)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg) == pytest.approx(0.55)
    assert lr_multiplier(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # cosine, not linear
    assert lr_multiplier(110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(150, cfg) == pytest.approx(0.1)
    flat = build_config(None, {"optimizer.decay_lr": False})
    assert lr_multiplier(5000, flat) == 1.0


def test_muon_in_fp32_orthogonalises_as_in_bf16():
    """The fp32 Newton-Schulz chain (for CPUs that emulate bf16) gives the bf16 chain's update within bf16's precision."""
    from quillgpt.optim import zeropower_via_newtonschulz

    torch.manual_seed(0)
    G = torch.randn(3, 32, 48)
    fp32 = zeropower_via_newtonschulz(G, dtype=torch.float32)
    bf16 = zeropower_via_newtonschulz(G).float()
    assert fp32.dtype == torch.float32
    assert torch.allclose(fp32, bf16, atol=0.05) and (fp32 - bf16).abs().mean() < 0.01


def test_wsd_holds_the_peak_then_warms_down_linearly_to_min_lr():
    """schedule "wsd" (nanochat's): warmup as cosine's, the peak held until the last warmdown_ratio of
    lr_decay_iters, then a straight line down to min_lr at lr_decay_iters, and min_lr after."""
    cfg = build_config(
        None,
        {
            "optimizer.schedule": "wsd",
            "optimizer.warmdown_ratio": 0.5,
            "optimizer.learning_rate": 1.0,
            "optimizer.min_lr": 0.1,
            "optimizer.warmup_iters": 10,
            "optimizer.lr_decay_iters": 100,
            "training.max_iters": 120,
        },
    )
    assert lr_multiplier(9, cfg) == pytest.approx(10 / 11)
    assert lr_multiplier(10, cfg) == lr_multiplier(50, cfg) == 1.0
    assert lr_multiplier(75, cfg) == pytest.approx(0.55)  # halfway down the warmdown: a line, not a cosine
    assert lr_multiplier(100, cfg) == lr_multiplier(119, cfg) == pytest.approx(0.1)
    steps = [lr_multiplier(it, cfg) for it in range(50, 101)]
    assert all(a > b for a, b in zip(steps, steps[1:]))
