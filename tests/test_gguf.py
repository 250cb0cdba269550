"""export.py --gguf: GGUF files for llama.cpp and Ollama, per architecture and outtype.

Every file is read back with gguf.GGUFReader (metadata, tensor names, shapes and types). When llama-cpp-python is
installed (pip install '.[llama]'; it builds llama.cpp from source), llama.cpp itself reads each file: it must
tokenize a prompt as we do, give our logits (f32 within F32_TOLERANCE; f16, bf16 and q8_0 within theirs, and every
rounded outtype q4_0 included within FILE_WEIGHTS_TOLERANCE of our model holding the file's rounded weights) and
greedy-decode the same 32 tokens from an f32 file.

Models: tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3, OLMo 2, SmolLM3, Qwen3-MoE, OLMoE and Mixtral
directories saved by transformers (with a byte-level BPE tokenizer.json; Mistral and Mixtral without their window,
SmolLM3 with four layers, Qwen3-MoE without its dense first layer, OLMoE without grouped-query attention: the shapes
llama.cpp reproduces), and our own tiny models in a .safetensors file: GPT-2 with a char tokenizer and with
tiktoken's gpt2, Llama with q/k/v biases and a char tokenizer, the modern recipe (rope, RMSNorm, SwiGLU, QK-norm:
Qwen3) with our BPE, OLMo 2's switches with a tied head; and a LoRA run on the Llama directory, exported merged
(--merge). What llama.cpp fixes in its code (windows, NoPE layers, Gemma 3's global layers, dense layers among
experts, whether the experts' weights are renormalised) is refused in one line.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, gpt2_encoding_error, require_llama_cpp, save_hf_family, save_hf_tokenizer, word_salad
from safetensors.torch import load_file, save_file
from test_lora import lora_run

import export
from model import GPT, GPTConfig
from quillgpt.chat_template import chat_format, with_chat_tokens
from quillgpt.engine import generate
from quillgpt.errors import UserError
from quillgpt.families import chunk_of, hf_names
from quillgpt.gguf_export import gguf_arch, modelfile
from quillgpt.hf import piece_sizes
from quillgpt.loading import load_model, write_safetensors
from quillgpt.tokenizer import tokenizer_from_dict, train_tokenizer

gguf = pytest.importorskip("gguf")

PROMPT = "The king and the queen naïve café 🦙 said: 'hello'  \n\n  there 12345"
TEXT = word_salad(20_000) + "naïve café — “quotes” 日本語 🦙 x: 'hello' 12345\n"
# a char vocabulary of ASCII characters only has no merges (nanoGPT's Shakespeare char model's case)
ASCII_PROMPT = "The king and the queen said: 'hello'  \n\n  there 12345"
ASCII_TEXT = word_salad(20_000) + ASCII_PROMPT
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama, Qwen2, Qwen3, Mistral, Phi-3, OLMo 2 and SmolLM3 files in f32 give our logits to about 1e-5. llama.cpp's
# GPT-2 and Gemma 3 compute GELU through a float16 table (ggml's GGML_GELU_FP16) whatever GELU form the model has,
# which rounds each activation: GPT-2's logits differ from ours by about 5e-4 of the largest logit, Gemma 3's by 2e-4
# (a tanh GELU rounded through float16 here comes within 2e-4 and 7e-5)
F32_TOLERANCE = 1e-3
GELU_TABLE_F32_TOLERANCE = 1e-3  # of the largest logit
GELU_TABLE_ARCHITECTURES = ("gpt2", "gemma3")
# f16, bf16 and q8_0 round the weights (and q8_0 the activations in its dot products): the largest logit difference
# as a fraction of the largest logit (measured on these models: at most 0.0034, 0.028 and 0.095). q4_0 has none: its
# rounding alone moves these random models' logits by 25-80% of the largest one (our model with the file's weights,
# in PyTorch, moves as far), so only the check against the file's weights below says whether llama.cpp runs it right
ROUNDED_TOLERANCE = {"f16": 0.01, "bf16": 0.05, "q8_0": 0.15}
# against our model holding the weights as the file rounds them, what is left is llama.cpp's own arithmetic: it rounds
# the activations too, to float16, bfloat16 or (for q8_0 and q4_0 matrices) 8-bit blocks (measured: at most 0.0027,
# 0.016, 0.053 and 0.053 of the largest logit)
FILE_WEIGHTS_TOLERANCE = {"f16": 0.01, "bf16": 0.05, "q8_0": 0.1, "q4_0": 0.1}
ROPE_SWITCHES = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # Llama's, off GPTConfig's GPT-2
OURS = {
    "gpt2-char": ("char", {}),
    "gpt2-char-ascii": ("char", {}),  # trained on ASCII_TEXT: no merges
    "gpt2-char-chat": ("char", {}),  # with ChatML's <|im_start|> and <|im_end|> added (with_chat_tokens)
    "gpt2-tiktoken": ("gpt2", {}),
    "llama-char": ("char", dict(ROPE_SWITCHES, qkv_bias=True, n_kv_head=2)),
    "qwen3-bpe": ("bpe", dict(ROPE_SWITCHES, qk_norm=True, n_kv_head=2, head_dim=32)),
    # OLMo 2's switches with a tied head, which llama.cpp's olmo2 reads only as output.weight
    "olmo2-char-tied": (
        "char",
        dict(ROPE_SWITCHES, qk_norm=True, qk_norm_scope="all", pre_norm=False, post_norm=True, n_kv_head=2),
    ),
    # rows of 48, which no 32-value block divides, but for ffn_down's 128; an untied head
    "llama-char-48": ("char", dict(ROPE_SWITCHES, n_kv_head=2, n_embd=48, mlp_hidden=128, tie_embeddings=False)),
}
ARCHITECTURE = {
    "gpt2-char": "gpt2",
    "gpt2-char-ascii": "gpt2",
    "gpt2-char-chat": "gpt2",
    "gpt2-tiktoken": "gpt2",
    "llama-char": "llama",
    "qwen3-bpe": "qwen3",
    "llama-char-48": "llama",
    "olmo2-char-tied": "olmo2",
    "llama-hf": "llama",
    "qwen2-hf": "qwen2",
    "qwen3-hf": "qwen3",
    "llama-hf-lora": "llama",  # a LoRA run on llama-hf, exported with --merge (its adapters folded in)
    # the later families (LATER_FAMILIES)
    "mistral-hf": "llama",  # as llama.cpp's converter writes Mistral
    "gemma3-hf": "gemma3",
    "phi3-hf": "phi3",
    "olmo2-hf": "olmo2",
    "smollm3-hf": "smollm3",
    # the mixtures of experts (MOE_FAMILIES)
    "qwen3_moe-hf": "qwen3moe",
    "olmoe-hf": "olmoe",
    "mixtral-hf": "llama",  # llama with experts, as llama.cpp's converter writes Mixtral
    "mixtral-8x-hf": "llama",  # 8 experts, Mixtral's count: for q4_0's 8-bit keys and values
}
# conftest's family configs as llama.cpp reproduces them: Mistral without its window (llama.cpp's llama has none),
# SmolLM3 with four layers, the 4th without rope (llama.cpp's smollm3 leaves rope out of every 4th layer, no other)
# The mixtures of experts: Qwen3-MoE without its dense first layer (llama.cpp's qwen3moe has experts in every layer),
# OLMoE with as many key heads as heads (llama.cpp's olmoe has no grouped-query attention), Mixtral without its window
HF_OVERRIDES = {
    "mistral": dict(sliding_window=None),
    "smollm3": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),
    "qwen3_moe": dict(mlp_only_layers=[]),
    "olmoe": dict(num_key_value_heads=4),
    "mixtral": dict(sliding_window=None),
    # Phi-3 with an original context llama.cpp can run within (it rounds n_ctx up to 256): its short factors there
    "phi3": dict(max_position_embeddings=512, original_max_position_embeddings=256),
}
HF_VARIANTS = {"mixtral-8x": ("mixtral", dict(num_local_experts=8))}  # case -> (family, its config beyond conftest's)
LATER_FAMILIES = ("mistral-hf", "gemma3-hf", "phi3-hf", "olmo2-hf", "smollm3-hf")
MOE_FAMILIES = ("qwen3_moe-hf", "olmoe-hf", "mixtral-hf")
IN_PROCESS_F32 = (*LATER_FAMILIES, *MOE_FAMILIES, "mixtral-8x-hf", "olmo2-char-tied")  # see exported
PRE = {"char": "gpt-2", "tiktoken": "gpt-2", "bpe": "llama-bpe", "hf": "gpt-2"}  # by tokenizer kind
# llama-char-48 is for q4_0's fallbacks, mixtral-8x-hf for q4_0's 8-bit keys and values
CASES = [name for name in ARCHITECTURE if name not in ("llama-char-48", "mixtral-8x-hf")]


def sharpen(model: torch.nn.Module) -> None:
    """Weights large enough for logits of a few units, norms and biases off their 1s and 0s (a norm or bias in the
    wrong place shows)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(3 if p.std() > 0.05 else 10)


