"""Score a model where runs are compared: bits per byte on text, HellaSwag, lm-evaluation-harness tasks, and the
accuracy of its answers on the synthetic chat tasks. eval.py is the command line over `evaluate(EvalRequest)`; how
each figure is
computed: scoring.py (bits per byte, HellaSwag), core_eval.py (DCLM's CORE, as nanochat computes it), lm_harness.py
(lm-evaluation-harness), run_chat_tasks below (chat
tasks, quillgpt/tasks.py), chat_eval.py (nanochat's chat evaluations: ARC, MMLU, GSM8K, HumanEval)."""

from __future__ import annotations

import hashlib
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from model import GPT
from quillgpt import corpus, tasks
from quillgpt.checkpoint import load_checkpoint
from quillgpt.data import check_vocab_compatible, load_dataset
from quillgpt.errors import UserError
from quillgpt.files import atomic_write, sha256_file
from quillgpt.generate import generate_texts, pick_device
from quillgpt.loading import load_model
from quillgpt.machine import keep_freed_memory
from quillgpt.precision import autocast as precision_autocast
from quillgpt.precision import inference_precision
from quillgpt.replies import chat_answers
from quillgpt.scoring import TextScore, document_streams, hellaswag_items, map_unknown, score_hellaswag, score_text
from quillgpt.tokenizer import Tokenizer, tokenizer_from_dict, tokenizer_label

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# git's blob id of data/hellaswag_val.jsonl in rowanz/hellaswag: SHA-1 of "blob <size>\0" + the file's bytes
HELLASWAG_BLOB_SHA1 = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
HELLASWAG_PATH = Path("data") / "hellaswag" / "hellaswag_val.jsonl"
DEFAULT_CONTEXT = 2048
ANSWER_TOKENS = 32  # a chat task's answer is a few characters: a reply longer than this is wrong anyway
FEW_SHOT = 3  # a base model's examples of the answer's form, fewer when they would not fit its context


# ---- what to score ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalRequest:
    """What to score and how: eval.py's flags, checked there (docs/evaluation.md)."""

    ckpt: str  # a checkpoint, run directory, .safetensors file, or Hugging Face directory or hub name
    text: tuple[str, ...] = ()  # text files, .jsonl/.parquet documents or directories
    text_field: str = "text"
    split: str | None = None  # "train" or "val" of a prepared dataset
    data: str | None = None  # that dataset's directory (None: the checkpoint's own)
    context: int = DEFAULT_CONTEXT  # at most this many tokens of context a window
    stride: int | None = None  # tokens a window moves on (None: half the context)
    hellaswag: str | None = None  # HellaSwag's validation jsonl ("": downloaded once); None: not asked
    core: str | None = None  # nanochat's CORE bundle directory ("": found or downloaded once); None: not asked
    tasks: tuple[str, ...] = ()  # lm-evaluation-harness tasks
    task_dir: str | None = None
    apply_chat_template: bool = False
    num_fewshot: int | None = None
    limit: int | None = None  # HellaSwag items and harness documents
    chat_tasks: tuple[str, ...] = ()  # synthetic chat tasks to answer and grade
    chat_items: int = 100
    chat_eval: tuple[str, ...] = ()  # nanochat's chat evaluations (quillgpt/chat_eval.py): arc_easy, ..., humaneval
    eval_data: str | None = None  # their files' directory (None: the hub's, downloaded once)
    max_per_task: int | None = None  # items of each task scored (None: all)
    max_new_tokens: int = 512  # a generated chat_eval reply's tokens at most (nanochat's default)
    map_unknown: bool = False
    device: str = "auto"  # as generate.pick_device takes it: auto is cuda, else mps, else cpu
    precision: str = "auto"


def text_documents(paths: list[str], text_field: str) -> list[tuple[str, list[str]]]:
    """(path, its documents) for each --text input: read as prepare.py reads its inputs."""
    out = []
    for path in paths:
        for source in corpus.local_sources([path], None):
            how = corpus.Reading(text_field)
            docs = [d for chunk in corpus.chunks_of(source, how, corpus.Budget(None)) for d in corpus.read(chunk).texts]
            out.append((source.path, docs))
    return out


