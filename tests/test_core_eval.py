"""CORE (quillgpt/core_eval.py) held to nanochat's rules: prompts rendered byte for byte as its templates render them,
its few-shot draws and shuffle, the scored spans, cropping, an oracle scoring 1 through the same code, a random GPT
at chance, the centring, two gloo ranks equal to one process, and eval.py --core with its one-line mistakes. Every
bundle is written here, in nanochat's eval_bundle layout (core.yaml, eval_meta_data.csv, eval_data/)."""

import csv
import functools
import http.server
import json
import os
import random
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO_ROOT, WORDS, tiny_overrides
from torch import nn

from model import GPT, GPTConfig
from quillgpt import core_eval
from quillgpt.checkpoint import load_checkpoint
from quillgpt.core_eval import (
    Rows,
    centered,
    core_score,
    crop,
    fewshot_indices,
    find_bundle,
    item_rows,
    prefix_ids,
    read_bundle,
    read_items,
    render_prompts,
    task_rows,
)
from quillgpt.errors import UserError
from quillgpt.tokenizer import CharTokenizer, tokenizer_from_dict
from train import train

# ---- bundles ------------------------------------------------------------------------------------


def write_bundle(root: Path, tasks: list[dict]) -> Path:
    """An eval_bundle directory: tasks are dicts of label, kind, shots, items and optionally delimiter, baseline
    (percent, as DCLM's csv has it) and uri (a path under eval_data/, in a subdirectory as the real ones are)."""
    config = {"icl_tasks": []}
    for t in tasks:
        uri = t.get("uri", f"group/{t['label']}.jsonl")
        entry = {"label": t["label"], "dataset_uri": uri, "num_fewshot": [t["shots"]], "icl_task_type": t["kind"]}
        if "delimiter" in t:
            entry["continuation_delimiter"] = t["delimiter"]
        config["icl_tasks"].append(entry)
        path = root / "eval_data" / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(item) + "\n" for item in t["items"]), encoding="utf-8")
    (root / "core.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    with open(root / "eval_meta_data.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "Random baseline", "Centered Metric?"])
        for t in tasks:
            w.writerow([t["label"], "test", t["kind"], t["shots"], t.get("baseline", 25.0), "True"])
    return root


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mc_items(n: int, seed: int = 0, choices: int = 4) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"query": words(rng, 4), "choices": rng.sample(WORDS, choices), "gold": rng.randrange(choices)}
        for _ in range(n)
    ]


def schema_items(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "context_options": [f"{words(rng, 3)} {w}" for w in rng.sample(WORDS, 2)],
            "continuation": words(rng, 3),
            "gold": rng.randrange(2),
        }
        for _ in range(n)
    ]


def lm_items(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"context": words(rng, 5) + " ", "continuation": " " + rng.choice(WORDS)} for _ in range(n)]


def three_tasks(n: int = 9) -> list[dict]:
    """One task of each type, in tiny Shakespeare's (and word salad's) characters."""
    return [
        {"label": "mc", "kind": "multiple_choice", "shots": 2, "items": mc_items(n), "baseline": 25.0},
        {
            "label": "schema",
            "kind": "schema",
            "shots": 1,
            "items": schema_items(n),
            "baseline": 50.0,
            "delimiter": "\n",
        },
        {"label": "lm", "kind": "language_modeling", "shots": 3, "items": lm_items(n), "baseline": 0.0},
    ]


def char_tokenizer_for(texts: list[str], eot: bool = True) -> CharTokenizer:
    return CharTokenizer(sorted(set("".join(texts))), eot=eot)


TINY_GPT = dict(block_size=128, n_layer=2, n_head=2, n_embd=32)


def random_gpt(vocab_size: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, **TINY_GPT)).eval()


# ---- prompts, few-shot draws, spans -------------------------------------------------------------


