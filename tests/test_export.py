"""GPT-2 in from Hugging Face and out again, safetensors files, and fine-tuning (Llama and Qwen: test_hf.py).

Logits are compared against transformers' own GPT-2 implementation on tiny random models."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, gpt2_encoding_error, needs_gpt2_encoding, save_hf_gpt2  # noqa: F401 (the skipif string)
from safetensors import safe_open
from test_sample import write_char_checkpoint

import export
from model import GPT, GPTConfig
from quillgpt.checkpoint import save_checkpoint
from quillgpt.errors import UserError
from quillgpt.hf import export_hf
from quillgpt.loading import load_model, read_safetensors
from quillgpt.tokenizer import CharTokenizer, get_tiktoken, tokenizer_from_dict


@pytest.fixture(scope="module")
def hf_dir(transformers, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_gpt2")
    return directory, save_hf_gpt2(transformers, directory)


def hf_logits(hf, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x).logits


def our_logits(model: GPT, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x)[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run_script(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env
    )


# ---- import ------------------------------------------------------------------------------------------


def test_local_hf_gpt2_imports_with_equal_logits(hf_dir):
    directory, hf = hf_dir
    model = load_model(directory, dropout=0.1).model
    assert model.config.gelu_approx == "tanh" and model.config.dropout == 0.1
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 100, (2, 64))
    assert max_diff(our_logits(model, x), hf_logits(hf, x)) <= 1e-4


def test_exact_gelu_hf_model_imports_with_equal_logits(transformers, tmp_path):
    hf = save_hf_gpt2(transformers, tmp_path, seed=1, activation_function="gelu")
    model = load_model(tmp_path).model
    assert model.config.gelu_approx == "none"
    x = torch.randint(0, 100, (1, 40))
    assert max_diff(our_logits(model, x), hf_logits(hf, x)) <= 1e-4


def test_gpt2_with_its_own_epsilon_and_mlp_width_imports_with_equal_logits(transformers, tmp_path):
    hf = save_hf_gpt2(transformers, tmp_path, seed=2, layer_norm_epsilon=1e-6, n_inner=48)
    model = load_model(tmp_path).model
    assert (model.config.norm_eps, model.config.mlp_hidden) == (1e-6, 48)
    x = torch.randint(0, 100, (1, 40))
    assert max_diff(our_logits(model, x), hf_logits(hf, x)) <= 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "relu"}, "activation_function is 'relu'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx is True, which model.py cannot"),
        ({"architectures": ["LlamaForCausalLM"]}, "config.json has no integer hidden_size, which a Llama model needs"),
    ],
)
def test_unsupported_hf_configs_are_refused(hf_dir, tmp_path, change, message):
    directory, _ = hf_dir
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=message):
        load_model(tmp_path)


def test_bad_gpt2_sources_are_user_errors(hf_dir, tmp_path):
    with pytest.raises(UserError, match="checkpoint not found: gpt2-huge"):
        load_model("gpt2-huge")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="architecture None is not supported"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((hf_dir[0] / "config.json").read_text())
    with pytest.raises(UserError, match="has config.json but no model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot read"):
        load_model(tmp_path)


@pytest.mark.slow
def test_gpt2_name_offline_is_a_one_line_error(transformers, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = run_script("sample.py", "--ckpt", "gpt2", "--prompt", "Hello", env=env)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(
        "error: gpt2 is a Hugging Face hub model, but HF_HUB_OFFLINE is set; download it where "
        "there is network (huggingface-cli download gpt2 --local-dir DIR)"
    )


# ---- export to Hugging Face ------------------------------------------------------------------------


@pytest.mark.parametrize("model_args", [dict(), dict(bias=False), dict(gelu_approx="tanh", block_size=48)])
def test_export_hf_loads_in_transformers_with_equal_logits(transformers, tmp_path, model_args):
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", **model_args)
    assert export.main(["--ckpt", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    model = load_model(ckpt).model
    x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    assert max_diff(our_logits(model, x), hf_logits(hf, x)) <= 1e-4
    # and back again
    assert max_diff(our_logits(load_model(tmp_path / "hf").model, x), our_logits(model, x)) <= 1e-5


def test_imported_gpt2_exports_back_unchanged(hf_dir, transformers, tmp_path):
    directory, hf = hf_dir
    notes = export_hf(load_model(directory).model, None, tmp_path)
    assert notes == ["no tokenizer files written: the checkpoint records no tokenizer"]
    assert json.loads((tmp_path / "config.json").read_text())["activation_function"] == "gelu_new"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 100, (1, 64))
    assert max_diff(hf_logits(again, x), hf_logits(hf, x)) <= 1e-5


def test_modern_model_export_exits_2_with_the_reason(tmp_path):
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", pos_emb="rope", norm="rmsnorm")
    result = run_script(
        "export.py", "--ckpt", str(ckpt), "--hf", str(tmp_path / "hf"), "--safetensors", str(tmp_path / "m.safetensors")
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"error: {ckpt} cannot be exported as Hugging Face Llama: model.mlp = 'gelu' (nearest that "
        "exports: 'swiglu') (export it with --safetensors instead)\n"
    )
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.safetensors").exists()


@needs_gpt2_encoding
def test_gpt2_checkpoint_exports_its_tokenizer(transformers, tmp_path):
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    assert export_hf(model, {"kind": "tiktoken", "name": "gpt2"}, tmp_path) == []
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello world, it's a test of GPT-2's tokenizer.\n"
    assert tok(text).input_ids == get_tiktoken("gpt2").encode(text)


def test_gpt2_tokenizer_files_skipped_offline_with_a_note(tmp_path):
    """Offline for real: an empty tiktoken cache and a proxy that refuses every connection."""
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    save_checkpoint(
        tmp_path / "ckpt.pt",
        {
            "model": model.state_dict(),
            "model_args": model.config.to_dict(),
            "tokenizer": {"kind": "tiktoken", "name": "gpt2"},
        },
    )
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "tiktoken_cache_dir")}
    env.update(TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"), HTTPS_PROXY="http://127.0.0.1:9")
    result = run_script("export.py", "--ckpt", str(tmp_path / "ckpt.pt"), "--hf", str(tmp_path / "hf"), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("note: no tokenizer files written: tiktoken could not load the 'gpt2' encoding")
    assert len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


# ---- safetensors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_args", [dict(), dict(pos_emb="rope", mlp="swiglu", tie_embeddings=False, logit_softcap=20.0)]
)
def test_safetensors_round_trip_gives_identical_logits(tmp_path, model_args):
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", **model_args)
    out = tmp_path / "model.safetensors"
    assert export.main(["--ckpt", str(ckpt), "--safetensors", str(out)]) == 0
    loaded, original = load_model(out), load_model(ckpt)
    model, tokenizer, tok_dict = loaded.model, tokenizer_from_dict(loaded.tokenizer), original.tokenizer
    original = original.model
    assert tokenizer.to_dict() == tok_dict and isinstance(tokenizer, CharTokenizer)
    assert model.config == original.config
    x = torch.randint(0, model.config.vocab_size, (2, 32))
    assert torch.equal(our_logits(model, x), our_logits(original, x))
    with safe_open(out, "pt") as f:
        stored = set(f.keys())
    tied = model.config.tie_embeddings
    assert ("transformer.wte.weight" not in stored) == tied and "lm_head.weight" in stored
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied


def test_sample_from_safetensors_prints_what_the_checkpoint_generates(tmp_path):
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt")
    export.main(["--ckpt", str(ckpt), "--safetensors", str(tmp_path / "m.safetensors")])
    args = ["--prompt", "abc", "--max-new-tokens", "30", "--temperature", "0", "--dtype", "fp32"]
    from_file = run_script("sample.py", "--ckpt", str(tmp_path / "m.safetensors"), *args)
    assert from_file.returncode == 0, from_file.stderr
    from quillgpt import generate as sample

    model, tokenizer, _ = sample.load_for_sampling(ckpt, "cpu")
    [text], _ = sample.generate_texts(model, tokenizer, tokenizer.encode("abc"), 1, 30, temperature=0)
    assert from_file.stdout == "abc" + text + "\n"


def test_foreign_or_corrupt_safetensors_are_user_errors(hf_dir, tmp_path):
    directory, _ = hf_dir
    with pytest.raises(UserError, match="no model_args metadata"):
        read_safetensors(directory / "model.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(UserError, match="not a readable safetensors file"):
        read_safetensors(tmp_path / "bad.safetensors")


# ---- fine-tuning -------------------------------------------------------------------------------------


def words(alphabet: str, n: int = 3000, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    letters = torch.randint(0, len(alphabet), (n * 5,), generator=g).tolist()
    return "\n".join("".join(alphabet[i] for i in letters[k : k + 5]) for k in range(0, len(letters), 5)) + "\n"


def tiny_run(tmp: Path, dataset: str, text: str, name: str, **overrides) -> dict:
    """train()'s overrides for a few steps of a tiny char model on `text`."""
    (tmp / f"{dataset}.txt").write_text(text)
    return {
        "data.dataset": dataset,
        "data.input": str(tmp / f"{dataset}.txt"),
        "data.data_dir": str(tmp / "data"),
        "data.tokenizer": "char",
        "run.out_dir": str(tmp / "runs"),
        "run.name": name,
        "run.device": "cpu",
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 32,
        "training.batch_size": 8,
        "training.max_iters": 6,
        "training.eval_interval": 3,
        "training.eval_iters": 2,
        "training.log_interval": 3,
        "optimizer.warmup_iters": 0,
        "logging.plot": False,
        **overrides,
    }


