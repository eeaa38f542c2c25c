"""The kernel side of a run: the launcher, the events, interrupts and timeouts.

Runs in the kernel, in the thread that runs the cell, so output lands in the
running cell and Ctrl-C / the stop button arrive here as KeyboardInterrupt.
Talks to the launcher and ranks only over socket pairs it made itself.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic import payload as payload_module
from xla_magic import probe, protocol, transport
from xla_magic.display import LiveLines, RankError, RankFailure, RunInterrupted, TaggedOutput
from xla_magic.payload import Payload

READY_TIMEOUT = 300.0
FAIL_GRACE = 0.5  # after a rank fails, how long to collect the others' errors
STOP_GRACE = 1.5  # between SIGINT, SIGTERM and SIGKILL
DRAIN_TIMEOUT = 3.0  # reading what is left once the processes are gone
TICK_INTERVAL = 0.5  # how often listeners hear of a running cell with no news


def private_dir() -> str:
    """A directory only this user can enter, for logs."""
    path = tempfile.mkdtemp(prefix=f"xla_magic-{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


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


def plan(backend: str, devices: int | None, action: str) -> probe.Placement:
    """Where ``action`` would run, or the UsageError that says why it cannot."""
    try:
        placement = probe.place(backend, devices)
    except probe.PlacementError as exc:
        raise UsageError(str(exc)) from exc
    refuse_if_kernel_holds_devices(action)
    return placement


def refuse_if_kernel_holds_devices(action: str) -> None:
    refusal = probe.kernel_xla_runtime() or probe.kernel_holds_libtpu()
    if refusal:
        raise UsageError(f"{action} refused: {refusal}")


# --- the launcher -----------------------------------------------------------


class LauncherError(RuntimeError):
    pass


class Launcher:
    """The long-lived ``python -m xla_magic.launcher`` process of this kernel."""

    def __init__(self, python: str | None = None) -> None:
        self.python = python or os.environ.get("XLA_MAGIC_PYTHON") or sys.executable
        self.dir = private_dir()
        self.log_path = os.path.join(self.dir, "launcher.log")
        ours, theirs = socket.socketpair()
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(
                [self.python, "-m", "xla_magic.launcher", "--fd", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=_launcher_environment(),
            )
        finally:
            theirs.close()
            log.close()
        self.channel = protocol.Channel(ours)
        self.info: dict[str, Any] | None = None
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        if self.info is not None:
            return self.info
        self.channel.sock.settimeout(timeout)
        try:
            event = self.channel.recv()
        except socket.timeout:
            raise LauncherError(
                f"the launcher did not start within {timeout:.0f} s; see {self.log_path}"
            ) from None
        finally:
            self.channel.sock.settimeout(None)
        if event.kind == protocol.READY:
            self.info = event.fields
            return self.info
        if event.kind == protocol.FATAL:
            raise LauncherError(
                f"the launcher could not import torch_xla with {self.python}: "
                f"{event.fields['message']}. Install it there (locally: "
                f"pip install 'xla_magic[local]'; Colab and Kaggle TPU images ship it), "
                f"or point XLA_MAGIC_PYTHON at an interpreter that has it."
            )
        raise LauncherError(f"the launcher exited while starting; see {self.log_path}:\n{self._log_tail()}")

    def submit(self, job: dict[str, Any], fds: list[int]) -> int:
        """Hand a job and its sockets to the launcher; the supervisor's pid."""
        self.wait_ready()
        try:
            self.channel.send_with_fds(fds, protocol.JOB, **job)
            event = self.channel.recv()
        except OSError as exc:
            raise LauncherError(f"lost the launcher ({exc}); see {self.log_path}") from exc
        if event.kind != protocol.STARTED:
            raise LauncherError(f"the launcher stopped unexpectedly; see {self.log_path}:\n{self._log_tail()}")
        return event.fields["pid"]

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.channel.close()  # EOF: the launcher returns from its loop
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except OSError:
            return ""