def our_model(name: str, directory: Path) -> Path:
    """One of OURS as a .safetensors file (write_safetensors), the way our checkpoints reach export.py."""
    kind, switches = OURS[name]
    if kind == "gpt2":
        if gpt2_encoding_error() is not None:
            pytest.skip(gpt2_encoding_error())
        tok = tokenizer_from_dict({"kind": "tiktoken", "name": "gpt2"})
    else:
        text = ASCII_TEXT if name.endswith("-ascii") else TEXT
        tok = train_tokenizer(kind, [text], 400 if kind == "bpe" else None, eot=True)
    if name.endswith("-chat"):
        tok = with_chat_tokens(tok)
    torch.manual_seed(0)
    shape = dict(block_size=128, vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_embd=64)
    model = GPT(GPTConfig(**shape | switches))
    sharpen(model.eval())
    tokenizer = tok.to_dict()
    if kind == "bpe":
        tokenizer["chat_template"] = CHATML
    path = directory / f"{name}.safetensors"
    write_safetensors(model, tokenizer, path)
    return path


def hf_model(transformers, name: str, directory: Path) -> Path:
    family, variant = HF_VARIANTS.get(name.removesuffix("-hf"), (name.removesuffix("-hf"), {}))
    save_hf_family(transformers, family, directory, **HF_OVERRIDES.get(family, {}), **variant)
    save_hf_tokenizer(transformers, directory, TEXT)
    state = load_file(directory / "model.safetensors")
    sharpen_state = {k: v * 10 if v.ndim == 2 else v for k, v in state.items()}  # transformers' 0.02 init: tiny logits
    save_file(sharpen_state, directory / "model.safetensors", metadata={"format": "pt"})
    if family == "qwen2":  # Qwen2 goes out as Qwen2 with Qwen's own tokenizer (hf.py); otherwise as Llama
        config_file = directory / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    return directory


@pytest.fixture(scope="module")
def source(request, tmp_path_factory):
    """case name -> the model export.py reads (made once per module)."""
    made = {}

    def make(name: str) -> Path:
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            if name in OURS:
                made[name] = our_model(name, directory)
            elif name.endswith("-lora"):
                made[name] = lora_run(make(name.removesuffix("-lora")), directory, **{"model.block_size": 128})
            else:
                made[name] = hf_model(request.getfixturevalue("transformers"), name, directory)
        return made[name]

    return make


