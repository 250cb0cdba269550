"""Chat data and fine-tuning: prepare.py --chat renders conversations with the chat template into tokens and an
assistant-token mask, bad records are one line naming file and record, and training counts the assistant's tokens
only, through batches, evaluation, resume and init_from a model without chat tokens."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT, resume_in_subprocess, tiny_overrides, train_until_sigterm

from model import GPT, GPTConfig
from quillgpt.chat_template import CHAT_TOKENS, TOOL_TOKENS, chat_format
from quillgpt.data import BatchSource, load_dataset
from quillgpt.errors import UserError
from quillgpt.prepare import pipeline, prepare_dataset
from quillgpt.prepare.splits import in_validation
from quillgpt.prepare.workdir import CHAT_FILES
from train import train

CHAT_NAMES = ("train.bin", "val.bin", "tokenizer.json", *CHAT_FILES)


def sums(n: int, seed: int = 0) -> list[list[dict]]:
    """n conversations "What is a + b?" -> the sum (a, b <= 99), a third with a system message, a quarter with a
    second exchange."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer with a number."})
        if i % 4 == 0:
            messages += [
                {"role": "user", "content": "And doubled?"},
                {"role": "assistant", "content": str(2 * (a + b))},
            ]
        out.append(messages)
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, conversations: list[list[dict]]) -> Path:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"messages": conversations}), path, row_group_size=64)
    return path


def prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "prepare.py"), *args], capture_output=True, text=True, timeout=120
    )


