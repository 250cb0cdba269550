"""eval.py and scoring.py: bits per byte and HellaSwag checked against transformers' own computation on a tiny random
GPT-2, the lm-evaluation-harness adapter through the real harness on a local task, the command line, bad input,
and the evaluations during training (bits per byte, HellaSwag, best checkpoint by either)."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, gpt2_encoding_error, needs_gpt2_encoding, save_hf_gpt2, tiny_overrides  # noqa: F401

from quillgpt import scoring
from quillgpt.checkpoint import load_checkpoint
from quillgpt.engine import generate
from quillgpt.loading import load_model
from quillgpt.scoring import (
    continuation_logprobs,
    document_streams,
    hellaswag_pairs,
    load_hellaswag,
    rows_per_pass,
    score_hellaswag,
    score_text,
    windows,
)
from quillgpt.tokenizer import get_tiktoken
from train import train

SUBJECTS = ["A man", "The woman", "A child", "Two dogs", "The chef", "A student"]
ACTIONS = [
    "is sitting on a roof.",
    "walks into the kitchen.",
    "opens the old door.",
    "throws a red ball.",
    "reads a long letter.",
    "paints the fence white.",
]
ENDINGS = [
    "he starts pulling up roofing.",
    "she picks up a knife and cuts the bread.",
    "they run across the field.",
    "it falls into the water with a splash.",
    "he puts the book back on the shelf.",
    "she smiles and waves.",
]


def write_hellaswag(path: Path, n: int = 36, seed: int = 0) -> Path:
    """n items in HellaSwag's own format (rowanz/hellaswag's jsonl fields)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.choice(SUBJECTS), rng.choice(ACTIONS)
            item = {
                "ind": i,
                "activity_label": "Everyday life",
                "ctx_a": f"{a} {b}",
                "ctx_b": "then",
                "ctx": f"{a} {b} then",
                "split": "val",
                "split_type": "indomain",
                "label": rng.randrange(4),
                "endings": rng.sample(ENDINGS, 4),
                "source_id": f"synthetic~{i}",
            }
            f.write(json.dumps(item) + "\n")
    return path


@pytest.fixture(scope="module")
def gpt2_dir(transformers, tmp_path_factory):
    """A tiny random GPT-2 with GPT-2's vocabulary, saved by transformers."""
    if gpt2_encoding_error() is not None:
        pytest.skip(gpt2_encoding_error())
    directory = tmp_path_factory.mktemp("hf_gpt2_eval")
    return directory, save_hf_gpt2(transformers, directory, vocab_size=50257, n_positions=128, n_embd=48)


def hf_token_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from transformers' model."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@needs_gpt2_encoding
def test_hellaswag_and_bits_per_byte_equal_a_straightforward_transformers_computation(gpt2_dir, tmp_path):
    """Our scorer on the model imported from a save_pretrained directory, against transformers' own forward pass:
    every ending's log-probability to 1e-4, the same acc and acc_norm, and bits per byte equal to transformers'
    summed token losses / ln 2 / UTF-8 bytes."""
    directory, hf = gpt2_dir
    model, tok = load_model(directory).model.eval(), get_tiktoken("gpt2")
    items = load_hellaswag(write_hellaswag(tmp_path / "hs.jsonl"))
    ours = score_hellaswag(model, tok, items)
    right = right_norm = 0
    for item, logprobs in zip(items, ours.logprobs):
        theirs = []
        for ctx, ending in hellaswag_pairs(tok, item):
            theirs.append((float(hf_token_logprobs(hf, ctx + ending)[-len(ending) :].sum()), len(ending)))
        assert max(abs(a - b) for a, (b, _) in zip(logprobs, theirs)) < 1e-4
        right += int(np.argmax([lp for lp, _ in theirs])) == item.label
        right_norm += int(np.argmax([lp / n for lp, n in theirs])) == item.label
    assert (ours.acc, ours.acc_norm) == (right / len(items), right_norm / len(items))
    print(f"\nHellaSwag fixture: acc {ours.acc:.4f}, acc_norm {ours.acc_norm:.4f} on {len(items)} items")

    text = "Bits per byte rank models across tokenizers: naïve café, 日本語, and 42 more words."
    streams = document_streams(tok, [text])
    score = score_text(model, streams, tok.token_bytes(), stride=64)
    nats = -float(hf_token_logprobs(hf, [tok.eot_id] + tok.encode(text)).sum())
    assert score.bytes == len(text.encode()) and score.tokens == len(tok.encode(text))
    assert score.bpb == pytest.approx(nats / math.log(2) / len(text.encode()), abs=1e-4)
    print(f"bits per byte: ours {score.bpb:.6f}, transformers {nats / math.log(2) / len(text.encode()):.6f}")


