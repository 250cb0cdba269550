"""The CUDA paths run for real: `python -m pytest -m cuda` on a machine with an NVIDIA GPU (`python bench.py --gpu`
runs it and records the counts). Without CUDA every test here skips; the CPU tests check the same paths as far as a
CPU can (docs/training.md, "On a GPU").

Each test is a real run of the tiny char model of the CPU tests (tests/conftest.py), moved to the GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, tiny_overrides, uncached_greedy
from test_step_sync import nan_gradient_once

from model import GPT, GPTConfig
from quillgpt import trainer
from quillgpt.checkpoint import load_checkpoint, save_checkpoint
from quillgpt.config import build_config
from quillgpt.data import find_dataset
from quillgpt.distributed import DistInfo
from quillgpt.engine import generate
from quillgpt.generate import load_for_sampling, plan_decoding
from train import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# the processes these tests start: no torchrun variables from outside, output as it comes
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    "PYTHONUNBUFFERED": "1",
}


def on_gpu(tiny_data: Path, out: Path, **extra) -> dict:
    """tiny_overrides on the GPU: bf16, eager, no dropout unless a test asks (compiling is what a few tests check)."""
    base = {"run.device": "cuda", "training.precision": "bf16", "training.compile": False, "model.dropout": 0.0}
    return tiny_overrides(tiny_data, out, **{**base, **extra})


def logged(run_dir: Path, kind: str = "train", key: str = "loss") -> dict[int, float]:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    return {p["iter"]: p[key] for p in history if p["kind"] == kind}


def gpu_trainer(tiny_data: Path, out: Path, **extra) -> trainer.Trainer:
    cfg = build_config(None, on_gpu(tiny_data, out, **extra))
    return trainer.build_trainer(cfg, trainer.setup(cfg, DistInfo()), find_dataset(cfg, DistInfo()))


@pytest.fixture
def tf32_off():
    """fp32 matmuls in fp32 (train.py turns TF32 on for CUDA): comparisons between two computations stay tight."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- training -------------------------------------------------------------------------------------------------------


def test_bf16_autocast_training_learns(tiny_data, tmp_path):
    """200 steps in bf16 on the GPU take the val loss 1.2 nats below its start, as test_a_short_run_learns does on the
    CPU; the checkpoint records bf16 resolved on cuda."""
    extra = {
        "training.max_iters": 200,
        "training.eval_interval": 200,
        "training.eval_iters": 20,
        "training.log_interval": 50,
        "training.batch_size": 16,
        "optimizer.learning_rate": 1e-2,
    }
    train(None, overrides=on_gpu(tiny_data, tmp_path, **extra))
    evals = logged(tmp_path / "t", "eval", "val_loss")
    assert sorted(evals) == [0, 200] and evals[200] < evals[0] - 1.2
    ckpt = load_checkpoint(tmp_path / "t" / "ckpt_last.pt")
    assert ckpt["config"]["training"]["precision"] == "bf16" and ckpt["resolved_on"] == "cuda"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fp16_with_a_grad_scaler_skips_a_nan_step_leaving_weights_and_optimizer_state_bit_identical(
    tiny_data, tmp_path, optimizer
):
    """fp16 trains through GradScaler: a NaN gradient at step 2 leaves the weights and every optimizer state tensor
    (fused AdamW's step counts included) as step 1 left them, bit for bit, and halves the scale; training goes on."""
    tr = gpu_trainer(tiny_data, tmp_path, **{"training.precision": "fp16", "optimizer.name": optimizer})
    assert tr.scaler.is_enabled() and tr.rt.precision == "fp16"
    handle = nan_gradient_once(tr.raw_model, at_call=2)
    trainer.train_step(tr, 0)
    weights = [p.detach().clone() for p in tr.raw_model.parameters()]
    states = [{k: v.clone() for k, v in s.items()} for opt in tr.optimizers for s in opt.state.values()]
    scale = tr.scaler.get_scale()
    _, _, skipped = trainer.train_step(tr, 1)
    handle.remove()
    assert skipped.item() == 1 and tr.scaler.get_scale() == scale / 2
    assert all(torch.equal(a, p) for a, p in zip(weights, tr.raw_model.parameters()))
    after = [s for opt in tr.optimizers for s in opt.state.values()]
    assert all(torch.equal(v, s[k]) for before, s in zip(states, after) for k, v in before.items())
    applied = [trainer.train_step(tr, it)[2].item() == 0 for it in range(2, 5)]
    assert any(applied) and not all(torch.equal(a, p) for a, p in zip(weights, tr.raw_model.parameters()))


