"""Robustness: no lost work, no code run from a checkpoint, no traceback for a user's mistake.

Real processes where the promise is about a process (SIGKILL, exit codes, one-line errors), real
files everywhere (a crafted pickle that would run code, truncated and bit-flipped checkpoints,
corrupted datasets, a full tmpfs). Disk-full is also injected at the OS boundary (os.fsync raising
ENOSPC for checkpoint temp files) so it is tested where mounting a tmpfs is not allowed.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, resume_in_subprocess, tiny_overrides
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillgpt.checkpoint import RunDir, load_checkpoint, resolve_run
from quillgpt.errors import UserError
from quillgpt.loading import model_from_checkpoint
from quillgpt.tokenizer import tokenizer_from_dict
from train import train

WORKERS = 2  # subprocesses at once: the CI machine has 2 cores
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ---- helpers ----------------------------------------------------------------------------------------


def cli_args(overrides: dict) -> list[str]:
    return [x for k, v in overrides.items() for x in (f"--{k}", str(v))]


def run_script(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=CHILD_ENV
    )


def run_scripts(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run several scripts, WORKERS at a time (each pays ~2 s of torch import)."""
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {name: pool.submit(run_script, args) for name, args in commands.items()}
        return {name: f.result() for name, f in futures.items()}


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, which contains every needle; returns that line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr)
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def temp_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(".*.tmp"))


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory) -> RunDir:
    """A finished 4-iteration run with ckpt_last, ckpt_best and step checkpoints."""
    out = tmp_path_factory.mktemp("trained")
    train(
        None,
        overrides=tiny_overrides(
            tiny_data, out, **{"training.max_iters": 4, "training.save_interval": 2, "training.eval_interval": 2}
        ),
    )
    return RunDir(out / "t")


# ---- 1. atomic everything ---------------------------------------------------------------------------

# Writes that may bypass atomic_write, by module (its path from the repository root) and enclosing function:
# prepare appends to its partial train.bin/val.bin in the work directory, whose complete length its journal
# records (a restart cuts them back to that), and moves them into the dataset only when they are finished.
ALLOWED_DIRECT_WRITES = {("quillgpt/prepare/workdir.py", "PartialBins.__init__")}
ALWAYS_DIRECT = {"write_text", "write_bytes", "tofile", "copy", "copy2", "copyfile", "move"}
# serialisers, with the position of their destination argument; writing into a file object is fine (by
# convention the `with atomic_write(...) as f` handle or a BytesIO named buf), writing to a path is not
TO_DESTINATION = {"save": 1, "dump": 1, "savefig": 0, "savez": 0, "savez_compressed": 0}
FILE_OBJECTS = {"f", "buf", "out", "f_dst"}


FILE_OPENERS = {"gzip", "bz2", "lzma", "io", "codecs"}  # module.open(path, mode), as the builtin open


