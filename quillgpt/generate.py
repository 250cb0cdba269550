"""Text from a model: load it for decoding under a plan decided once and shown, encode a prompt, and decode a batch of
continuations with stop strings, streaming the first row (through quillgpt/engine.py). sample.py is the command line
over these; chat.py and serve.py load through load_for_sampling too.

The decoding plan (plan_decoding) is every choice a decoding run takes from the machine, a file or a flag, each with
its reason: the precision (--dtype, or auto's kept measurement), the step (eager, a compiled package kept on disk,
or torch.compile on a GPU) and the product kernels swapped into the loaded model (quillgpt/decoding_kernels.py).
sample.py --verbose prints it; serve.py's start line always does.
"""

from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from model import GPT
from quillgpt.decoding_kernels import (
    ROW_PROBE_MAX_WIDTH,
    SPLIT_MARGIN,
    measure_bf16_speedup,
    quantize_int8,
    split_speedup,
    use_decoding_kernels,
)
from quillgpt.engine import Draws, Engine, Row, RowText, Sampling, cache_length, showable_length
from quillgpt.errors import UserError
from quillgpt.loading import load_model
from quillgpt.precision import PRECISIONS, inference_precision, int8_activations, kept_measurement, machine_key
from quillgpt.tokenizer import Tokenizer, tokenizer_from_dict, tokenizer_label

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
DTYPES = ("auto", "fp32", "bf16", "fp16", "int8")  # what --dtype takes in sample.py, chat.py and serve.py
COMPILE_HELP = (
    "--compile: decode with the one-token step compiled ahead of time and kept on disk (CPU: compiled once per model "
    "shape and cache length, tens of seconds, unless a kept one holds the call's cache; "
    "quillgpt/compiled_step.py); default: with a kept one where there is one, else eagerly; --no-compile: eagerly"
)
DEVICES = "auto | cpu | cuda | cuda:N | mps"  # what --device takes in sample.py, chat.py, serve.py and eval.py


def pick_device(name: str) -> torch.device:
    """--device: auto is cuda where this machine has a CUDA device, else mps where it has Apple's, else cpu; a device
    it lacks is a UserError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device: {DEVICES}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name} but this machine has no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name} but MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {name}: {DEVICES}")
    return device


# bf16 decodes by default where one decoding row's products measure this much faster in bf16 than in fp32: a row
# reads each weight once, and bf16 reads half the bytes; below it the step, whose other ops don't speed up, would
# gain under ~10% for fp32's exactness (on an AMD EPYC, 1.4-1.9x on the products, 1.2-1.26x a step: docs/LOG.md)
DECODING_BF16_MARGIN = 1.25
# ... and where a batch of this many rows (serve.py's default --max-batch) runs no slower in bf16: where bf16 is
# emulated (AVX2 only) one row ran 1.2-1.4x faster in bf16, and 16 rows at half fp32's speed (docs/LOG.md)
DECODING_BATCH_ROWS = 16


def decoding_precision(requested: str, device: torch.device, width: int) -> tuple[str, str]:
    """The precision sample.py, chat.py and serve.py decode a model of this width in, whatever their batch (so that
    on one machine the three agree on greedy text), and why: `requested`, or for "auto" bf16 on a CUDA device that
    has it, and on the CPU bf16 where the products of one decoding row, run as the step runs them, measure
    DECODING_BF16_MARGIN faster in bf16 than in fp32 and those of DECODING_BATCH_ROWS rows no slower. Each speed-up
    is measured once per machine and width and kept (kept_measurement)."""
    if requested != "auto":
        return requested, "--dtype"
    if device.type != "cpu":
        return inference_precision(requested, device, width, 1), f"auto on {device.type}"
    width = min(width, ROW_PROBE_MAX_WIDTH)
    pays = split_speedup()[0] >= SPLIT_MARGIN

    def speedup(rows: int) -> tuple[float, str]:
        key = f"{machine_key()}|{width}|{rows} rows"
        measure = lambda: measure_bf16_speedup(width, rows, pays)  # noqa: E731
        return kept_measurement("bf16_decoding_speedup.json", key, measure, float, where=True)

    (row, where), (batch, _) = speedup(1), speedup(DECODING_BATCH_ROWS)
    chosen = "bf16" if row >= DECODING_BF16_MARGIN and batch >= 1.0 else "fp32"
    return chosen, (
        f"auto: a decoding row's products ran {row:.2f}x as fast in bf16 (bf16 from {DECODING_BF16_MARGIN}x), "
        f"{DECODING_BATCH_ROWS} rows' {batch:.2f}x (from 1.0x); {where}"
    )


@dataclass
class DecodingPlan:
    """How a loaded model decodes, decided once where it is loaded (plan_decoding), each choice with its reason."""

    device: torch.device
    precision: str  # what the weights and activations are in ("int8 (bf16 activations)" for int8)
    precision_why: str
    step: str = "eager"  # "eager", "compiled" (a package kept on disk, CPU) or "torch.compile" (elsewhere)
    step_why: str = ""
    compile: bool | None = None  # the request: True compiles a package where none holds a call; None: kept ones
    products: list[str] = field(default_factory=list)  # the decoding kernels swapped in, and why
    source: str = ""

    @property
    def label(self) -> str:
        """`checkpoints/base/ckpt_best.pt, bf16 on cpu`: what sample.py's first line says."""
        return f"{self.source}, {self.precision} on {self.device}"

    def lines(self) -> list[str]:
        return [
            f"precision: {self.precision} ({self.precision_why})",
            f"step: {self.step} ({self.step_why})",
            f"products: {'; '.join(self.products) or 'PyTorch own, as they are'}",
        ]

    def describe(self) -> str:
        """The plan in one line (serve.py's start line)."""
        return "[decoding plan | " + " | ".join(self.lines()) + "]"

    def text(self) -> str:
        """The plan a line a choice (sample.py and chat.py --verbose)."""
        return "\n".join(["[decoding plan]", *(f"  {line}" for line in self.lines())])

    def lone_step(self, model: GPT, rows: int, length: int):
        """(a cache of `rows` rows, the compiled step over its first row) for an engine that decodes a lone row so, or
        None eagerly: the kept package whose cache is the shortest that holds `length` positions (compile True: one
        compiled for `length` and kept first; the cache takes the package's length), or off the CPU torch.compile."""
        if self.step == "eager":
            return None
        from quillgpt.compiled_step import compiled_row_step, graph_row_step, kept_package, package_length
        from quillgpt.engine import KVCache

        if self.step == "torch.compile":
            cache = KVCache.for_model(model, rows, length)
            return cache, graph_row_step(model, cache)
        package = kept_package(model, 1, length, build=bool(self.compile))
        if package is None:
            return None
        cache = KVCache.for_model(model, rows, package_length(package))
        step = compiled_row_step(package, model, cache)
        return (cache, step) if step is not None else None