def test_compiled_training_equals_eager_within_tolerance(tiny_data, tmp_path, tf32_off):
    """The same five fp32 steps from the same weights, eager and through torch.compile (inductor's Triton kernels):
    losses within 1e-3 of each other, relatively (fusion reorders sums, and Adam's first steps amplify the rounding;
    a wrong kernel is off by far more)."""
    losses = {}
    for compiled in (False, True):
        tr = gpu_trainer(tiny_data, tmp_path, **{"training.precision": "fp32", "training.compile": compiled})
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        losses[compiled] = [trainer.train_step(tr, it)[0].item() for it in range(5)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    assert losses[False][-1] < losses[False][0]


def test_a_resumed_run_continues_with_the_losses_of_one_that_never_stopped(tiny_data, tmp_path):
    """run.deterministic = true, fp32, dropout on (the CUDA RNG state is in the checkpoint) and SDPA's math kernel
    (flash and memory-efficient attention have no deterministic backward): 12 steps straight equal 6, a stop and 6
    resumed. Exactly, expected; 1e-6 leaves room for a kernel torch runs without a deterministic form (warn-only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    extra = {
        "run.deterministic": True,
        "training.precision": "fp32",
        "model.dropout": 0.1,
        "optimizer.lr_decay_iters": 12,
        "training.save_interval": 6,
    }
    with sdpa_kernel(SDPBackend.MATH):
        train(None, overrides=on_gpu(tiny_data, tmp_path / "straight", **extra, **{"training.max_iters": 12}))
        train(None, overrides=on_gpu(tiny_data, tmp_path / "split", **extra, **{"training.max_iters": 6}))
        train(None, overrides={"training.max_iters": 12}, resume=str(tmp_path / "split" / "t"))
    straight, resumed = logged(tmp_path / "straight" / "t"), logged(tmp_path / "split" / "t")
    assert sorted(straight) == sorted(resumed) == list(range(1, 13))
    assert resumed == pytest.approx(straight, abs=1e-6)


def test_a_checkpoint_saved_on_the_gpu_loads_on_the_cpu_and_back(tiny_data, tmp_path, capsys):
    """A run of precision auto trained on the GPU: its checkpoint loads onto the CPU (every tensor there), samples
    there, resumes there (auto resolved again for the CPU, said in one line) and then back on the GPU (bf16 again)."""
    over = on_gpu(tiny_data, tmp_path, **{"training.max_iters": 4})
    del over["training.precision"]  # auto
    train(None, overrides=over)
    run = tmp_path / "t"
    ckpt = load_checkpoint(run / "ckpt_last.pt")
    assert ckpt["resolved_on"] == "cuda" and ckpt["config"]["training"]["precision"] == "bf16"
    assert all(t.device.type == "cpu" for t in ckpt["model"].values())
    model, tokenizer, _ = load_for_sampling(run, "cpu")
    prompt = torch.tensor([tokenizer.encode("The ")])
    assert generate(model, prompt, 10, temperature=0).shape == (1, prompt.size(1) + 10)
    capsys.readouterr()
    train(resume=str(run), overrides={"training.max_iters": 6, "run.device": "cpu"})
    assert (
        "resuming on cpu a run that began on cuda: precision and compile are resolved again" in capsys.readouterr().out
    )
    ckpt = load_checkpoint(run / "ckpt_last.pt")
    assert ckpt["iter_num"] == 6 and ckpt["resolved_on"] == "cpu"
    train(resume=str(run), overrides={"training.max_iters": 8, "run.device": "cuda"})
    assert "resuming on cuda a run that began on cpu" in capsys.readouterr().out
    ckpt = load_checkpoint(run / "ckpt_last.pt")
    assert ckpt["iter_num"] == 8 and ckpt["resolved_on"] == "cuda" and ckpt["config"]["training"]["precision"] == "bf16"
    assert math.isfinite(logged(run)[8])


@pytest.mark.parametrize(
    "optimizer, precision, compile",
    [("adamw", "bf16", False), ("muon", "bf16", False), ("adamw", "fp16", False), ("adamw", "bf16", True)],
)
def test_a_step_that_does_not_log_never_syncs_the_gpu(tiny_data, tmp_path, monkeypatch, optimizer, precision, compile):
    """The real loop with torch.cuda.set_sync_debug_mode("error") from the start of each step that reads nothing back
    until the next step starts: any wait for the GPU there (.item(), a blocking copy, a tensor weight read as a number)
    raises. Ten steps of two micro-batches, a log line every 4th; the steps that read are the first (timed alone: it
    may compile), the log steps and the last (evaluation, saving)."""
    reading = {1, 4, 8, 10}
    real_step = trainer.train_step

    def step_under_sync_debug(tr, it):
        torch.cuda.set_sync_debug_mode("default" if it + 1 in reading else "error")
        return real_step(tr, it)

    monkeypatch.setattr(trainer, "train_step", step_under_sync_debug)
    extra = {
        "training.max_iters": 10,
        "training.log_interval": 4,
        "training.eval_interval": 0,
        "training.save_interval": 0,
        "training.grad_accum_steps": 2,
        "optimizer.name": optimizer,
        "training.precision": precision,
        "training.compile": compile,
    }
    try:
        result = train(None, overrides=on_gpu(tiny_data, tmp_path, **extra))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.iterations == 10 and math.isfinite(result.final_loss)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_ddp_and_fsdp_train_over_nccl_at_world_size_1(tiny_data, tmp_path, fsdp):
    """torchrun with one process: the process group is NCCL's, the model DDP- or FSDP2-wrapped (16-bit weights
    gathered), and the run trains, evaluates and saves (FSDP: its sharded directory too)."""
    over = on_gpu(tiny_data, tmp_path, **{"training.max_iters": 6, "distributed.fsdp": fsdp})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    proc = subprocess.run(
        [*cmd, *(f"--{k}={v}" for k, v in over.items())],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "device: cuda:0, bf16" in proc.stdout and "finished: 6 iters" in proc.stdout
    ckpt = load_checkpoint(tmp_path / "t" / "ckpt_last.pt")
    assert ckpt["iter_num"] == 6 and ckpt["world_size"] == 1
    assert (ckpt.get("sharded") is not None) == fsdp


# ---- decoding and the scripts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_kv_cache_decoding_equals_the_full_forward(tf32_off, compile, pos_emb):
    """Greedy fp32 decoding with the KV cache (eager, and the compiled decoding step) gives the tokens of decoding by
    full forward passes over the whole sequence, on the GPU (grouped-query attention in the rope model)."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=50, n_layer=2, n_head=4, n_embd=64, pos_emb=pos_emb, n_kv_head=2)
    model = GPT(config).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    prompt = torch.randint(0, 50, (1, 5), device="cuda")  # a lone row: the one a compiled step decodes
    full = uncached_greedy(model, prompt, 40)
    _, plan = plan_decoding(model, torch.device("cuda"), "fp32", compile)
    assert plan.step == ("torch.compile" if compile else "eager")
    cached = generate(model, prompt, 40, temperature=0, plan=plan)
    assert torch.equal(cached, full)


