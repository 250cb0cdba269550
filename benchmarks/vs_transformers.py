"""--vs-transformers: greedy decoding of the same exported model by sample.py, by transformers' `generate` and, where
llama-cpp-python is installed, by llama.cpp on export.py --gguf's f32 and bf16 files (the same threads), each a fresh
process, so that start-up, loading and any compile count as a user pays them. Our side is
`python sample.py --ckpt DIR --prompt TEXT --temperature 0 --max-new-tokens N --device D` (everything else sample.py's
default: dtype auto; --no-compile for the eager step); theirs a Python process that imports transformers, loads the directory with
AutoModelForCausalLM onto D (in bf16 on a CUDA device, as sample.py's auto; else fp32) and calls generate on the
prompt's ids (no tokenizer: its load would cost transformers more).
The sides alternate --repeats times in ABBA order (the machine's drift hits both alike); the table gives each side's
best process wall time and best generation tokens/s (as each process measures its own generation), and whether the
greedy tokens are equal. The model is the config's (default: the GPU preset's char model with a 512-token context,
so that the prompt and 256 new tokens fit) with random weights and tiny Shakespeare's characters, exported as
export.py --hf writes it. --with-compile first runs sample.py --compile once, ours and inductor's caches empty as on a
fresh machine (it compiles the step and keeps it: its wall time is the compile's cost, paid once per model shape),
then adds sample.py's default, which finds the kept step, on the model and on a second checkpoint of its shape with
other weights (whose text is not compared: it is another model's).
--batch N decodes N copies of the prompt at once (RL's rollouts are 144 rows): sample.py --num-samples N, generate on
N rows, and llama.cpp with N sequences in one context, each step one llama_decode of N tokens (llama-cpp-python's
low-level API: its Llama.generate decodes one sequence, which batch 1 keeps using). Tokens/s counts every row's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks.common import (
    GPU_PRESET,
    PROMPT_TOKENS,
    REPO,
    Mode,
    add_config,
    decoding_model_args,
    llama_cpp_installed,
    print_table,
)
from benchmarks.conditions import load_average
from model import GPT, GPTConfig
from quillgpt.errors import UserError
from quillgpt.hf import export_hf
from quillgpt.loading import load_model, write_safetensors
from quillgpt.tokenizer import CharTokenizer, tokenizer_from_dict

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # 65, as CHAR_VOCAB
PROMPT = "ROMEO:\nI will go"  # PROMPT_TOKENS characters
CONTEXT = 512  # the GPU preset's 256 can't hold the prompt and 256 new tokens
# sample.py --verbose's last line: "[256 tokens in 0.63s: 403 tokens/s, DIR, fp32]"
# the rate, not the seconds: those are printed to 0.01 s, which a short run on a small model rounds to 0
OUR_RATE = re.compile(r"\[\d+ tokens in [\d.]+s: ([\d,]+) tokens/s, .*, (\w+)[^,]*\]")
THEIRS = """
import json, sys, time
import torch, transformers
directory, new_tokens, prompt, device, dtype = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), *sys.argv[4:6]
batch = int(sys.argv[6])
model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).to(device).eval()
t0 = time.perf_counter()
ids = torch.tensor([prompt] * batch, device=device)
with torch.no_grad():  # an explicit mask: generate would take the pad id (0, a real character here) for padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0  # generate returns its tokens on the host's side of a sync: all were made
print(json.dumps({"ids": out[0, len(prompt):].tolist(), "seconds": seconds}))
"""
# llama.cpp through llama-cpp-python: its greedy sampler on the file, the threads torch uses, the prompt's ids
LLAMA_CPP = """
import json, sys, time
import llama_cpp
path, new_tokens, prompt, threads = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
ids, t0 = [], time.perf_counter()
for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
    ids.append(token)
    if len(ids) == new_tokens:
        break
