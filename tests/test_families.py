"""The families people fine-tune now (quillgpt/families.py): Mistral, Gemma 3, Phi-3/4, OLMo 2 and SmolLM3, each a
set of model.py's switches, against transformers' own implementations on tiny random models transformers writes
(tests/conftest.py's HF_FAMILY_CONFIGS: sliding windows of 8 positions, which every sequence here runs past, Gemma's
query scale and two rope bases, Phi's partial rotary and LongRoPE, SmolLM3's NoPE layer). In: logits and 48 greedy
tokens; out: export.py --hf writes the same family with our logits; a fine-tune step's loss and the step after it
are transformers'; PEFT adapters go both ways; what model.py cannot reproduce is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, save_hf_family, save_hf_tokenizer, word_salad
from test_lora import built_trainer, logits, lora_overrides, lora_run, max_diff

import export
import sample
from quillgpt.engine import KVCache, generate
from quillgpt.errors import UserError, run_main
from quillgpt.hf import export_hf
from quillgpt.loading import load_model
from quillgpt.moe import moe_layers

FAMILIES = ["mistral", "gemma3", "phi3", "olmo2", "smollm3", "qwen3_moe", "olmoe", "mixtral"]
WINDOW = 8  # the sliding windows of the tiny Mistral, Gemma 3 (its sliding layer) configs
T = 60  # positions a test runs: past every window; Phi's original context (64) holds them


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, transformers, tmp_path_factory):
    """(family, directory, transformers' model): a tiny random model of the family and a BPE tokenizer, saved."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_family(transformers, request.param, directory)
    save_hf_tokenizer(transformers, directory, word_salad(30_000))
    return request.param, directory, hf


X = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(0))


def test_logits_and_greedy_decoding_equal_transformers(family_dir):
    family, directory, hf = family_dir
    model = load_model(directory).model.eval()
    assert model.config.hf_family == family
    assert max_diff(logits(model, X), logits(hf, X)) <= 1e-5
    prompt = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    theirs = hf.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False, eos_token_id=None)
    assert torch.equal(generate(model, prompt, 48, temperature=0), theirs)  # the KV cache past every window


