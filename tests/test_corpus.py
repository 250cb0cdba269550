"""prepare.py on corpora of documents: every source kind (text, directories, jsonl(.gz/.zst), parquet, hub datasets
through the real `datasets` library on local files), end-of-text tokens, validation by whole documents, parallel
workers, restarting after SIGKILL, outputs beyond 2^31 tokens, and one-line errors for bad input."""

import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, word_salad

from quillgpt.data import BatchSource, gather_rows, load_dataset
from quillgpt.errors import UserError
from quillgpt.prepare import pipeline, prepare_dataset
from quillgpt.prepare.splits import in_validation
from quillgpt.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

DOCS = [word_salad(random.Random(i).randint(20, 400), seed=i) for i in range(240)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def write_parquet(path: Path, docs: list, field: str = "text", row_group_size: int = 25) -> Path:
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory) -> dict[str, Path]:
    """The same 240 documents as jsonl, jsonl.gz, jsonl.zst and parquet (60 each), and 30 more as a directory."""
    root = tmp_path_factory.mktemp("corpus")
    files = {
        "jsonl": write_jsonl(root / "a.jsonl", DOCS[:60]),
        "gz": write_jsonl(root / "b.jsonl.gz", DOCS[60:120]),
        "zst": write_jsonl(root / "c.jsonl.zst", DOCS[120:180]),
        "parquet": write_parquet(root / "d.parquet", DOCS[180:240]),
    }
    folder = root / "folder"
    for i, doc in enumerate(DOCS[:30]):
        path = folder / ("sub" if i % 3 else "") / f"doc{i:02d}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc)
    (folder / ".hidden.md").write_text("never read")
    (folder / "notes.txt").write_text("not matched by the glob")
    files["folder"] = folder
    return files


def documents_of(out_dir: Path) -> tuple[list[str], list[str], dict]:
    """(train documents, val documents, meta), cut at every <|endoftext|>."""
    meta = json.loads((out_dir / "meta.json").read_text())
    tok = load_tokenizer(out_dir / "tokenizer.json")
    splits = []
    for split in ("train", "val"):
        ids = np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"])
        assert ids[-1] == meta["eot_id"] == tok.eot_id
        ends = np.flatnonzero(ids == tok.eot_id)
        splits.append([tok.decode(ids[a + 1 if a >= 0 else 0 : b]) for a, b in zip(np.r_[-1, ends[:-1]], ends)])
    return *splits, meta


def test_every_source_kind_gives_its_documents_each_ended_by_endoftext(corpus_files, tmp_path):
    """jsonl, jsonl.gz, jsonl.zst and parquet in one list of inputs: every document comes back whole, in its
    split, in input order; val holds the documents that the hash of their index picks."""
    inputs = [str(corpus_files[k]) for k in ("jsonl", "gz", "zst", "parquet")]
    out = prepare_dataset("mix", input_path=inputs, data_dir=tmp_path, verbose=False, chunk_bytes=4096)
    train, val, meta = documents_of(out)
    in_val = in_validation(0, 0, len(DOCS), 0.1)
    assert train == [d for d, v in zip(DOCS, in_val) if not v] and val == [d for d, v in zip(DOCS, in_val) if v]
    assert (meta["train_documents"], meta["val_documents"]) == (len(train), len(val)) and 10 < len(val) < 40
    assert meta["split"] == {"rule": "docs", "val_fraction": 0.1, "seed": 0}
    assert [s["kind"] for s in meta["sources"]] == ["jsonl", "jsonl", "jsonl", "parquet"]
    assert meta["sources"][0]["sha256"] == hashlib.sha256(corpus_files["jsonl"].read_bytes()).hexdigest()
    assert meta["vocab_size"] == meta["eot_id"] + 1 and load_dataset(out).vocab_size == meta["vocab_size"]


