"""Fuzzing: the config loader, the command line and prepare.py take anything and either work or say
what is wrong (ConfigError / UserError: one line per mistake, exit 2), never a traceback.

In-process with hypothesis for volume, plus a handful of real subprocess runs for the exit path.
Run with -s to see how many examples each target tried.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
import types
import typing
from collections import Counter
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import tomllib
from conftest import REPO_ROOT
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from quillgpt.config import SECTIONS, SHORT_FLAGS, Config, ConfigError, build_config, load_config, to_toml
from quillgpt.data import load_dataset
from quillgpt.errors import UserError
from quillgpt.prepare import prepare_dataset
from quillgpt.tokenizer import load_tokenizer

TRIED: Counter = Counter()  # examples tried per target


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print("\nfuzz examples tried: " + ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items())))


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, timeout=120, env=CHILD_ENV)


# ---- TOML documents -----------------------------------------------------------------------------------


def toml_value(v) -> str:
    """A TOML value for a tomllib-like Python value (the test's own serialiser: tomllib can't write)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{toml_value(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_text(doc: dict) -> str:
    """Top-level keys first (TOML puts them before any [table]), then one [table] per dict value."""
    scalars = [f"{toml_value(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [
        f"[{toml_value(k)}]\n" + "".join(f"{toml_value(key)} = {toml_value(x)}\n" for key, x in v.items())
        for k, v in doc.items()
        if isinstance(v, dict)
    ]
    return "\n".join(scalars) + "\n" + "\n".join(tables)


text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)  # TOML text can't hold lone surrogates
scalars = st.one_of(st.booleans(), st.integers(-(10**6), 10**6), st.integers(), st.floats(), text)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6
)


def base_type(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) else tp


def typed_values(section: str, name: str):
    """Plausible values of the field's own type (so a good share of documents is valid or nearly so)."""
    f = next(f for f in fields(SECTIONS[section]) if f.name == name)
    tp = base_type(typing.get_type_hints(SECTIONS[section])[name])
    if f.metadata.get("choices"):
        return st.sampled_from(f.metadata["choices"]) | text
    return {bool: st.booleans(), int: st.integers(-2, 5000), float: st.floats(-0.5, 2.0), str: text}.get(tp, values)


FIELD_NAMES = {s: [f.name for f in fields(c)] for s, c in SECTIONS.items()}


def table(section: str):
    good = st.sampled_from(FIELD_NAMES[section]).flatmap(lambda k: st.tuples(st.just(k), typed_values(section, k)))
    wild = st.tuples(st.sampled_from(sum(FIELD_NAMES.values(), [])) | text, values)
    return st.lists(good | good | wild, max_size=6).map(dict)


documents = st.lists(
    st.sampled_from(list(SECTIONS)).flatmap(lambda s: st.tuples(st.just(s), table(s)))
    | st.tuples(text, values | st.dictionaries(text, values, max_size=3)),
    max_size=6,
).map(dict)


def assert_config_or_error(load, target: str) -> Config | None:
    TRIED[target] += 1
    try:
        cfg = load()
    except ConfigError as e:
        assert str(e).strip(), "a ConfigError must say what is wrong"
        return None
    assert isinstance(cfg, Config)
    TRIED[f"{target} (valid)"] += 1
    # the resolved config written to every run directory (config.toml) must load back to the same config
    assert to_toml(build_config(tomllib.loads(to_toml(cfg)))) == to_toml(cfg)
    return cfg


@settings(FUZZ, max_examples=400)
@given(doc=documents)
def test_any_toml_document_gives_a_config_or_a_config_error(doc, tmp_path):
    source = toml_text(doc)
    assert json.dumps(tomllib.loads(source), sort_keys=True) == json.dumps(
        doc, sort_keys=True
    )  # the serialiser is right
    path = tmp_path / "fuzz.toml"
    path.write_text(source, encoding="utf-8")
    assert_config_or_error(lambda: load_config(path), "toml documents")


