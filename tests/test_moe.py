"""Mixture-of-experts layers (quillgpt/moe.py): routing as transformers routes, dispatch against a per-token loop,
the balancing losses and bias, and MoE models trained for real (resumed, compiled, on two ranks)."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import tiny_overrides
from torch.nn import functional as F

from model import GPT, MLP, GPTConfig, make_mlp
from quillgpt.config import ConfigError, build_config
from quillgpt.moe import MoE, moe_layers
from train import train

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, dropout=0.0, bias=False)


def moe_config(**kw) -> GPTConfig:
    return GPTConfig(**{**TINY, "n_experts": 4, "experts_per_token": 2, "expert_hidden": 24, **kw})


def seeded_layer(config: GPTConfig, seed: int = 0) -> MoE:
    """An MoE layer whose router is as large as the experts (N(0, 0.02) routes near-uniformly: every test would
    pass with any choice of experts)."""
    torch.manual_seed(seed)
    layer = make_mlp(config, 0)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    return layer


def train_log(run) -> list[dict]:
    return json.loads((run / "train_log.json").read_text())["history"]


# ---- routing as transformers routes -------------------------------------------------------------


def qwen3_moe_block(norm_topk_prob: bool, router: torch.Tensor | None = None, experts_per_token: int = 2):
    """transformers' Qwen3MoeSparseMoeBlock (4 experts of width 24 on 32 features), random weights; and our MoE
    with its weights: gate_up_proj (E, 2I, C) is w_gate and w_up stacked, down_proj (E, C, I) is w_down."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=norm_topk_prob,
        hidden_act="silu",
    )
    torch.manual_seed(0)
    theirs = Qwen3MoeSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
        if router is not None:
            theirs.gate.weight.copy_(router)
    ours = make_mlp(moe_config(mlp="swiglu", router_renormalize=norm_topk_prob, experts_per_token=experts_per_token), 0)
    ours.eval()
    gate, up = theirs.experts.gate_up_proj.detach().chunk(2, dim=1)  # (E, I, C) each
    state = {"router.weight": theirs.gate.weight, "w_gate": gate, "w_up": up, "w_down": theirs.experts.down_proj}
    ours.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return theirs, ours


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_output_matches_transformers_qwen3_moe_block(norm_topk_prob):
    theirs, ours = qwen3_moe_block(norm_topk_prob)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), atol=1e-5, rtol=0)
        _, weights, experts = theirs.gate(x.view(-1, 32))
        routing = ours.route(x.view(-1, 32))
    assert torch.equal(routing.experts, experts)
    assert torch.allclose(routing.weights, weights, atol=1e-6, rtol=0)


def test_a_tie_between_experts_breaks_as_transformers_breaks_it():
    """Experts 1 and 2 have the same router row, larger than the others': every token's probabilities tie between
    them, and top-1 picks the one transformers picks (torch.topk's choice on the same fp32 probabilities)."""
    torch.manual_seed(1)
    router = torch.randn(4, 32) * 0.1
    router[1] = router[2] = torch.randn(32).abs() * 2
    theirs, ours = qwen3_moe_block(norm_topk_prob=False, router=router, experts_per_token=1)
    x = torch.rand(2, 5, 32)  # positive: the tied experts score highest for every token
    with torch.no_grad():
        _, _, their_experts = theirs.gate(x.view(-1, 32))
        routing = ours.route(x.view(-1, 32))
        assert torch.equal(routing.probs[:, 1], routing.probs[:, 2])  # a true tie
        assert torch.allclose(ours(x), theirs(x), atol=1e-5, rtol=0)
    assert torch.equal(routing.experts, their_experts)
    assert set(routing.experts.flatten().tolist()) == {1}  # the lower index, as torch.topk breaks it here


# ---- dispatch against a per-token loop ------------------------------------------------------------


