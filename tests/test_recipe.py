"""The 2026 recipe's config: the size dial (model.depth, config.py), the horizon from a data:parameter ratio
or a FLOP target (run_model.horizon) and the wall-clock budget (training.time_budget_s), on configs and real runs."""

import json
import math

import pytest
import tomllib
import torch
from conftest import tiny_overrides

from model import GPT
from quillgpt.config import ConfigError, GPTConfig, build_config, plan_lines, to_toml
from quillgpt.optim import lr_multiplier
from train import train


@pytest.mark.parametrize(
    "depth, shape",
    [(2, (2, 128, 1)), (4, (4, 256, 2)), (8, (8, 512, 4)), (12, (12, 768, 6)), (26, (26, 1664, 13))],
)
def test_the_dial_gives_nanochats_shapes(depth, shape):
    """n_layer, n_embd, n_head of nanochat's build_model_meta (aspect 64, head 128): d26 is its 1664 wide, 13 heads."""
    m = build_config({"model": {"depth": depth}}).model
    assert (m.n_layer, m.n_embd, m.n_head) == shape
    assert m.n_embd // m.n_head == 128


def test_the_dial_scales_the_rates_by_width_and_a_key_set_at_its_layer_or_above_wins():
    o = build_config({"model": {"depth": 8}}).optimizer
    assert o.learning_rate == pytest.approx(3e-3 * (512 / 128) ** -0.5)
    assert o.muon_lr == pytest.approx(2.5e-3 * 0.5)
    assert o.min_lr == pytest.approx(o.learning_rate * 0.05)  # nanochat's final_lr_frac
    # a file's own n_embd beside its depth stays, and the heads and rates follow it
    cfg = build_config({"model": {"depth": 4, "n_embd": 192, "head_dim": 64}})
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head) == (4, 192, 3)
    assert cfg.optimizer.learning_rate == pytest.approx(3e-3 * (192 / 128) ** -0.5)
    lines = plan_lines(cfg)
    assert "model.n_embd = 192 (set; the dial's is 256)" in lines
    assert "model.n_head = 3 (the dial: n_embd 192 / head width 64)" in lines
    # the dial on the command line resizes a file's model; a rate set on the command line beside it wins
    file = {"model": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "optimizer": {"learning_rate": 2e-3}}
    cfg = build_config(file, {"model.depth": 6, "optimizer.learning_rate": 1e-3})
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.optimizer.learning_rate) == (6, 384, 3, 1e-3)


def test_the_horizon_keys_and_the_budget_are_checked():
    with pytest.raises(ConfigError) as e:
        build_config(
            {"model": {"depth": -1, "aspect_ratio": 0}, "optimizer": {"final_lr_frac": 2.0}},
            {"training.target_param_data_ratio": 0, "training.time_budget_s": -5},
        )
    for key in ("model.depth", "model.aspect_ratio", "optimizer.final_lr_frac", "training.target_param_data_ratio"):
        assert key in str(e.value)
    assert "training.time_budget_s = -5" in str(e.value)


def scaling_parameters(model_args: dict) -> int:
    """The blocks' matrices and the head of the tests' tiny GPT (GELU MLP 4x, tied head), counted by hand."""
    c, vocab, layers = model_args["n_embd"], model_args["vocab_size"], model_args["n_layer"]
    return layers * (c * 3 * c + c * c + 2 * c * 4 * c) + vocab * c