def expected_split(dataset_dir: Path, conversations: list[list[dict]], split: str) -> tuple[list, list, list]:
    """(tokens, mask, starts) of a split, from ChatFormat.encode of each conversation the hash puts there."""
    fmt = chat_format(load_dataset(dataset_dir).tokenizer)
    val = in_validation(0, 0, len(conversations), 0.1)
    ids, mask, starts = [], [], []
    for messages, in_val in zip(conversations, val):
        if in_val == (split == "val"):
            i, m = fmt.encode(messages)
            starts.append(len(ids))
            ids += i
            mask += m
    return ids, mask, starts


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    """A chat dataset `sums` (char tokenizer + ChatML) of 400 conversations, and the conversations."""
    root = tmp_path_factory.mktemp("chat")
    conversations = sums(400)
    source = write_jsonl(root / "sums.jsonl", [{"messages": m} for m in conversations])
    prepare_dataset("sums", input_path=str(source), chat=True, data_dir=root / "data", verbose=False)
    return root / "data", conversations


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_prepared_ids_and_masks_equal_chat_format_encode_per_conversation(tmp_path, kind):
    conversations = sums(150, seed=1)
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "c.jsonl", [{"messages": m, "id": i} for i, m in enumerate(conversations)])
    else:
        source = write_parquet(tmp_path / "c.parquet", conversations)
    out = prepare_cli("--dataset", "c", "--chat", "--input", str(source), "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    directory = tmp_path / "data" / "c"
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["chat"] and meta["train_documents"] + meta["val_documents"] == 150
    dataset = load_dataset(directory)
    assert dataset.tokenizer.chat_tokens == CHAT_TOKENS + TOOL_TOKENS
    for split in ("train", "val"):
        ids, mask, starts = expected_split(directory, conversations, split)
        assert np.fromfile(directory / f"{split}.bin", dtype=np.uint16).tolist() == ids
        assert np.fromfile(directory / f"{split}.mask.bin", dtype=np.uint8).tolist() == mask
        assert dataset.starts[split].tolist() == starts
        assert meta[f"{split}_assistant_tokens"] == sum(mask)


def test_validation_is_whole_conversations_picked_by_hash(chat_data):
    data_dir, conversations = chat_data
    dataset = load_dataset(data_dir / "sums")
    val = in_validation(0, 0, len(conversations), 0.1)
    assert len(dataset.starts["val"]) == int(val.sum()) and len(dataset.starts["train"]) == int((~val).sum())
    tok = dataset.tokenizer
    tokens = np.fromfile(dataset.path("val"), dtype=dataset.dtype)
    pieces = np.split(tokens, dataset.starts["val"][1:])
    wanted = [m for m, v in zip(conversations, val) if v]
    assert [tok.decode(p) for p in pieces] == [chat_format(tok).render(m) for m in wanted]


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
# the bad-record table of docs/data.md: record -> what the one line says
BAD_RECORDS = {
    "not JSON": ("{not json", "not a JSON object"),
    "not an object": ([1, 2], "the record is a list, not an object with a 'messages' field"),
    "no messages field": ({"text": "hi"}, "the record has no 'messages' field (it has 'text')"),
    "messages not a list": ({"messages": "hi"}, "'messages' must be a non-empty list"),
    "empty messages": ({"messages": []}, "'messages' must be a non-empty list"),
    "missing role": ({"messages": [{"content": "hi"}]}, "message 0 has no role; roles are system, user, assistant"),
    "unknown role": ({"messages": [{"role": "bot", "content": "hi"}]}, "message 0 has role 'bot'"),
    "non-string content": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]},
        "message 1 (assistant) has content of type int, not a string",
    ),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_record_is_one_line_naming_file_and_record_and_leaves_nothing(tmp_path, case):
    record, message = BAD_RECORDS[case]
    lines = [json.dumps(GOOD)] * 5 + [record if isinstance(record, str) else json.dumps(record)] + [json.dumps(GOOD)]
    source = tmp_path / "talk.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = prepare_cli("--dataset", "c", "--chat", "--input", str(source), "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2 and out.stdout.count("\n") <= 1
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"error: {source}:6: ") and message in line and "--skip-bad-records" in line
    assert not (tmp_path / "data" / "c").exists() or not any((tmp_path / "data" / "c").iterdir())


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path):
    conversations = sums(100)
    conversations[70] = [{"role": "user", "content": "no reply"}]
    source = write_parquet(tmp_path / "c.parquet", conversations)
    out = prepare_cli("--dataset", "c", "--chat", "--input", str(source), "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2 and out.stderr.strip().startswith(f"error: {source} row 70: ")
    assert "no assistant message" in out.stderr


def test_a_text_file_is_not_chat_data(tmp_path):
    source = tmp_path / "notes.txt"
    source.write_text("hello\n")
    out = prepare_cli("--dataset", "c", "--chat", "--input", str(source), "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2 and "--chat reads records" in out.stderr


def test_skip_bad_records_counts_and_prints_the_skipped_conversations(tmp_path):
    records = [json.dumps({"messages": m}) for m in sums(60)]
    for i, (record, _) in enumerate(BAD_RECORDS.values()):
        records.insert(3 + 5 * i, record if isinstance(record, str) else json.dumps(record))
    source = tmp_path / "talk.jsonl"
    source.write_text("\n".join(records) + "\n")
    args = ["--dataset", "c", "--chat", "--input", str(source), "--data-dir", str(tmp_path / "data")]
    out = prepare_cli(*args, "--skip-bad-records")
    assert out.returncode == 0, out.stderr
    meta = json.loads((tmp_path / "data" / "c" / "meta.json").read_text())
    assert meta["skipped_records"] == len(BAD_RECORDS)
    assert meta["train_documents"] + meta["val_documents"] == 60
    assert f"{len(BAD_RECORDS)} records skipped" in out.stdout + out.stderr


def digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in CHAT_NAMES}


def test_chat_files_are_identical_for_any_number_of_workers_and_after_a_crash(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in sums(600)])
    common = dict(input_path=str(source), chat=True, data_dir=tmp_path, verbose=False, chunk_bytes=4096)
    prepare_dataset("one", workers=1, **common)
    prepare_dataset("two", workers=2, **common)
    assert digests(tmp_path / "one") == digests(tmp_path / "two")

    real, calls = pipeline.encode_chat_chunk, []

    def crash_on_the_fourth_chunk(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated crash")
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "encode_chat_chunk", crash_on_the_fourth_chunk)
        with pytest.raises(RuntimeError):
            prepare_dataset("crashed", workers=1, **common)
    progress = json.loads((tmp_path / "crashed" / ".prepare" / "progress.json").read_text())
    assert progress["chunks"] == 3
    prepare_dataset("crashed", workers=2, **common)
    assert digests(tmp_path / "crashed") == digests(tmp_path / "one")


