"""nanochat's chat evaluations, scored as its scripts/chat_eval.py scores them: ARC-Easy, ARC-Challenge and MMLU
(multiple choice), GSM8K (grade-school word problems) and HumanEval (Python functions run against their tests).
eval.py --chat-eval is the command line (docs/evaluation.md#chat-evaluations-arc-mmlu-gsm8k-humaneval).

Each question is asked as nanochat asks it: alone, as the user's turn in the model's chat template, the assistant's
turn started after it.
- Multiple choice: the question and its choices as nanochat's render_mc writes them, one forward pass, and the answer
  is the letter whose token has the highest logit at the reply's first position, among the item's own letters
  (nanochat's categorical evaluation: each letter must be one token of the tokenizer).
- GSM8K: the greedy reply, decoded through the Engine with the calculator tool answering its calls where the
  tokenizer has the tool's tokens (as chat.py and eval.py --chat-task decode: quillgpt/replies.py), is right when the
  number after its first "#### " is the one after the reference's (nanochat's extract_answer).
- HumanEval: the greedy reply's code (its first ``` block, else all of it) after the problem's prompt, then the
  problem's test and `check(entry_point)`, run in quillgpt/sandbox.py (nothing model-written runs any other way): right
  when the sandbox says the program passed.

The items are each dataset's test split in nanochat's order (shuffled with seed 42, as datasets' shuffle does), so
that --max-per-task N scores the N items nanochat's -x N scores. An item whose prompt does not fit the model's context
is counted wrong, and the report says how many there were.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from model import GPT
from quillgpt.chat_template import ChatFormat, chat_format
from quillgpt.corpus import parquet_file
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, sha256_file
from quillgpt.network import check_hub_reachable
from quillgpt.replies import chat_answers
from quillgpt.sandbox import Limits, Outcome, run_python
from quillgpt.tokenizer import Tokenizer

TASKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")
MULTIPLE_CHOICE = ("arc_easy", "arc_challenge", "mmlu")
# each task's test split on the Hugging Face hub, as nanochat's tasks/*.py name it: repository, subset, split
HUB = {
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "mmlu": ("cais/mmlu", "all", "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "humaneval": ("openai/openai_humaneval", "openai_humaneval", "test"),
}
# the columns each task reads, the hub datasets' own
COLUMNS = {
    "arc_easy": ("question", "choices", "answerKey"),
    "arc_challenge": ("question", "choices", "answerKey"),
    "mmlu": ("question", "subject", "choices", "answer"),
    "gsm8k": ("question", "answer"),
    "humaneval": ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
}
LAYOUT = (
    "each task as DIR/<task>.jsonl or DIR/<task>.parquet with its hub dataset's columns: arc_easy and "
    "arc_challenge: question, choices {text, label}, answerKey; mmlu: question, subject, choices, answer; "
    "gsm8k: question, answer; humaneval: task_id, prompt, canonical_solution, test, entry_point"
)
CACHE_DIR = Path("data") / "chat_eval"  # hub downloads, kept as jsonl: a later run reads them offline
SHUFFLE_SEED = 42  # nanochat's tasks shuffle each dataset with it before taking the first -x N
MAX_NEW_TOKENS = 512  # nanochat's chat_eval default for a generated reply
MMLU_LETTERS = ("A", "B", "C", "D")
# nanochat's chance accuracies, which its ChatCORE metric centres each accuracy on (ARC at 1 in 4 too)
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "mmlu": 0.25, "gsm8k": 0.0, "humaneval": 0.0}
HUMANEVAL_LIMITS = Limits(seconds=5.0, memory_bytes=256 << 20)  # nanochat's execute_code defaults
LOGITS_BYTES = 64 << 20  # a pass of multiple-choice prompts holds at most this much fp32 logits (one prompt at least)
GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # nanochat's, after OpenAI's grade-school-math
CALCULATION = re.compile(r"(<<[^>]+>>)")  # a GSM8K solution's calculator annotations


def parse_names(spec: str) -> list[str]:
    """--chat-eval's comma-separated names, checked before anything loads."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise UserError(f"unknown chat evaluation {', '.join(unknown) or repr(spec)}: they are {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


