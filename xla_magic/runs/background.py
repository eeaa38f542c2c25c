"""Background runs: a ``%%xla_spawn --bg`` cell followed by a thread of the kernel, and its handle. Runs in the
kernel.

``%%xla_spawn --bg`` returns at once with a :class:`BackgroundRun`; a
thread of the kernel runs the cell in the pool as a blocking cell would
(the same request: runner.py, runs/request.py), while the kernel runs other
cells. What the thread shows goes to the run's log and under the cell that
started it (routing.py). The handle waits for it, takes its results or its
error, stops it (as the stop button does: the pool keeps its ranks) and
replays its log. A rank's ``input()`` waits until someone waits on the run:
the waiter's cell asks it. :class:`Runs` is the session's list of them; a
pool that one holds refuses other requests at once, naming it.
"""

from __future__ import annotations

import contextvars
import os
import queue
import shutil
import sys
import threading
import time
import traceback
from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic.runs import profile_drawer
from xla_magic.runs.errors import RankError
from xla_magic.runs.sink import Sink, in_notebook
from xla_magic.runs import log as run_log
from xla_magic.runs import routing

POLL = 0.05  # how often a waiter looks for the end, or for a rank's question
DETACH_WAIT = 10.0  # for a kept pool's run to let go of its log as its session closes


