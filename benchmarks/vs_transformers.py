"""--vs-transformers: greedy decoding of one exported model by sample.py (its defaults; --no-compile: the eager step),
transformers' `generate` (bf16 on CUDA as sample.py's auto, else fp32) and, where llama-cpp-python is installed,
llama.cpp on export.py --gguf's f32 and bf16 files: fresh processes, so that start-up, loading and any compile count
as a user pays them, alternating --repeats times in ABBA order; each side's best process wall time and generation
tokens/s (as each process measures it), and whether the greedy tokens are equal. The model: the config's with a
512-token context, random weights and tiny Shakespeare's characters. --with-compile first runs sample.py --compile with
every cache empty (the compile's cost, once per shape), then the default, which finds the kept step, on the model and
another of its shape. --batch N decodes N copies of the prompt (RL's rollouts are 144 rows); llama.cpp then N
sequences in one context, one llama_decode of N tokens a step (its low-level API).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import partial

import torch

from benchmarks.common import GPU_PRESET, Mode, add_config, bench_model_args, print_table, run_child
from benchmarks.conditions import llama_cpp_installed, load_average
from model import GPT, GPTConfig
from quillgpt.errors import UserError
from quillgpt.hf import export_hf
from quillgpt.loading import load_model, write_safetensors
from quillgpt.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_dict

SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # 65, as CHAR_VOCAB
PROMPT = "ROMEO:\nI will go"  # 16 characters: 16 tokens
CONTEXT = 512  # the GPU preset's 256 can't hold the prompt and 256 new tokens
# sample.py --verbose's last line: "[256 tokens in 0.63s: 403 tokens/s, DIR, bf16 on cpu]" (the plan's label)
# the rate, not the seconds: those are printed to 0.01 s, which a short run on a small model rounds to 0
OUR_RATE = re.compile(r"\[\d+ tokens in [\d.]+s: ([\d,]+) tokens/s, .*, (\w+)[^,]*\]")
THEIRS = """
import json, sys, time, torch, transformers
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
import itertools, json, sys, time
import llama_cpp
path, new_tokens, prompt, threads = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
t0 = time.perf_counter()
ids = list(itertools.islice(llm.generate(prompt, top_k=1, temp=0.0, reset=True), new_tokens))
print(json.dumps({"ids": ids, "seconds": time.perf_counter() - t0}))
"""
# llama.cpp with `batch` sequences in one context, each its own part of the KV cache (a unified cache had every row
# attend over all rows' cells, masked: minutes at 144 rows): the prompts in one llama_decode, then each step one
# llama_decode of a token per sequence, greedy by argmax over each row's logits
LLAMA_CPP_BATCH = """
import json, sys, time
import numpy as np, llama_cpp as L
path, new_tokens, prompt = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
threads, batch = map(int, sys.argv[4:6])
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
    for s, row in enumerate(rows): row.append(greedy(s))