def run_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "export.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """(case, outtype) -> the GGUF file. f32 goes through export.py in a subprocess (the command a user runs); the
    other outtypes, and the later families' files, through export.main in this process, which keeps the file's
    runtime short (a subprocess costs ~5 s of CPU to import torch)."""
    made = {}

    def make(name: str, outtype: str = "f32") -> Path:
        if (name, outtype) not in made:
            out = tmp_path_factory.mktemp(f"{name}-{outtype}") / f"{name}.gguf"
            args = ["--ckpt", str(source(name)), "--gguf", str(out), "--outtype", outtype]
            args += ["--merge"] if name.endswith("-lora") else []
            if outtype == "f32" and name not in IN_PROCESS_F32:
                result = run_export(*args)
                assert result.returncode == 0, result.stderr
                assert f"wrote {out}" in result.stdout and "ollama create NAME -f" in result.stdout
            else:
                assert export.main(args) == 0
            made[name, outtype] = out
        return made[name, outtype]

    return make


def field(reader, key: str):
    f = reader.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))] if len(f.data) < 10 else len(f.data)
    return f.contents()


# ---- the file, read back without llama.cpp ---------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_every_architecture_writes_its_metadata_tensors_and_modelfile(source, exported, name):
    path = exported(name)
    loaded = load_model(source(name))
    model, c = loaded.model, loaded.model.config
    reader = gguf.GGUFReader(path)
    arch = ARCHITECTURE[name]
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.block_count") == c.n_layer and field(reader, f"{arch}.context_length") == c.block_size
    assert field(reader, f"{arch}.embedding_length") == c.n_embd
    assert field(reader, f"{arch}.attention.head_count_kv") == c.kv_heads
    assert field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == PRE[loaded.tokenizer["kind"]]
    assert field(reader, "tokenizer.ggml.tokens") == c.vocab_size
    if name.endswith("-ascii"):  # llama.cpp needs the key, empty or not
        assert field(reader, "tokenizer.ggml.merges") == []
    assert field(reader, "tokenizer.ggml.add_bos_token") == (loaded.tokenizer.get("bos_id") is not None)
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape]) for t in reader.tensors}
    assert tensors["token_embd.weight"] == ("F32", [c.n_embd, c.vocab_size])  # GGUF lists shapes innermost first
    assert all(kind == "F32" for kind, _ in tensors.values())
    # Llama: a zero o_proj bias with q/k/v biases; Gemma 3: four norms and qk-norm; Phi-3: fused qkv and gate-up;
    # experts: the router and three stacks in place of the three projections (Mixtral: llama with experts)
    per_block = {"gpt2": 12, "llama": 9 + 4 * c.qkv_bias + bool(c.n_experts), "qwen2": 12, "qwen3": 11, "gemma3": 13}
    per_block = {**per_block, "phi3": 6, "olmo2": 11, "smollm3": 9, "qwen3moe": 12, "olmoe": 12}[arch]
    rope_tensors = {"none": 0, "llama3": 1, "longrope": 2, "linear": 0}[c.rope_scaling]  # rope_freqs, or rope_factors
    output = not c.tie_embeddings or arch in ("olmo2", "olmoe")  # a tied head goes in as output.weight too there
    top = 2 + (arch == "gpt2") * 2 + output + rope_tensors
    assert len(tensors) == c.n_layer * per_block + top
    if arch == "qwen3":
        assert tensors["blk.1.attn_q_norm.weight"] == ("F32", [c.head_width])
    n_params = sum(t.numel() for k, t in model.state_dict().items() if k != "lm_head.weight" or not c.tie_embeddings)
    assert sum(int(t.n_elements) for t in reader.tensors) >= n_params  # and the zero biases GPT-2 or Llama may add
    modelfile_text = path.with_suffix(".Modelfile").read_text()
    assert modelfile_text.startswith(f"# ollama create NAME -f {name}.Modelfile\nFROM ./{name}.gguf\n")
    assert sorted(p.name for p in path.parent.iterdir()) == [f"{name}.Modelfile", f"{name}.gguf"]  # no temp file left


# what llama.cpp reads of each later family beyond the keys every file has (None: the key must be absent), and tensor
# shapes as GGUF lists them, innermost first (None: the tensor must be absent)
FAMILY_KEYS = {
    "mistral-hf": {"llama.attention.sliding_window": None},
    "gemma3-hf": {
        "gemma3.attention.sliding_window": 8,
        "gemma3.attention.sliding_window_pattern": 2,  # layer 1 of each 2 is global
        "gemma3.rope.freq_base": 1e6,
        "gemma3.rope.freq_base_swa": 1e4,
        "gemma3.rope.scaling.type": "linear",  # the global layers' only, in llama.cpp's gemma3
        "gemma3.rope.scaling.factor": 2.0,
        "gemma3.final_logit_softcapping": 30.0,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.scale": None,  # llama.cpp's gemma3 derives its own: ours goes into attn_q_norm
    },
    "phi3-hf": {
        "phi3.context_length": 512,  # max_position_embeddings: past the original 256 the long factors
        "phi3.rope.dimension_count": 8,  # half of the head's 16 (partial_rotary_factor 0.5)
        "phi3.rope.scaling.original_context_length": 256,
        "phi3.rope.scaling.attn_factor": (1 + np.log(2) / np.log(256)) ** 0.5,  # from 512 / 256
        "phi3.attention.sliding_window": 0,
    },
    "olmo2-hf": {"olmo2.attention.sliding_window": None},
    "smollm3-hf": {"smollm3.block_count": 4, "smollm3.rope.dimension_count": 16},
    # the experts: how many, how many a token takes, their width; whether the chosen weights are renormalised is
    # each architecture's own (qwen3moe and llama: always, olmoe: never), read from no key
    "qwen3_moe-hf": {
        "qwen3moe.expert_count": 4,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": 48,
        "qwen3moe.feed_forward_length": 96,  # the dense MLP's, as the converter writes it (unused: no dense layer)
        "qwen3moe.expert_weights_norm": None,
    },
    "olmoe-hf": {
        "olmoe.expert_count": 4,
        "olmoe.expert_used_count": 2,
        "olmoe.feed_forward_length": 96,  # the experts' width
        "olmoe.expert_feed_forward_length": None,
        "olmoe.attention.head_count_kv": 4,
    },
    "mixtral-hf": {
        "llama.expert_count": 4,
        "llama.expert_used_count": 2,
        "llama.feed_forward_length": 96,  # the experts' width
        "llama.attention.sliding_window": None,
    },
}
FAMILY_SHAPES = {
    "gemma3-hf": {"blk.0.attn_q_norm.weight": [32], "blk.1.post_ffw_norm.weight": [64], "output.weight": None},
    "phi3-hf": {
        "blk.0.attn_qkv.weight": [64, 128],  # q 64, k 32, v 32
        "blk.0.ffn_up.weight": [64, 192],  # gate then up
        "blk.0.attn_q.weight": None,
        "rope_factors_long.weight": [4],
        "rope_factors_short.weight": [4],
    },
    "olmo2-hf": {"blk.0.attn_q_norm.weight": [64], "blk.0.attn_k_norm.weight": [32], "blk.0.attn_norm.weight": None},
    "smollm3-hf": {"blk.3.attn_q.weight": [64, 64]},
    # each layer's experts stacked (E, H, C), listed innermost first; the router (E, C) as ffn_gate_inp
    "qwen3_moe-hf": {
        "blk.0.ffn_gate_inp.weight": [64, 4],
        "blk.0.ffn_gate_exps.weight": [64, 48, 4],
        "blk.0.ffn_up_exps.weight": [64, 48, 4],
        "blk.0.ffn_down_exps.weight": [48, 64, 4],
        "blk.0.ffn_gate.weight": None,
        "blk.0.attn_q_norm.weight": [32],
    },
    "olmoe-hf": {
        "blk.1.ffn_gate_exps.weight": [64, 96, 4],
        "blk.1.ffn_down_exps.weight": [96, 64, 4],
        "blk.0.attn_q_norm.weight": [64],  # over the whole projection
        "blk.0.attn_k_norm.weight": [64],
    },
    "mixtral-hf": {"blk.1.ffn_gate_inp.weight": [64, 4], "blk.1.ffn_up_exps.weight": [64, 96, 4]},
}


@pytest.mark.parametrize("name", [*LATER_FAMILIES, *MOE_FAMILIES])
def test_later_families_write_the_keys_and_tensors_llama_cpp_reads_of_them(exported, name):
    reader = gguf.GGUFReader(exported(name))
    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    for key, value in FAMILY_KEYS[name].items():
        assert (field(reader, key) if key in reader.fields else None) == pytest.approx(value), key
    for tensor, shape in FAMILY_SHAPES.get(name, {}).items():
        assert tensors.get(tensor) == shape, tensor


def gguf_tensor(reader, name: str) -> np.ndarray:
    [t] = [t for t in reader.tensors if t.name == name]
    return np.asarray(t.data)


def test_a_tied_olmo2_head_goes_in_as_output_weight_too(exported):
    """llama.cpp's olmo2 does not fall back to token_embd for its head (check_tensor_dims: tensor 'output.weight' not
    found): a tied head is written twice, the same numbers."""
    reader = gguf.GGUFReader(exported("olmo2-char-tied"))
    np.testing.assert_array_equal(gguf_tensor(reader, "output.weight"), gguf_tensor(reader, "token_embd.weight"))


def test_gemma3_norms_carry_their_1_and_the_query_norm_our_query_scale(source, exported):
    """llama.cpp multiplies by the norm's weight, Gemma by 1 + it; llama.cpp scales the query by head_dim ** -0.5,
    Gemma by query_pre_attn_scalar ** -0.5 (24 here): the ratio rides on the query norm's weight."""
    reader = gguf.GGUFReader(exported("gemma3-hf"))
    block = load_model(source("gemma3-hf")).model.transformer.h[1]
    for theirs, ours_ in (
        ("attn_norm", block.ln_1),
        ("post_ffw_norm", block.post_mlp_norm),
        ("attn_k_norm", block.attn.k_norm),
    ):
        np.testing.assert_allclose(gguf_tensor(reader, f"blk.1.{theirs}.weight"), ours_.weight.detach() + 1, rtol=1e-6)
    q_norm = (block.attn.q_norm.weight.detach() + 1) * (24**-0.5 / 32**-0.5)
    np.testing.assert_allclose(gguf_tensor(reader, "blk.1.attn_q_norm.weight"), q_norm, rtol=1e-6)


