"""The ordered process pool that does prepare's work: `ordered_map` runs a function over chunks in --workers
processes (default: the usable cores) and gives the results back in input order, so the files written from them
are byte-identical for any number of workers. At most 2 x workers chunks are in flight, so memory stays bounded
whatever the input size; the workers die with their parent, so a killed prepare leaves none behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from quillgpt import corpus
from quillgpt.corpus import Chunk, TextSpan


@dataclass
class Done:
    """What the main process keeps of a chunk while a worker has it: not the chunk's data."""

    split: str | None  # a TextSpan's split; None for documents, whose split their index decides
    size: int  # input bytes (the progress bar's unit)
    state: dict | None  # a hub stream's state after the chunk


def done(item: tuple[Chunk, dict | None]) -> Done:
    chunk, state = item
    return Done(chunk.split if isinstance(chunk, TextSpan) else None, corpus.chunk_size(chunk), state)


def ordered_map(
    fn: Callable, items: Iterable, workers: int, initializer: Callable | None = None, initargs: tuple = ()
) -> Iterator[tuple[Done, Any]]:
    """(done(item), fn(item)) in the order of items, computed by `workers` forked processes (in this one for 1), at
    most 2 x workers items ahead of the consumer: memory stays bounded whatever the number of items."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from ((done(item), fn(item)) for item in items)
        return
    context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=start_pool_worker, initargs=(os.getpid(), initializer, initargs)
    ) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append((done(item), pool.submit(fn, item)))
                if len(pending) > 2 * workers:
                    kept, future = pending.popleft()
                    yield kept, future.result()
            while pending:
                kept, future = pending.popleft()
                yield kept, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def start_pool_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    """Die with the parent: a SIGKILLed prepare.py would otherwise leave its workers waiting forever on a queue
    that every one of them holds open (Linux: the kernel sends SIGKILL when the parent goes)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    if initializer is not None:
        initializer(*initargs)
