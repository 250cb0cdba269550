"""Hugging Face model directories, both ways: GPT-2, Llama, Qwen2 and Qwen3 as switches of model.py's one GPT.

    family   HF class           what model.py uses for it
    gpt2     GPT2LMHeadModel    learned positions, LayerNorm, GELU MLP, tied embeddings (HF's Conv1D weights transposed)
    llama    LlamaForCausalLM   rope (theta, Llama 3 scaling), RMSNorm, SwiGLU of its own width, n_kv_head, tied or not
    qwen2    Qwen2ForCausalLM   llama + bias on the query, key and value projections (qkv_bias)
    qwen3    Qwen3ForCausalLM   llama + per-head RMSNorm of queries and keys (qk_norm) and its own head_dim

qkv_bias goes out as Qwen2 only with Qwen's own tokenizer: transformers 5 rebuilds a Qwen2 model's
tokenizer with Qwen's split pattern and normaliser, whatever its tokenizer.json says. With any other
tokenizer it goes out as Llama with attention_bias (its output projection's bias zero), which reads
back in as qkv_bias.

Reading needs no transformers: config.json, the weights from safetensors (model.safetensors, or the
shards model.safetensors.index.json lists) and tokenizer.json. A pytorch_model.bin is refused: it
is a pickle, which can run code when loaded. A hub name is downloaded once (config, safetensors
and tokenizer files only) when there is network; offline it is one line naming the local alternative.
Writing (export_hf; export.py --hf) picks the family from the switches a model uses, or names each switch that
no family expresses with the nearest setting that exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from model import GPT, rope_tables
from quillgpt.config import GPTConfig, build_config
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, atomic_write_json, atomic_write_text, read_json
from quillgpt.network import check_hub_reachable
from quillgpt.tokenizer import Tokenizer, hf_files, hf_tokenizer, tokenizer_from_dict
from quillgpt.typecheck import required

ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FAMILY_OF = {arch: family for family, arch in ARCHITECTURES.items()}
NAMES = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_TOKENIZER = {"kind": "tiktoken", "name": "gpt2"}
GPT2_VOCAB_SIZE = 50257  # the last id is <|endoftext|>
HUB_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
]
# HF's GPT-2 stores these as Conv1D weights, (in, out): the transpose of nn.Linear's (out, in)
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF activation -> GPTConfig.gelu_approx
# model.py's names inside block i -> the Llama-family names inside model.layers.i (several: concatenated along dim 0)
LLAMA_BLOCK = {
    "ln_1.weight": ("input_layernorm.weight",),
    "attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.c_attn.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.c_proj.weight": ("self_attn.o_proj.weight",),
    "attn.c_proj.bias": ("self_attn.o_proj.bias",),
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
    "ln_2.weight": ("post_attention_layernorm.weight",),
    "mlp.c_gate.weight": ("mlp.gate_proj.weight",),
    "mlp.c_gate.bias": ("mlp.gate_proj.bias",),
    "mlp.c_fc.weight": ("mlp.up_proj.weight",),
    "mlp.c_fc.bias": ("mlp.up_proj.bias",),
    "mlp.c_proj.weight": ("mlp.down_proj.weight",),
    "mlp.c_proj.bias": ("mlp.down_proj.bias",),
}
LLAMA_TOP = {
    "transformer.wte.weight": ("model.embed_tokens.weight",),
    "transformer.ln_f.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),
}
IGNORED = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers some checkpoints carry


# ---- in ---------------------------------------------------------------------------------------------------


def is_hub_name(name: str) -> bool:
    """A GPT-2 name or an owner/name that is not a local path (its first folder doesn't exist here)."""
    path = Path(name)
    if path.exists():
        return False
    return name in GPT2_NAMES or bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not Path(path.parts[0]).exists()


def load_hf(
    source: str | Path, dropout: float = 0.0, dtype: torch.dtype | None = torch.float32
) -> tuple[GPT, dict | None]:
    """A local Hugging Face directory or a hub name -> (model, tokenizer dict or None). The model takes the file's
    tensors as they are (built on the meta device, then given them), converted to dtype one at a time (None: kept in
    the file's, for a LoRA base that converts or quantizes them itself): the whole model never exists twice."""
    directory = Path(source) if Path(source).is_dir() else download(str(source))
    config, tokenizer = read_config_and_tokenizer(directory, str(source), dropout)
    with torch.device("meta"):
        model = GPT(config)
    family = family_of(read_json(directory / "config.json", "Hugging Face config"), str(source))
    state = state_from_hf(family, model, read_weights(directory), str(source))
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True)  # GPT-2's Conv1D: transposed
    del state
    if config.tie_embeddings:  # assign gives each module its own Parameter: tie them again
        model.lm_head.weight = model.transformer.wte.weight
    if config.pos_emb == "rope":  # non-persistent buffers, still on the meta device
        model.rope_cos, model.rope_sin = rope_tables(config)
    return (model if dtype is None else model.to(dtype)), tokenizer