def test_the_horizon_comes_from_a_ratio_or_flops_and_an_explicit_max_iters_wins(tiny_data, tmp_path, capsys):
    """A real run's steps: ratio x scaling parameters / tokens a step; target_flops / (FLOPs a token x tokens a step);
    max_iters on the command line over a ratio in the file. The plan line says which, and the run records steps."""

    def overrides(out, **extra):  # without the tiny runs' max_iters, which would win
        o = tiny_overrides(
            tiny_data, tmp_path / out, **{"training.eval_interval": 0, "training.save_interval": 0}, **extra
        )
        return {k: v for k, v in o.items() if k != "training.max_iters"}

    ratio = train(None, overrides=overrides("r", **{"training.target_param_data_ratio": 0.3}))
    args = torch.load(ratio.checkpoint_path, weights_only=True)["model_args"]
    tokens = 4 * 32  # batch_size x block_size
    assert ratio.iterations == int(0.3 * scaling_parameters(args)) // tokens > 20
    assert "training.max_iters = " in capsys.readouterr().out
    config = (tmp_path / "r" / "t" / "config.toml").read_text()
    assert f"max_iters = {ratio.iterations}" in config and "target_param_data_ratio" not in config
    flops = GPT(GPTConfig.from_dict(args)).flops_per_token()  # what MFU counts: 6N + attention
    target = 40 * flops * tokens
    done = train(None, overrides=overrides("f", **{"training.target_flops": target}))
    assert done.iterations == 40
    file = tmp_path / "ratio.toml"
    file.write_text("[training]\ntarget_param_data_ratio = 5.0\n")
    capped = train(str(file), overrides={**overrides("m"), "training.max_iters": 7})
    assert capped.iterations == 7
    assert "training.max_iters = 7 is set, so training.target_param_data_ratio is not used" in capsys.readouterr().err


def test_a_config_with_a_horizon_target_dumps_to_toml_that_reloads_to_it():
    """A dump holding both max_iters and a target would reload with max_iters winning (a file's explicit key): while a
    target decides the steps, the dump leaves max_iters out."""
    cfg = build_config({"training": {"target_param_data_ratio": 8.0}})
    text = to_toml(cfg)
    assert "target_param_data_ratio = 8.0" in text and "max_iters" not in text
    again = build_config(tomllib.loads(text))
    assert again.training.target_param_data_ratio == 8.0 and to_toml(again) == text


def test_validate_shows_the_dials_plan(tiny_data, tmp_path, capsys):
    overrides = tiny_overrides(
        tiny_data, tmp_path, **{"model.depth": 2, "model.head_dim": 16, "model.aspect_ratio": 16}
    )
    for key in ("model.n_layer", "model.n_head", "model.n_embd", "optimizer.learning_rate", "training.max_iters"):
        overrides.pop(key)
    report = train(None, overrides={**overrides, "training.target_param_data_ratio": 1.0}, validate_only=True)
    out = capsys.readouterr().out
    assert "plan: model.n_embd = 32 (the dial: depth 2 x aspect_ratio 16, up to a multiple of head width 16)" in out
    assert "plan: model.n_head = 2 (the dial: n_embd 32 / head width 16)" in out
    assert "plan: training.max_iters = " in out and "target_param_data_ratio 1 x" in out
    assert report["model_args"]["n_embd"] == 32


def test_a_batch_ramp_grows_the_micro_batch_row_by_row_from_the_full_batchs_first_rows(tiny_data, tmp_path):
    """batch_ramp_iters 6 from 1 row to batch_size 4: rows 1, 1, 2, 2, 3, 3, then 4; each micro-batch the first rows
    of the full one (the data a pure function of the step); the tokens counted are the rows trained on, and a ratio
    horizon counts the ramp's smaller steps."""
    from quillgpt.data import BatchSource, load_dataset, micro_batch_rows

    ramped = build_config({"training": {"batch_size": 4, "batch_ramp_iters": 6, "batch_ramp_start": 1}}).training
    assert [micro_batch_rows(ramped, i) for i in range(8)] == [1, 1, 2, 2, 3, 3, 4, 4]
    source = BatchSource(load_dataset(tiny_data / "tiny"), 32, 4, 1337, torch.device("cpu"))
    full, part = source.get("train", 5), source.get("train", 5, rows=2)
    assert part.x.shape == (2, 32) and torch.equal(part.x, full.x[:2]) and torch.equal(part.y, full.y[:2])
    ramp = {"training.batch_ramp_iters": 6, "training.batch_ramp_start": 1, "training.save_interval": 0}
    done = train(None, overrides=tiny_overrides(tiny_data, tmp_path / "r", **ramp, **{"training.max_iters": 10}))
    assert torch.load(done.checkpoint_path, weights_only=True)["tokens_seen"] == 32 * (12 + 4 * 4)
    horizon = {k: v for k, v in tiny_overrides(tiny_data, tmp_path / "h", **ramp).items() if k != "training.max_iters"}
    ratio = train(None, overrides={**horizon, "training.target_param_data_ratio": 0.3, "training.eval_interval": 0})
    target = int(0.3 * scaling_parameters(torch.load(ratio.checkpoint_path, weights_only=True)["model_args"]))
    assert ratio.iterations == 6 + (target - 32 * 12) // (32 * 4)  # the ramp's 12 rows of tokens, then full steps


