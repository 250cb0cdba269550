import json

import numpy as np
import pytest

from quillgpt import tokenizer as tokenizer_module
from quillgpt.errors import UserError
from quillgpt.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    get_tiktoken,
    load_tokenizer,
    safe_split_index,
    save_tokenizer,
    tokenizer_from_dict,
    train_tokenizer,
)

UNICODE_TEXT = "héllo wörld — 日本語 🎉\n"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\r\n  indented line\t\n\n\n"
    "def f(x):\n    return x + 1  # done\n"
    "Ünïcödé, 日本語のテキスト, emoji 🎉🎉 and numbers 12345.\n"
) * 40


def json_round_trip(tok):
    return tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe", [CORPUS], 300)


def test_char_tokenizer_round_trips_non_ascii_one_id_per_character():
    tok = train_tokenizer("char", [UNICODE_TEXT, "\x00abc"], None)
    assert tok.kind == "char" and tok.name is None
    assert tok.chars == sorted(set(UNICODE_TEXT + "\x00abc"))
    assert tok.vocab_size == len(tok.chars)
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) == len(UNICODE_TEXT)
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode(np.array(ids, dtype=np.uint16)) == UNICODE_TEXT
    assert tok.encode_array(UNICODE_TEXT).tolist() == ids
    assert tok.decode([]) == "" and tok.encode("") == []


def test_char_to_dict_rebuilds_same_tokenizer():
    tok = train_tokenizer("char", [UNICODE_TEXT + "\x00"], None)
    again = json_round_trip(tok)
    assert again.vocab_size == tok.vocab_size
    assert again.encode(UNICODE_TEXT + "\x00") == tok.encode(UNICODE_TEXT + "\x00")


def test_char_unknown_character_is_a_user_error():
    tok = train_tokenizer("char", ["abc"], None)
    with pytest.raises(UserError, match=r"'z'.*not in this dataset's char vocabulary"):
        tok.encode("abz")
    with pytest.raises(UserError, match="out of range"):
        tok.decode([0, 3])
    with pytest.raises(UserError, match="out of range"):
        tok.decode([-1])


def test_char_vocab_size_is_an_upper_bound():
    assert train_tokenizer("char", ["abc"], 10).vocab_size == 3
    with pytest.raises(UserError, match="3 distinct characters"):
        train_tokenizer("char", ["abc"], 2)


def test_char_keeps_a_given_order():
    tok = CharTokenizer(["b", "a", "\n"])  # nanoGPT metas may order ids differently
    assert tok.encode("ab\n") == [1, 0, 2]
    assert tok.decode([2, 0]) == "\nb"


def test_char_large_vocabulary_uses_wide_ids():
    chars = [chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c <= 0xDFFF]
    tok = CharTokenizer(chars)
    text = "".join(chars[-5:])
    ids = tok.encode_array(text)
    assert ids.tolist() == list(range(len(chars) - 5, len(chars)))
    assert tok.decode(ids) == text


def test_bpe_round_trips_any_unicode_and_learns_merges(bpe):
    assert bpe.kind == "bpe" and bpe.vocab_size == 300
    for text in [UNICODE_TEXT, CORPUS, "never seen: Ωμέγα ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00 \r\n", ""]:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    assert len(bpe.encode(CORPUS)) < 0.8 * len(CORPUS.encode())  # it did learn merges


def test_bpe_to_dict_rebuilds_same_tokenizer(bpe):
    d = json.loads(json.dumps(bpe.to_dict()))
    assert set(d) == {"kind", "vocab_size", "pattern", "tokens", "eot"} and len(d["tokens"]) == d["vocab_size"] - 1
    again = tokenizer_from_dict(d)
    assert again.encode(CORPUS + UNICODE_TEXT) == bpe.encode(CORPUS + UNICODE_TEXT) and again.eot_id == bpe.eot_id


def test_end_of_text_is_the_last_id_and_never_comes_from_text(bpe):
    """A trained BPE always ends with <|endoftext|>, a document char vocabulary when asked; text that contains
    the string encodes to its characters, and the id decodes to the string."""
    char = train_tokenizer("char", ["ab\n<|endoftext|>"], None, eot=True)
    for tok in (bpe, char):
        assert tok.eot_id == tok.vocab_size - 1
        assert (
            tok.eot_id not in tok.encode("<|endoftext|>") and tok.decode(tok.encode("<|endoftext|>")) == "<|endoftext|>"
        )
    a, b = char.encode("a") + [char.eot_id], char.encode("b") + [char.eot_id]
    assert char.decode(a + b) == "a<|endoftext|>b<|endoftext|>" and char.decode(char.encode("ab")) == "ab"
    assert bpe.decode(bpe.encode("Speak") + [bpe.eot_id]) == "Speak<|endoftext|>"
    assert json_round_trip(char).eot_id == char.eot_id and train_tokenizer("char", ["ab"], None).eot_id is None
    with pytest.raises(
        UserError, match="the text has 2 distinct characters and <|endoftext|>, more than the requested vocab_size 2"
    ):
        train_tokenizer("char", ["ab"], 2, eot=True)


