"""eval.py --chat-eval (quillgpt/chat_eval.py), nanochat's chat evaluations on datasets written here in the hub's own
columns: multiple choice is the letter a direct forward pass puts highest, GSM8K is graded on "#### N" by nanochat's
rules and generated as chat.py replies (the calculator answering), HumanEval's canonical solutions pass in the sandbox
and wrong or endless ones fail, the items are nanochat's (datasets' shuffle, seed 42), and the command line scores
all five on a checkpoint whose answers are known, refuses bad files and the hub offline in one line."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT
from test_chat import chat_tokenizer, random_chat_model, save_chat_checkpoint
from test_tools import scripted_model

from quillgpt import chat_eval
from quillgpt.chat_eval import (
    extract_answer,
    gsm8k_correct,
    humaneval_outcome,
    letter_ids,
    load_items,
    load_tasks,
    parse_record,
    predict_letters,
    reference_number,
    render_mc,
    run_chat_eval,
)
from quillgpt.chat_session import ChatSession
from quillgpt.chat_template import chat_format, with_chat_tokens
from quillgpt.errors import UserError
from quillgpt.sandbox import Limits
from quillgpt.tokenizer import CharTokenizer

# ---- datasets in the hub's columns ------------------------------------------------------------------------------

ARC = [
    ("Which of these is a color?", ["red", "dog", "run", "sky"], "A"),
    ("What do plants need to grow?", ["sand", "light", "glass"], "B"),  # ARC has 3-, 4- and 5-choice items
    ("Which animal can fly?", ["cow", "fish", "bird", "worm", "frog"], "C"),
    ("What is frozen water called?", ["steam", "ice", "rain", "mud"], "B"),
    ("Which is the closest star to Earth?", ["the Moon", "Mars", "Polaris", "the Sun"], "D"),
    ("What gas do people breathe in to live?", ["oxygen", "helium", "neon", "argon"], "A"),
]
MMLU = [
    ("What is 2 + 2?", "elementary_mathematics", ["3", "4", "5", "22"], 1),
    ("Which organ pumps blood?", "anatomy", ["lung", "liver", "heart", "skin"], 2),
    ("What is the capital of France?", "high_school_geography", ["Paris", "Rome", "Bonn", "Oslo"], 0),
    ("How many sides has a triangle?", "elementary_mathematics", ["2", "4", "5", "3"], 3),
    ("Which of these is a mammal?", "college_biology", ["shark", "whale", "trout", "squid"], 1),
]
GSM8K = [
    (
        "Tom picks 17 apples in the early morning. In the afternoon he buys 25 more apples at the market on his way "
        "home. How many apples does Tom have at the end of the day?",
        "Tom has 17+25 = <<17+25=42>>42 apples.\n#### 42",
    ),
    (
        "A farmer packs eggs into boxes. Each box holds 3 rows of eggs, and every row holds 4 eggs. The farmer "
        "fills one box this morning and sells it at noon. How many eggs were in the box that he sold?",
        "The box holds 3*4 = <<3*4=12>>12 eggs.\n#### 12",
    ),
]
HUMANEVAL = [
    {
        "task_id": "Test/0",
        "prompt": "def add(a: int, b: int) -> int:\n"
        '    """Add two whole numbers and return their sum. Either number may be negative, and the order in\n'
        "    which they are given does not change the result.\n    >>> add(2, 3)\n    5\n"
        '    >>> add(-1, 1)\n    0\n    """\n',
        "canonical_solution": "    return a + b\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    },
    {  # imports and a helper in the prompt, as HumanEval/10 has: a body-only completion uses both
        "task_id": "Test/1",
        "prompt": "from typing import List\n\n\ndef is_even(n: int) -> bool:\n    return n % 2 == 0\n\n\n"
        "def evens(numbers: List[int]) -> List[int]:\n"
        '    """Keep the even numbers of the list, in the order in which they come, and leave out the odd\n'
        "    ones; an empty list gives an empty list.\n    >>> evens([1, 2, 3, 4])\n    [2, 4]\n"
        '    >>> evens([])\n    []\n    """\n',
        "canonical_solution": "    return [n for n in numbers if is_even(n)]\n",
        "test": "def check(candidate):\n    assert candidate([1, 2, 3, 4]) == [2, 4]\n    assert candidate([]) == []\n",
        "entry_point": "evens",
    },
    {  # a solution that starts with a blank line, as several of HumanEval's do
        "task_id": "Test/2",
        "prompt": "def total(xs: list) -> int:\n"
        '    """Return the sum of the numbers in xs, adding them one at a time from the first one to the last one;\n'
        "    the sum of an empty list is zero, as a sum of no numbers at all is.\n    >>> total([1, 2, 3])\n    6\n"
        '    >>> total([])\n    0\n    """\n',
        "canonical_solution": "\n    s = 0\n    for x in xs:\n        s += x\n    return s\n",
        "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
        "entry_point": "total",
    },
]


