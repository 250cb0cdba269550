"""quillgpt.tasks: synthetic chat tasks whose answers are right, whose held-out items never appear in training, which
a seed repeats, which fit the Quickstart char model's vocabulary and context, and its command line."""

import json
import string
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from quillgpt.chat_template import chat_format, check_messages, with_chat_tokens
from quillgpt.errors import UserError
from quillgpt.tasks import (
    TASKS,
    WORDS,
    Item,
    conversations,
    grade,
    parse_tasks,
    plain_prompt,
    preference_pairs,
    sample_items,
    split_keys,
)
from quillgpt.tokenizer import CharTokenizer

QUICKSTART_BLOCK_SIZE = 128  # configs/base/base.toml


def run_tasks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tasks.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("task", sorted(TASKS))
def test_validation_and_held_out_keys_never_appear_in_training_in_any_phrasing(task):
    train, val, test = (set(split_keys(task, s)) for s in ("train", "val", "test"))
    assert train and val and test and not train & test and not train & val and not val & test
    assert len(test) < len(train) / 5 and len(val) < len(train) / 5
    assert train | val | test == set(TASKS[task].keys())
    trained = {i.key for i in sample_items(task, "train", 3000, seed=1)}
    for split, keys in (("val", val), ("test", test)):
        asked = sample_items(task, split, 50, seed=0, distinct=True)
        assert len({i.key for i in asked}) == len(asked) == min(50, len(keys))
        assert not trained & {i.key for i in asked}


def test_answers_are_right():
    by_task = {t: sample_items(t, "train", 200, seed=3) for t in TASKS}
    for item in by_task["arithmetic"]:
        a, op, b = item.key.split(":")
        assert int(item.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert f"{a} {op} {b}" in item.question
    for item in by_task["reverse"]:
        assert item.answer == item.key[::-1] and item.key in item.question
    for item in by_task["count"]:
        word, letter = item.key.split(":")
        assert item.answer == str(word.count(letter)) and word in item.question and letter in item.question
    assert {i.answer == "0" for i in by_task["count"]} == {True, False}


def test_made_up_words_are_never_the_tasks_words_and_their_answers_are_right():
    """Made-up words (RL's questions, tasks.py --made-up) are new words of the tasks' lengths and letters, never one
    of WORDS and so never a held-out one; arithmetic has none and keeps its training split."""
    reverse = sample_items("reverse", "train", 2000, seed=0, made_up=True)
    count = sample_items("count", "train", 2000, seed=0, made_up=True)
    words = {i.key for i in reverse} | {i.key.split(":")[0] for i in count}
    assert len(words) > 1500 and not words & set(WORDS)
    assert {len(w) for w in words} == {len(w) for w in WORDS}
    assert all(i.answer == i.key[::-1] and i.key in i.question for i in reverse)
    for item in count:
        word, letter = item.key.split(":")
        assert item.answer == str(word.count(letter)) and word in item.question
    zeros = sum(i.answer == "0" for i in count) / len(count)
    assert 0.25 < zeros < 0.42  # a third lack the letter, as the tasks' own count items
    sums = sample_items("arithmetic", "train", 50, seed=0, made_up=True)
    assert {i.key for i in sums} <= {":".join(map(str, k)) for k in split_keys("arithmetic", "train")}
    assert sample_items("reverse", "train", 2000, seed=0, made_up=True) == reverse  # a seed repeats them
    for split in ("val", "test"):
        with pytest.raises(UserError, match="the tasks' own words"):
            sample_items("reverse", split, 5, seed=0, made_up=True)
    pairs = preference_pairs(["reverse"], "train", 20, seed=1, made_up=True)
    assert not {p["chosen"][0]["content"][::-1] for p in pairs} & set(WORDS)


def test_a_seed_repeats_the_conversations_and_another_seed_changes_them():
    names = list(TASKS)
    assert conversations(names, "train", 60, seed=0, turns=2) == conversations(names, "train", 60, seed=0, turns=2)
    assert conversations(names, "train", 60, seed=0) != conversations(names, "train", 60, seed=1)
    rows = conversations(names, "train", 300, seed=0, turns=3)
    assert {len(r) for r in rows} == {2, 4, 6}
    questions = [m["content"] for r in rows for m in r if m["role"] == "user"]
    kinds = [
        "arithmetic" if any(c.isdigit() for c in q) else "count" if "ount" in q or "many" in q else "reverse"
        for q in questions
    ]
    shares = [kinds.count(t) for t in names]
    assert max(shares) - min(shares) <= max(shares) // 10  # in about equal shares


def test_every_conversation_is_short_ascii_that_fits_the_quickstart_char_model():
    tokenizer = with_chat_tokens(CharTokenizer(sorted(set(string.printable)), eot=True))
    fmt = chat_format(tokenizer)
    for task in TASKS:
        items = [TASKS[task].item(k, p) for k in split_keys(task, "train")[::7] for p in TASKS[task].phrasings]
        longest = max(items, key=lambda i: len(i.question) + len(i.answer))
        assert all((i.question + i.answer).isascii() for i in items)
        assert len(fmt.encode(longest.messages())[0]) <= QUICKSTART_BLOCK_SIZE - 40  # room for a second short turn


def test_grading_forgives_spaces_and_a_full_stop_only():
    item = Item("arithmetic", "17:+:25", "What is 17 + 25?", "42")
    assert grade(item, "42") and grade(item, " 42.\n") and grade(item, "42 ")
    assert not grade(item, "43") and not grade(item, "4 2") and not grade(item, "42!") and not grade(item, "")
    assert plain_prompt(item, [Item("arithmetic", "1:+:1", "What is 1 + 1?", "2")]) == (
        "Q: What is 1 + 1?\nA: 2\n\nQ: What is 17 + 25?\nA:"
    )


def test_unknown_task_names_are_a_user_error():
    assert parse_tasks("count, arithmetic,count") == ["count", "arithmetic"]
    with pytest.raises(UserError, match="unknown chat task spelling: the tasks are arithmetic, reverse, count"):
        parse_tasks("arithmetic,spelling")


def test_command_writes_chat_jsonl_of_the_split_asked(tmp_path):
    out = tmp_path / "nested" / "test.jsonl"
    proc = run_tasks("--out", str(out), "--n", "40", "--split", "test", "--tasks", "arithmetic,count", "--turns", "2")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and not list(out.parent.glob("*.tmp*"))
    assert [r["messages"] for r in rows] == conversations(["arithmetic", "count"], "test", 40, seed=0, turns=2)
    assert all(check_messages(r["messages"], "row", need_assistant=True) for r in rows)
    bad = run_tasks("--out", str(tmp_path / "x.jsonl"), "--tasks", "poetry")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown chat task poetry" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()
    held_out = run_tasks("--out", str(tmp_path / "x.jsonl"), "--made-up", "--split", "test")
    assert (
        held_out.returncode == 2 and "the tasks' own words" in held_out.stderr and not (tmp_path / "x.jsonl").exists()
    )
