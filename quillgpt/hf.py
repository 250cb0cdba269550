"""Hugging Face model directories, both ways, for every family of quillgpt/families.py (GPT-2, Llama, Mistral,
Qwen2, Qwen3, Gemma 3, Phi-3/4, OLMo 2, SmolLM3): each is a set of model.py's switches, and families.py says which.

qkv_bias goes out as Qwen2 only with Qwen's own tokenizer: transformers 5 rebuilds a Qwen2 model's
tokenizer with Qwen's split pattern and normaliser, whatever its tokenizer.json says. With any other
tokenizer it goes out as Llama with attention_bias (its output projection's bias zero), which reads
back in as qkv_bias.

Reading needs no transformers: config.json, the weights from safetensors (model.safetensors, or the
shards model.safetensors.index.json lists) and tokenizer.json. A pytorch_model.bin is refused: it
is a pickle, which can run code when loaded. A hub name is downloaded once (config, safetensors
and tokenizer files only) when there is network; offline it is one line naming the local alternative.
Writing (export_hf; export.py --hf) writes the family the model came from, or the one its switches say, or names
each switch the family does not express with the nearest setting that exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from model import GPT, mlp_hidden_width
from quillgpt.config import GPTConfig, build_config
from quillgpt.errors import UserError
from quillgpt.families import FAMILIES, chunk_of, config_args, config_json, export_family, family_of, hf_names
from quillgpt.files import atomic_write, atomic_write_json, atomic_write_text, read_json
from quillgpt.network import check_hub_reachable
from quillgpt.tokenizer import Tokenizer, hf_files, hf_tokenizer, tokenizer_from_dict

ARCHITECTURES = {key: f.architecture for key, f in FAMILIES.items()}
NAMES = {key: f.name for key, f in FAMILIES.items()}
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


def config_from_hf(family: str, hf: dict, source: str, dropout: float) -> GPTConfig:
    """config.json -> GPTConfig by the family's switch table (families.py); a setting model.py would compute
    differently is refused, naming it."""
    args = {**config_args(family, hf, source), "dropout": dropout}
    build_config({"model": args}, source=f"{source} config.json")  # the schema's range checks
    return GPTConfig.from_dict(args)


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


def piece_sizes(model: GPT, key: str, names: tuple[str, ...]) -> list[int]:
    """Rows of each HF tensor in model.py's concatenated one: q, k and v of c_attn; else one piece."""
    return list(model.transformer.h[0].attn.widths) if len(names) == 3 else [model.state_dict()[key].shape[0]]


def their_names(name: str, rows: int) -> list[str]:
    """The HF tensors a piece's name reads: itself, the one it is a chunk of, or each expert's of `rows`."""
    if "{e}" in name:
        return [name.format(e=e) for e in range(rows)]
    chunk = chunk_of(name)
    return [chunk[0] if chunk else name]


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
            parts.append(hf_piece(family, hf_state, name, key, (rows, *target.shape[1:]), source))
            used.update(their_names(name, rows))
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


def hf_piece(
    family: str, hf_state: dict[str, torch.Tensor], name: str, key: str, expected: tuple, source: str
) -> torch.Tensor:
    """The HF tensor `name` (or its chunk, name[i/n]; or every expert's, name with {e}, stacked) as model.py's piece of
    `key`, of the shape `expected`."""
    if "{e}" in name:  # (E, ...) from their E tensors
        experts = [hf_piece(family, hf_state, name.format(e=e), key, expected[1:], source) for e in range(expected[0])]
        return torch.stack(experts)
    chunk = chunk_of(name)
    whole, (i, n) = (chunk[0], chunk[1:]) if chunk else (name, (0, 1))
    if whole not in hf_state:
        raise UserError(
            f"{source}: tensor {whole} is missing from its weights (config.json describes a model that has it)"
        )
    tensor = hf_state[whole].t() if transposed(family, key) else hf_state[whole]
    implied = (expected[0] * n, *expected[1:])
    if tuple(tensor.shape) != implied:
        flip = transposed(family, key)  # shapes as HF stores them
        given, implied = (list(s)[::-1] if flip else list(s) for s in (tensor.shape, implied))
        raise UserError(f"{source}: tensor {whole} has shape {given}, but config.json implies {implied}")
    return tensor.chunk(n)[i]


# ---- out --------------------------------------------------------------------------------------------------


def hf_config(family: str, model: GPT, tokenizer: Tokenizer | None) -> dict:
    """config.json for the family (families.config_json), with the tokenizer's BOS/EOS ids (an <|endoftext|> plays
    both, as in GPT-2)."""
    eos = tokenizer.eot_id if tokenizer is not None else None
    bos = tokenizer.bos_id if tokenizer is not None and tokenizer.bos_id is not None else eos
    return config_json(family, model.config, mlp_hidden_width(model.config), bos, eos)


def hf_state(family: str, model: GPT) -> dict[str, torch.Tensor]:
    """model.py's weights under the family's names and layout; the tied head left out, as HF saves it. Biases the HF
    layout has and the model lacks are zeros, which compute the same function. Chunks of one of theirs (name[i/n])
    are joined in order."""
    own = model.state_dict()
    out, chunks = {}, {}
    for key, value in own.items():
        if key == "lm_head.weight" and model.config.tie_embeddings:
            continue
        names = hf_names(family, key)
        for name, piece in zip(names, value.split(piece_sizes(model, key, names))):
            piece = (piece.t() if transposed(family, key) else piece).detach().cpu()
            chunk = chunk_of(name)
            if "{e}" in name:
                out.update({name.format(e=e): expert.contiguous() for e, expert in enumerate(piece)})
            elif chunk:
                chunks.setdefault(chunk[0], {})[chunk[1]] = piece
            else:
                out[name] = piece.contiguous()
    for name, parts in chunks.items():
        out[name] = torch.cat([parts[i] for i in sorted(parts)])
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
    # attention_bias covers the output projection too
    if family in ("llama", "qwen3", "qwen3_moe") and c.qkv_bias and not c.bias:
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