def test_prompts_render_as_nanochats_templates_byte_for_byte():
    """Strings written out by hand from nanochat's Jinja templates (render_prompts_mc/_schema/_lm): examples as
    `<context><delimiter><answer>` and a blank line each, then the item; language modelling strips contexts, and
    strips the prompt without the continuation once more (its trailing delimiter space goes)."""
    shots = [{"query": "Q1?", "choices": ["a", "b"], "gold": 1}, {"query": " Q2 ", "choices": ["c", "d "], "gold": 0}]
    item = {"query": "Q3:", "choices": [" x", "y\n", "z"], "gold": 2}
    assert render_prompts("multiple_choice", item, "\nAnswer: ", shots) == [
        "Q1?\nAnswer: b\n\n Q2 \nAnswer: c\n\nQ3:\nAnswer:  x",
        "Q1?\nAnswer: b\n\n Q2 \nAnswer: c\n\nQ3:\nAnswer: y\n",
        "Q1?\nAnswer: b\n\n Q2 \nAnswer: c\n\nQ3:\nAnswer: z",
    ]
    assert render_prompts("multiple_choice", item, " ", []) == ["Q3:  x", "Q3: y\n", "Q3: z"]

    shots = [{"context_options": ["The cup", "The jug"], "continuation": "was full.", "gold": 1}]
    item = {"context_options": ["Tom ran", "Ann ran "], "continuation": "home.", "gold": 0}
    assert render_prompts("schema", item, " ", shots) == [
        "The jug was full.\n\nTom ran home.",
        "The jug was full.\n\nAnn ran  home.",
    ]
    assert render_prompts("schema", {**item, "continuation": 7}, "", []) == [
        "Tom ran7",
        "Ann ran 7",
    ]  # str() of a field

    shots = [{"context": "  Paris is in\t", "continuation": " France"}, {"context": "2+2=", "continuation": "4"}]
    item = {"context": "The sky is  \n", "continuation": " blue"}
    assert render_prompts("language_modeling", item, " ", shots) == [
        "Paris is in  France\n\n2+2= 4\n\nThe sky is",
        "Paris is in  France\n\n2+2= 4\n\nThe sky is  blue",
    ]
    assert render_prompts("language_modeling", item, "\nA: ", []) == ["The sky is\nA:", "The sky is\nA:  blue"]


def test_few_shot_examples_are_nanochats_draws_from_the_1337_shuffle(tmp_path):
    """A task's items in random.Random(1337)'s shuffle of the file, max_per_task the first N of it; item idx's
    examples random.Random(1234 + idx).sample(the other indices, k) of that cut list, never the item itself."""
    items = [{"query": f"question {i}", "choices": [f"yes {i}", f"no {i}"], "gold": i % 2} for i in range(13)]
    bundle = write_bundle(tmp_path, [{"label": "t", "kind": "multiple_choice", "shots": 3, "items": items}])
    (task,) = read_bundle(bundle)
    expected = list(items)
    random.Random(1337).shuffle(expected)
    assert read_items(task, None) == expected and read_items(task, 5) == expected[:5]
    tok = char_tokenizer_for([json.dumps(items), "\n"])
    cut = expected[:8]
    for idx, rows in enumerate(task_rows(task, cut, tok, 1000, range(len(cut)))):
        drawn = random.Random(1234 + idx).sample([i for i in range(8) if i != idx], 3)
        assert fewshot_indices(idx, 8, 3) == drawn and idx not in drawn
        head = "".join(f"{cut[i]['query']} {cut[i]['choices'][cut[i]['gold']]}\n\n" for i in drawn)
        texts = [tok.decode(t[1:]) for t in rows.tokens]  # after <|endoftext|>
        assert texts == [f"{head}{cut[idx]['query']} {c}" for c in cut[idx]["choices"]]
    assert fewshot_indices(4, 8, 0) == []