def test_a_batch_ramp_is_refused_where_it_would_not_apply():
    with pytest.raises(ConfigError) as e:
        build_config({"training": {"batch_ramp_iters": 10, "batch_ramp_start": 20, "batch_size": 8}})
    assert "training.batch_ramp_start = 20 must be in [1, batch_size 8]" in str(e.value)
    with pytest.raises(ConfigError, match="not DPO's pairs"):
        build_config({"training": {"batch_ramp_iters": 10}, "data": {"preference": True}})


def test_the_schedule_under_a_budget_runs_over_its_seconds():
    cfg = build_config({"training": {"time_budget_s": 100.0}, "optimizer": {"schedule": "wsd", "warmup_iters": 2}})
    floor = cfg.optimizer.min_lr / cfg.optimizer.learning_rate
    assert lr_multiplier(0, cfg, 0.0) == pytest.approx(1 / 3)  # warmup counts steps
    assert lr_multiplier(5000, cfg, 30.0) == 1.0  # steps past max_iters mean nothing: the budget's seconds do
    assert lr_multiplier(5, cfg, 35.0 + 0.65 * 50) == pytest.approx(floor + 0.5 * (1 - floor))
    assert lr_multiplier(5, cfg, 100.0) == pytest.approx(floor)
    cosine = build_config({"training": {"time_budget_s": 10.0}, "optimizer": {"warmup_iters": 0}})
    assert lr_multiplier(3, cosine, 5.0) == pytest.approx((1 + 0.1) / 2)


def spent(path) -> tuple[int, float]:
    state = torch.load(path, weights_only=True)
    return state["iter_num"], state["train_seconds"]


def test_a_time_budget_ends_training_and_a_resumed_run_has_what_was_left(tiny_data, tmp_path):
    """A real run under a 3 s budget: no step count (max_iters is no cap) and the warmdown ends at the budget, then
    the final evaluation; resumed from a checkpoint halfway, the run spends the budget left, not a new one."""
    budget = 3.0
    common = {"training.time_budget_s": budget, "optimizer.schedule": "wsd", "training.eval_interval": 0}
    overrides = tiny_overrides(
        tiny_data, tmp_path, **common, **{"training.save_interval": 50, "training.keep_last": 99}
    )
    del overrides["training.max_iters"]  # set beside the budget, it would cap it
    first = train(None, overrides=overrides)
    run = tmp_path / "t"
    iters, seconds = spent(run / "ckpt_last.pt")
    assert iters == first.iterations > 50 and budget - 0.5 < seconds < budget + 0.5
    history = json.loads((run / "train_log.json").read_text())["history"]
    rates = [r["lr"] for r in history if r["kind"] == "train"]
    assert rates[-1] < 0.1 * max(rates)  # the warmdown reached its end with the budget
    assert [r["iter"] for r in history if r["kind"] == "eval"] == [iters]  # the final evaluation (eval_interval 0)
    assert "max_iters = 1000000000" in (run / "config.toml").read_text()
    halfway = run / "ckpt_step0000050.pt"
    _, half = spent(halfway)
    assert 0 < half < budget
    train(None, resume=str(halfway), force=True)
    _, total = spent(run / "ckpt_last.pt")
    assert budget - 0.5 < total < budget + 0.5 and not math.isclose(total, half)


def test_polar_express_orthogonalises_closer_than_the_quintic_in_as_many_steps():
    from quillgpt.optim import POLAR_EXPRESS, QUINTIC, zeropower_via_newtonschulz

    G = torch.randn(4, 64, 160, generator=torch.Generator().manual_seed(0))
    spread = {}
    for name, coefficients in (("quintic", QUINTIC), ("polar", POLAR_EXPRESS)):
        sv = torch.linalg.svdvals(zeropower_via_newtonschulz(G, dtype=torch.float32, coefficients=coefficients))
        spread[name] = (sv.max() - sv.min()).item()
    assert spread["polar"] < 0.7 * spread["quintic"], spread