def plan_decoding(
    model: GPT, device: torch.device, dtype: str = "fp32", compile: bool | None = None, source: str = ""
) -> tuple[GPT, DecodingPlan]:
    """Decide how the model decodes on this device and make it so: its precision (dtype: auto, fp32, bf16, fp16 or
    int8), the step (compile: True compiles one where none is kept, None takes a kept one, False is eager) and, on
    the CPU, the decoding kernels swapped in. Returns the model as it decodes (int8's is another) and the plan."""
    if dtype == "int8" and device.type != "cpu":
        raise UserError(f"--dtype int8 is for the CPU (weight-only int8 matmuls); on {device} use bf16")
    if dtype == "int8":
        activations = int8_activations(model.config.n_embd)
        precision, why = (
            f"int8 ({activations} activations)",
            f"--dtype int8, whose product is faster with {activations}",
        )
    else:
        activations, why = decoding_precision(dtype, device, model.config.n_embd)
        precision = activations
    model.eval().to(device=device, dtype=PRECISIONS[activations])
    if dtype == "int8":
        model = quantize_int8(model, PRECISIONS[activations])
    plan = DecodingPlan(device, precision, why, compile=compile, source=source)
    if device.type == "cpu":
        speedup, where = split_speedup()
        pays = speedup >= SPLIT_MARGIN
        plan.products = use_decoding_kernels(model, pays)
        verdict = "used" if pays else f"not used: under {SPLIT_MARGIN}x"
        plan.products.append(f"a row's fp32 product split ran {speedup:.2f}x as fast ({verdict}; {where})")
    plan.step, plan.step_why = decoding_step(model, plan)
    return model, plan


