"""Train a GPT from a TOML config.

    # the main job: the offline default corpus (Python's stdlib sources), char tokenizer, CPU, a few minutes
    python train.py --config configs/base/base.toml

    # a tiny CPU smoke run
    python train.py --config configs/base/base.toml --max-iters 20 --training.eval_interval 10 --run.name smoke

    # tiny Shakespeare (nanoGPT's CPU preset), from a local copy of the text
    python train.py --config configs/shakespeare_char/cpu.toml --data.input path/to/input.txt

    # resume the run named in the config (or pass a run directory / checkpoint)
    python train.py --config configs/shakespeare_char/cpu.toml --resume

    # on a CPU a run of 5 minutes or more ends by compiling sample.py's decoding step for its model's shape and
    # keeping it (training.keep_decoding_step): sample.py, chat.py and serve.py decode with it from their first run

    # check a config and its feasibility without training
    python train.py --config configs/gpt2/124M.toml --validate

    # data-parallel: torchrun, or let train.py launch torchrun itself
    torchrun --standalone --nproc_per_node 2 train.py --config configs/base/base.toml
    python train.py --config configs/base/base.toml --nproc-per-node 2

Any config key can be overridden: --section.key value (or --section.key=value), plus the short
flags --max-iters, --device and --tokenizer. From Python:

    from train import train
    result = train("configs/base/base.toml", overrides={"training.max_iters": 50})
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from quillgpt import distributed
from quillgpt.checkpoint import TrainState, resolve_run
from quillgpt.config import build_config, load_toml, parse_overrides, plan_lines
from quillgpt.data import find_dataset
from quillgpt.errors import run_main
from quillgpt.feasibility import check_memory, report_feasibility
from quillgpt.generate import keep_decoding_step, keeps_decoding_step
from quillgpt.metrics import MetricsLog
from quillgpt.run_model import horizon, plan_model
from quillgpt.trainer import (
    Outcome,
    StopRequest,
    Trainer,
    build_trainer,
    callers_determinism_restored,
    fit,
    restore,
    setup,
    start_run,
)


@dataclass
class TrainResult:
    final_loss: float | None
    best_val_loss: float
    total_tokens: int
    checkpoint_path: str | None
    iterations: int
    stop_reason: str


def train(
    config: str | Path | None = None,
    overrides: dict | list | None = None,
    resume: bool | str = False,
    force: bool = False,
    validate_only: bool = False,
) -> TrainResult | dict:
    """Train from a TOML file plus overrides ({"training.max_iters": 10} or CLI-style list). Python API.
    validate_only: train nothing; the dict of what --validate checked (the model's arguments and parameters, the
    memory estimate, the measured step time)."""
    started = time.monotonic()
    dist = distributed.from_env()
    peer_failed = False
    try:
        with distributed.reporting_peer_failures(dist), callers_determinism_restored():
            cfg, run_dir, ckpt = resolve_run(config, overrides, resume, force or validate_only, dist.world_size)
            rt = setup(cfg, dist, ckpt.resolution() if ckpt else None)
            run_dir = distributed.broadcast_object(run_dir, dist)  # an unnamed run is named by each rank's clock
            dataset = find_dataset(cfg, dist)
            plan = distributed.on_every_rank(plan_model, dist, cfg, dataset, ckpt)  # the one model both paths take
            cfg, steps = horizon(cfg, plan.config, dist.world_size)  # max_iters, from a target where one is set
            if dist.is_main:
                print("\n".join(["plan: " + line for line in plan_lines(cfg)] + ["plan: " + steps]), flush=True)
            checked = check_memory(cfg, rt, plan) if validate_only else None
            tr = build_trainer(cfg, rt, dataset, run_dir, ckpt, plan)
            if validate_only:
                return report_feasibility(tr, checked)
            state = restore(tr, ckpt) if ckpt else TrainState()
            log = start_run(tr, state, resumed=ckpt is not None)
            with StopRequest() as stop, distributed.reporting_peer_failures(dist):  # reported while signals are ours
                outcome = fit(tr, state, log, stop)
            result = report(tr, outcome, log)
    except distributed.PeerFailure:
        peer_failed = True  # the process group is broken: destroying it waits on, or aborts with, the dead peer
        raise
    finally:
        if not peer_failed:
            distributed.shutdown()
    seconds = time.monotonic() - started
    t = cfg.training
    keeping = keeps_decoding_step(t.keep_decoding_step, t.eval_only, result.stop_reason, seconds)
    if dist.is_main and result.checkpoint_path and keeping:  # the other ranks are gone: rank 0 alone compiles
        keep_decoding_step(result.checkpoint_path, dist.world_size)
    return result


def report(tr: Trainer, outcome: Outcome, log: MetricsLog | None) -> TrainResult:
    """Print how the run ended (rank 0) and close its log; the result for a Python caller."""
    state, run_dir = outcome.state, tr.run_dir
    reason = outcome.stop_reason or "finished"
    if log:
        if outcome.stop_reason == "signal":
            print(f"saved {run_dir.last}; resume with: python train.py --resume {run_dir.path}", flush=True)
        elif outcome.stop_reason:
            print(outcome.stop_reason, flush=True)
        print(
            f"{reason}: {state.iter_num} iters, {state.tokens_seen:,} tokens, best val loss {state.best_val_loss:.4f}; "
            f"checkpoints in {run_dir.path}",
            flush=True,
        )
        log.finish()
    ckpt_path = run_dir.best if run_dir.best.is_file() else run_dir.last
    return TrainResult(
        final_loss=outcome.last_loss,
        best_val_loss=state.best_val_loss,
        total_tokens=state.tokens_seen,
        checkpoint_path=str(ckpt_path) if ckpt_path.exists() else None,
        iterations=state.iter_num,
        stop_reason=reason,
    )


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --section.key value pair overrides the config.",
    )
    p.add_argument("--config", help="TOML config file (e.g. configs/base/base.toml)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR_OR_CKPT",
        help="continue the config's run (or the given run directory / checkpoint)",
    )
    p.add_argument("--force", action="store_true", help="start over in an existing run directory")
    p.add_argument("--validate", action="store_true", help="check the config and its feasibility; don't train")
    p.add_argument("--nproc-per-node", type=int, default=None, help="relaunch under torchrun with N processes")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parse_args(argv)
    if args.nproc_per_node is not None:
        if args.config:  # config mistakes: one message here rather than one per worker
            build_config(
                load_toml(args.config), parse_overrides(rest), source=args.config, world_size=args.nproc_per_node
            )
        return distributed.relaunch_with_torchrun(args.nproc_per_node, argv, script=os.path.abspath(__file__))
    try:
        train(args.config, overrides=rest, resume=args.resume, force=args.force, validate_only=args.validate)
    except distributed.PeerFailure:  # its line is printed: leave now, not through the broken group's teardown
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    run_main(main)
