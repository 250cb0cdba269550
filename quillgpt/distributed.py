"""torch.distributed plumbing for train.py: process groups, DDP/FSDP wrapping, collectives, sharded checkpoints, relaunch.

One process per device, started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE in the environment);
without those variables everything here is a cheap no-op. nccl on CUDA, gloo on CPU.

- Data parallel: DDP by default; with distributed.fsdp, FSDP2 (`fully_shard` on every block and
  on the root), whose weights, gradients and optimizer state are sharded across the ranks.
- Files: rank 0 alone writes checkpoints, logs, plots and wandb. Under FSDP every rank also writes
  its shard of the model and optimizer state (torch.distributed.checkpoint) into a
  sharded_stepNNNNNNN/ directory beside the checkpoint, which names it; the .pt file still holds
  the full weights, so sample.py and init_from read it as any other checkpoint.
- Failures: a rank that dies closes its sockets, so the others fail at their next collective within
  about a second and torchrun stops the rest; a rank that hangs (or a lost node) makes the
  others' collectives fail after distributed.timeout_s. Checkpoints are written atomically, so the
  last one stays loadable whatever happens.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import os
import pickle
import re
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from quillgpt.errors import EXIT_USER_ERROR, UserError, report
from quillgpt.files import TEMP_SUFFIX, fsync_dir
from quillgpt.machine import usable_cpus
from quillgpt.precision import PRECISIONS

T = TypeVar("T")
# How gloo and NCCL report a peer that died, hung or became unreachable: gloo names its transport, NCCL a remote error
# or its aborted communicator. Not every NCCL error is one: "Duplicate GPU detected" (two ranks on one GPU) is the
# user's to fix, and is reported as it is.
PEER_FAILURE_HINTS = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "ncclRemoteError",
    "remote process exit",
    "communicator was aborted",
    "Watchdog caught collective operation timeout",
)


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


# How long the other ranks wait while rank 0 alone works (on_main: preparing a dataset, which can take hours, or
# writing a checkpoint). A rank 0 that dies closes its sockets, and the others fail within a second all the same.
MAIN_WORK_TIMEOUT = datetime.timedelta(hours=24)
_main_work_group: dist.ProcessGroup | None = None  # gloo, with MAIN_WORK_TIMEOUT; made with the default group


def init_process_group(info: DistInfo, device: torch.device, backend: str | None, timeout_s: int) -> None:
    """timeout_s bounds every collective: a rank that hangs makes the others fail instead of waiting forever; except
    while rank 0 works alone (on_main), which the others wait for in a gloo group of its own, up to MAIN_WORK_TIMEOUT.

    (With nccl the watchdog enforces timeout_s by aborting the process; TORCH_NCCL_ASYNC_ERROR_HANDLING is on by
    default. The gloo group's wait is a CPU one, outside the watchdog's sight.)"""
    global _main_work_group
    if not info.enabled or dist.is_initialized():
        return
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    _main_work_group = dist.new_group(backend="gloo", timeout=MAIN_WORK_TIMEOUT)


def shutdown() -> None:
    global _main_work_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _main_work_group = None


class PeerFailure(Exception):
    """A collective failed because another rank died, hung for longer than distributed.timeout_s or became unreachable."""


def is_peer_failure(e: BaseException) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    return reads_as_peer_failure(e)


def reads_as_peer_failure(e: BaseException) -> bool:
    """Whether an error says another rank (or the rendezvous store) went away, rather than what went wrong here."""
    return isinstance(e, (dist.DistNetworkError, dist.DistStoreError)) or (
        isinstance(e, RuntimeError) and any(h in str(e) for h in PEER_FAILURE_HINTS)
    )


@contextlib.contextmanager
def reporting_peer_failures(info: DistInfo):
    """Turn a collective's failure into a PeerFailure instead of a traceback on every surviving rank, its one line
    printed at once: torchrun's SIGTERM follows a peer's death, and once the training loop's handler is gone it ends
    the process, so a line printed any later could be lost (the killed-rank test saw it lost)."""
    try:
        yield
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        cause = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". This is typically")[0]  # gloo: "[file.cc:553] what. hint"
        failure = PeerFailure(
            f"rank {info.rank} stopped: another rank failed, hung for longer than distributed.timeout_s "
            f"or became unreachable ({cause[:120]}); checkpoints written so far are intact"
        )
        print(f"error: {failure}", file=sys.stderr, flush=True)
        raise failure from None


# ---- collectives ------------------------------------------------------------------------------------


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def settled(*tensors: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Wait (a second at most) until gloo's worker thread has let go of these tensors.

    gloo marks a collective done before its worker thread frees the work. If our Python tensors are
    gone by then, that thread must take the GIL to free them, and in a process that exits right after
    a collective (every rank exiting on a UserError that train.on_every_rank gathered) it can ask during
    interpreter shutdown, which aborts the process ("terminate called without an active exception",
    exit 134). Holding the tensors until the worker has dropped them means it never needs the GIL."""
    if dist.get_backend(group) != "gloo":  # nccl's watchdog keeps works longer; its threads never free Python objects
        return
    deadline = time.monotonic() + 1.0
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(1e-4)


