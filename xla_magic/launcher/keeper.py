"""A kept pool's launcher, once its ranks started: the pool's server. Runs in the kept launcher.

``%xla_pool start --keep NAME`` starts the launcher in its own session, as
ever, but without the parent-death signal: a kernel restart, a crash or a
closed notebook leaves it, its supervisor and its ranks running. Once the
ranks started, the kernel hands this process a copy of its ends of their
sockets (HOLD), so that they stay open when the kernel goes: the ranks
then see no end of their sockets, and keep their namespaces, devices and
compiled graphs.

The kernel's link to the pool is one socket, the same whether inherited at
start or connected later: a kernel that attaches connects to the Unix
socket in the pool's 0700 directory (wire/kept.py), whose peer uid must be
this process's own, and gets the held descriptors (SCM_RIGHTS) with what
it needs to drive them. One kernel is attached at a time; another is
refused, naming the holder, unless it steals the pool (the holder is told,
and its link closed).

With no kernel attached and the ranks idle for ``--keep-idle`` seconds the
pool ends itself, and says so in its log: a TPU is never held by a
forgotten pool. Ending, this process goes, which ends the supervisor
(its parent-death signal) and so every rank and what they started.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Any

from xla_magic.wire import kept, protocol

MAX_FDS = 253  # SCM_RIGHTS limit on Linux
ATTACH_READ_TIMEOUT = 5.0  # for a connected peer to say what it wants
BUSY_SHARE = 0.05  # of one core, over the last check, that counts a rank as running a cell
_TICKS = os.sysconf("SC_CLK_TCK")


def say(text: str) -> None:
    """One line in the pool's log (this process's stdout), with the time."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} kept pool: {text}", flush=True)


