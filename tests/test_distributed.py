"""Distributed training for real: torchrun subprocesses on CPU with gloo, a tiny model and a generated dataset.

Runs shared by several tests are module fixtures. Loss sequences come from train_log.json (log_interval 1);
under DDP the logged loss is the mean over ranks, i.e. the mean over all micro-batches of the step.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO_ROOT, word_salad

from quillgpt import distributed
from quillgpt.checkpoint import load_checkpoint
from quillgpt.engine import generate
from quillgpt.generate import load_for_sampling
from quillgpt.prepare import prepare_dataset
from train import train

ITERS = 12
STOP = 6  # where interrupted runs stop; also save_interval and eval_interval
# OMP_NUM_THREADS=1: two single-process "nodes" on two cores would otherwise oversubscribe them
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}

SEA_WORDS = "the king and queen of a far land rode out to see what the sea had left upon the sand".split()
CONFIG = """
[run]
name = "run"
device = "cpu"
seed = 7
[data]
dataset = "gen"
tokenizer = "char"
data_dir = "{data_dir}"
[model]
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = {dropout}
[training]
precision = "fp32"  # the runs compared must not hang on auto's probe
batch_size = 8
max_iters = {iters}
eval_interval = {stop}
eval_iters = 3
log_interval = 1
save_interval = {stop}
[optimizer]
warmup_iters = 2
lr_decay_iters = {iters}
[logging]
plot = false
peak_tflops = 1.0
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    (root / "input.txt").write_text(word_salad(150_000, SEA_WORDS))
    prepare_dataset("gen", input_path=str(root / "input.txt"), tokenizer="char", data_dir=root / "data", verbose=False)
    for dropout in (0.0, 0.1):
        (root / f"dropout{dropout}.toml").write_text(
            CONFIG.format(data_dir=root / "data", dropout=dropout, iters=ITERS, stop=STOP)
        )
    return root


def config(workdir: Path, dropout: float) -> str:
    return str(workdir / f"dropout{dropout}.toml")


def torchrun(*args, nproc: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "train.py",
        *args,
    ]
    return finished(subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout))


