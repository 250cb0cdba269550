"""The Hugging Face families model.py reproduces, each as a set of switches of its one GPT (quillgpt.config.GPTConfig),
in litgpt's manner: what a family's config.json means in switches (in), what a model's switches mean as a family's
config.json (out), and where each of model.py's tensors lives among the family's (the layout). hf.py reads and writes
the directories; gguf_export.py and peft_io.py take the family from here.

    family    HF class              its switches beyond Llama's (rope, RMSNorm, SwiGLU, grouped-query attention)
    gpt2      GPT2LMHeadModel       learned positions, LayerNorm, GELU MLP, biases, tied head (Conv1D weights)
    llama     LlamaForCausalLM      Llama 3's rope scaling; attention_bias / mlp_bias
    mistral   MistralForCausalLM    every layer a sliding window (sliding_window)
    qwen2     Qwen2ForCausalLM      bias on the query, key and value projections (qkv_bias)
    qwen3     Qwen3ForCausalLM      per-head RMSNorm of queries and keys (qk_norm), its own head_dim
    gemma3    Gemma3ForCausalLM     GeGLU (tanh GELU); RMSNorm x (1 + w); embeddings x sqrt(width); norms before and
                                    after attention and the MLP; qk_norm; query_pre_attn_scalar; sliding-window layers
                                    with their own rope base, global layers with theirs (linear scaling); tied head
    phi3      Phi3ForCausalLM       fused qkv_proj and gate_up_proj; partial rotary; LongRoPE (its short factors)
    olmo2     Olmo2ForCausalLM      norms after attention and the MLP only, qk_norm over the whole projection
    smollm3   SmolLM3ForCausalLM    no rotary in some layers (no_rope_layers: every 4th)
    qwen3_moe Qwen3MoeForCausalLM   Qwen3 with mixture-of-experts MLPs (quillgpt/moe.py): top-k of a softmax router,
                                    renormalised or not (norm_topk_prob), dense layers first (mlp_only_layers)
    olmoe     OlmoeForCausalLM      experts, the top-k weights as the softmax gives them; qk-norm over all heads
    mixtral   MixtralForCausalLM    Mistral with experts, the top-k weights renormalised

A setting a family's config.json holds that model.py would compute differently is refused in one line naming it,
never loaded approximately. LongRoPE is reproduced within the original context (Phi's short factors): a Phi model
loads with block_size = original_max_position_embeddings, past which transformers switches to its long factors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from model import expert_hidden_width
from quillgpt.config import GPTConfig
from quillgpt.errors import UserError
from quillgpt.typecheck import required


@dataclass(frozen=True)
class Family:
    name: str  # as people call it
    architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type
    block: dict[str, tuple[str, ...]]  # model.py's tensors in block i -> theirs in model.layers.i (see hf_names)
    fixed: dict = field(default_factory=dict)  # switches at other values than Llama's (PLAIN) in every such model
    free: tuple[str, ...] = ()  # switches a model of the family may have at any value


# model.py's names inside block i -> the Llama family's inside model.layers.i. Several names: concatenated along
# dim 0; "name[i/n]": the i-th of n equal row chunks of one of theirs (a fused projection of theirs).
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
TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Gemma 3's four norms: before attention, after it, before the MLP, after it (its post_attention_layernorm is the
# one after attention; Llama's, the one before the MLP)
GEMMA3_BLOCK = {
    **LLAMA_BLOCK,
    "post_attn_norm.weight": ("post_attention_layernorm.weight",),
    "ln_2.weight": ("pre_feedforward_layernorm.weight",),
    "post_mlp_norm.weight": ("post_feedforward_layernorm.weight",),
}
OLMO2_BLOCK = {
    **{k: v for k, v in LLAMA_BLOCK.items() if not k.startswith(("ln_1", "ln_2"))},
    "post_attn_norm.weight": ("post_attention_layernorm.weight",),
    "post_mlp_norm.weight": ("post_feedforward_layernorm.weight",),
}
# model.py's stacked experts (E, ...) -> their experts, one tensor each ({e}: the expert's index)
QWEN3_MOE_BLOCK = {
    **LLAMA_BLOCK,
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.w_gate": ("mlp.experts.{e}.gate_proj.weight",),
    "mlp.w_up": ("mlp.experts.{e}.up_proj.weight",),
    "mlp.w_down": ("mlp.experts.{e}.down_proj.weight",),
}
MIXTRAL_BLOCK = {
    **LLAMA_BLOCK,
    "mlp.router.weight": ("block_sparse_moe.gate.weight",),
    "mlp.w_gate": ("block_sparse_moe.experts.{e}.w1.weight",),
    "mlp.w_up": ("block_sparse_moe.experts.{e}.w3.weight",),
    "mlp.w_down": ("block_sparse_moe.experts.{e}.w2.weight",),
}
PHI3_BLOCK = {
    **LLAMA_BLOCK,
    "attn.c_attn.weight": ("self_attn.qkv_proj.weight",),  # q, k and v fused as model.py's c_attn
    "mlp.c_gate.weight": ("mlp.gate_up_proj.weight[0/2]",),
    "mlp.c_fc.weight": ("mlp.gate_up_proj.weight[1/2]",),
}

# Llama's switches: what a family fixes at other values, or frees, is measured against these
PLAIN = dict(
    value_embeds=False,
    smear=False,
    backout=False,
    pos_emb="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    qkv_bias=False,
    qk_norm=False,
    qk_norm_scope="head",
    logit_softcap=0.0,
    norm_plus_one=False,
    embed_scale=False,
    pre_norm=True,
    post_norm=False,
    sliding_window=0,
    global_layers=[],
    rope_theta_local=None,
    nope_layers=[],
    rope_fraction=1.0,
    rope_scaling="none",
    attn_scale=None,
    n_experts=0,
    shared_experts=0,
)
MOE = ("n_experts", "experts_per_token", "expert_hidden", "aux_loss_coef")  # what every MoE family carries
GPT2_SWITCHES = dict(
    PLAIN,
    pos_emb="learned",
    norm="layernorm",
    mlp="gelu",
    bias=True,
    n_kv_head=None,
    head_dim=None,
    tie_embeddings=True,
)
ATTENTION_SHAPE = ("n_kv_head", "head_dim", "tie_embeddings", "rope_theta", "norm_eps")

FAMILIES = {
    # biases it lacks go out as zeros (hf.missing_biases)
    "gpt2": Family("GPT-2", "GPT2LMHeadModel", "gpt2", {}, GPT2_SWITCHES, ("gelu_approx", "bias", "qkv_bias")),
    "llama": Family(
        "Llama", "LlamaForCausalLM", "llama", LLAMA_BLOCK, {}, (*ATTENTION_SHAPE, "rope_scaling", "bias", "qkv_bias")
    ),
    "mistral": Family(
        "Mistral", "MistralForCausalLM", "mistral", LLAMA_BLOCK, {}, (*ATTENTION_SHAPE, "sliding_window")
    ),
    "qwen2": Family("Qwen2", "Qwen2ForCausalLM", "qwen2", LLAMA_BLOCK, {"qkv_bias": True}, ATTENTION_SHAPE),
    "qwen3": Family(
        "Qwen3", "Qwen3ForCausalLM", "qwen3", LLAMA_BLOCK, {"qk_norm": True}, (*ATTENTION_SHAPE, "qkv_bias")
    ),
    "gemma3": Family(
        "Gemma 3",
        "Gemma3ForCausalLM",
        "gemma3_text",
        GEMMA3_BLOCK,
        dict(mlp="geglu", qk_norm=True, norm_plus_one=True, embed_scale=True, post_norm=True),
        (
            *ATTENTION_SHAPE,
            "sliding_window",
            "global_layers",
            "rope_theta_local",
            "rope_scaling",
            "attn_scale",
            "logit_softcap",
        ),
    ),
    "phi3": Family(
        "Phi-3",
        "Phi3ForCausalLM",
        "phi3",
        PHI3_BLOCK,
        {},
        (*ATTENTION_SHAPE, "rope_fraction", "rope_scaling", "sliding_window"),
    ),
    "olmo2": Family(
        "OLMo 2",
        "Olmo2ForCausalLM",
        "olmo2",
        OLMO2_BLOCK,
        dict(qk_norm=True, qk_norm_scope="all", pre_norm=False, post_norm=True),
        ATTENTION_SHAPE,
    ),
    "smollm3": Family("SmolLM3", "SmolLM3ForCausalLM", "smollm3", LLAMA_BLOCK, {}, (*ATTENTION_SHAPE, "nope_layers")),
    "qwen3_moe": Family(
        "Qwen3-MoE",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        QWEN3_MOE_BLOCK,
        {"qk_norm": True},
        (*ATTENTION_SHAPE, *MOE, "qkv_bias", "router_renormalize", "dense_layers"),
    ),
    "olmoe": Family(
        "OLMoE",
        "OlmoeForCausalLM",
        "olmoe",
        QWEN3_MOE_BLOCK,
        dict(qk_norm=True, qk_norm_scope="all", dense_layers=0),
        (*ATTENTION_SHAPE, *MOE, "router_renormalize"),
    ),
    "mixtral": Family(
        "Mixtral",
        "MixtralForCausalLM",
        "mixtral",
        MIXTRAL_BLOCK,
        dict(router_renormalize=True, dense_layers=0),
        (*ATTENTION_SHAPE, *MOE, "sliding_window"),
    ),
}
BY_ARCHITECTURE = {f.architecture: key for key, f in FAMILIES.items()}
BY_MODEL_TYPE = {f.model_type: key for key, f in FAMILIES.items()}
ROPE_TYPES = {  # the rope scalings each family's config.json may name, as model.py's rope_scaling
    "llama": {"default": "none", "llama3": "llama3"},
    "gemma3": {"default": "none", "linear": "linear"},
    "phi3": {"default": "none", "longrope": "longrope"},
}


def family_of(hf: dict, source: str) -> str:
    """config.json's architecture (or model_type) as one of FAMILIES; one line naming the supported ones if not."""
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else hf.get("model_type")
    family = BY_ARCHITECTURE.get(arch) or BY_MODEL_TYPE.get(arch)
    if family is None:
        supported = ", ".join(f.architecture for f in FAMILIES.values())
        raise UserError(f"{source}: architecture {arch!r} is not supported (supported: {supported})")
    return family