def test_a_directory_is_read_recursively_one_document_per_file(corpus_files, tmp_path):
    out = prepare_dataset(
        "folder",
        input_path=str(corpus_files["folder"]),
        glob="*.md",
        tokenizer="bpe",
        vocab_size=300,
        data_dir=tmp_path,
        verbose=False,
    )
    train, val, meta = documents_of(out)
    paths = sorted(p for p in corpus_files["folder"].rglob("*.md") if not p.name.startswith("."))
    assert sorted(train + val) == sorted(p.read_text() for p in paths) and len(paths) == 30
    in_val = in_validation(0, 0, 30, 0.1)
    assert val == [p.read_text() for p, v in zip(paths, in_val) if v]
    assert meta["sources"][0]["files"] == 30 and meta["tokenizer"]["kind"] == "bpe" and meta["vocab_size"] <= 300


def test_the_same_input_splits_the_same_way_and_another_seed_differently(corpus_files, tmp_path):
    a = prepare_dataset("a", input_path=str(corpus_files["jsonl"]), data_dir=tmp_path, verbose=False)
    b = prepare_dataset("b", input_path=str(corpus_files["jsonl"]), data_dir=tmp_path, verbose=False)
    c = prepare_dataset("c", input_path=str(corpus_files["jsonl"]), data_dir=tmp_path, verbose=False, split_seed=7)
    assert (a / "val.bin").read_bytes() == (b / "val.bin").read_bytes() != (c / "val.bin").read_bytes()
    picked = in_validation(0, 0, 100_000, 0.1)
    assert abs(picked.mean() - 0.1) < 0.005 and np.array_equal(picked[500:600], in_validation(0, 500, 100, 0.1))


@pytest.mark.parametrize("tokenizer", ["char", "bpe", "gpt2"])
def test_output_is_byte_identical_for_any_number_of_workers(corpus_files, tmp_path, tokenizer):
    inputs = [str(corpus_files[k]) for k in ("jsonl", "zst", "parquet")]
    outputs = []
    for workers in (1, 2, 3):
        out = prepare_dataset(
            f"w{workers}",
            input_path=inputs,
            tokenizer=tokenizer,
            vocab_size=300 if tokenizer == "bpe" else None,
            data_dir=tmp_path,
            verbose=False,
            workers=workers,
            chunk_bytes=2048,
        )
        outputs.append([(out / name).read_bytes() for name in ("train.bin", "val.bin", "tokenizer.json")])
    assert outputs[0] == outputs[1] == outputs[2]


def test_hub_datasets_stream_through_datasets_like_local_files(corpus_files, tmp_path):
    """--hf-dataset on a local folder of parquet files runs the datasets library's own streaming reader (no mock):
    the same tokens as reading the files with --input, and a restart resumes the stream from its saved state."""
    pytest.importorskip("datasets")
    hub = tmp_path / "hub"
    hub.mkdir()
    write_parquet(hub / "train-0.parquet", DOCS[:120])
    write_parquet(hub / "train-1.parquet", DOCS[120:])
    local = prepare_dataset(
        "local",
        input_path=[str(hub / "train-0.parquet"), str(hub / "train-1.parquet")],
        data_dir=tmp_path,
        verbose=False,
    )
    streamed = prepare_dataset("streamed", hf_dataset=str(hub), data_dir=tmp_path, verbose=False, chunk_bytes=4096)
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (local / name).read_bytes() == (streamed / name).read_bytes()
    meta = json.loads((streamed / "meta.json").read_text())
    assert meta["sources"] == [{"kind": "hub", "dataset": str(hub), "config": None, "split": "train", "revision": None}]


def test_continuing_a_hub_stream_gives_the_same_files(corpus_files, tmp_path, monkeypatch):
    """A prepare of a hub stream stopped after 3 chunks continues from the stream state in its journal."""
    pytest.importorskip("datasets")
    hub = tmp_path / "hub"
    hub.mkdir()
    write_parquet(hub / "train-0.parquet", DOCS)
    whole = prepare_dataset("whole", hf_dataset=str(hub), data_dir=tmp_path, verbose=False, chunk_bytes=2048, workers=1)
    real_write, written = pipeline.write_chunk, []

    def stop_after_three(*args, **kw):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(1)
        return real_write(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "write_chunk", stop_after_three)
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset("cut", hf_dataset=str(hub), data_dir=tmp_path, verbose=False, chunk_bytes=2048, workers=1)
    journal = json.loads((tmp_path / "cut" / ".prepare" / "progress.json").read_text())
    assert journal["chunks"] == 3 and journal["hub_state"] is not None
    resumed = prepare_dataset("cut", hf_dataset=str(hub), data_dir=tmp_path, verbose=False, chunk_bytes=2048, workers=1)
    for name in ("train.bin", "val.bin"):
        assert (whole / name).read_bytes() == (resumed / name).read_bytes()


