"""GGUF files for llama.cpp and Ollama (export.py --gguf), written with the gguf package llama.cpp ships.

The architecture is the Hugging Face family hf.py picks from the model's switches (GPT-2, Llama, Qwen2, Qwen3,
Gemma 3, Phi-3, OLMo 2, SmolLM3, Qwen3-MoE, OLMoE; Mistral as llama.cpp's llama, Mixtral as llama with experts), and
the tensors are built from hf.hf_state's HF-named state dict the way llama.cpp's convert_hf_to_gguf.py builds them:
GPT-2's Conv1D weights back to (out, in), Llama's, SmolLM3's and Mixtral's query and key rows reordered for
llama.cpp's interleaved rotary pairs (the others rotate halves, as model.py does), Llama 3's rope scaling as a
rope_freqs tensor, Gemma's norm weights with its 1 added, Phi's LongRoPE factors as rope_factors tensors, each layer's
experts stacked into one tensor per projection. What llama.cpp fixes in its code rather than reading from the file
(SmolLM3's NoPE layers, Gemma 3's query scale and window pattern, no window at all in llama and phi3, experts in
every qwen3moe layer, whether each MoE architecture renormalises the chosen experts' weights) bounds what it
reproduces: a model outside those bounds is refused before anything is written, naming the switch, as is a switch no
architecture expresses. Only what llama-cpp-python 0.3.36's llama.cpp computes exactly is written (tests/test_gguf.py,
docs/gguf.md).

    outtype  weights of the matrices          norms, biases, positions
    f32      float32 (the model as it is)     float32
    f16      float16                          float32
    bf16     bfloat16                         float32
    q8_0     8-bit blocks of 32, one scale    float32   (a row whose length is not a multiple of 32: float16)
    q4_0     4-bit blocks of 32, one scale;   float32   (a row whose length is not a multiple of 32: float16)
             the output head (or the tied embedding) q8_0, as llama.cpp's quantizer gives the head more bits
             (and an 8-expert model's keys and values)
The experts' router (ffn_gate_inp) stays float32 in every outtype, as llama.cpp's converter and quantizer keep it.

The tokenizer goes in as llama.cpp's byte-level BPE ("gpt2" model) with the pre-tokenizer that splits text as ours
does, so that llama.cpp's ids for a prompt are ours:
- tiktoken (gpt2, r50k_base, p50k_base): pre-tokenizer "gpt-2";
- bpe (rustbpe's GPT-4 split pattern): "llama-bpe", whose split is the same;
- char: each character as the byte-level text of its UTF-8 bytes, with merges that join the bytes of each
  multi-byte character (and only those), so every character is one token, as in ours; an ASCII-only vocabulary
  has no merges, and its file holds an empty merges list (llama.cpp refuses a byte-level BPE without the key);
- hf: a byte-level BPE tokenizer.json whose pre-tokenizer is GPT-2's, SmolLM's (digits one by one), Llama 3's or
  Qwen2's split. Anything else (a sentencepiece-style tokenizer, cl100k_base's split, which cuts trailing
  whitespace differently from every llama.cpp pre-tokenizer) is refused with one line.
Special tokens (<|endoftext|>, an HF tokenizer's special added tokens, chat tokens) are control tokens, which
llama.cpp, like us, never makes from text. A chat template the tokenizer carries goes in as tokenizer.chat_template.

Beside the file goes its own Ollama Modelfile (base.gguf: base.Modelfile, so that several exports share a folder):
FROM the file, with a ChatML TEMPLATE and stop tokens for a ChatML template, a comment for any other template (Ollama
reads the one in the GGUF), a plain-prompt TEMPLATE for a model without one.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from model import GPT, expert_hidden_width, layer_window, mlp_hidden_width, rope_frequencies, rotary_width
from quillgpt import hf
from quillgpt.config import GPTConfig
from quillgpt.errors import UserError
from quillgpt.families import export_family
from quillgpt.files import atomic_write, atomic_write_text
from quillgpt.tokenizer import CharTokenizer, Tokenizer, bytes_to_unicode, hf_files, tokenizer_from_dict

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
MODELFILE_SUFFIX = ".Modelfile"  # base.gguf's is base.Modelfile: ollama create NAME -f takes any file name
# the pre-tokenizer llama.cpp splits with exactly as a tokenizer.json's Split regex does
SPLIT_PATTERNS = {
    # tiktoken's gpt2 / r50k_base / p50k_base (GPT-2's regex with possessive quantifiers: the same pieces)
    r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s": "gpt-2",
    # rustbpe's GPT-4 pattern: Llama 3's regex with possessive quantifiers (the same pieces)
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+": (
        "llama-bpe"
    ),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": (
        "llama-bpe"
    ),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": (
        "qwen2"
    ),
}
CHATML_TEMPLATE = """TEMPLATE \"\"\"{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
\"\"\"
PARAMETER stop "<|im_start|>"
PARAMETER stop "<|im_end|>"
"""


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("writing GGUF needs the gguf package: pip install '.[gguf]'") from None
    return gguf


# ---- what gets written --------------------------------------------------------------------------------------


@dataclass
class Vocab:
    """A tokenizer as llama.cpp's byte-level BPE reads it."""

    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]  # id -> byte-level text (special tokens as they are)
    types: list[int]  # gguf.TokenType of each id
    merges: list[str]  # "left right", highest priority first
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # llama.cpp puts bos_id before a prompt, as Tokenizer.prompt_ids does
    chat_template: str | None