FREE_TEXT_FIELDS = [
    ("run", "name"),
    ("run", "out_dir"),
    ("run", "init_from"),
    ("data", "dataset"),
    ("data", "input"),
    ("data", "data_dir"),
    ("logging", "wandb_project"),
    ("logging", "wandb_run_name"),
]


@settings(FUZZ, max_examples=150)
@given(field=st.sampled_from(FREE_TEXT_FIELDS), value=text)
def test_any_text_in_a_free_text_field_round_trips_through_config_toml(field, value):
    """Quotes, backslashes, newlines, DEL and other control characters must be escaped in config.toml."""
    TRIED["free-text values"] += 1
    section, key = field
    cfg = build_config({section: {key: value}})
    assert getattr(getattr(build_config(tomllib.loads(to_toml(cfg))), section), key) == value


@settings(FUZZ, max_examples=200)
@given(
    raw=st.binary(max_size=300)
    | text.map(str.encode)
    | st.sampled_from([b"", b"\x00", b"\xff\xfe", b"[model]\nn_layer = \x00"])
)
def test_any_bytes_as_a_config_file_give_a_config_or_a_config_error(raw, tmp_path):
    path = tmp_path / "raw.toml"
    path.write_bytes(raw)
    assert_config_or_error(lambda: load_config(path), "raw config files")


flags = st.sampled_from(
    [f"--{s}.{k}" for s, names in FIELD_NAMES.items() for k in names]
    + list(SHORT_FLAGS)
    + ["--", "-", "--.", "---x", "--model", "--model.", "--.n_layer", "--a.b.c", "--model.n_layer.x"]
)
cli_values = st.one_of(
    st.sampled_from(
        [
            "1",
            "0",
            "-1",
            "1e-3",
            "1e999",
            "1" + "0" * 400,
            "true",
            "no",
            "none",
            "null",
            "[1, 2]",
            "{a = 1}",
            '"quoted"',
            "nan",
            "inf",
            "",
            " ",
            "cpu",
            "cuda:x",
        ]
    ),
    st.text(max_size=10),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),
)  # argv's invalid UTF-8
arguments = st.lists(
    st.one_of(
        flags.flatmap(lambda f: st.sampled_from([[f], [f, "1"]]) | cli_values.map(lambda v: [f, v])),
        flags.flatmap(lambda f: cli_values.map(lambda v: [f"{f}={v}"])),
        cli_values.map(lambda v: [v]),
    ),
    max_size=6,
).map(lambda parts: sum(parts, []))


@settings(FUZZ, max_examples=400)
@given(args=arguments)
def test_any_command_line_gives_a_config_or_a_config_error(args):
    assert_config_or_error(lambda: load_config(None, args), "command lines")


def config_cases(tmp: Path) -> dict[str, list[str]]:
    """A handful of hostile inputs for `python -m quillgpt.config`, from a seeded generator."""
    rng = random.Random(11)
    files = {
        "random_bytes": rng.randbytes(400),  # also invalid UTF-8 and NUL bytes
        "odd_but_valid": toml_text(
            {
                "run": {"name": 'tab\there\nnew line \x7f \U0001f600 "q" \\'},
                "optimizer": {"learning_rate": 1e-3, "min_lr": 0},
            }
        ).encode(),
        "many_mistakes": toml_text(
            {
                "modle": {"n_layer": 2},
                "model": {"n_layer": "two", "n_head": 0},
                "optimizer": {"learning_rate": 10**400},
                "top": 1,
            }
        ).encode(),
    }
    for name, raw in files.items():
        (tmp / f"{name}.toml").write_bytes(raw)
    cases = {name: ["-m", "quillgpt.config", str(tmp / f"{name}.toml")] for name in files}
    cases["argv_invalid_utf8"] = ["-m", "quillgpt.config", "--run.name", os.fsdecode(b"run\xff")]
    return cases


