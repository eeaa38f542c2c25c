"""The kernel side of a run: the launcher, the events, interrupts and timeouts.

Runs in the kernel, in the thread that runs the cell, so output lands in the
running cell and Ctrl-C / the stop button arrive here as KeyboardInterrupt.
Talks to the launcher and ranks only over socket pairs it made itself.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic import payload as payload_module
from xla_magic import probe, protocol, transport
from xla_magic.display import LiveLines, RankError, RankFailure, RunInterrupted, TaggedOutput
from xla_magic.payload import Payload

READY_TIMEOUT = 300.0
SUBMIT_TIMEOUT = 60.0  # for the launcher to take a job and say STARTED
FAIL_GRACE = 0.5  # after a rank fails, how long to collect the others' errors
STOP_GRACE = 1.5  # between SIGINT, SIGTERM and SIGKILL
DRAIN_TIMEOUT = 3.0  # reading what is left once the processes are gone
TICK_INTERVAL = 0.5  # how often listeners hear of a running cell with no news
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


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


# --- the session's private directory ----------------------------------------


class PrivateDir:
    """A directory of the session that only this user can enter.

    It holds each launcher's files, each run's gloo store (removed when the run
    ends) and the folded rank logs whose paths a cell printed (kept until the
    session closes). Made at first use; removed by :meth:`close`, when it is
    collected, or when the kernel exits.
    """

    SUFFIX = "session-"

    def __init__(self) -> None:
        self._path: str | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def path(self) -> str:
        if self._path is None:
            sweep_orphan_dirs()
            # Named like the kernel's shared memory: pid namespace and pid (mode 0700).
            self._path = tempfile.mkdtemp(prefix=transport.kernel_prefix() + self.SUFFIX)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, ignore_errors=True)
        return self._path

    def new(self, prefix: str) -> str:
        """A new directory inside, also 0700."""
        return tempfile.mkdtemp(prefix=prefix, dir=self.path)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._path = self._finalizer = None


_SESSION_DIR = re.compile(r"^xla_magic-\d+-(\d+)-" + PrivateDir.SUFFIX)


def sweep_orphan_dirs(root: str | None = None) -> None:
    """Remove the session directories of this pid namespace's kernels that died
    without closing (SIGKILL, the OOM killer), with their stores and logs."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _SESSION_DIR.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if not name.startswith(transport.kernel_prefix(pid) + PrivateDir.SUFFIX) or transport.process_alive(pid):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


# --- the launcher -----------------------------------------------------------


class LauncherError(RuntimeError):
    pass