@dataclass
class Plan:
    """Everything checked before a byte is written."""

    family: str
    outtype: str
    vocab: Vocab


def check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise UserError(f"unknown --outtype {outtype!r} (choose {', '.join(OUTTYPES[:-1])} or {OUTTYPES[-1]})")


def modelfile_path(path: str | Path) -> Path:
    """The GGUF file's own Modelfile beside it: exports/base.gguf -> exports/base.Modelfile."""
    return Path(path).with_suffix(MODELFILE_SUFFIX)


def check_target(path: str | Path, force: bool) -> None:
    """The GGUF file and its Modelfile are replaced only with --force."""
    path = Path(path)
    if path.is_dir() or path.suffix == MODELFILE_SUFFIX:  # the Modelfile would be the GGUF file itself
        raise UserError(f"{path} is not a file name for GGUF: give the .gguf file to write")
    for target in (path, modelfile_path(path)):
        if target.exists() and not force:
            raise UserError(f"{target} exists: give --force to replace it")


def plan_gguf(model: GPT, tokenizer: dict | None, outtype: str, source: str) -> Plan:
    """The architecture and vocabulary a model's GGUF file gets; UserError (one line) when llama.cpp can't run it."""
    check_outtype(outtype)
    import_gguf()
    return Plan(gguf_family(model, source, tokenizer), outtype, gguf_vocab(tokenizer, model.config.vocab_size, source))


def gguf_family(model: GPT, source: str, tokenizer: dict | None) -> str:
    c = model.config
    family = export_family(c, source, tokenizer, target="GGUF")
    if family == "qwen2" and c.head_width * c.n_head != c.n_embd:
        return "llama"  # llama.cpp's Qwen2 has no head_dim of its own; Llama with q/k/v biases computes the same
    refusals = [why for check in LLAMA_CPP_LIMITS.get(family, ()) if (why := check(c))]
    if refusals:
        raise UserError(
            f"{source} cannot be exported as GGUF {hf.NAMES[family]}: {'; '.join(refusals)} (export it with --hf instead)"
        )
    return family


# ---- what llama.cpp fixes in its code ---------------------------------------------------------------------------
# Each check: why llama.cpp (llama-cpp-python 0.3.36's) would compute the model otherwise than model.py, or None.


def windowed_layers(c: GPTConfig) -> list[int]:
    """The layers whose window is shorter than the context (a longer one is no window)."""
    return [i for i in range(c.n_layer) if layer_window(c, i)]


def no_window(arch: str):
    """llama.cpp's llama has no window, and its phi3 reads sliding_window but logs "Phi SWA is currently disabled"."""

    def check(c: GPTConfig) -> str | None:
        if not windowed_layers(c):
            return None
        return (
            f"model.sliding_window = {c.sliding_window}, shorter than its context ({c.block_size}), and llama.cpp's "
            f"{arch} attends to every position"
        )

    return check