# ---- the items --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """A multiple-choice question (ARC, MMLU)."""

    question: str
    letters: tuple[str, ...]
    choices: tuple[str, ...]
    answer: str  # the right one's letter
    where: str = ""  # its file and record

    def user(self) -> str:
        return render_mc(self.question, self.letters, self.choices)


@dataclass(frozen=True)
class Problem:
    """A GSM8K problem."""

    question: str
    answer: str  # the reference solution, ending in "#### N"
    where: str = ""

    def user(self) -> str:
        return self.question


@dataclass(frozen=True)
class Program:
    """A HumanEval problem: the start of a function (imports, signature, docstring), its tests and their entry."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str
    where: str = ""

    def user(self) -> str:
        return self.prompt


def render_mc(question: str, letters: tuple[str, ...], choices: tuple[str, ...]) -> str:
    """nanochat's form (tasks/common.py): each choice before its letter and no space after the "=", so that the
    letter is the same token in the question as in the one-letter answer (a small model's binding needs both)."""
    query = f"Multiple Choice question: {question}\n"
    query += "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return query + "\nRespond only with the letter of the correct answer."


def is_strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def parse_record(task: str, row, where: str) -> Choice | Problem | Program:
    """A record of the task's hub dataset as an item; UserError naming `where` (file and record) and the column."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object with the columns {', '.join(COLUMNS[task])}")
    missing = [c for c in COLUMNS[task] if c not in row]
    if missing:
        raise UserError(f"{where}: no column '{missing[0]}' ({task} records have {', '.join(COLUMNS[task])})")

    def text(column: str) -> str:
        if not isinstance(row[column], str):
            raise UserError(f"{where}: column '{column}' is {type(row[column]).__name__}, not a string")
        return row[column]

    if task in ("arc_easy", "arc_challenge"):
        choices = row["choices"]
        texts, labels = (choices.get("text"), choices.get("label")) if isinstance(choices, dict) else (None, None)
        if not (is_strings(texts) and is_strings(labels) and len(texts) == len(labels) >= 2):
            raise UserError(f"{where}: column 'choices' must be {{text: [...], label: [...]}}, strings of one length")
        if text("answerKey") not in labels:
            raise UserError(f"{where}: column 'answerKey' is {row['answerKey']!r}, not one of the labels {labels}")
        return Choice(text("question"), tuple(labels), tuple(texts), row["answerKey"], where)
    if task == "mmlu":
        text("subject")
        if not (is_strings(row["choices"]) and len(row["choices"]) == len(MMLU_LETTERS)):
            raise UserError(f"{where}: column 'choices' must be a list of {len(MMLU_LETTERS)} strings")
        answer = row["answer"]
        if type(answer) is not int or not 0 <= answer < len(MMLU_LETTERS):
            raise UserError(f"{where}: column 'answer' is {answer!r}, not the right choice's index (0 to 3)")
        return Choice(text("question"), MMLU_LETTERS, tuple(row["choices"]), MMLU_LETTERS[answer], where)
    if task == "gsm8k":
        if reference_number(text("answer")) is None:
            raise UserError(f"{where}: column 'answer' ends in no '#### N' final answer to grade against")
        return Problem(text("question"), row["answer"], where)
    return Program(*(text(c) for c in COLUMNS["humaneval"]), where)


# ---- the data ---------------------------------------------------------------------------------------------------


def read_records(path: Path) -> list[tuple[int, object]]:
    """(record number from 1, record) of a .jsonl (a record a line, blank lines skipped) or .parquet file."""
    if path.suffix == ".parquet":
        return list(enumerate(parquet_file(str(path)).read().to_pylist(), 1))
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append((n, json.loads(line)))
                except json.JSONDecodeError:
                    raise UserError(f"{path}: record {n}: not JSON") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return records


def task_file(task: str, eval_data: str | None) -> Path:
    """The task's file in --eval-data DIR; without DIR the hub's copy, downloaded once into data/chat_eval/."""
    if eval_data is not None:
        if not Path(eval_data).is_dir():
            raise UserError(f"--eval-data {eval_data} is not a directory ({LAYOUT})")
        found = [p for p in (Path(eval_data) / f"{task}.jsonl", Path(eval_data) / f"{task}.parquet") if p.is_file()]
        if not found:
            raise UserError(f"--eval-data {eval_data} has no {task}.jsonl or {task}.parquet ({LAYOUT})")
        if len(found) > 1:
            raise UserError(f"--eval-data {eval_data} has both {task}.jsonl and {task}.parquet: keep the one to score")
        return found[0]
    cached = CACHE_DIR / f"{task}.jsonl"
    return cached if cached.is_file() else download(task, cached)


def download(task: str, path: Path) -> Path:
    """The task's test split from the hub (through datasets, which keeps its own cache too), written to path as jsonl
    with the dataset's columns."""
    repo, subset, split = HUB[task]
    check_hub_reachable(
        f"{task} is read from {repo} ({subset}, {split} split) on the Hugging Face hub",
        f"offline, give the data with --eval-data DIR, {LAYOUT}",
    )
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"reading {task} from the hub needs datasets: pip install '.[data]', or --eval-data DIR"
        ) from None
    try:
        rows = datasets.load_dataset(repo, subset, split=split)
    except Exception as e:  # the hub client's and datasets' errors share no base class
        message = (str(e).splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"cannot load {repo} ({subset}) from the hub: {message}; give the data with --eval-data DIR"
        ) from None
    with atomic_write(path) as f:
        for row in rows:
            f.write((json.dumps(dict(row)) + "\n").encode())
    return path