def self_launch(*args, nproc: int = 2, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", "--nproc-per-node", str(nproc), *args]
    return subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def finished(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def log(run_dir: Path, kind: str = "train", key: str = "loss") -> dict[int, float]:
    history = json.loads((run_dir / "train_log.json").read_text())["history"]
    return {p["iter"]: p[key] for p in history if p["kind"] == kind}


def assert_same(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst <= tol, f"max difference {worst:.3g} > {tol}: {a} vs {b}"


def ended(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """Wait for a launched job; returns (output, seconds waited). On timeout, kill it and fail with its output."""
    t0 = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout}s:\n{output[-4000:]}") from None
    return output, time.monotonic() - t0


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the job ended before {path} appeared:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.1)


def worker(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The training process of one rank, among the launcher's descendants."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker with RANK={rank}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- shared runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_dropout(workdir) -> Path:
    """2 ranks with dropout, uninterrupted: the reference for exact resume."""
    out = workdir / "ddp_dropout"
    proc = torchrun("--config", config(workdir, 0.1), "--run.out_dir", str(out))
    assert proc.stdout.count("finished:") == 1  # only rank 0 reports
    return out / "run"


@pytest.fixture(scope="module")
def ddp_plain(workdir) -> Path:
    """2 ranks x grad_accum 1, no dropout."""
    out = workdir / "ddp_plain"
    torchrun("--config", config(workdir, 0.0), "--run.out_dir", str(out))
    return out / "run"


@pytest.fixture(scope="module")
def single_accum2(workdir) -> Path:
    """1 process x grad_accum 2, no dropout (in-process, through the Python API)."""
    out = workdir / "single"
    train(config(workdir, 0.0), overrides={"run.out_dir": str(out), "training.grad_accum_steps": 2})
    return out / "run"


# ---- tests -----------------------------------------------------------------------------------------


def test_without_flag_strips_every_spelling():
    argv = [
        "--config",
        "c.toml",
        "--nproc-per-node",
        "2",
        "--max-iters",
        "5",
        "--nproc-per-node=4",
        "--nproc",
        "3",
        "--training.batch_size",
        "4",
    ]
    assert distributed.without_flag(argv, "--nproc-per-node") == [
        "--config",
        "c.toml",
        "--max-iters",
        "5",
        "--training.batch_size",
        "4",
    ]


def test_root_cause_skips_the_ranks_that_only_lost_their_peer():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(exitcode: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=0, pid=100 + exitcode, exitcode=exitcode, error_file="<none>")
        f.timestamp = 1_700_000_000  # the same second: timestamps can't decide
        return f

    assert distributed.root_cause({0: failure(-signal.SIGTERM), 1: failure(-signal.SIGKILL)})[0] == 1
    assert distributed.root_cause({0: failure(1), 1: failure(2)})[0] == 1
    assert distributed.root_cause({0: failure(1), 1: failure(1)})[0] == 0


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_accumulation(ddp_plain, single_accum2):
    """Same micro-batches, same averaged gradient: 2 ranks x accum 1 == 1 rank x accum 2, losses and evals."""
    assert_same(log(ddp_plain), log(single_accum2), tol=1e-5)
    assert_same(log(ddp_plain, "eval", "val_loss"), log(single_accum2, "eval", "val_loss"), tol=1e-5)


@pytest.mark.slow
def test_mfu_is_over_the_peak_of_every_rank(ddp_plain, single_accum2):
    """tokens/s count all ranks' tokens, so MFU divides by all ranks' peak: at the same logging.peak_tflops per
    device, 2 ranks report half the MFU of 1 process for the same tokens/s (it once reported 2x the truth)."""

    def mfu_per_token_per_s(run: Path) -> float:
        points = [p for p in json.loads((run / "train_log.json").read_text())["history"] if p["kind"] == "train"]
        return statistics.median(p["mfu"] / p["tokens_per_s"] for p in points)

    assert mfu_per_token_per_s(ddp_plain) == pytest.approx(mfu_per_token_per_s(single_accum2) / 2, rel=1e-6)


@pytest.mark.slow
def test_resume_on_another_world_size_keeps_the_data_stream(workdir, ddp_plain, single_accum2):
    """A 2-rank checkpoint resumed on 1 rank x accum 2 (same global batch) continues the 1-rank run exactly."""
    run = workdir / "ddp_to_single" / "run"
    run.mkdir(parents=True)
    shutil.copyfile(ddp_plain / f"ckpt_step{STOP:07d}.pt", run / "ckpt_last.pt")
    train(overrides={"training.grad_accum_steps": 2}, resume=str(run))
    expected = {k: v for k, v in log(single_accum2).items() if k > STOP}
    assert_same(log(run), expected, tol=1e-5)


@pytest.mark.slow
def test_self_launch_then_resume_matches_uninterrupted_run(workdir, ddp_dropout):
    """Stop a 2-rank run with dropout at STOP (started with --nproc-per-node), resume it on 2 ranks:
    every rank's data stream and dropout RNG continue exactly."""
    out = workdir / "stopped"
    launcher = self_launch("--config", config(workdir, 0.1), "--run.out_dir", str(out), "--max-iters", str(STOP))
    output, _ = ended(launcher, timeout=180)
    assert launcher.returncode == 0, output[-3000:]
    assert "launching: torchrun --standalone --nproc-per-node=2" in output
    assert "8 x 1 accum x 2 ranks = 16 sequences" in output
    ckpt = load_checkpoint(out / "run" / "ckpt_last.pt")
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])  # each rank's own dropout stream

    torchrun("--resume", str(out / "run"), "--max-iters", str(ITERS))
    assert_same(log(out / "run"), log(ddp_dropout), tol=0.0)
    assert_same(log(out / "run", "eval", "val_loss"), log(ddp_dropout, "eval", "val_loss"), tol=0.0)


@pytest.mark.slow
def test_fsdp_trains_like_ddp_and_resumes(workdir, ddp_dropout):
    """FSDP2 on 2 gloo ranks: the same losses as DDP, sharded checkpoints that resume exactly (any world size),
    and a plain ckpt that sample.py reads."""
    out = workdir / "fsdp"
    args = ("--config", config(workdir, 0.1), "--run.out_dir", str(out), "--distributed.fsdp", "true")
    torchrun(*args, "--max-iters", str(STOP))
    run = out / "run"
    assert (run / f"sharded_step{STOP:07d}" / ".metadata").is_file()
    torchrun("--resume", str(run), "--max-iters", str(ITERS))
    # same initial weights (rank 0's), same per-rank dropout streams; reduce-scatter may round differently
    # from DDP's all-reduce (on 2 CPU ranks it does not: the difference measured is 0)
    assert_same(log(run), log(ddp_dropout), tol=1e-6)
    ckpt = load_checkpoint(run / "ckpt_last.pt")
    assert ckpt["sharded"] == f"sharded_step{ITERS:07d}" and ckpt["optimizers"] == [None]
    assert sorted(p.name for p in run.glob("sharded_step*")) == [f"sharded_step{STOP:07d}", f"sharded_step{ITERS:07d}"]

    model, tokenizer, _ = load_for_sampling(run, "cpu")  # the full weights gathered from the shards
    prompt = torch.tensor([tokenizer.encode("The ")])
    assert generate(model, prompt, 20, temperature=0).shape == (1, prompt.size(1) + 20)

    single = workdir / "fsdp_single" / "run"
    shutil.copytree(run, single)
    result = train(resume=str(single), overrides={"training.max_iters": ITERS + 2})  # 1 process, no FSDP
    assert result.iterations == ITERS + 2 and result.final_loss < log(run)[1]


@pytest.mark.slow
def test_two_node_job_on_localhost_agrees_on_early_stopping(workdir):
    """Two torchrun launches form one 2-node job; early stopping (decided from all-reduced eval losses)
    stops both ranks at the same step, so the job ends instead of hanging."""
    out = workdir / "two_nodes"
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
    ]
    args = [
        "train.py",
        "--config",
        config(workdir, 0.0),
        "--run.out_dir",
        str(out),
        "--training.early_stopping",
        "true",
        "--training.early_stopping_patience",
        "1",
        "--training.early_stopping_min_delta",
        "10.0",
        "--distributed.timeout_s",
        "60",
    ]
    nodes = [
        subprocess.Popen(
            common + [f"--node_rank={r}"] + args,
            cwd=REPO_ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [ended(node, timeout=180)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "x 2 ranks = 16 sequences" in outputs[0]
    assert "early stopping" in outputs[0]
    assert max(log(out / "run")) == STOP
    assert load_checkpoint(out / "run" / "ckpt_last.pt")["iter_num"] == STOP


@pytest.mark.slow
def test_killed_rank_ends_the_job_quickly_and_leaves_a_loadable_checkpoint(workdir):
    out = workdir / "killed"
    launcher = self_launch(
        "--config",
        config(workdir, 0.0),
        "--run.out_dir",
        str(out),
        "--max-iters",
        "100000",
        "--training.save_interval",
        "5",
        "--training.eval_interval",
        "0",
        "--training.log_interval",
        "100",
        "--distributed.timeout_s",
        "30",
    )
    wait_for(out / "run" / "ckpt_last.pt", launcher)
    worker(launcher, rank=1).send_signal(signal.SIGKILL)
    output, elapsed = ended(launcher, timeout=60)
    assert launcher.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert elapsed < 20, f"the job took {elapsed:.0f}s to end:\n{output[-3000:]}"  # the output shows where it waited
    assert "error: rank 1" in output and "was killed by SIGKILL" in output, output[-3000:]
    assert "rank 0 stopped: another rank failed" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert load_checkpoint(out / "run" / "ckpt_last.pt")["iter_num"] % 5 == 0


@pytest.mark.slow
def test_two_ranks_under_a_time_budget_stop_together_at_its_end(workdir):
    """training.time_budget_s under DDP: the ranks agree on rank 0's seconds where the loop reads back (every 7th step
    here) and project between, so both stop at the same step (a rank stopping alone would leave the other waiting in
    a collective) with the budget spent, and the value embeddings and a batch ramp train on both."""
    out = workdir / "budget"
    budget = ("--training.time_budget_s", "4", "--training.eval_interval", "0", "--training.log_interval", "7")
    ramp = ("--training.batch_ramp_iters", "10", "--training.batch_ramp_start", "2")
    launcher = self_launch(
        "--config", config(workdir, 0.0), "--run.out_dir", str(out), *budget, *ramp, "--model.value_embeds", "true"
    )
    output, _ = ended(launcher, timeout=150)
    assert launcher.returncode == 0, output[-3000:]
    ckpt = load_checkpoint(out / "run" / "ckpt_last.pt")
    steps = ckpt["iter_num"]
    assert 3.0 < ckpt["train_seconds"] < 5.5 and steps > 14, (ckpt["train_seconds"], steps)
    assert f"finished: {steps} iters" in output
    rows = [2 + 6 * i // 10 for i in range(10)] + [8] * (steps - 10)  # each rank's micro-batch rows, step by step
    assert ckpt["tokens_seen"] == 2 * 32 * sum(rows)  # 2 ranks x block_size 32


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(workdir):
    out = workdir / "sigterm"
    launcher = self_launch(
        "--config",
        config(workdir, 0.0),
        "--run.out_dir",
        str(out),
        "--max-iters",
        "100000",
        "--training.save_interval",
        "5",
        "--training.eval_interval",
        "0",
        "--training.log_interval",
        "100",
    )
    wait_for(out / "run" / "ckpt_last.pt", launcher)
    worker(launcher, rank=1).send_signal(signal.SIGTERM)
    output, _ = ended(launcher, timeout=60)
    assert launcher.returncode == 0, output[-3000:]
    assert output.count("SIGTERM received") == 1  # rank 1 got it; rank 0 learnt it through any_rank
    ckpt = load_checkpoint(out / "run" / "ckpt_last.pt")
    assert f"signal: {ckpt['iter_num']} iters" in output


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        (("--data.dataset", "no_such_dataset"), "error: unknown dataset 'no_such_dataset'"),  # found by rank 0 alone
        (("--model.block_size", "50000"), "fewer than block_size + 1 = 50001"),  # found by every rank
    ],
)
def test_self_launch_reports_a_worker_user_error_in_one_line(workdir, override, message):
    launcher = self_launch("--config", config(workdir, 0.0), "--run.out_dir", str(workdir / "bad"), *override)
    output, _ = ended(launcher, timeout=120)
    assert launcher.returncode == 2, output[-3000:]
    assert output.count(message) == 1, output[-3000:]  # rank 0 says it; rank 1 exits quietly
    assert output.count("error:") == 1 and "Traceback" not in output and "ChildFailedError" not in output


COLLECTIVES_SCRIPT = """
import sys
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from quillgpt import distributed as du
info = du.from_env()
du.init_process_group(info, torch.device("cpu"), None, 60)
held = 0
for i in range(300):
    t = du.all_reduce_sum(torch.ones(1))
    held += t._use_count() > 1  # gloo's worker thread still holds it: it would need the GIL to free it
    assert du.broadcast_object({{"step": i, "text": "x" * i}}, info) == {{"step": i, "text": "x" * i}}
    assert du.any_rank(i == 7 and info.rank == 1) == (i == 7)
    assert du.gather_objects("r" * (info.rank + i)) == ["r" * i, "r" * (1 + i)]
du.shutdown()
print(f"rank {{info.rank}} held {{held}}")
"""


@pytest.mark.slow
def test_collectives_return_only_after_gloo_lets_go_of_our_tensors(tmp_path):
    """Without settled(), gloo's worker still held the tensor when all_reduce returned in 20-50% of calls, and a
    rank that exited right then could abort in interpreter shutdown (exit 134), as CI once saw."""
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_SCRIPT.format(repo=str(REPO_ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = finished(subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120))
    assert sorted(re.findall(r"rank \d held \d+", proc.stdout)) == ["rank 0 held 0", "rank 1 held 0"], proc.stdout


@pytest.mark.slow
def test_compiled_ddp_with_gradient_checkpointing_trains_on_two_ranks(workdir):
    """Dynamo's DDP graph splitter is switched off for checkpointed blocks; the combination trains on 2 gloo ranks."""
    out = workdir / "compiled"
    env_threads = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile worker pool per rank on a small machine
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        "--config",
        config(workdir, 0.1),
        "--run.out_dir",
        str(out),
        "--max-iters",
        "4",
        "--training.eval_interval",
        "0",
        "--training.eval_iters",
        "1",
        "--training.compile",
        "true",
        "--training.gradient_checkpointing",
        "true",
    ]
    proc = finished(
        subprocess.run(cmd, cwd=REPO_ROOT, env={**ENV, **env_threads}, capture_output=True, text=True, timeout=600)
    )
    assert "Dynamo's DDP graph splitting is off" in proc.stdout
    losses = log(out / "run")
    assert len(losses) == 4 and all(0 < v < 10 for v in losses.values())
    assert losses[4] < losses[1]


@pytest.mark.slow
def test_hellaswag_dealt_to_two_ranks_scores_as_one_rank(workdir, ddp_plain, tmp_path):
    """HellaSwag during training deals its items to the ranks (an odd number: one rank pads) and sums the
    counts: 2 ranks report what 1 rank does, as do the val loss and bits per byte."""
    from test_eval import write_hellaswag

    hs = write_hellaswag(tmp_path / "hs.jsonl", n=12)
    args = [
        "--config",
        config(workdir, 0.0),
        "--run.out_dir",
        str(tmp_path),
        "--run.name",
        "ev",
        "--training.eval_only",
        "true",
        "--run.init_from",
        str(ddp_plain),
        "--eval.hellaswag",
        str(hs),
        "--eval.hellaswag_limit",
        "9",
        "--eval.map_unknown",
        "true",
    ]
    one = finished(
        subprocess.run(
            [sys.executable, "train.py", *args], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=180
        )
    )
    two = torchrun(*args)
    lines = [re.search(r"^eval 0: .*$", p.stdout, re.M)[0] for p in (one, two)]
    assert "bits/byte" in lines[0] and "hellaswag" in lines[0] and lines[0] == lines[1]
    assert not (tmp_path / "ev").exists()


SLOW_PREPARE_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
import quillgpt.data
real_prepare = quillgpt.data.prepare_dataset


def slow_prepare(*args, **kwargs):  # rank 0 prepares for longer than distributed.timeout_s
    time.sleep(6)
    return real_prepare(*args, **kwargs)


quillgpt.data.prepare_dataset = slow_prepare
import train
from quillgpt.errors import run_main
sys.argv[0] = "train.py"
run_main(train.main)
"""


@pytest.mark.slow
def test_the_other_ranks_wait_for_rank_0_to_prepare_the_dataset_however_long_it_takes(workdir, tmp_path):
    """torchrun on a dataset not prepared yet: rank 0 prepares it (here for 6 s) while rank 1 waits, longer than
    distributed.timeout_s (2 s), which bounds a collective's wait for a hung rank, not rank 0's work alone (it once
    aborted every such job on a big dataset: NCCL's watchdog after 300 s)."""
    script = tmp_path / "slow_prepare.py"
    script.write_text(SLOW_PREPARE_SCRIPT.format(repo=str(REPO_ROOT)))
    args = [
        "--config",
        config(workdir, 0.0),
        "--run.out_dir",
        str(tmp_path),
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.input",
        str(workdir / "input.txt"),
        "--max-iters",
        "2",
        "--training.eval_interval",
        "0",
        "--training.eval_iters",
        "1",
        "--distributed.timeout_s",
        "2",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    proc = finished(subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=180))
    assert "finished: 2 iters" in proc.stdout
    assert (tmp_path / "data" / "gen" / "meta.json").is_file()


def test_only_a_peers_failure_reads_as_another_rank_failing():
    """NCCL names itself in a user's mistake too (two ranks on one GPU): that is reported as it is, while gloo's and
    NCCL's errors for a peer that went away read as another rank failing."""
    import torch.distributed as dist

    duplicate = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
        "2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU "
        "detected : rank 1 and rank 0 both on CUDA device 1b000"
    )
    assert not distributed.reads_as_peer_failure(duplicate)
    assert not distributed.reads_as_peer_failure(RuntimeError("CUDA error: out of memory"))
    for peer in (
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5873"),
        dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL "
            "version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
            "exiting prematurely."
        ),
        dist.DistNetworkError("failed to recv, got 0 bytes"),
    ):
        assert distributed.reads_as_peer_failure(peer)


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of this one process over gloo, as torchrun with one process makes it (RANK set)."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield distributed.DistInfo(0, 0, 1)
    dist.destroy_process_group()


def tiny_rope_model():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32, pos_emb="rope"))