class Launcher:
    """The long-lived ``python -m xla_magic.launcher`` process of this kernel.

    The channel carries one job at a time: a JOB, then its STARTED. From a
    job's first byte until its STARTED is read the channel is out of step, and
    whatever stops the kernel there (an interrupt, a timeout, a lost launcher)
    stops the launcher too, so that no later job reads this one's answer.
    """

    def __init__(self, workdir: PrivateDir, python: str | None = None) -> None:
        self.python = python or os.environ.get("XLA_MAGIC_PYTHON") or sys.executable
        self.workdir = workdir
        self.dir = workdir.new("launcher-")
        self.log_path = os.path.join(self.dir, "launcher.log")
        # What the launcher inherits; each job carries the kernel's changes since.
        self.base_environment = dict(os.environ)
        self.in_step = True
        self.info: dict[str, Any] | None = None
        self.started_at = time.time()
        try:
            self.process, self.channel = self._start()
        except BaseException as exc:
            shutil.rmtree(self.dir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise LauncherError(
                    f"could not start the launcher with {self.python}: {exc}. Point XLA_MAGIC_PYTHON "
                    f"at a Python that has torch_xla, or unset it to use the kernel's own ({sys.executable})."
                ) from exc
            raise

    def _start(self) -> tuple[subprocess.Popen, protocol.Channel]:
        ours, theirs = socket.socketpair()
        try:
            with open(self.log_path, "wb") as log:
                process = subprocess.Popen(
                    [self.python, "-m", "xla_magic.launcher",
                     "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    env=self._environment(),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return process, protocol.Channel(ours)

    def _environment(self) -> dict[str, str]:
        env = dict(self.base_environment)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [self._import_dir(), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Read when torch is imported: keeps gloo's "Rank N is connected to M
        # peer ranks" chatter out of every cell.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        return env

    def _import_dir(self) -> str:
        """A directory holding only a link to this very package.

        The launcher must import the kernel's xla_magic, wherever the kernel
        found it, and nothing else from there (the package's parent may be a
        whole site-packages, of another Python than the launcher's).
        """
        path = os.path.join(self.dir, "import")
        os.mkdir(path, 0o700)
        os.symlink(PACKAGE_DIR, os.path.join(path, "xla_magic"))
        return path

    def environment_changes(self) -> dict[str, Any]:
        """How the kernel's environment differs now from what the launcher inherited."""
        now, base = dict(os.environ), self.base_environment
        return {
            "set": {name: value for name, value in now.items() if base.get(name) != value},
            "unset": sorted(name for name in base if name not in now),
        }

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
        except TimeoutError:
            raise LauncherError(f"the launcher did not start within {timeout:.0f} s{self._log_excerpt()}") from None
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
        raise LauncherError(f"the launcher exited while starting{self._log_excerpt()}")

    def submit(self, job: dict[str, Any], fds: list[int]) -> int:
        """Hand a job and its sockets to the launcher; the supervisor's pid.

        The job goes with the kernel's environment changes, and with a gloo
        store directory if it names none (a pool's: it lasts with the session).
        """
        self.wait_ready()
        job = {**job, "environment": self.environment_changes()}
        if "store" not in job:
            job["store"] = self.workdir.new(f"store-{job['run_id']}-")
        self.in_step = False
        try:
            self.channel.sock.settimeout(SUBMIT_TIMEOUT)
            self.channel.send_with_fds(fds, protocol.JOB, **job)
            event = self.channel.recv()
        except TimeoutError as exc:
            raise self._give_up(f"the launcher did not take the cell within {SUBMIT_TIMEOUT:g} s") from exc
        except OSError as exc:
            raise self._give_up(f"lost the launcher ({exc})") from exc
        except BaseException:
            self.stop()
            raise
        if event.kind != protocol.STARTED:
            raise self._give_up("the launcher stopped unexpectedly")
        if event.fields.get("run_id") != job["run_id"]:
            raise self._give_up(f"the launcher answered for run {event.fields.get('run_id')}, not {job['run_id']}")
        self.channel.sock.settimeout(None)
        self.in_step = True
        return event.fields["pid"]

    def _give_up(self, problem: str) -> LauncherError:
        """Stop a launcher whose channel cannot be trusted; the error that says so."""
        excerpt = self._log_excerpt()
        self.stop()
        return LauncherError(f"{problem}; it was stopped, and the next cell starts a new one{excerpt}")

    def stop(self, timeout: float = 5.0) -> None:
        """End the launcher and remove its directory. A ready launcher in step
        is asked to STOP; any other is killed (it holds nothing to tidy)."""
        try:
            if self.in_step and self.info is not None and self.alive():
                self._say_stop()
                self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.channel.close()
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _say_stop(self) -> None:
        try:
            self.channel.sock.settimeout(1.0)
            self.channel.send_with_fds([], protocol.STOP)
        except OSError:
            pass  # gone already

    def _log_excerpt(self, lines: int = 20) -> str:
        """The end of the launcher's log, to quote in an error (its directory may go)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                tail = "".join(log.readlines()[-lines:])
        except OSError:
            return ""
        return f"; its log ends:\n{tail}" if tail.strip() else ""


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


# --- the per-kernel session -------------------------------------------------


class Session:
    """Everything the extension started in one kernel."""

    HISTORY = 20

    def __init__(self) -> None:
        self.workdir = PrivateDir()
        self.launcher: Launcher | None = None
        self.run_count = 0
        self.history: list[RunRecord] = []
        self.listeners: list[Callable[[RunRecord], None]] = []
        self.pool: Any = None  # the running xla_magic.pool.Pool, if any

    def ensure_launcher(self) -> Launcher:
        """The launcher, started if there is none (LauncherError if it cannot be)."""
        if self.launcher is not None and not self.launcher.alive():
            self.drop_launcher()  # a dead one: its socket and directory go too
        if self.launcher is None:
            self.launcher = Launcher(self.workdir)
        return self.launcher

    def ready_launcher(self) -> Launcher:
        """The launcher, ready for jobs, or the UsageError that says what to do."""
        try:
            launcher = self.ensure_launcher()
            launcher.wait_ready()
        except LauncherError as exc:
            self.drop_launcher()
            raise UsageError(str(exc)) from exc
        return launcher

    def drop_launcher(self) -> None:
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            launcher.stop()

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
        try:
            return self.run(spec, run_id, cell, live_lines=live_lines)
        finally:
            # However the cell ended (before the run took the segments over,
            # too), nothing it shipped stays in shared memory.
            if cell_payload.segments is not None:
                cell_payload.segments.sweep()

    def run(self, spec: RunSpec, run_id: int, cell: str, live_lines: bool = False) -> list[Any] | None:
        launcher = self.ready_launcher()
        record = RunRecord(run_id, cell, spec.backend, spec.devices)
        self.remember(record)
        run = Run(spec, launcher, record, self._notify, live_lines=live_lines, workdir=self.workdir)
        self.start_run(run)
        return run.wait()

    def remember(self, record: RunRecord) -> None:
        """Keep the record in the recent runs (the status panel's history)."""
        self.history = (self.history + [record])[-self.HISTORY :]

    def start_run(self, run: Run) -> None:
        """Start a run; launcher trouble becomes a UsageError, Ctrl-C a RunInterrupted."""
        try:
            run.start()
        except BaseException as exc:
            given_up = not run.launcher.alive()  # stopped while the job was in flight
            if given_up and self.launcher is run.launcher:
                self.drop_launcher()
            if isinstance(exc, LauncherError):
                raise UsageError(str(exc)) from exc
            if isinstance(exc, KeyboardInterrupt):
                where = "; the launcher was stopped, and the next cell starts a new one" if given_up else ""
                raise RunInterrupted(
                    f"interrupted while handing the cell to the launcher, before it ran{where}", {}
                ) from None
            raise

    def _notify(self, record: RunRecord) -> None:
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a broken display must never break a run
                pass

    def close(self) -> None:
        """Stop the pool and the launcher, and remove the session's directory."""
        try:
            if self.pool is not None:
                self.pool.stop()
        finally:
            self.pool = None
            try:
                self.drop_launcher()
            finally:
                self.workdir.close()
