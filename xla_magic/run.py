"""One run of a cell on its ranks, followed from the kernel to the end.

Runs in the kernel, in the thread that runs the cell, so output lands in the
running cell and Ctrl-C / the stop button arrive here as KeyboardInterrupt:
events and raw output streams from every rank, fail-fast, interrupt and
timeout escalation, results.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable


from xla_magic import protocol, transport
from xla_magic.display import LiveLines, RankError, RankFailure, RunInterrupted, TaggedOutput
from xla_magic.launcher_client import Launcher, PrivateDir
from xla_magic.payload import Payload

FAIL_GRACE = 0.5  # after a rank fails, how long to collect the others' errors
STOP_GRACE = 1.5  # between SIGINT, SIGTERM and SIGKILL
DRAIN_TIMEOUT = 3.0  # reading what is left once the processes are gone
TICK_INTERVAL = 0.5  # how often listeners hear of a running cell with no news


def signal_name(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


SIGNAL_HINTS = {
    "SIGKILL": "killed; usually the host ran out of memory (every rank holds its own copy of what it loads)",
    "SIGSEGV": "a native crash (segmentation fault) in C/C++ code",
    "SIGABRT": "aborted by native code (a failed check in the runtime)",
    "SIGBUS": "a bus error; /dev/shm may be full",
    "SIGTERM": "terminated",
}


def describe_exit(code: int | None) -> str:
    name = signal_name(code)
    hint = SIGNAL_HINTS.get(name)
    return f"{name}: {hint}" if hint else name


# --- one run ----------------------------------------------------------------


@dataclass
class RankState:
    state: str = "starting"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    lines: int = 0
    last_line: str = ""
    pid: int | None = None
    memory: dict[str, Any] | None = None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


@dataclass
class RunRecord:
    """What the status panel shows of a run."""

    run_id: int
    cell: str
    backend: str
    devices: int
    started: float = field(default_factory=time.time)
    duration: float | None = None
    outcome: str = "running"
    ranks: dict[int, RankState] = field(default_factory=dict)
    # Set from any thread (the status panel's Interrupt button); the run
    # stops as if the notebook's stop button had been pressed.
    interrupt_requested: bool = False


@dataclass
class RunSpec:
    payload: Payload
    backend: str
    devices: int
    cpu_threads: bool = False
    timeout: float | None = None


class _Conn:
    """One socket the kernel reads during a run."""

    def __init__(self, sock: socket.socket, rank: int | None, kind: str) -> None:
        self.sock = sock
        self.rank = rank
        self.kind = kind  # "events", "stdout", "stderr" or "supervisor"
        self.reader = protocol.FrameReader() if kind in ("events", "supervisor") else None
        sock.setblocking(False)


class Run:
    """Starts one cell on its ranks and follows it to the end."""

    def __init__(
        self,
        spec: RunSpec,
        launcher: Launcher,
        record: RunRecord,
        on_update: Callable[[RunRecord], None] = lambda record: None,
        live_lines: bool = False,
        *,
        workdir: PrivateDir,
    ) -> None:
        self.spec = spec
        self.launcher = launcher
        self.record = record
        self.on_update = on_update
        self.workdir = workdir
        self.store: str | None = None  # a one-shot run's gloo store, removed when it ends
        self._live = LiveLines() if live_lines else None
        # Folded logs outlive the run: the cell printed their paths.
        self.output = TaggedOutput(
            log_dir=lambda: workdir.new(f"logs-{record.run_id}-"), on_line=self._on_line, live=self._live
        )
        self.selector = selectors.DefaultSelector()
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        self.done: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        self.supervisor_pid: int | None = None
        self.launch_error: str | None = None
        self.reported_running: set[int] = set()  # ranks that said they run the cell
        self.first_failure_at: float | None = None
        self.supervisor_closed_at: float | None = None
        self.stop_reason: str | None = None  # failure, timeout or interrupt, once we stop the run
        record.ranks = {rank: RankState() for rank in range(spec.devices)}

    @property
    def supervisor_open(self) -> bool:
        return self.supervisor_closed_at is None

    # -- starting --------------------------------------------------------

    def start(self) -> None:
        """Hand the cell to the launcher. If that fails, the run is over: its
        sockets, shared memory and store are gone and its record says how it ended."""
        theirs: list[socket.socket] = []
        try:
            ours, remote = socket.socketpair()
            self._watch(_Conn(ours, None, "supervisor"))
            theirs.append(remote)
            for rank in range(self.spec.devices):
                for kind in ("events", "stdout", "stderr"):
                    ours, remote = socket.socketpair()
                    self._watch(_Conn(ours, rank, kind))
                    theirs.append(remote)
            payload = self.spec.payload
            self.store = self.workdir.new(f"store-{self.record.run_id}-")
            job = {
                "run_id": self.record.run_id,
                "store": self.store,
                "backend": self.spec.backend,
                "cpu_threads": self.spec.cpu_threads,
                "source": payload.source,
                "filename": payload.filename,
                "has_result": payload.has_result,
                "namespace": payload.namespace,
            }
            self.supervisor_pid = self.launcher.submit(job, [s.fileno() for s in theirs])
        except BaseException as exc:
            self._close_all()
            self._sweep_segments()
            self._remove_store()
            self._finish("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        finally:
            for sock in theirs:
                sock.close()

    def _watch(self, conn: _Conn) -> None:
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)

    # -- following -------------------------------------------------------

    def wait(self) -> list[Any] | None:
        """Pump events until every rank is accounted for; results by rank."""
        deadline = None if self.spec.timeout is None else time.monotonic() + self.spec.timeout
        try:
            while self._running():
                if self.first_failure_at is not None and time.monotonic() - self.first_failure_at > FAIL_GRACE:
                    self._stop("failure", first_signal=signal.SIGTERM)
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self._stop("timeout", first_signal=signal.SIGINT)
                    raise self._error(f"timed out after {self.spec.timeout:g} s (--timeout); the ranks were stopped")
                if self._drained_long_enough():
                    break
                if self.record.interrupt_requested:
                    raise KeyboardInterrupt
                self._pump(0.1)
                self._tick()
        except KeyboardInterrupt:
            self._stop("interrupt", first_signal=signal.SIGINT)
            self._finish("interrupted")
            raise RunInterrupted(
                "interrupted; the ranks were stopped (SIGINT, then SIGTERM/SIGKILL if needed). "
                "Results of ranks that finished are on this error's .results.",
                dict(self.results),
            ) from None
        finally:
            self._close_all()
            self._sweep_segments()
            self._remove_store()
            if self.record.outcome == "running":  # the stop itself was broken off
                self._finish("interrupted" if self.stop_reason == "interrupt" else "failed")
        self._account_for_missing_ranks()
        if self.failures:
            self._finish("failed")
            raise self._error(self._failure_summary())
        self._finish("done")
        if not self.spec.payload.has_result:
            return None
        return [self.results.get(rank) for rank in range(self.spec.devices)]

    _last_tick = 0.0

    def _tick(self) -> None:
        """Let listeners show lines and elapsed time, at most every TICK_INTERVAL."""
        now = time.monotonic()
        if now - self._last_tick >= TICK_INTERVAL:
            self._last_tick = now
            self.on_update(self.record)

    def _open_conns(self) -> bool:
        return bool(self.selector.get_map())

    def _running(self) -> bool:
        """Whether to keep waiting: a one-shot run lasts until its sockets close
        (a pool run, see pool.py, until every rank said DONE)."""
        return self._open_conns()

    def _drained_long_enough(self) -> bool:
        """Every process of the run is gone; stop waiting for stray sockets."""
        closed = self.supervisor_closed_at
        return closed is not None and time.monotonic() - closed > DRAIN_TIMEOUT

    @staticmethod
    def _receive(conn: _Conn) -> bytes | None:
        """What the socket holds now: b"" once it closed, None if nothing yet."""
        try:
            return conn.sock.recv(1 << 20)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _pump(self, timeout: float) -> None:
        for key, _mask in self.selector.select(timeout):
            conn: _Conn = key.data
            data = self._receive(conn)
            if data is None:
                continue
            if not data:
                self._closed(conn)
            elif conn.reader is None:
                self.output.feed(conn.rank, conn.kind, data)
            else:
                for event in conn.reader.feed(data):
                    self._handle(conn, event)

    def _closed(self, conn: _Conn) -> None:
        self.selector.unregister(conn.sock)
        conn.sock.close()
        if conn.reader is not None and conn.reader.pending():
            self._fail(conn.rank if conn.rank is not None else -1, "ProtocolError",
                       f"truncated message ({conn.reader.pending()} bytes) when the channel closed")
        if conn.kind == "supervisor":
            self.supervisor_closed_at = time.monotonic()
            self._end_strays()
        elif conn.kind == "events" and conn.rank not in self.done:
            # In the cpu backend each rank alone holds its event socket, so
            # EOF before DONE means the rank died; wait for its exit code.
            self.done.add(conn.rank)
            self._rank_state(conn.rank, "killed" if self.stop_reason else "failed")

    def _handle(self, conn: _Conn, event: protocol.Event) -> None:
        kind, fields = event
        rank = conn.rank
        if kind == protocol.BROKEN:
            self._fail(rank if rank is not None else -1, "ProtocolError", f"garbled message: {fields['reason']}")
        elif conn.kind == "supervisor":
            self._handle_supervisor(kind, fields)
        elif kind == protocol.STATUS:
            state = self.record.ranks[rank]
            state.pid = fields.get("pid", state.pid)
            state.memory = fields.get("memory", state.memory)
            if fields["state"] == "running":
                self.reported_running.add(rank)
            self._rank_state(rank, fields["state"])
        elif kind == protocol.RESULT:
            self._take_result(rank, fields)
        elif kind == protocol.ERROR:
            self._fail(rank, fields["type"], fields["message"], fields.get("traceback", ""))
        elif kind == protocol.DONE:
            self.done.add(rank)
            if rank not in self.failures:
                self._rank_state(rank, "done")

    def _handle_supervisor(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == protocol.SPAWNED:
            for rank, pid in fields["pids"].items():
                self.record.ranks[rank].pid = pid
        elif kind == protocol.EXIT:
            rank, code = fields["rank"], fields["code"]
            self.exit_codes[rank] = code
            if code != 0 and rank not in self.failures and self.stop_reason is None:
                self._fail(rank, "RankDied", f"rank {rank} died: {describe_exit(code)}", exit_code=code)
        elif kind == protocol.ENDED and fields.get("error"):
            self.launch_error = fields["error"]

    def _take_result(self, rank: int, fields: dict[str, Any]) -> None:
        if fields.get("empty"):
            return
        try:
            self.results[rank] = transport.load_result(fields["value"])
        except transport.ResultRefused as exc:
            self._fail(rank, "ResultRefused", str(exc))
        except Exception as exc:
            self._fail(
                rank,
                type(exc).__name__,
                f"the kernel could not load rank {rank}'s result: {exc}. "
                f"Return types the kernel can import (tensors, numbers, dicts).",
            )

    def _fail(self, rank: int, type_: str, message: str, traceback: str = "", exit_code: int | None = None) -> None:
        self.failures.setdefault(rank, RankFailure(rank, type_, message, traceback, exit_code))
        if rank >= 0:
            # Errors that follow our own stop signals are the stop, not a fault.
            self._rank_state(rank, "killed" if self.stop_reason else "failed")
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _account_for_missing_ranks(self) -> None:
        """Ranks that ended without a word: say how, from their exit code."""
        for rank in range(self.spec.devices):
            if rank in self.failures or rank in self.results or self.record.ranks[rank].state == "done":
                continue
            code = self.exit_codes.get(rank)
            if self.launch_error and code is None and rank in self.reported_running:
                # The tpu path: the rank's process died mid-cell and xmp.spawn
                # raised; its traceback is torch_xla's, its last line the news.
                cause = self.launch_error.strip().splitlines()[-1]
                self._fail(rank, "RankDied", f"rank {rank}'s process ended during the cell: {cause}")
            elif self.launch_error and code is None:
                self._fail(rank, "LaunchError", "the ranks could not be started", self.launch_error)
            elif self.stop_reason is None:
                self._fail(rank, "RankDied", f"rank {rank} ended without reporting: {describe_exit(code)}", exit_code=code)
            else:
                self._rank_state(rank, "killed")

    def _stop(self, reason: str, first_signal: int) -> None:
        """Escalate SIGINT -> SIGTERM -> SIGKILL on the run's process group."""
        self.stop_reason = reason
        signals = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
        for sig in signals[signals.index(first_signal) :]:
            if not self._signal_group(sig):
                break
            deadline = time.monotonic() + (STOP_GRACE if sig != signal.SIGKILL else DRAIN_TIMEOUT)
            while self.supervisor_open and time.monotonic() < deadline:
                try:
                    self._pump(0.05)
                except KeyboardInterrupt:
                    break  # a second interrupt: escalate at once
            if not self.supervisor_open:
                break
        for state in self.record.ranks.values():
            if state.state in ("starting", "running"):
                state.state = "killed"
                state.ended = time.monotonic()
        # Read what the dead ranks left in their sockets.
        end = time.monotonic() + 0.5
        try:
            while self._open_conns() and time.monotonic() < end:
                self._pump(0.05)
        except KeyboardInterrupt:
            pass  # yet another interrupt: show what was read

    def _end_strays(self) -> None:
        """The supervisor outlives every rank, so what is left in the run's
        process group now (a subprocess a cell started, say) is a stray that
        would hold the devices and the rank's output sockets: end it."""
        if self.supervisor_pid is not None:
            try:
                os.killpg(self.supervisor_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _signal_group(self, sig: int) -> bool:
        if self.supervisor_pid is None:
            return False
        try:
            os.killpg(self.supervisor_pid, sig)
        except ProcessLookupError:
            try:
                os.kill(self.supervisor_pid, sig)
            except ProcessLookupError:
                return False
        return True

    # -- bookkeeping -----------------------------------------------------

    _lines_counted = 0

    def _on_line(self, rank: int, stream: str, line: str) -> None:
        # Called once per batch of complete lines with the batch's last line;
        # the output's running total says how many lines the batch held.
        batch = self.output.lines - self._lines_counted
        self._lines_counted = self.output.lines
        state = self.record.ranks.get(rank)
        if state is not None:
            state.lines += batch
            state.last_line = line

    def _rank_state(self, rank: int, value: str) -> None:
        state = self.record.ranks[rank]
        if state.state in ("failed", "killed"):
            return
        state.state = value
        if value in ("done", "failed", "killed"):
            state.ended = time.monotonic()
        self.on_update(self.record)

    def _finish(self, outcome: str) -> None:
        if self._live is not None:
            self._live.clear()
        for path in self.output.finish():
            print(f"(complete log: {path})")
        self.record.outcome = outcome
        self.record.duration = time.time() - self.record.started
        self.on_update(self.record)

    def _failure_summary(self) -> str:
        ranks = sorted(r for r in self.failures if r >= 0)
        if self.stop_reason == "failure" and len(ranks) < self.spec.devices:
            return f"rank(s) {', '.join(map(str, ranks))} failed; the other ranks were stopped"
        return f"rank(s) {', '.join(map(str, ranks))} failed"

    def _error(self, summary: str) -> RankError:
        if self.record.outcome == "running":
            self._finish("timeout" if self.stop_reason == "timeout" else "failed")
        return RankError(list(self.failures.values()), dict(self.results), summary)

    def _close_all(self) -> None:
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            key.fileobj.close()
        self.selector.close()

    def _remove_store(self) -> None:
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)

    def _sweep_segments(self) -> None:
        """Remove the run's shared memory: what was shipped and any result not taken."""
        segments = self.spec.payload.segments
        if segments is not None:
            segments.sweep()
