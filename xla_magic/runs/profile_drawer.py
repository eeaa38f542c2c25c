"""Filling in a ``--profile`` cell's profile once the kernel is done with the cell. Runs in the kernel.

A pool's ranks read their traces after they replied (launcher/profiling.py),
when the kernel tells them to (DIGEST), and the kernel fills in the profile
when those readings came (profile_view.after_cell). Both wait until the
kernel is done with the cell: its reply and its idle status sent
(:func:`after_this_cell`). The ranks' reading is the heaviest work of a
profile, four processes on this 2-core machine, and begun as soon as the
ranks had replied it made the kernel's own end of a 10-step training cell
(its result shown, its reply sent) 3.5 to 5 ms longer, a tenth of the cell,
even with the reading threads at the lowest priority.

The wait for the readings, and the drawing after it, run in one thread,
made with the first profile and kept: a thread per cell cost the cell 2-3
ms on a busy machine (``Thread.start`` waits until the new thread has run).
A job starts once its cell is over, or at once when something waits for
it (:meth:`Drawer.wait`: the next ``%%xla_spawn``, ``%xla_profile``, a
second profiled cell in the same cell).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Callable


def after_this_cell(then: Callable[[], None]) -> None:
    """``then`` in this thread once the kernel is done with the running cell.

    In a Jupyter kernel, a callback of its event loop: the cell runs inside
    the loop's handling of its message, so the callback runs when that
    handling returned, after the reply and the idle status went. In a
    terminal IPython, at its ``post_execute``; elsewhere (a background
    run's thread among them), now.
    """
    import asyncio

    if threading.current_thread() is not threading.main_thread():
        then()  # a background run's thread (runs/background.py): the cell that started it is long over
        return
    try:
        asyncio.get_running_loop().call_soon(then)
        return
    except RuntimeError:  # no loop runs the cell
        pass
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception:  # no IPython
        shell = None
    if shell is None:
        then()
        return

    def once() -> None:
        shell.events.unregister("post_execute", once)
        then()

    shell.events.register("post_execute", once)


class Job:
    """One profile to fill in, in the context of the cell that made it (its output goes to that cell)."""

    def __init__(self, work: Callable[[], None], start: Callable[[], None] | None) -> None:
        self.work = work
        self.start = start  # run once, in the kernel's thread, before the work may begin (the DIGEST)
        self.context = contextvars.copy_context()
        self.go = threading.Event()  # started: the work may begin
        self.done = threading.Event()
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Its start, then its work may go (once, whoever asks first: the cell's end, or a wait)."""
        with self._lock:
            start, self.start = self.start, None
            if self.go.is_set():
                return
            try:
                if start is not None:
                    start()
            except Exception:  # a pool gone since: its digests will not come, and the drawing says so
                pass
            finally:
                self.go.set()


class Drawer:
    """Jobs in order, each once its cell is over."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending: list[Job] = []  # jobs not begun yet
        self._last: Job | None = None

    def submit(self, work: Callable[[], None], start: Callable[[], None] | None = None) -> None:
        """``start`` (here), then ``work`` in the drawing thread, once the kernel is done with the running cell."""
        job = Job(work, start)
        with self._lock:
            self._last = job
            self._pending.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="xla_magic profile", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        after_this_cell(self._begin_pending)

    def wait(self) -> None:
        """Until every job so far is done; those not begun yet begin now."""
        job = self._last
        if job is None or threading.current_thread() is self._thread:
            return
        self._begin_pending()
        job.done.wait()

    def _begin_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for job in pending:
            job.begin()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            job.go.wait()
            try:
                job.context.run(job.work)  # (the work says what went wrong itself: profile_view._filled)
            except Exception:
                pass
            finally:
                job.done.set()


DRAWER = Drawer()
