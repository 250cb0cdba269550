import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT

from quillgpt import tokenizer as tokenizer_module
from quillgpt.data import load_dataset
from quillgpt.errors import UserError
from quillgpt.prepare import pipeline, prepare_dataset, prepare_txt_dir, recipes
from quillgpt.tokenizer import get_tiktoken, load_tokenizer, save_tokenizer, train_tokenizer

TEXT = "".join(
    f"Line {i}: the quick brown fox — naïve café 日本語 🎉 jumps over {i * 7} lazy dogs.\n"
    + ("\n" if i % 5 == 0 else "")
    + ("  indented: x = f(y)\r\n" if i % 7 == 0 else "")
    for i in range(400)
)
META_KEYS = {
    "format_version",
    "dataset",
    "tokenizer",
    "vocab_size",
    "dtype",
    "eot_id",
    "train_tokens",
    "val_tokens",
    "train_documents",
    "val_documents",
    "max_token_id",
    "split",
    "sources",
    "input_bytes",
    "request",
}


def run_cli(*args, cwd, env_extra=None, timeout=60):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "prepare.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def load(out_dir):
    meta = json.loads((out_dir / "meta.json").read_text())
    train = np.fromfile(out_dir / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(out_dir / "val.bin", dtype=meta["dtype"])
    return meta, train, val, load_tokenizer(out_dir / meta["tokenizer"]["file"])


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def check_dataset(out_dir, kind):
    meta, train, val, tok = load(out_dir)
    assert META_KEYS <= set(meta)
    assert meta["format_version"] == 2
    assert meta["tokenizer"]["kind"] == kind == tok.kind
    assert meta["vocab_size"] == tok.vocab_size
    assert meta["dtype"] == "uint16"
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert int(max(train.max(), val.max())) == meta["max_token_id"] < meta["vocab_size"]
    assert all(set(s) >= {"path", "kind", "bytes", "sha256"} for s in meta["sources"])
    assert sorted(p.name for p in out_dir.iterdir() if p.name != "input.txt") == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]  # no temp files, no work directory
    return meta, train, val, tok


def test_char_dataset_decodes_to_the_input_split_at_nanogpts_cut(tmp_path, text_file):
    out_dir = prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path / "data", verbose=False)
    assert out_dir == tmp_path / "data" / "mytext"
    meta, train, val, tok = check_dataset(out_dir, "char")
    assert tok.decode(train) + tok.decode(val) == TEXT
    assert meta["vocab_size"] == len(set(TEXT))
    raw = TEXT.encode()
    assert meta["sources"][0]["bytes"] == len(raw) and meta["sources"][0]["kind"] == "text"
    assert meta["split"] == {"rule": "tail", "val_fraction": 0.1} and meta["eot_id"] is None
    assert 0 <= len(tok.decode(train).encode()) - int(len(raw) * 0.9) < 4  # nanoGPT's cut, at a character start


def test_bpe_dataset_decodes_to_the_input_in_fewer_tokens_than_bytes(tmp_path, text_file):
    out_dir = prepare_dataset(
        "mytext", input_path=str(text_file), tokenizer="bpe", vocab_size=300, data_dir=tmp_path, verbose=False
    )
    meta, train, val, tok = check_dataset(out_dir, "bpe")
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["name"] is None and tok.eot_id == 299
    assert tok.decode(train) + tok.decode(val) == TEXT
    assert len(train) + len(val) < 0.6 * len(TEXT.encode())


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_small_chunks_give_the_same_tokens(tmp_path, text_file, monkeypatch, kind):
    whole = prepare_dataset(
        "a",
        input_path=str(text_file),
        tokenizer=kind,
        vocab_size=300 if kind == "bpe" else None,
        data_dir=tmp_path,
        verbose=False,
    )
    monkeypatch.setattr(pipeline, "BPE_PIECE_CHARS", 600)  # the pieces BPE trains on
    monkeypatch.setattr(tokenizer_module, "BPE_PIECE_CHARS", 500)  # the pieces encoded
    chunked = prepare_dataset(
        "b",
        input_path=str(text_file),
        tokenizer=kind,
        vocab_size=300 if kind == "bpe" else None,
        data_dir=tmp_path,
        verbose=False,
        chunk_bytes=1000,
    )
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (whole / name).read_bytes() == (chunked / name).read_bytes()