# ---- in: config.json -> switches -------------------------------------------------------------------------------


def config_args(family: str, hf: dict, source: str) -> dict:
    """config.json -> GPTConfig's arguments; a setting model.py would compute differently is refused, naming it."""

    def need(key: str) -> int:
        name = FAMILIES[family].name
        return required(hf, key, int, f"{source}: config.json has no integer {key}, which a {name} model needs")

    def refuse(what: str) -> UserError:
        return UserError(f"{source}: {what}")

    if family == "gpt2":
        return gpt2_args(hf, need, refuse)
    args = {**rope_family_args(family, hf, need, refuse), **FAMILIES[family].fixed}
    args.update(FAMILY_ARGS.get(family, lambda hf, need, refuse: {})(hf, need, refuse))
    return args


GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF activation -> GPTConfig.gelu_approx


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


def rope_family_args(family: str, hf: dict, need, refuse) -> dict:
    """What every rope family's config.json says alike: sizes, grouped-query attention, norms, biases, rope, the
    layers' attention kinds."""
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    gated = "geglu" if family == "gemma3" else "swiglu"
    if (gated == "swiglu" and activation != "silu") or (gated == "geglu" and activation not in GELU):
        raise refuse(f"hidden_act is {activation!r}, which model.py cannot reproduce in a {FAMILIES[family].name} MLP")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if mlp_bias and (family != "llama" or not attention_bias):
        raise refuse(
            "mlp_bias is true without attention_bias, which model.py cannot reproduce (model.bias switches both)"
        )
    if attention_bias and family not in ("llama", "qwen3", "qwen3_moe"):
        raise refuse(f"attention_bias is true, which model.py does not read for {FAMILIES[family].name}")
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
        mlp=gated,
        gelu_approx=GELU.get(activation, "none"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
        bias=mlp_bias,
        qkv_bias=family == "qwen2" or attention_bias and not mlp_bias,
        hf_family=family,
    )
    if args["n_kv_head"] == n_head:
        args["n_kv_head"] = None
    if args["head_dim"] == n_embd // n_head and n_embd % n_head == 0:
        args["head_dim"] = None
    args.update(rope_args(family, rope_parameters(hf, family), args["block_size"], refuse))
    args.update(window_args(family, hf, args["n_layer"], refuse))
    return args