seconds = time.perf_counter() - t0
print(json.dumps({"ids": ids, "seconds": seconds}))
"""
# llama.cpp with `batch` sequences in one context, each its own part of the KV cache (a unified cache had every row
# attend over all rows' cells, masked: minutes at 144 rows): the prompts in one llama_decode, then each step one
# llama_decode of a token per sequence, greedy by argmax over each row's logits
LLAMA_CPP_BATCH = """
import json, sys, time
import numpy as np
import llama_cpp as L
path, new_tokens, prompt, threads, batch = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), *map(int, sys.argv[4:6])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_seq_max, params.n_ctx, params.kv_unified = batch, batch * (len(prompt) + new_tokens), False
params.n_batch = params.n_ubatch = batch * len(prompt)
params.n_threads = params.n_threads_batch = threads
ctx = L.llama_init_from_model(model, params)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
tokens = L.llama_batch_init(params.n_batch, 0, batch)
def decode(rows):  # (sequence, position, token, whether its logits are wanted)
    tokens.n_tokens = len(rows)
    for i, (seq, pos, token, out) in enumerate(rows):
        tokens.token[i], tokens.pos[i], tokens.n_seq_id[i], tokens.logits[i] = token, pos, 1, out
        tokens.seq_id[i][0] = seq
    assert L.llama_decode(ctx, tokens) == 0
def greedy(i):
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
t0 = time.perf_counter()
decode([(s, p, t, p == len(prompt) - 1) for s in range(batch) for p, t in enumerate(prompt)])
rows = [[greedy(s * len(prompt) + len(prompt) - 1)] for s in range(batch)]
while len(rows[0]) < new_tokens:
    decode([(s, len(prompt) + len(row) - 1, row[-1], True) for s, row in enumerate(rows)])
    for s, row in enumerate(rows):
        row.append(greedy(s))
