"""quillgpt/decoding_kernels.py and the decoding plan (quillgpt.generate.plan_decoding): each product kernel against
F.linear and F.gelu, swapped into a loaded model with its state dict as it was, and the plan that decides them,
once, from measurements kept per machine (a corrupt or planted file is measured again or read as it says), shown
with its reasons."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT
from test_sample import write_char_checkpoint

from model import GPT, GPTConfig
from quillgpt import decoding_kernels as dk
from quillgpt.decoding_kernels import DecodingLinear, small_gelu, use_decoding_kernels
from quillgpt.generate import load_for_sampling, plan_decoding


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def ops(call) -> tuple[torch.Tensor, set[str]]:
    with torch.profiler.profile() as prof:
        out = call()
    return out, {e.key for e in prof.key_averages()}


def test_a_few_fp32_rows_through_a_split_linear_are_one_batched_matmul_of_its_row_blocks(two_threads):
    """A DecodingLinear with 2 parts runs a few fp32 rows (a decoding row, a batch's 15) as one bmm of the weight's
    row blocks, to fp32 rounding of F.linear; 17 rows, or autograd on, are F.linear itself."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(1536, 384)), torch.nn.Parameter(torch.randn(1536))
    assert dk.split_parts(weight, True) == 2 and dk.split_parts(weight, False) == 1
    assert dk.split_parts(weight[:64, :64].contiguous(), True) == 1  # a small weight: not worth it
    layer = DecodingLinear(weight, bias, 2)
    with torch.no_grad():
        for rows in (torch.randn(1, 1, 384), torch.randn(3, 5, 384)):
            got, ran = ops(lambda rows=rows: layer(rows))
            assert "aten::bmm" in ran and got.shape == (*rows.shape[:-1], 1536)
            assert torch.allclose(got, F.linear(rows, weight, bias), rtol=1e-5, atol=1e-4)
        many = torch.randn(17, 384)
        got, ran = ops(lambda: layer(many))
        assert "aten::bmm" not in ran and torch.equal(got, F.linear(many, weight, bias))
    x = torch.randn(1, 1, 384, requires_grad=True)
    (grad,) = torch.autograd.grad(layer(x).sum(), x)
    assert torch.allclose(grad, weight.detach().sum(0).view(1, 1, -1), atol=1e-4)


def test_an_exported_step_splits_bf16_products_too_and_eager_bf16_takes_pytorchs_kernel(monkeypatch, two_threads):
    """In a graph being compiled a row's bf16 product splits as fp32's does (inductor writes split products as its
    own loops); eager, a bf16 row or two run F.linear with oneDNN off (it reorders the weight every call), to the
    bit, and the global switch ends as it began; four rows keep oneDNN."""
    weight = torch.nn.Parameter(torch.randn(1536, 384, dtype=torch.bfloat16))
    row = torch.randn(1, 1, 384, dtype=torch.bfloat16)
    for parts in (2, 1):
        layer = DecodingLinear(weight, None, parts).eval()
        with torch.no_grad():
            graph = torch.export.export(layer, (row,), strict=False).graph
        assert ("aten.bmm.default" in {str(n.target) for n in graph.nodes}) == (parts == 2)
    calls, plain = [], F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(torch.backends.mkldnn.enabled) or plain(*a))
    layer = DecodingLinear(weight, None, 2)
    with torch.no_grad():
        for rows, onednn in (
            (row, False),
            (torch.randn(2, 1, 384, dtype=torch.bfloat16), False),
            (row.repeat(4, 1, 1), True),
        ):
            calls.clear()
            out = layer(rows)
            assert calls == [onednn] and torch.backends.mkldnn.enabled
            with torch.backends.mkldnn.flags(enabled=False):
                assert torch.equal(out, plain(rows, weight)) or onednn
    calls.clear()
    layer(row.clone().requires_grad_())
    assert calls == [True]  # autograd: F.linear as it is


