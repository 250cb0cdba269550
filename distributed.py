"""torch.distributed plumbing for train.py: process groups, DDP wrapping, collectives, relaunch.

One process per device, started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE in the environment);
without those variables everything here is a cheap no-op. nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or "RANK" in os.environ

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> DistInfo:
    """Read torchrun's variables (no process group yet)."""
    if "RANK" not in os.environ:
        return DistInfo()
    return DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]))


def init_process_group(info: DistInfo, device: torch.device, backend: str | None, timeout_s: int) -> None:
    if not info.enabled or dist.is_initialized():
        return
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


def shutdown(info: DistInfo) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def mean_over_ranks(t: torch.Tensor, info: DistInfo) -> float:
    t = t.detach().float().clone()
    return (all_reduce_sum(t, info) / info.world_size).item()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when it is True on any rank: all ranks agree to stop at the same step."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def save_on_main(fn, info: DistInfo) -> None:
    """Rank 0 writes; the others wait, so no rank runs ahead of a checkpoint being written."""
    if info.is_main:
        fn()
    barrier(info)


def no_sync(model: torch.nn.Module, last: bool):
    """Under DDP, skip the gradient all-reduce on all but the last accumulation micro-step."""
    if not last and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def model_state_dict(model: torch.nn.Module) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


def optimizer_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return opt.state_dict()


def load_optimizer_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    opt.load_state_dict(state)


def wrap_model(model: torch.nn.Module, cfg, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """torch.compile and DDP, in the order that works for both."""
    if cfg.model.compile:
        if info.enabled and cfg.training.gradient_checkpointing:
            # Dynamo's DDP graph splitter can't handle checkpointing's higher-order ops (pytorch#104674)
            import torch._dynamo
            torch._dynamo.config.optimize_ddp = False
            if info.is_main:
                print("compile + DDP + gradient checkpointing: Dynamo's DDP graph splitting is off (one gradient bucket)")
        model = torch.compile(model)
    if info.enabled:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def relaunch_with_torchrun(nproc: int, argv: list[str]) -> int:
    """`python train.py --nproc-per-node N ...` -> `torchrun --standalone --nproc_per_node N train.py ...`."""
    args, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        args.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(sys.argv[0]), *args]
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)