def split_stream(data_dir: Path, split: str, model: GPT, tokenizer: dict | None, source: str) -> np.ndarray:
    """A prepared split's tokens, checked against the model's tokenizer and vocabulary."""
    dataset = load_dataset(data_dir)
    check_vocab_compatible(model.config.vocab_size, tokenizer, dataset, source)
    return np.memmap(dataset.path(split), dtype=dataset.dtype, mode="r").astype(np.int64)


def checkpoint_dataset(ckpt_file: str) -> Path | None:
    """The prepared dataset a checkpoint was trained on (its config's data section), if it records one."""
    if not ckpt_file.endswith(".pt"):
        return None
    data = load_checkpoint(ckpt_file).get("config", {}).get("data", {})
    if not isinstance(data, dict):
        return None
    if data.get("processed_dir"):
        return Path(data["processed_dir"])
    return Path(data.get("data_dir", "data")) / str(data.get("dataset", ""))


def hellaswag_file(given: str | None) -> Path:
    """--hellaswag FILE, or (no FILE) HellaSwag's validation set, downloaded once into data/hellaswag/."""
    if given:
        return Path(given)
    if HELLASWAG_PATH.is_file():
        return HELLASWAG_PATH
    try:
        with urllib.request.urlopen(HELLASWAG_URL, timeout=20) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        raise UserError(
            f"cannot download HellaSwag ({getattr(e, 'reason', e)}): offline, give its validation file "
            "with --hellaswag FILE (hellaswag_val.jsonl from github.com/rowanz/hellaswag)"
        ) from None
    blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
    if blob != HELLASWAG_BLOB_SHA1:
        raise UserError(
            f"the downloaded HellaSwag file is not rowanz/hellaswag's (git blob {blob}, expected "
            f"{HELLASWAG_BLOB_SHA1}): give a copy with --hellaswag FILE"
        )
    with atomic_write(HELLASWAG_PATH) as f:
        f.write(data)
    return HELLASWAG_PATH


# ---- running it ---------------------------------------------------------------------------------


