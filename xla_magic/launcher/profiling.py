"""torch_xla's in-process profiler around a cell (``--profile``). Runs in a rank (process or thread).

The kernel names a directory for the run (in its session directory, on its
host); each rank process records the cell with
``torch_xla.debug.profiler.start_trace``/``stop_trace`` into its own folder
there (``rank<N>``, N its first rank), where torch_xla writes
``plugins/profile/<time>/<host>.xplane.pb`` and ``<host>.trace.json.gz``.
The rank sends where its trace is (protocol.PROFILE) with its reply. Once
the kernel says so (DIGEST, when it is done with the cell), a pool's rank
writes its sampled lines beside the trace, finds the profiler's files,
reads its Chrome-trace JSON into a digest of the timeline's lane
(wire/trace.py's digest: each rank process reads its own, all at once) and
writes that, with the files' paths, beside the trace (``DIGEST``,
:func:`write_digest`): the kernel fills in the timeline when the digests
are there (profile_view.py). A one-shot rank, whose process ends with its
reply, does all of it before and sends its digest with the reply.

torch_xla's profiler is one per process: rank threads of one process (the
tpu launch path) share one trace, started by the first to begin and stopped
by the last to end, as their XLA account is shared (xla_account.py). A
trace the user started in the cell makes ours fail to start: the cell runs
unprofiled, and the reply says why. Nothing here may fail a cell.

torch_xla's in-process profiler records no Python frames (2.9 takes no
options there; the ``python_tracer_level`` of its remote ``trace`` has no
Python tracer behind it in ``_XLAC``). So, while a profiled cell runs, a
thread of ours (:class:`LineSampler`) reads each rank thread's innermost
cell line every ``PERIOD_MS`` (``sys._current_frames()``, as the stack
sampler does) and keeps spans of (line, text, start, end), written beside
the trace (``python-lines.json``). Its times are aligned to the trace's by
one annotation it puts in the trace when it starts (``ORIGIN``).
"""

from __future__ import annotations

import json
import linecache
import os
import queue
import socket
import sys
import threading
import time
import types
from typing import Any

from xla_magic.launcher.stacks import CELL_FILE
from xla_magic.wire import trace

DIGEST = "xla_magic-digest.json"  # the rank's digest of its trace, written once its reply went (write_digest)
# How often the cell's line is sampled: at 5 ms the timer cost a 10-step training cell 1.12-1.17x (benchmarks/
# bench_profile.py); a line's time is known to about this.
PERIOD_MS = 10
ORIGIN = "xla_magic: sampled lines start"  # the annotation that ties the sampled lines' clock to the trace's
LINES_SWITCH = "XLA_MAGIC_PROFILE_LINES"  # in the kernel's environment: "0", no lines; a number, the period in ms


