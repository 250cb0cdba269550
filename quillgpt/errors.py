"""The user-error convention every entry script follows.

A user's mistake (bad config, missing data, corrupt checkpoint) raises UserError; the entry scripts wrap main() in
`run_main`, which prints one line to stderr and exits 2, no traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake the user can fix; reported as one line, exit code 2.

    reported_elsewhere: the error has been printed already (by rank 0 of a distributed job), so
    this process exits 2 without printing it again."""

    def __init__(self, message: str = "", reported_elsewhere: bool = False):
        super().__init__(message)
        self.reported_elsewhere = reported_elsewhere


class WriteError(UserError):
    """A file could not be written (disk full, read-only, no permission); the previous file is untouched."""


def report(e: UserError) -> None:
    for line in str(e).splitlines() or ["unknown error"]:
        print(f"error: {line}", file=sys.stderr, flush=True)


def run_main(main: Callable[[], int | None], exit_at_once: bool = False) -> None:
    """Run an entry point; turn UserError and Ctrl-C into a one-line message and an exit code.

    exit_at_once: once main has ended and its output is flushed, leave without the interpreter's teardown (for a
    process with nothing left to write, such as serve.py: tearing down torch's and the web stack's objects took
    seconds of CPU on a busy machine, between a user's Ctrl-C and the process ending)."""
    try:
        code = main() or 0
    except UserError as e:
        if not e.reported_elsewhere:
            report(e)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # e.g. `python sample.py ... | head`
        code = 0
    if exit_at_once:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):  # a reader that has gone, or a closed stream: nothing to flush to
                pass
        os._exit(code)
    sys.exit(code)
