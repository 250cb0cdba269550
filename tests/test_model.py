"""model.py and kernels.py: shapes, causality, initialisation, the model left plain (no decoding code, no global torch
state at import), and the CPU training kernels swapped in against their PyTorch definitions. Decoding is
test_decoding.py's, its kernels test_decoding_kernels.py's."""

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT, uncached_greedy

from model import GPT, GPTConfig
from quillgpt import kernels
from quillgpt.engine import generate
from quillgpt.kernels import CPUCausalAttention, Dropout, causal_softmax, cpu_keep_mask, use_cpu_training_kernels

MODERN = dict(
    pos_emb="rope",
    norm="rmsnorm",
    qk_norm=True,
    mlp="swiglu",
    tie_embeddings=False,
    logit_softcap=15.0,
    zero_init_proj=False,
)
VARIANTS = [dict(), dict(bias=False, mlp="relu2"), MODERN]


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    args = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**{**args, **kw}))


@pytest.mark.parametrize("kw", VARIANTS)
def test_forward_gives_logits_per_position_and_a_near_uniform_loss(kw):
    """(B, T, vocab) logits, a scalar loss near ln(vocab) untrained; last_only: the last position and no loss."""
    model = tiny(**kw)
    x = torch.randint(0, 50, (3, 20))
    logits, loss = model(x, x)
    assert logits.shape == (3, 20, 50)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    # an untrained model predicts roughly uniformly
    assert abs(loss.item() - math.log(50)) < 0.5
    logits, loss = model(x, last_only=True)
    assert logits.shape == (3, 1, 50) and loss is None


@pytest.mark.parametrize("kw", VARIANTS)
def test_a_later_token_never_changes_the_logits_of_earlier_positions(kw):
    """Changing a later token never changes the logits of earlier positions."""
    model = tiny(**kw).eval()
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 7) % 50
    lx, _ = model(x)
    ly, _ = model(y)
    torch.testing.assert_close(lx[:, :10], ly[:, :10])
    assert not torch.allclose(lx[:, 10:], ly[:, 10:])


def test_init_scales_projections_like_gpt2_and_ties_embeddings_by_default():
    """Weights of std 0.02, residual projections 0.02 / sqrt(2 n_layer); lm_head is wte unless tie_embeddings is off."""
    model = tiny(n_layer=4)
    assert model.lm_head.weight is model.transformer.wte.weight
    proj = model.transformer.h[0].attn.c_proj.weight
    fc = model.transformer.h[0].mlp.c_fc.weight
    assert abs(fc.std().item() - 0.02) < 0.003
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.002
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() > tiny().num_params()


def test_zero_init_proj_zeroes_the_projections_and_the_untied_head():
    model = tiny(zero_init_proj=True, tie_embeddings=False)
    assert model.transformer.h[0].attn.c_proj.weight.abs().sum() == 0
    assert model.lm_head.weight.abs().sum() == 0


@pytest.mark.parametrize("kw", VARIANTS)
def test_the_engines_greedy_tokens_are_the_uncached_forward_passes(kw):
    model = tiny(**kw).eval()
    prompt = torch.randint(0, 50, (2, 5))
    cached = generate(model, prompt, 20, temperature=0)
    assert cached.shape == (2, 25) and torch.equal(cached, uncached_greedy(model, prompt, 20))