seconds = time.perf_counter() - t0
print(json.dumps({"ids": rows[0], "seconds": seconds, "rows_equal": all(row == rows[0] for row in rows)}))
"""


@dataclass
class Side:
    """One decoder's runs: the best process wall time and generation time, and the text of the last run."""

    name: str
    wall: float = float("inf")
    generation: float = float("inf")
    text: str = ""
    note: str = ""
    compared: bool = True  # whether its text should be transformers' (false for another model's)

    def record(self, wall: float, generation: float, text: str) -> None:
        self.wall, self.generation, self.text = min(self.wall, wall), min(self.generation, generation), text


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument(
        "--new-tokens", type=int, default=256, help="tokens generated per run, within the context (default %(default)s)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per side; the best is reported (default %(default)s)")
    p.add_argument("--with-compile", action="store_true", help="also time sample.py --compile")
    p.add_argument(
        "--batch", type=int, default=1, help="rows decoded at once, each the same prompt (default %(default)s)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where both sides decode (default %(default)s); on CUDA transformers runs in bf16 as sample.py's auto does",
    )


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str, str]:
    """(wall seconds, stdout, stderr) of a fresh process (with env added to ours); UserError with its stderr's tail
    when it fails."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise UserError(f"{' '.join(cmd[:3])} ... failed: {done.stderr.strip()[-500:]}")
    return wall, done.stdout, done.stderr


def run_ours(
    side: Side, directory: str, new_tokens: int, flags: list[str], device: str, batch: int, env: dict[str, str]
) -> None:
    cmd = [sys.executable, "sample.py", "--ckpt", directory, "--prompt", PROMPT, "--temperature", "0"]
    cmd += ["--max-new-tokens", str(new_tokens), "--no-stream", "--verbose", "--device", device]
    cmd += ["--num-samples", str(batch)]
    wall, output, log = run_child([*cmd, *flags], env)
    stats = OUR_RATE.findall(log)
    if not stats:
        raise UserError(f"sample.py printed no tokens/s line: {log[-300:]}")
    rate, side.note = stats[-1]
    first = output.split("---------------\n")[0]  # several samples are printed one after another, each ended so
    text = first[len(PROMPT) :].removesuffix("\n")  # sample.py prints the prompt and the text
    side.record(wall, batch * new_tokens / float(rate.replace(",", "")), text)


def run_llama_cpp(side: Side, path: str, new_tokens: int, prompt_ids: list[int], tokenizer, batch: int) -> None:
    script = LLAMA_CPP if batch == 1 else LLAMA_CPP_BATCH
    threads = str(torch.get_num_threads())
    wall, output, _ = run_child(
        [sys.executable, "-c", script, path, str(new_tokens), json.dumps(prompt_ids), threads, str(batch)]
    )
    result = json.loads(output.strip().splitlines()[-1])
    if not result.get("rows_equal", True):
        raise UserError(f"llama.cpp's {batch} rows of the same prompt decoded differently")
    side.record(wall, result["seconds"], tokenizer.decode(result["ids"]))


def their_dtype(device: str) -> str:
    """transformers' dtype: bf16 on a CUDA device that has it (sample.py's auto there), else fp32 (the CPU's)."""
    if (
        device.startswith("cuda")
        and torch.cuda.is_available()
        and torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        return "bfloat16"
    return "float32"


def run_theirs(
    side: Side, directory: str, new_tokens: int, prompt_ids: list[int], tokenizer, device: str, batch: int
) -> None:
    cmd = [
        sys.executable,
        "-c",
        THEIRS,
        directory,
        str(new_tokens),
        json.dumps(prompt_ids),
        device,
        their_dtype(device),
        str(batch),
    ]
    wall, output, _ = run_child(cmd)
    result = json.loads(output.strip().splitlines()[-1])
    side.record(wall, result["seconds"], tokenizer.decode(result["ids"]))


@dataclass
class Comparison:
    """Both decoders' runs on one exported model."""

    margs: GPTConfig
    new_tokens: int
    repeats: int
    device: str
    batch: int
    sides: list[Side]  # ours (and compiled), transformers', then llama.cpp's (f32, bf16) where installed
    theirs: Side

    @property
    def same_text(self) -> bool:
        """Whether every side in fp32 wrote transformers' text (bf16 rounds differently, and may differ)."""
        return all(s.text == self.theirs.text for s in self.sides if s.compared and "bf16" not in s.name + s.note)


def compare(
    config: str, cli: list[str], new_tokens: int, repeats: int, with_compile: bool, device: str, batch: int = 1
) -> Comparison:
    """sample.py (and sample.py --compile) against transformers' generate on the config's model with random weights,
    exported as export.py --hf writes it: --repeats fresh processes a side, in ABBA order (the machine's drift hits
    both alike)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("--vs-transformers needs transformers: pip install -e '.[hf]'") from None
    margs = decoding_model_args(config, ["--model.block_size", str(CONTEXT), *cli])
    if PROMPT_TOKENS + new_tokens > margs.block_size:
        raise UserError(
            f"--new-tokens {new_tokens} + a {PROMPT_TOKENS}-token prompt exceed the context {margs.block_size}"
        )
    if margs.vocab_size != len(SHAKESPEARE_CHARS):  # transformers would draw ids the tokenizer has not
        raise UserError(
            f"--vs-transformers decodes tiny Shakespeare's {len(SHAKESPEARE_CHARS)} characters: "
            f"a vocabulary of {margs.vocab_size} can't be compared"
        )
    # (side, sample.py's flags, the checkpoint: 0 the model exported, 1 another of its shape)
    sides = [(Side("sample.py --no-compile (KV cache, eager step)"), ["--no-compile"], 0)]
    if with_compile:
        sides.append((Side("sample.py's default (the kept compiled step)"), [], 0))
        other = Side("sample.py's default on another checkpoint of the shape (the same kept step)", compared=False)
        sides.append((other, [], 1))
    compiling = Side("sample.py --compile, its first run (compiles and keeps the step; caches cold)")
    theirs = Side(f"transformers generate ({their_dtype(device).replace('float', 'fp').replace('bfloat', 'bf')})")
    llama_cpp = llama_cpp_installed() and device == "cpu"
    gguf = {outtype: Side(f"llama.cpp, --gguf {outtype}") for outtype in (("f32", "bf16") if llama_cpp else ())}
    with tempfile.TemporaryDirectory(prefix="vs_transformers_") as directory:
        torch.manual_seed(0)
        model, chars = GPT(margs), CharTokenizer(list(SHAKESPEARE_CHARS)).to_dict()
        export_hf(model, chars, directory)
        write_safetensors(model, chars, f"{directory}/ours.safetensors")  # GGUF takes the char vocabulary
        checkpoints = [directory, f"{directory}/other"]
        torch.manual_seed(1)
        # exported as the first is: an HF directory has biases (zero where ours has none), so another shape of ours
        export_hf(GPT(margs), chars, checkpoints[1])
        tokenizer = tokenizer_from_dict(load_model(directory).tokenizer)
        prompt_ids = tokenizer.encode(PROMPT)
        # the compile from cold caches, as on a fresh machine: ours and inductor's, the kept step found in the first
        env = {"QUILLGPT_CACHE": f"{directory}/cache", "TORCHINDUCTOR_CACHE_DIR": f"{directory}/inductor"}
        if with_compile:
            run_ours(compiling, directory, new_tokens, ["--compile"], device, batch, env)
        runs = [
            lambda side=side, flags=flags, ckpt=ckpt: run_ours(
                side, checkpoints[ckpt], new_tokens, flags, device, batch, env
            )
            for side, flags, ckpt in sides
        ]
        runs.append(lambda: run_theirs(theirs, directory, new_tokens, prompt_ids, tokenizer, device, batch))
        for outtype, side in gguf.items():
            path = f"{directory}/model-{outtype}.gguf"
            export_cmd = [sys.executable, "export.py", "--ckpt", f"{directory}/ours.safetensors", "--gguf", path]
            subprocess.run([*export_cmd, "--outtype", outtype], cwd=REPO, check=True, capture_output=True)
            runs.append(
                lambda side=side, path=path: run_llama_cpp(side, path, new_tokens, prompt_ids, tokenizer, batch)
            )
        for i in range(repeats):  # alternating, in ABBA order, so that drift hits every side alike
            for run_side in runs if i % 2 == 0 else runs[::-1]:
                run_side()
    ours = [*([compiling] if with_compile else []), *(side for side, _, _ in sides)]
    return Comparison(margs, new_tokens, repeats, device, batch, [*ours, theirs, *gguf.values()], theirs)


def print_comparison(c: Comparison) -> None:
    m, n, theirs = c.margs, c.new_tokens * c.batch, c.theirs
    threads = f", {torch.get_num_threads()} threads" if c.device == "cpu" else ""
    print(
        f"{m.n_layer} layers, n_embd {m.n_embd}, context {m.block_size}, {c.new_tokens} new tokens after a "
        f"{PROMPT_TOKENS}-token prompt, batch {c.batch}, greedy, on {c.device}{threads}; a fresh process per run, best of {c.repeats}"
    )
    llama_f32 = next((s for s in c.sides if s.name == "llama.cpp, --gguf f32"), None)
    print_table(
        [
            "decoder",
            "process wall (s)",
            "vs transformers",
            "generation tokens/s",
            "vs transformers",
            "vs llama.cpp f32",
        ],
        [
            [
                s.name + (f" ({s.note})" if s.note else ""),
                f"{s.wall:.2f}",
                f"{theirs.wall / s.wall:.2f}x",
                f"{n / s.generation:,.0f}",
                f"{theirs.generation / s.generation:.2f}x",
                f"{llama_f32.generation / s.generation:.2f}x" if llama_f32 else "",
            ]
            for s in c.sides
        ],
        left=1,
    )
    dtypes = {s.note for s in c.sides if s.note}
    print(
        f"greedy tokens equal: {c.same_text}"
        + ("" if c.same_text or dtypes <= {"fp32"} else f" (ours ran in {dtypes})")
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    if args.batch < 1:
        raise UserError(f"--batch {args.batch}: decode at least one row")
    comparison = compare(args.config, cli, args.new_tokens, args.repeats, args.with_compile, args.device, args.batch)
    print_comparison(comparison)
    print(load_average())


MODE = Mode(
    "--vs-transformers",
    "greedy decoding, fresh processes: sample.py's default against transformers' generate (and llama.cpp)",
    __doc__,
    add_arguments,
    run,
)
