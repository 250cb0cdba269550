"""DCLM's CORE score (arXiv 2406.11794) as nanochat computes it: nanochat/core_eval.py and scripts/base_eval.py, rule
for rule, in our tokenizer and model API.

    python eval.py --ckpt checkpoints/base --core                       # data/eval_bundle, downloaded once
    python eval.py --ckpt checkpoints/base --core path/to/eval_bundle --max-per-task 100

- The bundle (nanochat's eval_bundle.zip, unpacked): core.yaml's `icl_tasks` (label, dataset_uri, num_fewshot: its
  first entry, icl_task_type, continuation_delimiter: " " when absent), eval_meta_data.csv's "Random baseline" (in
  percent) of each "Eval Task", and eval_data/<dataset_uri>, one JSON item a line.
- Items: a task's items are shuffled with random.Random(1337), always, and max_per_task keeps the first N of that
  order. Item idx's few-shot examples are random.Random(1234 + idx).sample(every other index, num_fewshot) of that
  same (shuffled, cut) list, so a cut changes the examples too, as it does in nanochat.
- Prompts (nanochat's Jinja templates, as f-strings rendering the same bytes: a field renders as str() does):
  each example is `<context><delimiter><answer>` and a blank line, then the item. Multiple choice: the query, one
  prompt a choice. Schema: one prompt a context option, the continuation the same. Language modelling: the
  contexts stripped of surrounding whitespace, and two prompts: without the continuation (stripped again) and with.
- Tokens: each prompt encoded alone after a prefix token, the tokenizer's BOS (nanochat prepends its <|bos|>, which
  starts its documents), else <|endoftext|> (GPT-2's, and what starts each document our tokenizers prepare), else
  none (a char tokenizer of a single text). The scored span: multiple choice, the tokens after the prompts' common
  prefix (tokens the choices share are not scored); schema, the prompts' common suffix; language modelling, the
  tokens after the prompt without the continuation, which must be a token prefix of the one with it.
- A prompt longer than the model's context keeps its last block_size tokens, the span shifted with it (the rule
  nanochat applies to a model with max_seq_len, as GPT-2's 0.2565 was scored). One deviation: a span that would
  then start at position 0, where nanochat asserts or averages an empty slice to NaN, starts at 1 (position 0 has
  no token before it to predict it from).
- Scoring: multiple choice and schema pick the prompt with the lowest mean loss over its span (the first on a tie,
  NaN as Python's min() treats it); language modelling is right when the greedy argmax is the whole continuation.
  Several items go through the model in one pass (nanochat: one item a pass); only float rounding can differ.
- Centred: (acc - 0.01 * baseline) / (1 - 0.01 * baseline), 0 at chance and 1 when every item is right; CORE is the
  mean of the tasks' centred scores. GPT-2 (1.5B) scores 0.2565 (nanochat's README).
- Ranks: core_score on rank r of w scores items r, r + w, ... and sums the right/wrong vector over the ranks
  (torch.distributed, as nanochat does), so DDP gives what one process does.
"""

from __future__ import annotations

import csv
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch.nn import functional as F
from tqdm import tqdm

from model import GPT
from quillgpt import distributed
from quillgpt.errors import UserError, WriteError
from quillgpt.files import atomic_write, atomic_write_json, sha256_file
from quillgpt.scoring import rows_per_pass, to_device, unknown_table
from quillgpt.tokenizer import Tokenizer

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's base_eval.py
BUNDLE_PATH = Path("data") / "eval_bundle"
BUNDLE_ENV = "QUILLGPT_EVAL_BUNDLE"  # an unpacked bundle to use instead of data/eval_bundle
# nanochat publishes no checksum of eval_bundle.zip: a download is checked against the sha256 this variable gives,
# when it is set, and every download's sha256 is printed and recorded in the bundle (DOWNLOAD_RECORD)
BUNDLE_SHA256_ENV = "QUILLGPT_EVAL_BUNDLE_SHA256"
DOWNLOAD_RECORD = "DOWNLOADED.json"
SHUFFLE_SEED = 1337  # nanochat's: a task's items in this order, max_per_task the first N of it
FEWSHOT_SEED = 1234  # item idx's examples: random.Random(FEWSHOT_SEED + idx)
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
FIELDS = {  # what each task type's items hold (gold: the right choice or context option)
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}