def test_load_dataset_refuses_a_mask_of_another_size(chat_data, tmp_path):
    import shutil

    data_dir, _ = chat_data
    copy = tmp_path / "sums"
    shutil.copytree(data_dir / "sums", copy)
    with open(copy / "val.mask.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(UserError, match="val.mask.bin has .* bytes but val.bin has .* tokens"):
        load_dataset(copy)


def test_batches_target_only_assistant_tokens_and_the_loss_is_their_mean(chat_data):
    data_dir, _ = chat_data
    dataset = load_dataset(data_dir / "sums")
    batches = BatchSource(dataset, 48, 8, 1337, torch.device("cpu"), chat_rows="packed")
    x, y, _ = batches.get("train", 3)
    starts = batches.starts("train", 3)
    tokens = np.fromfile(dataset.path("train"), dtype=dataset.dtype).astype(np.int64)
    mask = np.fromfile(dataset.mask_path("train"), dtype=np.uint8)
    for row, start in enumerate(starts):
        real = tokens[start : start + 49]
        assert x[row, : len(real) - 1].tolist() == real[:-1].tolist()  # inputs: the tokens from a conversation start
        counted = mask[start + 1 : start + 49] == 1
        assert y[row, : len(counted)].tolist() == np.where(counted, real[1:], -1).tolist()
    assert start in set(dataset.starts["train"].tolist())

    model = GPT(GPTConfig(block_size=48, vocab_size=dataset.vocab_size, n_layer=1, n_head=2, n_embd=16))
    logits, loss = model(x, y)
    keep = y.flatten() >= 0
    by_hand = F.cross_entropy(logits.flatten(0, 1)[keep], y.flatten()[keep])
    assert torch.allclose(loss, by_hand) and 0 < keep.sum() < y.numel()
    nothing = torch.full_like(y, -1)  # a micro-batch without an assistant token: 0, not NaN, and no update
    _, zero = model(x, nothing)
    zero.backward()
    assert zero.item() == 0 and all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_padded_rows_count_the_first_conversation_only(chat_data):
    data_dir, _ = chat_data
    dataset = load_dataset(data_dir / "sums")
    packed = BatchSource(dataset, 200, 8, 1, torch.device("cpu"), chat_rows="packed")
    padded = BatchSource(dataset, 200, 8, 1, torch.device("cpu"), chat_rows="padded")
    (xa, ya, _), (xb, yb, _) = packed.get("train", 0), padded.get("train", 0)
    assert torch.equal(xa, xb)
    ends = dataset.conversation_ends("train")[padded.conversations("train", 0)] - padded.starts("train", 0)
    for row, length in enumerate(ends):
        assert torch.equal(yb[row, : length - 1], ya[row, : length - 1])
        assert (yb[row, length - 1 :] == -1).all()
    assert (ya >= 0).sum() > (yb >= 0).sum()


def chat_overrides(data_dir: Path, out_dir: Path, **extra) -> dict:
    return tiny_overrides(data_dir, out_dir, **{"data.dataset": "sums", "model.block_size": 48, **extra})


@pytest.mark.slow
def test_training_logs_assistant_losses_and_resumes_exactly(chat_data, tmp_path, capsys):
    data_dir, _ = chat_data
    common = {"training.max_iters": 16, "training.save_interval": 4, "optimizer.lr_decay_iters": 16}
    straight = train(None, overrides=chat_overrides(data_dir, tmp_path / "straight", **common))
    assert straight.iterations == 16
    out = capsys.readouterr().out
    assert "chat: losses, accuracy and the best checkpoint count the assistant's tokens only" in out
    steps = [line for line in out.splitlines() if line.startswith("iter ")]
    evals = [line for line in out.splitlines() if line.startswith("eval ")]
    assert len(steps) == 16 and all("| assistant loss " in line for line in steps)  # the number says what it counts
    assert evals and all(line.startswith(f"eval {line.split()[1]} (assistant tokens): train ") for line in evals)
    train_until_sigterm(chat_overrides(data_dir, tmp_path / "split", **common), iter_lines=6)
    resume_in_subprocess(tmp_path / "split" / "t", 16)

    def losses(run: Path) -> dict:
        history = json.loads((run / "train_log.json").read_text())["history"]
        return {(p["kind"], p["iter"]): p.get("loss", p.get("val_loss")) for p in history}

    assert losses(tmp_path / "straight" / "t") == losses(tmp_path / "split" / "t")


def test_init_from_a_model_without_chat_tokens_grows_its_vocabulary_and_samples(chat_data, tmp_path):
    from quillgpt.loading import load_model

    data_dir, conversations = chat_data
    text = tmp_path / "plain.txt"
    text.write_text("".join(m["content"] + "\n" for c in conversations for m in c) + "systemuserassistant<>|_\n")
    prepare_dataset("plain", input_path=str(text), data_dir=data_dir, verbose=False)
    base = {"data.dataset": "plain", "training.max_iters": 4, "model.block_size": 48}
    train(None, overrides=tiny_overrides(data_dir, tmp_path / "base", **base))
    before = load_model(tmp_path / "base" / "t")
    chat = tmp_path / "talks.jsonl"
    write_jsonl(chat, [{"messages": m} for m in conversations[:200]])
    overrides = tiny_overrides(
        data_dir,
        tmp_path / "chat",
        **{
            "data.dataset": "sums_ft",
            "data.input": str(chat),
            "data.chat": True,
            "run.init_from": str(tmp_path / "base" / "t"),
            "training.max_iters": 4,
        },
    )
    del overrides["model.n_layer"], overrides["model.n_head"], overrides["model.n_embd"]
    train(None, overrides=overrides)
    after = load_model(tmp_path / "chat" / "t")
    grown = before.model.config.vocab_size + len(CHAT_TOKENS + TOOL_TOKENS)
    assert after.model.config.vocab_size == grown and after.tokenizer["chat_tokens"] == list(CHAT_TOKENS + TOOL_TOKENS)
    meta = json.loads((data_dir / "sums_ft" / "meta.json").read_text())
    assert meta["request"]["tokenizer_from"] == str((tmp_path / "base" / "t" / "ckpt_best.pt").resolve())
    out = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(tmp_path / "chat" / "t"), "--prompt", "What is 1 + 2?"]
        + ["--num-samples", "1", "--max-new-tokens", "8", "--device", "cpu"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_two_ranks_on_chat_data_equal_one_rank_with_accumulation(chat_data, tmp_path):
    """The mask and the positions are drawn with the tokens: 2 DDP ranks x accumulation 1 see exactly the
    micro-batches of 1 rank x accumulation 2, so their assistant-token losses and evaluations agree (packed rows:
    every conversation of a row counts, each attending within itself)."""
    data_dir, _ = chat_data
    common = {
        "data.chat_rows": "packed",
        "model.dropout": 0.0,
        "training.max_iters": 6,
        "optimizer.lr_decay_iters": 6,
        "training.eval_interval": 3,
        "training.save_interval": 3,
    }
    train(None, overrides=chat_overrides(data_dir, tmp_path / "one", **common, **{"training.grad_accum_steps": 2}))
    two = chat_overrides(data_dir, tmp_path / "two", **common)
    cli = [a for key, value in two.items() for a in (f"--{key}", str(value).lower() if value is False else str(value))]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *cli],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def history(run: Path) -> dict:
        points = json.loads((run / "train_log.json").read_text())["history"]
        return {(p["kind"], p["iter"]): p.get("loss", p.get("val_loss")) for p in points}

    one, ddp = history(tmp_path / "one" / "t"), history(tmp_path / "two" / "t")
    assert one.keys() == ddp.keys() and len(one) > 6
    assert max(abs(one[k] - ddp[k]) for k in one) < 1e-5