class Keeper:
    """The kept pool's one loop: the attached kernel's link, the listening socket, the idle clock."""

    def __init__(self, name: str, path: str, idle: float, link: protocol.Channel, kernel_pid: int) -> None:
        self.name = name
        self.path = path
        self.idle = idle
        self.link: protocol.Channel | None = link
        self.kernel_pid: int | None = kernel_pid
        self.held: list[int] = []
        self.fields: dict[str, Any] = {}
        self.supervisor_pid: int | None = None
        self.started = time.time()
        self.detached_at: float | None = None
        self.cpu_seen: tuple[float, float] | None = None  # (when, the ranks' CPU seconds then)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(os.path.join(path, kept.SOCKET))
        os.chmod(os.path.join(path, kept.SOCKET), 0o600)
        self.listener.listen(8)

    def take_job(self, supervisor_pid: int) -> None:
        self.supervisor_pid = supervisor_pid
        self.write_record()

    # -- the loop ----------------------------------------------------------------

    def run(self) -> None:
        """Until the pool ends: told to (END), idle too long, or its supervisor gone."""
        say(f"{self.name} started (pid {os.getpid()}); it ends after {self.idle:g} s with no kernel attached "
            f"and no cell running")
        while True:
            watched = [self.listener] + ([self.link.sock] if self.link is not None else [])
            ready, _, _ = select.select(watched, [], [], self._wait())
            if self.supervisor_pid is not None and not kept.process_alive(self.supervisor_pid):
                say(f"{self.name}: its ranks are gone (supervisor {self.supervisor_pid} exited); ending")
                return
            if self.link is not None and self.link.sock in ready:
                if not self._from_kernel():
                    return
            if self.listener in ready:
                if not self._admit():
                    return
            if self._expired():
                say(f"{self.name}: no kernel attached for {time.time() - (self.detached_at or 0):.0f} s and no "
                    f"cell running (--keep-idle {self.idle:g}); ending it to free its devices")
                return

    def _wait(self) -> float | None:
        if self.link is not None:
            return None
        return max(0.05, min(self.idle, 60.0))

    def _expired(self) -> bool:
        if self.link is not None or self.detached_at is None:
            return False
        now = time.time()
        if now - self.detached_at < self.idle:
            return False
        cpu = self._ranks_cpu()
        seen, self.cpu_seen = self.cpu_seen, (now, cpu)
        if seen is None:
            return self.idle <= 0 or not self._was_busy(cpu)
        return (cpu - seen[1]) / max(now - seen[0], 1e-3) < BUSY_SHARE

    def _was_busy(self, cpu: float) -> bool:
        """A first look at an idle pool: its ranks' CPU over a short while (a cell left running computes)."""
        time.sleep(0.2)
        again = self._ranks_cpu()
        self.cpu_seen = (time.time(), again)
        return (again - cpu) / 0.2 >= BUSY_SHARE

    def _ranks_cpu(self) -> float:
        total = 0.0
        for pid in set(self.fields.get("pids", {}).values()):
            try:
                with open(f"/proc/{pid}/stat", "rb") as file:
                    parts = file.read().rpartition(b")")[2].split()
                total += (int(parts[11]) + int(parts[12])) / _TICKS
            except (OSError, IndexError, ValueError):
                continue
        return total

    # -- the attached kernel --------------------------------------------------------

    def _from_kernel(self) -> bool:
        """One message from the attached kernel; False when the pool is to end."""
        assert self.link is not None
        try:
            event, fds = self.link.recv_with_fds(MAX_FDS)
        except (OSError, ConnectionError):
            event, fds = protocol.Event(protocol.CLOSED, {}), []
        if event.kind == kept.HOLD:
            self._close_held()
            self.held, self.fields = fds, event.fields
            self.write_record()
            return True
        for fd in fds:
            os.close(fd)
        if event.kind == kept.END:
            self._ending(self.link)
            return False
        # Gone: the kernel restarted, crashed or detached. The pool waits for the next one.
        say(f"{self.name}: kernel {self.kernel_pid} went; the pool stays, waiting for %xla_pool attach {self.name}")
        self._detach()
        return True

    def _detach(self) -> None:
        if self.link is not None:
            self.link.sock.close()
        self.link, self.kernel_pid = None, None
        self.detached_at, self.cpu_seen = time.time(), None
        self.write_record()

    def _admit(self) -> bool:
        """A connection on the listening socket: an attach, or an END; False when the pool is to end."""
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return True
        channel = protocol.Channel(conn)
        try:
            if kept.peer_uid(conn) != os.getuid():
                say(f"{self.name}: refused a connection from uid {kept.peer_uid(conn)}")
                channel.send_with_fds([], kept.REFUSED, message=(
                    f"kept pool {self.name} belongs to another user (uid {os.getuid()}): only its owner may attach"))
                conn.close()
                return True
            conn.settimeout(ATTACH_READ_TIMEOUT)
            event, fds = channel.recv_with_fds(8)
            for fd in fds:
                os.close(fd)
            conn.settimeout(None)
            if event.kind == kept.END:
                self._ending(channel)
                return False
            if event.kind == kept.ATTACH:
                self._attach(channel, event.fields)
                return True
        except (OSError, ConnectionError):
            pass
        conn.close()
        return True

    def _attach(self, channel: protocol.Channel, fields: dict[str, Any]) -> None:
        pid = fields.get("pid")
        if self.link is not None and pid != self.kernel_pid:
            if not fields.get("steal"):
                channel.send_with_fds([], kept.REFUSED, message=(
                    f"kept pool {self.name} is attached to another kernel (pid {self.kernel_pid}); "
                    f"%xla_pool attach {self.name} --steal takes it over, and that kernel's next pool cell is "
                    f"refused"))
                channel.sock.close()
                return
            say(f"{self.name}: kernel {pid} takes the pool over from kernel {self.kernel_pid}")
            try:
                self.link.send_with_fds([], kept.STOLEN, pid=pid)
            except OSError:
                pass
            self.link.sock.close()
        self.link, self.kernel_pid, self.detached_at = channel, pid, None
        self.write_record()  # before the answer: what the attached kernel reads next names it
        try:
            channel.send_with_fds(self.held, kept.HELD, **self.fields)
        except OSError:
            say(f"{self.name}: kernel {pid} went while attaching")
            self._detach()
            return
        say(f"{self.name}: kernel {pid} attached")

    def _ending(self, channel: protocol.Channel) -> None:
        say(f"{self.name}: ended by kernel {self.kernel_pid if channel is self.link else 'not attached'}")
        self._close_held()
        try:
            channel.send_with_fds([], kept.ENDING)
        except OSError:
            pass

    def _close_held(self) -> None:
        for fd in self.held:
            try:
                os.close(fd)
            except OSError:
                pass
        self.held = []

    # -- the record ---------------------------------------------------------------------

    def write_record(self) -> None:
        record = {
            "name": self.name, "pid": os.getpid(), "started": self.started, "idle_limit": self.idle,
            "kernel": self.kernel_pid, "detached_at": self.detached_at,
            "devices": self.fields.get("describe", "starting"), "backend": self.fields.get("backend"),
            "supervisor": self.supervisor_pid,
        }
        try:
            kept.write_record(self.path, record)
        except OSError as exc:
            print(f"kept pool: could not write its record: {exc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """The pool's directory goes (its log stays beside it); the caller then exits, ending the ranks."""
        import shutil

        self._close_held()
        self.listener.close()
        shutil.rmtree(self.path, ignore_errors=True)