def test_windows_score_every_target_once_with_enough_context():
    for n, block, stride in ((2, 8, 4), (9, 8, 4), (100, 8, 3), (100, 8, 8), (1000, 64, 32)):
        scored = []
        for start, end, first in windows(n, block, stride):
            assert end - start <= block and first > start and first - 1 - start >= min(block - stride, first - 1)
            scored += range(first, end + 1)
        assert scored == list(range(1, n))


def test_char_model_bits_per_byte_is_its_loss_over_ln2_on_ascii(tiny_data, tmp_path):
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 4}))
    loaded = load_model(tmp_path / "t")
    from quillgpt.tokenizer import tokenizer_from_dict

    tok = tokenizer_from_dict(loaded.tokenizer)
    text = (tiny_data / "tiny.txt").read_text()[:300]  # the training text: every character is in the vocabulary
    assert text.isascii()
    score = score_text(loaded.model, document_streams(tok, [text]), tok.token_bytes(), stride=16)
    assert score.tokens == score.bytes == len(text) - 1  # no <|endoftext|> to put first: the first char is context
    assert score.bpb == pytest.approx(score.loss / math.log(2))


def test_scoring_reads_the_device_once_a_pass_and_never_the_vocabulary_wide_log_probabilities(monkeypatch):
    """On a GPU a read back to the host waits for the device: bits per byte keeps its sums on the device and reads
    them once at the end, however many passes it makes; continuation log-probabilities read one (2, rows, T) tensor a
    pass (each target's log-probability and whether it is the argmax), never the (rows, T, V) log-probabilities.
    Reads counted on the CPU (tests/test_decoding.py's HostReads), the figures unchanged by the pass size."""
    from test_decoding import HostReads

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).eval()
    streams = [np.random.default_rng(0).integers(0, 50, 300)]
    token_bytes = np.ones(50, dtype=np.int64)
    whole = score_text(model, streams, token_bytes, stride=16)  # every window in one pass
    monkeypatch.setattr(scoring, "LOGITS_BUDGET", 2 * 32 * 50)  # two windows a pass
    mode = HostReads()
    with mode:
        score = score_text(model, streams, token_bytes, stride=16)
    assert len(windows(300, 32, 16)) > 8 and rows_per_pass(model, torch.device("cpu")) == 2
    assert [name for name, _ in mode.reads] == ["__int__", "__float__", "__int__", "__int__"]  # at the end, once
    assert (score.tokens, score.bytes) == (whole.tokens, whole.bytes) == (299, 299)
    assert score.nats == pytest.approx(whole.nats, rel=1e-6)

    pairs = [(list(range(i, i + 10)), list(range(20, 20 + i % 4 + 1))) for i in range(8)]
    with HostReads() as mode:
        scored = continuation_logprobs(model, pairs, rows=2)
    device_reads = [numel for name, numel in mode.reads if name == "cpu"]
    assert device_reads == [2 * 2 * 11, 2 * 2 * 13] * 2  # (2, rows, T): 4 passes of 2 rows, 11 or 13 inputs wide
    assert all(numel <= 2 * 2 * 13 for _, numel in mode.reads)  # nothing vocabulary-wide
    once = continuation_logprobs(model, pairs, rows=8)
    assert [(c.tokens, c.greedy) for c in scored] == [(c.tokens, c.greedy) for c in once]
    assert [c.logprob for c in scored] == pytest.approx([c.logprob for c in once], abs=1e-5)


def test_a_gpu_scores_many_gpt2_windows_a_pass_where_the_cpu_budget_allows_one(monkeypatch):
    """The CPU's budget is sized for its caches: one 1,024-token window of GPT-2's vocabulary a pass. On a CUDA device
    the windows a pass are as many as fit in an eighth of its free memory, logits and activations counted."""
    from model import GPT

    model = GPT.__new__(GPT)  # only the config is read
    model.config = type("Config", (), {"block_size": 1024, "vocab_size": 50304, "n_embd": 768})()
    assert rows_per_pass(model, torch.device("cpu")) == 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))  # an idle 80 GB GPU
    rows = rows_per_pass(model, torch.device("cuda"))
    assert rows == 80 * 2**30 // 8 // 4 // (1024 * (50304 + 16 * 768)) and rows > 30