def test_config_cli_exits_0_or_2_without_traceback(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cases = config_cases(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(lambda args: run_script(*args), cases.values())))
    TRIED["python -m quillgpt.config runs"] += len(results)
    for name, proc in results.items():
        stderr = proc.stderr.decode("utf-8", "replace")
        assert proc.returncode in (0, 2) and b"Traceback" not in proc.stderr, (name, stderr)
        if proc.returncode == 2:
            assert stderr.startswith("error: "), (name, stderr)
    assert results["odd_but_valid"].returncode == 0
    printed = tomllib.loads(results["odd_but_valid"].stdout.decode("utf-8"))
    assert printed["run"]["name"] == 'tab\there\nnew line \x7f \U0001f600 "q" \\'
    assert results["many_mistakes"].stderr.decode().count("error: ") == 5  # every mistake, one line each
    assert results["argv_invalid_utf8"].returncode == 2 and b"not valid UTF-8" in results["argv_invalid_utf8"].stderr


# ---- prepare.py on arbitrary bytes ------------------------------------------------------------------------

inputs = st.one_of(
    st.binary(max_size=2000),
    st.text(max_size=600).map(lambda s: s.encode("utf-8")),
    st.lists(
        st.sampled_from(
            [
                b"a",
                b"\n",
                b"\x00",
                b"\xff",
                b"\xc3",
                b"\xc3\xa9",
                b"\xe2\x82",
                b"\xe2\x82\xac",
                b"\xf0\x9f\x98\x80",
                b"\x80",
                b"\xef\xbf\xbd",
                b"\r\n",
                b" ",
            ]
        ),
        max_size=400,
    ).map(b"".join),
)


def decoded(directory: Path) -> tuple[str, str]:
    tok = load_tokenizer(directory / "tokenizer.json")
    dtype = json.loads((directory / "meta.json").read_text())["dtype"]
    return tuple(tok.decode(np.fromfile(directory / f"{split}.bin", dtype=dtype)) for split in ("train", "val"))


@settings(FUZZ, max_examples=150)
@given(
    data=inputs,
    kind=st.sampled_from(["char", "bpe"]),
    val_fraction=st.floats(0.01, 0.99),
    max_bytes=st.none() | st.integers(1, 2100),
)
@example(data=b"\x80\x80", kind="char", val_fraction=0.5, max_bytes=1)  # no character starts in the first byte
def test_prepare_takes_any_bytes(data, kind, val_fraction, max_bytes, monkeypatch, capsys):
    """Success or UserError; on success the docstring's rules hold: UTF-8 with each invalid sequence as U+FFFD (and one
    warning line with the count), NUL kept, the first int(n * (1 - val_fraction)) bytes (moved to a character
    start) are train, --max-bytes keeps a prefix of at most that many bytes."""
    TRIED["prepare inputs"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "input.bin")
        source.write_bytes(data)
        try:  # chunks of 64 bytes: small inputs cross chunk boundaries
            out = prepare_dataset(
                "fuzz",
                input_path=str(source),
                tokenizer=kind,
                vocab_size=260 if kind == "bpe" else None,
                val_fraction=val_fraction,
                max_bytes=max_bytes,
                data_dir=tmp,
                verbose=False,
                chunk_bytes=64,
                workers=1,
            )
        except UserError:
            capsys.readouterr()
            return
        meta = json.loads((out / "meta.json").read_text())
        used = data[: meta["input_bytes"]]
        limit = min(max_bytes or len(data), len(data))
        assert limit - 4 < len(used) <= limit  # cut back to a character start
        train, val = decoded(out)
        whole = used.decode("utf-8", "replace")
        assert train + val == whole
        invalid = whole.count("\ufffd") - used.count("\ufffd".encode())
        assert meta["invalid_utf8_replaced"] == invalid
        assert capsys.readouterr().err.count(f"has {invalid} invalid UTF-8") == (1 if invalid else 0)
        if "\x00" in whole and kind == "char":
            assert "\x00" in load_tokenizer(out / "tokenizer.json").chars
        cut = int(len(used) * (1 - val_fraction))
        train_bytes = len(used) - len(val.encode("utf-8")) if "\ufffd" not in whole else None
        if train_bytes is not None:  # valid UTF-8: the split is at `cut`, moved forward to a character start
            assert cut <= train_bytes <= cut + 3