def test_gelu_of_a_few_rows_runs_pytorchs_kernel_and_leaves_onednn_as_it_found_it():
    """small_gelu is F.gelu; a decoding step's few rows get PyTorch's own kernel (F.gelu with oneDNN off, bit for
    bit), a training batch's and the tanh form stay F.gelu, and the global switch ends as it began, on or off."""
    torch.manual_seed(0)
    row, batch = torch.randn(1, 1, 1536) * 3, torch.randn(64, 1536) * 3
    assert dk.ONEDNN_GELU_FROM > row.numel() and dk.ONEDNN_GELU_FROM <= batch.numel()
    with torch.backends.mkldnn.flags(enabled=False):
        native_row = F.gelu(row)
        assert torch.equal(small_gelu(row), native_row) and not torch.backends.mkldnn.enabled
    assert torch.equal(small_gelu(row), native_row) and torch.backends.mkldnn.enabled
    assert torch.equal(small_gelu(batch), F.gelu(batch))
    assert torch.equal(small_gelu(row, approximate="tanh"), F.gelu(row, approximate="tanh"))
    assert torch.allclose(small_gelu(row), F.gelu(row), rtol=0, atol=1e-5)


def test_swapping_the_decoding_kernels_in_keeps_the_state_dict_and_the_logits(two_threads):
    """use_decoding_kernels turns a loaded model's nn.Linear maps into DecodingLinears over the same parameters
    (state-dict names unchanged, the tied head still the embedding) and its exact GELUs into small_gelu, and says
    what it swapped; a decoding row's logits stay F.linear's to fp32 rounding."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_embd=256)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        want = model(x)[0]
        done = use_decoding_kernels(model, split_pays=True)
        got = model(x)[0]
    assert list(model.state_dict()) == list(before) and all(
        torch.equal(model.state_dict()[k], v) for k, v in before.items()
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.transformer.h[0].mlp.act is small_gelu
    assert any("split in 2 row blocks" in line for line in done) and any("GELU" in line for line in done)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_split_is_measured_once_per_machine_kept_and_a_bad_kept_value_measured_again(tmp_path):
    """split_speedup measures, keeps the ratio under the machine's key and says so; a later process reads it
    (a planted one each way decides the plan as it says), and a kept value that is no ratio (NaN, negative) or a
    file that is not JSON is measured again, never trusted."""
    env = {**os.environ, "QUILLGPT_CACHE": str(tmp_path)}
    code = "from quillgpt import decoding_kernels as d, precision; v, w = d.split_speedup(); print(v, precision.machine_key()); print(w)"

    def run() -> tuple[float, str, str]:
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
        )
        first, where = out.stdout.splitlines()
        value, key = first.split(" ", 1)
        return float(value), key, where

    measured, key, where = run()
    kept_file = tmp_path / "split_linear.json"
    assert where.startswith("measured now") and json.loads(kept_file.read_text()) == {key: measured}
    for planted in (9.0, 0.5):
        kept_file.write_text(json.dumps({key: planted}))
        assert run()[0] == planted and run()[2].startswith("kept in")
    for bad in (json.dumps({key: float("nan")}), json.dumps({key: -1.0}), "{not json"):
        kept_file.write_text(bad)
        value, _, where = run()
        assert where.startswith("measured now") and value >= 0 and json.loads(kept_file.read_text()) == {key: value}


def test_the_plan_says_each_choice_and_why_fresh_kept_and_corrupt(tmp_path, monkeypatch):
    """load_for_sampling's plan names the precision (flag or kept measurement, and its file), the step (eager, or
    the kept package's path) and the products swapped in. A measurements file that is corrupt is measured again
    (and says so); a forced dtype says --dtype."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", n_embd=64, n_head=4)
    _, _, fresh = load_for_sampling(ckpt, "cpu", "auto")
    assert fresh.step == "eager" and "no compiled step kept" in fresh.step_why
    assert "measured now, kept in" in fresh.precision_why and fresh.describe().startswith("[decoding plan | precision:")
    _, _, again = load_for_sampling(ckpt, "cpu", "auto")
    assert "; kept in" in again.precision_why and "measured now" not in again.precision_why
    (tmp_path / "cache" / "bf16_decoding_speedup.json").write_text("{damaged")
    _, _, corrupt = load_for_sampling(ckpt, "cpu", "auto")
    assert "measured now" in corrupt.precision_why
    _, _, forced = load_for_sampling(ckpt, "cpu", "bf16", compile=False)
    assert forced.precision == "bf16" and forced.precision_why == "--dtype" and forced.step_why == "--no-compile"
    assert any("bf16/fp16 linear maps by PyTorch's kernel" in line for line in forced.products)
    model, plan = plan_decoding(
        GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8)), torch.device("cpu"), "int8"
    )
    assert plan.precision.startswith("int8 (") and "--dtype int8" in plan.precision_why
