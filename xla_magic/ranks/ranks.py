"""A live set of ranks: one launcher job, its sockets and processes. Runs in the kernel.

A one-shot cell's ranks and a pool's are the same thing with one policy
apart (policy.py): a one-shot set is launched with its one request and
stopped when that request ends; a pool's set serves request after request
and keeps its ranks' namespaces, devices and compiled graphs.

The kernel makes a private socket pair per rank and stream (events,
stdout, stderr) and one for the supervisor, and hands the far ends to the
launcher with the job; nothing listens on a port. The set owns what lasts
as long as its ranks: those sockets, the gloo store directory, the held
shared memory and the results prefix (see shipping.py).

``state`` is one of starting, ready, running, broken, stopped, and only
the set writes it: its requests (request.py) report what happened (a
request began or is over, a rank or a connection was lost, a stop), and the
set moves its state as its policy says. A broken set cannot serve again,
and says why (``problem``).

The placement decides how many ranks the set has: one per device, or (SPMD)
one process driving every device, whose output is tagged ``[spmd]`` and
whose value is one value rather than a list by rank.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import termios
import time
from typing import Any

from xla_magic.cell import compile_cache
from xla_magic.ranks import frame_writer, probe
from xla_magic.wire import protocol, result_memory, transport
from xla_magic.ranks import naming
from xla_magic.ranks.launcher_client import READY_TIMEOUT, Launcher, PrivateDir
from xla_magic.ranks.policy import RESTART_HINT, Policy
from xla_magic.cell.shipping import Shipping
from xla_magic.wire.help import see

STOP_WAIT = 5.0  # how long the ranks get to leave after the kernel closes their sockets


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


class Conn:
    """One socket of the set that the kernel reads."""

    def __init__(self, sock: socket.socket, rank: int | None, kind: str) -> None:
        self.sock = sock
        self.rank = rank
        self.kind = kind  # "events", "stdout", "stderr", "stacks" or "supervisor"
        self.reader = protocol.FrameReader() if kind in ("events", "supervisor", "stacks") else None
        sock.setblocking(False)

    def receive(self) -> bytes | None:
        """What the socket holds now: b"" once it closed, None if nothing yet."""
        try:
            return self.sock.recv(1 << 20)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def bytes_waiting(self) -> int:
        """How many bytes it holds unread; 1 when it cannot say, so that a read finds out."""
        if self.sock.fileno() < 0:
            return 0
        try:
            return int.from_bytes(fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), sys.byteorder) or 0
        except OSError:
            return 1


class Ranks:
    """The kernel's handle on one launcher job's ranks."""

    def __init__(self, placement: probe.Placement, policy: Policy, requested_backend: str, workdir: PrivateDir,
                 world: dict[str, Any] | None = None, cache: compile_cache.CacheSetting | None = None) -> None:
        self.placement = placement
        self.world = world  # one host's ranks of several (see xla_magic.hosts): host, rank_offset, world_size...
        self.ordinals: dict[int, int] = {}  # there: rank -> its global rank, as it said when ready (torch_xla's)
        self.backend = placement.backend
        self.devices = placement.devices
        self.size = placement.ranks  # how many ranks answer each request
        self.one_value = placement.spmd
        self.cpu_threads = placement.cpu_threads
        self.policy = policy  # one-shot or a pool's, for the set's life
        self.requested_backend = requested_backend
        self.workdir = workdir
        self.state = "starting"
        self.problem: str | None = None
        self._problem_is_a_guess = False
        self.launcher: Launcher | None = None
        self.supervisor: Conn | None = None
        self.events: list[Conn] = []
        self.outputs: list[Conn] = []
        self.samplers: list[Conn] = []  # each rank's stacks socket (launcher/stacks.py): where it is, on request
        self.selector = selectors.DefaultSelector()  # every socket of the set, for its whole life
        self.supervisor_pid: int | None = None
        self.pids: dict[int, int] = {}  # rank -> its process (rank threads share one)
        self.writing: int | None = None  # the rank whose request's first byte may have gone (send)
        self.thread_ranks: set[int] = set()  # ranks that are threads of a shared process
        self.ended = False  # the supervisor said ENDED or closed its socket
        self.started = time.time()
        self.start_seconds: float | None = None
        self.cells = 0
        self.shipping = Shipping()
        self.place: dict[str, Any] | None = None  # the kernel's directory and path, as the ranks last got them
        self.results = transport.RunSegments()  # where ranks put large results and pulled values
        self.store: str | None = None  # the gloo store's directory, for the set's life
        self.store_home: str | None = None  # where it is made (a kept pool's directory), else the kernel's own
        self.hang_after: float | None = None  # a pool's --hang-after, for cells that give none (watch.py)
        self.modules_checked = 0  # len(sys.modules) when the kernel was last found not to hold libtpu
        # torch_xla's persistent compilation cache: what was asked for, what the ranks' job says, what each
        # rank reported when it was ready (its directory, or why it has none), and its stderr lines not shown.
        self.cache = cache if cache is not None else compile_cache.resolve(None)
        self.cache_job = self.cache.job(placement.on_cpu)
        self.cache_facts: dict[int, dict[str, Any]] = {}
        self.quiet_line = compile_cache.quiet_line(self.cache_job)
        self._seq = 0

    # -- starting --------------------------------------------------------

    def launch(self, launcher: Launcher, run_id: int, first: bytes | None) -> None:
        """Hand the job to the launcher: with ``first``, the one request of a one-shot set.

        If that fails, nothing of the set is left (sockets, store, memory).
        """
        self.launcher = launcher
        theirs: list[socket.socket] = []
        try:
            theirs = self._open_sockets()
            self.store = self.workdir.new(f"store-{run_id}-") if self.store_home is None else \
                tempfile.mkdtemp(prefix=f"store-{run_id}-", dir=self.store_home)
            job = {
                "run_id": run_id,
                "store": self.store,
                "backend": self.backend,
                "cpu_threads": self.cpu_threads,
                "policy": self.policy.name,
                "first": first,
                "spmd": self._spmd_job(),
                "world": self.world,
                "compile_cache": self.cache_job,
            }
            self.supervisor_pid = launcher.submit(job, [sock.fileno() for sock in theirs])
        except BaseException:
            self.stop()
            raise
        finally:
            for sock in theirs:
                sock.close()

    def _spmd_job(self) -> dict[str, Any] | None:
        placement = self.placement
        if not placement.spmd:
            return None
        return {"devices": placement.devices, "mesh": placement.mesh, "axes": placement.axes,
                "on_cpu": placement.on_cpu}

    def _open_sockets(self) -> list[socket.socket]:
        """Make the socket pairs, watched by the set's selector; the ends the job hands over."""
        theirs: list[socket.socket] = []
        ours, remote = socket.socketpair()
        self.supervisor = Conn(ours, None, "supervisor")
        self.selector.register(ours, selectors.EVENT_READ, self.supervisor)
        theirs.append(remote)
        for rank in range(self.size):
            for kind in ("events", "stdout", "stderr", "stacks"):
                ours, remote = socket.socketpair()
                conn = Conn(ours, rank, kind)
                {"events": self.events, "stacks": self.samplers}.get(kind, self.outputs).append(conn)
                self.selector.register(ours, selectors.EVENT_READ, conn)
                theirs.append(remote)
        return theirs

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- naming ----------------------------------------------------------

    def label(self, rank: int) -> str:
        """The tag of a rank's output and errors: ``rank N``, ``spmd``, or on several hosts ``hH rN`` (N global)."""
        if self.world:
            return naming.tag(self.world['host'], self.global_rank(rank))
        return "spmd" if self.one_value else f"rank {rank}"

    def global_rank(self, rank: int) -> int:
        """On one host of several: its global rank as it said (torch_xla's ordinal), until then the hosts' order."""
        return self.ordinals.get(rank, rank + (self.world or {}).get("rank_offset", 0))

    def name(self, rank: int) -> str:
        """A rank in a sentence: ``rank N``, or ``the SPMD process``."""
        return "the SPMD process" if self.one_value else f"rank {rank}"

    def value(self, results: list[Any] | None) -> Any:
        """What a request's results are to the notebook: the list by rank, or the one value."""
        if results is None or not self.one_value:
            return results
        return results[0]

    # -- talking to the ranks --------------------------------------------

    def send(self, rank: int, frame: bytes) -> None:
        """Write one request on a rank's events socket (OSError: the rank is gone).

        Whatever stops it part-way (an interrupt, a rank that stopped reading)
        leaves a partial frame the rank cannot read past: the set is broken.
        One that stops it before the first byte leaves ``writing`` None: that
        rank has nothing to stop. Otherwise ``writing`` is ``rank``, which may
        hold the whole request (an interrupt just after it went).
        """
        self.writing = rank
        try:
            frame_writer.write_frame(self.events[rank].sock, frame, READY_TIMEOUT)
        except frame_writer.Unsent as unsent:
            if unsent.sent == 0:
                self.writing = None
            elif unsent.sent is not None:
                self.mark_broken(f"the request to rank {rank} was cut off part-way ({type(unsent.cause).__name__})")
            raise unsent.cause from None

    def lend(self, rank: int, segments: list[result_memory.Segment]) -> None:
        """Send ``rank`` the descriptors of free result segments it may write its next results over."""
        frame = protocol.encode(protocol.LEND, numbers=[segment.number for segment in segments],
                                results_to=self.results.prefix)
        sock = self.events[rank].sock
        try:
            sent = socket.send_fds(sock, [frame], [segment.fd for segment in segments])
        except BlockingIOError:
            return  # a full socket: no lending this time; the request's own send waits for room
        if sent < len(frame):
            self.send(rank, frame[sent:])

    def tell(self, ranks: list[int], frame: bytes) -> None:
        """A few bytes to ``ranks`` that answer nothing (DIGEST): gone or full sockets are skipped."""
        for rank in ranks:
            sock = self.events[rank].sock
            if sock.fileno() < 0:
                continue
            try:
                sent = sock.send(frame)
            except OSError:
                continue
            if 0 < sent < len(frame):
                self.send(rank, frame[sent:])

    def ask_where(self, ranks: list[int], probe: int, everything: bool = False, with_locals: bool = False) -> list[int]:
        """Ask ``ranks``' samplers where they are (their answers come on the same sockets); those asked.

        ``with_locals``: and each cell frame's local names (launcher/stacks.py: cell_locals)."""
        asked = []
        frame = protocol.encode(protocol.STACKS, probe=probe, all=everything, locals=with_locals)
        for rank in ranks:
            sock = self.samplers[rank].sock if rank < len(self.samplers) else None
            if sock is None or sock.fileno() < 0:
                continue
            try:
                sock.send(frame)  # a few bytes: the socket's buffer takes them whole
            except OSError:
                continue
            asked.append(rank)
        return asked

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to the processes of ``ranks`` (threads of one process share it).

        SIGCONT with it: a rank stopped by SIGSTOP could not take it otherwise.
        """
        for pid in {self.pids[rank] for rank in ranks if rank in self.pids}:
            for sig in (signal.SIGINT, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def signal_group(self, sig: int) -> bool:
        """``sig`` to every process of the set (one process group); False when none is left."""
        if self.supervisor_pid is None:
            return False
        try:
            os.killpg(self.supervisor_pid, sig)
            if sig != signal.SIGKILL:
                os.killpg(self.supervisor_pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    def kill_ranks(self) -> None:
        """SIGKILL the rank processes, not their supervisor: it reports their exits, then
        ends everything they started, however it detached (it is their subreaper), and says ENDED."""
        for pid in set(self.pids.values()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def end_broken(self) -> None:
        """End what is left of a broken set, and everything its ranks started (a pool keeps what its cells start)."""
        try:
            self.kill_ranks()
            self._wait_for_supervisor(STOP_WAIT)
        finally:
            self.kill()

    # -- state: what its requests report, and what the set makes of it -----------

    def cache_reported(self, rank: int, fact: dict[str, Any] | None) -> None:
        """A rank's compilation cache as it was ready: its directory, or why it runs without one."""
        if fact:
            self.cache_facts[rank] = fact

    def start_answered(self, seconds: float) -> None:
        """Every rank answered the set's start (a pool's, which sends no cell): it is ready for requests."""
        self.start_seconds = seconds
        self.state = "ready"

    def request_began(self) -> None:
        """A request goes to ready ranks (a one-shot set's went with its job, while it was starting)."""
        self.state = "running"

    def request_over(self, had_results: bool) -> None:
        """A request to the set ended, however it did: running ranks are ready again.

        As the policy says, what is left of a broken set ends now (it only
        holds memory, devices and what its cells started), and so do the
        results the kernel did not take; else all that goes when it stops.
        """
        settles = self.policy.settles_after_each_request
        if had_results and settles:
            self.results.sweep()  # the kernel took (and unlinked) each one it loaded
        if self.state == "running":
            self.state = "ready"
        elif self.state == "broken" and settles:
            self.end_broken()
            self.release_memory()

    def lost(self, reason: str, guess: bool = False) -> None:
        """Part of the set is gone (a rank, a connection, its start) or garbled: broken, if its policy says so."""
        if self.policy.loss_breaks:
            self.mark_broken(reason, guess)

    def processes_ended(self, reason: str) -> bool:
        """The supervisor says every rank process is gone; True when that broke a set that was serving."""
        self.ended = True
        if not self.policy.loss_breaks or self.state in ("starting", "stopped"):
            return False
        self.mark_broken(reason)
        return True

    def mark_broken(self, reason: str, guess: bool = False) -> None:
        """Note that the set cannot serve again, and why.

        A ``guess`` (a socket closed) gives way to a better word on the same
        death (an exit code, the launcher's end), which tends to arrive just after.
        """
        if self.state == "stopped":
            return
        self.state = "broken"
        if self.problem is None or (self._problem_is_a_guess and not guess):
            self.problem = reason
            self._problem_is_a_guess = guess

    def launcher_death(self) -> str | None:
        """How the launcher ended, if it has: the cause of everything else ending."""
        launcher = self.launcher
        if launcher is None or launcher.alive():
            return None
        return (f"the launcher process died ({describe_exit(launcher.process.returncode)}), and its ranks "
                f"with it; the next cell starts a new launcher. " + see("launcher-died"))

    # -- stopping -------------------------------------------------------------

    def stop(self) -> None:
        """End the ranks: close their sockets (they leave their loop), then make sure.

        Ranks that left by themselves (a one-shot set) are only waited for.
        """
        if self.state == "stopped":
            return
        self.selector.close()
        for conn in self.events + self.outputs + self.samplers:
            conn.sock.close()
        try:
            if self.state == "broken":
                self.kill_ranks()  # their supervisor then ends what they started
            if self.supervisor_pid is not None:
                self._wait_for_supervisor(STOP_WAIT)
        finally:
            self.kill()
            if self.backend == "tpu":
                self._end_the_runs_processes()
            self._wait_until_gone(self.supervisor_pid)
            if self.supervisor is not None:
                self.supervisor.sock.close()
            self.release_memory()
            if self.store is not None:
                shutil.rmtree(self.store, ignore_errors=True)
            self.state = "stopped"

    def release_memory(self) -> None:
        """Drop the shared memory of the set: held values, results not taken."""
        try:
            self.shipping.held.release()
        finally:
            self.results.sweep()

    def _wait_for_supervisor(self, timeout: float) -> None:
        """Until the supervisor, which outlives every rank and what they started, says ENDED or goes."""
        supervisor = self.supervisor
        if supervisor is None or supervisor.sock.fileno() < 0 or self.ended:
            return
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(supervisor.sock, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    continue
                data = supervisor.receive()
                if not data:
                    if data is None:
                        continue
                    return
                if any(event.kind in (protocol.ENDED, protocol.BROKEN) for event in supervisor.reader.feed(data)):
                    self.ended = True
                    return

    def _end_the_runs_processes(self, timeout: float = 10.0) -> None:
        """Every process of the run (its session: the supervisor's) gone, not only the supervisor: on a TPU
        a rank process holds its chip until it has exited, and the next cell's ranks would find it held.
        The group's SIGKILL misses one that left the group; SIGKILL it too."""
        if self.supervisor_pid is None:
            return
        left = session_members(self.supervisor_pid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout
        for pid in left:
            self._wait_until_gone(pid, max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _wait_until_gone(pid: int | None, timeout: float = 2.0) -> None:
        """Until the process has really exited (on a TPU host its end frees the chips)."""
        if pid is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat", "rb") as stat:
                    if stat.read().rpartition(b")")[2].split()[0] in (b"Z", b"X"):
                        return
            except (OSError, IndexError):
                return
            time.sleep(0.002)

    # -- showing ---------------------------------------------------------------

    def describe(self) -> str:
        if self.one_value:
            kind = " XLA CPU" if self.placement.on_cpu else ""
            where = (f"one SPMD process driving {self.devices}{kind} devices, mesh "
                     f"{self.placement.describe_mesh()}, on the {self.backend} backend")
        else:
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
        processes = "process" if self.one_value else "rank processes"
        return (
            f"{self.state}: {where}, up {uptime:.0f} s, {self.cells} cell(s) run; "
            f"{processes} {pids or 'unknown'}"
        )


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except OSError:
                pass
    return members


def process_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (state T), as /proc says."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False