def rope_scalings(arch: str, kinds: tuple[str, ...]):
    """The rope scalings llama.cpp's arch reads from the file: gemma3 linear (global layers), phi3 LongRoPE."""

    def check(c: GPTConfig) -> str | None:
        if c.rope_scaling in kinds:
            return None
        return f"model.rope_scaling = {c.rope_scaling!r}, and llama.cpp's {arch} takes {' or '.join(kinds)}"

    return check


def smollm3_nope_layers(c: GPTConfig) -> str | None:
    """llama.cpp's smollm3 leaves rope out of every 4th layer: n_no_rope_layer_step, set in its code, read from no
    key (SmolLM3's own no_rope_layer_interval)."""
    fixed = [i for i in range(c.n_layer) if (i + 1) % SMOLLM3_NOPE_STEP == 0]
    if sorted(c.nope_layers) == fixed:
        return None
    here = ", ".join(map(str, fixed)) or "none"
    return (
        f"model.nope_layers = {c.nope_layers}, and llama.cpp's smollm3 leaves rope out of every 4th layer and no "
        f"other (here: {here})"
    )


def gemma3_global_layers(c: GPTConfig) -> str | None:
    """llama.cpp's gemma3 makes the last layer of each period global (sliding_window_pattern, gemma3_window_period)."""
    if gemma3_window_period(c) is not None:
        return None
    return (
        f"model.global_layers = {c.global_layers}, and llama.cpp's gemma3 takes as global the last layer of each "
        "period of layers only (p-1, 2p-1, ...)"
    )


def gemma3_local_rope(c: GPTConfig) -> str | None:
    """llama.cpp's gemma3 never scales the sliding layers' rope; model.py scales it where they share the global base
    (rope_theta_local unset)."""
    if c.rope_scaling == "none" or c.rope_theta_local is not None or not windowed_layers(c):
        return None
    return (
        f"model.rope_theta_local = None with model.rope_scaling = {c.rope_scaling!r}: its sliding layers' rope is "
        "scaled, and llama.cpp's gemma3 scales the global layers' only"
    )


def gemma3_window_period(c: GPTConfig) -> int | None:
    """sliding_window_pattern as llama.cpp's gemma3 reads it: layer i is global when i % p == p - 1, every layer has
    the window at p = 0. The p that gives the model's layers, or None where none does."""
    windowed = windowed_layers(c)
    if len(windowed) == c.n_layer:
        return 0
    for period in range(1, c.n_layer + 1):
        if windowed == [i for i in range(c.n_layer) if i % period < period - 1]:
            return period
    return None


def qwen3moe_dense_layers(c: GPTConfig) -> str | None:
    """llama.cpp's qwen3moe builds every layer with experts: it has no dense MLP for Qwen3-MoE's mlp_only_layers."""
    if not c.dense_layers:
        return None
    return (
        f"model.dense_layers = {c.dense_layers}, and llama.cpp's qwen3moe has experts in every layer (no dense MLP "
        "for Qwen3-MoE's mlp_only_layers)"
    )


def renormalized(arch: str, renormalizes: bool):
    """llama.cpp's MoE architectures fix in their code whether the chosen experts' weights are renormalised to sum
    to 1 (qwen3moe always, olmoe never; llama always, as Mixtral), reading no key (expert_weights_norm is read by other
    architectures only): the model's router_renormalize must be the one its architecture has."""

    def check(c: GPTConfig) -> str | None:
        if c.router_renormalize == renormalizes:
            return None
        does = "always renormalises" if renormalizes else "never renormalises"
        return (
            f"model.router_renormalize = {c.router_renormalize}, and llama.cpp's {arch} {does} the chosen experts' "
            "weights"
        )

    return check


def olmoe_attention_shape(c: GPTConfig) -> str | None:
    """llama.cpp's olmoe sizes its query, key and value projections and both qk-norms n_embd wide: heads of
    n_embd / n_head, as many key heads as heads (OLMoE's own)."""
    if c.head_width * c.n_head == c.n_embd and c.kv_heads == c.n_head:
        return None
    return (
        f"model.n_kv_head = {c.kv_heads} and head_dim = {c.head_width} with {c.n_head} heads of n_embd {c.n_embd}, "
        "and llama.cpp's olmoe has as many key heads as heads, each n_embd / n_head wide"
    )