@pytest.fixture(scope="module")
def gpu_run(tiny_data, tmp_path_factory) -> Path:
    """A run directory trained on the GPU, for the scripts to read."""
    out = tmp_path_factory.mktemp("gpu_run")
    train(None, overrides=on_gpu(tiny_data, out, **{"training.max_iters": 20}))
    return out / "t"


def script(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def test_sample_py_decodes_on_the_gpu(gpu_run):
    proc = script("sample.py", "--ckpt", str(gpu_run), "--device", "cuda", "--prompt", "The ", "--max-new-tokens", "30")
    assert proc.stdout.startswith("The ") and len(proc.stdout.rstrip("\n")) == len("The ") + 30


def test_eval_py_scores_bits_per_byte_on_the_gpu(gpu_run, tiny_data, tmp_path):
    report = tmp_path / "eval.json"
    script(
        "eval.py",
        "--ckpt",
        str(gpu_run),
        "--device",
        "cuda",
        "--text",
        str(tiny_data / "tiny.txt"),
        "--json",
        str(report),
    )
    assert "bits" in report.read_text()


def test_chat_py_answers_on_the_gpu(tmp_path):
    """A random model whose tokenizer carries ChatML's tokens and template: one answer, greedy, on the GPU."""
    from quillgpt.chat_template import with_chat_tokens
    from quillgpt.tokenizer import CharTokenizer

    tokenizer = with_chat_tokens(CharTokenizer(list("\n abcdefghijklmnopqrstuvwxyz?.")))
    args = GPTConfig(block_size=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    path = tmp_path / "ckpt_best.pt"
    save_checkpoint(
        path, {"model": GPT(args).state_dict(), "model_args": args.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    script(
        "chat.py",
        "--ckpt",
        str(path),
        "--device",
        "cuda",
        "--prompt",
        "hi",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
    )


def test_serve_py_answers_completions_on_the_gpu(gpu_run):
    pytest.importorskip("fastapi")
    from benchmarks.serving_load import ServerProcess

    with ServerProcess(gpu_run, "--device", "cuda") as server:
        client = server.client(timeout=120)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="The ", max_tokens=12, temperature=0)
        assert 0 < reply.usage.completion_tokens <= 12 and isinstance(reply.choices[0].text, str)