def read_config_and_tokenizer(directory: Path, source: str, dropout: float = 0.0) -> tuple[GPTConfig, dict | None]:
    """The model a local Hugging Face directory holds and its tokenizer, without reading its weights."""
    hf_config = read_json(directory / "config.json", "Hugging Face config")
    family = family_of(hf_config, source)
    config = config_from_hf(family, hf_config, source, dropout)
    return config, directory_tokenizer(family, directory, hf_config, config.vocab_size)


def download(name: str) -> Path:
    """A hub model's config, safetensors and tokenizer files in the hub cache (downloaded once)."""
    local = (
        f"download it where there is network (huggingface-cli download {name} --local-dir DIR) "
        "and give that directory instead"
    )
    repo = f"openai-community/{name}" if name in GPT2_NAMES else name
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"downloading {name} needs huggingface_hub: pip install '.[hf]', or {local}") from None
    try:  # downloaded before: no network needed
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # not in the cache (the hub client's LocalEntryNotFoundError and friends)
        pass
    check_hub_reachable(f"{name} is a Hugging Face hub model", local)
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as e:  # the hub client raises many types (HTTP, offline, missing repo)
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(f"could not download {name} from the Hugging Face hub ({reason}); {local}") from None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files: model.safetensors, or the shards of its index."""
    state = {}
    for path in weight_files(directory):
        state.update(read_safetensors_file(path))
    return state


def weight_files(directory: Path) -> list[Path]:
    """A directory's safetensors files: model.safetensors, or the shards its index lists (all present)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{index} has no weight_map of tensor names to shard files")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UserError(f"{directory}: shard {missing[0]}{more} listed in model.safetensors.index.json is missing")
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif any(directory.glob("pytorch_model*.bin")):
        raise UserError(
            f"{directory} has only pytorch_model.bin weights: a pickle, which can run code when loaded, so "
            "quillgpt reads safetensors only (load it once with transformers and save_pretrained it, "
            "which writes model.safetensors)"
        )
    else:
        raise UserError(f"{directory} has config.json but no model.safetensors")
    return [directory / name for name in files]


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a file safetensors can't read is a UserError naming it."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def family_of(hf: dict, source: str) -> str:
    archs = hf.get("architectures") or []
    arch = (
        archs[0] if isinstance(archs, list) and archs else ARCHITECTURES.get(hf.get("model_type"), hf.get("model_type"))
    )
    if arch not in FAMILY_OF:
        raise UserError(
            f"{source}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES.values())})"
        )
    return FAMILY_OF[arch]


def config_from_hf(family: str, hf: dict, source: str, dropout: float) -> GPTConfig:
    """config.json -> GPTConfig; a setting model.py would compute differently is refused, naming it."""

    def need(key: str) -> int:
        return required(
            hf, key, int, f"{source}: config.json has no integer {key}, which a {NAMES[family]} model needs"
        )

    def refuse(what: str) -> UserError:
        return UserError(f"{source}: {what}")

    if family == "gpt2":
        args = gpt2_args(hf, need, refuse)
    else:
        args = llama_args(family, hf, need, refuse)
    args["dropout"] = dropout
    build_config({"model": args}, source=f"{source} config.json")  # the schema's range checks
    return GPTConfig.from_dict(args)