def test_finetune_from_a_run_starts_a_new_run_and_leaves_the_source_untouched(tmp_path):
    """The checkpoint's architecture (the config's n_layer is ignored), the config's dropout; weights move a little."""
    from quillgpt.checkpoint import load_checkpoint
    from train import train

    text = words("abcdefgh ")
    train(overrides=tiny_run(tmp_path, "a", text, "base", **{"optimizer.learning_rate": 1e-2}))
    base = tmp_path / "runs" / "base"
    before = {p.name: p.read_bytes() for p in base.glob("ckpt_*.pt")}
    result = train(
        overrides=tiny_run(
            tmp_path,
            "a",
            text,
            "tuned",
            **{
                "run.init_from": str(base),
                "optimizer.learning_rate": 1e-4,
                "optimizer.decay_lr": False,
                "model.dropout": 0.1,
                "model.n_layer": 4,
            },
        )
    )  # architecture comes from the checkpoint, not the config
    assert {p.name: p.read_bytes() for p in base.glob("ckpt_*.pt")} == before  # the source run is untouched
    assert result.iterations == 6
    source, tuned = load_checkpoint(base / "ckpt_best.pt"), load_checkpoint(result.checkpoint_path)
    assert tuned["model_args"] == {**source["model_args"], "dropout": 0.1}
    assert tuned["config"]["model"]["n_layer"] == 2 and tuned["config"]["run"]["init_from"] == str(base)
    drift = max((tuned["model"][k] - v).abs().max().item() for k, v in source["model"].items())
    assert 0 < drift < 6 * 1e-4 * 2  # a few small AdamW steps away from the source weights