class Profiler:
    """This process's profile of the cell, shared by its rank threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.ranks: list[int] = []
        self.folder = ""
        self.error = ""
        self.lines: LineSampler | None = None  # the sampler, while it samples this process's profiled cell
        self.sampler = LineSampler()

    def begin(self, rank: int, directory: str) -> None:
        with self.lock:
            self.ranks.append(rank)
            self.active += 1
            if self.active == 1:
                self._start(rank, directory)
            if self.lines is not None:
                self.lines.add(rank, threading.get_ident())

    def _start(self, rank: int, directory: str) -> None:
        self.folder, self.error, self.lines = os.path.join(directory, f"rank{rank}"), "", None
        try:
            import torch_xla.debug.profiler as xp

            os.makedirs(self.folder, exist_ok=True)
            xp.start_trace(self.folder)
        except Exception as exc:  # another trace running (the user's), an old torch_xla
            self.error = f"{type(exc).__name__}: {exc}"
            return
        period = _period()
        if not period:
            return
        try:
            import torch_xla

            # The C++ TraceMe itself: xp.Trace would also push an IR scope and look for jax (ms, each time).
            with torch_xla._XLAC.profiler.TraceMe(ORIGIN):
                origin = time.time_ns() // 1000
            self.sampler.start(origin, period)
            self.lines = self.sampler
        except Exception:  # no lines, still the trace
            self.lines = None

    def end(self, digest_now: bool = True) -> dict[str, Any] | None:
        """Where the trace went, for the last rank thread to leave (protocol.PROFILE); None for the others.

        With its digest when ``digest_now``; else it names the file its digest will be written to
        (``digest_file``: :func:`write_digest`, once the reply went)."""
        with self.lock:
            self.active -= 1
            if self.lines is not None:
                self.lines.remove(threading.get_ident())
            if self.active:
                return None
            ranks, self.ranks = sorted(self.ranks), []
            sampler, self.lines = self.lines, None
            sampled = sampler.stop() if sampler is not None else None
            if not self.error:
                try:
                    import torch_xla.debug.profiler as xp

                    xp.stop_trace()
                except Exception as exc:
                    self.error = f"{type(exc).__name__}: {exc}"
            where = {"ranks": ranks, "host": socket.gethostname(), "pid": os.getpid(), "folder": self.folder,
                     "error": self.error}
            if self.error:
                where.update(trace="", xplane="", lines="")
            elif digest_now:
                where.update(_files(self.folder, sampled))
                where["digest"] = _digest(where)
            else:  # the files too are found and written after the reply (write_digest), off the cell's time
                where["digest_file"] = os.path.join(self.folder, DIGEST)
                _sampled[where["digest_file"]] = sampled
            return where


def _files(folder: str, sampled: dict[str, Any] | None) -> dict[str, str]:
    """The sampled lines written beside the trace, then the profile's files in ``folder``: their paths ("" for one
    not there)."""
    if sampled is not None:
        try:
            with open(os.path.join(folder, trace.LINES_FILE), "w", encoding="utf-8") as file:
                json.dump(sampled, file)
        except Exception:  # no lines: the trace still stands
            pass
    return trace.profiler_files(folder)


class LineSampler:
    """Every PERIOD_MS while a profiled cell runs, each profiled rank thread's innermost cell line, kept as spans
    (µs since the epoch).

    A rank whose cell runs in its process's main thread (the cpu backend, SPMD)
    is sampled by a timer signal (ITIMER_REAL), whose handler Python runs in
    that thread between two bytecodes, with the frame it interrupted. A thread
    of ours would take the GIL at every sample: the cell's thread, which lets
    go of it in many of torch's calls, then waits to get it back, and on a
    busy machine that wait is the scheduler's (measured on this project's
    2-core machine beside a test run: 5 to 7 of 16 profiled 10-step training
    cells took over 250 ms, up to 1.2 s, against 90-180 ms without lines).
    SA_RESTART is asked for, so the signal restarts the system calls
    it lands in. Rank threads (the tpu launch path) are sampled by a thread,
    made with the first profiled cell of a process and kept, asleep between
    profiled cells; so is a cell whose process already uses SIGALRM.
    """

    def __init__(self) -> None:
        self.origin = 0  # when the ORIGIN annotation began, µs since the epoch
        self.period: float = PERIOD_MS
        self.threads: dict[int, int] = {}  # thread ident -> its rank
        self.spans: dict[int, list[list[Any]]] = {}  # rank -> [line, text, start, end], in order
        self.texts: dict[tuple[str, int], str] = {}  # (cell file, line) -> its text, for this cell
        self.main = threading.main_thread().ident
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.thread: threading.Thread | None = None
        self.timed = False  # sampling by the timer signal, in the main thread
        self._in_alarm = False  # its handler is running: Python runs a signal's handler inside a handler too
        self._handler: Any = None  # SIGALRM's handler before ours

    def start(self, origin: int, period: float = PERIOD_MS) -> None:
        with self.lock:
            self.origin, self.period, self.threads, self.spans, self.texts = origin, period, {}, {}, {}
            self.main = threading.main_thread().ident
            if not (_on_main_thread() and self._start_timer()):
                self._start_thread()

    def _start_thread(self) -> None:
        self.running.set()
        if self.thread is None or not self.thread.is_alive():  # a forked child has none
            self.thread = threading.Thread(target=self._run, name="xla_magic cell lines", daemon=True)
            self.thread.start()

    def _start_timer(self) -> bool:
        """Sample the main thread by SIGALRM; False where the process uses it already (its own alarm, a timer)."""
        import signal

        try:
            if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None) or any(
                    signal.getitimer(signal.ITIMER_REAL)):
                return False
            self._handler = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.siginterrupt(signal.SIGALRM, False)
            self.timed = True
            signal.setitimer(signal.ITIMER_REAL, self.period / 1000, self.period / 1000)
            return True
        except (ValueError, OSError):
            self._stop_timer()
            return False

    def _stop_timer(self) -> None:
        """No sample once this returns: the flag first (an alarm already raised is let pass), then the timer,
        then the handler back (no alarm is left to meet it)."""
        import signal

        if self._handler is None:
            return
        self.timed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._handler)
        self._handler = None

    def _on_alarm(self, _signum: int, frame: types.FrameType | None) -> None:
        # Runs in the main thread, maybe inside add/remove/stop (which hold the lock): so it takes none. In
        # this mode only the main thread ever touches the spans.
        # An alarm that comes while a sample is taken (a loaded machine left the process off its core for a
        # period) would note a span between the outer one's closing the last span and appending its own,
        # leaving one open in the middle for good: it is skipped.
        if not self.timed or self._in_alarm:
            return
        self._in_alarm = True
        try:
            rank = self.threads.get(self.main)
            if rank is not None:
                self._note(rank, frame, time.time_ns() // 1000)
        except Exception:  # never lose the cell to a frame we could not read
            pass
        finally:
            self._in_alarm = False

    def add(self, rank: int, ident: int) -> None:
        with self.lock:
            self.threads[ident] = rank
            self.spans.setdefault(rank, [])
            if self.timed and ident != threading.main_thread().ident:  # the timer sees the main thread only
                self._stop_timer()
                self._start_thread()

    def remove(self, ident: int) -> None:
        """A rank thread's cell ended: its open span ends now."""
        with self.lock:
            rank = self.threads.pop(ident, None)
            if rank is not None:
                self._close(rank, time.time_ns() // 1000)

    def _run(self) -> None:
        while True:
            self.running.wait()
            time.sleep(self.period / 1000)
            try:
                self.sample()
            except Exception:  # never lose the cell to a frame we could not read
                pass

    def sample(self) -> None:
        frames = sys._current_frames()
        now = time.time_ns() // 1000
        with self.lock:
            if not self.running.is_set():
                return
            for ident, rank in self.threads.items():
                self._note(rank, frames.get(ident), now)

    def _note(self, rank: int, frame: types.FrameType | None, now: int) -> None:
        """One sample of ``rank``'s thread: a new span where its line changed (its text read once per line)."""
        found = _cell_frame(frame)
        line = (found.f_lineno or 0) if found is not None else None
        spans = self.spans[rank]
        last = spans[-1] if spans and spans[-1][3] is None else None
        if last is not None and last[0] == line:
            return
        if last is not None:
            last[3] = now
        if found is not None:
            key = (found.f_code.co_filename, line)
            text = self.texts.get(key)
            if text is None:
                text = self.texts[key] = linecache.getline(key[0], line).strip()
            spans.append([line, text, now, None])

    def _close(self, rank: int, now: int) -> None:
        spans = self.spans.get(rank)
        if spans and spans[-1][3] is None:
            spans[-1][3] = now

    def stop(self) -> dict[str, Any]:
        """Stop sampling (the thread sleeps again); what it saw, as written beside the trace."""
        self._stop_timer()
        now = time.time_ns() // 1000
        with self.lock:
            self.running.clear()
            for rank in list(self.spans):
                self._close(rank, now)
            return {"period_ms": self.period, "origin": self.origin, "origin_event": ORIGIN,
                    "ranks": {str(rank): spans for rank, spans in self.spans.items()}}


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _digest(where: dict[str, Any]) -> dict[str, Any] | None:
    """This process's trace, read here, at once, as every rank process reads its own (wire/trace.py's digest);
    None if it could not be: the kernel then reads the files itself."""
    try:
        return trace.digest(where)
    except Exception:
        return None


_sampled: dict[str, dict[str, Any] | None] = {}  # by digest file: the sampled lines, written with the digest
_digests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
_digester: list[threading.Thread] = []
_held: list[dict[str, Any]] = []  # traces whose reading waits for the kernel's DIGEST


def digest_later(where: dict[str, Any]) -> None:
    """:func:`write_digest` once the kernel says so (:func:`digest_now`): when it is done with the cell. A
    pool's rank replies first, and its reading of the trace, the heaviest work of a profile, would otherwise
    take the cores from the ranks still running the cell (a 10-step cell's 4 ranks on 2 cores: 1.23 times the
    profiler alone, against 1.12 with no reading at all), and then from the kernel ending the cell."""
    _held.append(where)


def digest_now() -> None:
    """DIGEST: the held traces are read in this process's digesting thread, at the lowest priority."""
    held, _held[:] = list(_held), []
    if not held:
        return
    if not _digester:
        _digester.append(threading.Thread(target=_digest_forever, name="xla_magic-digest", daemon=True))
        _digester[0].start()
    for where in held:
        _digests.put(where)


def _digest_forever() -> None:
    try:  # Linux, this thread only: it runs when no other thread of the machine wants the core
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # a thread's own nice value
        except OSError:
            pass
    while True:
        try:
            write_digest(_digests.get())  # which writes a file whatever happens: the kernel never waits in vain
        except Exception:  # the kernel reads that trace itself, and says so if it cannot
            pass


def write_digest(where: dict[str, Any]) -> None:
    """The sampled lines beside the trace, then the digest of the trace into ``where``'s ``digest_file``, with
    the files' paths (whole or not at all: written aside, then renamed); what went wrong instead, if the trace
    could not be read, so the kernel reads the files itself."""
    path = where.get("digest_file")
    if not path:
        return
    found: dict[str, Any] | None = None
    files: dict[str, str] = {}
    try:
        os.makedirs(where["folder"], exist_ok=True)  # (the profiler may have written nothing)
        files = _files(where["folder"], _sampled.pop(path, None))
        found = _digest({**where, **files})
    finally:  # an interrupt meant for the next cell still leaves a file: the kernel does not wait in vain
        try:
            aside = f"{path}.{os.getpid()}.part"
            with open(aside, "w", encoding="utf-8") as file:
                json.dump({**(found if found is not None else {"failed": True}), "files": files}, file)
            os.replace(aside, path)
        except Exception:  # the kernel's wait (wire/trace.py's wait_digest) gives up when the rank is gone
            pass


def _period() -> float:
    """The sampling period the kernel's environment asks for (LINES_SWITCH), in ms; 0: no lines."""
    asked = os.environ.get(LINES_SWITCH, "")
    try:
        return max(float(asked), 0.0) if asked else PERIOD_MS
    except ValueError:
        return PERIOD_MS


def _cell_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame of the cell's own code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(CELL_FILE):
            return frame
        frame = frame.f_back
    return None


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