@needs_gpt2_encoding
def test_harness_adapter_runs_a_local_task_and_equals_our_scorer(gpt2_dir, tmp_path):
    """The real lm-evaluation-harness on a task of our own (a YAML over a local jsonl): its acc is ours, and the
    adapter's loglikelihood equals our scorer's per-ending log-probabilities."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from quillgpt.lm_harness import QuillLM, run_tasks

    directory, _ = gpt2_dir
    model, tok = load_model(directory).model.eval(), get_tiktoken("gpt2")
    hs = write_hellaswag(tmp_path / "hs.jsonl", n=24, seed=1)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text(
        "task: local_hellaswag\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    validation: {hs}\noutput_type: multiple_choice\nvalidation_split: validation\n"
        'doc_to_text: "{{ctx}}"\ndoc_to_target: "{{label}}"\ndoc_to_choice: "{{endings}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    items = load_hellaswag(hs)
    ours = score_hellaswag(model, tok, items)
    results = run_tasks(model, tok, ["local_hellaswag"], str(tmp_path / "tasks"), None, None)
    assert results["local_hellaswag"]["acc"] == pytest.approx(ours.acc)
    lm = QuillLM(model, tok)
    requests = [
        Instance("loglikelihood", {}, (item.context, " " + ending), i)
        for i, item in enumerate(items)
        for ending in item.endings
    ]
    adapter = [lp for lp, _ in lm.loglikelihood(requests)]
    assert adapter == pytest.approx([lp for row in ours.logprobs for lp in row], abs=1e-4)  # batched differently
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("A man walks in.",), 0)])[0]
    direct = continuation_logprobs(model, [([tok.eot_id], tok.encode("A man walks in."))])[0].logprob
    assert rolling == pytest.approx(direct, abs=1e-6)
    text = lm.generate_until([Instance("generate_until", {}, ("A man", {"until": ["."], "max_gen_toks": 12}), 0)])[0]
    greedy = generate(model, torch.tensor([tok.encode("A man")]), 12, temperature=0)[0, len(tok.encode("A man")) :]
    assert text == tok.decode(greedy.tolist()).split(".")[0]


# ---- the command line ---------------------------------------------------------------------------


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "eval.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def char_run(tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("char_run")
    train(None, overrides=tiny_overrides(tiny_data, out, **{"training.max_iters": 30, "training.eval_interval": 30}))
    return out / "t"


@pytest.mark.slow
def test_eval_cli_reports_bits_per_byte_first_and_writes_every_figure(char_run, tiny_data, tmp_path):
    text = tmp_path / "sample.txt"
    text.write_text((tiny_data / "tiny.txt").read_text()[:3000] + "Ω")  # a character the model has never seen
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": line}) + "\n" for line in text.read_text().split("\n\n") if line))
    hs = write_hellaswag(tmp_path / "hs.jsonl", n=8)
    proc = run_eval(
        "--ckpt",
        str(char_run),
        "--split",
        "val",
        "--text",
        str(text),
        str(docs),
        "--hellaswag",
        str(hs),
        "--map-unknown",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert proc.returncode == 0, proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| text | bits per byte |") and len(table) == 5  # header, rule, 3 texts
    report = json.loads((tmp_path / "r.json").read_text())
    assert [t["name"] for t in report["text"]] == ["sample.txt", "docs.jsonl", f"val split of {tiny_data / 'tiny'}"]
    assert all(len(t["sha256"]) == 64 and t["bpb"] > 0 and t["tokens"] > 0 for t in report["text"])
    assert report["checkpoint"] == str(char_run / "ckpt_best.pt") and len(report["checkpoint_sha256"]) == 64
    assert report["hellaswag"]["items"] == 8 and 0 <= report["hellaswag"]["acc_norm"] <= 1
    assert "unknown characters ('Ω')" in report["text"][0]["note"] and report["settings"]["stride"] == 16
    val_tokens = json.loads((tiny_data / "tiny" / "meta.json").read_text())["val_tokens"]
    assert report["text"][2]["tokens"] == val_tokens - 1  # no <|endoftext|>: the split's first token is context


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, make, fragments",
    [
        (
            "hellaswag_field",
            lambda p, _: p.write_text('{"ctx": "a", "endings": ["x", "y"], "label": 0}\n'),
            ["hs.jsonl:1: field 'endings' must be a list of 4 non-empty strings"],
        ),
        (
            "hellaswag_json",
            lambda p, _: p.write_text('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 1}\nnot json\n'),
            ["hs.jsonl:2: not a JSON object"],
        ),
        ("short_text", lambda p, corpus: p.write_text(corpus[0]), ["shorter than 2 tokens"]),  # a known character
        (
            "unseen_chars",
            lambda p, _: p.write_text("Ωμέγα and ∑ are not in tiny Shakespeare"),
            ["characters the model's char vocabulary lacks", "--map-unknown"],
        ),
        ("unknown_task", None, ["lm-evaluation-harness: ", "no_such_task"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(char_run, tiny_data, tmp_path, case, make, fragments):
    path = tmp_path / ("hs.jsonl" if case.startswith("hellaswag") else "text.txt")
    if make is not None:
        make(path, (tiny_data / "tiny.txt").read_text())  # the text char_run trained on
    args = {
        "hellaswag_field": ["--hellaswag", str(path)],
        "hellaswag_json": ["--hellaswag", str(path)],
        "short_text": ["--text", str(path)],
        "unseen_chars": ["--text", str(path)],
        "unknown_task": ["--tasks", "no_such_task"],
    }[case]
    if case == "unknown_task":
        pytest.importorskip("lm_eval")
    proc = run_eval("--ckpt", str(char_run), *args)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_offline_hellaswag_without_a_file_names_the_option(char_run, tmp_path, monkeypatch):
    """No network here: the download fails at once with the way out."""
    from quillgpt import evaluate as evaluation
    from quillgpt.errors import UserError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(evaluation, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")
    with pytest.raises(UserError, match="cannot download HellaSwag .*--hellaswag FILE"):
        evaluation.hellaswag_file(None)
    assert not (tmp_path / "data").exists()


# ---- during training ------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["hellaswag", "bpb"])
def test_training_logs_bits_per_byte_and_hellaswag_and_keeps_the_best_by_either(tiny_data, tmp_path, metric):
    """Every evaluation logs val bits per byte and HellaSwag; ckpt_best.pt is the evaluation that last improved
    training.best_metric (HellaSwag's acc_norm, higher is better; bits per byte, lower is better)."""
    hs = write_hellaswag(tmp_path / "hs.jsonl", n=16)
    result = train(
        None,
        overrides=tiny_overrides(
            tiny_data,
            tmp_path,
            **{
                "training.max_iters": 40,
                "training.eval_interval": 10,
                "model.block_size": 64,
                "eval.hellaswag": str(hs),
                "eval.hellaswag_limit": 12,
                "eval.map_unknown": True,
                "training.best_metric": metric,
                "logging.plot": metric == "bpb",
            },
        ),
    )
    run = tmp_path / "t"
    evals = [p for p in json.loads((run / "train_log.json").read_text())["history"] if p["kind"] == "eval"]
    assert [p["iter"] for p in evals] == [0, 10, 20, 30, 40]
    assert all(0 < p["val_bpb"] < 8 and 0 <= p["hellaswag_acc_norm"] <= 1 for p in evals)
    score = {"hellaswag": lambda p: -p["hellaswag_acc_norm"], "bpb": lambda p: p["val_bpb"]}[metric]
    best, best_iter = score(evals[0]), None
    for p in evals[1:]:
        if score(p) < best:
            best, best_iter = score(p), p["iter"]
    if best_iter is None:
        assert not (run / "ckpt_best.pt").exists()
    else:
        ckpt = load_checkpoint(run / "ckpt_best.pt")
        assert ckpt["iter_num"] == best_iter and ckpt["best_score"] == pytest.approx(best)
    assert metric == "hellaswag" or best_iter == 40  # bits per byte falls at every evaluation of this run
    assert result.best_val_loss == min(p["val_loss"] for p in evals)
    if metric == "bpb":
        import matplotlib.image

        assert matplotlib.image.imread(run / "loss_curve.png").shape[1] > 1000  # a second panel: the evaluations


def test_best_metric_hellaswag_needs_the_file():
    from quillgpt.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="best_metric = 'hellaswag' needs eval.hellaswag"):
        build_config(None, {"training.best_metric": "hellaswag"})