SMOLLM3_NOPE_STEP = 4
LLAMA_CPP_LIMITS = {
    "mistral": (no_window("llama"),),  # as llama.cpp's converter writes Mistral: llama
    "mixtral": (no_window("llama"),),  # llama with experts, as the converter writes it (renormalised, as Mixtral)
    "qwen3_moe": (qwen3moe_dense_layers, renormalized("qwen3moe", True)),
    "olmoe": (renormalized("olmoe", False), olmoe_attention_shape),
    "phi3": (no_window("phi3"), rope_scalings("phi3", ("none", "longrope"))),
    "smollm3": (smollm3_nope_layers,),
    "gemma3": (gemma3_global_layers, rope_scalings("gemma3", ("none", "linear")), gemma3_local_rope),
}


# ---- tokenizer ------------------------------------------------------------------------------------------------


def gguf_vocab(tokenizer: dict | None, vocab_size: int, source: str) -> Vocab:
    """The tokenizer as llama.cpp's byte-level BPE, padded with unused tokens to the model's embedding rows."""
    import gguf

    if tokenizer is None:
        raise UserError(f"{source} records no tokenizer, which a GGUF file needs (llama.cpp reads text through it)")
    tok = tokenizer_from_dict(tokenizer)
    if tok.vocab_size > vocab_size:
        raise UserError(f"{source}: its tokenizer has {tok.vocab_size} ids, more than the model's {vocab_size} rows")
    pre, tokens, types, merges = char_vocab(tok) if isinstance(tok, CharTokenizer) else byte_level_vocab(tok)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    bos = tok.bos_id if tok.bos_id is not None else tok.eot_id  # <|endoftext|> plays both parts, as in GPT-2
    return Vocab(pre, tokens, types, merges, bos, tok.eot_id, tok.bos_id is not None, tok.chat_template)


def char_vocab(tok: CharTokenizer) -> tuple[str, list[str], list[int], list[str]]:
    """Each character as the byte-level text of its UTF-8 bytes; merges join a character's bytes left to right. A
    merge's left side starts with a UTF-8 lead byte and its right side is a continuation byte, so no merge joins two
    characters: llama.cpp ends with one token per character, whatever its pre-tokenizer splits."""
    import gguf

    as_text = bytes_to_unicode()
    text = lambda data: "".join(as_text[b] for b in data)  # noqa: E731
    tokens, merges = [], {}
    for c in tok.chars:
        data = c.encode("utf-8", "surrogatepass")
        tokens.append(text(data))
        for i in range(1, len(data)):
            merges.setdefault(f"{text(data[:i])} {text(data[i : i + 1])}", None)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    by_id = {i: content for content, i in tok.special_tokens.items()}  # <|endoftext|>, chat tokens
    for i in range(len(tokens), tok.vocab_size):
        tokens.append(by_id[i])
        types.append(gguf.TokenType.CONTROL)
    return "gpt-2", tokens, types, list(merges)


def byte_level_vocab(tok: Tokenizer) -> tuple[str, list[str], list[int], list[str]]:
    """A byte-level BPE from the tokenizer.json hf_files writes for it (an hf tokenizer's own file)."""
    import gguf

    spec = json.loads(hf_files(tok, 1)["tokenizer.json"])
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("decoder")):
        kind = model.get("type") or "unknown"
        raise UserError(
            f"the {kind} tokenizer is not a byte-level BPE, the only kind of tokenizer.json llama.cpp reads exactly "
            "here (export it with --hf and convert it with llama.cpp's convert_hf_to_gguf.py)"
        )
    pre = pre_tokenizer(spec)
    tokens: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    for added in spec.get("added_tokens") or []:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    size = max(tokens) + 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return (
        pre,
        [tokens.get(i, f"[PAD{i}]") for i in range(size)],
        [types.get(i, gguf.TokenType.UNUSED) for i in range(size)],
        merges,
    )