class Workers:
    """The threads that follow background runs, kept between runs: one idle takes the next run at once.

    Starting a thread costs the starting cell more than the rest of ``--bg``
    together: ``Thread.start`` waits until the new thread runs, and a busy new
    thread keeps the starter from the GIL for up to its switch interval (5 ms).
    Daemon threads: a run that goes on never holds up the kernel's exit.
    """

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        """``job`` in a thread of its own, each run in a fresh context (no other run's cell as its parent)."""
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="xla_magic run", daemon=True).start()
        jobs.put(job)

    def _serve(self, jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            job = jobs.get()
            try:
                contextvars.Context().run(job)
            except BaseException:  # a run's own failure was shown under its cell; the thread serves on
                pass
            with self._lock:
                self._idle.append(jobs)


WORKERS = Workers()


class WaitInterrupted(KeyboardInterrupt):
    """An interrupt stopped the wait for a background run; the run goes on."""


def first_line(cell: str, width: int = 40) -> str:
    line = next((line.strip() for line in cell.splitlines() if line.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


class BackgroundRun:
    """A cell running in the background: ``done()``, ``wait()``, ``results``, ``error``, ``stop()``, ``show()``."""

    def __init__(self, runs: Runs, run_id: int, cell: str, pool: Any, size: int, work: Callable[[Any], Any],
                 parent: dict[str, Any] | None, shell: Any, resumed: str | None = None,
                 started: float | None = None) -> None:
        self.runs = runs
        self.id = run_id
        self.cell = cell
        self.pool = pool  # the pool it holds; None: ranks spawned for it alone
        plural = "s" if size != 1 else ""
        self.pool_text = f"pool of {size} rank{plural}" if pool is not None else f"{size} new rank{plural}"
        self.size = size
        self.started = time.time() if started is None else started
        self.duration: float | None = None
        self.state = "running"
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.stop_requested = False
        self.last_line = ""
        self._closing = False
        # A kept pool's run outlives this kernel: its log goes on in a log another kernel began (``resumed``)
        self.detached = False
        if resumed is not None:
            self.path, self.log = resumed, run_log.LogWriter.resume(resumed)
        else:
            self.path = runs.log_path(pool, run_id)
            self.log = run_log.LogWriter(self.path, run_id, cell, self.pool_text, self.started)
        # a rank's question waits here until someone waits on the run (questions.Ask)
        self._question: dict[str, Any] | None = None
        self._reply: dict[str, Any] | None = None
        self._answered = threading.Event()
        self._work = work
        self._output = routing.ThreadOutput(shell, parent, self._stream, self._display)
        # what its requests write: into its log first, whatever the kernel's cells do meanwhile, then under its cell
        self.sink = routing.RunSink(runs.shown(), self._stream, self.ask)
        self._begun = False
        self._begin_lock = threading.Lock()

    # -- the thread ----------------------------------------------------------------

    def start(self) -> None:
        """The run begins once the kernel is done with the starting cell (its reply sent), or as soon as
        something in that cell asks the handle (done, wait, show, stop): a thread that begins work while the
        cell still runs takes the GIL from it for up to a switch interval (5 ms) at a time."""
        routing.route_streams()
        profile_drawer.after_this_cell(self.begin)

    def begin(self) -> None:
        with self._begin_lock:
            begun, self._begun = self._begun, True
        if not begun:
            WORKERS.run(self._follow)

    def _follow(self) -> None:
        state = "failed"
        try:
            with self._output:
                try:
                    self._value = self._work(self.sink)
                    state = "done"
                except BaseException as exc:  # whatever it was, it is the run's, shown under its cell
                    self._error = exc
                    if self.detached:  # its kernel goes and leaves the run to the kept pool: no end in its log
                        self.log.detach()
                        raise
                    state = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
                    if isinstance(exc, RankError):  # the last error shown, as a failed cell's: %debug opens it
                        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
                    self.sink.write("stderr", _rendered(exc))
                    sys.stderr.flush()  # before the line that says the run ended
                finally:
                    self.duration = time.time() - self.started
                    self._closing = True  # the run's last line stays the run's own
                self.sink.write("stdout", f"run {self.id} {_ended_words(state)} after {self.duration:.1f} s; every "
                                f"line it showed is kept in {self.path} (%xla_run show {self.id} shows it again)\n")
                sys.stdout.flush()
        finally:  # whatever became of its output (a kernel closing its streams), the run is over for its waiters
            if self.detached and self._error is not None:  # (a run that did end, ends in its log too)
                self.log.detach()
            else:
                self.log.end(state, self.seconds)
                ended = getattr(self.pool, "run_ended", None)
                if ended is not None:
                    ended(self.id)
            self.state = state
            self._done.set()
            routing.unroute_streams()

    def _stream(self, name: str, text: str) -> None:
        self.log.stream(name, text)
        lines = [line for line in text.splitlines() if line.strip()]
        if lines and not self._closing:
            self.last_line = lines[-1]

    def _display(self, msg: dict[str, Any]) -> None:
        content = msg.get("content", {})
        display_id = (content.get("transient") or {}).get("display_id")
        self.log.display(content.get("data", {}), content.get("metadata"), display_id,
                         msg.get("msg_type") == "update_display_data")
        text = content.get("data", {}).get("text/plain", "")
        if text.strip():
            self.last_line = text.strip().splitlines()[-1]

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        """A rank's question, from the run's thread: it waits until a waiter (wait, show) asks it in its cell."""
        line = question.get("line")
        at = f" at line {line}" if line is not None else ""
        self.sink.write("stdout", f"[run {self.id}] {question['who']} waits for {question['what']}{at}: run.wait(), "
                        f"run.show() or %xla_run show {self.id} asks it\n")
        sys.stdout.flush()
        self._reply = None
        self._answered.clear()
        self._question = question
        try:
            while not self._answered.wait(POLL):
                if self.stop_requested:
                    return {"eof": f"run {self.id} was stopped, so nothing answers {question['what']} on "
                                   f"{question['who']}"}
            return self._reply or {"eof": "no answer"}
        finally:
            self._question = None

    # -- the handle ----------------------------------------------------------------

    def done(self) -> bool:
        self.begin()
        return self._done.is_set()

    @property
    def results(self) -> Any:
        """The run's value, as a blocking cell's (by rank; an SPMD pool's one value); None until it is done."""
        return self._value

    @property
    def error(self) -> BaseException | None:
        """The error a blocking cell would have raised (RankError, RunInterrupted), once the run ended with one."""
        return self._error

    def wait(self, timeout: float | None = None) -> Any:
        """The results, once the run ended; its error is raised. An interrupt stops the wait, not the run.

        A rank's question (``input()``, ``breakpoint()``) is asked here while waiting. ``timeout`` seconds
        passed first: TimeoutError.
        """
        self.begin()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(POLL):
                self._serve()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run {self.id} still runs after {timeout:g} s; it goes on")
        except KeyboardInterrupt:
            raise WaitInterrupted(self._left_running()) from None
        if self._error is not None:
            raise self._error
        return self._value

    def stop(self) -> None:
        """Stop the run as the stop button stops a cell (a pool keeps its ranks), and wait until it has."""
        if self.done():
            raise UsageError(f"run {self.id} already ended ({self.state}); its results and output stay: "
                             f".results, .error, .show()")
        self.stop_requested = True
        self.begin()
        try:
            while not self._done.wait(POLL):
                record = self.record
                if record is not None:
                    record.interrupt_requested = True
        except KeyboardInterrupt:
            raise WaitInterrupted(f"stopped waiting for run {self.id} to stop; it is being stopped") from None

    def show(self) -> None:
        """Every line the run showed so far, once and in order, then its new ones as they come, until it ends.

        Read from the run's log. An interrupt stops the showing, not the run; a rank's question is asked here.
        """
        if not os.path.exists(self.path):
            raise UsageError(f"run {self.id}'s log was removed (%xla_runs --clear, or one of more than "
                             f"{run_log.KEPT} runs since); its results stay in .results")
        self.begin()
        try:
            replay(run_log.follow(self.path, idle=self._serve), self.runs.shown())
        except KeyboardInterrupt:
            raise WaitInterrupted(self._left_running()) from None

    @property
    def record(self) -> Any:
        """The run's record in the session's history (the status panel's), once the run made it."""
        for record in reversed(self.runs.session.history):
            if record.run_id == self.id:
                return record
        return None

    @property
    def seconds(self) -> float:
        return self.duration if self.duration is not None else time.time() - self.started

    def _serve(self) -> None:
        """Ask a rank's waiting question here, in the waiter's cell."""
        question = self._question
        if question is not None and not self._answered.is_set():
            self._reply = self.runs.shown().ask(question)
            self._answered.set()

    def _left_running(self) -> str:
        return (f"stopped waiting for run {self.id}, which goes on: .stop() or %xla_run stop {self.id} stops it"
                if not self.done() else f"stopped; run {self.id} has ended ({self.state})")

    def __repr__(self) -> str:
        ranks = f"{self.size} rank{'s' if self.size != 1 else ''}"
        last = f"; last: {self.last_line}" if self.last_line else ""
        return (f"<run {self.id} ({first_line(self.cell)}): {self.state} {self.seconds:.1f} s on {ranks}"
                f"{last}>")


def _ended_words(state: str) -> str:
    return {"done": "ended", "failed": "failed", "interrupted": "was stopped"}.get(state, state)


def _rendered(exc: BaseException) -> str:
    """An error as IPython would show it under the cell."""
    render = getattr(exc, "_render_traceback_", None)
    if render is not None:
        return "\n".join(render()) + "\n"
    if isinstance(exc, UsageError):
        return f"UsageError: {exc}\n"
    return "".join(traceback.format_exception(exc))


def replay(entries: Any, sink: Sink) -> None:
    """A log's entries shown through ``sink`` (the running cell's): streams written, displays displayed (updates in
    place), as the live run showed them."""
    handles: dict[str, Any] = {}
    for entry in entries:
        if "stream" in entry:
            sink.write(entry["stream"], entry["text"])
            (sys.stderr if entry["stream"] == "stderr" else sys.stdout).flush()
        elif "display" in entry:
            sink.show_data(entry["display"], entry.get("metadata"), entry.get("id"), bool(entry.get("update")),
                           handles)
        elif "cut" in entry:
            sink.write("stdout", f"(the run's log reached its bound of {run_log.LIMIT // 2**20} MiB here; what the "
                                 f"run showed after this is not kept)\n")


class Runs:
    """The session's background runs, the last :data:`~xla_magic.runs.log.KEPT` of them with their logs."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.shell: Any = None
        self.runs: dict[int, BackgroundRun] = {}
        self._directory: str | None = None

    def shown(self) -> Sink:
        """Where the session shows what runs say, in the cell that runs now: its runner's sink."""
        return self.session.host.sink

    def directory(self) -> str:
        """Where the logs go: ``runs/`` in the session's private directory (mode 0700)."""
        path = os.path.join(self.session.host.workdir.path, "runs")
        os.makedirs(path, mode=0o700, exist_ok=True)
        self._directory = path
        return path

    def log_path(self, pool: Any, run_id: int) -> str:
        """A run's log: in a kept pool's own directory (it outlives this kernel), else in the session's."""
        kept_logs = getattr(pool, "runs_directory", None)
        if kept_logs is not None:
            return os.path.join(kept_logs(), f"run-{run_id}-kernel-{os.getpid()}.jsonl")
        return os.path.join(self.directory(), f"run-{run_id}.jsonl")

    def adopt(self, pool: Any) -> BackgroundRun | None:
        """``%xla_pool attach``: the run a kernel that went left going in kept ``pool``, if any, as a run of this
        session. What its log holds is shown now, under the attaching cell; the rest follows live, under it too."""
        going = pool.run_going()
        if going is None:
            return None
        from IPython import get_ipython

        shell = get_ipython()
        run_id = int(going["id"])
        counter = self.session.runs  # this session's ids go on after the adopted one's
        counter.run_count = max(counter.run_count, run_id)
        self.shell = shell
        path = going.get("log")
        try:
            entries = run_log.read(path) if path else None
        except (OSError, ValueError):  # gone, or its kernel died before its first line was whole
            entries = None
        if entries:
            print(f"run {run_id} ({first_line(going['cell'])}) went on in kept pool {pool.name} after its kernel went; "
                  f"its output so far, from its log, then the rest live (%xla_run show {run_id}, %xla_run wait "
                  f"{run_id}):", flush=True)
            replay(entries, self.shown())
        else:  # a cell that ran in the foreground has no log: what it printed was shown under its own cell
            path = self.log_path(pool, run_id)
            run_log.LogWriter(path, run_id, going["cell"], "", going.get("started")).detach()
            print(f"run {run_id} ({first_line(going['cell'])}) went on in kept pool {pool.name} after its kernel went; "
                  f"the rest of its output follows live, and it is a run of this kernel's now (%xla_run show "
                  f"{run_id}, %xla_run wait {run_id})", flush=True)
        pool.run_adopted(going, path)
        run = BackgroundRun(self, run_id, going["cell"], pool, pool.world_size, pool.follow_run(going),
                            _parent_header(shell), shell, resumed=path, started=going.get("started"))
        self.runs[run_id] = run
        run.start()
        return run

    def start(self, cell: str, pool: Any, size: int, work: Callable[[Any], Any], shell: Any,
              run_id: int) -> BackgroundRun:
        """A run of ``cell`` in ``pool`` (None: in new ranks) on ``size`` ranks, by ``work(ask)`` in a thread."""
        self.shell = shell
        parent = _parent_header(shell)
        run = BackgroundRun(self, run_id, cell, pool, size, work, parent, shell)
        self.runs[run_id] = run
        self._forget_old()
        run.start()
        return run

    def holding(self, pool: Any) -> BackgroundRun | None:
        """The live run that holds ``pool``, if any."""
        for run in self.runs.values():
            if pool is not None and run.pool is pool and not run.done():
                return run
        return None

    def living(self) -> list[BackgroundRun]:
        return [run for run in self.runs.values() if not run.done()]

    def get(self, run_id: str | int | None) -> BackgroundRun:
        """The run ``run_id`` names (None: the last one), or the UsageError that says which there are."""
        if run_id is None:
            if not self.runs:
                raise UsageError("no background run in this session: %%xla_spawn --bg starts one")
            return self.runs[max(self.runs)]
        try:
            number = int(str(run_id).strip())
        except ValueError:
            raise UsageError(f"a run's id is its number, as %xla_runs lists them, not {run_id!r}") from None
        run = self.runs.get(number)
        if run is None:
            known = (f"its runs: {', '.join(str(n) for n in sorted(self.runs))}; %xla_runs lists them" if self.runs
                     else "it has none now: %%xla_spawn --bg starts one")
            raise UsageError(f"no background run {number} in this session ({known}; %xla_runs --clear forgets the "
                             f"runs that ended)")
        return run

    def refusal(self, run: BackgroundRun, action: str) -> str:
        return (f"{action} refused at once: the pool is running background run {run.id} (cell: "
                f"{first_line(run.cell)!r}, {run.seconds:.0f} s so far). Wait for it (%xla_run wait {run.id}), "
                f"stop it (%xla_run stop {run.id}), run this cell in new ranks with --fresh where devices are free, "
                f"or queue it with %%xla_spawn --after, which waits for the pool and then runs")

    def check_free(self, pool: Any, action: str) -> None:
        run = self.holding(pool)
        if run is not None:
            raise UsageError(self.refusal(run, action))

    def wait_for_pool(self, pool: Any) -> None:
        """``--after``: wait until no background run holds ``pool`` (an interrupt stops the wait; the cell did
        not run)."""
        run = self.holding(pool)
        while run is not None:
            try:
                while not run.done():  # (which begins it, if the cell that started it still runs)
                    run._done.wait(POLL)
                    run._serve()
            except KeyboardInterrupt:
                raise WaitInterrupted(f"stopped waiting for run {run.id} (which goes on); this cell did not "
                                      f"run") from None
            run = self.holding(pool)

    def clear(self) -> int:
        """``%xla_runs --clear``: the ended runs and their logs go; a run still going stays. How many went."""
        gone = [run for run in self.runs.values() if run.done()]
        for run in gone:
            del self.runs[run.id]
            _remove(run.path)
        return len(gone)

    def _forget_old(self) -> None:
        ended = sorted(run_id for run_id, run in self.runs.items() if run.done())
        while len(self.runs) > run_log.KEPT and ended:
            _remove(self.runs.pop(ended.pop(0)).path)

    def close(self) -> None:
        """The session ends: every live run is stopped (its ranks' cells interrupted) and waited for; a run in a
        kept pool goes on there without this kernel (its log stops here, without an end, for the next one)."""
        for run in self.living():
            if getattr(run.pool, "runs_directory", None) is not None:
                run.detached = True
                run.pool.leave()  # its thread reads no more, writes down what it read, and lets go of the log
                run._done.wait(DETACH_WAIT)
                continue
            run.stop_requested = True
            run.begin()  # (a run never begun ends at once, stopped)
            deadline = time.monotonic() + 30
            while not run.done() and time.monotonic() < deadline:
                record = run.record
                if record is not None:
                    record.interrupt_requested = True
                run._done.wait(POLL)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _parent_header(shell: Any) -> dict[str, Any] | None:
    """The header of the request running now (the cell that starts the run), in a Jupyter kernel."""
    if not in_notebook(shell):
        return None
    header = getattr(getattr(shell, "display_pub", None), "parent_header", None)
    return dict(header) if header else None