def test_the_model_is_plain_torch_and_importing_it_changes_no_global_state():
    """model.py's layers are torch's own (nn.Linear, nn.Dropout, SDPA), and importing it (or building a model)
    leaves torch's global state alone: no compile-cache tag, no custom op; the CPU training kernels are swapped into
    a built model (use_cpu_training_kernels) and then tag the caches."""
    code = (
        "import torch; before = torch.compiler.config.cache_key_tag\n"
        "import model\n"
        "m = model.GPT(model.GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8))\n"
        "print(torch.compiler.config.cache_key_tag == before, hasattr(torch.ops, 'quill') and hasattr(torch.ops.quill, 'keep_mask'))\n"
        "print(sorted({type(x).__module__ for x in m.modules()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    unchanged, modules = out.stdout.splitlines()
    assert unchanged == "True False"
    assert all(m == "model" or m.startswith("torch.nn.modules.") for m in eval(modules)), modules


def test_flops_per_token_exceed_6n_and_mfu_divides_by_the_peak():
    model = tiny()
    n = model.num_params()
    assert model.flops_per_token() > 6 * n
    assert model.estimate_mfu(1000.0, model.flops_per_token() * 2000.0) == pytest.approx(0.5)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradient_checkpointing_gives_the_same_gradients(dropout):
    """With dropout too: the recomputed forward must redraw the same masks (CPU dropout draws from torch's RNG)."""
    x = torch.randint(0, 50, (2, 16))
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = tiny(dropout=dropout)
        model.gradient_checkpointing = ckpt
        _, loss = model(x, x)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_default_cpu_peak_knows_zen4_half_width_avx512_and_intel_amx():
    """MFU's default CPU peak: Zen 4 (AMD family 25) executes AVX-512 on 256-bit units, so half of Intel's; with AMX
    tiles (flag amx_bf16), bf16 runs at 1,024 FLOPs per cycle and core, where the vector units' 128 would make a
    step's MFU read several times the truth."""
    from quillgpt.metrics import default_peak_flops, has_amx_bf16, is_amd_zen4, read_cpuinfo

    zen4 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: avx512f avx512_bf16\n"
    )
    zen5 = zen4.replace(": 25", ": 26")
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
    sapphire_rapids = intel + "flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    assert is_amd_zen4(zen4) and not is_amd_zen4(zen5) and not is_amd_zen4(intel) and not is_amd_zen4("")
    assert has_amx_bf16(sapphire_rapids) and not has_amx_bf16(zen4) and not has_amx_bf16(intel + "flags\t: amx_tile\n")
    from quillgpt.metrics import cpu_clock_hz, cpu_flag_set

    cpu, here = torch.device("cpu"), read_cpuinfo()
    clock = cpu_clock_hz(here)
    assert clock >= 3.0e9
    per_cycle = default_peak_flops(cpu, "fp32")[0] / torch.get_num_threads() / clock
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert per_cycle == (64 if avx512 and not is_amd_zen4(here) else 32)
    bf16_per_cycle = default_peak_flops(cpu, "bf16")[0] / torch.get_num_threads() / clock
    native = 2 * per_cycle if "avx512_bf16" in cpu_flag_set(here) else per_cycle  # emulated: fp32's at best
    assert bf16_per_cycle == (1024 if has_amx_bf16(here) else native)