def pre_tokenizer(spec: dict) -> str:
    """llama.cpp's name for the way a tokenizer.json splits text before BPE; UserError when it has none."""
    pre, normalizer = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    # Qwen's NFC leaves NFC text (nearly all text) unchanged; llama.cpp doesn't normalise
    if normalizer not in (None, {"type": "NFC"}):
        raise UserError(f"llama.cpp has no {normalizer.get('type')} normaliser, which this tokenizer applies")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel" and not s.get("add_prefix_space")]
    others = [s for s in steps if s not in byte_level]
    if len(byte_level) == 1 and byte_level[0].get("use_regex", True):
        if not others:
            return "gpt-2"
        if others == [{"type": "Digits", "individual_digits": True}] and steps[0] is others[0]:
            return "smollm"
    if len(byte_level) == 1 and len(others) == 1 and steps[0] is others[0] and others[0].get("type") == "Split":
        split = others[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if split.get("behavior") == "Isolated" and not split.get("invert") and pattern in SPLIT_PATTERNS:
            return SPLIT_PATTERNS[pattern]
    raise UserError(
        f"llama.cpp has no pre-tokenizer that splits text as this tokenizer does ({json.dumps(pre)[:200]}): "
        "export it with --hf or --safetensors instead"
    )


def modelfile(gguf_name: str, template: str | None) -> str:
    """An Ollama Modelfile for the GGUF file beside it (ollama create NAME -f base.Modelfile)."""
    head = f"# ollama create NAME -f {modelfile_path(gguf_name).name}\nFROM ./{gguf_name}\n"
    if template is None:
        return (
            head + '# no chat template: a completion model, the prompt goes in as it is\nTEMPLATE """{{ .Prompt }}"""\n'
        )
    if "<|im_start|>" in template and "<|im_end|>" in template:
        return head + "# ChatML, as the tokenizer's chat template\n" + CHATML_TEMPLATE
    return head + "# Ollama reads the chat template from the GGUF file (tokenizer.chat_template)\n"


# ---- tensors ------------------------------------------------------------------------------------------------


def interleave_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Query/key rows from rotate-half order (each head: first halves, then second halves of its rotary pairs) to
    llama.cpp's Llama order (each pair's two rows side by side), as convert_hf_to_gguf.py's permute does."""
    # (n_heads * hs, ...) -> (n_heads, 2, hs/2, ...) -> (n_heads, hs/2, 2, ...) -> (n_heads * hs, ...)
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(family: str, model: GPT) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in PyTorch's (out, in) order) for every tensor llama.cpp reads."""
    import gguf

    c = model.config
    names = gguf.get_tensor_name_map(gguf_arch(family), c.n_layer)
    interleaved = GGUF_ARCHITECTURES[family] in INTERLEAVED_ROPE
    for hf_name, tensor in merged_experts(hf.hf_state(family, model), c.n_experts):
        tensor = tensor.float()
        if hf.transposed(family, hf_name):
            tensor = tensor.t()  # HF's Conv1D (in, out) back to (out, in)
        if interleaved and ".self_attn.q_proj." in hf_name:
            tensor = interleave_rope(tensor, c.n_head)
        if interleaved and ".self_attn.k_proj." in hf_name:
            tensor = interleave_rope(tensor, c.kv_heads)
        if family == "gemma3":
            tensor = gemma3_tensor(hf_name, tensor, c)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RuntimeError(f"no GGUF name for {hf_name}")  # a tensor hf_state gained that this module lacks
        yield name, tensor.contiguous().numpy()
    if c.tie_embeddings and writes_output(family, c):
        yield "output.weight", model.lm_head.weight.detach().float().numpy()
    yield from rope_tensors(c)


EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(.+)")  # an expert's tensor: model.layers.0.mlp.experts.3.up_proj.weight


