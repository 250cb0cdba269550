"""GGUF files for llama.cpp and Ollama (export.py --gguf), written with the gguf package llama.cpp ships.

The architecture is the Hugging Face one hf.py picks from the model's switches (GPT-2, Llama, Qwen2, Qwen3), and the
tensors are built from hf.hf_state's HF-named state dict the way llama.cpp's convert_hf_to_gguf.py builds them:
GPT-2's Conv1D weights back to (out, in), Llama's query and key rows reordered for llama.cpp's interleaved rotary
pairs (Qwen2 and Qwen3 rotate halves, as model.py does), Llama 3's rope scaling as a rope_freqs tensor. A switch no
architecture expresses is refused before anything is written, naming it.

    outtype  weights of the matrices          norms, biases, positions
    f32      float32 (the model as it is)     float32
    f16      float16                          float32
    bf16     bfloat16                         float32
    q8_0     8-bit blocks of 32, one scale    float32   (a row whose length is not a multiple of 32: float16)
    q4_0     4-bit blocks of 32, one scale;   float32   (a row whose length is not a multiple of 32: float16)
             the output head (or the tied embedding) q8_0, as llama.cpp's quantizer gives the head more bits

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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from model import GPT, rope_frequencies
from quillgpt import hf
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
    return family


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
    for hf_name, tensor in hf.hf_state(family, model).items():
        tensor = tensor.float()
        if hf.transposed(family, hf_name):
            tensor = tensor.t()  # HF's Conv1D (in, out) back to (out, in)
        if family == "llama" and ".self_attn.q_proj." in hf_name:
            tensor = interleave_rope(tensor, c.n_head)
        if family == "llama" and ".self_attn.k_proj." in hf_name:
            tensor = interleave_rope(tensor, c.kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RuntimeError(f"no GGUF name for {hf_name}")  # a tensor hf_state gained that this module lacks
        yield name, tensor.contiguous().numpy()
    if c.pos_emb == "rope" and c.rope_scaling == "llama3":
        # llama.cpp divides each rotary frequency by its factor
        factors = rope_frequencies(replace(c, rope_scaling="none")) / rope_frequencies(c)
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.numpy()


def gguf_arch(family: str):
    import gguf

    return {
        "gpt2": gguf.MODEL_ARCH.GPT2,
        "llama": gguf.MODEL_ARCH.LLAMA,
        "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3,
    }[family]


def head_name(model: GPT) -> str:
    """The GGUF tensor that computes the logits: output.weight, or token_embd.weight when the head is tied to it."""
    return "token_embd.weight" if model.config.tie_embeddings else "output.weight"


def tensor_type(name: str, data: np.ndarray, outtype: str, head: str):
    """The GGMLQuantizationType a tensor is meant for. Vectors, norms and positions stay float32, as in
    convert_hf_to_gguf.py. In q4_0 the head (output.weight, or the tied token_embd.weight) is q8_0: llama.cpp's
    quantizer gives it Q6_K, or Q8_0 where Q6_K's blocks of 256 don't divide its rows (llama_tensor_get_type_impl and
    tensor_type_fallback in src/llama-quant.cpp), and the gguf package can't write Q6_K."""
    import gguf

    q = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or name.startswith("position_"):
        return q.F32
    if outtype == "q4_0" and name == head:
        return q.Q8_0
    return {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0}[outtype]


def stored(name: str, data: np.ndarray, outtype: str, head: str) -> tuple[np.ndarray, object]:
    """(bytes as the file holds them, GGMLQuantizationType). A matrix whose rows the type's blocks don't divide (q8_0
    and q4_0: a row not a multiple of 32) falls back to float16, as convert_hf_to_gguf.py falls back when the gguf
    package's quantize refuses a shape."""
    import gguf

    qtype = tensor_type(name, data, outtype, head)
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
    writer.add_name(name)
    writer.add_file_type(file_type(plan.outtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(model.transformer.h[0].mlp.c_fc.out_features)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.kv_heads)
    if plan.family == "gpt2":
        writer.add_layer_norm_eps(c.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_dimension_count(c.head_width)
        writer.add_key_length(c.head_width)
        writer.add_value_length(c.head_width)
        writer.add_vocab_size(c.vocab_size)
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
    with torch.no_grad():
        for tensor_name, data in gguf_tensors(plan.family, model):
            data, qtype = stored(tensor_name, data, plan.outtype, head_name(model))
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