@pytest.mark.slow
def children(parent: int) -> list[int]:
    """Live processes whose parent is `parent` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def still_running(pids: list[int], wait: float = 5.0) -> list[int]:
    """Those of `pids` still alive (not gone, not zombies) after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.slow
def test_restarts_after_sigkill_end_with_the_uninterrupted_files(tmp_path):
    """A dozen SIGKILLs of `python prepare.py`, each at a random moment after the run has moved on from where the
    previous one stopped, each followed by the same command: the last run ends with the files of a run never
    stopped, and until then the folder never passes for a complete dataset."""
    docs = [word_salad(random.Random(i).randint(50, 900), seed=i) for i in range(24_000)]
    source = write_jsonl(tmp_path / "big.jsonl", docs)
    cmd = [
        sys.executable,
        str(REPO_ROOT / "prepare.py"),
        "--input",
        str(source),
        "--tokenizer",
        "gpt2",
        "--chunk-bytes",
        "32768",
        "--data-dir",
        str(tmp_path / "data"),
        "--workers",
        "2",
    ]
    reference = subprocess.run([*cmd, "--dataset", "straight"], capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    journal = tmp_path / "data" / "killed" / ".prepare" / "progress.json"

    def chunks_done() -> int:
        try:
            return json.loads(journal.read_text())["chunks"]
        except (OSError, ValueError):
            return -1

    rng, stopped_at = random.Random(11), []
    for _ in range(12):
        before = chunks_done()
        proc = subprocess.Popen([*cmd, "--dataset", "killed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and chunks_done() <= before:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.1))
        if proc.poll() is not None:
            break  # it finished first: nothing left to interrupt
        workers = children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stopped_at.append(chunks_done())
        assert workers and not still_running(workers), "the killed run's workers outlived it"
        with pytest.raises(UserError, match="incomplete"):
            load_dataset(tmp_path / "data" / "killed")
    final = subprocess.run([*cmd, "--dataset", "killed"], capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    print(f"\n{len(stopped_at)} kills, with the journal at chunks {stopped_at}")
    assert len(stopped_at) == 12 and stopped_at == sorted(stopped_at) and len(set(stopped_at)) >= 8
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        digest = [
            hashlib.sha256((tmp_path / "data" / d / name).read_bytes()).hexdigest() for d in ("straight", "killed")
        ]
        assert digest[0] == digest[1], name
    metas = [json.loads((tmp_path / "data" / d / "meta.json").read_text()) for d in ("straight", "killed")]
    assert [{k: v for k, v in m.items() if k != "dataset"} for m in metas][0] == {
        k: v for k, v in metas[1].items() if k != "dataset"
    }
    assert not journal.parent.exists()


@pytest.mark.slow
def test_outputs_beyond_2_to_the_31_tokens_are_addressed_with_64_bit_offsets(tmp_path):
    """A sparse train.bin of 2^31 + 2^27 uint16 tokens (4.25 GiB, almost none of it on disk): the dataset opens, the
    sampler draws starts past 2^31 and the gather reads the tokens written there."""
    directory = tmp_path / "huge"
    directory.mkdir()
    n = 2**31 + 2**27
    tok = train_tokenizer("char", ["abcdefgh"], None)
    with open(directory / "train.bin", "wb") as f:
        f.truncate(n * 2)
        f.seek((2**31 + 1000) * 2)
        f.write(np.arange(1, 8, dtype=np.uint16).tobytes())
    np.tile(np.arange(8, dtype=np.uint16), 100).tofile(directory / "val.bin")
    save_tokenizer(tok, directory / "tokenizer.json")
    (directory / "meta.json").write_text(
        json.dumps(
            {
                "tokenizer": {"kind": "char", "name": None, "file": "tokenizer.json"},
                "vocab_size": tok.vocab_size,
                "dtype": "uint16",
            }
        )
    )
    dataset = load_dataset(directory)  # checks every token id, 4.25 GiB of them
    assert dataset.lengths["train"] == n
    rows = gather_rows(dataset.path("train"), dataset.dtype, np.array([2**31 + 999]), 8)
    assert rows.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0]]
    source = BatchSource(dataset, 8, 64, seed=0, device=torch.device("cpu"))
    starts = np.concatenate([source.starts("train", i) for i in range(4)])
    assert starts.dtype == np.int64 and (starts > 2**31).any() and starts.max() < n - 8  # 15 of 256 expected
    x, y, _ = source.get("train", 0)
    assert x.shape == (64, 8) and x.dtype == torch.int64


# ---- bad input: one line, exit 2, nothing half-written -------------------------------------------


def run_prepare(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, str(REPO_ROOT / "prepare.py"), *args]
    return subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


BAD_JSON = "not json\n"


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    write_jsonl(root / "good.jsonl", DOCS[:50])
    (root / "broken.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:30])
        + BAD_JSON
        + "".join(json.dumps({"text": d}) + "\n" for d in DOCS[30:60])
    )
    (root / "nofield.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (root / "number.jsonl").write_text(json.dumps({"text": 42}) + "\n")
    (root / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n" * 3)
    write_parquet(root / "nocolumn.parquet", DOCS[:10], field="body")
    pq.write_table(pa.table({"text": list(range(10))}), root / "ints.parquet")
    write_jsonl(root / "c.jsonl.zst", DOCS[:10])
    (root / "nodata").mkdir()
    (root / "nodata" / "README.md").write_text("no data files here")
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--input", "{root}/broken.jsonl"], ["broken.jsonl:31: not a JSON object", "--skip-bad-records"]),
        (
            ["--input", "{root}/nofield.jsonl"],
            ["nofield.jsonl:2: the record has no 'text' field (it has 'body')", "--text-field"],
        ),
        (["--input", "{root}/number.jsonl"], ["number.jsonl:1: field 'text' is a int, not a string"]),
        (["--input", "{root}/nocolumn.parquet"], ["nocolumn.parquet has no column 'text' (it has 'body', 'n')"]),
        (["--input", "{root}/ints.parquet"], ["ints.parquet: column 'text' holds int64, not strings"]),
        (["--input", "{root}/empty.jsonl"], ["the corpus has no documents (1 records skipped or empty)"]),
        (["--input", "{root}", "--glob", "*.pdf"], ["--glob '*.pdf' matches no file under"]),
        (["--input", "{root}/good.jsonl", "--split", "tail"], ["--split tail cuts one text file by bytes"]),
        (["--hf-dataset", "{root}/nodata"], ["--hf-dataset", "nodata"]),
        (
            ["--hf-dataset", "nobody/no-such-dataset"],
            [
                "the dataset nobody/no-such-dataset streams from the Hugging Face hub",
                "127.0.0.1",
                "pass them with --input",
            ],
        ),
        (["--dataset", "openwebtext"], ["Skylion007/openwebtext", "needs the network", "--input"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2_and_leaves_nothing(bad_inputs, tmp_path, args, fragments):
    args = [a.replace("{root}", str(bad_inputs)) for a in args]
    dataset = [] if "--dataset" in args else ["--dataset", "bad"]
    # no network here or in CI; a closed local port makes the hub unreachable everywhere, at once
    proc = run_prepare(*dataset, *args, "--data-dir", str(tmp_path), env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_one_line_error(proc, *fragments)
    assert list(tmp_path.rglob("*.bin")) == [] and list(tmp_path.rglob("progress.json")) == []


def test_skip_bad_records_counts_and_skips(bad_inputs, tmp_path):
    out = prepare_dataset(
        "skipped",
        input_path=[str(bad_inputs / "broken.jsonl"), str(bad_inputs / "nofield.jsonl")],
        data_dir=tmp_path,
        verbose=False,
        skip_bad_records=True,
    )
    train, val, meta = documents_of(out)
    assert meta["skipped_records"] == 2 and sorted(train + val) == sorted(DOCS[:60] + ["a b c"])


@pytest.mark.slow
def test_zst_without_zstandard_names_the_extra(bad_inputs, tmp_path):
    code = (
        "import sys; sys.modules['zstandard'] = None; sys.argv[0] = 'prepare.py'; sys.path.insert(0, '.'); "
        "import prepare; from quillgpt.errors import run_main; run_main(prepare.main)"
    )
    proc = run_prepare(
        "--dataset", "z", "--input", str(bad_inputs / "c.jsonl.zst"), "--data-dir", str(tmp_path), code=code
    )
    assert_one_line_error(proc, "c.jsonl.zst needs the zstandard package: pip install '.[data]'")


def test_a_failed_new_prepare_keeps_the_previous_dataset(bad_inputs, tmp_path):
    """--reset with a broken input: the old, complete dataset is still there and loads."""
    good = prepare_dataset("keep", input_path=str(bad_inputs / "good.jsonl"), data_dir=tmp_path, verbose=False)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    with pytest.raises(UserError, match="not a JSON object"):
        prepare_dataset(
            "keep", input_path=str(bad_inputs / "broken.jsonl"), data_dir=tmp_path, verbose=False, reset=True
        )
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before and load_dataset(good).lengths["val"] > 0


def test_another_requests_unfinished_work_is_not_thrown_away(bad_inputs, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(pipeline, "write_chunk", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset("busy", input_path=str(bad_inputs / "good.jsonl"), data_dir=tmp_path, verbose=False)
    with pytest.raises(UserError, match="holds an unfinished prepare of another request .* --reset to discard it"):
        prepare_dataset(
            "busy", input_path=str(bad_inputs / "good.jsonl"), tokenizer="bpe", data_dir=tmp_path, verbose=False
        )
    assert (tmp_path / "busy" / ".prepare" / "progress.json").is_file()
    prepare_dataset(
        "busy", input_path=str(bad_inputs / "good.jsonl"), tokenizer="bpe", data_dir=tmp_path, verbose=False, reset=True
    )


# ---- several inputs on the command line ------------------------------------------------------------


def test_input_flag_repeated_or_listed_gives_one_dataset_of_every_input(tmp_path):
    """`prepare.py --input a --input b` (once kept only b) and `--input a b` make the same dataset: every document of
    both halves, in order, and more tokens than either half alone."""
    halves = {
        "first": write_jsonl(tmp_path / "first.jsonl", DOCS[:120]).resolve(),
        "second": write_jsonl(tmp_path / "second.jsonl", DOCS[120:]).resolve(),
    }
    forms = {
        "repeated": ["--input", str(halves["first"]), "--input", str(halves["second"])],
        "listed": ["--input", str(halves["first"]), str(halves["second"])],
        **{name: ["--input", str(path)] for name, path in halves.items()},
    }
    for name, args in forms.items():
        proc = run_prepare("--dataset", name, *args, "--workers", "1", "--data-dir", str(tmp_path / "data"))
        assert proc.returncode == 0, proc.stderr
    files = {
        name: [(tmp_path / "data" / name / f).read_bytes() for f in ("train.bin", "val.bin", "tokenizer.json")]
        for name in forms
    }
    assert files["repeated"] == files["listed"]
    train, val, meta = documents_of(tmp_path / "data" / "repeated")
    in_val = in_validation(0, 0, len(DOCS), 0.1)
    assert train == [d for d, v in zip(DOCS, in_val) if not v] and val == [d for d, v in zip(DOCS, in_val) if v]
    assert [s["path"] for s in meta["sources"]] == [str(halves["first"]), str(halves["second"])]
    tokens = meta["train_tokens"] + meta["val_tokens"]
    for half, docs in (("first", DOCS[:120]), ("second", DOCS[120:])):
        half_train, half_val, half_meta = documents_of(tmp_path / "data" / half)
        assert sorted(half_train + half_val) == sorted(docs)
        assert half_meta["train_tokens"] + half_meta["val_tokens"] < tokens and files[half] != files["repeated"]
