"""Llama, Qwen2 and Qwen3 in and out (hf.py), Hugging Face tokenizers, and tokenizer.json for our own tokenizers.

Every model here is a tiny random one built and saved by transformers itself; logits and greedy generations are
compared with transformers' own implementations."""

import json
import subprocess
import sys

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
from safetensors.torch import load_file, save_file
from test_train import losses

import export
import sample
from model import GPT, GPTConfig
from quillgpt.checkpoint import RunDir, load_checkpoint
from quillgpt.engine import generate
from quillgpt.errors import UserError, run_main
from quillgpt.hf import export_hf
from quillgpt.loading import load_model
from quillgpt.prepare import prepare_dataset
from quillgpt.tokenizer import hf_files, hf_tokenizer, load_tokenizer, tokenizer_from_dict, train_tokenizer
from train import train

FAMILIES = ["llama", "qwen2", "qwen3"]
TEXT = word_salad(30_000)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, transformers, tmp_path_factory):
    """(family, directory, transformers model): a tiny model with its tokenizer (BOS-prepending BPE of 300 ids)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_family(transformers, request.param, directory)
    save_hf_tokenizer(transformers, directory, TEXT)
    return request.param, directory, hf


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
        return out.logits if hasattr(out, "logits") else out[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- in ------------------------------------------------------------------------------------------------


def test_family_imports_with_the_logits_of_transformers(family_dir):
    family, directory, hf = family_dir
    loaded = load_model(directory)
    c = loaded.model.config
    assert (c.pos_emb, c.norm, c.mlp, c.n_kv_head, c.mlp_hidden, c.norm_eps) == (
        "rope",
        "rmsnorm",
        "swiglu",
        2,
        96,
        1e-6,
    )
    assert (c.qkv_bias, c.qk_norm, c.tie_embeddings) == (family == "qwen2", family == "qwen3", family == "qwen2")
    assert c.rope_scaling == ("llama3" if family == "llama" else "none") and c.head_width == (
        32 if family == "qwen3" else 16
    )
    x = torch.randint(0, 300, (2, 100))
    assert max_diff(logits(loaded.model.eval(), x), logits(hf, x)) <= 1e-4
    assert loaded.tokenizer["kind"] == "hf" and loaded.tokenizer["bos_id"] == 0 and loaded.tokenizer["eos_id"] == 1


def test_greedy_decoding_with_the_kv_cache_equals_transformers_generate(family_dir):
    _, directory, hf = family_dir
    model = load_model(directory).model.eval()
    prompt = torch.randint(2, 300, (1, 12))
    theirs = hf.generate(
        prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ours = generate(model, prompt, 64, temperature=0)
    assert ours.shape == (1, 76) and torch.equal(ours, theirs)


def test_sharded_safetensors_load_like_one_file(transformers, tmp_path):
    hf = save_hf_family(transformers, "llama", tmp_path, max_position_embeddings=64)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    x = torch.randint(0, 300, (1, 64))
    assert max_diff(logits(load_model(tmp_path / "sharded").model, x), logits(hf, x)) <= 1e-4


# ---- out -----------------------------------------------------------------------------------------------


def test_imported_family_exports_back_as_the_same_architecture(family_dir, transformers, tmp_path):
    family, directory, hf = family_dir
    loaded = load_model(directory)
    tokenizer = loaded.tokenizer
    if family == "qwen2":  # Qwen2 goes out as Qwen2 with Qwen's own tokenizer, which transformers 5 rebuilds itself
        tokenizer = {
            **tokenizer,
            "tokenizer_config": {**tokenizer["tokenizer_config"], "tokenizer_class": "Qwen2Tokenizer"},
        }
    assert export_hf(loaded.model, tokenizer, tmp_path, str(directory)) == []
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    x = torch.randint(0, 300, (2, 100))
    assert max_diff(logits(back, x), logits(hf, x)) <= 1e-5
    theirs, ours = (transformers.AutoTokenizer.from_pretrained(d) for d in (directory, tmp_path))
    assert ours(TEXT[:500]).input_ids == theirs(TEXT[:500]).input_ids  # the tokenizer files went with it


@pytest.mark.parametrize(
    "family, switches",
    [
        ("llama", {"model.n_kv_head": 1, "model.tie_embeddings": False, "model.zero_init_proj": True}),
        ("qwen3", {"model.qk_norm": True, "model.n_kv_head": 1, "model.head_dim": 24}),
        ("llama", {"model.qkv_bias": True}),  # as Llama with attention_bias: a char tokenizer can't go out as Qwen2's
    ],
)
def test_models_trained_with_modern_switches_export_and_load_in_transformers(
    tiny_data, tmp_path, transformers, family, switches
):
    from conftest import tiny_overrides

    modern = {
        "model.pos_emb": "rope",
        "model.norm": "rmsnorm",
        "model.mlp": "swiglu",
        "model.bias": False,
        "model.n_head": 4,
        "training.max_iters": 6,
        "training.eval_interval": 3,
        **switches,
    }
    result = train(overrides=tiny_overrides(tiny_data, tmp_path, **modern))
    assert export.main(["--ckpt", str(result.checkpoint_path), "--hf", str(tmp_path / "hf")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    loaded = load_model(result.checkpoint_path)
    again = load_model(tmp_path / "hf").model.eval()  # and back in, with the same switches
    switches = ("pos_emb", "norm", "mlp", "kv_heads", "head_width", "qk_norm", "qkv_bias", "bias", "tie_embeddings")
    assert [getattr(again.config, k) for k in switches] == [getattr(loaded.model.config, k) for k in switches]
    x = torch.randint(0, loaded.model.config.vocab_size, (2, 32))
    assert max_diff(logits(back, x), logits(loaded.model.eval(), x)) <= 1e-4
    assert max_diff(logits(again, x), logits(loaded.model, x)) <= 1e-5
    ours, theirs = tokenizer_from_dict(loaded.tokenizer), transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = (tiny_data / "tiny.txt").read_text()[:2000]
    assert theirs(text).input_ids == ours.encode(text) and theirs.decode(ours.encode(text)) == text


@pytest.mark.parametrize(
    "switches, blocker",
    [
        (dict(pos_emb="rope", norm="rmsnorm", mlp="relu2"), "model.mlp = 'relu2' (nearest that exports: 'swiglu')"),
        (
            dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", logit_softcap=30.0),
            "model.logit_softcap = 30.0 (nearest that exports: 0.0)",
        ),
        (
            dict(pos_emb="rope"),
            "Llama: model.norm = 'layernorm' (nearest that exports: 'rmsnorm'); "
            "model.mlp = 'gelu' (nearest that exports: 'swiglu')",
        ),
        (dict(norm="rmsnorm"), "GPT-2: model.norm = 'rmsnorm' (nearest that exports: 'layernorm')"),
        (
            dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=True),
            "Qwen3: model.bias = True (nearest that exports: False)",
        ),
        (dict(n_kv_head=1), "GPT-2: model.n_kv_head = 1 (nearest that exports: None)"),
    ],
)
def test_switches_no_hf_architecture_expresses_are_refused_naming_the_nearest(tmp_path, switches, blocker):
    model = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16, **switches))
    with pytest.raises(UserError, match="cannot be exported as Hugging Face") as e:
        export_hf(model, None, tmp_path / "hf")
    assert blocker in str(e.value) and str(e.value).endswith("(export it with --safetensors instead)")
    assert not (tmp_path / "hf").exists()


def test_char_and_bpe_tokenizers_export_as_tokenizer_json_autotokenizer_reads_alike(
    shakespeare_path, transformers, tmp_path
):
    text = shakespeare_path.read_text(encoding="utf-8")
    for kind, tok in (
        ("char", train_tokenizer("char", [text], None, eot=True)),
        ("bpe", train_tokenizer("bpe", [text], 1024)),
    ):
        for name, content in hf_files(tok, 256).items():
            (tmp_path / kind).mkdir(exist_ok=True)
            (tmp_path / kind / name).write_text(content)
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / kind)
        ids = tok.encode(text)
        assert theirs(text).input_ids == ids, kind
        assert theirs.decode(ids) == text and theirs.decode([tok.eot_id]) == "<|endoftext|>"
        assert theirs.eos_token_id == tok.eot_id
        # and back in as an hf tokenizer, which counts the same bytes per token (bits per byte)
        again = hf_tokenizer(tmp_path / kind)
        assert again.encode(text[:5000]) == ids[: len(again.encode(text[:5000]))]
        assert np.array_equal(again.token_bytes(), tok.token_bytes())


# ---- Hugging Face tokenizers ----------------------------------------------------------------------------


def test_prepare_with_an_hf_tokenizer_puts_bos_and_eos_around_each_document(transformers, tmp_path):
    save_hf_tokenizer(transformers, tmp_path / "tok", TEXT)
    docs = TEXT.splitlines()[:200]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare_dataset(
        "docs",
        input_path=str(tmp_path / "docs.jsonl"),
        tokenizer=f"hf:{tmp_path / 'tok'}",
        data_dir=tmp_path / "data",
        verbose=False,
        val_fraction=0.1,
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "hf" and meta["dtype"] == "uint16" and meta["eot_id"] == 1
    tok = load_tokenizer(out / "tokenizer.json")
    ids = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert ids[0] == 0 and ids[-1] == 1 and (ids == 0).sum() == (ids == 1).sum() == len(docs)
    texts = [tok.decode(doc) for doc in np.split(ids, np.flatnonzero(ids == 0)[1:])]
    assert sorted(t.removeprefix("<s>").removesuffix("</s>") for t in texts) == sorted(docs)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.prompt_ids(docs[0]) == reference(docs[0]).input_ids  # BOS first, as transformers encodes


def test_an_hf_tokenizer_beyond_65535_ids_writes_uint32_bins(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.split()))
    vocab = {f"<unused{i}>": i for i in range(70_000)} | {w: 70_000 + i for i, w in enumerate(words)}
    vocab |= {"[UNK]": len(vocab), "</s>": len(vocab) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT.splitlines()[:50]))
    out = prepare_dataset(
        "big",
        input_path=str(tmp_path / "docs.jsonl"),
        tokenizer=f"hf:{tmp_path / 'tok'}",
        data_dir=tmp_path / "data",
        verbose=False,
    )
    assert json.loads((out / "meta.json").read_text())["dtype"] == "uint32"
    ids = np.fromfile(out / "train.bin", dtype=np.uint32)
    assert ids.min() >= 70_000 and ids.max() == len(vocab) - 1  # every word above 65535, documents end with </s>


def test_sample_from_an_hf_directory_prepends_bos_and_prints_what_transformers_generates(family_dir, capsys):
    _, directory, hf = family_dir
    tok = hf_tokenizer(directory)
    prompt = "the king and the queen"
    assert (
        sample.main(
            [
                "--ckpt",
                str(directory),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "40",
                "--temperature",
                "0",
                "--no-stream",
            ]
        )
        == 0
    )
    ids = torch.tensor([tok.prompt_ids(prompt)])
    assert ids[0, 0] == 0  # <s>
    new = hf.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=1, pad_token_id=1)[
        0, ids.size(1) :
    ].tolist()
    new = new[: new.index(1)] if 1 in new else new  # a row ends at </s>
    assert capsys.readouterr().out == prompt + tok.decode_after(ids[0].tolist(), new) + "\n"


@pytest.mark.slow
def test_finetuning_an_hf_llama_lowers_the_loss_and_resumes_bit_exact_after_sigterm(transformers, tmp_path):
    """GQA and an HF tokenizer through prepare, init_from, SIGTERM, --resume: the losses of a run that never stopped."""
    directory = tmp_path / "llama"
    save_hf_family(transformers, "llama", directory)
    save_hf_tokenizer(transformers, directory, TEXT)
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in word_salad(60_000, seed=1).splitlines())
    )
    over = {
        "run.init_from": str(directory),
        "data.dataset": "ft",
        "data.input": str(tmp_path / "docs.jsonl"),
        "data.tokenizer": f"hf:{directory}",
        "data.data_dir": str(tmp_path / "data"),
        "run.out_dir": str(tmp_path / "runs"),
        "run.name": "ft",
        "run.device": "cpu",
        "model.block_size": 32,
        "model.dropout": 0.1,
        "training.batch_size": 4,
        "training.max_iters": 400,
        "training.eval_interval": 0,
        "training.log_interval": 1,
        "training.save_interval": 1000,
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_iters": 2,
        "optimizer.lr_decay_iters": 400,
        "logging.plot": False,
    }
    train_until_sigterm(over, 20, timeout=120)
    run = RunDir(tmp_path / "runs" / "ft")
    assert 20 <= load_checkpoint(run.latest())["iter_num"] < 400
    resume_in_subprocess(run.path, 40)
    train(overrides={**over, "run.out_dir": str(tmp_path / "straight"), "training.max_iters": 40})
    straight = losses(tmp_path / "straight" / "ft")
    assert losses(run.path) == straight and max(straight) == 40
    assert np.mean([straight[i] for i in range(36, 41)]) < np.mean([straight[i] for i in range(1, 6)]) - 1.0
    ckpt = load_checkpoint(run.latest())
    assert ckpt["model_args"]["n_kv_head"] == 2 and ckpt["tokenizer"]["kind"] == "hf"


# ---- bad input -------------------------------------------------------------------------------------------


def breakages():
    def arch(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))

    def field(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["num_attention_heads"]
        (d / "config.json").write_text(json.dumps(cfg))

    def shard(d):
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        index = {
            "weight_map": {
                "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                "model.norm.weight": "model-00002-of-00002.safetensors",
            }
        }
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    def shape(d):
        state = load_file(d / "model.safetensors")
        state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})

    def tokenizer(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 200}))
        state = load_file(d / "model.safetensors")
        state = {k: v[:200] if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in state.items()}
        save_file(state, d / "model.safetensors", metadata={"format": "pt"})

    def pickle_only(d):
        (d / "model.safetensors").rename(d / "pytorch_model.bin")

    def no_tokenizer(d):
        (d / "tokenizer.json").unlink()

    return [
        (
            arch,
            "architecture 'FalconForCausalLM' is not supported (supported: GPT2LMHeadModel, LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, "
            "Olmo2ForCausalLM, SmolLM3ForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM)",
        ),
        (field, "config.json has no integer num_attention_heads, which a Llama model needs"),
        (shard, "shard model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing"),
        (shape, "tensor model.layers.1.self_attn.k_proj.weight has shape [16, 64], but config.json implies [32, 64]"),
        (tokenizer, "has 300 tokens, more than the model's 200 embedding rows: it is not this model's tokenizer"),
        (pickle_only, "has only pytorch_model.bin weights: a pickle, which can run code when loaded"),
        (no_tokenizer, "records no tokenizer (a Hugging Face directory needs its tokenizer.json)"),
    ]


@pytest.fixture(scope="module")
def llama_dir(transformers, tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_hf_family(transformers, "llama", directory)
    save_hf_tokenizer(transformers, directory, TEXT)
    return directory


@pytest.mark.parametrize("break_it, message", breakages(), ids=lambda x: getattr(x, "__name__", ""))
def test_bad_hf_directories_are_one_line_errors_exit_2(llama_dir, tmp_path, capsys, break_it, message):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    break_it(broken)
    with pytest.raises(SystemExit) as e:
        run_main(lambda: sample.main(["--ckpt", str(broken), "--prompt", "the", "--max-new-tokens", "4"]))
    assert e.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {broken}") and message in line


@pytest.mark.slow
def test_fine_tuning_from_a_pickle_only_directory_exits_2_and_writes_nothing(llama_dir, tmp_path):
    import shutil

    shutil.copytree(llama_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "pytorch_model.bin")
    (tmp_path / "docs.txt").write_text(TEXT)
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"--run.init_from={tmp_path / 'm'}",
            "--data.dataset=d",
            f"--data.input={tmp_path / 'docs.txt'}",
            f"--data.tokenizer=hf:{tmp_path / 'm'}",
            f"--data.data_dir={tmp_path / 'data'}",
            f"--run.out_dir={tmp_path / 'runs'}",
            "--model.block_size=32",
            "--max-iters=2",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "has only pytorch_model.bin weights" in line and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_hub_name_offline_is_one_line_naming_the_local_alternative(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UserError,
        match=r"^HuggingFaceTB/SmolLM2-135M is a Hugging Face hub model, but HF_HUB_OFFLINE "
        r"is set; download it where there is network \(huggingface-cli download ",
    ):
        load_model("HuggingFaceTB/SmolLM2-135M")


def test_validate_estimates_the_init_from_model_not_the_config(llama_dir, tmp_path, capsys):
    (tmp_path / "docs.txt").write_text(TEXT)
    train(
        overrides={
            "run.init_from": str(llama_dir),
            "data.dataset": "d",
            "data.input": str(tmp_path / "docs.txt"),
            "data.tokenizer": f"hf:{llama_dir}",
            "data.data_dir": str(tmp_path / "data"),
            "run.out_dir": str(tmp_path / "runs"),
            "model.block_size": 32,
            "model.n_layer": 12,
            "training.batch_size": 2,
            "training.max_iters": 2,
        },
        validate_only=True,
    )
    model = load_model(llama_dir).model
    assert f"model: {model.num_params() / 1e6:.2f}M parameters, block 32, vocab 300" in capsys.readouterr().out


def test_eval_scores_an_hf_directory_within_its_context(llama_dir, tmp_path):
    from quillgpt.evaluate import EvalRequest, evaluate

    (tmp_path / "t.txt").write_text(TEXT[:3000])
    report = evaluate(EvalRequest(ckpt=str(llama_dir), text=(str(tmp_path / "t.txt"),), context=48))
    assert report["model_args"]["block_size"] == 48 and 0 < report["text"][0]["bpb"] < 20


def test_every_preset_trains_a_model_that_exports_to_hugging_face():
    """Every dense preset exports; the MoE preset (the Quickstart's GPT-2 model with experts, which no Hugging Face
    family has) is refused naming its experts, and goes out as --safetensors."""
    from quillgpt.config import build_config, load_toml
    from quillgpt.families import export_family

    families = {}
    for path in sorted((REPO_ROOT / "configs").rglob("*.toml")):
        cfg = build_config(load_toml(path), source=str(path))
        model = GPTConfig.from_dict({**cfg.model_args(), "vocab_size": 65})
        if cfg.run.init_from == "scratch" and not model.n_experts:
            families[path.name] = export_family(model, str(path))
        elif cfg.run.init_from == "scratch":
            with pytest.raises(UserError, match="model.n_experts"):
                export_family(model, str(path))
    assert families["speedrun_cpu.toml"] == "qwen3" and families["cpu.toml"] == "gpt2" and len(families) >= 5


def test_sentencepiece_style_continuations_keep_their_leading_space(tmp_path):
    """A Metaspace tokenizer (Llama 2, TinyLlama) drops the leading space when ids are decoded alone: samples are
    decoded after the prompt's last ids instead, and such a tokenizer encodes long text whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    (tmp_path / "sp").mkdir()
    tok.save(str(tmp_path / "sp" / "tokenizer.json"))
    (tmp_path / "sp" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    sp = hf_tokenizer(tmp_path / "sp")
    assert not sp.byte_level and sp.encode(TEXT[:5000]) == tok.encode(TEXT[:5000]).ids
    prompt, rest = sp.encode("the king"), sp.encode("the king and the queen")[len(sp.encode("the king")) :]
    assert sp.decode(rest) == "and the queen"  # alone: the space is lost
    assert sp.decode_after(prompt, rest) == " and the queen"