print(json.dumps({"ids": rows[0], "seconds": time.perf_counter() - t0, "rows_equal": all(r == rows[0] for r in rows)}))
"""


@dataclass
class Side:
    """One decoder's runs: the best process wall time and generation time, and the text of the last run."""

    name: str
    wall: float = float("inf")
    generation: float = float("inf")
    text: str = ""
    note: str = ""  # the precision sample.py decoded in
    compared: bool = True  # whether its text should be transformers' (false for another model's)

    def record(self, wall: float, generation: float, text: str) -> None:
        self.wall, self.generation, self.text = min(self.wall, wall), min(self.generation, generation), text


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, GPU_PRESET)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens a run generates (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side; the best is reported (default %(default)s)")
    p.add_argument("--with-compile", action="store_true", help="also time sample.py --compile")
    p.add_argument("--batch", type=int, default=1, help="rows decoded at once, each the prompt (default %(default)s)")
    p.add_argument("--device", default="cpu", help="where both sides decode (default %(default)s; CUDA: bf16 both)")


def run_ours(side: Side, ckpt: str, flags: list[str], new_tokens: int, device: str, batch: int, env: dict) -> None:
    cmd = [sys.executable, "sample.py", "--ckpt", ckpt, "--prompt", PROMPT, "--temperature", "0", "--no-stream"]
    cmd += ["--max-new-tokens", str(new_tokens), "--verbose", "--device", device, "--num-samples", str(batch)]
    wall, output, log = run_child([*cmd, *flags], env)
    stats = OUR_RATE.findall(log)
    if not stats:
        raise UserError(f"sample.py printed no tokens/s line: {log[-300:]}")
    rate, side.note = stats[-1]
    first = output.split("---------------\n")[0]  # several samples are printed one after another, each ended so
    text = first[len(PROMPT) :].removesuffix("\n")  # sample.py prints the prompt and the text
    side.record(wall, batch * new_tokens / float(rate.replace(",", "")), text)


def run_theirs(side: Side, tokenizer: Tokenizer, script: str, *args: object) -> None:
    """transformers or llama.cpp: `python -c script args`, whose last line is JSON: the first row's ids, the
    generation's seconds and (llama.cpp's batch) whether every row decoded the same."""
    wall, output, _ = run_child([sys.executable, "-c", script, *map(str, args)])
    result = json.loads(output.strip().splitlines()[-1])
    if not result.get("rows_equal", True):
        raise UserError(f"{side.name}: the rows of the same prompt decoded differently")
    side.record(wall, result["seconds"], tokenizer.decode(result["ids"]))


def their_dtype(device: str) -> str:
    """transformers' dtype: bf16 on a CUDA device that has it (sample.py's auto there), else fp32 (the CPU's)."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return "bfloat16" if cuda and torch.cuda.is_bf16_supported(including_emulation=False) else "float32"


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


def comparable_model(config: str, cli: list[str], new_tokens: int) -> GPTConfig:
    """The config's model with a 512-token context, checked to hold the prompt and the new tokens, in tiny
    Shakespeare's characters (transformers would draw ids another tokenizer has not)."""
    if importlib.util.find_spec("transformers") is None:  # only the children import it
        raise UserError("--vs-transformers needs transformers: pip install -e '.[hf]'")
    margs = bench_model_args(config, ["--model.block_size", str(CONTEXT), *cli])
    if len(PROMPT) + new_tokens > margs.block_size:
        raise UserError(f"--new-tokens {new_tokens} and a 16-token prompt exceed the context {margs.block_size}")
    if margs.vocab_size != len(SHAKESPEARE_CHARS):
        raise UserError(f"--vs-transformers decodes 65 characters: no vocabulary of {margs.vocab_size}")
    return margs


def export(margs: GPTConfig, directory: str) -> Tokenizer:
    """The model with random weights as export.py --hf writes it, beside it as safetensors (export.py --gguf reads the
    char vocabulary there), and another of its shape in other/, exported alike; the tokenizer the export holds."""
    chars = CharTokenizer(list(SHAKESPEARE_CHARS)).to_dict()
    for seed, path in ((0, directory), (1, f"{directory}/other")):
        torch.manual_seed(seed)
        model = GPT(margs)
        export_hf(model, chars, path)
        if seed == 0:
            write_safetensors(model, chars, f"{directory}/ours.safetensors")
    return tokenizer_from_dict(load_model(directory).tokenizer)


def compare(
    config: str, cli: list[str], new_tokens: int, repeats: int, with_compile: bool, device: str, batch: int = 1
) -> Comparison:
    """sample.py (and sample.py --compile) against transformers' generate (and llama.cpp) on the config's model with
    random weights: --repeats fresh processes a side, in ABBA order (the machine's drift hits every side alike)."""
    margs = comparable_model(config, cli, new_tokens)
    # (side, sample.py's flags, the checkpoint: "" the model exported, "/other" another of its shape)
    ours = [(Side("sample.py --no-compile (KV cache, eager step)"), ["--no-compile"], "")]
    if with_compile:
        ours.append((Side("sample.py's default (the kept compiled step)"), [], ""))
        other = Side("sample.py's default on another checkpoint of the shape (the same kept step)", compared=False)
        ours.append((other, [], "/other"))
    compiling = Side("sample.py --compile, its first run (compiles and keeps the step; caches cold)")
    dtype = their_dtype(device)
    theirs = Side(f"transformers generate ({dtype.replace('float', 'fp').replace('bfloat', 'bf')})")
    llama_cpp = llama_cpp_installed() and device == "cpu"
    gguf = {outtype: Side(f"llama.cpp, --gguf {outtype}") for outtype in (("f32", "bf16") if llama_cpp else ())}
    with tempfile.TemporaryDirectory(prefix="vs_transformers_") as directory:
        tokenizer = export(margs, directory)
        decode = (new_tokens, json.dumps(tokenizer.encode(PROMPT)))  # the scripts' arguments after the model's path
        # the compile from cold caches, as on a fresh machine: ours and inductor's, the kept step found in the first
        env = {"QUILLGPT_CACHE": f"{directory}/cache", "TORCHINDUCTOR_CACHE_DIR": f"{directory}/inductor"}
        mine = (new_tokens, device, batch, env)  # run_ours's arguments after the flags
        if with_compile:
            run_ours(compiling, directory, ["--compile"], *mine)
        runs = [partial(run_ours, side, directory + ckpt, flags, *mine) for side, flags, ckpt in ours]
        runs.append(partial(run_theirs, theirs, tokenizer, THEIRS, directory, *decode, device, dtype, batch))
        for outtype, side in gguf.items():
            path = f"{directory}/model-{outtype}.gguf"
            export_cmd = [sys.executable, "export.py", "--ckpt", f"{directory}/ours.safetensors", "--gguf", path]
            run_child([*export_cmd, "--outtype", outtype])
            script = LLAMA_CPP if batch == 1 else LLAMA_CPP_BATCH
            runs.append(partial(run_theirs, side, tokenizer, script, path, *decode, torch.get_num_threads(), batch))
        for i in range(repeats):  # alternating, in ABBA order, so that drift hits every side alike
            for run_side in runs if i % 2 == 0 else runs[::-1]:
                run_side()
    sides = [*([compiling] if with_compile else []), *(side for side, _, _ in ours), theirs, *gguf.values()]
    return Comparison(margs, new_tokens, repeats, device, batch, sides, theirs)


def print_comparison(c: Comparison) -> None:
    m, n, theirs = c.margs, c.new_tokens * c.batch, c.theirs
    threads = f", {torch.get_num_threads()} threads" if c.device == "cpu" else ""
    print(
        f"{m.n_layer} layers, n_embd {m.n_embd}, context {m.block_size}, {c.new_tokens} new tokens after a "
        f"{len(PROMPT)}-token prompt, batch {c.batch}, greedy, on {c.device}{threads}; a fresh process per run, best "
        f"of {c.repeats}"
    )
    f32 = next((s for s in c.sides if s.name == "llama.cpp, --gguf f32"), None)
    header = ["decoder", "process wall (s)", "vs transformers", "generation tokens/s", "vs transformers"]
    rows = [
        [s.name + (f" ({s.note})" if s.note else ""), f"{s.wall:.2f}", f"{theirs.wall / s.wall:.2f}x"]
        + [f"{n / s.generation:,.0f}", f"{theirs.generation / s.generation:.2f}x"]
        + [f"{f32.generation / s.generation:.2f}x" if f32 else ""]
        for s in c.sides
    ]
    print_table([*header, "vs llama.cpp f32"], rows)
    dtypes = {s.note for s in c.sides if s.note}
    print(f"greedy tokens equal: {c.same_text}" + ("" if c.same_text or dtypes <= {"fp32"} else f" (ours in {dtypes})"))


def run(args: argparse.Namespace, cli: list[str]) -> None:
    if args.batch < 1:
        raise UserError(f"--batch {args.batch}: decode at least one row")
    comparison = compare(args.config, cli, args.new_tokens, args.repeats, args.with_compile, args.device, args.batch)
    print_comparison(comparison)
    print(load_average())


SUMMARY = "greedy decoding, fresh processes: sample.py's default against transformers' generate (and llama.cpp)"
MODE = Mode("--vs-transformers", SUMMARY, __doc__, add_arguments, run)