def decoding_step(model: GPT, plan: DecodingPlan) -> tuple[str, str]:
    """Which step the plan decodes with, and why: eager with --no-compile; on the CPU the compiled package kept for
    this model's shape (compiled first with --compile), else eager; elsewhere torch.compile with --compile."""
    if plan.compile is False:
        return "eager", "--no-compile"
    if plan.device.type != "cpu":
        return ("torch.compile", "--compile") if plan.compile else ("eager", "no --compile")
    from quillgpt.compiled_step import kept_packages, package_key, verified

    kept = [(length, path) for length, path in kept_packages(package_key(model, 1)) if verified(path)]
    if kept:
        shown = ", ".join(f"{path} ({length} positions)" for length, path in kept)
        return "compiled", f"kept for this model's shape: {shown}"
    if plan.compile:
        return "compiled", "--compile: none kept for this model's shape, compiled at its first generation and kept"
    return "eager", "no compiled step kept for this model's shape (--compile keeps one)"


def load_for_sampling(
    source: str | Path, device: str = "auto", dtype: str = "fp32", compile: bool | None = None
) -> tuple[GPT, Tokenizer, DecodingPlan]:
    """A checkpoint, run directory, .safetensors file, or Hugging Face directory or hub name -> (the model as it
    decodes on the device (pick_device), its tokenizer, the decoding plan: plan_decoding, whose label names the
    source, the precision and the device). dtype auto (the scripts' default): bf16 on a CUDA device that has it; on
    the CPU bf16 where decoding's products run clearly faster in it (decoding_precision). int8: weight-only int8
    (CPU), its activations in the precision its int8 product runs faster with (precision.int8_activations)."""
    device = pick_device(device)
    loaded = load_model(source)
    if loaded.tokenizer is None:
        raise UserError(
            f"{loaded.source} records no tokenizer (a Hugging Face directory needs its tokenizer.json), "
            "so its ids can't be decoded"
        )
    tokenizer = tokenizer_from_dict(loaded.tokenizer)
    if tokenizer.vocab_size > loaded.model.config.vocab_size:
        raise UserError(
            f"{source} has {loaded.model.config.vocab_size} token ids, fewer than its "
            f"{tokenizer_label(loaded.tokenizer)} tokenizer's {tokenizer.vocab_size}: sample from the "
            "checkpoint it was exported from instead"
        )
    model, plan = plan_decoding(loaded.model, device, dtype, compile, loaded.source)
    return model, tokenizer, plan


# A run at least this long keeps its decoding step by default (keep_decoding_step): the compile, 15-30 s on 2 cores
# for the presets' models, is then a small part of it, and the tests' few-second runs never pay it
KEEP_STEP_AFTER_SECONDS = 300


def keeps_decoding_step(setting: bool | None, eval_only: bool, stop_reason: str, seconds: float) -> bool:
    """Whether a run that ended so keeps sample.py's compiled decoding step (training.keep_decoding_step): not an
    evaluation, nor a run stopped by a signal (its user wants it to stop) or by non-finite losses; else the setting,
    and where it is None (auto) a run of KEEP_STEP_AFTER_SECONDS or more on a machine where sample.py decodes on the
    CPU."""
    if eval_only or stop_reason == "signal" or stop_reason.startswith("stopped:"):
        return False
    if setting is None:
        return seconds >= KEEP_STEP_AFTER_SECONDS and pick_device("auto").type == "cpu"
    return setting