# transformers' rope_theta where config.json names none (its config classes' default_theta); 10,000 for the rest
DEFAULT_THETA = {"mixtral": 1e6, "smollm3": 2e6, "gemma3": 1e6}
SCALED_TYPES = ("llama3", "yarn", "longrope")  # the rope types that read original_max_position_embeddings


def rope_parameters(hf: dict, family: str, layer_type: str = "full_attention") -> dict:
    """The rope settings of a kind of layer, read from config.json as transformers 5 reads them
    (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict and its families' own): a rope_scaling beside
    rope_parameters replaces it (Gemma 3: is merged into its global layers' settings), rope_theta and
    partial_rotary_factor fill in what the settings lack, each family's default theta where config.json names none;
    "type" is read where "rope_type" is missing; original_max_position_embeddings defaults to the context (Phi-3: is
    its top-level key, 4,096 where there is none)."""
    if family == "gemma3":
        return gemma3_rope_parameters(hf, layer_type)
    scaling = hf.get("rope_scaling")
    params = dict(scaling) if isinstance(scaling, dict) and scaling else dict(hf.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):  # settings by the kind of layer
        params = dict(params[layer_type])
    params.setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA.get(family, 10000.0)))
    if "partial_rotary_factor" in hf or family == "phi3":
        params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if family == "phi3" and params["rope_type"] in ("su", "yarn"):  # Phi-3's earlier names for LongRoPE
        params["rope_type"] = "longrope"
    if params["rope_type"] in SCALED_TYPES:
        if family == "phi3":
            params["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", 4096)
        else:
            params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return params


