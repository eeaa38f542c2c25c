"""The persistent rank pool, kernel side: ``%xla_pool`` and the cells run in it. Runs in the kernel.

A pool is one launcher job of kind ``pool``. Its ranks start once and keep
their namespace, their device and torch_xla's compiled graphs; the kernel
keeps the same private socket pairs open for the pool's life and sends each
request (a cell, pushed values, a pull) on every rank's events socket.

Large tensors and arrays that a cell reads go to the ranks once, through one
shared-memory segment each, and stay with them while unchanged
(:class:`HeldValues`); the rest of what a cell reads travels as a pickle,
sent again only when it changed (:class:`Shipping`). Large results and
pulled values come back the same way, under the pool's results prefix.

A request is followed by :class:`PoolRun`, a :class:`~xla_magic.run.Run`
with a different start (send on the open sockets, watched by one selector
for the pool's life) and a different end (every asked rank said DONE), so
output, results, errors and fail-fast are the one-shot run's own. Stopping a
request sends SIGINT to the rank processes, again and again until they
answer (a rank still reading the request is not yet listening); rank
threads (the tpu launch path) stuck in native code get THREAD_STOP_GRACE.
Ranks that answer keep the pool; ranks that do not are killed and the pool
is *broken*: every later request says so and how to restart, without waiting.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import io
import mmap
import os
import pickle
import selectors
import signal
import socket
import sys
import termios
import time
import types
import weakref
from typing import Any, Mapping

import cloudpickle
from IPython.core.error import UsageError

from xla_magic import payload, probe, protocol, transport
from xla_magic.display import RankError, RunInterrupted
from xla_magic.launcher_client import READY_TIMEOUT
from xla_magic.run import STOP_GRACE, RankState, Run, RunRecord, RunSpec, _Conn, describe_exit
from xla_magic.session import Session, plan, refuse_if_kernel_holds_devices

RESTART_HINT = "%xla_pool restart starts fresh ranks (their namespaces are lost)"
EXIT_CODE_WAIT = 1.0  # after a rank's socket closes, how long to wait for its exit code
STOP_WAIT = 5.0  # how long the ranks get to leave after the kernel closes their sockets
# Rank threads (the tpu launch path) take an interrupt only between bytecodes,
# so one in native code (an XLA compile, .item(), a sleep) gets this long.
THREAD_STOP_GRACE = 30.0
RESEND_INTERRUPT = 0.25  # while a rank has not answered, SIGINT again this often
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)
_ANALYSED_CELLS_KEPT = 128


# --- what the ranks already hold ------------------------------------------------


class HeldValues:
    """Large kernel tensors and arrays that the pool's ranks keep in shared memory.

    Each is written once into a segment. The kernel keeps a mapping of it (to
    compare against) and every rank keeps a descriptor of it (to map a fresh
    copy-on-write view for every cell), so the segment's name is needed only
    while the cell that first ships it runs: :meth:`settle` unlinks it then.

    The rule for "unchanged", checked at every cell that reads the value: the
    same kernel object, with the same bytes as its segment. The bytes are
    compared with memcmp at memory speed (about 0.05 s per GiB, where hashing
    takes 0.8 s), which is exact whatever wrote to the value: in-place ops,
    ``.data``, numpy views (torch's version counter misses the last two). A
    non-contiguous tensor or array is copied to contiguous for the comparison.
    A changed value gets a new segment. A segment is dropped when its kernel
    object dies, when its value changes, and when the pool stops or breaks.
    """

    def __init__(self) -> None:
        self.segments = transport.RunSegments()
        self._held: dict[int, _Held] = {}  # id of the kernel object -> its segment
        self._new: list[int] = []  # ids whose segment this request wrote

    def reduce(self, obj: Any) -> tuple | None:
        """A stand-in for ``obj`` naming its segment when it is large, else None."""
        large = transport.large_value(obj)
        if large is None:
            return None
        held = self._held.get(id(obj))
        if held is None or held.kernel_value() is not obj or not held.has_bytes_of(large):
            held = self._write(obj, large)
            if held is None:
                return None  # no room in /dev/shm: it goes in the pickle
        return transport.held_segment, (large.kind, held.name, large.args)

    def _write(self, obj: Any, large: transport.LargeValue) -> _Held | None:
        self._drop(id(obj))
        name = self.segments.writer.write(large.data)
        if name is None:
            return None
        key = id(obj)
        held = _Held(name, transport.map_private(name), weakref.ref(obj, lambda ref: self._forget(key, ref)))
        self._held[key] = held
        self._new.append(key)
        return held

    def names(self) -> tuple[str, ...]:
        """The segments the ranks must keep open; they close any other."""
        return tuple(held.name for held in list(self._held.values()))  # a GC may drop one meanwhile

    def settle(self, delivered: bool) -> None:
        """After a request: unlink the new names (every rank opened them, or none ever will).

        Undelivered, the new segments are forgotten too, so the next cell writes them again.
        """
        new, self._new = self._new, []
        try:
            self.segments.sweep()
        finally:
            if not delivered:
                for key in new:
                    self._drop(key)

    def release(self) -> None:
        """Drop every segment: the pool's ranks are gone."""
        self._held.clear()
        self._new = []
        self.segments.sweep()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """The kernel object died: its segment goes (the ranks close theirs at the next cell)."""
        held = self._held.get(key)
        if held is not None and held.kernel_value is ref:
            del self._held[key]

    def _drop(self, key: int) -> None:
        self._held.pop(key, None)


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class _Held:
    """One held segment, as the kernel sees it: its name, its bytes mapped, whose they are."""

    def __init__(self, name: str, mapping: mmap.mmap, kernel_value: weakref.ref) -> None:
        self.name = name
        self.kernel_value = kernel_value
        self.size = len(mapping)
        self._start = ctypes.c_char.from_buffer(mapping)  # holds the mapping open as long as we do

    def has_bytes_of(self, large: transport.LargeValue) -> bool:
        return len(large.data) == self.size and _memcmp(ctypes.addressof(self._start), large.address, self.size) == 0


class _HeldPickler(cloudpickle.Pickler):
    """cloudpickle that puts large tensors and arrays in the pool's held segments."""

    def __init__(self, file: io.BytesIO, held: HeldValues) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.held = held

    def reducer_override(self, obj: Any) -> Any:
        reduced = self.held.reduce(obj)
        return reduced if reduced is not None else super().reducer_override(obj)


class Shipping:
    """The kernel values the ranks hold, so that only changed ones travel.

    Plain values (numbers, strings, modules) are compared by identity: the
    same object cannot have changed. The others are pickled together, with
    large tensors and arrays as references to :class:`HeldValues` segments,
    and the pickle is sent only when it differs from the last one sent; the
    ranks load their copy afresh for every cell, large values included (as
    new copy-on-write views), so a cell's in-place change never reaches the
    next cell.
    """

    def __init__(self) -> None:
        self.plain: dict[str, Any] = {}
        self.held = HeldValues()
        self.objects_sent: tuple[tuple[str, ...], bytes] | None = None  # (names, digest)
        self._objects_going: tuple[tuple[str, ...], bytes] | None = None

    def fields(self, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The CELL message's shipping fields, and the plain values they send.

        Call :meth:`settle` afterwards, however the request goes.
        """
        plain_names: list[str] = []
        changed: dict[str, Any] = {}
        objects: dict[str, Any] = {}
        for name, value in values.items():
            if type(value) in _PLAIN_TYPES or isinstance(value, types.ModuleType):
                plain_names.append(name)
                if name not in self.plain or self.plain[name] is not value:
                    changed[name] = value
            else:
                objects[name] = value
        blob = None
        if objects:
            pickled = self._pickle_objects(objects)
            key = (tuple(objects), hashlib.blake2b(pickled, digest_size=16).digest())
            if key != self.objects_sent:
                blob = pickled
            self._objects_going = key
        fields = {
            "plain_names": tuple(plain_names),
            "plain": payload.pickle_namespace(changed) if changed else None,
            "object_names": tuple(objects),
            "objects": blob,
            "held": self.held.names(),
        }
        return fields, changed

    def _pickle_objects(self, objects: dict[str, Any]) -> bytes:
        buffer = io.BytesIO()
        try:
            _HeldPickler(buffer, self.held).dump(objects)
        except Exception:
            payload.pickle_namespace(objects)  # raises the UsageError that names the culprit
            raise
        return buffer.getvalue()

    def sent(self, changed: dict[str, Any], fields: dict[str, Any]) -> None:
        """Remember what every rank now holds (call once the request went out)."""
        self.plain.update(changed)
        if fields["object_names"]:
            self.objects_sent = self._objects_going

    def settle(self, delivered: bool) -> None:
        """After the request, however it went: see :meth:`HeldValues.settle`."""
        self.held.settle(delivered)


# --- the pool ---------------------------------------------------------------------


class Pool:
    """The kernel's handle on a pool: its sockets, processes and state.

    ``state`` is one of starting, ready, running, broken, stopped.
    """

    def __init__(self, placement: probe.Placement, requested_backend: str) -> None:
        self.backend = placement.backend
        self.devices = placement.devices
        self.cpu_threads = placement.cpu_threads
        self.requested_backend = requested_backend
        self.state = "starting"
        self.problem: str | None = None
        self._problem_is_a_guess = False
        self.supervisor: _Conn | None = None
        self.events: list[_Conn] = []
        self.outputs: list[_Conn] = []
        self.selector = selectors.DefaultSelector()  # every socket of the pool, for its whole life
        self.supervisor_pid: int | None = None
        self.ranks: dict[int, RankState] = {}  # the start's record of each rank: pid, ...
        self.thread_ranks: set[int] = set()  # ranks that are threads of a shared process
        self.started = time.time()
        self.start_seconds: float | None = None
        self.cells = 0
        self.shipping = Shipping()
        self.results = transport.RunSegments()  # where ranks put large results and pulled values
        self.modules_checked = 0  # len(sys.modules) when the kernel was last found not to hold libtpu
        self._seq = 0
        self._analysed: dict[str, tuple[bool, frozenset[str]]] = {}

    @property
    def pids(self) -> dict[int, int]:
        """Each rank's process id (rank threads share one)."""
        return {rank: state.pid for rank, state in self.ranks.items() if state.pid is not None}

    # -- sockets and processes -------------------------------------------

    def open_sockets(self) -> list[socket.socket]:
        """Make the pool's socket pairs, watched by its selector; the ends its job hands to the launcher."""
        theirs: list[socket.socket] = []
        ours, remote = socket.socketpair()
        self.supervisor = _Conn(ours, None, "supervisor")
        self.selector.register(ours, selectors.EVENT_READ, self.supervisor)
        theirs.append(remote)
        for rank in range(self.devices):
            for kind in ("events", "stdout", "stderr"):
                ours, remote = socket.socketpair()
                conn = _Conn(ours, rank, kind)
                (self.events if kind == "events" else self.outputs).append(conn)
                self.selector.register(ours, selectors.EVENT_READ, conn)
                theirs.append(remote)
        return theirs

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send(self, rank: int, frame: bytes) -> None:
        """Write one request on a rank's events socket (OSError: the rank is gone).

        Whatever stops it part-way (an interrupt, a rank that stopped reading)
        leaves a partial frame the rank cannot read past: the pool is broken.
        """
        sock = self.events[rank].sock
        sent = 0
        try:
            try:
                sent = sock.send(frame)
            except BlockingIOError:
                pass
            if sent < len(frame):
                sock.settimeout(READY_TIMEOUT)  # a large request: let the rank read it
                try:
                    rest = memoryview(frame)[sent:]
                    while rest:
                        written = sock.send(rest)
                        sent += written
                        rest = rest[written:]
                finally:
                    sock.setblocking(False)
        except BaseException as exc:
            if 0 < sent < len(frame):
                self.mark_broken(f"the request to rank {rank} was cut off part-way ({type(exc).__name__})")
            raise

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to the processes of ``ranks`` (threads of one process share it)."""
        pids = self.pids
        for pid in {pids[rank] for rank in ranks if rank in pids}:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to every process of the pool (they share one process group)."""
        if self.supervisor_pid is None:
            return
        try:
            os.killpg(self.supervisor_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def mark_broken(self, reason: str, guess: bool = False) -> None:
        """Note that the pool cannot serve again, and why.

        A ``guess`` (a socket closed) gives way to the supervisor's word on
        the same death (the exit code), which tends to arrive just after it.
        """
        if self.state == "stopped":
            return
        self.state = "broken"
        if self.problem is None or (self._problem_is_a_guess and not guess):
            self.problem = reason
            self._problem_is_a_guess = guess

    def stop(self) -> None:
        """End the ranks: close their sockets (they leave their loop), then make sure."""
        if self.state == "stopped":
            return
        self.selector.close()
        for conn in self.events + self.outputs:
            conn.sock.close()
        try:
            if self.state != "broken":
                self._wait_for_supervisor(STOP_WAIT)
        finally:
            self.kill()
            if self.supervisor is not None:
                self.supervisor.sock.close()
            self.release_memory()
            self.state = "stopped"

    def release_memory(self) -> None:
        """Drop the shared memory of the pool: held values, results not taken."""
        try:
            self.shipping.held.release()
        finally:
            self.results.sweep()

    def _wait_for_supervisor(self, timeout: float) -> None:
        """Until the supervisor, which outlives every rank, closes its socket."""
        if self.supervisor is None or self.supervisor.sock.fileno() < 0:
            return
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.supervisor.sock, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    continue
                try:
                    if not self.supervisor.sock.recv(1 << 16):
                        return
                except BlockingIOError:
                    continue
                except OSError:
                    return

    # -- cells ---------------------------------------------------------------

    def analyse(self, source: str, filename: str) -> tuple[bool, frozenset[str]]:
        """(ends in an expression, names read), computed once per cell source."""
        known = self._analysed.get(source)
        if known is None:
            known = (payload.compile_cell(source, filename), frozenset(payload.names_read(source)))
            if len(self._analysed) >= _ANALYSED_CELLS_KEPT:
                self._analysed.pop(next(iter(self._analysed)))
            self._analysed[source] = known
        return known

    def check_fits(self, devices: int | None, backend: str) -> None:
        """A cell's --devices / --backend must agree with the running pool."""
        if devices is not None and devices != self.devices:
            raise UsageError(
                f"a pool of {self.devices} ranks is running, so --devices {devices} contradicts it. "
                f"Leave --devices out to run in the pool, add --fresh to run in {devices} newly "
                f"spawned ranks, or use %xla_pool restart --devices {devices} to replace the pool."
            )
        if backend != "auto" and backend != self.backend:
            raise UsageError(
                f"the running pool uses the {self.backend} backend, so --backend {backend} contradicts "
                f"it. Leave --backend out, add --fresh, or use %xla_pool restart --backend {backend}."
            )

    def check_fresh_allowed(self) -> None:
        """On a TPU host the pool's ranks hold the chips, so fresh ranks could not open them."""
        if self.backend == "tpu" and not self.cpu_threads and self.state != "broken":
            raise UsageError(
                "the pool's ranks hold this host's TPU chips, so --fresh ranks could not use them. "
                "Run the cell in the pool (leave --fresh out), or %xla_pool stop first."
            )

    def check_usable(self) -> None:
        if self.state == "broken":
            raise UsageError(
                f"the pool is broken ({self.problem}). {RESTART_HINT}; %xla_pool stop goes back "
                f"to one-shot ranks; --fresh runs this cell in newly spawned ranks."
            )

    # -- showing ---------------------------------------------------------------

    def describe(self) -> str:
        where = f"{self.devices} ranks on the {self.backend} backend"
        if self.cpu_threads:
            where += " (threads on the CPU)"
        elif self.backend == "cpu":
            where += " (simulated devices)"
        if self.state == "stopped":
            return f"stopped ({where})"
        if self.state == "broken":
            return f"broken: {self.problem}. {RESTART_HINT}"
        uptime = time.time() - self.started
        pids = ", ".join(str(pid) for pid in sorted(set(self.pids.values())))
        return (
            f"{self.state}: {where}, up {uptime:.0f} s, {self.cells} cell(s) run; "
            f"rank processes {pids or 'unknown'}"
        )


# --- following one request ------------------------------------------------------


class PoolRun(Run):
    """One request to the pool's ranks, followed to every asked rank's DONE."""

    def __init__(
        self,
        pool: Pool,
        spec: RunSpec,
        record: RunRecord,
        seq: int,
        request: bytes | None,
        session: Session,
        ranks: list[int] | None = None,
        live_lines: bool = False,
    ) -> None:
        super().__init__(spec, session.launcher, record, session._notify, live_lines=live_lines,
                         workdir=session.workdir)
        self.selector.close()
        self.selector = pool.selector
        self.pool = pool
        self.seq = seq
        self.request = request
        self.targets = list(range(spec.devices)) if ranks is None else ranks
        self.lost: dict[int, float] = {}  # rank -> when its events socket closed
        self.requests_sent = request is None
        self.delivered = False  # every asked rank got the whole request
        for rank, state in pool.ranks.items():
            record.ranks[rank].pid = state.pid

    # -- start: the sockets are open already --------------------------------

    def start(self) -> None:
        """Check the pool is whole; the request itself goes out in :meth:`wait`."""
        self.supervisor_pid = self.pool.supervisor_pid
        for rank in range(self.spec.devices):
            if rank not in self.targets:
                self.done.add(rank)
                self.record.ranks[rank].state = "done"
        self._pump(0)  # news from between requests: a rank that died, stray output
        if self.pool.state == "broken":
            self._close_all()
            self._finish("failed")
            raise UsageError(
                f"the pool lost a rank before this request ({self.pool.problem}); nothing ran. {RESTART_HINT}."
            )
        self.pool.state = "running"

    def _send_requests(self) -> None:
        """Send the request to every asked rank.

        Called from inside :meth:`wait`, so an interrupt while sending stops
        the ranks that got the request like any other interrupt; a rank that
        got none of it is not waited for, one that got part of it broke the
        pool (:meth:`Pool.send`).
        """
        self.requests_sent = True
        for rank in self.targets:
            self.record.ranks[rank].state = "running"
        self.on_update(self.record)
        asked: set[int] = set()
        try:
            for rank in self.targets:
                try:
                    self.pool.send(rank, self.request)
                except OSError as exc:
                    self.pool.mark_broken(f"rank {rank} could not be reached ({exc})")
                    self._fail(rank, "RankDied", f"rank {rank} could not be reached: {exc}")
                    self.done.add(rank)
                    continue
                asked.add(rank)
        finally:
            for rank in self.targets:
                if rank not in asked and rank not in self.done:
                    self.done.add(rank)
                    self._rank_state(rank, "killed")
            self.delivered = len(asked) == len(self.targets)

    # -- the end: every asked rank said DONE ------------------------------

    def _running(self) -> bool:
        if not self.requests_sent:
            self._send_requests()
        if not self._open_conns():
            return False
        if any(rank not in self.done for rank in self.targets):
            return True
        return self._waiting_for_exit_codes()

    def _waiting_for_exit_codes(self) -> bool:
        """A rank's socket closed: give its exit code a moment to arrive."""
        missing = [rank for rank in self.lost if rank not in self.exit_codes]
        if not missing or not self.supervisor_open:
            return False
        return time.monotonic() - min(self.lost.values()) < EXIT_CODE_WAIT

    def wait(self) -> list[Any] | None:
        try:
            return super().wait()
        except RunInterrupted as exc:
            raise RunInterrupted(self._interrupted_message(), exc.results) from None
        except RankError as exc:
            if self.pool.state == "broken":
                note = f"the pool is broken: {RESTART_HINT}"
            elif self.stop_reason == "timeout":
                note = "the pool keeps its ranks and their namespaces"
            else:
                raise
            error = RankError(exc.failures, exc.results, f"{exc.summary}; {note}")
            error.__suppress_context__ = True  # keep __cause__: the remote traceback
            raise error
        finally:
            if self.pool.state == "running":
                self.pool.state = "ready"
            elif self.pool.state == "broken":
                self.pool.kill()  # what is left of a broken pool only holds memory and devices
                self.pool.release_memory()

    def _interrupted_message(self) -> str:
        if self.pool.state == "broken":
            return f"interrupted; {self.pool.problem}, so the pool is broken. {RESTART_HINT}."
        return (
            "interrupted; the cell was stopped in every rank, and the pool keeps its ranks and "
            "their namespaces. Results of ranks that finished are on this error's .results."
        )

    # -- events ------------------------------------------------------------

    def _handle(self, conn: _Conn, event: protocol.Event) -> None:
        kind, fields = event
        if kind == protocol.BROKEN:
            self.pool.mark_broken(f"a garbled message from the pool ({fields.get('reason')})")
        elif conn.kind == "events":
            if kind == protocol.STATUS:
                self._take_status(conn.rank, fields)
                return
            if fields.get("seq") != self.seq:
                return  # a reply to a request the kernel gave up on
            if kind == protocol.ERROR and self.stop_reason is not None and fields.get("type") == "KeyboardInterrupt":
                self._rank_state(conn.rank, "killed")  # our own SIGINT, not a fault of the rank
                return
        elif conn.kind == "supervisor" and not self._take_supervisor_news(kind, fields):
            return
        super()._handle(conn, event)

    def _take_status(self, rank: int, fields: dict[str, Any]) -> None:
        state = self.record.ranks[rank]
        if fields.get("pid"):
            state.pid = fields["pid"]
        if fields.get("thread"):
            self.pool.thread_ranks.add(rank)
        if fields.get("memory") is not None:
            state.memory = fields["memory"]
        self.on_update(self.record)

    def _take_supervisor_news(self, kind: str, fields: dict[str, Any]) -> bool:
        """Note what the supervisor says; False where Run must not see it."""
        if kind == protocol.EXIT:
            rank = fields["rank"]
            self.pool.mark_broken(f"rank {rank} died: {describe_exit(fields['code'])}")
        elif kind == protocol.ENDED and self.pool.state != "starting":
            # Not a launch error: the ranks' processes ended under a running pool
            # (the tpu launch path reports a rank process that died this way).
            error = (fields.get("error") or "").strip()
            cause = f": {error.splitlines()[-1]}" if error else ""
            self.pool.mark_broken(f"the pool's rank processes ended{cause}")
            for rank in self.targets:
                if rank not in self.done and rank not in self.failures and self.stop_reason is None:
                    self._fail(rank, "RankDied", f"rank {rank}'s process ended{cause}")
            return False
        return True

    def _closed(self, conn: _Conn) -> None:
        if conn.kind == "events" and conn.rank not in self.done:
            self.lost[conn.rank] = time.monotonic()
        super()._closed(conn)
        if self.pool.state != "stopped":
            who = "the pool's supervisor" if conn.rank is None else f"rank {conn.rank}"
            self.pool.mark_broken(f"{who} ended", guess=True)

    # -- stopping: the cell, not the pool, unless the ranks do not answer --

    def _stop(self, reason: str, first_signal: int) -> None:
        self.stop_reason = reason
        pending = [rank for rank in self.targets if rank not in self.done]
        if self.pool.state == "starting":
            pending = []
            self.pool.mark_broken(f"its start was stopped ({reason})")
        elif pending and self.pool.state != "broken":
            self._interrupt(pending, reason)
        if self.pool.state == "broken":
            self.pool.kill()
            end = time.monotonic() + EXIT_CODE_WAIT
            while self.supervisor_open and time.monotonic() < end:
                self._pump(0.05)
        for rank in self.targets:
            if rank not in self.done:
                self._rank_state(rank, "killed")
        self._drain_output()

    def _interrupt(self, ranks: list[int], reason: str) -> None:
        """SIGINT to ``ranks`` until each said DONE; those that do not in time break the pool.

        Rank threads in native code get THREAD_STOP_GRACE, unless the person
        interrupts again.
        """
        self.pool.interrupt(ranks)
        answered = self._wait_for_done(ranks, STOP_GRACE)
        waiting = self._not_done(ranks)
        grace = STOP_GRACE
        if answered and waiting and all(rank in self.pool.thread_ranks for rank in waiting):
            grace = THREAD_STOP_GRACE
            again = "again " if reason == "interrupt" else ""
            print(f"waiting up to {grace:g} s for rank(s) {_listed(waiting)} to leave native code; "
                  f"interrupt {again}to stop {'it' if len(waiting) == 1 else 'them'} now", flush=True)
            answered = self._wait_for_done(waiting, grace - STOP_GRACE)
            waiting = self._not_done(ranks)
        if not waiting:
            return
        if answered:
            self.pool.mark_broken(f"rank(s) {_listed(waiting)} did not stop on SIGINT within {grace:g} s "
                                  f"and were killed")
        else:
            self.pool.mark_broken(f"rank(s) {_listed(waiting)} were still running at a second interrupt "
                                  f"and were killed")

    def _wait_for_done(self, ranks: list[int], seconds: float) -> bool:
        """Pump until every one of ``ranks`` said DONE or ``seconds`` passed; False at a second interrupt.

        SIGINT goes again every RESEND_INTERRUPT to those still at it: a rank
        that was still reading the request was not yet listening (it takes
        one interrupt per request, so a repeat never reaches its cell twice).
        """
        now = time.monotonic()
        end, resend = now + seconds, now + RESEND_INTERRUPT
        while self._not_done(ranks) and time.monotonic() < end:
            try:
                self._pump(0.05)
            except KeyboardInterrupt:
                return False
            if time.monotonic() >= resend:
                self.pool.interrupt(self._not_done(ranks))
                resend = time.monotonic() + RESEND_INTERRUPT
        return True

    def _not_done(self, ranks: list[int]) -> list[int]:
        return [rank for rank in ranks if rank not in self.done]

    # -- the sockets stay open for the next request ---------------------------

    def _drain_output(self) -> None:
        """Read what the ranks wrote before their DONE: what their output sockets hold now.

        A rank's background thread may go on printing; what it writes after
        this moment shows in the next request.
        """
        for key in list(self.selector.get_map().values()):
            conn: _Conn = key.data
            if conn.reader is not None:
                continue
            left = _bytes_waiting(conn.sock)
            while left > 0:
                data = self._receive(conn)
                if data is None:
                    break
                if not data:
                    self._closed(conn)
                    break
                self.output.feed(conn.rank, conn.kind, data)
                left -= len(data)

    def _close_all(self) -> None:
        """The pool keeps its sockets and selector; only read what is left."""
        self._drain_output()

    def _sweep_segments(self) -> None:
        """Remove results the kernel did not take (it takes each one it loads)."""
        if self.spec.payload.has_result:
            self.pool.results.sweep()


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _bytes_waiting(sock: socket.socket) -> int:
    """How many bytes a socket holds unread; 1 when it cannot say, so that a read finds out."""
    if sock.fileno() < 0:
        return 0
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), sys.byteorder) or 0
    except OSError:
        return 1


class PoolStart(PoolRun):
    """The pool's start: hand the job to the launcher; done when every rank is ready."""

    def start(self) -> None:
        self.pool.ranks = self.record.ranks  # the ranks' pids arrive in this record
        theirs = self.pool.open_sockets()
        try:
            job = {
                "mode": protocol.POOL_JOB,
                "run_id": self.record.run_id,
                "backend": self.pool.backend,
                "cpu_threads": self.pool.cpu_threads,
            }
            self.supervisor_pid = self.launcher.submit(job, [sock.fileno() for sock in theirs])
            self.pool.supervisor_pid = self.supervisor_pid
        except BaseException as exc:
            self._finish("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        finally:
            for sock in theirs:
                sock.close()


# --- what the magics call ---------------------------------------------------------


def current(session: Session) -> Pool | None:
    """The session's pool, unless there is none or it was stopped."""
    pool = session.pool
    return None if pool is None or pool.state == "stopped" else pool


def _request_spec(pool: Pool, source: str, has_result: bool, timeout: float | None = None) -> RunSpec:
    empty = payload.Payload(source=source, filename="<xla_pool>", has_result=has_result, namespace=b"")
    return RunSpec(payload=empty, backend=pool.backend, devices=pool.devices,
                   cpu_threads=pool.cpu_threads, timeout=timeout)


def start(session: Session, devices: int | None, backend: str | None, live_lines: bool = False) -> Pool:
    """``%xla_pool start``: a pool of ready ranks, or the one already running."""
    running = current(session)
    if running is not None:
        running.check_usable()
        running.check_fits(devices, backend or "auto")
        print(f"the pool is already running: {running.describe()}")
        return running
    placement = plan(backend or "auto", devices, "%xla_pool start")
    session.ready_launcher()
    pool = Pool(placement, backend or "auto")
    run_id = session.next_run_id()
    record = RunRecord(run_id, "%xla_pool start", pool.backend, pool.devices)
    session.remember(record)
    run = PoolStart(pool, _request_spec(pool, "%xla_pool start", False, READY_TIMEOUT), record, 0, None,
                    session, live_lines=live_lines)
    began = time.monotonic()
    try:
        session.start_run(run)
        run.wait()
    except BaseException:
        pool.stop()
        raise
    pool.start_seconds = time.monotonic() - began
    pool.state = "ready"
    session.pool = pool
    print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
    return pool


def stop(session: Session) -> bool:
    """``%xla_pool stop`` and the status panel's Stop pool: True when there was a pool to stop."""
    pool, session.pool = current(session), None
    if pool is None:
        return False
    pool.stop()
    return True


def restart(session: Session, devices: int | None, backend: str | None, live_lines: bool = False) -> Pool:
    old = current(session)
    if old is not None:
        devices = devices if devices is not None else old.devices
        backend = backend or old.requested_backend
        stop(session)
    return start(session, devices, backend, live_lines)


def run_cell(
    session: Session,
    cell: str,
    devices: int | None,
    backend: str,
    timeout: float | None,
    user_ns: Mapping[str, Any],
    hidden: Mapping[str, Any],
    live_lines: bool = False,
) -> list[Any] | None:
    """A ``%%xla_spawn`` cell in the running pool."""
    pool = session.pool
    pool.check_fits(devices, backend)
    pool.check_usable()
    _refuse_if_kernel_holds_devices(pool)
    run_id = session.next_run_id()
    filename = f"<xla_spawn cell {run_id}>"
    has_result, names = pool.analyse(cell, filename)
    values = payload.select_names(names, user_ns, hidden)
    delivered = False
    try:
        shipping, changed = pool.shipping.fields(values)
        seq = pool.next_seq()
        request = protocol.encode(protocol.CELL, seq=seq, run_id=run_id, source=cell, filename=filename,
                                  has_result=has_result, results_to=pool.results.prefix, **shipping)
        spec = _request_spec(pool, cell, has_result, timeout)
        record = RunRecord(run_id, cell, pool.backend, pool.devices)
        session.remember(record)
        run = PoolRun(pool, spec, record, seq, request, session, live_lines=live_lines)
        run.start()
        try:
            return run.wait()
        finally:
            delivered = run.delivered
            if delivered:
                pool.shipping.sent(changed, shipping)
                pool.cells += 1
    finally:
        pool.shipping.settle(delivered)


def _refuse_if_kernel_holds_devices(pool: Pool) -> None:
    """The kernel guard of every cell, without its /proc scan while no module was imported since."""
    if len(sys.modules) != pool.modules_checked:
        refuse_if_kernel_holds_devices("%%xla_spawn")
        pool.modules_checked = len(sys.modules)
    elif probe.kernel_xla_runtime():  # a runtime torch_xla had imported may start any time
        refuse_if_kernel_holds_devices("%%xla_spawn")


def _exchange(session: Session, kind: str, label: str, ranks: list[int] | None, has_result: bool,
              **fields: Any) -> PoolRun:
    pool = _usable(session)
    seq = pool.next_seq()
    request = protocol.encode(kind, seq=seq, **fields)
    record = RunRecord(session.next_run_id(), label, pool.backend, pool.devices)
    run = PoolRun(pool, _request_spec(pool, label, has_result), record, seq, request, session, ranks=ranks)
    run.start()
    run.wait()
    return run


def _usable(session: Session) -> Pool:
    pool = current(session)
    if pool is None:
        raise UsageError("no pool is running; start one with %xla_pool start [--devices N]")
    pool.check_usable()
    return pool


def push(session: Session, names: list[str], user_ns: Mapping[str, Any]) -> None:
    """``%xla_pool push NAME...``: the kernel's values into every rank's namespace."""
    _usable(session)
    missing = [name for name in names if name not in user_ns]
    if missing:
        raise UsageError(f"no notebook variable named {', '.join(missing)} to push")
    values = {name: user_ns[name] for name in names}
    segments = transport.RunSegments()  # large values: mapped by every rank, unlinked once all have
    try:
        _exchange(session, protocol.PUSH, f"%xla_pool push {' '.join(names)}", None, False,
                  values=payload.pickle_namespace(values, segments))
    finally:
        segments.sweep()


def pull(session: Session, name: str, rank: int | None) -> Any:
    """``%xla_pool pull NAME``: every rank's value (a list by rank), or rank ``rank``'s."""
    pool = _usable(session)
    if rank is not None and not 0 <= rank < pool.devices:
        raise UsageError(f"--rank must be between 0 and {pool.devices - 1} (the pool has {pool.devices} ranks)")
    run = _exchange(session, protocol.PULL, f"%xla_pool pull {name}", None if rank is None else [rank], True,
                    name=name, results_to=pool.results.prefix)
    if rank is not None:
        return run.results.get(rank)
    return [run.results.get(r) for r in range(pool.devices)]


def describe(session: Session) -> str:
    pool = current(session)
    if pool is None:
        return ("no pool is running. %xla_pool start [--devices N] starts one; %%xla_spawn cells "
                "then keep their ranks, namespaces and compiled graphs between cells.")
    return f"pool {pool.describe()}"