def collective_device(group: dist.ProcessGroup | None = None) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        settled(t)
    return t


def mean_over_ranks(t: torch.Tensor, info: DistInfo) -> float:
    t = t.detach().float().clone()
    return (all_reduce_sum(t) / info.world_size).item()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any rank: all ranks agree to stop at the same step."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    settled(t)
    return bool(t.item())


def pickled(obj: object, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(collective_device(group))


def unpickled(t: torch.Tensor) -> object:
    return pickle.loads(t.cpu().numpy().tobytes())


def gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (small picklable objects such as RNG states).

    Pickled as all_gather_object does, but through tensors we hold; see settled."""
    if not dist.is_initialized():
        return [obj]
    payload = pickled(obj, group)
    size = torch.tensor([payload.numel()], dtype=torch.long, device=payload.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size, group=group)
    padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    settled(size, *sizes, padded, *gathered, group=group)
    return [unpickled(g[: int(s.item())]) for g, s in zip(gathered, sizes)]


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's obj on every rank (pickled, as broadcast_object_list does, but through tensors we hold; see settled)."""
    if not dist.is_initialized():
        return obj
    data = pickled(obj) if info.is_main else None
    size = torch.tensor([data.numel() if info.is_main else 0], dtype=torch.long, device=collective_device())
    dist.broadcast(size, src=0)
    if not info.is_main:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=collective_device())
    dist.broadcast(data, src=0)
    settled(size, data)
    return obj if info.is_main else unpickled(data)


def on_every_rank(fn: Callable[..., T], info: DistInfo, *args, **kwargs) -> T:
    """fn(*args, **kwargs) on every rank, for steps whose outcome is the same on each (opening the data, building the
    model). A UserError on any rank is printed once, by rank 0, before any rank exits, and raised on every
    rank, so all of them exit 2 (torchrun stops the others as soon as one exits: a later message is lost)."""
    return _on_every_rank(None, fn, info, *args, **kwargs)


def on_main(fn: Callable[..., object], info: DistInfo, *args, **kwargs) -> None:
    """fn(*args, **kwargs) on rank 0 while the others wait (preparing data, writing a checkpoint), for as long as it
    takes (MAIN_WORK_TIMEOUT, not distributed.timeout_s); a UserError there is handled as on_every_rank's."""
    _on_every_rank(_main_work_group, _main_only, info, fn, info, *args, **kwargs)


