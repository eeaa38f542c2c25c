"""torch_xla's in-process profiler around a cell (``--profile``). Runs in a rank (process or thread).

The kernel names a directory for the run (in its session directory, on its
host); each rank process records the cell with
``torch_xla.debug.profiler.start_trace``/``stop_trace`` into its own folder
there (``rank<N>``, N its first rank), where torch_xla writes
``plugins/profile/<time>/<host>.xplane.pb`` and ``<host>.trace.json.gz``.
The rank sends where they are (protocol.PROFILE) with its reply; the kernel
draws the timeline from the Chrome-trace JSON (profile_view.py).

torch_xla's profiler is one per process: rank threads of one process (the
tpu launch path) share one trace, started by the first to begin and stopped
by the last to end, as their XLA account is shared (xla_account.py). A
trace the user started in the cell makes ours fail to start: the cell runs
unprofiled, and the reply says why. Nothing here may fail a cell.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
from typing import Any

TRACE = "trace.json.gz"
XPLANE = "xplane.pb"


class Profiler:
    """This process's profile of the cell, shared by its rank threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.ranks: list[int] = []
        self.folder = ""
        self.error = ""

    def begin(self, rank: int, directory: str) -> None:
        with self.lock:
            self.ranks.append(rank)
            self.active += 1
            if self.active > 1:
                return
            self.folder, self.error = os.path.join(directory, f"rank{rank}"), ""
            try:
                import torch_xla.debug.profiler as xp

                os.makedirs(self.folder, exist_ok=True)
                xp.start_trace(self.folder)
            except Exception as exc:  # another trace running (the user's), an old torch_xla
                self.error = f"{type(exc).__name__}: {exc}"

    def end(self) -> dict[str, Any] | None:
        """Where the trace went, for the last rank thread to leave (protocol.PROFILE); None for the others."""
        with self.lock:
            self.active -= 1
            if self.active:
                return None
            ranks, self.ranks = sorted(self.ranks), []
            if not self.error:
                try:
                    import torch_xla.debug.profiler as xp

                    xp.stop_trace()
                except Exception as exc:
                    self.error = f"{type(exc).__name__}: {exc}"
            return {"ranks": ranks, "host": socket.gethostname(), "pid": os.getpid(), "folder": self.folder,
                    "trace": _newest(self.folder, TRACE), "xplane": _newest(self.folder, XPLANE),
                    "error": self.error}


def _newest(folder: str, suffix: str) -> str:
    """The newest file the profiler wrote there that ends so ("" if none)."""
    found = glob.glob(os.path.join(folder, "plugins", "profile", "*", f"*.{suffix}"))
    return max(found, key=os.path.getmtime) if found else ""


_profiler: Profiler | None = None
_profiler_pid: int | None = None
_profiler_lock = threading.Lock()


def profiler() -> Profiler:
    """This process's profiler, one for all its rank threads (made anew in a forked child)."""
    global _profiler, _profiler_pid
    with _profiler_lock:
        if _profiler is None or _profiler_pid != os.getpid():
            _profiler, _profiler_pid = Profiler(), os.getpid()
        return _profiler
