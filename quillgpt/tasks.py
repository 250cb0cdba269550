"""Synthetic chat tasks with checkable answers: what a small model learns on a CPU in minutes, and how it is graded.

tasks.py (at the repository root) writes them as conversations; this module makes and grades them.

Three families, each a question and a short answer in plain ASCII (any char vocabulary trained on English or code
has every character):
- arithmetic: "What is 17 + 25?" -> "42" (sums and differences of numbers below 100, never negative)
- reverse: "Spell 'night' backwards." -> "thgin"
- count: "How many times does 'r' appear in 'strawberry'?" -> "3"

Each item has a key (its content: the numbers, or the word and letter, never the phrasing), and a hash of the key
puts it in the train, val or test split, so held-out items are never trained on, in any phrasing, whatever the seed.
A run's in-training evaluations grade the val split (and choose its best checkpoint on it); eval.py and the reports
grade the test split, which no run reads.
Written as jsonl lines {"messages": [...]} (the form prepare.py --chat reads); eval.py --chat-task grades a model on
the test split (quillgpt.evaluate.run_chat_tasks).

With tool=True, arithmetic and count are answered with the calculator tool (quillgpt/tools.py), as nanochat's
SpellingBee counts letters: the assistant's reply calls it and then gives the output as its answer, parts {"type":
"python", "text": "17+25"} (or "'strawberry'.count('r')"), {"type": "python_output", "text": "42"}, {"type":
"text", "text": "42"}; the output is the calculator's own (the sampler inserts it at run time) and the loss does not
count it (quillgpt.chat_template).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from quillgpt.errors import UserError
from quillgpt.tools import calculate

# Common English words of 3 to 8 letters: reversing and counting letters of a word the model has never seen in a
# question is the test, so the held-out split holds words no training item uses.
WORDS = """
able acid aged also area army away baby back ball band bank base bath bear beat been beer bell belt best bird
blow blue boat body bone book boot born boss both bowl burn bush busy cake call calm came camp card care case
cash cast cell chat chip city club coal coat code cold come cook cool cope copy core cost crew crop dark data
date dawn dead deal dear debt deep deny desk diet dirt dish door down draw drop drug dust duty each earn ease
east easy edge else even ever face fact fail fair fall farm fast fate fear feed feel file fill film find fine
fire firm fish five flat flow food foot form fort four free from fuel full fund gain game gate gave gear gift
girl give glad goal gold golf gone good gray grew grow hair half hall hand hang hard harm hate have head hear
heat held help here hero high hill hire hold hole holy home hope host hour huge hung hunt idea inch into
iron item jack join jump jury just keen keep kept kick kind king knee knew know lack lady
laid lake land lane last late lead left less life lift like line link list live load loan lock long look lord
lose loss lost love luck made mail main make male many mark mass meal mean meat meet menu mere mile milk mind
mine miss mode mood moon more most move much must name navy near neck need news next nice nine none nose
note okay once only open oral over pace pack page paid pain pair palm park part pass past path peak pick pink
pipe plan play plot plus poem poet pool poor port post pull pure push race rail rain rank rare rate read real
rear rely rent rest rice rich ride ring rise risk road rock role roll roof room root rope rose rule rush safe
said sake sale salt same sand save seat seed seek seem seen self sell send sent ship shop shot show shut sick
side sign site size skin slip slow snow soft soil sold sole some song soon sort soul spot star stay step stop
such suit sure take tale talk tall tank tape task team tech tell tend term test text than that them then they
thin this thus tide till time tiny told tone took tool tour town tree trip true tune turn twin type unit upon
used user vast very vice view vote wage wait wake walk wall want ward warm wash wave ways weak wear week well
went were west what when whom wide wife wild will wind wine wing wire wise wish with wood word wore work yard
yeah year your zero zone apple bread chair dance earth field glass heart horse house judge knife laugh light
money mouth night ocean paper party peace phone piano plant power queen radio river round scale shape sheep
shirt smile sound space spoon storm sugar table teeth thing tiger toast touch tower train truth uncle voice
water whale wheel woman world young animal basket bottle bridge butter camera candle castle circle cookie
corner dinner doctor dragon family father finger flower forest friend garden guitar hammer island jacket
kitten letter little market mirror monkey mother number orange parent pencil pepper person pickle planet
pocket rabbit school silver spring square street summer ticket tomato turtle winter yellow balloon blanket
brother chicken country diamond dolphin kitchen library monster morning picture rainbow sandwich strawberry
teacher thunder village weather banana elephant mountain notebook umbrella
""".split()
WORDS_SET = frozenset(WORDS)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# the words' letters, each as often as in WORDS: made-up words spell like them
VOWELS = "".join(c for w in WORDS for c in w if c in "aeiou")
CONSONANTS = "".join(c for w in WORDS for c in w if c not in "aeiou")
HELD_OUT = 10  # one key in HELD_OUT goes to the test split, another to the validation split
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Item:
    task: str
    key: str  # the item's content, whatever its phrasing: what the split is decided by
    question: str
    answer: str
    call: str = ""  # the calculator call that answers it ("17+25"); "" for a task the tool does not answer

    def messages(self, tool: bool = False) -> list[dict]:
        """The question and its answer; with tool (and a call), the answer through the calculator."""
        reply: str | list[dict] = self.answer
        if tool and self.call:
            reply = [
                {"type": "python", "text": self.call},
                {"type": "python_output", "text": calculate(self.call)},
                {"type": "text", "text": self.answer},
            ]
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": reply}]


@dataclass(frozen=True)
class Task:
    name: str
    keys: Callable[[], list[tuple]]  # every item's content, in a fixed order
    phrasings: tuple[str, ...]  # str.format templates over the fields of ask()
    ask: Callable[[tuple], dict]  # content -> the fields a phrasing names
    answer: Callable[[tuple], str]
    call: Callable[[tuple], str] | None = None  # content -> the calculator call that answers it (None: no tool)
    made_up: Callable[[random.Random], tuple] | None = None  # a key beyond keys(), on made-up words (None: no such)

    def item(self, key: tuple, phrasing: str) -> Item:
        question = phrasing.format(**self.ask(key))
        return Item(self.name, ":".join(map(str, key)), question, self.answer(key), self.call(key) if self.call else "")


def arithmetic_keys() -> list[tuple]:
    return [(a, op, b) for a in range(100) for b in range(100) for op in "+-" if op == "+" or a >= b]


def count_keys() -> list[tuple]:
    """Each word with each of its letters, and with half as many letters it lacks (answer 0)."""
    keys = []
    for w in WORDS:
        present = sorted(set(w))
        absent = random.Random(w).sample([c for c in LETTERS if c not in w], max(1, len(present) // 2))
        keys += [(w, c) for c in present + sorted(absent)]
    return keys


def made_up_word(rng: random.Random) -> str:
    """A made-up word as long as a random one of WORDS, consonants and vowels mostly in turn and each letter as common
    as in WORDS, never one of WORDS: reverse and count items on it are new to a model trained on the tasks' words,
    and never a held-out item."""
    while True:
        vowel = rng.random() < 0.4
        letters = []
        for _ in range(len(rng.choice(WORDS))):
            letters.append(rng.choice(VOWELS if vowel else CONSONANTS))
            vowel = not vowel if rng.random() < 0.8 else vowel
        word = "".join(letters)
        if word not in WORDS_SET:
            return word


def made_up_count_key(rng: random.Random) -> tuple:
    """A made-up word with one of its letters, or (a third of the time, as count_keys has it) a letter it lacks."""
    w = made_up_word(rng)
    pool = sorted(set(w)) if rng.random() >= 1 / 3 else [c for c in LETTERS if c not in w]
    return (w, rng.choice(pool))


TASKS = {
    "arithmetic": Task(
        "arithmetic",
        arithmetic_keys,
        ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "What do you get from {a} {op} {b}?"),
        lambda k: {"a": k[0], "op": k[1], "b": k[2]},
        lambda k: str(k[0] + k[2] if k[1] == "+" else k[0] - k[2]),
        lambda k: f"{k[0]}{k[1]}{k[2]}",
    ),
    "reverse": Task(
        "reverse",
        lambda: [(w,) for w in WORDS],
        ("Spell '{w}' backwards.", "What is '{w}' reversed?", "Reverse the word {w}.", "Write {w} backwards."),
        lambda k: {"w": k[0]},
        lambda k: k[0][::-1],
        made_up=lambda rng: (made_up_word(rng),),
    ),
    "count": Task(
        "count",
        count_keys,
        (
            "How many times does '{c}' appear in '{w}'?",
            "How many {c}'s are in '{w}'?",
            "Count the letter {c} in {w}.",
        ),
        lambda k: {"w": k[0], "c": k[1]},
        lambda k: str(k[0].count(k[1])),
        lambda k: f"'{k[0]}'.count('{k[1]}')",
        made_up=made_up_count_key,
    ),
}


def parse_tasks(spec: str | list[str]) -> list[str]:
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise UserError(f"unknown chat task {', '.join(unknown) or repr(spec)}: the tasks are {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def split_of(task: str, key: tuple) -> str:
    """train, val (what a run's in-training evaluations grade and its best checkpoint is chosen on) or test (what
    eval.py and the reports grade): disjoint, whatever the phrasing."""
    digest = hashlib.sha256(f"{task}:{':'.join(map(str, key))}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") % HELD_OUT
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def split_keys(task: str, split: str) -> list[tuple]:
    return [k for k in TASKS[task].keys() if split_of(task, k) == split]


def sample_items(task: str, split: str, n: int, seed: int, distinct: bool = False, made_up: bool = False) -> list[Item]:
    """n items of a task's split, each in a random phrasing: drawn with replacement, or (distinct) n different keys
    (all of them when the split has fewer); made_up: on made-up words instead, for a task that has them (reverse,
    count), which no split holds (the train split only)."""
    rng = random.Random(f"{task}:{split}:{seed}")
    if made_up and TASKS[task].made_up is not None:
        if split != "train":
            raise UserError("made-up words are training questions: the val and test splits are the tasks' own words")
        keys = [TASKS[task].made_up(rng) for _ in range(n)]
    else:
        pool = split_keys(task, split)
        keys = rng.sample(pool, min(n, len(pool))) if distinct else [rng.choice(pool) for _ in range(n)]
    phrasings = TASKS[task].phrasings
    return [TASKS[task].item(k, rng.choice(phrasings)) for k in keys]


def conversations(
    tasks: list[str], split: str, n: int, seed: int, turns: int = 1, tool: bool = False, made_up: bool = False
) -> list[list[dict]]:
    """n conversations of 1 to `turns` question-answer turns, the tasks in equal shares, in a seeded order; tool:
    arithmetic and count answered with the calculator (Item.messages); made_up: reverse and count on made-up words."""
    groups = item_groups(tasks, split, n, seed, turns, made_up)
    return [[m for item in group for m in item.messages(tool)] for group in groups]


def item_groups(
    tasks: list[str], split: str, n: int, seed: int, turns: int = 1, made_up: bool = False
) -> list[list[Item]]:
    """n groups of 1 to `turns` items, the tasks in equal shares, in a seeded order: a conversation's questions."""
    rng = random.Random(f"conversations:{split}:{seed}")
    lengths = [rng.randint(1, turns) for _ in range(n)]
    per_task = -(-sum(lengths) // len(tasks))
    pools = {t: sample_items(t, split, per_task, seed, made_up=made_up) for t in tasks}
    items = [item for pool in pools.values() for item in pool]
    rng.shuffle(items)
    out, at = [], 0
    for length in lengths:
        out.append(items[at : at + length])
        at += length
    return out


def preference_pairs(
    tasks: list[str], split: str, n: int, seed: int, turns: int = 1, made_up: bool = False, tool: bool = False
) -> list[dict]:
    """n preference records in TRL's conversational form: the conversation so far (earlier turns answered right)
    and the last question as the prompt, its answer chosen and a near miss rejected; made_up: reverse and count on
    made-up words; tool: arithmetic and count answered through the calculator, the rejected reply a call that
    miscopies the question (near_miss_call)."""
    rng = random.Random(f"preference:{split}:{seed}")
    records = []
    for group in item_groups(tasks, split, n, seed, turns, made_up):
        *before, last = group
        prompt = [m for item in before for m in item.messages(tool)] + [{"role": "user", "content": last.question}]
        called = tool and last.call
        rejected = near_miss_call(last, rng) if called else near_miss(last, rng)
        records.append(
            {
                "prompt": prompt,
                "chosen": [last.messages(tool)[1]],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return records


def near_miss_call(item: Item, rng: random.Random) -> list[dict]:
    """A reply through the calculator whose call miscopies the question (a number off by one, a word with a letter
    left out), with that call's output and answer: the tool-using model's most likely miss."""
    if item.task == "count":
        word, letter = item.key.split(":")
        call = f"'{without_a_letter(word, rng)}'.count('{letter}')"
    else:
        a, op, b = item.key.split(":")
        a, b = int(a), int(b)
        # one number off by one, the difference never negative: (a + 1, b) always qualifies
        misses = [(x, y) for x, y in ((a, b - 1), (a, b + 1), (a - 1, b), (a + 1, b)) if min(x, y) >= 0]
        x, y = rng.choice([(x, y) for x, y in misses if op == "+" or x >= y])
        call = f"{x}{op}{y}"
    output = calculate(call)
    return [
        {"type": "python", "text": call},
        {"type": "python_output", "text": output},
        {"type": "text", "text": output},
    ]


def without_a_letter(word: str, rng: random.Random) -> str:
    """The word with one letter, chosen at random, left out."""
    i = rng.randrange(len(word))
    return word[:i] + word[i + 1 :]


def near_miss(item: Item, rng: random.Random) -> str:
    """A wrong answer close to the right one: a number off by a little (never negative), a reversed word with one
    letter left out (the chat demo's model's most common miss)."""
    if item.task == "reverse":
        return without_a_letter(item.answer, rng)
    right = int(item.answer)
    steps = (-10, -2, -1, 1, 2, 10) if item.task == "arithmetic" else (-1, 1)
    return str(right + rng.choice([d for d in steps if right + d >= 0]))


def plain_prompt(item: Item, shots: list[Item]) -> str:
    """A base model's form of the question (it knows no chat template): the shots answered, then the question, each
    as "Q: ...\nA: ..." and a blank line; the answer is what follows "A:" up to the end of the line."""
    return "".join(f"Q: {s.question}\nA: {s.answer}\n\n" for s in shots) + f"Q: {item.question}\nA:"


def grade(item: Item, reply: str) -> bool:
    """A reply is right when, stripped of surrounding spaces and a final full stop, it is the answer."""
    return reply.strip().removesuffix(".").strip() == item.answer