def meta_mutations():
    keys = [
        "format_version",
        "dataset",
        "tokenizer",
        "vocab_size",
        "dtype",
        "eot_id",
        "train_tokens",
        "val_tokens",
        "train_documents",
        "max_token_id",
        "split",
        "sources",
        "input_bytes",
        "request",
    ]
    change = st.tuples(
        st.sampled_from(keys), st.just("delete") | values | st.sampled_from(["uint16", "uint32", "float64"])
    )
    return st.lists(change, min_size=1, max_size=3)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small")
    (root / "in.txt").write_text("to be or not to be, that is the question\n" * 60, encoding="utf-8")
    prepare_dataset("small", input_path=str(root / "in.txt"), data_dir=root / "data", verbose=False)
    return root


@settings(FUZZ, max_examples=150)
@given(changes=meta_mutations(), via_prepare=st.booleans())
def test_damaged_meta_json_is_reused_rebuilt_or_refused(small_dataset, changes, via_prepare):
    TRIED["meta.json mutations"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp, "small")
        directory.mkdir()
        for f in (small_dataset / "data" / "small").iterdir():
            (directory / f.name).write_bytes(f.read_bytes())
        meta = json.loads((directory / "meta.json").read_text())
        for key, value in changes:
            if value == "delete":
                meta.pop(key, None)
            else:
                meta[key] = value
        (directory / "meta.json").write_text(json.dumps(meta))
        try:
            if via_prepare:
                prepare_dataset("small", input_path=str(small_dataset / "in.txt"), data_dir=tmp, verbose=False)
            load_dataset(directory, expect_tokenizer="char" if via_prepare else None)
        except UserError:
            pass


def huge_line(path: Path) -> None:
    """17 MB without a newline: more than one 16 MB chunk, so the reader must cut inside the line."""
    with open(path, "wb") as f:
        for _ in range(17):
            f.write(b"abc\xc3\xa9" * (2**20 // 5) + b"x" * (2**20 % 5))


def test_prepare_cli_exits_0_or_2_without_traceback_on_hostile_files(tmp_path):
    """Binary, empty, NUL bytes, invalid UTF-8, a 17 MB line; empty is refused, invalid UTF-8 warns once, counted."""
    rng = random.Random(3)
    files = {
        "binary": rng.randbytes(5000),
        "empty": b"",
        "nul_bytes": b"a\x00b\x00" * 500,
        "invalid_utf8": b"caf\xe9 ok \xff\xfe and \xe2\x82 and more text\n" * 50,
    }
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    huge_line(tmp_path / "huge_line")
    results = {
        name: run_script(
            "prepare.py", "--dataset", name, "--input", str(tmp_path / name), "--data-dir", str(tmp_path / "data")
        )
        for name in [*files, "huge_line"]
    }
    TRIED["prepare.py subprocess runs"] += len(results)
    for name, proc in results.items():
        assert proc.returncode in (0, 2) and b"Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
    assert results["empty"].returncode == 2 and results["empty"].stderr.decode().strip().endswith("is empty")
    warnings = [line for line in results["invalid_utf8"].stderr.decode().splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "has 200 invalid UTF-8 byte sequences" in warnings[0]
    train, val = decoded(tmp_path / "data" / "huge_line")
    assert results["huge_line"].returncode == 0 and train + val == (tmp_path / "huge_line").read_bytes().decode()