def merged_experts(state: dict[str, torch.Tensor], n_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """hf_state's tensors with each layer's experts stacked into one (E, out, in) tensor per projection, named as
    convert_hf_to_gguf.py names the stack (model.layers.0.mlp.experts.up_proj.weight), which gguf's name map takes to
    llama.cpp's blk.0.ffn_up_exps.weight. hf_state gives a layer's experts in order, 0 to E-1."""
    stacks: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        expert = EXPERT.fullmatch(name)
        if expert is None:
            yield name, tensor
            continue
        merged = f"{expert[1]}.{expert[3]}"
        stacks.setdefault(merged, []).append(tensor)
        if len(stacks[merged]) == n_experts:
            yield merged, torch.stack(stacks.pop(merged))


def rope_tensors(c: GPTConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Llama 3's scaling as rope_freqs (llama.cpp divides each rotary frequency by its factor); LongRoPE's factors as
    rope_factors_short and _long (llama.cpp takes the long ones for a context longer than the original one)."""
    import gguf

    if c.pos_emb == "rope" and c.rope_scaling == "llama3":
        factors = rope_frequencies(replace(c, rope_scaling="none")) / rope_frequencies(c)
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.numpy()
    if c.rope_scaling == "longrope":
        for kind, factors in (
            (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, c.rope_long_factors or c.rope_factors),
            (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, c.rope_factors),
        ):
            yield gguf.TENSOR_NAMES[kind] + ".weight", np.array(factors, dtype=np.float32)


def gemma3_tensor(hf_name: str, tensor: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by 1 + w, llama.cpp's by w: every norm weight gets its 1, as llama.cpp's converter
    adds it. The query norm also carries the ratio of our query scale (query_pre_attn_scalar ** -0.5) to the one
    llama.cpp's gemma3 applies, which it derives from the shape and reads from no key: the query is scaled after its
    norm and rope, both linear in the norm's weight, so scaling the weight scales the query."""
    if not hf_name.endswith("norm.weight"):
        return tensor
    tensor = tensor + 1.0
    if hf_name.endswith("self_attn.q_norm.weight"):
        tensor = tensor * ((c.attn_scale or c.head_width**-0.5) / gemma3_llama_cpp_query_scale(c))
    return tensor


def gemma3_llama_cpp_query_scale(c: GPTConfig) -> float:
    """The query scale llama.cpp's gemma3 applies: 1/sqrt(head_dim), or for a 62-layer model (its "27B")
    1/sqrt(n_embd / n_head) in integers, Gemma 3 27B's query_pre_attn_scalar."""
    return (c.n_embd // c.n_head if c.n_layer == 62 else c.head_width) ** -0.5


GGUF_ARCHITECTURES = {  # family -> gguf.MODEL_ARCH's name of the architecture it goes out as
    "gpt2": "GPT2",
    "llama": "LLAMA",
    "mistral": "LLAMA",  # as llama.cpp's converter writes Mistral's models
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "gemma3": "GEMMA3",
    "phi3": "PHI3",
    "olmo2": "OLMO2",
    "smollm3": "SMOLLM3",
    "qwen3_moe": "QWEN3MOE",
    "olmoe": "OLMOE",
    "mixtral": "LLAMA",  # llama with experts, as llama.cpp's converter writes Mixtral's models
}
# the architectures whose rope rotates adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM): their query and key rows are
# reordered, as the converter's LlamaModel (SmolLM3Model's base) permutes them; the others rotate halves, as model.py
INTERLEAVED_ROPE = ("LLAMA", "SMOLLM3")


def gguf_arch(family: str):
    """The GGUF architecture of a family (or of an architecture's own name, as a file's general.architecture)."""
    import gguf

    return gguf.MODEL_ARCH[GGUF_ARCHITECTURES[family]]


def head_name(family: str, model: GPT) -> str:
    """The GGUF tensor that computes the logits: output.weight, or token_embd.weight when the head is tied to it."""
    return "output.weight" if writes_output(family, model.config) else "token_embd.weight"


def writes_output(family: str, c: GPTConfig) -> bool:
    """Whether the file holds output.weight: an untied head, or a tied one where llama.cpp's architecture requires
    the tensor (its olmo2 and olmoe do not fall back to token_embd): there a copy of the embedding."""
    return not c.tie_embeddings or family in OUTPUT_REQUIRED


OUTPUT_REQUIRED = ("olmo2", "olmoe")


def eight_bit_in_q4_0(family: str, model: GPT) -> frozenset[str]:
    """The matrices llama.cpp's quantizer gives 8 bits in a Q4_0 file (llama_tensor_get_type_impl and
    tensor_type_fallback in src/llama-quant.cpp): the head (output.weight, or the tied token_embd.weight), which it
    gives Q6_K, or Q8_0 where Q6_K's blocks of 256 don't divide its rows (the gguf package can't write Q6_K: always
    Q8_0 here); and in a model of exactly 8 experts (Mixtral's count) every layer's key and value projections, which
    it bumps to Q8_0 whatever the file type ("for the 8-expert model, bumping this to Q8_0 trades just ~128MB")."""
    c = model.config
    keys_values = [f"blk.{i}.attn_{kv}.weight" for i in range(c.n_layer) for kv in "kv"] if c.n_experts == 8 else []
    return frozenset([head_name(family, model), *keys_values])


def tensor_type(name: str, data: np.ndarray, outtype: str, eight_bit: frozenset[str]):
    """The GGMLQuantizationType a tensor is meant for. Vectors, norms, positions and the experts' router
    (ffn_gate_inp) stay float32, as convert_hf_to_gguf.py writes them and llama.cpp's quantizer leaves them. In q4_0
    the tensors llama.cpp's quantizer gives more bits (eight_bit_in_q4_0) are q8_0."""
    import gguf

    q = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or name.startswith("position_"):
        return q.F32
    if name.endswith(".ffn_gate_inp.weight"):
        return q.F32
    if outtype == "q4_0" and name in eight_bit:
        return q.Q8_0
    return {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0}[outtype]


def stored(name: str, data: np.ndarray, outtype: str, eight_bit: frozenset[str]) -> tuple[np.ndarray, object]:
    """(bytes as the file holds them, GGMLQuantizationType). A matrix whose rows the type's blocks don't divide (q8_0
    and q4_0: a row not a multiple of 32) falls back to float16, as convert_hf_to_gguf.py falls back when the gguf
    package's quantize refuses a shape."""
    import gguf

    qtype = tensor_type(name, data, outtype, eight_bit)
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


# ---- writing --------------------------------------------------------------------------------------------------


def file_type(outtype: str):
    import gguf

    t = gguf.LlamaFileType
    kinds = {"f32": t.ALL_F32, "f16": t.MOSTLY_F16, "bf16": t.MOSTLY_BF16, "q8_0": t.MOSTLY_Q8_0, "q4_0": t.MOSTLY_Q4_0}
    return kinds[outtype]


def add_metadata(writer, plan: Plan, model: GPT, name: str) -> None:
    import gguf

    c, v = model.config, plan.vocab
    writer.add_name(llama_cpp_neutral_name(name))
    writer.add_file_type(file_type(plan.outtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(feed_forward_length(plan.family, c))
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.kv_heads)
    if plan.family == "gpt2":
        writer.add_layer_norm_eps(c.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_dimension_count(rotary_width(c))  # Phi's partial rotary: the rotating dimensions only
        writer.add_key_length(c.head_width)
        writer.add_value_length(c.head_width)
        writer.add_vocab_size(c.vocab_size)
        if c.n_experts:
            experts_metadata(writer, plan.family, c)
        FAMILY_METADATA.get(plan.family, lambda writer, c: None)(writer, c)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's byte-level BPE
    writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.types)
    # gguf's add_array drops an empty list, and an ASCII char vocabulary has no merges: llama.cpp must find the key
    writer.add_key_value(gguf.Keys.Tokenizer.MERGES, v.merges, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    if v.bos_id is not None:
        writer.add_bos_token_id(v.bos_id)
    if v.eos_id is not None:
        writer.add_eos_token_id(v.eos_id)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(False)
    if v.chat_template is not None:
        writer.add_chat_template(v.chat_template)


def feed_forward_length(family: str, c: GPTConfig) -> int:
    """feed_forward_length: the dense MLP's width; llama.cpp's llama (Mixtral) and olmoe take their experts' width
    from it, qwen3moe from expert_feed_forward_length."""
    return expert_hidden_width(c) if family in ("mixtral", "olmoe") else mlp_hidden_width(c)


def experts_metadata(writer, family: str, c: GPTConfig) -> None:
    """How many experts, how many a token takes, and (qwen3moe) their width. How the chosen weights are normalised
    is the architecture's own (LLAMA_CPP_LIMITS: renormalized)."""
    writer.add_expert_count(c.n_experts)
    writer.add_expert_used_count(c.experts_per_token)
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(expert_hidden_width(c))


def gemma3_metadata(writer, c: GPTConfig) -> None:
    """Gemma 3's windows (the window, and the period whose last layer is global), its sliding layers' rope base and
    its global layers' linear scaling (llama.cpp scales those only); the embedding scale is llama.cpp's own."""
    import gguf

    if windowed_layers(c):
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern(gemma3_window_period(c))
        writer.add_rope_freq_base_swa(c.rope_theta_local or c.rope_theta)
    if c.rope_scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_factor)
    if c.logit_softcap:
        writer.add_final_logit_softcapping(c.logit_softcap)


def phi3_metadata(writer, c: GPTConfig) -> None:
    """No window (refused when there is one), and LongRoPE's attention factor and original context as llama.cpp's
    converter writes them; its factors are tensors (rope_tensors)."""
    writer.add_sliding_window(0)  # the converter's 0: no window
    longrope = c.rope_scaling == "longrope"
    writer.add_rope_scaling_orig_ctx_len(c.rope_original_context if longrope else c.block_size)
    if longrope:
        writer.add_rope_scaling_attn_factors(c.rope_attention_factor)


FAMILY_METADATA = {"gemma3": gemma3_metadata, "phi3": phi3_metadata}


def llama_cpp_neutral_name(name: str) -> str:
    """general.name as llama.cpp reads no more into it: a name holding "phi-3" or "phi3" (any case) makes llama.cpp's
    vocabulary loader give the special tokens Phi-3's right-strip (text after one tokenizes otherwise than ours) and
    look up <unk>, <s>, <|endoftext|> and </s>, failing on a vocabulary without them; "phi 3" does neither."""
    return re.sub(r"(?i)(phi)(-?3)", r"\1 \2", name)


def writer_class():
    """gguf's GGUFWriter, which also packs an empty array (the GGUF format has them; the gguf package refuses them)."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
            if vtype != gguf.GGUFValueType.ARRAY or len(val) or sub_type is None:
                return super()._pack_val(val, vtype, add_vtype, sub_type)
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)  # the element type, then a count of 0

    return Writer


def model_name(source: str) -> str:
    """general.name: a run directory's name for its checkpoint, else the file or directory's."""
    path = Path(source)
    return path.parent.name if path.suffix == ".pt" and path.parent.name else path.stem


def write_gguf(model: GPT, plan: Plan, path: str | Path, name: str) -> Path:
    """Write the GGUF file (atomically) and its Modelfile beside it; returns the Modelfile's path. Where llama.cpp is
    installed it reads the file's vocabulary back first: a file it refuses is removed, and the error names why."""
    import gguf

    path = Path(path)
    writer = writer_class()(None, gguf.MODEL_ARCH_NAMES[gguf_arch(plan.family)])
    add_metadata(writer, plan, model, name)
    eight_bit = eight_bit_in_q4_0(plan.family, model)
    with torch.no_grad():
        for tensor_name, data in gguf_tensors(plan.family, model):
            data, qtype = stored(tensor_name, data, plan.outtype, eight_bit)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    with atomic_write(path) as f:
        writer.fout, writer.state = [f], gguf.gguf_writer.WriterState.EMPTY  # our temp file, renamed into place
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.fout = None  # atomic_write closes it
    refusal = llama_cpp_refusal(path)
    if refusal:  # a file no llama.cpp or Ollama can read is not left behind as if it were one
        path.unlink()
        raise UserError(f"llama.cpp cannot load the GGUF file written for {name} ({refusal}); nothing was kept")
    modelfile_at = modelfile_path(path)
    atomic_write_text(modelfile_at, modelfile(path.name, plan.vocab.chat_template))
    return modelfile_at


def llama_cpp_refusal(path: str | Path) -> str | None:
    """Why llama.cpp cannot load the file's vocabulary, where llama-cpp-python is installed; None when it loads (or
    there is no llama.cpp to ask). Only the vocabulary is read: cheap, whatever the model's size."""
    try:
        import llama_cpp
        import llama_cpp._logger
    except (ImportError, OSError):  # not installed, or a build whose library does not load
        return None
    said: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        said.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))  # its lines, not on our stderr
    try:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    if model:
        llama_cpp.llama_model_free(model)
        return None
    errors = [line.strip() for line in said if "error" in line]
    return errors[0] if errors else "llama.cpp could not load it"