def per_token_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token and expert by expert, as the definition reads."""
    out = []
    for token in x.reshape(-1, x.size(-1)):
        probs = F.softmax(layer.router(token).float(), dim=-1)
        scores = probs if layer.router_bias is None else probs + layer.router_bias
        chosen = torch.topk(scores, layer.k).indices
        weights = probs[chosen] / (probs[chosen].sum() if layer.renormalize else 1.0)
        y = torch.zeros_like(token)
        for e, w in zip(chosen.tolist(), weights):
            up = layer.w_up[e] @ token
            h = layer.act(layer.w_gate[e] @ token) * up if hasattr(layer, "w_gate") else layer.act(up)
            y = y + w * (layer.w_down[e] @ h)
        out.append(y + (layer.shared(token) if layer.shared is not None else 0.0))
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("swiglu", {"shared_experts": 1}),
        ("geglu", {"router_renormalize": False}),
        ("gelu", {"experts_per_token": 3, "balance": "bias"}),
        ("relu2", {"experts_per_token": 1, "router_renormalize": False}),
    ],
)
def test_dispatch_equals_a_per_token_loop_forward_and_backward(kind, extra):
    layer = seeded_layer(moe_config(mlp=kind, **extra))
    if layer.router_bias is not None:
        layer.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # moves the choice, not the weights
    x = torch.randn(2, 9, 32, requires_grad=True)
    ours = layer(x)
    grads = torch.autograd.grad(ours.square().sum(), [x, *layer.parameters()])
    reference = per_token_reference(layer, x)
    expected = torch.autograd.grad(reference.square().sum(), [x, *layer.parameters()])
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_grouped_mm_path_equals_the_loop():
    """The CUDA path's torch._grouped_mm (which has a CPU kernel in this torch) and the loop over experts: same
    routing and sort, same outputs and gradients, in fp32 and in bf16 under autocast."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    layer = seeded_layer(moe_config(mlp="swiglu"))
    x = torch.randn(2, 9, 32)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        results = []
        for grouped in (False, True):
            layer.grouped_mm = grouped
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = layer(x)
            results.append((y, *torch.autograd.grad(y.float().square().sum(), [layer.w_up, layer.w_down])))
        assert y.dtype == torch.float32  # back in the residual stream's dtype
        for loop, grouped in zip(*results):
            assert torch.allclose(loop, grouped, atol=tol, rtol=tol)
    layer.grouped_mm = None


def test_dense_layers_come_first_and_the_block_holds_either():
    model = GPT(moe_config(n_layer=3, dense_layers=1, shared_experts=2, mlp="swiglu"))
    kinds = [type(block.mlp) for block in model.transformer.h]
    assert kinds == [MLP, MoE, MoE]
    layer = model.transformer.h[1].mlp
    assert dict((n, tuple(p.shape)) for n, p in layer.named_parameters() if not n.startswith("shared")) == {
        "router.weight": (4, 32),
        "w_gate": (4, 24, 32),
        "w_up": (4, 24, 32),
        "w_down": (4, 32, 24),
    }
    assert layer.shared.c_fc.weight.shape == (2 * 24, 32)  # shared_experts x the expert width
    assert "transformer.h.1.mlp.router_bias" not in model.state_dict()  # only balance = bias has one
    biased = GPT(moe_config(balance="bias"))
    assert biased.state_dict()["transformer.h.0.mlp.router_bias"].shape == (4,)
    gelu = make_mlp(moe_config(mlp="gelu", expert_hidden=None), 0)
    assert not hasattr(gelu, "w_gate") and gelu.w_up.shape == (4, 4 * 32, 32)  # the dense MLP's width rule


# ---- balancing --------------------------------------------------------------------------------------


def test_aux_loss_is_transformers_load_balancing_loss_and_z_loss_its_formula():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layer = seeded_layer(moe_config(aux_loss_coef=0.02, router_z_loss_coef=0.003))
    x = torch.randn(3, 8, 32)
    layer(x)
    logits = layer.router(x.view(-1, 32)).detach()
    expected = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    assert layer.aux_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    z = torch.logsumexp(logits, dim=-1).square().mean()
    assert layer.z_loss.item() == pytest.approx(z.item(), rel=1e-6)
    assert layer.router_loss.item() == pytest.approx(0.02 * expected.item() + 0.003 * z.item(), rel=1e-6)
    assert layer.load.sum().item() == 3 * 8 * 2 and layer.load.shape == (4,)
    layer.balance = "bias"  # the aux loss is then reported, not trained on
    layer(x)
    assert layer.router_loss.item() == pytest.approx(0.003 * z.item(), rel=1e-6)


def test_training_loss_adds_the_router_losses_and_evaluation_leaves_them_out():
    torch.manual_seed(0)
    model = GPT(moe_config(aux_loss_coef=0.5, router_z_loss_coef=0.1))
    x, y = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    _, training = model.train()(x, y)
    router = sum(m.router_loss for m in moe_layers(model))
    _, evaluated = model.eval()(x, y)
    assert training.item() == pytest.approx(evaluated.item() + router.item(), rel=1e-6)
    model.train().loss_chunks = 2  # the chunked training loss adds them too
    assert model(x, y)[1].item() == pytest.approx(training.item(), rel=1e-5)