def load_items(task: str, eval_data: str | None, max_per_task: int | None) -> tuple[list, dict]:
    """The task's items in nanochat's order, the first max_per_task of them, and where they came from. Every record
    is checked, not only those scored."""
    path = task_file(task, eval_data)
    records = read_records(path)
    if not records:
        raise UserError(f"{path} holds no records")
    items = [parse_record(task, row, f"{path}: record {n}") for n, row in records]
    order = np.random.default_rng(SHUFFLE_SEED).permutation(len(items))  # datasets' Dataset.shuffle(seed=42)
    items = [items[i] for i in order[:max_per_task]]
    return items, {"path": str(path), "sha256": sha256_file(path), "records": len(records)}


# ---- scoring ----------------------------------------------------------------------------------------------------


def letter_ids(tokenizer: Tokenizer, letters: list[str], task: str) -> dict[str, int]:
    """Each answer letter's one token (nanochat asserts one): a letter the tokenizer lacks or splits is a UserError."""
    ids = {}
    for letter in letters:
        try:
            encoded = tokenizer.encode(letter)
        except UserError:
            raise UserError(f"{task}: the answer letter {letter!r} is not in this model's vocabulary") from None
        if len(encoded) != 1:
            raise UserError(
                f"{task}: the answer letter {letter!r} is {len(encoded)} tokens in this tokenizer, not one "
                "(multiple choice is scored on each letter's token)"
            )
        ids[letter] = encoded[0]
    return ids


def prompt_of(fmt: ChatFormat, item: Choice | Problem | Program) -> list[int]:
    """The item's question as the user's turn, the assistant's turn started; a character a char vocabulary lacks is
    a UserError naming the item's file and record."""
    try:
        return fmt.prompt_ids([{"role": "user", "content": item.user()}])
    except UserError as e:
        raise UserError(f"{item.where}: {e}") from None