@dataclass(frozen=True)
class CoreTask:
    label: str
    kind: str  # one of TASK_TYPES
    path: Path  # eval_data/<dataset_uri>
    shots: int
    delimiter: str
    baseline: float  # percent, as eval_meta_data.csv gives it


@dataclass
class Rows:
    """One item's prompts as token rows, and in each the span [start, end) that is scored."""

    tokens: list[list[int]]
    starts: list[int]
    ends: list[int]


# ---- the bundle ---------------------------------------------------------------------------------


def find_bundle(given: str | None) -> Path:
    """--core DIR; without DIR, $QUILLGPT_EVAL_BUNDLE, else data/eval_bundle, else nanochat's bundle downloaded
    there once."""
    if given:
        return Path(given)
    if os.environ.get(BUNDLE_ENV):
        return Path(os.environ[BUNDLE_ENV])
    if BUNDLE_PATH.is_dir():
        return BUNDLE_PATH
    return download_bundle(BUNDLE_PATH)


def download_bundle(dest: Path) -> Path:
    """eval_bundle.zip into dest, unpacked beside it and renamed into place, so that dest is whole or absent."""
    try:
        response = urllib.request.urlopen(EVAL_BUNDLE_URL, timeout=20)
    except (urllib.error.URLError, OSError) as e:
        raise UserError(
            f"cannot download nanochat's CORE bundle ({getattr(e, 'reason', e)}): offline, point at an unpacked copy "
            f"of its eval_bundle directory with --core DIR or {BUNDLE_ENV}=DIR"
        ) from None
    print(f"[downloading {EVAL_BUNDLE_URL} into {dest}]", file=sys.stderr, flush=True)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.TemporaryDirectory(prefix=".eval_bundle.", dir=dest.parent)
    except OSError as e:
        response.close()
        raise WriteError(f"cannot write the CORE bundle into {dest.parent}: {e.strerror or e}") from None
    with response, scratch as tmp:
        archive = Path(tmp) / "eval_bundle.zip"
        try:
            with atomic_write(archive) as f:
                while block := response.read(2**22):
                    f.write(block)
        except OSError as e:
            raise UserError(f"the download of {EVAL_BUNDLE_URL} failed ({e}): try again, or use --core DIR") from None
        digest = sha256_file(archive)
        expected = os.environ.get(BUNDLE_SHA256_ENV, "").strip().lower()
        if expected and digest != expected:
            raise UserError(f"{EVAL_BUNDLE_URL} has sha256 {digest}, not {BUNDLE_SHA256_ENV}'s {expected}")
        root = unpack(archive, Path(tmp) / "unpacked")
        record = {"url": EVAL_BUNDLE_URL, "sha256": digest, "bytes": archive.stat().st_size}
        atomic_write_json(root / DOWNLOAD_RECORD, record)
        try:
            root.rename(dest)
        except OSError as e:
            if not (dest / "core.yaml").is_file():  # not another process's bundle put there first
                raise WriteError(f"cannot put the CORE bundle at {dest}: {e.strerror or e}") from None
    print(f"[eval_bundle.zip: sha256 {digest}, recorded in {dest / DOWNLOAD_RECORD}]", file=sys.stderr, flush=True)
    return dest


def unpack(archive: Path, into: Path) -> Path:
    """The eval_bundle directory of nanochat's zip, extracted under `into`."""
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)  # zipfile drops absolute paths and ".." from member names
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{EVAL_BUNDLE_URL} is not a readable zip ({e}): try again, or use --core DIR") from None
    root = into / "eval_bundle"
    if not all((root / name).exists() for name in ("core.yaml", "eval_meta_data.csv", "eval_data")):
        raise UserError(f"{EVAL_BUNDLE_URL} holds no eval_bundle/ with core.yaml, eval_meta_data.csv and eval_data/")
    return root