@pytest.mark.slow
def test_finetune_on_another_char_vocabulary_exits_2(tmp_path):
    from train import train

    train(overrides=tiny_run(tmp_path, "a", words("abcdefgh "), "base", **{"training.max_iters": 1}))
    args = tiny_run(tmp_path, "b", words("ABCDEFGH "), "tuned", **{"run.init_from": str(tmp_path / "runs" / "base")})
    result = run_script("train.py", *[f"--{k}={v}" for k, v in args.items()])
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # the rest: progress bars
    assert line.startswith("error: vocabulary mismatch:") and "char tokenizer of 10 tokens" in line
    assert "the dataset has characters the checkpoint lacks: 'ABCDEFGH'" in line
    assert not (tmp_path / "runs" / "tuned").exists()


def test_gpt2_init_refuses_a_char_dataset(hf_dir, tmp_path):
    from train import train

    directory, _ = hf_dir
    args = tiny_run(tmp_path, "a", words("abcdefgh "), "tuned", **{"run.init_from": str(directory)})
    with pytest.raises(
        UserError, match="^vocabulary mismatch: .* gpt2 tokenizer of 100 tokens, .* uses char with 10: "
    ):
        train(overrides=args)


@pytest.mark.slow
@needs_gpt2_encoding
def test_finetuned_local_hf_gpt2_resumes_and_exports_with_equal_logits(transformers, tmp_path):
    """GPT-2 from save_pretrained trains on gpt2 tokens cropped to model.block_size, resumes, exports equal logits."""
    from train import train

    directory = tmp_path / "hf"
    save_hf_gpt2(transformers, directory, vocab_size=50257)
    args = tiny_run(
        tmp_path,
        "g",
        "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 300,
        "tuned",
        **{"data.tokenizer": "gpt2", "run.init_from": str(directory), "optimizer.learning_rate": 3e-4},
    )
    result = train(overrides=args)
    assert result.iterations == 6 and result.best_val_loss < 11
    resumed = train(overrides={"training.max_iters": 8}, resume=str(tmp_path / "runs" / "tuned"))
    assert resumed.iterations == 8
    model = load_model(resumed.checkpoint_path).model
    assert model.config.gelu_approx == "tanh" and model.config.block_size == 32  # cropped to model.block_size
    export_hf(model, {"kind": "tiktoken", "name": "gpt2"}, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 50257, (1, 32))
    assert max_diff(our_logits(model, x), hf_logits(hf, x)) <= 1e-4