def gemma3_rope_parameters(hf: dict, layer_type: str) -> dict:
    """Gemma 3's (Gemma3TextConfig): settings for its global (full_attention) and sliding layers; a rope_scaling is
    merged into the global layers' (a "type" in it then names nothing: their rope_type is already set)."""
    given = hf.get("rope_parameters")
    kinds = ("sliding_attention", "full_attention")
    params = {k: dict(given.get(k) or {"rope_type": "default"}) for k in kinds} if isinstance(given, dict) else None
    params = params or {k: {"rope_type": "default"} for k in kinds}
    if isinstance(hf.get("rope_scaling"), dict):
        params["full_attention"].update(hf["rope_scaling"])
    params["full_attention"].setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA["gemma3"]))
    params["sliding_attention"].setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    chosen = params[layer_type]
    chosen.setdefault("rope_type", chosen.get("type", "default"))
    if chosen["rope_type"] in SCALED_TYPES:
        chosen.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return chosen


def rope_args(family: str, rope: dict, max_positions: int, refuse) -> dict:
    kinds = ROPE_TYPES.get(family, {"default": "none"})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in kinds:
        raise refuse(f"rope scaling {rope_type!r} is not supported for this family (supported: {', '.join(kinds)})")
    args = dict(rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=kinds[rope_type])
    if "partial_rotary_factor" in rope:
        args["rope_fraction"] = float(rope["partial_rotary_factor"])
    try:
        if rope_type == "llama3":
            args.update(
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_context=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            args["rope_factor"] = float(rope["factor"])
        elif rope_type == "longrope":
            args.update(longrope_args(rope, max_positions))
    except (KeyError, TypeError, ValueError) as e:
        raise refuse(f"config.json's {rope_type} rope scaling lacks a valid {e}") from None
    return args


def longrope_args(rope: dict, max_positions: int) -> dict:
    """Phi's LongRoPE: the short factors, the long ones that a forward pass reaching past the original context takes
    (as transformers switches by the sequence's length), and the attention factor transformers derives from the
    context it was extended to (rope's factor, else max / original context)."""
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return dict(
        rope_factors=[float(f) for f in rope["short_factor"]],
        rope_long_factors=[float(f) for f in rope.get("long_factor") or rope["short_factor"]],
        rope_attention_factor=float(attention),
        rope_original_context=original,
    )


def window_args(family: str, hf: dict, n_layer: int, refuse) -> dict:
    """Which layers attend through a sliding window: config.json's layer_types (Gemma 3, SmolLM3), or every layer
    where sliding_window is set (Mistral, Phi-3); Qwen's windows (use_sliding_window) are refused."""
    types = hf.get("layer_types") or []
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "llama") and (hf.get("use_sliding_window") or "sliding_attention" in types):
        raise refuse("it uses sliding-window attention, which model.py reproduces for Mistral, Gemma 3 and Phi-3 only")
    if family in ("mistral", "phi3", "mixtral"):
        return dict(sliding_window=int(window or 0))
    if "sliding_attention" not in types or (family == "smollm3" and not hf.get("use_sliding_window")):
        return {}
    if len(types) != n_layer or not isinstance(window, int):
        raise refuse("layer_types and sliding_window do not describe each layer's window")
    return dict(sliding_window=window, global_layers=[i for i, t in enumerate(types) if t != "sliding_attention"])