def test_loading_a_family_directory_leaves_torch_compile_unimported(transformers, tmp_path):
    """A model is built on the meta device to be given its weights, and is not initialised there (model.embedding,
    MoE.init_experts): normal_ on a meta tensor imports torch._dynamo, a second of every sample.py start from a
    Hugging Face directory. A dense family and an MoE one, loaded in a fresh process."""
    directories = []
    for family in ("gemma3", "qwen3_moe"):
        save_hf_family(transformers, family, tmp_path / family)
        save_hf_tokenizer(transformers, tmp_path / family, word_salad(3_000))
        directories.append(str(tmp_path / family))
    code = (
        "import sys; from quillgpt.loading import load_model\n"
        f"for d in {directories!r}: load_model(d)\n"
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_export_writes_the_same_family_with_our_logits(family_dir, transformers, tmp_path):
    family, directory, hf = family_dir
    loaded = load_model(directory)
    assert export_hf(loaded.model, loaded.tokenizer, tmp_path, str(directory)) == []
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    assert max_diff(logits(back, X), logits(loaded.model, X)) <= 1e-5
    assert max_diff(logits(load_model(tmp_path).model, X), logits(loaded.model, X)) <= 1e-5  # and back in


def test_a_fine_tune_step_gives_transformers_losses(family_dir, transformers):
    """The loss of a batch, and after one SGD step on it (their gradients, our gradients), the loss again: equal to
    transformers' within 1e-5, attention windows and all."""
    family, directory, _ = family_dir
    ours = load_model(directory).model.train()
    for layer in moe_layers(ours):  # transformers' loss is the cross-entropy alone (output_router_logits false)
        layer.aux_loss_coef = layer.z_loss_coef = 0.0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    losses = []
    for model, loss_of in (
        (ours, lambda: ours(X[:, :-1], targets=X[:, 1:])[1]),
        (theirs, lambda: theirs(input_ids=X, labels=X).loss),
    ):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        first = loss_of()
        first.backward()
        optimizer.step()
        with torch.no_grad():
            losses.append((first.item(), loss_of().item()))
    (a0, a1), (b0, b1) = losses
    assert abs(a0 - b0) <= 1e-5 and abs(a1 - b1) <= 1e-5 and abs(a1 - a0) > 1e-3


def test_peft_adapters_go_out_and_come_back_with_peft_s_logits(family_dir, transformers, tmp_path):
    peft = pytest.importorskip("peft")
    family, directory, _ = family_dir
    x = X[:, :24]  # within the LoRA runs' context
    if family == "phi3":  # its fused qkv_proj and gate_up_proj hold one PEFT adapter where model.py has several
        run = lora_run(directory, tmp_path, **{"training.max_iters": 1})
        with pytest.raises(UserError, match="PEFT adapters are written for"):
            export.main(["--ckpt", str(run), "--peft", str(tmp_path / "adapter")])
        return
    run = lora_run(directory, tmp_path, **{"training.max_iters": 2})
    assert export.main(["--ckpt", str(run), "--peft", str(tmp_path / "adapter")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert max_diff(logits(theirs, x), logits(load_model(run, keep_adapters=True).model, x)) <= 1e-5
    moe = family in ("qwen3_moe", "olmoe", "mixtral")  # its MLPs are experts: adapters on attention only
    written = peft_adapter(
        peft, transformers, directory, ["q_proj", "o_proj"] if moe else ["q_proj", "o_proj", "up_proj"]
    )
    written.save_pretrained(tmp_path / "theirs")
    over = lora_overrides(directory, tmp_path / "in", **{"lora.adapters": str(tmp_path / "theirs")})
    assert max_diff(logits(built_trainer(over).raw_model, x), logits(written.eval(), x)) <= 1e-5
    if family in ("qwen3_moe", "olmoe"):  # PEFT's adapters on transformers' fused experts: refused in one line
        peft_adapter(peft, transformers, directory, ["gate_proj", "up_proj"]).save_pretrained(tmp_path / "experts")
        over = lora_overrides(directory, tmp_path / "ex", **{"lora.adapters": str(tmp_path / "experts")})
        with pytest.raises(UserError, match="adapters on a mixture of experts' experts"):
            built_trainer(over)


def peft_adapter(peft, transformers, directory, targets: list[str]):
    """PEFT's own LoRA adapters (random B: not the identity) on the directory's model."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory), config)


@pytest.mark.parametrize("family_dir", ["mistral", "gemma3"], indirect=True)
def test_a_window_hides_what_lies_past_it_in_training_packed_rows_and_batched_decoding(family_dir):
    """The window's band mask changes the logits past it and only there; packed rows see it within each document;
    rows decoded a step apart (the server's batched step, a masked cache) give the full pass's logits."""
    family, directory, _ = family_dir
    model, x = load_model(directory).model.eval(), X[:1]
    windowed = logits(model, x)
    unwindowed = load_model(directory).model
    for block in unwindowed.transformer.h:
        block.attn.window = 0
    full = logits(unwindowed, x)
    assert max_diff(windowed[:, :WINDOW], full[:, :WINDOW]) <= 1e-6 < max_diff(windowed[:, WINDOW:], full[:, WINDOW:])
    split = 20  # two documents in one row, at their own positions
    positions = torch.cat([torch.arange(split), torch.arange(T - split)])[None]
    with torch.no_grad():
        packed = model(x, positions=positions)[0]
    alone = torch.cat([logits(model, x[:, :split]), logits(model, x[:, split:])], dim=1)
    assert max_diff(packed, alone) <= 1e-5
    # two rows a step apart (the server's batch: each row at its own position, the span masked per row)
    cache = KVCache.for_model(model, 2, T + 1)
    steps = []
    with torch.no_grad():
        for i in range(T + 1):
            rows = 1 if i == 0 else 2  # row 1 starts a step later, so the rows' positions differ
            tokens = torch.stack([x[0, min(i, T - 1)], x[0, max(i - 1, 0)]])[:rows, None]
            cache.prepare(rows, 1)
            out = model(tokens, cache=cache)[0][:, -1]
            cache.advance()
            steps.append(out[1] if rows == 2 else None)
            if i < T:
                assert max_diff(out[0], windowed[0, i]) <= 1e-5
    assert max_diff(torch.stack(steps[1:]), windowed[0]) <= 1e-5


def test_a_lora_fine_tune_of_gemma3_trains_and_samples(transformers, tmp_path, capsys):
    directory = tmp_path / "gemma3"
    save_hf_family(transformers, "gemma3", directory)
    save_hf_tokenizer(transformers, directory, word_salad(30_000))
    run = lora_run(directory, tmp_path, **{"training.max_iters": 6})
    history = json.loads((run / "train_log.json").read_text())["history"]
    assert [p["iter"] for p in history if p["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    capsys.readouterr()
    assert sample.main(["--ckpt", str(run), "--prompt", "the king", "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("the king")


def edited(directory, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **changes}))
    return copy


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0, which model.py cannot"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention is True"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "it uses sliding-window attention"),
        (
            "phi3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope scaling 'dynamic' is not supported",
        ),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act is 'gelu', which model.py cannot reproduce"),
    ],
)
def test_what_model_py_cannot_reproduce_is_refused_in_one_line(
    transformers, tmp_path, capsys, family, changes, message
):
    directory = tmp_path / family
    save_hf_family(transformers, family, directory)
    save_hf_tokenizer(transformers, directory, word_salad(5_000))
    broken = edited(directory, tmp_path, **changes)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(lambda: sample.main(["--ckpt", str(broken), "--prompt", "the", "--max-new-tokens", "2"]))
    [line] = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and line.startswith(f"error: {broken}") and message in line


@pytest.mark.parametrize("prompt_length", [12, 70])
def test_phi3_past_its_original_context_takes_the_long_factors_as_transformers_does(
    transformers, tmp_path, prompt_length
):
    """LongRoPE: a forward pass that reaches past original_max_position_embeddings (64 here, of 128) takes the long
    factors, as transformers decides by the sequence's length; keys cached before keep the short ones. A prompt
    within the original context whose reply runs past it, and a prompt past it, give transformers' greedy tokens."""
    hf = save_hf_family(transformers, "phi3", tmp_path)
    save_hf_tokenizer(transformers, tmp_path, word_salad(5_000))
    model = load_model(tmp_path).model.eval()
    assert model.config.block_size == 128 and model.config.rope_long_factors == [1.0, 3.0, 5.0, 9.0]
    prompt = torch.randint(2, 300, (1, prompt_length), generator=torch.Generator().manual_seed(2))
    new = 110 - prompt_length
    theirs = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
    assert torch.equal(generate(model, prompt, new, temperature=0), theirs)
    assert max_diff(logits(model, theirs[:, :100]), logits(hf, theirs[:, :100])) <= 1e-5


@pytest.mark.parametrize(
    "family, rope_scaling",
    [
        ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        ("gemma3", {"rope_type": "linear", "factor": 4.0}),
        ("mistral", {"type": "linear", "factor": 4.0}),  # a "type" key, as older files name it
    ],
)
def test_a_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(
    transformers, tmp_path, family, rope_scaling
):
    """transformers 5 lets a config.json's rope_scaling replace its rope_parameters (losing their rope_theta), or
    on Gemma 3 be merged into its global layers'; ours reads the two as it does: the same logits, or a refusal in
    one line where model.py has no such scaling for the family (Mistral: none)."""
    directory = tmp_path / family
    save_hf_family(transformers, family, directory)
    save_hf_tokenizer(transformers, directory, word_salad(5_000))
    changed = edited(directory, tmp_path, rope_scaling=rope_scaling)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(changed).eval()
    if family == "mistral":
        with pytest.raises(UserError, match="rope scaling 'linear' is not supported for this family"):
            load_model(changed)
        return
    assert max_diff(logits(load_model(changed).model.eval(), X), logits(theirs, X)) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "mixtral", "smollm3", "gemma3", "phi3"])
def test_rope_settings_are_read_from_config_json_as_transformers_5_reads_them(transformers, tmp_path, family):
    """families.rope_parameters against transformers' own config classes, for every way a config.json may say it:
    rope_parameters alone, with a rope_scaling beside it, the older top-level rope_theta and rope_scaling, a "type"
    key, and nothing at all (each family's own default theta)."""
    from quillgpt.families import rope_parameters

    directory = tmp_path / family
    save_hf_family(transformers, family, directory)
    base = json.loads((directory / "config.json").read_text())
    base = {k: v for k, v in base.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    scaled = {"rope_type": "longrope" if family == "phi3" else "linear", "factor": 2.0}
    if family == "phi3":
        scaled.update(short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 2.1, 2.2, 2.3])
    variants = [
        {},
        {"rope_theta": 1234.0},
        {"rope_theta": 1234.0, "rope_scaling": scaled},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 99.0}, "rope_scaling": scaled},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 99.0}},
        {"rope_scaling": {**scaled, "type": scaled["rope_type"], "rope_type": None}},
    ]
    if family == "gemma3":  # its rope_parameters are by the kind of layer (a flat dict fails transformers itself)
        variants = [v for v in variants if "rope_parameters" not in v]
        variants.append({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5.0}}})
        variants.append({"rope_parameters": {"full_attention": {"rope_theta": 5.0}}, "rope_scaling": scaled})
    for variant in variants:
        variant = {k: v for k, v in variant.items() if v is not None}
        if "rope_scaling" in variant:
            variant["rope_scaling"] = {k: v for k, v in variant["rope_scaling"].items() if v is not None}
        hf = {**base, **variant}
        (directory / "config.json").write_text(json.dumps(hf))
        config = transformers.AutoConfig.from_pretrained(directory)
        expected = config.rope_parameters
        for layer in ("full_attention", "sliding_attention") if family == "gemma3" else ("full_attention",):
            want = expected[layer] if family == "gemma3" else expected
            got = rope_parameters(hf, "gemma3" if family == "gemma3" else family, layer)
            assert {k: v for k, v in got.items() if k != "type"} == {k: v for k, v in want.items() if k != "type"}, (
                variant,
                layer,
            )