def _on_every_rank(group: dist.ProcessGroup | None, fn: Callable[..., T], info: DistInfo, *args, **kwargs) -> T:
    """on_every_rank, the ranks agreeing on errors in `group` (None: the default one)."""
    try:
        return_value, error = fn(*args, **kwargs), None
    except UserError as e:
        if not info.enabled:
            raise
        return_value, error = None, str(e)
    if info.enabled:
        errors = [e for e in gather_objects(error, group) if e is not None]
        if errors:
            if info.is_main:
                report(UserError(errors[0]))
            barrier(group)  # nobody exits (and so has torchrun stop the rest) before rank 0 has printed
            raise UserError(errors[0], reported_elsewhere=True)
    return return_value


def _main_only(fn: Callable[..., object], info: DistInfo, *args, **kwargs) -> None:
    if info.is_main:
        fn(*args, **kwargs)


# ---- wrapping ---------------------------------------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under torch.compile and DDP (for FSDP, the sharded root: fully_shard works in place)."""
    model = getattr(model, "_orig_mod", model)
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return getattr(model, "_orig_mod", model)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


def no_sync(model: torch.nn.Module, last: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on all but the last accumulation micro-step.

    Run both forward and backward inside it: DDP decides in forward, FSDP in backward."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(unwrap(model))
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's gradient norm) as a plain tensor; anything else unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def broadcast_weights(model: torch.nn.Module) -> None:
    """Give every rank rank 0's weights (DDP does this itself; fully_shard would keep each rank's own init)."""
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t, src=0)