def evaluate(req: EvalRequest) -> dict:
    """Every figure the request asks for, in one report (print_report prints it, eval.py --json writes it)."""
    core_bundle = None
    if req.core is not None:  # a missing or malformed bundle is a line at once, before a model loads
        from quillgpt.core_eval import find_bundle, read_bundle

        core_bundle = find_bundle(req.core)
        read_bundle(core_bundle)
    chat_eval_tasks = None
    if req.chat_eval:  # their data too: read and checked (or downloaded) before a model loads
        from quillgpt.chat_eval import load_tasks

        chat_eval_tasks = load_tasks(list(req.chat_eval), req.eval_data, req.max_per_task)
    loaded = load_model(req.ckpt)
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.source} records no tokenizer, so no text can be encoded for it")
    tokenizer = tokenizer_from_dict(loaded.tokenizer)
    model = loaded.model
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"{loaded.source} has {model.config.vocab_size} token ids, fewer than its "
            f"{tokenizer_label(loaded.tokenizer)} tokenizer's {tokenizer.vocab_size}"
        )
    if req.context < model.config.block_size:  # a 32k-token window's logits alone would not fit in memory
        model.crop_block_size(req.context)
    device = pick_device(req.device)
    if device.type == "cpu":
        keep_freed_memory()  # batches re-allocate the same activations, which glibc would fault in again (docs/LOG.md)
    model.to(device).eval()
    rows = min(req.context, model.config.block_size) * 4  # a few windows a forward pass
    precision = inference_precision(req.precision, device, model.config.n_embd, rows)
    autocast = precision_autocast(device.type, precision)
    report = {
        "checkpoint": loaded.source,
        "model_args": model.config.to_dict(),
        "parameters": model.num_params(),
        "tokenizer": tokenizer_label(loaded.tokenizer),
        "settings": {
            "stride": req.stride or model.config.block_size // 2,
            "precision": precision,
            "device": str(device),
            "limit": req.limit,
            "map_unknown": req.map_unknown,
        },
        "text": [],
        "hellaswag": None,
        "core": None,
        "harness": None,
        "chat_tasks": None,
        "chat_eval": None,
    }
    if Path(loaded.source).is_file():
        report["checkpoint_sha256"] = sha256_file(Path(loaded.source))
    for name, path, streams, note in text_inputs(req, model, tokenizer, loaded):
        t0 = time.perf_counter()
        score = score_text(model, streams, tokenizer.token_bytes(), req.stride, autocast, progress=True)
        report["text"].append(
            {
                "name": name,
                "path": str(path),
                "sha256": sha256_file(path),
                **figures(score),
                "seconds": time.perf_counter() - t0,
                **({"note": note} if note else {}),
            }
        )
    if req.hellaswag is not None:
        report["hellaswag"] = run_hellaswag(req, model, tokenizer, autocast)
    if core_bundle is not None:
        from quillgpt.core_eval import core_score

        report["core"] = core_score(
            model,
            tokenizer,
            core_bundle,
            req.max_per_task,
            device,
            autocast=autocast,
            map_unknown=req.map_unknown,
            progress=True,
        )
    if req.tasks:
        from quillgpt.lm_harness import run_tasks

        report["harness"] = run_tasks(
            model,
            tokenizer,
            list(req.tasks),
            req.task_dir,
            req.limit,
            req.num_fewshot,
            autocast,
            apply_chat_template=req.apply_chat_template,
        )
    if req.chat_tasks:
        with autocast:
            report["chat_tasks"] = run_chat_tasks(model, tokenizer, list(req.chat_tasks), req.chat_items)
    if chat_eval_tasks is not None:
        from quillgpt.chat_eval import run_chat_eval

        with autocast:
            report["chat_eval"] = run_chat_eval(model, tokenizer, chat_eval_tasks, req.max_new_tokens)
    return report


def text_inputs(req: EvalRequest, model: GPT, tokenizer: Tokenizer, loaded) -> list[tuple]:
    """(name, file, token streams, note) of each text to score: the --text inputs and the --split."""
    out = []
    for path, docs in text_documents(list(req.text), req.text_field):
        docs, note = map_unknown(tokenizer, docs, req.map_unknown, path)
        out.append((Path(path).name, Path(path), document_streams(tokenizer, docs), note))
    if req.split:
        data_dir = Path(req.data) if req.data else checkpoint_dataset(loaded.source)
        if data_dir is None:
            raise UserError(f"{loaded.source} records no dataset: give the prepared dataset with --data DIR")
        stream = split_stream(data_dir, req.split, model, loaded.tokenizer, loaded.source)
        out.append((f"{req.split} split of {data_dir}", data_dir / f"{req.split}.bin", [stream], ""))
    return out


def figures(score: TextScore) -> dict:
    return {"bpb": score.bpb, "loss": score.loss, "ppl": score.ppl, "tokens": score.tokens, "bytes": score.bytes}


def run_hellaswag(req: EvalRequest, model: GPT, tokenizer: Tokenizer, autocast) -> dict:
    path = hellaswag_file(req.hellaswag or None)
    items, note = hellaswag_items(path, tokenizer, req.limit, req.map_unknown)
    t0 = time.perf_counter()
    score = score_hellaswag(model, tokenizer, items, autocast, progress=True)
    seconds = time.perf_counter() - t0
    return {
        "path": str(path),
        "sha256": sha256_file(path),
        "items": score.items,
        "acc": score.acc,
        "acc_norm": score.acc_norm,
        "seconds": seconds,
        "seconds_per_1000_items": seconds / score.items * 1000,
        **({"note": note} if note else {}),
    }


