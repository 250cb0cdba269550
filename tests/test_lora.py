"""LoRA and QLoRA (quillgpt/lora.py, quillgpt/peft_io.py): adapters on a frozen base that train, resume, load
everywhere a run loads, go out to PEFT and come back, and fold into merged exports.

The bases are tiny random Llama and Qwen3 models that transformers saves (with a BPE tokenizer), fine-tuned on word
salad prepared with their own tokenizer; PEFT itself loads what export.py --peft writes and writes what
lora.adapters reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO_ROOT,
    resume_in_subprocess,
    save_hf_family,
    save_hf_tokenizer,
    train_until_sigterm,
    word_salad,
)
from test_train import losses

import export
from model import GPT, GPTConfig
from quillgpt import distributed
from quillgpt.checkpoint import RunDir, load_checkpoint
from quillgpt.config import build_config
from quillgpt.data import find_dataset
from quillgpt.errors import UserError, run_main
from quillgpt.hf import load_hf
from quillgpt.loading import load_model, write_safetensors
from quillgpt.lora import LoraLinear, LoraSettings, QuantizedLinear, adapter_state, add_adapters, merged
from quillgpt.trainer import build_trainer, callers_determinism_restored, setup, train_step
from train import train

TEXT = word_salad(30_000)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def base(request, transformers, tmp_path_factory) -> Path:
    """A tiny random model of the family with its BPE tokenizer, saved by transformers."""
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_family(transformers, request.param, directory)
    save_hf_tokenizer(transformers, directory, TEXT)
    return directory


@pytest.fixture(scope="module")
def llama(transformers, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    save_hf_family(transformers, "llama", directory)
    save_hf_tokenizer(transformers, directory, TEXT)
    return directory


def lora_overrides(base_dir: Path, tmp: Path, **extra) -> dict:
    """A LoRA fine-tune of base_dir on word salad prepared with its tokenizer (beside base_dir: prepared once for all
    the tests on that base), its runs under tmp; a few ms a step."""
    shared = base_dir.parent / f"{base_dir.name}-ft"
    docs = shared / "docs.jsonl"
    if not docs.exists():
        shared.mkdir(exist_ok=True)
        docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in word_salad(40_000, seed=1).splitlines()))
    return {
        "run.init_from": str(base_dir),
        "data.dataset": "ft",
        "data.input": str(docs),
        "data.tokenizer": f"hf:{base_dir}",
        "data.data_dir": str(shared / "data"),
        "run.out_dir": str(tmp / "runs"),
        "run.name": "lora",
        "run.device": "cpu",
        "training.precision": "fp32",
        "model.block_size": 32,
        "model.dropout": 0.0,
        "training.batch_size": 4,
        "training.max_iters": 8,
        "training.eval_interval": 0,
        "training.eval_iters": 2,
        "training.log_interval": 1,
        "training.save_interval": 1000,
        "optimizer.learning_rate": 2e-2,
        "optimizer.warmup_iters": 0,
        "optimizer.weight_decay": 0.0,
        "logging.plot": False,
        "lora.enabled": True,
        "lora.rank": 4,
        **extra,
    }


def lora_run(base_dir: Path, tmp: Path, **extra) -> Path:
    """A trained LoRA run directory on base_dir."""
    over = lora_overrides(base_dir, tmp, **extra)
    train(overrides=over)
    return Path(over["run.out_dir"]) / over["run.name"]


def built_trainer(over: dict):
    """The Trainer train.py builds for these overrides, before any step."""
    cfg = build_config({}, over)
    dist = distributed.from_env()
    rt = setup(cfg, dist)
    return build_trainer(cfg, rt, find_dataset(cfg, dist))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(x)
        return out.logits if hasattr(out, "logits") else out[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


X = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


# ---- training ------------------------------------------------------------------------------------------------


def test_only_adapters_train_the_base_has_no_gradient_no_optimizer_state_and_step_0_is_the_base(llama, tmp_path):
    with callers_determinism_restored():
        tr = built_trainer(lora_overrides(llama, tmp_path, **{"lora.dropout": 0.1}))
        model = tr.raw_model
        base = load_hf(llama)[0]
        assert max_diff(logits(model, X), logits(base, X)) == 0.0  # B = 0: the base's function at step 0
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        assert set(trainable) == set(adapter_state(model)) and all(".adapters." in n for n in trainable)
        model.train()
        train_step(tr, 0)
        for opt in tr.optimizers:  # zero_grad(set_to_none) ran: look before it, on a second step's backward
            opt.zero_grad(set_to_none=True)
        x, y, _ = tr.batches.get("train", 1)
        model(x, y)[1].backward()
        named = dict(model.named_parameters())
        assert all(named[n].grad is None for n in frozen) and all(named[n].grad is not None for n in trainable)
        state_ids = {id(p) for opt in tr.optimizers for p in opt.state}
        assert state_ids == {id(named[n]) for n in trainable}
        assert all(torch.equal(named[n], p) for n, p in frozen.items())
        assert any(not torch.equal(named[n], p) for n, p in trainable.items())


@pytest.mark.slow
def test_a_resumed_lora_run_repeats_the_losses_of_one_that_never_stopped(llama, tmp_path):
    over = lora_overrides(
        llama,
        tmp_path,
        **{
            "training.max_iters": 400,
            "optimizer.lr_decay_iters": 400,
            "lora.dropout": 0.1,
            "model.dropout": 0.1,
            "optimizer.learning_rate": 3e-3,
        },
    )
    train_until_sigterm(over, 10, timeout=120)
    run = RunDir(Path(over["run.out_dir"]) / "lora")
    ckpt = load_checkpoint(run.latest())
    assert 10 <= ckpt["iter_num"] < 400
    assert set(ckpt["model"]) == {k for k in ckpt["model"] if ".adapters." in k}  # the adapters only
    assert ckpt["lora"]["base"]["path"] == str(llama) and len(ckpt["lora"]["base"]["sha256"]) == 64
    resume_in_subprocess(run.path, 24)
    train(overrides={**over, "run.out_dir": str(tmp_path / "straight"), "training.max_iters": 24})
    straight = losses(tmp_path / "straight" / "lora")
    assert losses(run.path) == straight and max(straight) == 24


def test_a_base_changed_on_disk_is_one_line_for_resume_and_sampling(transformers, tmp_path, capsys):
    base_dir = tmp_path / "base"
    save_hf_family(transformers, "llama", base_dir)
    save_hf_tokenizer(transformers, base_dir, TEXT)
    run = lora_run(base_dir, tmp_path, **{"training.max_iters": 2})
    save_hf_family(transformers, "llama", base_dir, seed=1)  # other weights, same shapes
    capsys.readouterr()
    import sample

    for main, args in (
        (sample.main, ["--ckpt", str(run), "--prompt", "the", "--max-new-tokens", "2"]),
        (train_main, ["--resume", str(run), "--training.max_iters", "4"]),
    ):
        assert exit_code(main, args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "changed on disk since the adapters were trained on it" in err


def train_main(argv: list[str]) -> int:
    import train as train_script

    return train_script.main(argv)


def exit_code(main, argv: list[str]) -> int:
    """What the script's process would exit with (run_main: a UserError is one line on stderr and 2)."""
    with pytest.raises(SystemExit) as e:
        run_main(lambda: main(argv))
    return e.value.code