def arc_rows(items=ARC) -> list[dict]:
    letters = "ABCDE"
    return [
        {"id": f"Test_{i}", "question": q, "choices": {"text": c, "label": list(letters[: len(c)])}, "answerKey": a}
        for i, (q, c, a) in enumerate(items)
    ]


def rows_of(task: str) -> list[dict]:
    if task in ("arc_easy", "arc_challenge"):
        return arc_rows(ARC if task == "arc_easy" else ARC[::-1])
    if task == "mmlu":
        return [{"question": q, "subject": s, "choices": c, "answer": a} for q, s, c, a in MMLU]
    if task == "gsm8k":
        return [{"question": q, "answer": a} for q, a in GSM8K]
    return [dict(r) for r in HUMANEVAL]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """rows as a .jsonl file, or a .parquet one (pyarrow: ARC's choices become a struct column, as on the hub)."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_eval_data(directory: Path) -> Path:
    """All five tasks, jsonl and parquet mixed."""
    directory.mkdir(parents=True, exist_ok=True)
    suffixes = {"arc_easy": "jsonl", "arc_challenge": "parquet", "mmlu": "parquet", "gsm8k": "jsonl"}
    for task in chat_eval.TASKS:
        write_rows(directory / f"{task}.{suffixes.get(task, 'jsonl')}", rows_of(task))
    return directory


# ---- multiple choice --------------------------------------------------------------------------------------------


def test_a_question_is_rendered_as_nanochats_render_mc():
    assert render_mc("Which is red?", ("A", "B"), ("fire", "snow")) == (
        "Multiple Choice question: Which is red?\n- fire=A\n- snow=B\n\nRespond only with the letter of the correct answer."
    )


@pytest.mark.parametrize("rows_per_pass", [1, None])
def test_multiple_choice_is_the_letter_a_direct_forward_pass_puts_highest(tmp_path, monkeypatch, rows_per_pass):
    """predict_letters' answers, prompts right-padded together (or one a pass), are item for item the letter whose
    token has the highest logit, among the item's own letters, at the last position of the prompt alone through
    model(idx): the user turn in the chat template and the assistant's turn started. A prompt longer than the
    context gets no answer and counts wrong."""
    model, tok = random_chat_model(block_size=256, seed=2), chat_tokenizer()  # a seed whose answers vary by item
    too_long = ("Which word is longest? " + "Think carefully. " * 14, ["a", "bb", "ccc", "dddd"], "D")
    write_rows(tmp_path / "arc_easy.jsonl", arc_rows(ARC + [too_long]))
    write_rows(tmp_path / "mmlu.parquet", rows_of("mmlu"))
    if rows_per_pass:
        monkeypatch.setattr(chat_eval, "LOGITS_BYTES", 1)  # one prompt a pass, the least there can be
    fmt = chat_format(tok)
    for task in ("arc_easy", "mmlu"):
        items, _ = load_items(task, str(tmp_path), None)
        predictions = predict_letters(model, tok, items)
        by_hand = []
        for item in items:
            ids = fmt.prompt_ids([{"role": "user", "content": render_mc(item.question, item.letters, item.choices)}])
            if len(ids) > model.config.block_size:
                by_hand.append(None)
                continue
            with torch.no_grad():
                logits, _ = model(torch.tensor([ids]))
            scores = [float(logits[0, -1, tok.encode(letter)[0]]) for letter in item.letters]
            by_hand.append(item.letters[int(np.argmax(scores))])
        assert predictions == by_hand
        assert len(set(predictions) - {None}) > 1  # the case discriminates: not one letter for everything
        report = run_chat_eval(model, tok, load_tasks([task], str(tmp_path), None))["tasks"][task]
        right = sum(p == item.answer for p, item in zip(predictions, items))
        assert (report["correct"], report["items"], report["acc"]) == (right, len(items), right / len(items))
        assert report["too_long"] == (task == "arc_easy") and (None in predictions) == (task == "arc_easy")


def test_an_answer_letter_that_is_not_one_token_is_one_line():
    tok = with_chat_tokens(CharTokenizer(list("ABCD abc\n"), eot=True))
    assert letter_ids(tok, ["A", "B"], "mmlu") == {"A": 0, "B": 1}
    with pytest.raises(UserError, match="arc_easy: the answer letter 'E' is not in this model's vocabulary"):
        letter_ids(tok, ["A", "E"], "arc_easy")
    with pytest.raises(UserError, match="arc_easy: the answer letter 'AB' is 2 tokens in this tokenizer, not one"):
        letter_ids(tok, ["AB"], "arc_easy")


def test_the_items_are_nanochats_datasets_shuffled_with_seed_42(tmp_path):
    """--max-per-task N scores the N items nanochat's -x N does: the first of the dataset shuffled as datasets'
    Dataset.shuffle(seed=42) shuffles it (nanochat's tasks do so), whichever file form holds it."""
    datasets = pytest.importorskip("datasets")
    rows = [
        {"question": f"What is {i} + 1?", "answer": f"{i}+1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
        for i in range(40)
    ]
    shuffled = datasets.Dataset.from_list(rows).shuffle(seed=42)
    for suffix in ("jsonl", "parquet"):
        data = tmp_path / suffix
        data.mkdir()
        write_rows(data / f"gsm8k.{suffix}", rows)
        items, source = load_items("gsm8k", str(data), 7)
        assert [i.question for i in items] == [shuffled[k]["question"] for k in range(7)]
        assert source["records"] == 40 and len(source["sha256"]) == 64


# ---- GSM8K -------------------------------------------------------------------------------------------------------


def test_gsm8k_is_graded_on_the_number_after_the_first_four_hashes_as_nanochat_grades():
    answer = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
    assert reference_number(answer) == "10"
    assert gsm8k_correct(answer, "She earned 10 dollars.\n#### 10")
    assert gsm8k_correct(answer, "<|python_start|>0.2*50<|python_end|><|output_start|>10<|output_end|>\n#### 10")
    assert not gsm8k_correct(answer, "She earned 10 dollars.")  # no "####": nanochat has no last-number fallback
    assert not gsm8k_correct(answer, "#### 10.")  # "10." is not "10": nothing but commas is normalised
    assert not gsm8k_correct(answer, "#### 9\nno, #### 10")  # the first "#### " counts
    assert not gsm8k_correct(answer, "####10") and not gsm8k_correct(answer, None)
    assert extract_answer("#### 1,234") == "1234" and extract_answer("#### -3") == "-3"
    assert gsm8k_correct("... #### 1,234", "#### 1234")


def test_gsm8k_replies_are_chat_pys_greedy_replies(tmp_path):
    """The replies graded are what ChatSession.reply answers each question alone, greedily, decoded together."""
    model, tok = random_chat_model(block_size=256, seed=1), chat_tokenizer()
    write_rows(tmp_path / "gsm8k.jsonl", rows_of("gsm8k"))
    report = run_chat_eval(model, tok, load_tasks(["gsm8k"], str(tmp_path), None), 24)["tasks"]["gsm8k"]
    items, _ = load_items("gsm8k", str(tmp_path), None)
    session = ChatSession(model, tok, max_new_tokens=24)
    alone = []
    for item in items:
        session.reset()
        alone.append(session.reply(item.question))
    assert [e["reply"] for e in report["examples"]] == alone
    assert [e["answer"] for e in report["examples"]] == [reference_number(i.answer) for i in items]
    assert report["correct"] == sum(gsm8k_correct(i.answer, r) for i, r in zip(items, alone)) == 0


# ---- HumanEval ---------------------------------------------------------------------------------------------------


def humaneval_items(tmp_path) -> list:
    write_rows(tmp_path / "humaneval.jsonl", rows_of("humaneval"))
    return sorted(load_items("humaneval", str(tmp_path), None)[0], key=lambda i: i.task_id)


def test_canonical_solutions_pass_in_the_sandbox_and_wrong_ones_fail(tmp_path):
    """The oracle: each problem's canonical solution, given as the completion, passes its tests; so does a whole
    function in a ```python block (nanochat's form of a reply), and a wrong body fails."""
    items = humaneval_items(tmp_path)
    assert all(humaneval_outcome(item, item.canonical_solution).passed for item in items)
    fenced = "Here it is:\n```python\ndef add(a: int, b: int) -> int:\n    return b + a\n```\nDone."
    assert humaneval_outcome(items[0], fenced).passed
    wrong = humaneval_outcome(items[0], "    return a - b\n")
    assert not wrong.passed and wrong.status == "failed"
    assert not humaneval_outcome(items[1], "").passed  # no completion: the docstring's function returns None


def test_a_completion_that_never_ends_fails_within_its_limit(tmp_path):
    item = humaneval_items(tmp_path)[0]
    t0 = time.perf_counter()
    outcome = humaneval_outcome(item, "    while True:\n        pass\n", Limits(seconds=1.0))
    elapsed = time.perf_counter() - t0
    assert not outcome.passed and outcome.status == "timeout"
    assert elapsed < 10  # the limit's second and the sandbox's start; unbounded without the limit


# ---- the command line --------------------------------------------------------------------------------------------


def run_eval(*args: str, cwd: Path = REPO_ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "eval.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def known_answers_checkpoint(path: Path, data: Path) -> tuple[Path, dict]:
    """A checkpoint whose every answer is known (test_tools' scripted model: the greedy token at each position is
    scripted), and the accuracy each task must get: multiple choice the right letter for every other item, GSM8K
    one problem through the calculator and one wrong, HumanEval one body right, one whole fenced function right,
    one body wrong."""
    tok = with_chat_tokens(CharTokenizer(["\n"] + [chr(c) for c in range(32, 127)], eot=True))
    fmt, s = chat_format(tok), tok.special_tokens
    end = s["<|im_end|>"]
    script: dict[int, int] = {}

    def write(prompt: list[int], reply: list[int | None]) -> None:
        """The reply after the prompt (None: a position whose guess the calculator's output overrides)."""
        for i, token in enumerate(reply):
            at = len(prompt) - 1 + i
            if token is not None:
                assert script.setdefault(at, token) == token, f"two replies want position {at}"

    expected = {}
    for task in chat_eval.MULTIPLE_CHOICE:
        items, _ = load_items(task, str(data), None)
        right = 0
        for k, item in enumerate(items):
            prompt = fmt.prompt_ids([{"role": "user", "content": item.user()}])
            wanted = item.answer if k % 2 == 0 else next(x for x in item.letters if x != item.answer)
            at = len(prompt) - 1
            script.setdefault(at, tok.encode(wanted)[0])  # an item of the same length may have taken it
            assert tok.decode([script[at]]) in item.letters, f"position {at} holds another item's letter"
            right += tok.decode([script[at]]) == item.answer
        expected[task] = right / len(items)

    def reply_ids(text: str) -> list[int]:
        return tok.encode(text) + [end]

    call = [s["<|python_start|>"], *tok.encode("17+25"), s["<|python_end|>"]]
    inserted = [None] * len([s["<|output_start|>"], *tok.encode("42"), s["<|output_end|>"]])
    replies = {
        GSM8K[0][0]: call + inserted + reply_ids("\n#### 42"),
        GSM8K[1][0]: reply_ids("3 rows of 4 is 7.\n#### 7"),
        HUMANEVAL[0]["prompt"]: reply_ids("    return a + b"),
        HUMANEVAL[1]["prompt"]: reply_ids(
            "```python\nfrom typing import List\n\n\ndef evens(numbers: List[int]) -> List[int]:\n"
            "    return [n for n in numbers if n % 2 == 0]\n```"
        ),
        HUMANEVAL[2]["prompt"]: reply_ids("    return 0"),
    }
    for question, reply in replies.items():
        write(fmt.prompt_ids([{"role": "user", "content": question}]), reply)
    expected.update(gsm8k=1 / 2, humaneval=2 / 3)
    model = scripted_model(tok, script, block_size=max(script) + 8)
    return save_chat_checkpoint(path, model, tok), expected


def test_eval_cli_scores_all_five_on_a_checkpoint_whose_answers_are_known(tmp_path):
    data = write_eval_data(tmp_path / "evals")
    ckpt, expected = known_answers_checkpoint(tmp_path / "known.pt", data)
    out = tmp_path / "r.json"
    t0 = time.perf_counter()
    proc = run_eval(
        *("--ckpt", str(ckpt), "--chat-eval", ",".join(chat_eval.TASKS), "--eval-data", str(data)),
        *("--precision", "fp32", "--json", str(out)),
    )
    print(f"\neval.py --chat-eval, all five tasks: {time.perf_counter() - t0:.1f}s")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())["chat_eval"]
    assert list(report["tasks"]) == list(chat_eval.TASKS)
    for task, acc in expected.items():
        r = report["tasks"][task]
        assert r["acc"] == pytest.approx(acc) and r["items"] == len(rows_of(task)) and r["too_long"] == 0, task
        assert r["path"] == str(next(data.glob(f"{task}.*"))) and len(r["sha256"]) == 64
        assert f"| {task} | {r['scored']} | {r['acc']:.4f} | {r['correct']}/{r['items']} |" in proc.stdout
    gsm8k = {e["question"]: e["reply"] for e in report["tasks"]["gsm8k"]["examples"]}
    assert gsm8k[GSM8K[0][0]] == "<|python_start|>17+25<|python_end|><|output_start|>42<|output_end|>\n#### 42"
    assert report["tasks"]["humaneval"]["statuses"] == {"passed": 2, "failed": 1}
    centred = [(expected[t] - chat_eval.CHANCE[t]) / (1 - chat_eval.CHANCE[t]) for t in chat_eval.TASKS]
    assert report["chatcore"] == pytest.approx(sum(centred) / 5) and "ChatCORE" in proc.stdout


def test_offline_without_eval_data_is_one_line_naming_the_flag_and_the_layout(tmp_path):
    """No --eval-data and nothing downloaded before (data/chat_eval/ of the working directory): the hub is asked
    for, and unreachable (an endpoint that refuses at once), which is one line, exit 2."""
    ckpt = save_chat_checkpoint(tmp_path / "c.pt", random_chat_model(block_size=64))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    proc = run_eval("--ckpt", str(ckpt), "--chat-eval", "arc_easy", cwd=tmp_path, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "allenai/ai2_arc" in errors[0] and "--eval-data DIR" in errors[0]
    assert "DIR/<task>.jsonl or DIR/<task>.parquet" in errors[0]
    assert not (tmp_path / "data").exists()


def test_a_malformed_file_is_one_line_and_exit_2_before_a_model_loads(tmp_path):
    ckpt = tmp_path / "not-there.pt"  # the data is read first: its error, not the checkpoint's, is the one line
    rows = rows_of("gsm8k")
    del rows[1]["answer"]
    write_rows(tmp_path / "gsm8k.jsonl", rows)
    proc = run_eval("--ckpt", str(ckpt), "--chat-eval", "gsm8k", "--eval-data", str(tmp_path))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{tmp_path / 'gsm8k.jsonl'}: record 2: no column 'answer'" in errors[0]


@pytest.mark.parametrize(
    "task, row, message",
    [
        (
            "mmlu",
            {"question": "q", "subject": "s", "choices": ["a", "b", "c", "d"], "answer": 4},
            "column 'answer' is 4",
        ),
        ("mmlu", {"question": "q", "subject": "s", "choices": ["a", "b"], "answer": 0}, "column 'choices' must be"),
        ("arc_easy", {"question": "q", "choices": {"text": ["a"], "label": ["A", "B"]}, "answerKey": "A"}, "'choices'"),
        ("arc_easy", arc_rows()[0] | {"answerKey": "Z"}, "column 'answerKey' is 'Z', not one of the labels"),
        ("gsm8k", {"question": "q", "answer": "It is 4."}, "column 'answer' ends in no '#### N'"),
        ("humaneval", HUMANEVAL[0] | {"entry_point": 3}, "column 'entry_point' is int, not a string"),
        ("humaneval", ["not", "a", "record"], "not a JSON object"),
    ],
)
def test_a_bad_record_names_its_file_record_and_column(task, row, message):
    with pytest.raises(UserError, match="^f.jsonl: record 3: ") as e:
        parse_record(task, row, "f.jsonl: record 3")
    assert message in str(e.value)


def test_data_files_that_are_not_there_twice_there_or_not_json_are_one_line(tmp_path):
    with pytest.raises(UserError, match="has no mmlu.jsonl or mmlu.parquet .*DIR/<task>.jsonl"):
        load_items("mmlu", str(tmp_path), None)
    write_rows(tmp_path / "mmlu.jsonl", rows_of("mmlu"))
    write_rows(tmp_path / "mmlu.parquet", rows_of("mmlu"))
    with pytest.raises(UserError, match="both mmlu.jsonl and mmlu.parquet"):
        load_items("mmlu", str(tmp_path), None)
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps(rows_of("gsm8k")[0]) + "\n{not json\n")
    with pytest.raises(UserError, match="gsm8k.jsonl: record 2: not JSON"):
        load_items("gsm8k", str(tmp_path), None)


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path):
    write_rows(tmp_path / "gsm8k.jsonl", rows_of("gsm8k"))
    base = CharTokenizer(list(chat_tokenizer().chars), eot=True)
    with pytest.raises(UserError, match="no chat template"):
        run_chat_eval(random_chat_model(block_size=64), base, load_tasks(["gsm8k"], str(tmp_path), None))


def test_a_prompt_a_char_vocabulary_cannot_spell_is_one_line_naming_its_record(tmp_path):
    write_rows(tmp_path / "humaneval.jsonl", rows_of("humaneval"))  # chat_tokenizer() has no "(" for def f(...)
    with pytest.raises(UserError, match=r"humaneval.jsonl: record \d: character '\(' \(U\+0028\) is not in"):
        run_chat_eval(
            random_chat_model(block_size=64), chat_tokenizer(), load_tasks(["humaneval"], str(tmp_path), None)
        )


def test_an_unknown_chat_evaluation_is_refused_before_loading_anything(tmp_path):
    proc = run_eval("--ckpt", str(tmp_path / "missing.pt"), "--chat-eval", "arc_easy,poetry")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown chat evaluation poetry" in proc.stderr