def test_ddp_sends_no_buffers_at_each_forward(one_rank, monkeypatch):
    """The model's only buffers are rope's tables, the same on every rank: DDP broadcasting them from rank 0 at every
    forward is traffic for nothing."""
    import torch.distributed as dist

    model = distributed.wrap_model(tiny_rope_model(), one_rank, torch.device("cpu"), False, False, False)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    sent = []
    real = dist._broadcast_coalesced
    monkeypatch.setattr(dist, "_broadcast_coalesced", lambda *a, **k: sent.append(1) or real(*a, **k))
    x = torch.randint(0, 50, (2, 16))
    for _ in range(2):
        _, loss = model(x, x)
        loss.backward()
    assert sent == []


def test_fsdp_gathers_16_bit_weights_and_reduces_fp32_gradients(one_rank):
    """A bf16 run under FSDP gathers the weights in bf16 (what autocast casts them to anyway: half the all-gather's
    bytes), and the gradients land in fp32 on the fp32 shards the optimizer steps."""
    model = tiny_rope_model()
    dtypes = []
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda module, args: dtypes.append(module.weight.dtype))
    wrapped = distributed.wrap_model(model, one_rank, torch.device("cpu"), False, True, False, "bf16")
    x = torch.randint(0, 50, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = wrapped(x, x)
    loss.backward()
    assert dtypes == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