def test_normuon_evens_the_rows_of_an_update_and_keeps_its_norm():
    from quillgpt.optim import variance_reduced

    u = torch.randn(2, 8, 4) * torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 10.0]).view(1, 8, 1)  # one loud row (of 8)
    buffers = [torch.zeros(8, 1), torch.zeros(8, 1)]
    out = variance_reduced(u, buffers, 1.0)  # weight 1: the buffer is this step's mean square
    assert torch.allclose(out.norm(dim=(-2, -1)), u.norm(dim=(-2, -1)), rtol=1e-5)
    rows = out.square().mean(-1)
    assert torch.allclose(rows, rows.mean(-1, keepdim=True), rtol=1e-4)  # every row as loud as the others
    assert torch.allclose(buffers[0], u[0].square().mean(-1, keepdim=True))


SWITCHES = {
    "model.pos_emb": "rope",
    "model.norm": "rmsnorm",
    "model.mlp": "swiglu",
    "model.value_embeds": True,
    "model.backout": True,
    "model.smear": True,
    "optimizer.name": "muon",
    "optimizer.muon_coefficients": "polar_express",
    "optimizer.normuon": True,
    "training.batch_ramp_iters": 12,  # batch_size 4: 1 row at step 0, 4 from step 12 (past the resumed run's step 8)
    "training.batch_ramp_start": 1,
}


def test_a_run_with_every_switch_resumes_exactly(tiny_data, tmp_path):
    """Value embeddings, the skips, smear, Polar Express, NorMuon (its second moments in the checkpoint) and a batch
    ramp: stopped at step 8 and resumed, the losses equal a straight run's, exactly."""

    def losses(run) -> dict:
        history = json.loads((run / "train_log.json").read_text())["history"]
        return {r["iter"]: r["loss"] for r in history if r["kind"] == "train"}

    common = {**SWITCHES, "training.save_interval": 8, "optimizer.lr_decay_iters": 16}
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "straight", **common, **{"training.max_iters": 16}))
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "split", **common, **{"training.max_iters": 8}))
    state = torch.load(tmp_path / "split" / "t" / "ckpt_last.pt", weights_only=True)["optimizers"][0]["state"]
    assert all("second_momentum_buffer" in s for s in state.values())
    train(None, overrides={"training.max_iters": 16}, resume=str(tmp_path / "split" / "t"))
    assert losses(tmp_path / "straight" / "t") == losses(tmp_path / "split" / "t")


@pytest.mark.slow
@pytest.mark.xdist_group("compiled_step")
def test_a_compiled_run_with_every_switch_trains_as_the_eager_one(tiny_data, tmp_path):
    """torch.compile over value embeddings, the skips, smear, Polar Express, NorMuon and a batch ramp (micro-batches
    of 1, 1, 1, 1, 2 and 2 rows: shapes the compiled model meets one after the other): the same losses as the eager
    run, step for step, within fp32's rounding (inductor may fuse the arithmetic in another order)."""

    def losses(run) -> list[float]:
        history = json.loads((run / "train_log.json").read_text())["history"]
        return [r["loss"] for r in history if r["kind"] == "train"]

    common = {**SWITCHES, "training.max_iters": 6, "training.save_interval": 0, "model.dropout": 0.0}
    common["training.batch_ramp_iters"] = 8  # rows 1, 1, 1, 1, 2, 2 over the 6 steps
    for name, compiled in (("eager", False), ("compiled", True)):
        train(None, overrides=tiny_overrides(tiny_data, tmp_path / name, **common, **{"training.compile": compiled}))
    assert tomllib.loads((tmp_path / "compiled" / "t" / "config.toml").read_text())["training"]["compile"] is True
    eager, compiled = losses(tmp_path / "eager" / "t"), losses(tmp_path / "compiled" / "t")
    assert len(eager) == len(compiled) == 6
    assert compiled == pytest.approx(eager, rel=1e-4)