def test_cpu_bf16_attention_matches_flash_gradients():
    """The CPU bf16 training path (flash forward, matmul backward) that bench.py times computes true gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(2, 3, 40, 16, dtype=torch.bfloat16)
    exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    want = torch.autograd.grad(exact, (q, k, v), dy.float())
    got = torch.autograd.grad(CPUCausalAttention.apply(q, k, v), (q, k, v), dy)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert (g.float() - w).abs().max() <= 0.01 * w.abs().max()  # bf16 rounding of the result
    # the model takes this path when training under bf16 autocast on the CPU, and learns
    model = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(0, 20, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, x)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_cpu_dropout_mask_has_the_asked_rate_and_keeps_expectations():
    """cpu_keep_mask, the fast dropout mask of CPU training: drops p of the elements, scale undoes it on average."""
    torch.manual_seed(0)
    for p in (0.1, 0.2, 0.5):
        keep, scale = cpu_keep_mask(torch.empty(4, 1000, 1001, dtype=torch.bfloat16), p)  # odd count
        assert keep.shape == (4, 1000, 1001) and keep.dtype == torch.bfloat16
        assert set(keep.unique().tolist()) == {0.0, 1.0}
        assert abs(1 - keep.float().mean().item() - p) < 0.002
        assert abs(scale - 1 / (1 - p)) < 1e-4
    a, _ = cpu_keep_mask(torch.empty(64, 64), 0.2)
    b, _ = cpu_keep_mask(torch.empty(64, 64), 0.2)
    assert not torch.equal(a, b)  # consecutive draws differ
    torch.manual_seed(1)
    c, _ = cpu_keep_mask(torch.empty(64, 64), 0.2)
    torch.manual_seed(1)
    assert torch.equal(c, cpu_keep_mask(torch.empty(64, 64), 0.2)[0])  # seeded: reproducible
    for dtype in (torch.bfloat16, torch.float16):  # built from 1.0's bit pattern in int16: float32's mask, exactly
        torch.manual_seed(2)
        want, _ = cpu_keep_mask(torch.empty(3, 777), 0.2)
        torch.manual_seed(2)
        got, _ = cpu_keep_mask(torch.empty(3, 777, dtype=dtype), 0.2)
        assert got.dtype == dtype and torch.equal(got.float(), want)


def test_compiled_dropout_draws_a_mask_per_call_and_replays_eager():
    """Under torch.compile our mask is an opaque op (quill::keep_mask): two dropouts of same-shape tensors
    get two masks (the compiler's common-subexpression pass once merged them into one), drawn in eager's
    order from the same generator, with eager's gradients."""
    d1, d2 = Dropout(0.5), Dropout(0.5)

    def f(x, y):
        return d1(x) * 3, d2(y)

    x, y = (torch.ones(16, 32, requires_grad=True) for _ in range(2))
    torch.manual_seed(3)
    a, b = torch.compile(f, backend="aot_eager")(x, y)
    assert not torch.equal(a / 3, b)
    torch.manual_seed(3)
    ea, eb = f(x, y)
    assert torch.equal(a, ea) and torch.equal(b, eb)
    gx, gy = torch.autograd.grad((a + b).sum(), (x, y))
    assert torch.equal(gx, a.detach()) and torch.equal(gy, b.detach())  # x * mask * scale: the gradient is the output


def test_causal_softmax_op_is_masked_softmax_with_its_gradients():
    """quill::causal_softmax (PyTorch's matmul and softmax kernels, kept whole under torch.compile) gives the
    masked softmax of the scaled scores and its gradients; opcheck checks its fake and autograd registrations."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    got = causal_softmax(q, k)
    want = (
        ((q @ k.transpose(-2, -1)) / 2.0)
        .masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        .softmax(-1)
    )
    assert torch.allclose(got, want) and (got.triu(1) == 0).all()
    w = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k)), torch.autograd.grad((want * w).sum(), (q, k))):
        assert torch.allclose(a, b)
    torch.library.opcheck(causal_softmax, (q, k))


def test_compile_caches_are_keyed_by_the_kernels_source():
    """torch.compile's on-disk caches do not see a custom op's registered backward (pytorch/pytorch#144344: an edited
    backward kept running the old compiled one, from another process's cache); swapping kernels.py's kernels into a
    model tags every cache key with the file's hash, once however often it is done."""
    digest = hashlib.sha256(Path(kernels.__file__).read_bytes()).hexdigest()[:16]
    for _ in range(2):
        use_cpu_training_kernels(tiny())
    assert f"quill-kernels-{digest}" in torch.compiler.config.cache_key_tag.split("+")
    assert torch.compiler.config.cache_key_tag.count("quill-kernels-") == 1


def test_cpu_dropout_layer_and_attention_match_their_definitions():
    """CPU training swaps our dropout mask into the residual/embedding Dropout and attention (use_cpu_training_kernels):
    the outputs and gradients are dropout's (the same mask, replayed from the same seed)."""
    x = torch.randn(3, 7, 10, requires_grad=True)
    drop = Dropout(0.3)
    torch.manual_seed(5)
    y = drop(x)
    torch.manual_seed(5)
    keep, scale = cpu_keep_mask(x, 0.3)
    assert torch.equal(y, x * keep * scale) and 0.2 < (y == 0).float().mean() < 0.4
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(gx, keep * scale)
    assert torch.equal(drop.eval()(x), x)

    model = GPT(GPTConfig(block_size=12, vocab_size=11, n_layer=1, n_head=2, n_embd=8, dropout=0.25, bias=False))
    use_cpu_training_kernels(model)
    attn = model.transformer.h[0].attn
    assert type(attn.resid_dropout) is Dropout and type(model.transformer.drop) is Dropout
    h = torch.randn(2, 12, 8, requires_grad=True)
    torch.manual_seed(9)
    got = attn(h, None, None)
    # the same computation by hand: SDPA's math path with the mask drawn at the same RNG position
    torch.manual_seed(9)
    q, k, v = attn.c_attn(h).split(8, dim=2)
    q, k, v = (t.view(2, 12, 2, 4).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    probs = (
        ((q @ k.transpose(-2, -1)) / 2.0)
        .masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
        .softmax(-1)
    )
    keep, scale = cpu_keep_mask(probs, 0.25)
    out = ((probs * keep * scale) @ v).transpose(1, 2).reshape(2, 12, 8)
    keep2, scale2 = cpu_keep_mask(out, 0.25)
    want = attn.c_proj(out) * keep2 * scale2
    assert torch.allclose(got, want, atol=1e-6)
    g_got, g_want = (torch.autograd.grad(t.square().sum(), h)[0] for t in (got, want))
    assert torch.allclose(g_got, g_want, atol=1e-5)
    # about p of the attention probabilities are dropped: rows of the output differ from no-dropout's
    assert not torch.allclose(
        got, attn.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 12, 8))
    )