def gpt2_args(hf: dict, need, refuse) -> dict:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GELU:
        raise refuse(f"activation_function is {activation!r} (supported: {', '.join(GELU)})")
    for key, expected in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if hf.get(key, expected) != expected:
            raise refuse(f"{key} is {hf[key]}, which model.py cannot reproduce")
    n_embd = need("n_embd")
    return dict(
        block_size=need("n_positions"),
        vocab_size=need("vocab_size"),
        n_layer=need("n_layer"),
        n_head=need("n_head"),
        n_embd=n_embd,
        bias=True,
        gelu_approx=GELU[activation],
        mlp_hidden=None if hf.get("n_inner") in (None, 4 * n_embd) else hf["n_inner"],
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def llama_args(family: str, hf: dict, need, refuse) -> dict:
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act is {hf['hidden_act']!r}, which model.py cannot reproduce (its SwiGLU uses silu)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise refuse("it uses sliding-window attention, which model.py cannot reproduce")
    rope = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise refuse(f"rope scaling {rope_type!r} is not supported (supported: default, llama3)")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if mlp_bias and (family != "llama" or not attention_bias):
        raise refuse(
            "mlp_bias is true without attention_bias, which model.py cannot reproduce (model.bias switches both)"
        )
    n_embd, n_head = need("hidden_size"), need("num_attention_heads")
    args = dict(
        block_size=need("max_position_embeddings"),
        vocab_size=need("vocab_size"),
        n_layer=need("num_hidden_layers"),
        n_head=n_head,
        n_embd=n_embd,
        mlp_hidden=need("intermediate_size"),
        n_kv_head=hf.get("num_key_value_heads") or None,
        head_dim=hf.get("head_dim") or None,
        pos_emb="rope",
        norm="rmsnorm",
        mlp="swiglu",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=mlp_bias,
        qkv_bias=family == "qwen2" or attention_bias and not mlp_bias,
        qk_norm=family == "qwen3",
    )
    if args["n_kv_head"] == n_head:
        args["n_kv_head"] = None
    if args["head_dim"] == n_embd // n_head and n_embd % n_head == 0:
        args["head_dim"] = None
    if rope_type == "llama3":
        try:
            args.update(
                rope_scaling="llama3",
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_context=int(rope["original_max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise refuse(f"config.json's llama3 rope scaling lacks a valid {e}") from None
    return args


def directory_tokenizer(family: str, directory: Path, hf_config: dict, vocab_size: int) -> dict | None:
    """The tokenizer a model directory comes with: its tokenizer.json, or GPT-2's for a GPT-2 directory without one."""
    has_file = (directory / "tokenizer.json").is_file()
    if family == "gpt2" and not has_file:
        return GPT2_TOKENIZER
    if not has_file:
        return None
    tok = hf_tokenizer(directory, hf_config)
    if family == "gpt2" and tok.vocab_size == GPT2_VOCAB_SIZE:
        return GPT2_TOKENIZER  # the same encoding as tiktoken's gpt2, which datasets prepared with --tokenizer gpt2 use
    if tok.vocab_size > vocab_size:
        raise UserError(
            f"{directory / 'tokenizer.json'} has {tok.vocab_size} tokens, more than the model's "
            f"{vocab_size} embedding rows: it is not this model's tokenizer"
        )
    return tok.to_dict()


def hf_names(family: str, key: str) -> tuple[str, ...]:
    """The HF tensor names that make up model.py's tensor `key`."""
    if family == "gpt2":
        return (key,)
    block = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", key)
    if block:
        return tuple(f"model.layers.{block[1]}.{name}" for name in LLAMA_BLOCK[block[2]])
    return LLAMA_TOP[key]


def piece_sizes(model: GPT, key: str, names: tuple[str, ...]) -> list[int]:
    """Rows of each HF tensor in model.py's concatenated one: q, k and v of c_attn; else one piece."""
    return list(model.transformer.h[0].attn.widths) if len(names) == 3 else [model.state_dict()[key].shape[0]]


def transposed(family: str, key: str) -> bool:
    return family == "gpt2" and key.endswith(CONV1D_WEIGHTS)


def state_from_hf(family: str, model: GPT, hf_state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """HF weights -> model.py's state dict, checking every name and shape against the model config.json describes."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith(IGNORED)}
    for name, _ in missing_biases(family, model, model.state_dict()):  # attention_bias without an output bias
        if name in hf_state and hf_state.pop(name).any():
            raise UserError(
                f"{source}: tensor {name} is not zero: a bias on the attention output, which model.py "
                "cannot reproduce (it has biases on the query, key and value only, or on every layer)"
            )
    if family == "gpt2":  # OpenAI's hub files name GPT2Model's weights bare
        hf_state = {
            k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf_state.items()
        }
    tied = model.config.tie_embeddings
    state, used = {}, {"lm_head.weight"} if tied else set()  # a tied head some files store anyway
    for key, target in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue
        names = hf_names(family, key)
        parts = []
        for name, rows in zip(names, piece_sizes(model, key, names)):
            if name not in hf_state:
                raise UserError(
                    f"{source}: tensor {name} is missing from its weights (config.json describes a model that has it)"
                )
            tensor = hf_state[name].t() if transposed(family, key) else hf_state[name]
            expected = (rows, *target.shape[1:])
            if tuple(tensor.shape) != expected:
                flip = transposed(family, key)  # shapes as HF stores them
                given, implied = (list(s)[::-1] if flip else list(s) for s in (tensor.shape, expected))
                raise UserError(f"{source}: tensor {name} has shape {given}, but config.json implies {implied}")
            parts.append(tensor)
            used.add(name)
        state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if tied:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    unexpected = sorted(set(hf_state) - used)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise UserError(
            f"{source}: tensor {unexpected[0]}{more} has no place in the {NAMES[family]} model config.json describes"
        )
    return state


# ---- out --------------------------------------------------------------------------------------------------


def export_family(config: GPTConfig, source: str, tokenizer: dict | None = None, target: str = "Hugging Face") -> str:
    """The HF family a model exports as; UserError naming each switch no family expresses (and the nearest that does).
    tokenizer: the model's (Qwen2 needs Qwen's own, see the module docstring). target: the format named in the error
    (GGUF files take the same architectures)."""
    c = config
    if c.pos_emb == "learned":
        family = "gpt2"
        nearest = {
            "norm": "layernorm",
            "qk_norm": False,
            "mlp": "gelu",
            "tie_embeddings": True,
            "logit_softcap": 0.0,
            "n_kv_head": None,
            "head_dim": None,
        }
        if c.n_kv_head == c.n_head:
            nearest.pop("n_kv_head")
        if c.head_dim is not None and c.head_dim * c.n_head == c.n_embd:
            nearest.pop("head_dim")
    else:
        family = (
            "qwen3" if c.qk_norm else "qwen2" if c.qkv_bias and not c.bias and qwen_tokenizer(tokenizer) else "llama"
        )
        nearest = {"norm": "rmsnorm", "mlp": "swiglu", "logit_softcap": 0.0}
        if family == "qwen3":
            nearest["bias"] = False  # Qwen3's MLP has no bias
    blockers = [
        f"model.{k} = {getattr(c, k)!r} (nearest that exports: {v!r})" for k, v in nearest.items() if getattr(c, k) != v
    ]
    if blockers:
        raise UserError(
            f"{source} cannot be exported as {target} {NAMES[family]}: {'; '.join(blockers)} "
            "(export it with --safetensors instead)"
        )
    return family


def qwen_tokenizer(tokenizer: dict | None) -> bool:
    config = (tokenizer or {}).get("tokenizer_config") or {}
    return str(config.get("tokenizer_class", "")).removesuffix("Fast") == "Qwen2Tokenizer"


def hf_config(family: str, model: GPT, tokenizer: Tokenizer | None) -> dict:
    """config.json for the family, with the tokenizer's BOS/EOS ids (an <|endoftext|> plays both, as in GPT-2)."""
    c = model.config
    eos = tokenizer.eot_id if tokenizer is not None else None
    bos = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else eos
    hidden = model.transformer.h[0].mlp.c_fc.out_features
    common = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if family == "gpt2":
        return {
            **common,
            "n_positions": c.block_size,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_inner": hidden,
            "activation_function": "gelu_new" if c.gelu_approx == "tanh" else "gelu",
            "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout,
            "attn_pdrop": c.dropout,
            "scale_attn_weights": True,
            "tie_word_embeddings": True,
        }
    out = {
        **common,
        "hidden_size": c.n_embd,
        "intermediate_size": hidden,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_width,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
    }
    if c.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": c.rope_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_context,
        }
    if family == "llama":
        out.update(attention_bias=c.bias or c.qkv_bias, mlp_bias=c.bias)
    if family == "qwen3":
        out["attention_bias"] = c.qkv_bias
    if family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def hf_state(family: str, model: GPT) -> dict[str, torch.Tensor]:
    """model.py's weights under the family's names and layout; the tied head left out, as HF saves it. Biases the HF
    layout has and the model lacks are zeros, which compute the same function."""
    own = model.state_dict()
    out = {}
    for key, value in own.items():
        if key == "lm_head.weight" and model.config.tie_embeddings:
            continue
        names = hf_names(family, key)
        for name, piece in zip(names, value.split(piece_sizes(model, key, names))):
            out[name] = (piece.t() if transposed(family, key) else piece).detach().cpu().contiguous()
    for name, size in missing_biases(family, model, own):
        out[name] = torch.zeros(size)
    return out


def missing_biases(family: str, model: GPT, own: dict[str, torch.Tensor]) -> list[tuple[str, int]]:
    c = model.config
    if family == "gpt2":  # every Linear and LayerNorm has one
        return [
            (k.removesuffix("weight") + "bias", v.shape[0])
            for k, v in own.items()
            if k.endswith("weight")
            and not k.startswith(("transformer.wte", "transformer.wpe", "lm_head"))
            and k.removesuffix("weight") + "bias" not in own
        ]
    if family in ("llama", "qwen3") and c.qkv_bias and not c.bias:  # attention_bias covers the output projection too
        return [(f"model.layers.{i}.self_attn.o_proj.bias", c.n_embd) for i in range(c.n_layer)]
    return []


def export_hf(model: GPT, tokenizer: dict | None, out_dir: str | Path, source: str = "model") -> list[str]:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files); returns notes for the user
    (a tokenizer that could not be written). UserError before anything is written when the model can't export."""
    family = export_family(model.config, source, tokenizer)
    tok, notes = readable_tokenizer(tokenizer)
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "config.json", hf_config(family, model, tok))
    with atomic_write(out_dir / "model.safetensors") as f:
        f.write(save(hf_state(family, model), metadata={"format": "pt"}))
    if tok is not None:
        try:
            files = hf_files(tok, model.config.block_size)
        except UserError as e:
            return [f"no tokenizer files written: {e}"]
        for name, text in files.items():
            atomic_write_text(out_dir / name, text)
    return notes


def readable_tokenizer(tokenizer: dict | None) -> tuple[Tokenizer | None, list[str]]:
    if tokenizer is None:
        return None, ["no tokenizer files written: the checkpoint records no tokenizer"]
    try:
        return tokenizer_from_dict(tokenizer), []
    except UserError as e:  # tiktoken's gpt2 offline, with an empty cache
        return None, [f"no tokenizer files written: {e}"]