def read_bundle(bundle: Path) -> list[CoreTask]:
    """core.yaml's tasks with their random baselines, every data file checked to be there (before any is scored)."""
    config = bundle / "core.yaml"
    if not config.is_file():
        raise UserError(
            f"{bundle} is not a CORE bundle (no core.yaml): give the unpacked eval_bundle directory of nanochat's "
            f"eval_bundle.zip with --core DIR or {BUNDLE_ENV}=DIR"
        )
    try:
        tasks = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"{config} is unreadable or not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(tasks, dict) or not isinstance(tasks.get("icl_tasks"), list) or not tasks["icl_tasks"]:
        raise UserError(f"{config} has no list of tasks under 'icl_tasks'")
    baselines = read_baselines(bundle / "eval_meta_data.csv")
    out = [core_task(bundle, config, i, task, baselines) for i, task in enumerate(tasks["icl_tasks"])]
    labels = [t.label for t in out]
    if len(set(labels)) != len(labels):
        raise UserError(f"{config} names a task twice: {sorted({x for x in labels if labels.count(x) > 1})}")
    return out


def read_baselines(path: Path) -> dict[str, float]:
    """eval_meta_data.csv's "Random baseline" of each "Eval Task" (as base_eval.py reads it)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    out = {}
    for number, row in enumerate(rows, 2):
        task, baseline = row.get("Eval Task"), row.get("Random baseline")
        if task is None or baseline is None:
            raise UserError(f"{path} lacks the columns 'Eval Task' and 'Random baseline'")
        try:
            out[task] = float(baseline)
        except ValueError:
            raise UserError(f"{path}:{number}: 'Random baseline' of {task} is {baseline!r}, not a number") from None
    return out


def core_task(bundle: Path, config: Path, i: int, task: object, baselines: dict[str, float]) -> CoreTask:
    where = f"{config}: task {i + 1}"
    if not isinstance(task, dict):
        raise UserError(f"{where} is not a mapping of label, dataset_uri, num_fewshot, icl_task_type")
    missing = [k for k in ("label", "dataset_uri", "num_fewshot", "icl_task_type") if k not in task]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}")
    label, kind, shots = str(task["label"]), task["icl_task_type"], task["num_fewshot"]
    shots = shots[0] if isinstance(shots, list) and shots else shots  # a list in core.yaml: nanochat takes the first
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise UserError(f"{where} ({label}): num_fewshot must be a count, or a list whose first entry is one")
    if kind not in TASK_TYPES:
        raise UserError(f"{where} ({label}): icl_task_type {kind!r} is none of {', '.join(TASK_TYPES)}")
    if label not in baselines:
        raise UserError(f"{bundle / 'eval_meta_data.csv'} has no row for task {label} (its 'Random baseline')")
    if not baselines[label] < 100:
        raise UserError(f"{bundle / 'eval_meta_data.csv'}: the random baseline of {label} must be under 100 (%)")
    path = bundle / "eval_data" / str(task["dataset_uri"])
    if not path.is_file():
        raise UserError(f"{where} ({label}): its data {path} is missing")
    delimiter = task.get("continuation_delimiter", " ")
    return CoreTask(label, kind, path, shots, f"{delimiter}", baselines[label])


def read_items(task: CoreTask, max_per_task: int | None) -> list[dict]:
    """The task's items in nanochat's order (shuffled with SHUFFLE_SEED), the first max_per_task of them."""
    try:
        lines = task.path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {task.path}: {e}") from None
    items = [item_of(task, line, f"{task.path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    random.Random(SHUFFLE_SEED).shuffle(items)
    if max_per_task and max_per_task > 0:
        items = items[:max_per_task]
    if len(items) <= task.shots:
        cut = " (raise --max-per-task)" if max_per_task and max_per_task > 0 else ""
        raise UserError(
            f"{task.label} is {task.shots}-shot: it needs more than {task.shots} items, has {len(items)}{cut}"
        )
    return items


def item_of(task: CoreTask, line: str, where: str) -> dict:
    try:
        item = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({e})") from None
    if not isinstance(item, dict):
        raise UserError(f"{where}: not a JSON object")
    missing = [k for k in FIELDS[task.kind] if k not in item]
    if missing:
        raise UserError(
            f"{where}: a {task.kind} item needs {', '.join(FIELDS[task.kind])}; it lacks {', '.join(missing)}"
        )
    options = item.get("choices", item.get("context_options"))
    if task.kind != "language_modeling":
        name = "choices" if task.kind == "multiple_choice" else "context_options"
        gold = item["gold"]
        if not isinstance(options, list) or not options:
            raise UserError(f"{where}: '{name}' must be a non-empty list")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(options):
            raise UserError(f"{where}: 'gold' must be an index into its {len(options)} {name}")
    return item


# ---- prompts and their tokens ---------------------------------------------------------------------


def fewshot_indices(idx: int, n: int, shots: int) -> list[int]:
    """The indices of item idx's few-shot examples among n items: nanochat's rule, the item itself never one."""
    if shots == 0:
        return []
    return random.Random(FEWSHOT_SEED + idx).sample([i for i in range(n) if i != idx], shots)


def render_prompts(kind: str, item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    """The prompts nanochat's templates render for an item after its examples (render_prompts_mc/_schema/_lm)."""
    if kind == "multiple_choice":
        head = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    head = "".join(f"{str(s['context']).strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    without = f"{head}{str(item['context']).strip()}{delimiter}"
    # stripped again: a trailing space would be part of the continuation's first token in the other prompt
    return [without.strip(), f"{without}{item['continuation']}"]


def prefix_ids(tokenizer: Tokenizer) -> list[int]:
    """What every prompt starts with: BOS, else <|endoftext|>, else nothing (see the module docstring)."""
    for token in (tokenizer.bos_id, tokenizer.eot_id):
        if token is not None:
            return [token]
    return []


def prefix_name(tokenizer: Tokenizer) -> str:
    if tokenizer.bos_id is not None:
        return f"BOS (id {tokenizer.bos_id})"
    return f"<|endoftext|> (id {tokenizer.eot_id})" if tokenizer.eot_id is not None else "none"


def common_length(rows: list[list[int]], from_end: bool = False) -> int:
    """How many tokens every row shares at its start (or end)."""
    shortest = min(map(len, rows))
    for i in range(shortest):
        at = -1 - i if from_end else i
        if any(row[at] != rows[0][at] for row in rows):
            return i
    return shortest


def item_rows(kind: str, tokenizer: Tokenizer, prompts: list[str], prefix: list[int], where: str = "") -> Rows:
    """The prompts' tokens (each encoded alone, after the prefix) and the span of each that is scored."""
    tokens = [prefix + (tokenizer.encode(p) if p else []) for p in prompts]
    ends = [len(t) for t in tokens]
    if kind == "multiple_choice":  # the same context, different continuations
        return Rows(tokens, [common_length(tokens)] * len(tokens), ends)
    if kind == "schema":  # different contexts, the same continuation
        suffix = common_length(tokens, from_end=True)
        return Rows(tokens, [end - suffix for end in ends], ends)
    without, whole = tokens
    if not (len(without) < len(whole) and whole[: len(without)] == without):
        raise UserError(
            f"{where}: the prompt without its continuation does not encode to a prefix of the prompt with it, which "
            "this task type needs (nanochat asserts it too)"
        )
    return Rows([whole], [len(without)], [len(whole)])


def crop(rows: Rows, block: int) -> Rows:
    """Rows longer than the model's context keep their last `block` tokens, their spans shifted with them."""
    out = Rows([], [], [])
    for t, start, end in zip(rows.tokens, rows.starts, rows.ends):
        cut = max(0, len(t) - block)
        out.tokens.append(t[cut:])
        out.starts.append(max(1, start - cut))  # position 0 has nothing before it to predict it from
        out.ends.append(end - cut)
    return out


# ---- scoring ------------------------------------------------------------------------------------


@torch.inference_mode()
def score_rows(model: GPT, rows: list[tuple[list[int], int, int]], pad: int, autocast=None) -> tuple[list, list]:
    """Each (tokens, start, end) row's mean loss over tokens start..end-1 (each predicted from the token before it)
    and whether each of them is the argmax: one forward pass, one read back to the host."""
    device = next(model.parameters()).device
    width = max(len(t) for t, _, _ in rows)
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    span = torch.zeros(len(rows), width, dtype=torch.bool)  # span[r, p]: the target at p + 1 is scored
    for r, (t, start, end) in enumerate(rows):
        x[r, : len(t)] = torch.tensor(t)
        span[r, start - 1 : end - 1] = True
    x, span = to_device(x, device), to_device(span, device)
    with autocast or nullcontext():
        logits, _ = model(x)
    logits = logits.float()
    targets = x.roll(-1, dims=1)
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    means = torch.where(span, losses, 0.0).sum(1) / span.sum(1)  # NaN for an empty span, as nanochat's mean
    greedy = ((logits.argmax(-1) == targets) | ~span).all(1)
    means, greedy = torch.stack((means, greedy.float())).cpu()
    return means.tolist(), [bool(g) for g in greedy]


def is_right(kind: str, item: dict, means: list[float], greedy: list[bool]) -> bool:
    if kind == "language_modeling":
        return greedy[0]
    return means.index(min(means)) == item["gold"]  # nanochat's pick: the first lowest (a NaN first wins, as there)


def task_rows(task: CoreTask, items: list[dict], tokenizer: Tokenizer, block: int, mine: range) -> Iterator[Rows]:
    prefix = prefix_ids(tokenizer)
    for idx in mine:
        shots = [items[i] for i in fewshot_indices(idx, len(items), task.shots)]
        prompts = render_prompts(task.kind, items[idx], task.delimiter, shots)
        yield crop(item_rows(task.kind, tokenizer, prompts, prefix, f"{task.label}, item {idx}"), block)


def score_task(
    model: GPT, tokenizer: Tokenizer, task: CoreTask, items: list[dict], rank: int, world_size: int, autocast, bar
) -> list[tuple[int, bool]]:
    """(index, right) for this rank's items (idx % world_size == rank), several items a forward pass: as many rows
    as rows_per_pass allows of block_size tokens, counted at the rows' own width (at least one item a pass)."""
    block = model.config.block_size
    budget = rows_per_pass(model, next(model.parameters()).device) * block
    pad = (prefix_ids(tokenizer) or [0])[0]  # after a row's end: never scored, never attended to by its tokens
    mine = range(rank, len(items), world_size)
    out: list[tuple[int, bool]] = []
    batch: list[tuple[int, Rows]] = []
    shape = [0, 0]  # the batch's rows and width

    def flush():
        rows = [(t, s, e) for _, r in batch for t, s, e in zip(r.tokens, r.starts, r.ends)]
        means, greedy = score_rows(model, rows, pad, autocast)
        at = 0
        for idx, r in batch:
            n = len(r.tokens)
            out.append((idx, is_right(task.kind, items[idx], means[at : at + n], greedy[at : at + n])))
            at += n
        bar.update(len(batch))
        batch.clear()
        shape[:] = [0, 0]

    for idx, rows in zip(mine, task_rows(task, items, tokenizer, block, mine)):
        width = max(map(len, rows.tokens))
        if batch and (shape[0] + len(rows.tokens)) * max(shape[1], width) > budget:
            flush()
        batch.append((idx, rows))
        shape[:] = [shape[0] + len(rows.tokens), max(shape[1], width)]
    if batch:
        flush()
    return out


def map_items(task: CoreTask, items: list[dict], tokenizer: Tokenizer, allow: bool) -> tuple[list[dict], str]:
    """A char model's items with the characters it has never seen replaced, when allowed (as --map-unknown does for
    text); a note for the report. Byte-level tokenizers encode anything: items unchanged."""
    table, note = unknown_table(
        tokenizer, [s for item in items for s in item_texts(item)], allow, f"CORE task {task.label}"
    )
    if table is None:
        return items, ""

    def mapped(value):
        if isinstance(value, str):
            return value.translate(table)
        return [mapped(v) for v in value] if isinstance(value, list) else value

    return [{k: mapped(v) for k, v in item.items()} for item in items], note


def item_texts(item: dict) -> Iterator[str]:
    for key in ("query", "choices", "context_options", "context", "continuation"):
        value = item.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                yield v


def centered(accuracy: float, baseline: float) -> float:
    """DCLM's centring: 0 at the random baseline (a percent), 1 at every item right."""
    return (accuracy - 0.01 * baseline) / (1.0 - 0.01 * baseline)


def core_score(
    model: GPT,
    tokenizer: Tokenizer,
    bundle_dir: str | os.PathLike,
    max_per_task: int | None = None,
    device: torch.device | str | None = None,
    rank: int = 0,
    world_size: int = 1,
    *,
    autocast=None,
    map_unknown: bool = False,
    progress: bool = False,
) -> dict:
    """CORE of the model (the unwrapped module, not DDP's wrapper) over a bundle: each task's accuracy and centred
    score, and their mean. max_per_task: None or <= 0 for every item. On rank `rank` of `world_size` (a
    torch.distributed job: every rank calls it) each rank scores items rank, rank + world_size, ... and the
    right/wrong vectors are summed over the ranks, so every rank returns the one process's figures. The model is
    left in the mode it came in."""
    if world_size > 1 and not torch.distributed.is_initialized():
        raise ValueError(f"core_score on {world_size} ranks needs torch.distributed initialised")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    bundle = Path(bundle_dir)
    tasks = read_bundle(bundle)
    if max_per_task and max_per_task > 0 and (few := [t.label for t in tasks if t.shots >= max_per_task]):
        raise UserError(
            f"--max-per-task {max_per_task} leaves too few items for the few-shot examples of {', '.join(few)}: "
            f"give at least {max(t.shots for t in tasks) + 1}"
        )
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    out = {
        "bundle": str(bundle),
        "max_per_task": max_per_task if max_per_task and max_per_task > 0 else None,
        "prefix": prefix_name(tokenizer),
        "context": model.config.block_size,
        "tasks": {},
    }
    try:
        for task in tasks:
            start = time.perf_counter()
            items, note = map_items(task, read_items(task, max_per_task), tokenizer, map_unknown)
            with tqdm(
                total=len(range(rank, len(items), world_size)),
                desc=task.label,
                unit="item",
                leave=False,
                disable=None if progress and rank == 0 else True,
            ) as bar:
                scored = score_task(model, tokenizer, task, items, rank, world_size, autocast, bar)
            right = torch.zeros(len(items), dtype=torch.float32, device=device)
            for idx, ok in scored:
                right[idx] = float(ok)
            if world_size > 1:
                distributed.all_reduce_sum(right)
            accuracy = right.mean().item()
            out["tasks"][task.label] = {
                "type": task.kind,
                "shots": task.shots,
                "delimiter": task.delimiter,
                "items": len(items),
                "accuracy": accuracy,
                "random_baseline": task.baseline,
                "centered": centered(accuracy, task.baseline),
                "seconds": time.perf_counter() - start,
                "data": str(task.path),
                "sha256": sha256_file(task.path),
                **({"note": note} if note else {}),
            }
    finally:
        model.train(was_training)
    out["core"] = sum(t["centered"] for t in out["tasks"].values()) / len(out["tasks"])
    out["seconds"] = time.perf_counter() - t0
    return out


def print_core(core: dict) -> None:
    """The report's CORE table (eval.py's print_report)."""
    print("| CORE task | type | shots | items | accuracy | centered |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, t in core["tasks"].items():
        print(f"| {label} | {t['type']} | {t['shots']} | {t['items']:,} | {t['accuracy']:.4f} | {t['centered']:.4f} |")
        if t.get("note"):
            print(f"  note: {t['note']}")
    items = sum(t["items"] for t in core["tasks"].values())
    cut = f", at most {core['max_per_task']:,} a task" if core["max_per_task"] else ""
    print(
        f"CORE {core['core']:.4f}: the mean centered score of {len(core['tasks'])} tasks ({items:,} items{cut}; "
        f"prefix {core['prefix']}) in {core['seconds']:.1f}s"
    )