def gemma3_args(hf: dict, need, refuse) -> dict:
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise refuse(f"{key} is {hf[key]!r}, which model.py cannot reproduce")
    local = rope_parameters(hf, "gemma3", "sliding_attention")
    local_theta = local["rope_theta"]
    if local["rope_type"] != "default":
        raise refuse("the sliding layers' rope is scaled, which model.py cannot reproduce")
    return dict(
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_theta_local=float(local_theta),
        logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
    )


def smollm3_args(hf: dict, need, refuse) -> dict:
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:  # transformers' default: no rope in every no_rope_layer_interval-th layer
        interval = int(hf.get("no_rope_layer_interval", 4))
        uses_rope = [int((i + 1) % interval != 0) for i in range(need("num_hidden_layers"))]
    return dict(nope_layers=[i for i, rope in enumerate(uses_rope) if not rope])


def experts_args(hf: dict, need, refuse, width_key: str) -> dict:
    """The mixture of experts every MoE family's config.json describes: how many (num_experts, or as transformers 5
    writes it num_local_experts), how many a token takes, their width, the auxiliary loss's weight."""
    if hf.get("router_jitter_noise"):
        raise refuse(f"router_jitter_noise is {hf['router_jitter_noise']}, which model.py does not add in training")
    return dict(
        n_experts=need("num_experts" if "num_experts" in hf else "num_local_experts"),
        experts_per_token=need("num_experts_per_tok"),
        expert_hidden=need(width_key),
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
    )


def qwen3_moe_args(hf: dict, need, refuse) -> dict:
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise refuse(
            "its dense layers are not the first ones (mlp_only_layers, decoder_sparse_step), as model.py has them"
        )
    args = experts_args(hf, need, refuse, "moe_intermediate_size")
    return {**args, "router_renormalize": bool(hf.get("norm_topk_prob", False)), "dense_layers": len(dense)}


def olmoe_args(hf: dict, need, refuse) -> dict:
    if hf.get("clip_qkv") is not None:
        raise refuse(f"clip_qkv is {hf['clip_qkv']}, which model.py cannot reproduce")
    args = experts_args(hf, need, refuse, "intermediate_size")
    return {**args, "router_renormalize": bool(hf.get("norm_topk_prob", False))}


def mixtral_args(hf: dict, need, refuse) -> dict:
    return experts_args(hf, need, refuse, "intermediate_size")


FAMILY_ARGS = {
    "gemma3": gemma3_args,
    "smollm3": smollm3_args,
    "qwen3_moe": qwen3_moe_args,
    "olmoe": olmoe_args,
    "mixtral": mixtral_args,
}


# ---- out: switches -> a family, and its config.json ----------------------------------------------------------