def write_mode(node: ast.Call) -> str | None:
    """The mode of open(path, mode) / gzip.open(path, mode) / path.open(mode), when it is a constant."""
    args = node.args[1:] if path_first(node) else node.args
    mode = args[0] if args else next((k.value for k in node.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else None


def path_first(node: ast.Call) -> bool:
    func = node.func
    return isinstance(func, ast.Name) or (
        isinstance(func, ast.Attribute) and getattr(func.value, "id", "") in FILE_OPENERS
    )


def direct_write(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name == "open" and getattr(getattr(func, "value", None), "id", "") == "os":  # os.open(path, flags)
        return any(flag in ast.unparse(node) for flag in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"))
    if name == "open":
        has_mode = len(node.args) > path_first(node) or any(k.arg == "mode" for k in node.keywords)
        mode = write_mode(node)
        to_proc = (
            bool(node.args) and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("/proc/")
        )
        if has_mode and mode is None:
            return not to_proc  # a mode computed at run time may be a write mode
        return mode is not None and any(c in mode for c in "wax+") and not to_proc
    if name in {"copy", "deepcopy"} and getattr(getattr(func, "value", None), "id", "") == "copy":
        return False  # copy.copy(obj): an object's shallow copy, not a file's
    if name in ALWAYS_DIRECT:
        return True
    if name in TO_DESTINATION and isinstance(func, ast.Attribute):
        owner = getattr(func.value, "id", "")
        if name in ("save", "dump") and owner not in ("torch", "np", "numpy", "json", "pickle"):
            return False  # e.g. safetensors' save() returns bytes; dcp.save writes its own directory
        position = TO_DESTINATION[name]
        target = node.args[position] if len(node.args) > position else None
        return not (isinstance(target, ast.Name) and target.id in FILE_OBJECTS)
    return False


def calls_by_function(tree: ast.AST, scope: str = "") -> Iterator[tuple[str, ast.Call]]:
    """(qualified name of the enclosing function, call) for every call in the tree."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from calls_by_function(node, f"{scope}.{node.name}".lstrip("."))
            continue
        if isinstance(node, ast.Call):
            yield scope, node
        yield from calls_by_function(node, scope)


def repo_modules() -> list[Path]:
    """Every module of the code: the scripts and model.py at the repository root, the quillgpt package and the
    benchmarks."""
    return sorted([*REPO_ROOT.glob("*.py"), *REPO_ROOT.glob("quillgpt/**/*.py"), *REPO_ROOT.glob("benchmarks/**/*.py")])


def module_name(path: Path) -> str:
    """A module's path from the repository root (quillgpt/prepare/workdir.py); its bare name outside the repo."""
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name


def direct_write_sites(path: Path) -> list[tuple[str, str, ast.Call]]:
    """(module, enclosing function, call) of every call in a module that writes a file without atomic_write:
    open(..., 'w') or with a mode computed at run time, Path.write_*, torch.save or np.save to a path, savefig to a
    path, tofile, json.dump to a path, shutil copies."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(module_name(path), scope, node) for scope, node in calls_by_function(tree) if direct_write(node)]


def direct_writes(path: Path) -> list[str]:
    """The direct writes of a module that ALLOWED_DIRECT_WRITES does not allow, as "module:line call"."""
    return [
        f"{module}:{node.lineno} {ast.unparse(node)[:60]}"
        for module, scope, node in direct_write_sites(path)
        if (module, scope) not in ALLOWED_DIRECT_WRITES
    ]


def test_the_write_audit_catches_direct_writes(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "open(p, 'w')\np.write_text('x')\ntorch.save(obj, 'ckpt.pt')\nfig.savefig(out_path)\n"
        "a.tofile(p)\njson.dump(d, open(p, 'w'))\nshutil.copyfile(a, b)\nPath(p).open('a')\n"
        "def f():\n    open(p, 'r+b' if x else 'w+b')\ngzip.open(p, 'wb')\nos.open(p, os.O_WRONLY)\n"
    )
    good = tmp_path / "good.py"
    good.write_text(
        "open(p, 'rb')\nopen('/proc/self/clear_refs', 'w')\ntorch.save(obj, f)\nfig.savefig(buf)\n"
        "data = save(state)\ngzip.open(p, 'rb')\nos.open(p, os.O_RDONLY)\np.open()\ncopy.copy(obj)\n"
    )
    assert len(direct_writes(bad)) == 12 and direct_writes(good) == []


def test_the_audits_read_the_scripts_and_the_whole_package():
    read = {module_name(p) for p in repo_modules()}
    some = {"train.py", "model.py", "quillgpt/files.py", "quillgpt/prepare/workdir.py", "benchmarks/common.py"}
    assert some <= read, f"the audits miss {some - read}"


def test_every_write_in_the_repo_goes_through_atomic_write():
    offenders = [w for path in repo_modules() for w in direct_writes(path)]
    assert offenders == [], "write these through quillgpt.files.atomic_write: " + "; ".join(offenders)


def test_every_allowed_direct_write_is_still_in_the_code():
    sites = {(module, scope) for path in repo_modules() for module, scope, _ in direct_write_sites(path)}
    stale = ALLOWED_DIRECT_WRITES - sites
    assert not stale, f"ALLOWED_DIRECT_WRITES names writes the code no longer makes (moved or renamed?): {stale}"


def test_every_torch_load_is_weights_only():
    for path in repo_modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and getattr(node.func.value, "id", "") == "torch"
            ):
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, (
                    f"{module_name(path)}:{node.lineno} torch.load without weights_only=True"
                )


KILL_TRIALS = 12
KILL_WINDOW_S = 0.6  # kill after a seeded random delay in [0, KILL_WINDOW_S) once a new checkpoint exists
MID_WRITE_EVERY = 3  # every third trial kills inside a write for certain (stop_inside_a_write), whatever the load


def wait_for_new_checkpoint(run: RunDir, old_inode: int | None, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Until ckpt_last.pt is a file other than old_inode (atomic_write replaces the inode on every save)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if run.last.stat().st_ino != old_inode:
                return
        except FileNotFoundError:
            pass
        assert proc.poll() is None, f"train.py exited with {proc.returncode} before writing a checkpoint"
        time.sleep(0.01)
    raise AssertionError("no new checkpoint in time")


def stop_inside_a_write(run: RunDir, proc: subprocess.Popen, timeout: float = 90) -> None:
    """SIGSTOP the run at a moment its checkpoint's temp file exists (a write under way), so that the SIGKILL that
    follows lands inside the write whatever the machine's load: a stop that came just after the write had ended is
    undone (SIGCONT) and the next write is waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"train.py exited with {proc.returncode}"
        if temp_files(run.path):
            proc.send_signal(signal.SIGSTOP)
            if temp_files(run.path):
                return
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError("no write caught under way in time")


def kill_chain(chain: int, trials: int, data_dir: Path, out_dir: Path) -> dict:
    """SIGKILL a run `trials` times; each restart is `--resume`, so every trial after the first also proves that
    the previous kill left a checkpoint --resume continues from (the "resuming ... at iter N" line). Most kills
    come at a random moment after a new checkpoint; every MID_WRITE_EVERY-th lands inside a write for certain."""
    rng = random.Random(7000 + chain)
    over = tiny_overrides(
        data_dir,
        out_dir,
        **{
            "run.name": f"chain{chain}",
            "training.max_iters": 10**6,
            "training.save_interval": 1,
            "training.eval_interval": 0,
            "training.log_interval": 0,
            "training.keep_last": 2,
            # a 1.3 MB checkpoint every step: ~40% of the time a write is under way
            "model.n_embd": 64,
        },
    )
    run = RunDir(out_dir / f"chain{chain}")
    stats = {"trials": 0, "mid_write": 0, "resumed": 0}
    left_at = None
    for trial in range(trials):
        args = cli_args(over) if left_at is None else ["--resume", str(run.path)]
        log = out_dir / f"chain{chain}-{trial}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "train.py", *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=CHILD_ENV
            )
            try:
                wait_for_new_checkpoint(run, run.last.stat().st_ino if run.last.exists() else None, proc)
                if trial % MID_WRITE_EVERY == MID_WRITE_EVERY - 1:
                    stop_inside_a_write(run, proc)
                else:
                    time.sleep(rng.uniform(0, KILL_WINDOW_S))
            finally:
                proc.kill()
                proc.wait()
        stats["trials"] += 1
        stats["mid_write"] += bool(temp_files(run.path))
        if left_at is not None:
            assert f"at iter {left_at} " in log.read_text(), f"trial {trial} did not resume from iter {left_at}"
            stats["resumed"] += 1
        ckpt = load_checkpoint(run.latest())  # raises on a torn or missing checkpoint
        assert left_at is None or ckpt["iter_num"] > left_at
        left_at = ckpt["iter_num"]
    stats["left_at"] = left_at
    return stats


@pytest.mark.slow
def test_sigkill_at_random_moments_always_leaves_a_resumable_checkpoint(tiny_data, tmp_path):
    with ThreadPoolExecutor(WORKERS) as pool:
        chains = list(pool.map(lambda c: kill_chain(c, KILL_TRIALS // WORKERS, tiny_data, tmp_path), range(WORKERS)))
    print(
        f"\nkill trials: {sum(c['trials'] for c in chains)}, killed mid-write: {sum(c['mid_write'] for c in chains)}, "
        f"resumed from the killed run's checkpoint: {sum(c['resumed'] for c in chains)}"
    )
    assert sum(c["trials"] for c in chains) == KILL_TRIALS
    assert sum(c["mid_write"] for c in chains) >= KILL_TRIALS // MID_WRITE_EVERY  # the kills land inside writes
    # the final check: resume for two more iterations and finish cleanly
    run = RunDir(tmp_path / "chain0")
    left_at = chains[0]["left_at"]
    resume_in_subprocess(run.path, left_at + 2)
    assert load_checkpoint(run.latest())["iter_num"] == left_at + 2
    assert temp_files(run.path) == []  # the killed runs' temp files were cleaned up at start-up
    assert json.loads((run.path / "train_log.json").read_text())["history"] is not None


def test_resume_from_a_named_checkpoint_file_resumes_that_file(trained_run, tmp_path):
    run = RunDir(tmp_path / "t")
    shutil.copytree(trained_run.path, run.path)
    step2 = run.step(2)
    assert load_checkpoint(run.latest())["iter_num"] == 4 and step2.is_file()
    result = train(None, overrides={"training.max_iters": 3}, resume=str(step2))
    assert result.iterations == 3  # resumed at 2, not at the run's latest (4)
    assert load_checkpoint(run.last)["iter_num"] == 3


def test_train_restores_the_callers_signal_handlers(tiny_data, tmp_path):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    train(None, overrides=tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 1}))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# ---- 2. safe loading --------------------------------------------------------------------------------


class CodeOnUnpickle:
    """Unpickling this creates `marker` (a stand-in for any code an attacker would run)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def craft_malicious_checkpoint(path: Path, marker: Path) -> None:
    torch.save(
        {"model": {"w": torch.zeros(1)}, "model_args": {"vocab_size": 65}, "payload": CodeOnUnpickle(marker)}, path
    )


def test_the_crafted_checkpoint_really_runs_code_with_an_unsafe_load(tmp_path):
    """Proves the payload is live, so the refusal tests below cannot pass for the wrong reason."""
    marker = tmp_path / "pwned"
    craft_malicious_checkpoint(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)  # what we must never do
    assert marker.exists()


@pytest.mark.slow
def test_malicious_checkpoint_is_refused_by_train_and_sample(tmp_path):
    marker = tmp_path / "pwned"
    run = tmp_path / "evil_run"
    run.mkdir()
    craft_malicious_checkpoint(run / "ckpt_last.pt", marker)
    with pytest.raises(UserError, match="refusing to load"):
        load_checkpoint(run / "ckpt_last.pt")
    procs = run_scripts(
        {"train": ["train.py", "--resume", str(run)], "sample": ["sample.py", "--ckpt", str(run / "ckpt_last.pt")]}
    )
    for proc in procs.values():
        assert_user_error(proc, "refusing to load", "ckpt_last.pt")
    assert not marker.exists()


def test_truncated_checkpoint_names_the_file(trained_run, tmp_path):
    data = trained_run.last.read_bytes()
    half = tmp_path / "half.pt"
    half.write_bytes(data[: len(data) // 2])
    for cut in (0, 10, len(data) // 3, len(data) // 2, len(data) - 1):
        half.write_bytes(data[:cut])
        with pytest.raises(UserError, match=re.escape(str(half))):
            load_checkpoint(half)
    half.write_bytes(data[: len(data) // 2])
    assert_user_error(run_script(["sample.py", "--ckpt", str(half)]), str(half), "truncated or corrupt")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4))
def test_bit_flipped_checkpoint_is_refused_or_identical(trained_run, tmp_path, flips):
    """torch.load alone loads most flipped files silently (the flips land in the weights); the CRC check refuses
    them. A flip that still loads must have hit bytes that don't matter (zip padding, unused header fields)."""
    original = trained_run.last.read_bytes()
    damaged = bytearray(original)
    for where, xor in flips:
        damaged[int(where * len(damaged))] ^= xor
    path = tmp_path / "flipped.pt"
    path.write_bytes(damaged)
    try:
        ckpt = load_checkpoint(path)
    except UserError as e:
        assert str(path) in str(e)
        return
    reference = load_checkpoint(trained_run.last)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in reference["model"].items())
    assert ckpt["config"] == reference["config"] and ckpt["iter_num"] == reference["iter_num"]


def test_a_corrupt_latest_checkpoint_names_an_older_one_that_resumes(trained_run, tmp_path):
    run = RunDir(tmp_path / "t")
    shutil.copytree(trained_run.path, run.path)  # copies: the step files are no longer hard links to ckpt_last
    damaged = bytearray(run.last.read_bytes())
    middle = len(damaged) // 2
    damaged[middle : middle + 16] = bytes(b ^ 0xFF for b in damaged[middle : middle + 16])
    run.last.write_bytes(damaged)
    with pytest.raises(
        UserError, match=rf"{re.escape(str(run.last))} is corrupt.*--resume {re.escape(str(run.step(4)))}"
    ):
        resolve_run(None, [], str(run.path), False, 1)
    assert train(None, overrides={"training.max_iters": 5}, resume=str(run.step(4))).iterations == 5


@pytest.mark.slow
def test_architecture_and_vocabulary_mismatches_are_named(trained_run, tiny_data, tmp_path):
    ckpt = load_checkpoint(trained_run.last)
    ckpt["model_args"]["n_embd"] = 64  # the weights are 32 wide
    torch.save(ckpt, tmp_path / "reshaped.pt")
    other = tmp_path / "data"
    (other / "txt").mkdir(parents=True)
    (other / "txt" / "abc.txt").write_text("abcab cabca\n" * 400, encoding="utf-8")
    from quillgpt.prepare import prepare_dataset

    prepare_dataset("abc", input_path=str(other / "txt" / "abc.txt"), data_dir=other, verbose=False)
    procs = run_scripts(
        {
            "resume_wider": ["train.py", "--resume", str(trained_run.path), "--model.n_embd", "64"],
            "resume_other_vocab": [
                "train.py",
                "--resume",
                str(trained_run.path),
                "--data.dataset",
                "abc",
                "--data.data_dir",
                str(other),
            ],
            "sample_reshaped": ["sample.py", "--ckpt", str(tmp_path / "reshaped.pt"), "--max-new-tokens", "2"],
        }
    )
    assert_user_error(procs["resume_wider"], "n_embd")
    assert_user_error(procs["resume_other_vocab"], "vocabulary mismatch")
    assert_user_error(procs["sample_reshaped"], "reshaped.pt", "does not match the model", "32]", "64]")


plain_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(0, 5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tampered_checkpoint_contents_load_or_give_a_user_error(trained_run, tmp_path, data):
    """A well-formed file with wrong contents (edited by hand, another tool, another version): sampling's and
    resuming's loaders either accept it or raise UserError; never another exception."""
    ckpt = load_checkpoint(trained_run.last)
    section = data.draw(st.sampled_from(["top", "model_args", "model", "config"]))
    if section == "top":
        ckpt[data.draw(st.sampled_from(sorted(ckpt)))] = data.draw(plain_values)
    elif section == "model_args":
        ckpt["model_args"][data.draw(st.sampled_from(sorted(ckpt["model_args"]) + ["extra"]))] = data.draw(plain_values)
    elif section == "model":
        key = data.draw(st.sampled_from(sorted(ckpt["model"])))
        ckpt["model"][key] = data.draw(st.one_of(plain_values, st.just(torch.zeros(3)), st.just(torch.zeros(0))))
    else:
        table = data.draw(st.sampled_from(sorted(ckpt["config"])))
        ckpt["config"][table] = data.draw(st.one_of(plain_values, st.just({**ckpt["config"][table], "junk": 1})))
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    torch.save(ckpt, run / "ckpt_last.pt")
    for load in (sampling_load, lambda path: resolve_run(None, [], str(path.parent), False, 1)):
        try:
            load(run / "ckpt_last.pt")
        except UserError:
            pass


def sampling_load(path: Path) -> None:
    """What sample.py needs from a checkpoint: the model and the tokenizer."""
    ckpt = load_checkpoint(path)
    model_from_checkpoint(ckpt, path)
    tokenizer_from_dict(ckpt.get("tokenizer"))


# ---- 3. data checks at start-up ---------------------------------------------------------------------


def corrupt_bin_size(d: Path) -> None:
    with open(d / "train.bin", "ab") as f:
        f.write(b"\x01")


def corrupt_token_id(d: Path) -> None:
    ids = np.memmap(d / "train.bin", dtype=np.uint16, mode="r+")
    ids[100] = 60000
    ids.flush()


def edit_meta(**fields):
    def edit(d: Path) -> None:
        meta = json.loads((d / "meta.json").read_text())
        meta.update(fields)
        (d / "meta.json").write_text(json.dumps(meta))

    return edit


def write_file(name: str, content: str):
    return lambda d: (d / name).write_text(content)


def remove_file(name: str):
    return lambda d: (d / name).unlink()


# case -> (how to damage data/tiny, extra train.py arguments, words the one error line must contain)
DATA_CASES = {
    "bin_size_not_a_dtype_multiple": (corrupt_bin_size, [], ["train.bin", "not a multiple", "uint16"]),
    "token_id_beyond_vocab": (corrupt_token_id, [], ["token id 60000", "vocabulary"]),
    "dataset_shorter_than_block": (lambda d: None, ["--model.block_size", "20000"], ["fewer than block_size + 1"]),
    "empty_val_split": (write_file("val.bin", ""), [], ["val.bin", "empty"]),
    "meta_missing": (remove_file("meta.json"), [], ["no meta.json", "--input"]),
    "meta_not_json": (write_file("meta.json", "{not json"), [], ["meta.json", "malformed"]),
    "meta_not_an_object": (write_file("meta.json", "[1, 2]"), [], ["meta.json", "malformed"]),
    "meta_field_wrong_type": (edit_meta(tokenizer="char"), [], ["meta.json", "'tokenizer'"]),
    "meta_vocab_disagrees_with_tokenizer": (
        edit_meta(vocab_size=70),
        ["--data.processed_dir", "{dir}"],
        ["vocab_size 70", "tokenizer.json"],
    ),
    "meta_missing_processed_dir": (
        remove_file("meta.json"),
        ["--data.processed_dir", "{dir}"],
        ["meta.json", "not found"],
    ),
    "other_tokenizer_than_config": (lambda d: None, ["--data.tokenizer", "bpe"], ["char tokenizer", "bpe", "--reset"]),
}


def damaged_copy(tiny_data: Path, root: Path, case: str) -> tuple[Path, list[str]]:
    """data/tiny copied under root/case and damaged as DATA_CASES says; returns it and train.py's arguments."""
    damage, extra, _ = DATA_CASES[case]
    data_dir = root / case
    shutil.copytree(tiny_data / "tiny", data_dir / "tiny")
    damage(data_dir / "tiny")
    over = tiny_overrides(data_dir, root / "out" / case, **{"training.max_iters": 1})
    return data_dir, [*cli_args(over), *[a.replace("{dir}", str(data_dir / "tiny")) for a in extra]]


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_is_a_user_error_naming_the_fault(case, tiny_data, tmp_path):
    """train() refuses each damaged dataset with a UserError (one line, exit 2 from the scripts) that names it."""
    _, args = damaged_copy(tiny_data, tmp_path, case)
    with pytest.raises(UserError) as err:
        train(None, overrides=args)
    message = str(err.value)
    assert "\n" not in message and all(needle in message for needle in DATA_CASES[case][2]), message


@pytest.mark.slow
def test_bad_data_from_train_py_is_one_line_and_exit_2(tiny_data, tmp_path):
    commands = {
        case: ["train.py", *damaged_copy(tiny_data, tmp_path, case)[1]]
        for case in ("token_id_beyond_vocab", "meta_not_json")
    }
    for case, proc in run_scripts(commands).items():
        assert_user_error(proc, *DATA_CASES[case][2])


# ---- 4. disk full -----------------------------------------------------------------------------------


def fail_checkpoint_fsyncs(monkeypatch, should_fail) -> list[int | None]:
    """Make os.fsync raise ENOSPC for checkpoint temp files when should_fail(n) for the n-th (1-based) such write.
    Returns a list that gets, at each failure, the iter_num of ckpt_last.pt as it is on disk at that moment."""
    real_fsync, count, seen = os.fsync, [0], []

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if re.search(r"/\.ckpt_\w+\.pt\.\w+\.tmp$", name):
            count[0] += 1
            if should_fail(count[0]):
                last = Path(name).parent / "ckpt_last.pt"
                seen.append(load_checkpoint(last)["iter_num"] if last.exists() else None)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_periodic_save_failing_with_enospc_keeps_training_and_retries(tiny_data, tmp_path, monkeypatch, capsys):
    seen = fail_checkpoint_fsyncs(monkeypatch, lambda n: n in (2, 3, 4))
    result = train(
        None,
        overrides=tiny_overrides(
            tiny_data, tmp_path, **{"training.max_iters": 6, "training.save_interval": 1, "training.eval_interval": 0}
        ),
    )
    err = capsys.readouterr().err
    run = RunDir(tmp_path / "t")
    assert result.iterations == 6 and load_checkpoint(run.latest())["iter_num"] == 6
    assert seen == [1, 1, 1]  # while the saves of iters 2-4 failed, iter 1's checkpoint stayed in place
    assert err.count("not saved") == 3 and "No space left on device" in err and "the last good checkpoint is" in err
    assert temp_files(run.path) == []


def test_final_save_failing_names_the_last_good_checkpoint_which_resumes(tiny_data, tmp_path, monkeypatch):
    fail_checkpoint_fsyncs(monkeypatch, lambda n: n > 1)
    over = tiny_overrides(
        tiny_data, tmp_path, **{"training.max_iters": 3, "training.save_interval": 1, "training.eval_interval": 0}
    )
    with pytest.raises(UserError, match=r"final checkpoint was not saved.*ckpt_last\.pt \(iter 1\)"):
        train(None, overrides=over)
    run = RunDir(tmp_path / "t")
    assert load_checkpoint(run.latest())["iter_num"] == 1 and temp_files(run.path) == []
    monkeypatch.undo()  # space again
    assert train(None, overrides={"training.max_iters": 3}, resume=str(run.path)).iterations == 3


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """An 800 kB tmpfs: room for config, log and three tiny checkpoints, not for a fourth plus its temp file."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("tmpfs mounts are not allowed here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_really_full_disk_exits_2_naming_the_last_good_checkpoint(tiny_data, tiny_tmpfs):
    """800 kB tmpfs: periodic saves warn, training goes on, the final save names a checkpoint on disk; no temp files."""
    over = tiny_overrides(
        tiny_data, tiny_tmpfs, **{"training.max_iters": 12, "training.save_interval": 1, "training.eval_interval": 6}
    )
    proc = run_script(["train.py", *cli_args(over)])
    line = assert_user_error(
        proc, "final checkpoint was not saved", "No space left on device", "the last good checkpoint is"
    )
    assert "warning:" in proc.stderr and "training continues" in proc.stderr
    good_iter = int(re.search(r"\(iter (\d+)\)", line).group(1))
    run = RunDir(tiny_tmpfs / "t")
    assert load_checkpoint(run.latest())["iter_num"] == good_iter
    assert temp_files(run.path) == []