def test_spans_are_the_common_prefix_suffix_and_the_continuation():
    tok = CharTokenizer(list(" :abcdefghijklmnopqrstuvwxyz"), eot=True)
    eot = tok.eot_id
    assert prefix_ids(tok) == [eot] and prefix_ids(CharTokenizer(list("ab"))) == []
    # multiple choice: the choices' shared first letters are not scored (nanochat's common prefix)
    rows = item_rows("multiple_choice", tok, ["q: cat", "q: cow"], [eot])
    assert rows.tokens[0] == [eot] + tok.encode("q: cat") and (rows.starts, rows.ends) == ([5, 5], [7, 7])
    # schema: the span is the common suffix (" ran"), after contexts of different lengths
    rows = item_rows("schema", tok, ["a dog ran", "the cat ran"], [eot])
    assert (rows.starts, rows.ends) == ([10 - 4, 12 - 4], [10, 12])
    # language modelling: one row, the span after the prompt without the continuation
    rows = item_rows("language_modeling", tok, ["the sky is", "the sky is blue"], [])
    assert rows.tokens == [tok.encode("the sky is blue")] and (rows.starts, rows.ends) == ([10], [15])
    with pytest.raises(UserError, match="does not encode to a prefix"):
        item_rows("language_modeling", tok, ["the sky", "the sky"], [eot], "lm, item 3")


def test_a_long_prompt_keeps_its_last_context_tokens_and_its_span_moves_with_them():
    rows = crop(Rows([list(range(10)), list(range(6))], [6, 3], [10, 6]), 8)
    assert rows.tokens == [list(range(2, 10)), list(range(6))] and (rows.starts, rows.ends) == ([4, 3], [8, 6])
    # a continuation as long as the context: nanochat's span would start at 0, where nothing predicts it
    assert crop(Rows([list(range(10))], [2], [10]), 8).starts == [1]


def test_centring_is_dclms():
    assert centered(0.25, 25.0) == 0.0 and centered(1.0, 62.0) == 1.0
    assert centered(0.5, 25.0) == pytest.approx(1 / 3) and centered(0.1, 0.0) == 0.1
    assert centered(0.2, 50.0) == pytest.approx(-0.6)  # below chance is negative


# ---- scores -------------------------------------------------------------------------------------


class NGramOracle(nn.Module):
    """A "model" that knows the right answers: its logits put (nearly) all mass on the token that follows the last
    K tokens in the truth strings, where those K tokens are followed by one token only (else all logits are 0). The
    truth strings are each item's context and right answer, so it predicts a right continuation and nothing else;
    every prompt, span and pick still goes through core_score."""

    K = 16

    def __init__(self, tokenizer, truths: list[str], block_size: int):
        super().__init__()
        self.config = GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=1, n_embd=8)
        self.anchor = nn.Parameter(torch.zeros(1))  # the device core_score reads
        self.next: dict[tuple, int | None] = {}
        for text in truths:
            ids = tokenizer.encode(text)
            for p in range(self.K, len(ids)):
                key = tuple(ids[p - self.K : p])
                self.next[key] = ids[p] if self.next.get(key, ids[p]) == ids[p] else None

    def forward(self, idx: torch.Tensor):
        B, T = idx.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        rows = idx.tolist()
        for b in range(B):
            for p in range(self.K - 1, T):
                token = self.next.get(tuple(rows[b][p - self.K + 1 : p + 1]))
                if token is not None:
                    logits[b, p, token] = 30.0
        return logits, None