# ---- loading a LoRA run ----------------------------------------------------------------------------------------


def test_sample_and_eval_load_a_lora_run_as_base_plus_adapters(llama, tmp_path):
    run = lora_run(llama, tmp_path)
    unmerged = load_model(run, keep_adapters=True).model
    assert any(isinstance(m, LoraLinear) for m in unmerged.modules())
    plain = load_model(run).model
    assert type(plain) is GPT and not any(isinstance(m, LoraLinear) for m in plain.modules())
    assert max_diff(logits(plain, X), logits(unmerged, X)) <= 1e-5
    assert max_diff(logits(plain, X), logits(load_hf(llama)[0], X)) > 1e-3  # the adapters changed something
    for script, args in (
        ("sample.py", ["--prompt", "the king", "--max-new-tokens", "8", "--temperature", "0"]),
        ("eval.py", ["--text", str(llama.parent / f"{llama.name}-ft" / "docs.jsonl")]),
    ):
        result = subprocess.run(
            [sys.executable, script, "--ckpt", str(run), *args], cwd=REPO_ROOT, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr


# ---- PEFT ---------------------------------------------------------------------------------------------------


def test_export_peft_loads_in_peft_with_our_logits(base, transformers, tmp_path):
    peft = pytest.importorskip("peft")
    run = lora_run(base, tmp_path)
    assert export.main(["--ckpt", str(run), "--peft", str(tmp_path / "adapter")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ours = load_model(run, keep_adapters=True).model
    assert max_diff(logits(theirs, X), logits(ours, X)) <= 1e-5
    assert max_diff(logits(theirs, X), logits(transformers.AutoModelForCausalLM.from_pretrained(base), X)) > 1e-3


def test_lora_adapters_reads_a_peft_directory_with_peft_s_logits(base, transformers, tmp_path):
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        r=6, lora_alpha=9, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    theirs = peft.get_peft_model(hf, config)
    theirs.save_pretrained(tmp_path / "adapter")
    with callers_determinism_restored():
        tr = built_trainer(lora_overrides(base, tmp_path, **{"lora.adapters": str(tmp_path / "adapter")}))
    assert (tr.cfg.lora.rank, tr.cfg.lora.alpha, tr.cfg.lora.targets) == (6, 9.0, ["q_proj", "v_proj", "down_proj"])
    assert max_diff(logits(tr.raw_model, X), logits(theirs.eval(), X)) <= 1e-5


# ---- merged exports --------------------------------------------------------------------------------------------


def test_merged_exports_compute_the_unmerged_lora_model(llama, transformers, tmp_path):
    run = lora_run(llama, tmp_path)
    ours = logits(load_model(run, keep_adapters=True).model, X)
    args = ["--ckpt", str(run), "--merge", "--hf", str(tmp_path / "hf")]
    assert export.main([*args, "--safetensors", str(tmp_path / "merged.safetensors")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert max_diff(logits(hf, X), ours) <= 1e-5
    assert max_diff(logits(load_model(tmp_path / "merged.safetensors").model, X), ours) <= 1e-5


# ---- QLoRA ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_qlora_stores_the_base_quantized_trains_and_merges_into_the_dequantized_base(llama, tmp_path, quantize):
    run = lora_run(llama, tmp_path, **{"lora.quantize": quantize, "training.max_iters": 16})
    model = load_model(run, keep_adapters=True).model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 5 * model.config.n_layer  # every Linear of the blocks (c_attn is q, k, v), adapted or not
    assert all(m.codes.dtype == (torch.int8 if quantize == "int8" else torch.uint8) for m in quantized)
    assert not any(p.requires_grad for m in quantized for p in m.parameters())
    assert max_diff(logits(merged(model), X), logits(model, X)) <= 1e-5
    history = losses(run)
    assert np.mean([history[i] for i in (13, 14, 15, 16)]) < np.mean([history[i] for i in (1, 2, 3, 4)])


# ---- bad input -------------------------------------------------------------------------------------------------


def other_type_peft(tmp: Path, transformers, base_dir: Path) -> Path:
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    ia3 = peft.get_peft_model(hf, peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"]))
    ia3.save_pretrained(tmp / "ia3")
    return tmp / "ia3"


def other_base_peft(tmp: Path, transformers, base_dir: Path) -> Path:
    peft = pytest.importorskip("peft")
    other = tmp / "other"
    hf = save_hf_family(transformers, "llama", other, hidden_size=32, intermediate_size=48)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp / "other_adapter")
    return tmp / "other_adapter"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lora.rank": 0}, "lora.rank = 0 must be positive"),
        ({"lora.targets": ["q_proj", "qkv"]}, "unknown target module 'qkv'"),
        ({"lora.adapters": other_type_peft}, "holds a PEFT IA3 adapter, not LoRA"),
        ({"lora.adapters": other_base_peft}, "adapters for another base"),
        ({"run.init_from": "scratch"}, "lora.enabled needs run.init_from"),
    ],
)
def test_bad_lora_input_is_one_line_exit_2_and_nothing_written(llama, transformers, tmp_path, capsys, extra, message):
    extra = {k: v(tmp_path, transformers, llama) if callable(v) else v for k, v in extra.items()}
    over = lora_overrides(llama, tmp_path, **extra)
    capsys.readouterr()  # transformers' progress bars while making the adapters
    code = exit_code(train_main, [f"--{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in over.items()])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (Path(over["run.out_dir"]) / "lora").exists()


def test_export_refuses_lora_mistakes_in_one_line_writing_nothing(llama, tmp_path, capsys):
    run = lora_run(llama, tmp_path, **{"training.max_iters": 2})
    plain = tmp_path / "plain.safetensors"
    write_safetensors(load_hf(llama)[0], None, plain)
    for args, message in (
        (["--ckpt", str(run), "--hf", str(tmp_path / "out")], "is a LoRA run: export it with its adapters folded"),
        (["--ckpt", str(plain), "--merge", "--hf", str(tmp_path / "out")], "has no adapters to merge"),
        (["--ckpt", str(plain), "--peft", str(tmp_path / "out")], "has no adapters"),
    ):
        assert exit_code(export.main, args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
        assert not (tmp_path / "out").exists()


def test_a_gelu_model_refuses_gate_proj_by_name_and_leaves_it_out_of_the_groups(tiny_data, tmp_path):
    over = {
        "data.dataset": "tiny",
        "data.data_dir": str(tiny_data),
        "run.out_dir": str(tmp_path),
        "run.device": "cpu",
        "training.precision": "fp32",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 32,
        "training.max_iters": 2,
        "training.eval_interval": 0,
        "training.eval_iters": 1,
        "logging.plot": False,
    }
    train(overrides={**over, "run.name": "base"})
    lora = {**over, "run.init_from": str(tmp_path / "base"), "lora.enabled": True, "run.name": "lora"}
    train(overrides={**lora, "lora.targets": ["mlp"]})
    assert load_checkpoint(tmp_path / "lora" / "ckpt_last.pt")["lora"]["settings"]["targets"] == [
        "up_proj",
        "down_proj",
    ]
    with pytest.raises(UserError, match="gate_proj: this model's MLP \\(gelu\\) has no gate"):
        train(overrides={**lora, "run.name": "gate", "lora.targets": ["gate_proj"]})


@pytest.mark.parametrize("tied", [True, False])
def test_tokens_added_to_the_vocabulary_get_trainable_rows_that_merge(tied):
    """Chat tokens a run adds to the base's vocabulary: rows of their own that train (the base's stay frozen), start
    as the mean of the base's, and fold into the merged embedding and head."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50, tie_embeddings=tied)
    base = GPT(config).eval()
    x = torch.randint(0, 50, (2, 8))
    reference = logits(base, x)
    model = add_adapters(base, LoraSettings(4, 8.0, ("q_proj", "v_proj")), vocab_size=53)
    assert max_diff(logits(model, x)[..., :50], reference) == 0.0
    rows = [n for n, p in model.named_parameters() if p.requires_grad and n.endswith(".rows")]
    assert rows == (["transformer.wte.rows"] if tied else ["transformer.wte.rows", "lm_head.rows"])
    assert torch.allclose(model.transformer.wte.rows[0], model.transformer.wte.base.weight.mean(0))
    model.train()
    y = torch.randint(48, 53, (2, 8))
    model(torch.randint(0, 53, (2, 8)), y)[1].backward()
    assert model.transformer.wte.rows.grad.abs().sum() > 0 and model.transformer.wte.base.weight.grad is None
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 53, (2, 8))
    assert max_diff(logits(merged(model), x), logits(model, x)) <= 1e-5


def test_validate_estimates_a_lora_run_from_its_adapters(llama, tmp_path):
    full = lora_overrides(llama, tmp_path, **{"lora.enabled": False})
    full_est = train(overrides=full, validate_only=True)["memory"]
    lora = train(overrides=lora_overrides(llama, tmp_path), validate_only=True)
    # 2 layers of 7 adapters: A (4 x in: 64, but down_proj's 96) and B (out x 4: q 64, k and v 32, o 64, gate and up
    # 96, down 64)
    adapters = 2 * 4 * ((6 * 64 + 96) + (64 + 32 + 32 + 64 + 96 + 96 + 64))
    assert lora["memory"]["gradients"] == adapters * 4 and lora["memory"]["optimizer"] == adapters * 8
    assert lora["memory"]["total"] < full_est["total"]