@pytest.mark.slow
def test_shakespeare_finetune_preset_commands_train_tune_and_sample(shakespeare_path, tmp_path):
    """The commands in configs/finetune/shakespeare_from_checkpoint.toml, shortened, in temporary directories."""
    where = [
        "--data.data_dir",
        str(tmp_path / "data"),
        "--run.out_dir",
        str(tmp_path / "runs"),
        "--logging.plot",
        "false",
        "--data.input",
        str(shakespeare_path),
        "--training.eval_iters",
        "2",
    ]
    base = run_script(
        "train.py",
        "--config",
        "configs/shakespeare_char/cpu.toml",
        "--max-iters",
        "4",
        "--training.eval_interval",
        "2",
        "--training.compile",
        "false",
        *where,
    )  # 4 steps: no compile
    assert base.returncode == 0, base.stderr
    tuned = run_script(
        "train.py",
        "--config",
        "configs/finetune/shakespeare_from_checkpoint.toml",
        "--max-iters",
        "4",
        "--training.eval_interval",
        "2",
        "--device",
        "cpu",
        "--run.init_from",
        str(tmp_path / "runs" / "shakespeare-char-cpu"),
        *where,
    )
    assert tuned.returncode == 0, tuned.stderr
    assert (tmp_path / "runs" / "shakespeare-char-finetune" / "ckpt_last.pt").is_file()
    sampled = run_script(
        "sample.py",
        "--ckpt",
        str(tmp_path / "runs" / "shakespeare-char-finetune"),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "20",
        "--seed",
        "1",
    )
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr


def test_value_embeddings_smear_and_the_skips_are_refused_by_the_hugging_face_export(tmp_path):
    """No Hugging Face family has nanochat's value embeddings, smear or skips: one line naming each, exit 2, no
    files."""
    switches = dict(
        pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, value_embeds=True, backout=True, smear=True
    )
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", **switches)
    result = run_script("export.py", "--ckpt", str(ckpt), "--hf", str(tmp_path / "hf"))
    assert result.returncode == 2
    assert result.stderr == (
        f"error: {ckpt} cannot be exported as Hugging Face Llama: model.value_embeds = True (nearest that exports: "
        "False); model.smear = True (nearest that exports: False); model.backout = True (nearest that exports: False) "
        "(export it with --safetensors instead)\n"
    )
    assert not (tmp_path / "hf").exists()