@torch.inference_mode()
def predict_letters(
    model: GPT, tokenizer: Tokenizer, items: list[Choice], label: str = "", prompts: list[list[int]] | None = None
) -> list[str | None]:
    """Each item's answer: the letter, of its own, whose token the model puts highest after the assistant's turn is
    started (None: its prompt is longer than the model's context). Prompts of about one length share a forward pass,
    right-padded (causal attention keeps a prompt blind to the padding after it), each pass's logits at most
    LOGITS_BYTES in fp32."""
    fmt = chat_format(tokenizer)
    ids = letter_ids(tokenizer, sorted({letter for item in items for letter in item.letters}), label)
    prompts = prompts or [prompt_of(fmt, item) for item in items]
    fits = sorted(
        (i for i, p in enumerate(prompts) if len(p) <= model.config.block_size), key=lambda i: len(prompts[i])
    )
    device = model.transformer.wte.weight.device
    position_bytes = 4 * model.config.vocab_size  # a position's fp32 logits
    out: list[str | None] = [None] * len(items)
    with tqdm(total=len(fits), desc=label, unit="item", leave=False, disable=None) as bar:
        at = 0
        while at < len(fits):
            n = 1  # sorted by length: a pass's last prompt is its widest
            while at + n < len(fits) and (n + 1) * len(prompts[fits[at + n]]) * position_bytes <= LOGITS_BYTES:
                n += 1
            chunk = fits[at : at + n]
            idx = torch.zeros((n, len(prompts[chunk[-1]])), dtype=torch.long)
            for row, i in enumerate(chunk):
                idx[row, : len(prompts[i])] = torch.tensor(prompts[i])
            logits, _ = model(idx.to(device))  # (n, T, V)
            last = logits[torch.arange(n), torch.tensor([len(prompts[i]) - 1 for i in chunk])].float().cpu()  # (n, V)
            for row, i in enumerate(chunk):
                letters = items[i].letters
                out[i] = letters[int(last[row, [ids[letter] for letter in letters]].argmax())]  # a tie: the first
            at += n
            bar.update(n)
    return out


def generated_replies(
    model: GPT,
    tokenizer: Tokenizer,
    items: list[Problem | Program],
    max_new_tokens: int,
    label: str = "",
    prompts: list[list[int]] | None = None,
) -> list[str | None]:
    """Each user turn's greedy reply as text, the tool's tokens spelled out (replies.chat_answers: the Engine, the
    calculator answering calls); None where the prompt leaves no room in the model's context."""
    prompts = prompts or [prompt_of(chat_format(tokenizer), item) for item in items]
    fits = [i for i, p in enumerate(prompts) if len(p) < model.config.block_size]
    out: list[str | None] = [None] * len(items)
    if fits:
        replies = chat_answers(model, tokenizer, [items[i].user() for i in fits], max_new_tokens, label)
        for i, reply in zip(fits, replies):
            out[i] = reply.text
    return out


def extract_answer(completion: str) -> str | None:
    """nanochat's (tasks/gsm8k.py, after OpenAI's grade-school-math): the number after the first "#### ", its commas
    dropped, nothing else normalised ("#### 10." is "10."); None without one."""
    match = GSM_RE.search(completion)
    return match.group(1).strip().replace(",", "") if match else None


def reference_number(answer: str) -> str | None:
    """A GSM8K solution's final number, as nanochat reads it: extract_answer of its text after the last <<...>>
    calculator annotation."""
    return extract_answer(CALCULATION.split(answer)[-1])


def gsm8k_correct(answer: str, reply: str | None) -> bool:
    """Whether the reply's "#### N" is the reference solution's; a reply without one is wrong (nanochat has no
    fallback to the reply's last number)."""
    return reply is not None and extract_answer(reply) == reference_number(answer)


def extract_program(completion: str) -> str:
    """The code of a reply, as nanochat's humaneval.py finds it: the first ```python (or ```) block, else the whole
    reply; then only leading blank lines and trailing space taken off, so that the first line keeps its indentation
    (a reply that writes only the function's body, as canonical_solution is written, stays inside the function)."""
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", completion, re.DOTALL)
    code = blocks[0] if blocks else completion
    return re.sub(r"\A(?:[ \t]*\n)+", "", code).rstrip()


def humaneval_program(item: Program, completion: str) -> str:
    """The program that grades a completion: the prompt (imports, helpers, the signature and docstring), the
    completion's code, the problem's tests and their call (a completion that writes the whole function redefines it
    after the prompt's)."""
    prompt = item.prompt if item.prompt.endswith("\n") else item.prompt + "\n"
    return prompt + extract_program(completion) + "\n\n" + item.test + f"\ncheck({item.entry_point})\n"


def humaneval_outcome(item: Program, completion: str, limits: Limits = HUMANEVAL_LIMITS) -> Outcome:
    """The completion's program run in the sandbox under limits: Outcome.passed is the grade."""
    return run_python(humaneval_program(item, completion), limits)


# ---- the evaluation ---------------------------------------------------------------------------------------------