def oracle_bundle(root: Path, n: int, wrong: dict[str, int]) -> tuple[Path, list[str]]:
    """Tasks of every type whose items end in their own id (so that K tokens before an answer name the item: every
    context is at least K tokens long), and the oracle's truth strings: the right answer, except for the first wrong[label] items of a task, where the truth
    is another choice, context or continuation than the item's gold."""
    rng = random.Random(1)
    tasks, truths = [], []
    for label, kind, shots, baseline in (
        ("mc", "multiple_choice", 3, 25.0),
        ("schema", "schema", 2, 50.0),
        ("lm", "language_modeling", 1, 0.0),
    ):
        items = []
        for i in range(n):
            tag = f"{label}{i:03d}"
            flip = i < wrong.get(label, 0)
            if kind == "multiple_choice":
                choices = [f"{c}{rng.choice('xyz')}" for c in rng.sample("abcdefgh", 4)]  # distinct first letters
                item = {"query": f"{words(rng, 2)} {tag}", "choices": choices, "gold": rng.randrange(4)}
                truths.append(f"{item['query']}\nAnswer: {choices[(item['gold'] + flip) % 4]}")
            elif kind == "schema":
                lead = words(rng, 3)  # options of one sentence; distinct last letters: the suffix starts after
                options = [f"{lead} {tag} {w}" for w in ("red", "blue")]
                item = {"context_options": options, "continuation": words(rng, 2), "gold": rng.randrange(2)}
                truths.append(f"{options[(item['gold'] + flip) % 2]} {item['continuation']}")
            else:
                item = {"context": f"{words(rng, 5)} {tag}  ", "continuation": " " + rng.choice(["art", "say", "go"])}
                truth = item["continuation"] if not flip else " zz"
                truths.append(f"{item['context'].strip()} {truth}")
            items.append(item)
        delimiter = "\nAnswer: " if kind == "multiple_choice" else " "
        tasks.append(
            {"label": label, "kind": kind, "shots": shots, "items": items, "baseline": baseline, "delimiter": delimiter}
        )
    return write_bundle(root, tasks), truths


@pytest.mark.parametrize("block_size", [1024, 40])
def test_an_oracle_gets_every_item_of_every_task_type_right_and_core_1(tmp_path, block_size):
    """Through core_score: multiple choice and schema by the lowest mean loss, language modelling by the greedy
    argmax, all right; at block_size 40 the few-shot prompts are cropped to their last 40 tokens on the way."""
    bundle, truths = oracle_bundle(tmp_path, 15, {})
    tok = char_tokenizer_for([p.read_text() for p in (bundle / "eval_data").rglob("*.jsonl")] + truths + ["\n:"])
    result = core_score(NGramOracle(tok, truths, block_size), tok, bundle)
    assert {label: t["accuracy"] for label, t in result["tasks"].items()} == {"mc": 1.0, "schema": 1.0, "lm": 1.0}
    assert result["core"] == 1.0 and result["prefix"].startswith("<|endoftext|>")
    assert all(t["items"] == 15 and len(t["sha256"]) == 64 for t in result["tasks"].values())


def test_accuracies_centred_scores_and_core_follow_from_the_items_right(tmp_path):
    """The oracle is wrong on a known number of items of each task (its truth is not the gold): each accuracy is
    exactly right/n, each centred score DCLM's formula of it, CORE their mean; max_per_task scores the first N of
    the shuffle only."""
    n = 20
    wrong = {"mc": 5, "schema": 8, "lm": 3}
    bundle, truths = oracle_bundle(tmp_path, n, wrong)
    tok = char_tokenizer_for([p.read_text() for p in (bundle / "eval_data").rglob("*.jsonl")] + truths + ["\n:"])
    oracle = NGramOracle(tok, truths, 1024)
    result = core_score(oracle, tok, bundle)
    baselines = {"mc": 25.0, "schema": 50.0, "lm": 0.0}
    for label, t in result["tasks"].items():
        acc = (n - wrong[label]) / n
        assert t["accuracy"] == pytest.approx(acc, abs=1e-7)
        assert t["centered"] == pytest.approx((acc - 0.01 * baselines[label]) / (1 - 0.01 * baselines[label]))
    assert result["core"] == pytest.approx(sum(t["centered"] for t in result["tasks"].values()) / 3)
    assert result["core"] == pytest.approx(((15 / 20 - 0.25) / 0.75 + (12 / 20 - 0.5) / 0.5 + 17 / 20) / 3)

    cut = core_score(oracle, tok, bundle, max_per_task=6)
    for label, t in cut["tasks"].items():
        (task,) = [x for x in read_bundle(bundle) if x.label == label]
        first = read_items(task, 6)  # the wrong ones are the file's first items: where did the shuffle put them?
        items = [json.loads(line) for line in task.path.read_text().splitlines()]
        right = sum(items.index(item) >= wrong[label] for item in first)
        assert t["items"] == 6 and t["accuracy"] == pytest.approx(right / 6, abs=1e-7)
    assert cut["max_per_task"] == 6