def keep_decoding_step(checkpoint: str | Path, processes: int = 1) -> None:
    """Compile the one-token decoding step sample.py would decode this checkpoint with on this machine (loaded as
    it loads it: dtype auto, the CPU; batch 1; the model's whole context, which chat.py's conversations and
    serve.py's lone requests use too) and keep it (quillgpt/compiled_step.py), unless a kept one holds that context:
    from their first run, the three decode this model, and any other of its shape, with it by default. Where it
    can't be compiled (no C++ compiler, a model torch.export refuses) the run gets one line, not an error: the run
    itself is done. So does a run of several processes (torchrun): its ranks run on a share of the cores
    (OMP_NUM_THREADS), and a step is compiled for the threads it runs on, which sample.py's are not."""
    from quillgpt.compiled_step import kept_package

    if processes > 1:
        print(
            f"[sample.py's decoding step not kept: the {processes} processes of this run each had a share of the "
            "cores, and a step is compiled for sample.py's threads; sample.py --compile keeps it once]",
            flush=True,
        )
        return
    model, _, plan = load_for_sampling(checkpoint, device="cpu", dtype="auto")
    label, length = plan.label, model.config.block_size
    if kept := kept_package(model, 1, length, build=False):
        print(f"[sample.py's compiled decoding step for this model's shape is kept already: {kept.name}]", flush=True)
        return
    print(
        f"[compiling sample.py's decoding step for {label} (batch 1, {length} positions; once per model shape; "
        "training.keep_decoding_step = false skips it)]",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        path = kept_package(model, 1, length, build=True)
    except Exception as e:  # the run is done and saved: a step that can't be kept costs a line, not the run's exit
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(f"[not kept: {why}]", flush=True)
        return
    print(f"[kept in {time.perf_counter() - t0:.0f}s: {path}; sample.py, chat.py and serve.py use it]", flush=True)


# the seeds torch.Generator.manual_seed takes (a 64-bit word, signed or not), for --seed and a request's seed
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_SAMPLES = 1024  # sample.py's --num-samples: one batch, a KV cache row each


def sampling_error(
    temperature: float,
    top_p: float | None,
    top_k: int | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    max_new_tokens: int = 0,
) -> str | None:
    """Why the command line's sampling settings can't sample (a script's usage error, one line), or None when they
    can: every number checked at its edges (negative, huge, NaN, infinite) before anything is loaded."""
    if not math.isfinite(temperature) or temperature < 0:
        return f"--temperature must be a finite number >= 0 (0: greedy), not {temperature}"
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        return f"--top-p must be in (0, 1], not {top_p}"
    if top_k is not None and top_k < 0:
        return f"--top-k must be >= 0 (0: off), not {top_k}"
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        return f"--seed must be a 64-bit integer (from {SEED_MIN} to {SEED_MAX}), not {seed}"
    if not 1 <= num_samples <= MAX_SAMPLES:
        return f"--num-samples must be in 1..{MAX_SAMPLES} (one batch), not {num_samples}"
    if max_new_tokens < 0:
        return f"--max-new-tokens must be >= 0, not {max_new_tokens}"
    return None


def encode_prompt(tokenizer: Tokenizer, prompt: str, block_size: int) -> list[int]:
    try:
        ids = tokenizer.prompt_ids(prompt)
    except UserError as e:
        raise UserError(f"prompt: {e}") from None
    if not ids:  # generation needs at least one token: start from a newline, or token 0
        try:
            ids = tokenizer.encode("\n")
        except UserError:
            ids = []
        ids = ids or [0]
    if len(ids) > block_size:
        print(
            f"[prompt is {len(ids)} tokens, longer than block_size {block_size}: keeping the last {block_size}]",
            file=sys.stderr,
        )
        ids = ids[-block_size:]
    return ids


def generate_texts(
    model: GPT,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    stop: list[str] | None = None,
    seed: int | torch.Generator | None = None,
    stream: TextIO | None = None,
    plan: DecodingPlan | None = None,
) -> tuple[list[str], int]:
    """Sample num_samples continuations as one batch, rows of one engine (quillgpt/engine.py). Returns (texts, tokens
    generated: every row's, as many steps as the longest ran).

    A row ends at the tokenizer's <|endoftext|> (end of sequence) or the first stop string, which are left out;
    stop strings may span tokens. seed: an int seeds a new generator, a torch.Generator is drawn from as it is (an
    interactive session shares one), None uses torch's global one. stream, a text file, receives the first row's
    text as it is produced. plan: the loaded model's (plan_decoding): the step it decodes with (None: eager)."""
    stop = tuple(s for s in stop or [] if s)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if isinstance(seed, int) else seed
    if max_new_tokens == 0:
        return [""] * num_samples, 0
    draws = Draws(generator, num_samples)
    ends = frozenset() if tokenizer.eot_id is None else frozenset({tokenizer.eot_id})
    rows = [
        Row(
            prompt_ids,
            Sampling(temperature, top_k, top_p),
            max_new_tokens,
            stop_ids=ends,
            stop=stop,
            draws=draws,
            draw_index=i,
            text=RowText(tokenizer, prompt_ids),
        )
        for i in range(num_samples)
    ]
    length = cache_length(len(prompt_ids) + max_new_tokens, model.config.block_size)
    engine = Engine(model, plan, capacity=num_samples, length=length, vocab_size=tokenizer.vocab_size)
    engine.add(rows)
    shown = steps = 0
    while engine.rows:
        engine.step()
        steps += 1
        if stream is not None:
            first = rows[0]
            end = len(first.shown) if first.finish else showable_length(first.shown, stop)
            stream.write(first.shown[shown:end])
            stream.flush()
            shown = max(shown, end)
    if stream is not None:
        stream.write(rows[0].shown[shown:])
        stream.flush()
    return [row.shown for row in rows], steps * num_samples


def unescape(text: str) -> str:
    r"""Turn \n, \t, \r and \\ typed on a command line into the characters."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m[1], m[0]), text)