def load_tasks(names: list[str], eval_data: str | None, max_per_task: int | None) -> dict[str, tuple[list, dict]]:
    """Each named task's items and source (load_items): read and checked before a model loads, so that a missing
    or malformed file, or the hub offline, is a line at once."""
    return {name: load_items(name, eval_data, max_per_task) for name in names}


def run_chat_eval(
    model: GPT,
    tokenizer: Tokenizer,
    tasks: dict[str, tuple[list, dict]],
    max_new_tokens: int = MAX_NEW_TOKENS,
    limits: Limits = HUMANEVAL_LIMITS,
) -> dict:
    """Accuracy on each task of load_tasks (the report's chat_eval entry). The chat template, every item's prompt
    and every answer letter's token are checked before the first item is scored."""
    fmt = chat_format(tokenizer)  # a model without a chat template: one line
    prompts = {name: [prompt_of(fmt, item) for item in items] for name, (items, _) in tasks.items()}
    for name, (items, _) in tasks.items():
        if name in MULTIPLE_CHOICE:
            letter_ids(tokenizer, sorted({letter for item in items for letter in item.letters}), name)
    out = {
        "form": "chat template",
        "context": model.config.block_size,
        "max_new_tokens": max_new_tokens,
        "humaneval_limits": {"seconds": limits.seconds, "memory_bytes": limits.memory_bytes},
        "tasks": {},
    }
    for name, (items, source) in tasks.items():
        t0 = time.perf_counter()
        extra = {}
        if name in MULTIPLE_CHOICE:
            answers = predict_letters(model, tokenizer, items, name, prompts[name])
            right = [a == item.answer for item, a in zip(items, answers)]
            scored = "letter logits"
            examples = [{"question": i.user(), "answer": i.answer, "prediction": a} for i, a in zip(items, answers)]
        else:
            answers = generated_replies(model, tokenizer, items, max_new_tokens, name, prompts[name])
            if name == "gsm8k":
                right = [gsm8k_correct(item.answer, a) for item, a in zip(items, answers)]
                scored = "greedy, its '#### N'"
                examples = [
                    {"question": i.question, "answer": reference_number(i.answer), "reply": a}
                    for i, a in zip(items, answers)
                ]
            else:
                runs = tqdm(zip(items, answers), desc=name, total=len(items), unit="program", leave=False, disable=None)
                outcomes = [humaneval_outcome(item, a, limits) if a is not None else None for item, a in runs]
                right = [o is not None and o.passed for o in outcomes]
                scored = "greedy, its tests in the sandbox"
                extra["statuses"] = dict(Counter(o.status if o else "too long" for o in outcomes))
                examples = [
                    {"task_id": i.task_id, "status": o.status if o else "too long", "reply": a}
                    for i, a, o in zip(items, answers, outcomes)
                ]
        correct = sum(right)
        out["tasks"][name] = {
            **source,
            "scored": scored,
            "items": len(items),
            "correct": correct,
            "acc": correct / len(items),
            "too_long": sum(a is None for a in answers),
            **extra,
            "seconds": time.perf_counter() - t0,
            "examples": examples[:5],
        }
    if all(name in out["tasks"] for name in TASKS):  # nanochat's ChatCORE: the accuracies above chance, averaged
        centred = [(out["tasks"][n]["acc"] - CHANCE[n]) / (1 - CHANCE[n]) for n in TASKS]
        out["chatcore"] = sum(centred) / len(centred)
    return out


def print_chat_eval(report: dict) -> None:
    """The chat_eval entry as print_report's table."""
    print("| chat evaluation | scored as | accuracy | right / items | seconds |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, r in report["tasks"].items():
        print(f"| {name} | {r['scored']} | {r['acc']:.4f} | {r['correct']:,}/{r['items']:,} | {r['seconds']:.1f} |")
    for name, r in report["tasks"].items():
        if r["too_long"]:
            print(
                f"  note: {r['too_long']:,} of {name}'s items leave no room in the model's context of "
                f"{report['context']} tokens: counted wrong"
            )
    if "chatcore" in report:
        print(f"ChatCORE (nanochat's: each accuracy's way from chance to 1, averaged): {report['chatcore']:.4f}")