def _launcher_environment() -> dict[str, str]:
    env = dict(os.environ)
    # The launcher must import this very package, wherever the kernel found it.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Read when torch is imported: keeps gloo's "Rank N is connected to M
    # peer ranks" chatter out of every cell.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


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
    ) -> None:
        self.spec = spec
        self.launcher = launcher
        self.record = record
        self.on_update = on_update
        self._live = LiveLines() if live_lines else None
        self.output = TaggedOutput(log_dir=private_dir, on_line=self._on_line, live=self._live)
        self.selector = selectors.DefaultSelector()
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        self.done: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        self.supervisor_pid: int | None = None
        self.supervisor_open = True
        self.launch_error: str | None = None
        self.first_failure_at: float | None = None
        self.supervisor_closed_at: float | None = None
        self.stop_reason: str | None = None  # failure, timeout or interrupt, once we stop the run
        record.ranks = {rank: RankState() for rank in range(spec.devices)}

    # -- starting --------------------------------------------------------

    def start(self) -> None:
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
            job = {
                "run_id": self.record.run_id,
                "backend": self.spec.backend,
                "cpu_threads": self.spec.cpu_threads,
                "source": payload.source,
                "filename": payload.filename,
                "has_result": payload.has_result,
                "namespace": payload.namespace,
            }
            self.supervisor_pid = self.launcher.submit(job, [s.fileno() for s in theirs])
        except BaseException:
            self._close_all()
            self._sweep_segments()
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
            self.supervisor_open = False
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
            if self.launch_error and code is None:
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
        while self._open_conns() and time.monotonic() < end:
            self._pump(0.05)

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

    def _sweep_segments(self) -> None:
        """Remove the run's shared memory: what was shipped and any result not taken."""
        segments = self.spec.payload.segments
        if segments is not None:
            segments.sweep()


# --- the per-kernel session -------------------------------------------------


class Session:
    """Everything the extension started in one kernel."""

    HISTORY = 20

    def __init__(self) -> None:
        self.launcher: Launcher | None = None
        self.run_count = 0
        self.history: list[RunRecord] = []
        self.listeners: list[Callable[[RunRecord], None]] = []
        self.pool: Any = None  # the running xla_magic.pool.Pool, if any

    def ensure_launcher(self) -> Launcher:
        if self.launcher is None or not self.launcher.alive():
            self.launcher = Launcher()
        return self.launcher

    def next_run_id(self) -> int:
        self.run_count += 1
        return self.run_count

    def spawn(
        self,
        cell: str,
        backend: str,
        devices: int | None,
        timeout: float | None,
        user_ns: dict[str, Any],
        hidden: dict[str, Any],
        live_lines: bool = False,
    ) -> list[Any] | None:
        """A ``%%xla_spawn`` cell in newly spawned ranks: results by rank."""
        placement = plan(backend, devices, "%%xla_spawn")
        run_id = self.next_run_id()
        cell_payload = payload_module.build(cell, f"<xla_spawn cell {run_id}>", user_ns, hidden)
        spec = RunSpec(
            payload=cell_payload,
            backend=placement.backend,
            devices=placement.devices,
            cpu_threads=placement.cpu_threads,
            timeout=timeout,
        )
        return self.run(spec, run_id, cell, live_lines=live_lines)

    def run(self, spec: RunSpec, run_id: int, cell: str, live_lines: bool = False) -> list[Any] | None:
        launcher = self.ensure_launcher()
        try:
            launcher.wait_ready()
        except LauncherError as exc:
            self.launcher = None
            launcher.stop()
            raise UsageError(str(exc)) from exc
        record = RunRecord(run_id, cell, spec.backend, spec.devices)
        self.history = (self.history + [record])[-self.HISTORY :]
        run = Run(spec, launcher, record, self._notify, live_lines=live_lines)
        try:
            run.start()
        except LauncherError:
            self.launcher = None
            launcher.stop()
            raise
        return run.wait()

    def _notify(self, record: RunRecord) -> None:
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a broken display must never break a run
                pass

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