def test_a_random_gpt_scores_about_chance_on_four_choices(tmp_path):
    """400 items of 4 choices, the gold at random: a random-init GPT picks the gold about a quarter of the time, and
    its centred score is near 0 (the band is 3.5 standard deviations of a binomial either side)."""
    items = mc_items(400, seed=3)
    bundle = write_bundle(tmp_path, [{"label": "mc4", "kind": "multiple_choice", "shots": 0, "items": items}])
    tok = char_tokenizer_for([(bundle / "eval_data" / "group" / "mc4.jsonl").read_text()])
    result = core_score(random_gpt(tok.vocab_size), tok, bundle)
    acc = result["tasks"]["mc4"]["accuracy"]
    assert 0.25 - 0.076 < acc < 0.25 + 0.076, acc
    assert abs(result["core"]) < 0.11


def test_a_char_model_needs_map_unknown_for_characters_it_lacks(tmp_path):
    items = lm_items(3) + [{"context": "a café", "continuation": " ω"}]
    bundle = write_bundle(tmp_path, [{"label": "t", "kind": "language_modeling", "shots": 0, "items": items}])
    tok = char_tokenizer_for([" ".join(WORDS)])
    model = random_gpt(tok.vocab_size)
    with pytest.raises(UserError, match=r"CORE task t has 2 characters .*\('éω'\): pass --map-unknown .* as ' '"):
        core_score(model, tok, bundle)
    result = core_score(model, tok, bundle, map_unknown=True)
    assert (
        result["tasks"]["t"]["items"] == 4
        and "2 unknown characters ('éω') scored as ' '" in result["tasks"]["t"]["note"]
    )