def test_phi3_longrope_factors_go_in_as_both_sets_and_its_name_stays_clear_of_llama_cpps_phi_3_rule(source, exported):
    """LongRoPE's short and long factors go in as rope_factors_short and _long (llama.cpp takes the long ones for a
    context longer than the original one). A general.name holding "phi3" would give the special tokens Phi-3's
    right-strip in llama.cpp (and fail without <unk>): the directory's name phi3-hf0 goes in as "phi 3-hf0"."""
    path = exported("phi3-hf")
    reader = gguf.GGUFReader(path)
    for kind, factors in (("short", [1.0, 1.3, 1.9, 2.6]), ("long", [1.0, 3.0, 5.0, 9.0])):
        np.testing.assert_array_equal(gguf_tensor(reader, f"rope_factors_{kind}.weight"), np.float32(factors))
    assert field(reader, "general.name") == source("phi3-hf").name.replace("phi3", "phi 3")


def test_outtypes_round_matrices_only_and_shrink_the_file(exported):
    sizes = {}
    t = gguf.LlamaFileType
    # (outtype, the file's type, the blocks' matrices, the tied embedding that is also the head): q4_0's head is 8-bit
    for outtype, file_type, matrix, head in (
        ("f32", t.ALL_F32, "F32", "F32"),
        ("f16", t.MOSTLY_F16, "F16", "F16"),
        ("bf16", t.MOSTLY_BF16, "BF16", "BF16"),
        ("q8_0", t.MOSTLY_Q8_0, "Q8_0", "Q8_0"),
        ("q4_0", t.MOSTLY_Q4_0, "Q4_0", "Q8_0"),
    ):
        path = exported("qwen3-bpe", outtype)
        reader = gguf.GGUFReader(path)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.ffn_down.weight"] == types["blk.1.attn_q.weight"] == matrix
        assert types["token_embd.weight"] == head and "output.weight" not in types
        assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_q_norm.weight"] == "F32"
        assert field(reader, "general.file_type") == file_type
        sizes[outtype] = path.stat().st_size
    assert sizes["f32"] > sizes["f16"] == sizes["bf16"] > sizes["q8_0"] > sizes["q4_0"]