def shard(model: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
    """FSDP2: one unit per transformer block, and the root for the embeddings, the (tied) head and ln_f.

    In bf16 or fp16 the weights are gathered in that dtype, which autocast would cast them to anyway (half the
    all-gather's bytes), and the gradients reduced in fp32 onto the fp32 shards. The root keeps its weights gathered
    from forward to backward: fully_shard's default for the root, whose weights backward needs first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if precision != "fp32":
        policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP. Buffers are not sent from rank 0 at each forward: the model's only ones are rope's tables, computed alike
    on every rank (torch 2.13 renamed the switch forward_sync_buffers)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    ids = [device.index] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(ddp).parameters:
        return ddp(model, device_ids=ids, forward_sync_buffers=False)
    return ddp(model, device_ids=ids, broadcast_buffers=False)


def wrap_model(
    model: torch.nn.Module,
    info: DistInfo,
    device: torch.device,
    compile: bool,
    fsdp: bool,
    gradient_checkpointing: bool,
    precision: str = "fp32",
    compile_mode: str = "default",
) -> torch.nn.Module:
    """FSDP or DDP, and torch.compile (in compile_mode), in the orders that work: shard then compile; compile then
    DDP. precision is the run's (FSDP gathers 16-bit weights for a 16-bit run).

    Under FSDP the optimizer must be built after this call (fully_shard replaces the parameters with DTensors)."""
    if fsdp and info.enabled:
        broadcast_weights(model)
        model = shard(model, device, precision)
        return torch.compile(model, mode=compile_mode) if compile else model
    if compile:
        if info.enabled and gradient_checkpointing:
            # Dynamo's DDP graph splitter can't handle checkpointing's higher-order ops (pytorch#104674)
            import torch._dynamo.config as dynamo_config

            dynamo_config.optimize_ddp = False
            if info.is_main:
                print(
                    "compile + DDP + gradient checkpointing: Dynamo's DDP graph splitting is off (one gradient bucket)"
                )
        model = torch.compile(model, mode=compile_mode)
    if info.enabled:
        model = data_parallel(model, device)
    return model


# ---- state dicts ------------------------------------------------------------------------------------


def model_state_dict(model: torch.nn.Module) -> dict:
    """Plain weights. Collective under FSDP: rank 0 receives the full, unsharded weights on the CPU, the others {}."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach() for k, v in unwrap(model).state_dict().items()}


def optimizer_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    """The optimizer's plain state; None under FSDP, whose optimizer state lives in the sharded directory."""
    return None if is_sharded(model) else opt.state_dict()


def save_sharded(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], directory: Path, info: DistInfo
) -> Path:
    """Every rank writes its shards of the model and optimizer state to `directory` (DCP), atomically.

    The shards go to a temp directory that rank 0 renames once DCP has written the metadata (DCP
    fsyncs the files); the checkpoint that names `directory` is written after that."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp = directory.with_name(f".{directory.name}{TEMP_SUFFIX}")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(unwrap(model), optimizers)
    dcp.save({"model": model_sd, "optimizers": optim_sd}, checkpoint_id=tmp)
    if info.is_main:  # dcp.save returns on every rank only after the coordinator wrote .metadata
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    return directory


def load_sharded(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], directory: Path) -> None:
    """Load a sharded directory into any layout: FSDP on any world size, DDP or a single process (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (directory / ".metadata").is_file():
        raise UserError(f"{directory} (this checkpoint's sharded model and optimizer state) is missing or incomplete")
    model_sd, optim_sd = get_state_dict(unwrap(model), optimizers)
    state = {"model": model_sd, "optimizers": optim_sd}
    try:
        with warnings.catch_warnings():  # DCP warns that a load without a process group is single-process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    except (RuntimeError, KeyError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{directory} does not match this model and optimizer: {first[:300]}") from None
    set_state_dict(unwrap(model), optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"])


# ---- launching --------------------------------------------------------------------------------------


def without_flag(argv: list[str], flag: str) -> list[str]:
    """argv minus `flag VALUE` and `flag=VALUE`, and their abbreviations, which argparse accepts (--nproc 2)."""
    out, skip = [], False
    for a in argv:
        name, eq, _ = a.partition("=")
        if skip:
            skip = False
        elif len(name) > 3 and flag.startswith(name):
            skip = not eq
        else:
            out.append(a)
    return out


def root_cause(failures: dict) -> tuple:
    """(rank, failure) that started it all: the others exited 1 when they lost their peer (PeerFailure) or were
    stopped by torchrun (SIGTERM). Timestamps alone can't tell: they have a resolution of one second."""
    consequences = (1, -signal.SIGTERM)
    return min(failures.items(), key=lambda item: (item[1].exitcode in consequences, item[1].timestamp))


def relaunch_with_torchrun(nproc: int, argv: list[str], script: str) -> int:
    """`python train.py --nproc-per-node N ...` -> `torchrun --standalone --nproc_per_node N train.py ...`.

    The torchrun agent runs in this process, so a failed job ends with one line naming the rank that
    failed first and its exit code (passed on as ours; a UserError in the workers keeps exit code 2)
    instead of torchrun's traceback; Ctrl-C or SIGTERM reach the workers once (they save and stop)
    and give exit code 128 + signal. Each worker gets cores / N OpenMP threads unless
    OMP_NUM_THREADS is set (bare torchrun gives each worker 1)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        raise UserError(f"--nproc-per-node = {nproc} must be at least 1")
    if "RANK" in os.environ:
        raise UserError("--nproc-per-node launches torchrun itself: don't combine it with torchrun")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    launch = ["--standalone", f"--nproc-per-node={nproc}", script, *without_flag(argv, "--nproc-per-node")]
    print(f"launching: torchrun {' '.join(launch)} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})", flush=True)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we report failures ourselves
    try:
        run(get_args_parser().parse_args(launch))
    except SignalException as e:  # Ctrl-C or SIGTERM: torchrun passed it on, the workers saved and said so
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = root_cause(e.failures)
        if failure.exitcode == EXIT_USER_ERROR:  # the worker has printed its one-line error
            return EXIT_USER_ERROR
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            print(f"error: rank {rank} (pid {failure.pid}) was killed by {name}; the job stopped", file=sys.stderr)
            return 128 - failure.exitcode
        print(
            f"error: rank {rank} (pid {failure.pid}) failed with exit code {failure.exitcode}; the job stopped "
            "(its error is above)",
            file=sys.stderr,
        )
        return failure.exitcode
    return 0