def skewed_router_loads(data_dir, out_dir, rate: float, steps: int = 30) -> list[float]:
    """expert_load of each of `steps` real training steps (trainer.train_step) of a one-layer MoE whose router is as
    large as a trained one's and whose bias starts at 0.5 for expert 0: every token chooses it first."""
    from quillgpt.data import find_dataset
    from quillgpt.distributed import DistInfo
    from quillgpt.trainer import build_trainer, setup, train_step

    over = {
        "model.n_experts": 4,
        "model.n_layer": 1,
        "model.dropout": 0.0,
        "model.balance": "bias",
        "model.bias_update_rate": rate,
        "training.batch_size": 16,
    }
    cfg = build_config({}, list(tiny_overrides(data_dir, out_dir, **over).items()))
    tr = build_trainer(cfg, setup(cfg, DistInfo()), find_dataset(cfg, DistInfo()))
    (layer,) = moe_layers(tr.raw_model)
    with torch.no_grad():
        torch.manual_seed(0)
        layer.router.weight.normal_(0, 1.0)
        layer.router_bias[0] = 0.5
    loads = []
    for it in range(steps):
        train_step(tr, it)
        loads.append(tr.objective.routing.figures()["expert_load"])
    return loads


def test_the_bias_brings_a_skewed_router_toward_balance_over_real_steps(tiny_data, tmp_path):
    """DeepSeek-V3's update after each step, from the step's loads, against the same run with the bias frozen:
    expert 0 then gets every token at every step (max/mean = E/k = 2); with it, the load evens out."""
    frozen = skewed_router_loads(tiny_data, tmp_path / "frozen", rate=0.0)
    moving = skewed_router_loads(tiny_data, tmp_path / "moving", rate=0.02)
    assert frozen == [2.0] * 30 and moving[0] == 2.0
    assert sum(moving[10:]) / 20 < 1.7 and min(moving) < 1.4


# ---- training for real ------------------------------------------------------------------------------

MOE_RUN = {
    "model.n_experts": 4,
    "model.experts_per_token": 2,
    "model.mlp": "swiglu",
    "model.shared_experts": 1,
    "model.balance": "bias",
    "model.bias_update_rate": 0.01,  # large enough that the biases differ from 0 when the run is split
    "training.grad_accum_steps": 2,
    "optimizer.lr_decay_iters": 16,
    "training.save_interval": 8,
    "training.eval_interval": 8,
}


def test_an_moe_trains_logs_its_balance_and_resumes_exactly(tiny_data, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(None, overrides=tiny_overrides(tiny_data, straight, **MOE_RUN, **{"training.max_iters": 16}))
    train(None, overrides=tiny_overrides(tiny_data, split, **MOE_RUN, **{"training.max_iters": 8}))
    train(None, overrides={"training.max_iters": 16, "logging.plot": True}, resume=str(split / "t"))
    a, b = train_log(straight / "t"), train_log(split / "t")
    fields = ("loss", "expert_load", "aux_loss", "z_loss")
    steps = [[p[k] for k in fields] for p in a if p["kind"] == "train"]
    assert steps == [[p[k] for k in fields] for p in b if p["kind"] == "train"]  # exact, biases restored
    assert len(steps) == 16 and all(1.0 <= load <= 2.0 and aux > 0 and z > 0 for _, load, aux, z in steps)
    evals = [p["val_loss"] for p in a if p["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.3  # it learns
    ckpt = torch.load(split / "t" / "ckpt_last.pt", weights_only=False)
    bias = ckpt["model"]["transformer.h.0.mlp.router_bias"]
    assert bias.abs().sum() > 0 and ckpt["model_args"]["n_experts"] == 4
    assert (split / "t" / "router_balance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_compiled_moe_trains_as_the_eager_one(tiny_data, tmp_path):
    """torch.compile with the loop over experts as one opaque op: no graph break, the eager run's losses."""
    over = {"model.n_experts": 4, "model.n_layer": 1, "training.max_iters": 4, "model.dropout": 0.0}
    runs = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        train(None, overrides=tiny_overrides(tiny_data, out, **over, **{"training.compile": compiled}))
        runs[compiled] = [(p["loss"], p["expert_load"]) for p in train_log(out / "t") if p["kind"] == "train"]
    for (eager, eager_load), (compiled, compiled_load) in zip(runs[False], runs[True]):
        assert compiled == pytest.approx(eager, rel=1e-4) and compiled_load == eager_load


def test_gradient_checkpointing_and_bf16_autocast_keep_the_layer_working():
    torch.manual_seed(0)
    model = GPT(moe_config())
    x, y = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = checkpointed
        loss = model(x, y)[1]
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x, y)[1].item() == pytest.approx(loss.item(), rel=2e-2)


def test_muon_steps_each_experts_matrix():
    from quillgpt.config import OptimizerConfig
    from quillgpt.optim import make_optimizers

    torch.manual_seed(0)
    model = GPT(moe_config(n_layer=1))
    muon, _ = make_optimizers(model, OptimizerConfig(name="muon"), "cpu", torch.float32)
    layer = model.transformer.h[0].mlp
    before = layer.w_up.detach().clone()
    model(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))[1].backward()
    muon.step()
    change = (layer.w_up.detach() - before).flatten(1)  # (E, H*C): each expert's update, orthogonalised alone
    assert all(0 < c.norm() < 1 for c in change)


# ---- accounting and config ------------------------------------------------------------------------


def test_flops_count_the_active_experts_and_memory_all_of_them():
    """8 experts of width 64, top-2, against a dense MLP of width 128: the same FLOPs but for the router's."""
    moe = GPT(moe_config(n_experts=8, experts_per_token=2, expert_hidden=64, mlp="gelu"))
    dense = GPT(GPTConfig(**TINY, mlp="gelu", mlp_hidden=128))
    router = 2 * 8 * 32  # two layers of (E, C)
    assert moe.active_params() == dense.num_params() + router
    assert moe.flops_per_token() == dense.flops_per_token() + 6 * router
    assert moe.num_params() == dense.num_params() + router + 2 * 6 * (2 * 64 * 32)  # six more experts per layer
    assert dense.active_params() == dense.num_params()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"model.experts_per_token": 5}, "model.experts_per_token = 5 must be in [1, n_experts = 4]"),
        ({"model.dense_layers": 2}, "model.dense_layers = 2 must be in [0, n_layer = 2)"),
        ({"model.aux_loss_coef": -0.1}, "model.aux_loss_coef = -0.1 must be >= 0"),
        ({"model.expert_hidden": 0}, "model.expert_hidden = 0 must be positive"),
    ],
)
def test_a_bad_moe_config_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_config({}, list({"model.n_experts": 4, "model.n_layer": 2, **override}.items()))