def test_q4_0_keeps_rows_its_blocks_cannot_divide_in_f16_as_llama_cpps_converter_does(exported):
    """convert_hf_to_gguf.py stores a tensor the gguf package can't quantize (QuantError: rows not a multiple of the
    block) in F16; the untied head, q8_0 in q4_0, falls back the same way."""
    reader = gguf.GGUFReader(exported("llama-char-48", "q4_0"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for matrix in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):  # rows of 48
        assert types[f"blk.0.{matrix}.weight"] == types[f"blk.1.{matrix}.weight"] == "F16"
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "Q4_0"  # rows of 128
    assert types["token_embd.weight"] == types["output.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0


def test_experts_go_in_stacked_and_their_router_in_float32(source, exported):
    """convert_hf_to_gguf.py stacks each layer's experts into one tensor per projection, expert e at index e, and
    keeps the router (ffn_gate_inp) in float32 whatever the outtype, as llama.cpp's quantizer does."""
    reader = gguf.GGUFReader(exported("qwen3_moe-hf", "f16"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.ffn_gate_inp.weight"] == "F32" and types["blk.1.ffn_down_exps.weight"] == "F16"
    mlp = load_model(source("qwen3_moe-hf")).model.transformer.h[1].mlp
    np.testing.assert_array_equal(gguf_tensor(reader, "blk.1.ffn_gate_inp.weight"), mlp.router.weight.detach())
    for theirs, stack in (("ffn_gate_exps", mlp.w_gate), ("ffn_up_exps", mlp.w_up), ("ffn_down_exps", mlp.w_down)):
        np.testing.assert_array_equal(gguf_tensor(reader, f"blk.1.{theirs}.weight"), stack.detach().half())


def test_q4_0_gives_an_8_expert_models_keys_and_values_8_bits_as_llama_cpps_quantizer_does(exported):
    """llama.cpp's quantizer bumps the key and value projections of a model of exactly 8 experts (Mixtral's count)
    to Q8_0 in every file type; the other matrices stay q4_0."""
    reader = gguf.GGUFReader(exported("mixtral-8x-hf", "q4_0"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_k.weight"] == types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up_exps.weight"] == "Q4_0"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"


def test_a_chat_template_goes_into_the_gguf_and_a_chatml_modelfile(exported):
    path = exported("qwen3-bpe")
    assert field(gguf.GGUFReader(path), "tokenizer.chat_template") == CHATML
    text = path.with_suffix(".Modelfile").read_text()
    assert "<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>" in text
    assert 'PARAMETER stop "<|im_start|>"\nPARAMETER stop "<|im_end|>"\n' in text


def test_llama_cpp_reads_a_rendered_chat_prompt_as_we_encode_it(needs_llama_cpp, source, exported):
    path = exported("gpt2-char-chat")
    tok = tokenizer_from_dict(load_model(source("gpt2-char-chat")).tokenizer)
    fmt = chat_format(tok)
    lines = TEXT.splitlines()  # a char vocabulary has only the corpus's characters
    messages = [{"role": "system", "content": lines[0]}, {"role": "user", "content": lines[1]}]
    ids = fmt.prompt_ids(messages)
    assert tok.special_tokens["<|im_start|>"] in ids and tok.special_tokens["<|im_end|>"] in ids
    reader = gguf.GGUFReader(path)
    assert field(reader, "tokenizer.chat_template") == tok.chat_template
    assert 'PARAMETER stop "<|im_end|>"' in path.with_suffix(".Modelfile").read_text()
    with llama_cpp_model(path) as llm:  # the rendered text, its chat tokens parsed as special, as llama.cpp chats
        assert llm.tokenize(tok.decode(ids).encode(), add_bos=True, special=True) == ids


def test_two_exports_into_one_folder_each_write_their_own_modelfile(source, tmp_path):
    ckpt = source("qwen3-bpe")
    assert export.main(["--ckpt", str(ckpt), "--gguf", str(tmp_path / "base.gguf")]) == 0  # f16
    result = run_export("--ckpt", str(ckpt), "--gguf", str(tmp_path / "base-q8_0.gguf"), "--outtype", "q8_0")
    assert result.returncode == 0, result.stderr
    assert f"ollama create NAME -f {tmp_path / 'base-q8_0.Modelfile'}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base-q8_0.Modelfile",
        "base-q8_0.gguf",
        "base.Modelfile",
        "base.gguf",
    ]
    for stem, file_type in (("base", gguf.LlamaFileType.MOSTLY_F16), ("base-q8_0", gguf.LlamaFileType.MOSTLY_Q8_0)):
        text = (tmp_path / f"{stem}.Modelfile").read_text()
        assert text.startswith(f"# ollama create NAME -f {stem}.Modelfile\nFROM ./{stem}.gguf\n")
        assert field(gguf.GGUFReader(tmp_path / f"{stem}.gguf"), "general.file_type") == file_type


def test_modelfiles_follow_the_template_kind():
    assert 'TEMPLATE """{{ .Prompt }}"""' in modelfile("m.gguf", None)  # no template: a completion model
    other = modelfile("m.gguf", "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    assert other.endswith("# Ollama reads the chat template from the GGUF file (tokenizer.chat_template)\n")
    assert "TEMPLATE" not in other and "FROM ./m.gguf\n" in other


# ---- llama.cpp ---------------------------------------------------------------------------------------------------


@pytest.fixture
def needs_llama_cpp():
    """Skips before anything is exported when llama-cpp-python is not installed (fails where CI requires it)."""
    require_llama_cpp("llama_cpp")


@contextmanager
def llama_cpp_model(path: Path, n_ctx: int = 128):
    """llama.cpp's model with a float32 KV cache (its default, float16, rounds keys and values) and without the CPU
    backend's extra buffer types (its AMX matrix multiply crashes in a process that has run PyTorch, on CPUs that
    have AMX)."""
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        llm = llama_cpp.Llama(
            model_path=str(path), logits_all=True, n_ctx=n_ctx, n_threads=1, verbose=False, type_k=0, type_v=0
        )
    finally:
        lib.llama_model_default_params = defaults
    try:
        yield llm
    finally:
        llm.close()


def logits_and_greedy(llm, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)])
    new = []
    for _ in range(n):
        new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(new[-1:])
    return logits, new


def ours(model: GPT, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    x = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(x)[0][0].numpy()
        return logits, generate(model, x, n, temperature=0)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_tokenizes_and_decodes_greedily_as_we_do_in_f32(needs_llama_cpp, source, exported, name):
    path = exported(name)
    loaded = load_model(source(name))
    tok = tokenizer_from_dict(loaded.tokenizer)
    text = ASCII_PROMPT if name.endswith("-ascii") else PROMPT
    # Phi-3 within its original context: llama.cpp takes LongRoPE's long factors for every position of a longer
    # n_ctx, transformers and ours only in a pass that reaches past it
    c = loaded.model.config
    context = c.rope_original_context if c.rope_scaling == "longrope" else min(c.block_size, 128)
    with llama_cpp_model(path, context) as llm:
        prompt = tok.prompt_ids(text)
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == prompt
        assert llm.tokenize(TEXT[:3000].encode(), add_bos=False, special=False) == tok.encode(TEXT[:3000])
        # 32 new tokens within the context: past it ours slides, llama.cpp's doesn't
        prompt = prompt[: context - 32]
        theirs, their_tokens = logits_and_greedy(llm, prompt, 32)
    mine, my_tokens = ours(loaded.model.eval(), prompt, 32)
    relative = ARCHITECTURE[name] in GELU_TABLE_ARCHITECTURES
    tolerance = GELU_TABLE_F32_TOLERANCE * np.abs(mine).max() if relative else F32_TOLERANCE
    assert np.abs(theirs - mine).max() <= tolerance
    assert their_tokens == my_tokens


def with_file_weights(model: GPT, path: Path) -> GPT:
    """The model holding each weight as the GGUF file rounds it (the gguf package's quantize, then dequantize, in the
    type the file stores it in). Each GGUF tensor is a row split, row reordering or row concatenation (Phi's fused
    ones, name[i/n] in the layout) of ours, or a stack of a layer's experts, and every type rounds each row on its
    own, so rounding ours along its rows, each of its pieces (c_attn's query, key, value) in its tensor's type,
    rounds theirs."""
    reader = gguf.GGUFReader(path)
    family = model.config.hf_family or field(reader, "general.architecture")  # ours: the architecture's own family
    types = {t.name: t.tensor_type for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf_arch(family), model.config.n_layer)
    with torch.no_grad():
        for key, p in model.named_parameters():  # a tied head once, as the embedding
            theirs = hf_names(family, key)
            rounded = []
            for name, piece in zip(theirs, p.split(piece_sizes(model, key, theirs))):
                # an expert's tensor (name with {e}) is a slice of the layer's stack, merged as the converter does
                whole = (chunk_of(name) or (name,))[0].replace(".{e}", "")
                qtype = types[names.get_name(whole, try_suffixes=(".weight", ".bias"))]
                rounded.append(gguf.quants.dequantize(gguf.quants.quantize(piece.numpy(), qtype), qtype))
            p.copy_(torch.from_numpy(np.concatenate(rounded)).reshape(p.shape))
    return model


def expert_choices(model: GPT, prompt: list[int]) -> np.ndarray:
    """(MoE layers, positions, k): the experts each position's token goes to in each layer, in ascending order
    (a dense model: none)."""
    from quillgpt.moe import MoE

    chosen = []

    def keep(layer, args, output):
        x = args[0]
        chosen.append(layer.route(x.reshape(-1, x.shape[-1])).experts.sort(-1).values)

    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, MoE)]
    try:
        ours(model, prompt, 0)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen).numpy() if chosen else np.zeros((0, len(prompt), 0))


def routed_alike(model: GPT, other: GPT, prompt: list[int]) -> np.ndarray:
    """(positions,) whether both models send each position's token to the same experts in every layer."""
    return np.all(expert_choices(model, prompt) == expert_choices(other, prompt), axis=(0, 2))


ROUNDED_CASES = (
    [
        (name, outtype)
        for name in ("gpt2-char", "llama-hf", "qwen2-hf", "qwen3-bpe")
        for outtype in ("f16", "bf16", "q8_0", "q4_0")
    ]
    + [("gemma3-hf", "q8_0")]  # one of the later families: its norms (+1, the query scale) stay float32
    + [(name, "f16") for name in MOE_FAMILIES]  # llama.cpp's float16 activations route as ours (docs/gguf.md)
)


@pytest.mark.parametrize("name, outtype", ROUNDED_CASES)
def test_llama_cpp_logits_of_rounded_outtypes_stay_within_their_tolerance(
    needs_llama_cpp, source, exported, name, outtype
):
    """Against our model with the file's weights, every position; against our model itself, the positions whose
    route the rounded weights leave as it was: a token between two experts whose router probabilities are nearly
    equal (here 7e-4 apart) goes to the other one in our own model with the rounded weights, and its logits jump by
    14% of the largest (Mixtral in f16). A dense model has no route: every position."""
    path = exported(name, outtype)
    loaded = load_model(source(name))
    prompt = tokenizer_from_dict(loaded.tokenizer).prompt_ids(PROMPT)
    with llama_cpp_model(path) as llm:
        theirs, _ = logits_and_greedy(llm, prompt, 0)
    file_weights = with_file_weights(loaded.model.eval(), path)
    rounded, _ = ours(file_weights, prompt, 0)
    assert np.abs(theirs - rounded).max() <= FILE_WEIGHTS_TOLERANCE[outtype] * np.abs(rounded).max()
    if outtype in ROUNDED_TOLERANCE:
        model = load_model(source(name)).model.eval()
        mine, _ = ours(model, prompt, 0)
        alike = routed_alike(model, file_weights, prompt)
        assert alike.mean() > 0.9  # a few positions at most, each one the rounding sends to another expert
        assert np.abs(theirs - mine)[alike].max() <= ROUNDED_TOLERANCE[outtype] * np.abs(mine).max()


def test_llama_cpp_runs_q4_0_with_its_f16_fallbacks_as_our_model_with_the_files_weights(
    needs_llama_cpp, source, exported
):
    path = exported("llama-char-48", "q4_0")
    loaded = load_model(source("llama-char-48"))
    tok = tokenizer_from_dict(loaded.tokenizer)
    prompt = tok.prompt_ids(TEXT.splitlines()[0][:60])  # a char vocabulary has only the corpus's characters
    with llama_cpp_model(path) as llm:
        theirs, _ = logits_and_greedy(llm, prompt, 0)
    rounded, _ = ours(with_file_weights(loaded.model.eval(), path), prompt, 0)
    assert np.abs(theirs - rounded).max() <= FILE_WEIGHTS_TOLERANCE["q4_0"] * np.abs(rounded).max()


def test_a_file_llama_cpp_refuses_is_removed_and_named_in_one_line(needs_llama_cpp, source, tmp_path, monkeypatch):
    """export.py reads each GGUF file's vocabulary back with llama.cpp where it is installed: a file it refuses (here,
    as files of ASCII char models were, without the merges key) is not left behind with an 'ollama create' line."""
    from quillgpt import gguf_export

    add_metadata = gguf_export.add_metadata

    def without_merges(writer, *args):
        add_metadata(writer, *args)
        del writer.kv_data[0]["tokenizer.ggml.merges"]

    monkeypatch.setattr(gguf_export, "add_metadata", without_merges)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(UserError, match=r"llama.cpp cannot load .*merges.*nothing was kept"):
        export.main(["--ckpt", str(source("gpt2-char-ascii")), "--gguf", str(out)])
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
# tied head, untied, rows of 48; experts (rows of 48: F16), 8 of them (8-bit keys and values in q4_0)
@pytest.mark.parametrize("name", ["qwen3-bpe", "llama-hf", "llama-char-48", "qwen3_moe-hf", "mixtral-8x-hf"])
def test_quantized_files_are_llama_cpps_own_quantization_of_the_f32_file(
    needs_llama_cpp, exported, tmp_path, name, outtype
):
    """llama.cpp's llama_model_quantize, run on our f32 file, gives every tensor the type ours has (q4_0's 8-bit head,
    an 8-expert model's 8-bit keys and values, the float32 router and the F16 fallbacks included) and the same
    bytes."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{outtype.upper()}")
    params.nthread = 1
    theirs_path = tmp_path / "llama-quantize.gguf"
    assert (
        llama_cpp.llama_model_quantize(str(exported(name)).encode(), str(theirs_path).encode(), ctypes.byref(params))
        == 0
    )
    ours = {t.name: t for t in gguf.GGUFReader(exported(name, outtype)).tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(theirs_path).tensors}
    assert sorted(ours) == sorted(theirs)
    for tensor_name, tensor in ours.items():
        assert tensor.tensor_type == theirs[tensor_name].tensor_type, tensor_name
        assert np.asarray(tensor.data).tobytes() == np.asarray(theirs[tensor_name].data).tobytes(), tensor_name


# ---- bad input ---------------------------------------------------------------------------------------------------


def unexportable(directory: Path, **switches) -> Path:
    tok = train_tokenizer("char", [TEXT[:2000]], None, eot=True)
    shape = dict(block_size=16, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32)
    model = GPT(GPTConfig(**{**shape, **switches}))
    path = directory / "m.safetensors"
    write_safetensors(model, tok.to_dict(), path)
    return path


@pytest.mark.parametrize(
    "make, args, message",
    [
        (
            lambda d: unexportable(d),
            ["--outtype", "q4_k_m"],
            "unknown --outtype 'q4_k_m' (choose f32, f16, bf16, q8_0 or q4_0)",
        ),
        (
            lambda d: unexportable(d, pos_emb="rope", norm="rmsnorm", mlp="relu2"),
            [],
            "cannot be exported as GGUF Llama: model.mlp = 'relu2' (nearest that exports: 'swiglu')",
        ),
        (
            lambda d: unexportable(d, pos_emb="rope", norm="rmsnorm", mlp="swiglu", logit_softcap=15.0),
            [],
            "model.logit_softcap = 15.0 (nearest that exports: 0.0)",
        ),
        (
            lambda d: unexportable(
                d, pos_emb="rope", norm="rmsnorm", mlp="swiglu", value_embeds=True, backout=True, smear=True
            ),
            [],
            "model.value_embeds = True (nearest that exports: False); model.smear = True (nearest that exports: False); "
            "model.backout = True (nearest that exports: False)",
        ),
    ],
    ids=["outtype", "relu2", "softcap", "value-embeds-smear-and-backout"],
)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, make, args, message):
    ckpt = make(tmp_path)
    out = tmp_path / "out" / "m.gguf"
    result = run_export("--ckpt", str(ckpt), "--gguf", str(out), *args)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line
    assert not (tmp_path / "out").exists()


GEMMA3_SWITCHES = dict(
    mlp="geglu", gelu_approx="tanh", qk_norm=True, norm_plus_one=True, embed_scale=True, post_norm=True, bias=False
)
EXPERTS = dict(n_experts=4, experts_per_token=2)
QWEN3_MOE_SWITCHES = dict(EXPERTS, qk_norm=True, n_layer=2)
OLMOE_SWITCHES = dict(EXPERTS, qk_norm=True, qk_norm_scope="all", router_renormalize=False)


@pytest.mark.parametrize(
    "switches, message",
    [
        (
            dict(sliding_window=8),
            "GGUF Mistral: model.sliding_window = 8, shorter than its context (16), and llama.cpp's llama attends to "
            "every position (export it with --hf instead)",
        ),
        (dict(sliding_window=8, rope_fraction=0.5), "GGUF Phi-3: model.sliding_window = 8, shorter than"),
        (
            dict(rope_scaling="linear", rope_factor=2.0, rope_fraction=0.5),
            "model.rope_scaling = 'linear', and llama.cpp's phi3 takes none or longrope",
        ),
        (
            dict(nope_layers=[0]),
            "GGUF SmolLM3: model.nope_layers = [0], and llama.cpp's smollm3 leaves rope out of every 4th layer and no "
            "other (here: none)",
        ),
        (
            dict(GEMMA3_SWITCHES, n_layer=3, sliding_window=8, global_layers=[0]),
            "GGUF Gemma 3: model.global_layers = [0], and llama.cpp's gemma3 takes as global the last layer of each "
            "period of layers only",
        ),
        (
            dict(GEMMA3_SWITCHES, sliding_window=8, rope_scaling="linear", rope_factor=2.0),
            "model.rope_theta_local = None with model.rope_scaling = 'linear'",
        ),
        (
            dict(QWEN3_MOE_SWITCHES, dense_layers=1),
            "GGUF Qwen3-MoE: model.dense_layers = 1, and llama.cpp's qwen3moe has experts in every layer (no dense MLP "
            "for Qwen3-MoE's mlp_only_layers) (export it with --hf instead)",
        ),
        (
            dict(QWEN3_MOE_SWITCHES, router_renormalize=False),
            "model.router_renormalize = False, and llama.cpp's qwen3moe always renormalises the chosen experts' weights",
        ),
        (
            dict(OLMOE_SWITCHES, router_renormalize=True),
            "GGUF OLMoE: model.router_renormalize = True, and llama.cpp's olmoe never renormalises",
        ),
        (
            dict(OLMOE_SWITCHES, n_kv_head=1),
            "model.n_kv_head = 1 and head_dim = 16 with 2 heads of n_embd 32, and llama.cpp's olmoe has as many key "
            "heads as heads, each n_embd / n_head wide",
        ),
        (dict(EXPERTS, sliding_window=8), "GGUF Mixtral: model.sliding_window = 8, shorter than its context (16)"),
        # what no GGUF architecture's MoE graph has: shared experts, the router's bias, another kind of expert
        (dict(EXPERTS, shared_experts=1), "GGUF Mixtral: model.shared_experts = 1 (nearest that exports: 0)"),
        (dict(EXPERTS, balance="bias"), "model.balance = 'bias' (nearest that exports: 'aux_loss')"),
        (dict(EXPERTS, mlp="relu2"), "model.mlp = 'relu2' (nearest that exports: 'swiglu')"),
    ],
    ids=[
        "mistral-window",
        "phi3-window",
        "phi3-linear",
        "smollm3-nope",
        "gemma3-pattern",
        "gemma3-local-rope",
        "qwen3moe-dense-layers",
        "qwen3moe-not-renormalised",
        "olmoe-renormalised",
        "olmoe-grouped-query",
        "mixtral-window",
        "moe-shared-experts",
        "moe-router-bias",
        "moe-relu2-experts",
    ],
)
def test_what_llama_cpp_computes_otherwise_is_refused_in_one_line(tmp_path, switches, message):
    """llama.cpp fixes these in its code, reading no key for them: a model outside them would run there otherwise.
    And the experts no GGUF architecture has."""
    ckpt = unexportable(tmp_path, **{**ROPE_SWITCHES, **switches})
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(UserError) as refused:
        export.main(["--ckpt", str(ckpt), "--gguf", str(out)])
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "family, message",
    [
        ("qwen3_moe", "model.dense_layers = 1, and llama.cpp's qwen3moe has experts in every layer"),
        ("olmoe", "model.n_kv_head = 2 and head_dim = 16 with 4 heads of n_embd 64, and llama.cpp's olmoe"),
        ("mixtral", "model.sliding_window = 8, shorter than its context (128), and llama.cpp's llama attends"),
    ],
    ids=["qwen3_moe", "olmoe", "mixtral"],
)
def test_the_conftest_mixtures_llama_cpp_computes_otherwise_are_refused(transformers, tmp_path, family, message):
    """conftest's configs as they are (HF_OVERRIDES makes them what llama.cpp reproduces): Qwen3-MoE's dense first
    layer, OLMoE's grouped-query attention, Mixtral's window of 8."""
    save_hf_family(transformers, family, tmp_path / "hf")
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(UserError) as refused:
        export.main(["--ckpt", str(tmp_path / "hf"), "--gguf", str(out)])
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_existing_target_needs_force(source, tmp_path):
    ckpt = source("gpt2-char")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"mine")
    (tmp_path / "Modelfile").write_text("FROM llama3\n")  # the user's own Modelfile, which no export touches
    result = run_export("--ckpt", str(ckpt), "--gguf", str(out))
    assert result.returncode == 2 and result.stderr == f"error: {out} exists: give --force to replace it\n"
    assert out.read_bytes() == b"mine" and not (tmp_path / "m.Modelfile").exists()
    out.unlink()
    (tmp_path / "m.Modelfile").write_text("FROM llama3\n")  # this export's Modelfile, from another model
    with pytest.raises(UserError, match="m.Modelfile exists: give --force"):
        export.main(["--ckpt", str(ckpt), "--gguf", str(out)])
    assert not out.exists()
    assert export.main(["--ckpt", str(ckpt), "--gguf", str(out), "--force", "--outtype", "q8_0"]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "gpt2"
    assert (tmp_path / "m.Modelfile").read_text().startswith("# ollama create NAME -f m.Modelfile\nFROM ./m.gguf")
    assert (tmp_path / "Modelfile").read_text() == "FROM llama3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "m.Modelfile", "m.gguf"]  # no temp file left
    with pytest.raises(UserError, match="is not a file name for GGUF"):  # its Modelfile would be the file itself
        export.main(["--ckpt", str(ckpt), "--gguf", str(tmp_path / "m.Modelfile"), "--force"])


def test_a_tokenizer_llama_cpp_cannot_split_alike_is_one_line(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    tokenizer = {"kind": "hf", "name": "sp", "tokenizer_json": tok.to_str(), "eos_id": 1, "bos_id": None}
    model = GPT(GPTConfig(block_size=16, vocab_size=200, n_layer=1, n_head=2, n_embd=32))
    write_safetensors(model, tokenizer, tmp_path / "m.safetensors")
    result = run_export("--ckpt", str(tmp_path / "m.safetensors"), "--gguf", str(tmp_path / "out" / "m.gguf"))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "is not a byte-level BPE" in line or "llama.cpp has no pre-tokenizer" in line
    assert not (tmp_path / "out").exists()