def test_a_prepared_dataset_is_reused_and_another_request_needs_reset(tmp_path, text_file, capsys):
    """The same request reuses the files untouched; another tokenizer, vocab or input is refused naming --reset."""
    kwargs = dict(input_path=str(text_file), data_dir=tmp_path, verbose=True)
    out_dir = prepare_dataset("mytext", **kwargs)
    stamps = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    capsys.readouterr()
    assert prepare_dataset("mytext", **kwargs) == out_dir
    assert capsys.readouterr().out.startswith(f"reusing {out_dir} (char tokenizer")
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == stamps

    with pytest.raises(
        UserError,
        match=r"prepared with the char tokenizer \(vocab \d+\); re-prepare it with the bpe tokenizer \(vocab 4096\): "
        r"prepare.py --reset, or remove .* and train.py prepares it again",
    ):
        prepare_dataset("mytext", tokenizer="bpe", **kwargs)
    prepare_dataset("mytext", tokenizer="bpe", vocab_size=300, reset=True, **kwargs)
    assert load(out_dir)[0]["tokenizer"]["kind"] == "bpe"
    with pytest.raises(UserError, match=r"vocab 300.*vocab 512\): prepare.py --reset"):
        prepare_dataset("mytext", tokenizer="bpe", vocab_size=512, **kwargs)
    other = tmp_path / "other.txt"
    other.write_text("something else\n" * 10)
    with pytest.raises(UserError, match="re-prepare it from .*: prepare.py --reset"):
        prepare_dataset("mytext", tokenizer="bpe", vocab_size=300, input_path=str(other), data_dir=tmp_path)


def test_an_input_rewritten_since_its_preparation_is_refused_until_the_dataset_is_removed(tmp_path, text_file):
    """Rewriting the input (tasks.py again, with --tool) and training on it names both ways to re-prepare; removing
    the dataset, as the message says, lets the next preparation make it from the new text."""
    prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path)
    text_file.write_text(text_file.read_text() + "more lines\n")
    with pytest.raises(UserError, match="changed since .* prepare.py --reset, or remove .* prepares it again"):
        prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path)
    shutil.rmtree(tmp_path / "mytext")
    out_dir = prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path)
    assert json.loads((out_dir / "meta.json").read_text())["sources"][0]["bytes"] == text_file.stat().st_size


