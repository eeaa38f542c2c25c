"""Process lifetime helpers for the launcher, supervisors and ranks (Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits.

    ``parent_pid`` is the parent as the parent knew itself (its pid recorded
    before the fork, or passed on the command line). If our parent is someone
    else by the time the signal is armed, it died before the call: exit now.
    PID 1 is a parent like any other (a kernel run as a container's first process).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: pipe EOF still ends us
        return
    if os.getppid() != parent_pid:
        os._exit(1)


_libc: ctypes.CDLL | None = None


def flush_c_stdio() -> None:
    """Flush C stdio buffers so printf output reaches fd 1 (before we exit, after a pool cell).

    libc is looked up once: a pool rank calls this at the end of every cell.
    """
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except (OSError, AttributeError):
        pass


def exit_code(status: int) -> int:
    """A wait status as an exit code, or minus the signal that ended it."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@contextlib.contextmanager
def silenced_stdout() -> Iterator[None]:
    """Send what native code writes to fd 1 to /dev/null for a moment."""
    sys.stdout.flush()
    flush_c_stdio()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
