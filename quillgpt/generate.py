"""Text from a model: load it for sampling, encode a prompt, and decode a batch of continuations with stop
sequences, streaming the first row. sample.py is the command line over these."""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from model import GPT, quantize_int8
from quillgpt.errors import UserError
from quillgpt.kernels import ROW_PROBE_MAX_WIDTH, measure_bf16_speedup
from quillgpt.loading import load_model
from quillgpt.precision import PRECISIONS, inference_precision, int8_activations, kept_measurement, machine_key
from quillgpt.tokenizer import Tokenizer, tokenizer_from_dict, tokenizer_label

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
DTYPES = ("auto", "fp32", "bf16", "fp16", "int8")  # what --dtype takes in sample.py, chat.py and serve.py
COMPILE_HELP = (
    "--compile: decode with the one-token step compiled ahead of time and kept on disk (CPU: compiled once per model "
    "shape, batch and cache length, tens of seconds, unless a kept one holds the call's cache; "
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


def decoding_precision(requested: str, device: torch.device, width: int) -> str:
    """The precision sample.py, chat.py and serve.py decode a model of this width in, whatever their batch (so that
    on one machine the three agree on greedy text): `requested`, or for "auto" bf16 on a CUDA device that has it,
    and on the CPU bf16 where the products of one decoding row, run as the step runs them (kernels.linear), measure
    DECODING_BF16_MARGIN faster in bf16 than in fp32 and those of DECODING_BATCH_ROWS rows no slower. Each speed-up
    is measured once per machine and width and kept (kept_measurement)."""
    if requested != "auto" or device.type != "cpu":
        return inference_precision(requested, device, width, 1)
    width = min(width, ROW_PROBE_MAX_WIDTH)

    def speedup(rows: int) -> float:
        key = f"{machine_key()}|{width}|{rows} rows"
        return kept_measurement("bf16_decoding_speedup.json", key, lambda: measure_bf16_speedup(width, rows), float)

    return "bf16" if speedup(1) >= DECODING_BF16_MARGIN and speedup(DECODING_BATCH_ROWS) >= 1.0 else "fp32"


def load_for_sampling(source: str | Path, device: str = "auto", dtype: str = "fp32") -> tuple[GPT, Tokenizer, str]:
    """A checkpoint, run directory, .safetensors file, or Hugging Face directory or hub name -> (model in `dtype` on
    the device (pick_device), tokenizer, label: the source, the precision and the device). dtype auto (the scripts'
    default): bf16 on a CUDA device that has it; on the CPU bf16 where decoding's products run clearly faster in it
    (decoding_precision). int8: weight-only int8 (CPU), its activations in the precision its int8
    product runs faster with (precision.int8_activations)."""
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
    if dtype == "int8" and device.type != "cpu":
        raise UserError(f"--dtype int8 is for the CPU (weight-only int8 matmuls); on {device} use bf16")
    width = loaded.model.config.n_embd
    if dtype == "int8":
        activations = int8_activations(width)
    else:
        activations = decoding_precision(dtype, device, width)
    loaded.model.eval().to(device=device, dtype=PRECISIONS[activations])
    model = quantize_int8(loaded.model, PRECISIONS[activations]) if dtype == "int8" else loaded.model
    precision = f"int8 ({activations} activations)" if dtype == "int8" else activations
    return model, tokenizer, f"{loaded.source}, {precision} on {device}"


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
    model, _, label = load_for_sampling(checkpoint, device="cpu", dtype="auto")
    length = model.config.block_size
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


def showable_length(text: str, stop: list[str]) -> int:
    """How much of a growing sample can be printed: not a cut-off UTF-8 character, nor what may begin a stop sequence."""
    n = len(text.rstrip("\ufffd"))
    held = max((k for s in stop for k in range(1, len(s)) if text[:n].endswith(s[:k])), default=0)
    return n - held


class RowText:
    """The text of a growing row of ids, decoded as it grows: each token's text is decoded after the 8 ids before
    it (context enough for a sentencepiece space, as for the prompt) and kept once it ends in a whole character, so
    a token costs the decoding of a few ids, not of the whole row."""

    CONTEXT = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_ids[-self.CONTEXT :])  # the ids before the pending ones
        self.pending: list[int] = []  # ids whose text may still end in a cut-off UTF-8 character
        self.kept = ""

    def add(self, token: int) -> str:
        """Append one id; returns the row's whole text (U+FFFD where a character is not complete yet)."""
        self.pending.append(token)
        tail = self.tokenizer.decode_after(self.context, self.pending)
        if tail.endswith("\ufffd"):
            return self.kept + tail
        self.kept += tail
        self.context = (self.context + self.pending)[-self.CONTEXT :]
        self.pending = []
        return self.kept


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
    compile: bool = False,
) -> tuple[list[str], int]:
    """Sample num_samples continuations as one batch. Returns (texts, tokens generated).

    A row ends at the tokenizer's <|endoftext|> (end of sequence) or the first stop sequence, which are left out;
    stop sequences may span tokens.
    seed: an int seeds a new generator, a torch.Generator is drawn from as it is (an interactive session
    shares one), None uses torch's global one. stream, a text file, receives the first row's text as
    it is produced. compile: decode with the compiled step (GPT.generate_stream)."""
    stop = [s for s in stop or [] if s]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if isinstance(seed, int) else seed
    idx = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)
    rows = [RowText(tokenizer, prompt_ids) for _ in range(num_samples)]
    texts = [""] * num_samples
    done = [False] * num_samples
    shown = steps = 0
    for token in model.generate_stream(
        idx,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        vocab_limit=tokenizer.vocab_size,
        compile=compile,
    ):
        steps += 1
        for i, t in enumerate(token[:, 0].tolist()):
            if done[i]:
                continue
            if t == tokenizer.eot_id:
                done[i] = True
                continue
            texts[i] = rows[i].add(t)
            hits = [texts[i].index(s) for s in stop if s in texts[i]]
            if hits:
                texts[i], done[i] = texts[i][: min(hits)], True
        if stream is not None:
            end = len(texts[0]) if done[0] else showable_length(texts[0], stop)
            stream.write(texts[0][shown:end])
            stream.flush()
            shown = max(shown, end)
        if all(done):
            break
    if stream is not None:
        stream.write(texts[0][shown:])
        stream.flush()
    return texts, steps * num_samples


def unescape(text: str) -> str:
    r"""Turn \n, \t, \r and \\ typed on a command line into the characters."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m[1], m[0]), text)