@pytest.mark.slow
def test_a_bpe_dataset_prepared_at_one_size_is_reused_by_a_run_that_names_no_size(tmp_path, text_file):
    """prepare.py --tokenizer bpe --vocab-size 512, then train.py with the README's --data.tokenizer bpe and no size:
    the run trains on the dataset as prepared (the 4096 default was never asked for). A size that differs is still
    a conflict, named as one."""
    data = tmp_path / "data"
    made = run_cli(
        "--dataset",
        "mytext",
        "--input",
        str(text_file),
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "512",
        "--data-dir",
        str(data),
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    stamps = {p.name: p.stat().st_mtime_ns for p in (data / "mytext").iterdir()}
    common = [
        "--data.dataset",
        "mytext",
        "--data.tokenizer",
        "bpe",
        "--data.data_dir",
        str(data),
        "--run.out_dir",
        str(tmp_path / "runs"),
        "--run.name",
        "t",
        "--max-iters",
        "2",
        "--device",
        "cpu",
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.n_embd",
        "32",
        "--model.block_size",
        "32",
        "--training.batch_size",
        "2",
        "--training.eval_interval",
        "0",
        "--logging.plot",
        "false",
    ]
    trained = subprocess.run(
        [sys.executable, "train.py", *common], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert trained.returncode == 0, trained.stderr
    assert f"reusing {data / 'mytext'} (bpe tokenizer, vocab 512" in trained.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (data / "mytext").iterdir()} == stamps
    conflict = subprocess.run(
        [sys.executable, "train.py", *common, "--data.bpe_vocab_size", "1024", "--force"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(conflict, "prepared with the bpe tokenizer (vocab 512)", "(vocab 1024)")


def test_a_crash_leaves_only_work_to_continue(tmp_path, text_file, monkeypatch):
    def explode(self, text):
        raise RuntimeError("simulated crash")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_module.CharTokenizer, "encode_array", explode)
        with pytest.raises(RuntimeError):
            prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path, verbose=False)
    assert sorted(p.name for p in (tmp_path / "mytext").iterdir()) == [".prepare"]
    with pytest.raises(UserError, match="is incomplete: prepare.py stopped before finishing it; run the same"):
        load_dataset(tmp_path / "mytext")
    prepare_dataset("mytext", input_path=str(text_file), data_dir=tmp_path, verbose=False)
    assert load_dataset(tmp_path / "mytext").lengths["train"] > 0


def test_tiny_shakespeare_matches_nanogpt(tmp_path, shakespeare_path):
    out_dir = prepare_dataset("shakespeare_char", input_path=str(shakespeare_path), data_dir=tmp_path, verbose=False)
    meta, train, val, tok = check_dataset(out_dir, "char")
    assert meta["vocab_size"] == 65
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert meta["sources"][0]["sha256"] == recipes.SHAKESPEARE_SHA256
    assert tok.decode(train[:14]) == "First Citizen:"


def test_shakespeare_defaults_to_gpt2(tmp_path, shakespeare_path):
    try:
        get_tiktoken("gpt2")
    except UserError as e:
        pytest.skip(str(e))
    out_dir = prepare_dataset("shakespeare", input_path=str(shakespeare_path), data_dir=tmp_path, verbose=False)
    meta, train, val, tok = check_dataset(out_dir, "tiktoken")
    assert meta["tokenizer"]["name"] == "gpt2" and meta["vocab_size"] == 50257
    assert json.loads((out_dir / "tokenizer.json").read_text()) == {"kind": "tiktoken", "name": "gpt2"}


def test_tiktoken_dataset_records_the_encoding_name_and_decodes_to_the_input(tmp_path, text_file, monkeypatch):
    """tokenizer='gpt2' stores the encoding's name, not its tokens; a vocab_size below the encoding's is refused."""
    # the real gpt2 files need the network once; a locally trained encoding under the name "gpt2" stands in
    bpe = train_tokenizer("bpe", [TEXT], 300)
    stand_in = tokenizer_module.NamedTiktokenTokenizer("gpt2", bpe.encoding)
    monkeypatch.setattr(tokenizer_module, "get_tiktoken", lambda name, chat_tokens=(): stand_in)
    monkeypatch.setattr(pipeline, "get_tiktoken", lambda name, chat_tokens=(): stand_in)
    out_dir = prepare_dataset("x", input_path=str(text_file), tokenizer="gpt2", data_dir=tmp_path, verbose=False)
    meta, train, val, tok = check_dataset(out_dir, "tiktoken")
    assert meta["tokenizer"]["name"] == "gpt2" and meta["request"]["tokenizer"] == "gpt2"
    assert json.loads((out_dir / "tokenizer.json").read_text()) == {"kind": "tiktoken", "name": "gpt2"}
    assert tok.decode(train) + tok.decode(val) == TEXT
    with pytest.raises(UserError, match="300 tokens, more than the requested vocab_size 299"):
        prepare_dataset("y", input_path=str(text_file), tokenizer="gpt2", vocab_size=299, data_dir=tmp_path)


def test_pystdlib_is_an_offline_corpus_of_documents(tmp_path):
    """Each stdlib file a document ending with <|endoftext|>; whole documents go to val by hash."""
    outputs = []
    for data_dir in (tmp_path / "one", tmp_path / "two"):
        out_dir = prepare_dataset("pystdlib", max_bytes=150_000, data_dir=data_dir, verbose=False)
        meta, train, val, tok = check_dataset(out_dir, "char")
        outputs.append((meta["sources"], train.tobytes(), val.tobytes()))
    assert outputs[0] == outputs[1]  # deterministic
    assert meta["sources"][0]["kind"] == "pystdlib" and 140_000 < meta["input_bytes"] <= 150_000
    assert meta["split"] == {"rule": "docs", "val_fraction": 0.1, "seed": 0} and meta["eot_id"] == tok.eot_id
    documents = meta["train_documents"] + meta["val_documents"]
    assert (train == tok.eot_id).sum() == meta["train_documents"] and (val == tok.eot_id).sum() == meta["val_documents"]
    assert train[-1] == val[-1] == tok.eot_id and 0 < meta["val_documents"] < documents / 4
    first = tok.decode(train[: np.argmax(train == tok.eot_id)])
    stdlib = sorted(Path(meta["sources"][0]["path"]).glob("*.py"))[:20]
    assert first in {p.read_text() for p in stdlib}  # a whole file
    # a request that leaves max_bytes open takes the dataset as prepared; one that names another is refused,
    # naming the setting and both ways on
    prepare_dataset("pystdlib", data_dir=tmp_path / "one", verbose=False)
    assert (tmp_path / "one" / "pystdlib" / "train.bin").read_bytes() == outputs[0][1]
    with pytest.raises(
        UserError, match=r"prepared with max_bytes = 150000, and --max-bytes asks for 200000: use it as"
    ):
        prepare_dataset("pystdlib", max_bytes=200_000, data_dir=tmp_path / "one", verbose=False)


def test_invalid_utf8_becomes_u_fffd_with_a_warning_and_nul_bytes_stay(tmp_path, capsys):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good \x00 text\n" * 20 + b"bad \xff\xfe bytes \xe6\x97 cut\n" + b"more text here\n" * 20)
    out_dir = prepare_dataset("bad", input_path=str(path), data_dir=tmp_path, verbose=False)
    meta, train, val, tok = check_dataset(out_dir, "char")
    assert meta["invalid_utf8_replaced"] == 3
    assert tok.decode(train) + tok.decode(val) == path.read_bytes().decode("utf-8", "replace")
    assert "\x00" in tok.chars
    assert "3 invalid UTF-8 byte sequences" in capsys.readouterr().err


def test_split_and_max_bytes_respect_characters(tmp_path):
    path = tmp_path / "cjk.txt"
    path.write_text("日本語テキスト" * 1000, encoding="utf-8")
    out_dir = prepare_dataset(
        "cjk", input_path=str(path), max_bytes=10_000, val_fraction=0.25, data_dir=tmp_path, verbose=False
    )
    meta, train, val, tok = check_dataset(out_dir, "char")
    assert meta["input_bytes"] == 9999 and meta["invalid_utf8_replaced"] == 0
    assert (len(train), len(val)) == (2500, 833)


def test_large_vocabulary_uses_uint32(tmp_path):
    path = tmp_path / "wide.txt"
    path.write_text(
        "".join(chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c <= 0xDFFF) * 2, encoding="utf-8"
    )
    meta, train, val, tok = load(prepare_dataset("wide", input_path=str(path), data_dir=tmp_path, verbose=False))
    assert meta["dtype"] == "uint32" and train.dtype == np.uint32 and meta["vocab_size"] > 65535
    assert tok.decode(train) + tok.decode(val) == path.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dataset="nope"), "unknown dataset 'nope'.*--input"),
        (dict(dataset="x", input_path="missing.txt"), "input not found: missing.txt"),
        (dict(dataset="x", input_path=".", glob="*.nothing"), "--glob '\\*.nothing' matches no file under ."),
        (dict(dataset="pystdlib", val_fraction=1.0), "val_fraction"),
        (dict(dataset="pystdlib", tokenizer="gpt5"), "unknown tokenizer 'gpt5'"),
        (dict(dataset="pystdlib", tokenizer="bpe", vocab_size=100), "at least 257"),
        (dict(dataset="pystdlib", max_bytes=5000, vocab_size=3), "more than the requested vocab_size 3"),
        (dict(dataset="../x", input_path="a.txt"), "plain folder name"),
    ],
)
def test_bad_prepare_arguments_are_user_errors_naming_the_fault(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        prepare_dataset(**kwargs, data_dir=tmp_path, verbose=False)


@pytest.mark.parametrize("name", ["verbos", "inputs"])
def test_an_option_that_is_not_one_is_named(tmp_path, name):
    """prepare_dataset's options are Request's and Settings' fields (the inputs given as input_path): a misspelt
    one is refused by name, not ignored."""
    with pytest.raises(TypeError, match=f"prepare_dataset\\(\\) got an unexpected keyword argument '{name}'"):
        prepare_dataset("x", data_dir=tmp_path, **{name: False})
    assert not (tmp_path / "x").exists()


def test_an_input_too_small_for_a_split_is_refused_writing_nothing(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("ab")
    with pytest.raises(UserError, match="too small for a validation split"):
        prepare_dataset("tiny", input_path=str(path), data_dir=tmp_path, verbose=False)
    assert not (tmp_path / "tiny" / "train.bin").exists()


def test_cli_empty_file_exits_2(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    result = run_cli("--dataset", "empty", "--input", "empty.txt", cwd=tmp_path)
    assert_one_line_error(result, "empty.txt is empty")


def test_cli_prepares_and_reuses(tmp_path, text_file):
    first = run_cli("--dataset", "mytext", "--input", str(text_file), "--data-dir", "out", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "out" / "mytext" / "meta.json").is_file()
    second = run_cli("--dataset", "mytext", "--input", str(text_file), "--data-dir", "out", cwd=tmp_path)
    assert second.returncode == 0 and second.stdout.startswith("reusing out/mytext")


def test_shakespeare_download_is_verified_and_kept(tmp_path, shakespeare_path, monkeypatch):
    # no network here: a stand-in for urlopen serves the local copy (or corrupt bytes)
    served = [b"not shakespeare", shakespeare_path.read_bytes()]
    monkeypatch.setattr(recipes.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(served.pop(0)))
    with pytest.raises(UserError, match="sha256.*--input"):
        prepare_dataset("shakespeare_char", data_dir=tmp_path, verbose=False)
    assert not (tmp_path / "shakespeare_char" / "input.txt").exists()
    out_dir = prepare_dataset("shakespeare_char", data_dir=tmp_path, verbose=False)
    meta = check_dataset(out_dir, "char")[0]
    assert meta["sources"][0]["url"] == recipes.SHAKESPEARE_URL and meta["train_tokens"] == 1_003_854
    prepare_dataset(
        "shakespeare_char", data_dir=tmp_path, tokenizer="bpe", reset=True, verbose=False
    )  # no second download


def test_offline_shakespeare_download_names_the_local_input_flag(tmp_path):
    """Offline, prepare.py and train.py (which prepares a missing preset dataset) each name the flag that gives a
    local copy, and leave nothing behind."""
    result = run_cli("--dataset", "shakespeare_char", cwd=tmp_path, timeout=30)
    if result.returncode == 0:
        pytest.skip("network available: the download worked")
    assert_one_line_error(result, "cannot download tiny Shakespeare", "--input")
    assert not (tmp_path / "data" / "shakespeare_char" / "input.txt").exists()
    train_py = REPO_ROOT / "train.py"
    result = subprocess.run(
        [
            sys.executable,
            str(train_py),
            "--config",
            str(train_py.parent / "configs/shakespeare_char/cpu.toml"),
            "--data.data_dir",
            str(tmp_path / "data"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(result, "cannot download tiny Shakespeare", "--data.input")
    assert not (tmp_path / "data" / "shakespeare_char").exists()


def test_cli_gpt2_offline_is_one_line_naming_the_offline_tokenizers(tmp_path, text_file):
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache")}
    result = run_cli("--dataset", "x", "--input", str(text_file), "--tokenizer", "gpt2", cwd=tmp_path, env_extra=env)
    if result.returncode == 0:
        pytest.skip("network available: gpt2 was downloaded")
    assert_one_line_error(
        result,
        "tiktoken could not load the 'gpt2' encoding (it downloads it once and needs the network): "
        "run once with network access, or use --tokenizer char|bpe offline",
    )


def make_txt_dir(path, train="hello world\n" * 50, val="world hello\n" * 10):
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.txt").write_text(train)
    (path / "val.txt").write_text(val)
    return path


def test_txt_dir_builds_and_reuses_cache(tmp_path, capsys):
    src = make_txt_dir(tmp_path / "processed")
    cache = prepare_txt_dir(src, verbose=False)
    assert cache == src / "cache"
    meta, train, val, tok = check_dataset(cache, "char")
    assert tok.decode(train) == "hello world\n" * 50 and tok.decode(val) == "world hello\n" * 10
    assert meta["split"]["rule"] == "given" and [s["path"] for s in meta["sources"]] == [
        str((src / name).resolve()) for name in ("train.txt", "val.txt")
    ]
    prepare_txt_dir(src, verbose=True)
    assert capsys.readouterr().out.startswith("reusing")

    (src / "val.txt").write_text("hello hello z\n" * 3)
    meta, train, val, tok = load(prepare_txt_dir(src, verbose=False))
    assert "z" in tok.chars and tok.decode(val) == "hello hello z\n" * 3

    meta, train, val, tok = load(prepare_txt_dir(src, tokenizer="bpe", vocab_size=260, verbose=False))
    assert tok.kind == "bpe" and tok.decode(train) == "hello world\n" * 50


def test_txt_dir_honours_the_order_of_a_nanogpt_char_meta(tmp_path):
    src = make_txt_dir(tmp_path / "processed", train="abcabc\n" * 5, val="cab\n")
    itos = {str(i): c for i, c in enumerate("cba\n")}  # a non-sorted order, to see it is honoured
    (src / "meta.json").write_text(
        json.dumps({"vocab_size": 4, "itos": itos, "stoi": {c: int(i) for i, c in itos.items()}})
    )
    meta, train, val, tok = load(prepare_txt_dir(src, verbose=False))
    assert tok.chars == ["c", "b", "a", "\n"]
    assert val.tolist() == [0, 2, 1, 3]


def test_txt_dir_loads_token_ids_and_refuses_ids_beyond_the_tokenizer(tmp_path):
    """Token ids in train.npy/val.npy load with the meta's tokenizer; an id beyond it or no tokenizer is refused."""
    src = tmp_path / "processed"
    src.mkdir()
    tok = train_tokenizer("char", ["abc\n"], None)
    save_tokenizer(tok, src / "tokenizer.json")
    (src / "meta.json").write_text(json.dumps({"tokenizer": {"kind": "char", "name": None, "file": "tokenizer.json"}}))
    np.save(src / "train.npy", np.array(tok.encode("abcabc\n" * 4), dtype=np.int64))
    np.save(src / "val.npy", np.array(tok.encode("cab\n"), dtype=np.int64))
    meta, train, val, loaded = load(prepare_txt_dir(src, verbose=False))
    assert loaded.decode(train) == "abcabc\n" * 4 and loaded.decode(val) == "cab\n"

    np.save(src / "val.npy", np.array([0, 9], dtype=np.int64))
    with pytest.raises(UserError, match="token id 9"):
        prepare_txt_dir(src, verbose=False)
    (src / "meta.json").write_text("{}")
    with pytest.raises(UserError, match="must say which tokenizer"):
        prepare_txt_dir(src, verbose=False)


def test_txt_dir_without_its_files_is_a_user_error(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "train.txt").write_text("abc")
    with pytest.raises(UserError, match="missing val.txt"):
        prepare_txt_dir(tmp_path / "p")
    with pytest.raises(UserError, match="not found"):
        prepare_txt_dir(tmp_path / "nothing")