def export_family(config: GPTConfig, source: str, tokenizer: dict | None = None, target: str = "Hugging Face") -> str:
    """The HF family a model exports as: the one it came from (hf_family) or the one its switches say; UserError
    naming each switch the family does not express (and the nearest that does). tokenizer: the model's (Qwen2 needs
    Qwen's own, see hf.py). target: the format named in the error (GGUF files take the same architectures)."""
    family = config.hf_family if config.hf_family in FAMILIES else likely_family(config, tokenizer)
    blockers = [
        f"model.{k} = {getattr(config, k)!r} (nearest that exports: {v!r})"
        for k, v in expected_switches(family, config).items()
        if getattr(config, k) != v
    ]
    if family == "qwen2" and not qwen_tokenizer(tokenizer) and target != "PEFT base":
        family = "llama"  # Qwen2's switches as Llama with attention_bias (hf.py's docstring says why)
    if blockers:
        raise UserError(
            f"{source} cannot be exported as {target} {FAMILIES[family].name}: {'; '.join(blockers)} "
            "(export it with --safetensors instead)"
        )
    return family


def expected_switches(family: str, config: GPTConfig) -> dict:
    """The switches family fixes, at the values it fixes them to (a free one at the model's own)."""
    f = FAMILIES[family]
    base = GPT2_SWITCHES if family == "gpt2" else PLAIN
    out = {k: v for k, v in {**base, **f.fixed}.items() if k not in f.free}
    if family == "gpt2":
        # GPT-2's own ways of saying "as many key heads as heads" and "n_embd / n_head wide"
        if config.n_kv_head == config.n_head:
            out.pop("n_kv_head")
        if config.head_dim is not None and config.head_dim * config.n_head == config.n_embd:
            out.pop("head_dim")
    if family == "gemma3":
        out["gelu_approx"] = "tanh"
    if family in ("mistral", "phi3", "mixtral"):  # their windows are every layer's
        out["global_layers"] = []
    if config.n_experts and config.balance == "bias":  # the per-expert bias routes too: no HF family has it
        out["balance"] = "aux_loss"
    if family in ("qwen3_moe", "olmoe", "mixtral") and not config.n_experts:
        out["n_experts"] = "at least 1"
    if family == "llama" and config.rope_scaling not in ("none", "llama3"):
        out["rope_scaling"] = "none"
    return out


def likely_family(config: GPTConfig, tokenizer: dict | None) -> str:
    """The family a model's switches say, for a model that did not come from one (trained here)."""
    c = config
    if c.pos_emb == "learned":
        return "gpt2"
    if c.n_experts:
        return "qwen3_moe" if c.qk_norm and c.qk_norm_scope == "head" else "olmoe" if c.qk_norm else "mixtral"
    if c.embed_scale or c.norm_plus_one or (c.post_norm and c.pre_norm) or c.mlp == "geglu":
        return "gemma3"
    if c.post_norm:
        return "olmo2"
    if c.rope_fraction != 1.0 or c.rope_scaling == "longrope":
        return "phi3"
    if c.nope_layers:
        return "smollm3"
    if c.sliding_window:
        return "mistral"
    if c.qk_norm:
        return "qwen3"
    return "qwen2" if c.qkv_bias and not c.bias and qwen_tokenizer(tokenizer) else "llama"


def qwen_tokenizer(tokenizer: dict | None) -> bool:
    config = (tokenizer or {}).get("tokenizer_config") or {}
    return str(config.get("tokenizer_class", "")).removesuffix("Fast") == "Qwen2Tokenizer"


def config_json(family: str, config: GPTConfig, mlp_width: int, bos: int | None, eos: int | None) -> dict:
    """config.json for the family, from the model's switches."""
    c, f = config, FAMILIES[family]
    common = {
        "architectures": [f.architecture],
        "model_type": f.model_type,
        "vocab_size": c.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,  # some families' defaults (Phi-3's 32000) lie outside a small vocabulary
        "torch_dtype": "float32",
    }
    if family == "gpt2":
        return {
            **common,
            "n_positions": c.block_size,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_inner": mlp_width,
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
        "intermediate_size": mlp_width,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_width,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling_json(c),
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
    }
    out.update(FAMILY_JSON.get(family, lambda c: {})(c))
    return out