def test_a_dense_model_is_unchanged():
    """No MoE layer, no router loss: the training loss is the cross-entropy, as before the switch existed."""
    torch.manual_seed(0)
    model = GPT(replace(moe_config(), n_experts=0))
    assert not moe_layers(model) and model.router_loss() == 0.0


@pytest.mark.slow
def test_two_ranks_route_and_balance_as_one_rank_with_accumulation_under_ddp_and_fsdp(tiny_data, tmp_path):
    """DDP and FSDP (2 gloo ranks) against 1 rank x 2 micro-steps: the same micro-batches, the loads summed over
    the ranks, so the same biases (every rank moves its own copy alike), losses and balance figures."""
    from test_distributed import assert_same, log, torchrun

    over = tiny_overrides(tiny_data, tmp_path / "single", **{**MOE_RUN, "model.dropout": 0.0})
    single = tmp_path / "single" / "t"
    train(None, overrides=over)
    for name, fsdp in (("ddp", False), ("fsdp", True)):
        ranks = {**over, "run.out_dir": str(tmp_path / name), "training.grad_accum_steps": 1}
        torchrun(*[f"--{k}={v}" for k, v in ranks.items()], "--distributed.fsdp", str(fsdp).lower())
        for key in ("loss", "expert_load", "aux_loss", "z_loss"):
            assert_same(log(tmp_path / name / "t", key=key), log(single, key=key), tol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("experts", [0, 16])
def test_the_memory_estimate_holds_what_a_training_step_keeps_for_its_backward(precision, experts):
    """--validate's activation terms (feasibility.memory_estimate: activations, logits, an MoE's routed copies) are
    at least the bytes a real forward pass saves for its backward, read off autograd's saved tensors (the weights left out),
    with the autocast copies' term, for a dense model and a 16-expert one alike."""
    from quillgpt.config import Config
    from quillgpt.feasibility import memory_estimate

    # short rows, 4 of 16 experts a token: the routed copies are most of what a layer keeps
    extra = dict(n_experts=16, experts_per_token=4, expert_hidden=128) if experts else dict(mlp_hidden=512)
    model_cfg = GPTConfig(block_size=16, vocab_size=100, n_layer=2, n_head=4, n_embd=128, bias=False, **extra)
    cfg = Config()
    cfg.model, cfg.training.batch_size = model_cfg, 8
    torch.manual_seed(0)
    model = GPT(model_cfg).train()
    x = torch.randint(0, 100, (8, 16))
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, x)[1].backward()
    weights = {p.data_ptr() for p in model.parameters()}
    kept = sum(n for (ptr, _, _), n in saved.items() if ptr not in weights)  # the autocast casts are not weights
    est = memory_estimate(cfg, model, precision, 1)
    assert est["activations"] + est["logits"] + est.get("routed", 0.0) + est["autocast copies"] >= kept