DDP_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {repo!r})
from quillgpt import distributed as du
from model import GPT, GPTConfig
from quillgpt.core_eval import core_score
from quillgpt.tokenizer import CharTokenizer
info = du.from_env()
du.init_process_group(info, torch.device("cpu"), None, 60)
tok = CharTokenizer(sorted(set("".join(open(p).read() for p in sys.argv[2:]))), eot=True)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=tok.vocab_size, **{tiny!r})).eval()
result = core_score(model, tok, sys.argv[1], 13, "cpu", info.rank, info.world_size)
print("RESULT", json.dumps({{k: t["accuracy"] for k, t in result["tasks"].items()}}), result["core"])
du.shutdown()
"""


@pytest.mark.slow
def test_two_gloo_ranks_score_what_one_process_does(tmp_path):
    """torchrun, 2 ranks: each scores every other item and the right/wrong vectors are summed, so both ranks report
    the one process's accuracies and CORE (13 items a task: the ranks' shares differ in size)."""
    bundle = write_bundle(tmp_path / "bundle", three_tasks(n=17))
    files = [str(p) for p in sorted((bundle / "eval_data").rglob("*.jsonl"))]
    script = tmp_path / "ddp_core.py"
    script.write_text(DDP_SCRIPT.format(repo=str(REPO_ROOT), tiny=TINY_GPT))
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(bundle),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = char_tokenizer_for([open(p).read() for p in files])
    one = core_score(random_gpt(tok.vocab_size), tok, bundle, 13, "cpu")
    expected = f"RESULT {json.dumps({k: t['accuracy'] for k, t in one['tasks'].items()})} {one['core']}"
    assert [line for line in proc.stdout.splitlines() if line.startswith("RESULT")] == [expected, expected]


# ---- the bundle: found, downloaded, malformed ---------------------------------------------------


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output, not a line a request
        pass


def serve_directory(directory: Path):
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_bundle_downloads_once_checked_and_unpacks_whole(tmp_path, monkeypatch):
    """nanochat's zip (eval_bundle/ inside) from a local server: unpacked into data/eval_bundle with its sha256
    recorded; with QUILLGPT_EVAL_BUNDLE_SHA256 set to another hash, refused and nothing left behind."""
    import hashlib

    source = write_bundle(tmp_path / "src" / "eval_bundle", three_tasks())
    (tmp_path / "site").mkdir()
    with zipfile.ZipFile(tmp_path / "site" / "eval_bundle.zip", "w") as z:
        for p in sorted(source.rglob("*")):
            z.write(p, p.relative_to(source.parent))
    digest = hashlib.sha256((tmp_path / "site" / "eval_bundle.zip").read_bytes()).hexdigest()
    server = serve_directory(tmp_path / "site")
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", core_eval.BUNDLE_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(core_eval, "EVAL_BUNDLE_URL", f"http://127.0.0.1:{server.server_port}/eval_bundle.zip")
    try:
        (tmp_path / "a").mkdir()
        monkeypatch.chdir(tmp_path / "a")
        monkeypatch.setenv(core_eval.BUNDLE_SHA256_ENV, "0" * 64)
        with pytest.raises(UserError, match=f"has sha256 {digest}, not QUILLGPT_EVAL_BUNDLE_SHA256's 0000"):
            find_bundle(None)
        assert list((tmp_path / "a" / "data").iterdir()) == []  # the temporary directory went with it
        monkeypatch.setenv(core_eval.BUNDLE_SHA256_ENV, digest)
        assert find_bundle(None) == Path("data/eval_bundle")
    finally:
        server.shutdown()
    placed = tmp_path / "a" / "data" / "eval_bundle"
    assert json.loads((placed / "DOWNLOADED.json").read_text())["sha256"] == digest
    assert [t.label for t in read_bundle(placed)] == ["mc", "schema", "lm"] and find_bundle(None) == Path(
        "data/eval_bundle"
    )
    assert sorted(p.name for p in (tmp_path / "a" / "data").iterdir()) == ["eval_bundle"]


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("bad_yaml", "core.yaml is unreadable or not YAML"),
        ("no_csv_row", "eval_meta_data.csv has no row for task schema"),
        ("no_data", "its data"),
        ("bad_type", "icl_task_type 'generation' is none of"),
        ("bad_gold", "mc.jsonl:2: 'gold' must be an index into its 4 choices"),
        ("no_field", "lm.jsonl:1: a language_modeling item needs context, continuation; it lacks continuation"),
        ("few_items", "--max-per-task 2 leaves too few items for the few-shot examples of mc, lm: give at least 4"),
    ],
)
def test_a_malformed_bundle_is_a_user_error_naming_the_place(tmp_path, case, fragment):
    bundle = write_bundle(tmp_path, three_tasks())
    if case == "bad_yaml":
        (bundle / "core.yaml").write_text("icl_tasks:\n- label: mc\n  num_fewshot: [2\n")
    elif case == "no_csv_row":
        rows = (bundle / "eval_meta_data.csv").read_text().splitlines()
        (bundle / "eval_meta_data.csv").write_text("\n".join(r for r in rows if not r.startswith("schema")) + "\n")
    elif case == "no_data":
        (bundle / "eval_data" / "group" / "lm.jsonl").unlink()
    elif case == "bad_type":
        text = (bundle / "core.yaml").read_text()
        (bundle / "core.yaml").write_text(text.replace("icl_task_type: schema", "icl_task_type: generation"))
    elif case == "bad_gold":
        path = bundle / "eval_data" / "group" / "mc.jsonl"
        lines = path.read_text().splitlines()
        path.write_text("\n".join([lines[0], json.dumps({**json.loads(lines[1]), "gold": 4}), *lines[2:]]) + "\n")
    elif case == "no_field":
        (bundle / "eval_data" / "group" / "lm.jsonl").write_text('{"context": "a"}\n')
    tok = char_tokenizer_for([p.read_text() for p in (bundle / "eval_data").rglob("*.jsonl")] + ["\n"])
    with pytest.raises(UserError) as e:
        core_score(random_gpt(tok.vocab_size), tok, bundle, 2 if case == "few_items" else None)
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---- eval.py --core -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def char_ckpt(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("core_run")
    train(None, overrides=tiny_overrides(tiny_data, out, **{"training.max_iters": 2, "training.eval_interval": 2}))
    return out / "t"


def run_eval(*args: str, cwd: Path = REPO_ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "eval.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_core_prints_the_table_and_writes_every_figure(char_ckpt, tmp_path):
    bundle = write_bundle(tmp_path / "bundle", three_tasks(n=12))
    proc = run_eval(
        "--ckpt", str(char_ckpt), "--core", str(bundle), "--max-per-task", "6", "--json", str(tmp_path / "r.json")
    )
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| CORE task | type | shots | items | accuracy | centered |" and len(table) == 5
    assert "CORE " in proc.stdout and "at most 6 a task" in proc.stdout and "| text |" not in proc.stdout
    core = json.loads((tmp_path / "r.json").read_text())["core"]
    assert [t["items"] for t in core["tasks"].values()] == [6, 6, 6] and core["max_per_task"] == 6
    assert core["core"] == pytest.approx(sum(t["centered"] for t in core["tasks"].values()) / 3)
    assert (
        core["bundle"] == str(bundle) and core["prefix"] == "none"
    )  # the tiny char dataset is one text: no <|endoftext|>


def test_eval_core_offline_without_a_bundle_is_one_line_naming_the_ways_to_give_one(char_ckpt, tmp_path):
    """No data/eval_bundle where it runs, no QUILLGPT_EVAL_BUNDLE, and the download's proxy refuses at once."""
    env = {k: v for k, v in os.environ.items() if k not in (core_eval.BUNDLE_ENV, "no_proxy", "NO_PROXY")}
    env.update(https_proxy="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    proc = run_eval("--ckpt", str(char_ckpt), "--core", cwd=tmp_path, env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        "cannot download nanochat's CORE bundle" in errors[0] and "--core DIR or QUILLGPT_EVAL_BUNDLE=DIR" in errors[0]
    )
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("case", ["bad_yaml", "no_csv_row"])
def test_eval_core_with_a_malformed_bundle_is_one_line_and_exit_2(char_ckpt, tmp_path, case):
    bundle = write_bundle(tmp_path, three_tasks())
    if case == "bad_yaml":
        (bundle / "core.yaml").write_text("icl_tasks: [\n")
    else:
        (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,25\nlm,0\n")
    proc = run_eval("--ckpt", str(char_ckpt), "--core", str(bundle))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("not YAML" if case == "bad_yaml" else "has no row for task schema") in errors[0]


def test_core_during_training_is_logged_at_its_evaluations_and_drawn(tiny_data, tmp_path):
    """eval.core_every: a real run scores CORE on the bundle at every second evaluation and the last, each figure
    what core_score gives the checkpoint saved there; it is in train_log.json and the curve's PNG; a run whose bundle
    is missing stops before its first step, in one line."""
    bundle = write_bundle(tmp_path / "bundle", three_tasks(n=8))
    common = {
        "training.max_iters": 6,
        "training.eval_interval": 2,
        "eval.core_every": 4,
        "eval.core_max_per_task": 5,
        "eval.core_bundle": str(bundle),
    }
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **common, **{"logging.plot": True}))
    history = json.loads((tmp_path / "t" / "train_log.json").read_text())["history"]
    scored = {p["iter"]: p for p in history if p["kind"] == "eval" and "core" in p}
    assert sorted(scored) == [4, 6]  # every 4 steps (not before the first) and the last
    assert set(scored[6]) >= {"core", "core_mc", "core_schema", "core_lm"}
    ckpt = load_checkpoint(tmp_path / "t" / "ckpt_last.pt")
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    assert core_score(model, tokenizer, bundle, 5)["core"] == pytest.approx(scored[6]["core"], abs=1e-6)
    assert (tmp_path / "t" / "loss_curve.png").stat().st_size > 0
    with pytest.raises(UserError, match="not a CORE bundle"):
        train(
            None, overrides=tiny_overrides(tiny_data, tmp_path / "b", **{**common, "eval.core_bundle": str(tmp_path)})
        )
    assert not (tmp_path / "b" / "t" / "ckpt_last.pt").exists()