def rope_scaling_json(c: GPTConfig) -> dict | None:
    if c.rope_scaling == "llama3":
        return {
            "rope_type": "llama3",
            "factor": c.rope_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_context,
        }
    if c.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": c.rope_factor}
    if c.rope_scaling == "longrope":
        return {
            "rope_type": "longrope",
            "short_factor": c.rope_factors,
            "long_factor": c.rope_long_factors or c.rope_factors,
            "attention_factor": c.rope_attention_factor,
            "original_max_position_embeddings": c.rope_original_context,
        }
    return None


def gemma3_json(c: GPTConfig) -> dict:
    types = [
        "full_attention" if i in c.global_layers or not c.sliding_window else "sliding_attention"
        for i in range(c.n_layer)
    ]
    scaling = rope_scaling_json(c) or {"rope_type": "default"}
    return {
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round((c.attn_scale or c.head_width**-0.5) ** -2),
        "sliding_window": c.sliding_window or c.block_size,
        "layer_types": types,
        "rope_scaling": None,
        "rope_parameters": {
            "full_attention": {**scaling, "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta_local or c.rope_theta},
        },
        "final_logit_softcapping": c.logit_softcap or None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


FAMILY_JSON = {
    "llama": lambda c: dict(attention_bias=c.bias or c.qkv_bias, mlp_bias=c.bias),
    "qwen2": lambda c: dict(use_sliding_window=False, sliding_window=None),
    "qwen3": lambda c: dict(attention_bias=c.qkv_bias, use_sliding_window=False, sliding_window=None),
    "mistral": lambda c: dict(sliding_window=c.sliding_window or None),
    "gemma3": gemma3_json,
    "phi3": lambda c: dict(
        partial_rotary_factor=c.rope_fraction,
        sliding_window=c.sliding_window or None,
        original_max_position_embeddings=c.rope_original_context if c.rope_scaling == "longrope" else c.block_size,
    ),
    "olmo2": lambda c: dict(attention_bias=False),
    "smollm3": lambda c: dict(
        no_rope_layers=[int(i not in c.nope_layers) for i in range(c.n_layer)],
        use_sliding_window=False,
        sliding_window=None,
        attention_bias=False,
        mlp_bias=False,
    ),
    "qwen3_moe": lambda c: dict(
        **experts_json(c),
        num_experts=c.n_experts,
        moe_intermediate_size=expert_width(c),
        norm_topk_prob=c.router_renormalize,
        mlp_only_layers=list(range(c.dense_layers)),
        decoder_sparse_step=1,
        attention_bias=c.qkv_bias,
        use_sliding_window=False,
        sliding_window=None,
    ),
    "olmoe": lambda c: dict(
        **experts_json(c),
        num_experts=c.n_experts,
        intermediate_size=expert_width(c),
        norm_topk_prob=c.router_renormalize,
        clip_qkv=None,
        attention_bias=False,
    ),
    "mixtral": lambda c: dict(
        **experts_json(c),
        num_local_experts=c.n_experts,
        intermediate_size=expert_width(c),
        sliding_window=c.sliding_window or None,
        router_jitter_noise=0.0,
    ),
}


def experts_json(c: GPTConfig) -> dict:
    return dict(num_experts_per_tok=c.experts_per_token, router_aux_loss_coef=c.aux_loss_coef)


def expert_width(c: GPTConfig) -> int:
    return expert_hidden_width(c)


# ---- the layout: where each of model.py's tensors lives among the family's -------------------------------------

CHUNK = re.compile(r"(.+)\[(\d+)/(\d+)\]")


def hf_names(family: str, key: str) -> tuple[str, ...]:
    """The HF tensor names that make up model.py's tensor `key` (concatenated), a chunk written name[i/n]."""
    if family == "gpt2":
        return (key,)
    block = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", key)
    if block:
        return tuple(f"model.layers.{block[1]}.{name}" for name in FAMILIES[family].block[block[2]])
    return (TOP[key],)


def chunk_of(name: str) -> tuple[str, int, int] | None:
    """(their name, i, n) for "name[i/n]", the i-th of n row chunks of one of their tensors; None for a whole one."""
    m = CHUNK.fullmatch(name)
    return (m[1], int(m[2]), int(m[3])) if m else None
