"""--kernels: where a compiled CPU training step's time goes, by clock. Each kernel's time per step (the generated
code's fused kernels, its matmuls with their FLOP/s, the ops it calls by name), the parts of the step outside the
compiled graphs (batches, gradient clipping, the optimizer), and what is left (autograd, dynamo's guards, Python);
the matmuls' rate beside this machine's matmul ceiling, measured just before.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    CPU_PRESET,
    Bench,
    Mode,
    add_config,
    describe,
    matmul_ceiling,
    print_table,
    run_steps,
    trainer_for,
)
from benchmarks.conditions import load_average, with_shakespeare_input
from quillgpt.config import parse_overrides
from quillgpt.errors import UserError
from quillgpt.trainer import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, CPU_PRESET)
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first, the first one compiling (default %(default)s)"
    )
    p.add_argument("--iters", type=int, default=20, help="steps timed by clock (default %(default)s)")
    p.add_argument(
        "--top", type=int, default=20, help="rows of the table, the slowest kernels first (default %(default)s)"
    )


def run(args: argparse.Namespace, cli: list[str]) -> None:
    bench = Bench(trainer_for(args.config, parse_overrides(with_shakespeare_input(cli))))
    tr = bench.tr
    if tr.rt.device.type != "cpu" or not tr.rt.compile:
        raise UserError(
            "--kernels times the kernels torch.compile generates on the CPU: run with --training.compile true "
            "--device cpu (on CUDA, use --profile)"
        )
    print(describe(tr), flush=True)
    start = run_steps(bench, 0, args.warmup)
    ceiling = matmul_ceiling(tr)
    steps = args.iters
    with KernelClock() as clock:
        clock.time_outside(tr)
        t0 = time.perf_counter()
        run_steps(bench, start, steps)
        step_ms = (time.perf_counter() - t0) / steps * 1e3
    ms = {k: v / steps * 1e3 for k, v in clock.seconds.items()}
    rows = []
    for key in sorted(ms, key=ms.get, reverse=True)[: args.top]:
        rate = f"{clock.flops[key] / steps / ms[key] / 1e6:,.0f}" if key in clock.flops else ""
        rows.append([key, str(clock.calls[key] // steps), f"{ms[key]:.2f}", f"{ms[key] / step_ms:.1%}", rate])
    print_table(["kernel", "calls per step", "ms per step", "share of the step", "GFLOP/s"], rows)
    matmul_ms = sum(ms[k] for k in clock.flops)
    ops = sum(v for k, v in ms.items() if "::" in k)
    outside = sum(v for k, v in ms.items() if k.startswith("("))
    groups = {
        "matmuls": matmul_ms,
        "ops called by name (quill::, aten::)": ops,
        "inductor's fused kernels": sum(ms.values()) - matmul_ms - ops - outside,
        "optimizer, clipping, batches": outside,
    }
    groups["the rest (autograd, dynamo's guards, Python)"] = step_ms - sum(groups.values())
    parts = "; ".join(f"{k} {v:.1f} ms ({v / step_ms:.0%})" for k, v in groups.items())
    print(f"step {step_ms:.1f} ms (mean of {steps}): {parts}")
    matmul_rate = sum(clock.flops.values()) / steps / matmul_ms * 1e3
    step_rate = tr.tokens_per_step * tr.raw_model.flops_per_token() / step_ms * 1e3
    print(
        f"matmuls at {matmul_rate / 1e9:,.0f} GFLOP/s, {matmul_rate / ceiling:.0%} of the matmul ceiling measured just "
        f"before ({ceiling / 1e9:,.0f} GFLOP/s, {tr.rt.precision}, MLP shape); the step at "
        f"{step_rate / ceiling:.0%} of it"
    )
    print(load_average())


MODE = Mode(
    "--kernels",
    "a compiled CPU step's time per kernel, by clock (matmuls with their FLOP/s, fused kernels, custom ops)",
    __doc__,
    add_arguments,
    run,
)


class KernelClock:
    """Wall time of every kernel a compiled CPU training step runs, by clock rather than profiler: the generated
    modules' fused kernels (cpp_fused_*), their calls to PyTorch's matmuls (extern_kernels) and the ops they call by
    name (torch.ops.quill.*, torch.ops.aten.*) are wrapped with perf_counter for the timed steps, then put back.
    On a machine with few cores the profiler disturbs what it measures: it slows the step and inflates some kernels
    many times over (docs/LOG.md holds the numbers)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def timed(self, name: str, fn: Callable, flops: Callable[[tuple], float] | None = None) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
            key = name if flops is None else f"{name} {' @ '.join(str(tuple(a.shape)) for a in args[:2])}"
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            self.calls[key] = self.calls.get(key, 0) + 1
            if flops is not None:
                self.flops[key] = self.flops.get(key, 0.0) + flops(args)
            return out

        return wrapper

    def __enter__(self) -> KernelClock:
        try:
            self._wrap_generated_code()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wrap_generated_code(self) -> None:
        from torch._inductor.codecache import PyCodeCache

        modules = [m for m in getattr(PyCodeCache, "modules", []) if hasattr(m, "call")]
        if not modules:
            raise UserError("--kernels found no code generated by torch.compile: run with --training.compile true")
        ops: set[tuple[str, str]] = set()
        for graph, module in enumerate(modules):  # the forward's and the backward's: kernel names repeat across them
            for name, fn in list(vars(module).items()):
                if name.startswith("cpp_fused"):
                    self._swap(module, name, self.timed(f"{name.removeprefix('cpp_fused_')} (graph {graph})", fn))
            if hasattr(module, "extern_kernels"):
                self._swap(module, "extern_kernels", _TimedMatmuls(module.extern_kernels, self))
            ops |= set(re.findall(r"torch\.ops\.(\w+)\.(\w+)\.default\(", Path(module.__file__).read_text()))
        for namespace, op in sorted(ops):  # ours (quill::) and PyTorch's the generated code calls by name
            packet = getattr(getattr(torch.ops, namespace), op)
            self._swap(packet, "default", self.timed(f"{namespace}::{op}", packet.default))

    def time_outside(self, tr: Trainer) -> None:
        """Also time the parts of a step outside the compiled graphs: batches, gradient clipping, optimizer steps."""
        from quillgpt import trainer

        self._swap(tr.batches, "get", self.timed("(batches)", tr.batches.get))
        self._swap(trainer, "clip_gradients", self.timed("(gradient clipping)", trainer.clip_gradients))
        for opt in tr.optimizers:
            self._swap(opt, "step", self.timed(f"({type(opt).__name__} step)", opt.step))

    def _swap(self, owner: object, name: str, value: object) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()


class _TimedMatmuls:
    """extern_kernels as the generated code calls it, with the matmuls timed and their FLOPs counted."""

    def __init__(self, inner: object, clock: KernelClock):
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str):  # called once per name: the result is kept as an attribute
        fn = getattr(self._inner, name)
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            operands = slice(1, 3) if name in ("addmm", "baddbmm") else slice(0, 2)

            def flops(args: tuple) -> float:
                a, b = args[operands]
                return 2 * a.numel() * b.size(-1)  # (..., m, k) @ (..., k, n): 2mkn per batch

            fn = self._clock.timed(name, fn, flops)
        setattr(self, name, fn)
        return fn