def test_bpe_vocab_size_is_at_least_257_and_4096_at_most_by_default():
    """Below 257 (256 bytes + <|endoftext|>) is refused, the default is at most 4096, ids beyond it do not decode."""
    with pytest.raises(UserError, match="at least 257"):
        train_tokenizer("bpe", ["abc"], 256)
    assert train_tokenizer("bpe", ["abc abc abc"], None).vocab_size <= 4096
    with pytest.raises(UserError, match="out of range"):
        train_tokenizer("bpe", ["abc"], 257).decode([257])


@pytest.mark.parametrize("pattern", ["gpt4", "gpt2"])
def test_parallel_pieces_encode_like_one_piece(bpe, monkeypatch, pattern):
    tok = bpe if pattern == "gpt4" else BPETokenizer(GPT2_PATTERN, bpe.tokens)
    whole = tok.encode(CORPUS)
    monkeypatch.setattr(tokenizer_module, "BPE_PIECE_CHARS", 97)
    assert tok.encode_array(CORPUS).tolist() == whole


def test_safe_split_index_cuts_between_letter_and_line_break():
    text = "ab.\ncd:\nef\r\ngh\n"
    assert safe_split_index(text, 0, len(text)) == text.index("h") + 1
    assert safe_split_index(text, 0, 12) == text.index("\r")
    assert safe_split_index(text.encode(), 0, 12) == text.index("\r")
    assert safe_split_index("ab.\ncd:\n", 0, 8) == 8  # no letter before a newline: after the last newline
    assert safe_split_index("日本語".encode(), 0, 4) == 3  # never inside a UTF-8 character


@pytest.mark.parametrize(
    "d, message",
    [
        ({}, "unknown tokenizer kind"),
        ({"kind": "char"}, "'chars'"),
        ({"kind": "char", "chars": ["a", "a"]}, "duplicate"),
        ({"kind": "char", "chars": ["ab"]}, "single characters"),
        ({"kind": "char", "chars": ["a"], "vocab_size": 2}, "vocab_size 2"),
        ({"kind": "bpe", "pattern": "x", "tokens": ["not base64!"]}, "base64"),
        ({"kind": "bpe", "pattern": "x", "tokens": ["YQ=="]}, "256 single bytes"),
        ({"kind": "tiktoken", "name": "nope"}, "unknown tokenizer 'nope'"),
    ],
)
def test_malformed_dict_is_a_user_error(d, message):
    with pytest.raises(UserError, match=message):
        tokenizer_from_dict(d)


def test_a_saved_tokenizer_loads_equal_and_bad_files_are_user_errors(tmp_path, bpe):
    save_tokenizer(bpe, tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path / "tokenizer.json").encode(CORPUS) == bpe.encode(CORPUS)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left behind
    (tmp_path / "bad.json").write_text('{"kind": "char", "chars": 5}')
    with pytest.raises(UserError, match="bad.json"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")


def test_unknown_tiktoken_name_is_a_user_error():
    with pytest.raises(UserError, match="unknown tokenizer 'gpt5'"):
        get_tiktoken("gpt5")


def test_tiktoken_offline_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache: tiktoken has to download
    try:
        tok = get_tiktoken("r50k_base")
    except UserError as e:
        assert "needs the network" in str(e) and "--tokenizer char|bpe" in str(e)
    else:
        pytest.skip(f"network available, loaded {tok}")


def test_gpt2_tiktoken_round_trips_unicode_when_available():
    try:
        tok = get_tiktoken("gpt2")
    except UserError as e:
        pytest.skip(str(e))
    assert tok.kind == "tiktoken" and tok.name == "gpt2" and tok.vocab_size == 50257
    assert tok.decode(tok.encode(UNICODE_TEXT)) == UNICODE_TEXT
    assert tok.to_dict() == {"kind": "tiktoken", "name": "gpt2"}