def run_chat_tasks(model: GPT, tokenizer: Tokenizer, names: list[str], n_items: int, split: str = "test") -> dict:
    """Accuracy on n_items items of each chat task's split, greedy answers graded by tasks.grade: the test split for
    eval.py and the reports, the val split for a run's in-training evaluations (rl.py), which must never see a test
    item.

    A model whose tokenizer has a chat template is asked in it, one conversation per question, and answers until an
    end-of-turn token (with the calculator tool where its tokenizer has it: the answer is the text after the tool's
    output), every question's reply decoded together (chat_answers); a base model gets the plain form
    (tasks.plain_prompt): up to FEW_SHOT solved training items of the same task, then the question, and answers to
    the end of the line."""
    chat = tokenizer.chat_template is not None
    out = {"form": "chat template" if chat else f"plain, up to {FEW_SHOT}-shot", "split": split, "tasks": {}}
    for name in names:
        items = tasks.sample_items(name, split, n_items, seed=0, distinct=True)
        t0 = time.perf_counter()
        if chat:
            replies = [
                (r.text, r.answer)
                for r in chat_answers(model, tokenizer, [i.question for i in items], ANSWER_TOKENS, name)
            ]
        else:
            shots = tasks.sample_items(name, "train", FEW_SHOT, seed=0, distinct=True)
            answers = (plain_answer(model, tokenizer, item, shots) for item in items)
            replies = [
                (a, a) for a in tqdm(answers, desc=name, total=len(items), unit="item", leave=False, disable=None)
            ]
        correct = sum(tasks.grade(item, answer) for item, (_, answer) in zip(items, replies))
        out["tasks"][name] = {
            "items": len(items),
            "correct": correct,
            "acc": correct / len(items),
            "seconds": time.perf_counter() - t0,
            "examples": [
                {"question": item.question, "answer": item.answer, "reply": reply}
                for item, (reply, _) in zip(items[:5], replies)
            ],
        }
    return out


def plain_answer(model: GPT, tokenizer: Tokenizer, item: tasks.Item, shots: list[tasks.Item]) -> str:
    """A base model's greedy answer to the plain form of the question, with as many shots as fit its context."""
    for k in range(len(shots), -1, -1):
        ids = tokenizer.prompt_ids(tasks.plain_prompt(item, shots[:k]))
        if len(ids) + ANSWER_TOKENS <= model.config.block_size or k == 0:
            break
    ids = ids[-(model.config.block_size - 1) :]
    texts, _ = generate_texts(model, tokenizer, ids, 1, ANSWER_TOKENS, temperature=0, top_k=None, stop=["\n"])
    return texts[0]


def print_report(report: dict) -> None:
    print(
        f"{report['checkpoint']}: {report['parameters'] / 1e6:.2f}M parameters, {report['tokenizer']} tokenizer, "
        f"context {report['model_args']['block_size']}, {report['settings']['precision']} on {report['settings']['device']}"
    )
    if report["text"]:
        print(
            f"| text | bits per byte | loss (nats/token) | perplexity | tokens | bytes |  (stride {report['settings']['stride']})"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for t in report["text"]:
            print(
                f"| {t['name']} | {t['bpb']:.4f} | {t['loss']:.4f} | {t['ppl']:.2f} | {t['tokens']:,} | {t['bytes']:,} |"
            )
            if t.get("note"):
                print(f"  note: {t['note']}")
    if report["hellaswag"]:
        h = report["hellaswag"]
        print(
            f"hellaswag (0-shot, completion): acc {h['acc']:.4f} | acc_norm {h['acc_norm']:.4f} | {h['items']:,} items "
            f"in {h['seconds']:.1f}s ({h['seconds_per_1000_items']:.0f}s per 1,000)"
        )
    if report.get("core"):
        from quillgpt.core_eval import print_core

        print_core(report["core"])
    for task, metrics in (report["harness"] or {}).items():
        print(f"{task}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if report.get("chat_tasks"):
        chat = report["chat_tasks"]
        for task, r in chat["tasks"].items():
            print(
                f"chat task {task} ({chat['form']}, greedy): acc {r['acc']:.4f} | {r['correct']}/{r['items']} "
                f"held-out items in {r['seconds']:.1f}s"
            )
    if report.get("chat_eval"):
        from quillgpt.chat_eval import print_chat_eval

        print_chat_eval(report["chat_eval"])
