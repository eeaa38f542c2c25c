"""Carry everything a rank writes to its output sockets, losing nothing. Runs in a rank.

Runs in a run's supervisor (the :class:`Relay`) and in its ranks (the
writers).

A rank's ``sys.stdout`` and ``sys.stderr`` write into a :class:`Ring`, a
buffer in memory the rank shares with its supervisor: an anonymous
MAP_SHARED mapping that the supervisor makes before it forks the ranks. A
thread of the supervisor, the relay, sends what each ring holds to the
rank's output socket, which the kernel reads. Once a ``write`` has returned,
its bytes are no longer only in the rank's own memory, so a rank that is
killed (SIGKILL, the OOM killer), crashes or calls ``os._exit`` loses
nothing it wrote: the relay, which outlives it, sends the rest, and the
supervisor reports the exit only after that.

Why this shape:

- A print must stay cheap, so the rank may not make a system call per line:
  it copies into the ring and goes on.
- The only buffer that survives SIGKILL is one outside the process.
- Each ring has one reader, the relay, so no byte is sent twice. A reader in
  the rank could die between a ``send`` and writing down what it sent.

File descriptors 1 and 2 point at the sockets of the process's first rank,
for C code, subprocesses and faulthandler. A write there is in the socket
when it returns.

- A rank that is its process's main thread owns the process (the cpu
  backend, one-shot and pool; a one-device tpu run). ``sys.stdout`` and
  ``sys.stderr`` are C text streams that pass every write straight to the
  ring (:class:`OwnStreams`), so a print costs about what it costs in plain
  Python.
- Rank threads (the tpu launch path) share their process, so
  ``sys.stdout``/``sys.stderr`` route by thread to each rank's own rings.
- A process forked from a rank (``os.fork`` in a cell, a DataLoader worker)
  writes straight to the sockets, because a ring takes one writing process.
"""

from __future__ import annotations

import faulthandler
import io
import mmap
import os
import select
import socket
import sys
import threading
import time
from typing import Any

RING_BYTES = 1 << 20  # per rank and stream; a power of two
FLUSH_TIMEOUT = 30.0  # how long a rank waits for the relay to send what it wrote
BATCH_SECONDS = 0.002  # while a rank prints, the relay sends what gathered this often
IDLE_ROUNDS = 3  # rounds with nothing to send before the relay waits for a wake-up
SETTLE_SECONDS = 0.002  # see _RankRelay._sleep
IDLE_SECONDS = 1.0  # a waiting relay looks at its rings this often anyway
ENDED_JOIN_SECONDS = 10.0  # how long the supervisor waits for a dead rank's last bytes to go out

# Header words of a ring (8-byte words, each on its own cache line).
_HEAD = 0  # bytes ever written, by the rank
_TAIL = 8  # bytes ever sent, by the relay
_ASLEEP = 16  # 1 while the relay waits for a wake-up
_HEADER_BYTES = mmap.PAGESIZE

# The rings of this supervisor's ranks, by rank; a forked rank finds its own here.
_rings: list[tuple["Ring", "Ring"]] | None = None


class Ring:
    """One output stream's bytes on their way from a rank to its socket.

    One process writes (its threads take turns under a lock), one reads.
    ``head`` and ``tail`` only grow; ``head - tail`` bytes wait to be sent.
    """

    def __init__(self, wake_fd: int, size: int = RING_BYTES) -> None:
        self.size = size
        self._mask = size - 1
        memory = mmap.mmap(-1, _HEADER_BYTES + size)  # anonymous and MAP_SHARED: forked ranks share it
        self._words = memoryview(memory)[:_HEADER_BYTES].cast("Q")
        self._data = memoryview(memory)[_HEADER_BYTES:]
        self._wake_fd = wake_fd
        self._lock = threading.Lock()
        # The writer's own copies: its head, and where the room it last saw ends.
        self._head = 0
        self._limit = size

    # -- the rank's side ----------------------------------------------------

    def write(self, data: Any) -> int:
        """Copy ``data`` in (waiting for room if the ring is full); called once per line."""
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        size = len(data)
        lock = self._lock
        lock.acquire()
        try:
            head = self._head
            end = head + size
            at = head & self._mask
            if end <= self._limit and at + size <= self.size:
                self._data[at : at + size] = data
                # Published after the bytes: the relay never sends what is not there yet.
                self._head = self._words[_HEAD] = end
            else:
                self._write_in_pieces(memoryview(data))
        finally:
            lock.release()
        if self._words[_ASLEEP]:
            self.wake()
        return size

    def _write_in_pieces(self, view: memoryview) -> None:
        """Write across the end of the ring, waiting for room where it is full."""
        pause = 50e-6
        while view:
            self._limit = self._words[_TAIL] + self.size
            room = self._limit - self._head
            if not room:
                self.wake()
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
                continue
            at = self._head & self._mask
            piece = min(room, len(view), self.size - at)
            self._data[at : at + piece] = view[:piece]
            self._head = self._words[_HEAD] = self._head + piece
            view = view[piece:]

    def wake(self) -> None:
        """Tell the relay there is something to send."""
        self._words[_ASLEEP] = 0
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass  # the supervisor is gone; this rank is about to be ended too

    def wait_sent(self, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Wait until the relay has sent all that was written; False if it did not in time."""
        words = self._words
        target = words[_HEAD]
        if words[_TAIL] >= target:
            return True
        self.wake()
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while words[_TAIL] < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.001)
        return True

    # -- the relay's side ---------------------------------------------------

    def pending(self) -> int:
        return self._words[_HEAD] - self._words[_TAIL]

    def set_asleep(self, asleep: bool) -> None:
        self._words[_ASLEEP] = int(asleep)

    def send_to(self, sock: socket.socket) -> bool:
        """Send all the ring holds now; True if it held anything."""
        words = self._words
        head, tail = words[_HEAD], words[_TAIL]
        if head == tail:
            return False
        while tail < head:
            at = tail & self._mask
            end = min(at + head - tail, self.size)
            tail += _send(sock, self._data[at:end])
            words[_TAIL] = tail  # only what the socket took: a short send leaves the rest to send
        return True


def _send(sock: socket.socket, data: memoryview) -> int:
    """Send what the socket takes of ``data``; how many bytes are done with."""
    try:
        return sock.send(data)
    except BlockingIOError:  # the rank made its socket non-blocking; the description is shared
        select.select([], [sock], [], 1.0)
        return 0
    except OSError:
        return len(data)  # the kernel closed its end: nobody will read these bytes


# --- the supervisor's side ------------------------------------------------------


class _RankRelay:
    """One rank's two rings and the supervisor thread that sends them on."""

    def __init__(self) -> None:
        self.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.out = Ring(self.wake_fd)
        self.err = Ring(self.wake_fd)
        self.ended = False
        self._pairs: list[tuple[Ring, socket.socket]] = []
        self._thread: threading.Thread | None = None

    def start(self, out: socket.socket, err: socket.socket, name: str) -> None:
        self._pairs = [(self.out, out.dup()), (self.err, err.dup())]
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def end(self) -> None:
        """The rank is gone: send what it left, then close our copies of its sockets."""
        self.ended = True
        if self._thread is None:
            return
        os.eventfd_write(self.wake_fd, 1)
        self._thread.join(ENDED_JOIN_SECONDS)

    def _run(self) -> None:
        """Send, then let the next bytes gather for BATCH_SECONDS, while a rank
        prints: it need not wake us then, so a line costs it no system call."""
        idle = 0
        try:
            while True:
                ended = self.ended  # read before sending: a dead rank's rings are then sent whole
                sent = [ring.send_to(sock) for ring, sock in self._pairs]
                if ended:
                    return
                idle = 0 if any(sent) else idle + 1
                if idle <= IDLE_ROUNDS:
                    self._wait(BATCH_SECONDS)
                else:
                    self._sleep()
        finally:
            for _ring, sock in self._pairs:
                sock.close()

    def _sleep(self) -> None:
        """Wait for a writer's wake-up.

        A writer stores its bytes, then looks at ``asleep``; we store
        ``asleep``, then look for bytes. Each can see the other's old value,
        and then no wake-up comes, so look once more after SETTLE_SECONDS, by
        when the writer's bytes are visible. After that every writer sees
        ``asleep`` and wakes us.
        """
        for ring, _sock in self._pairs:
            ring.set_asleep(True)
        for timeout in (0.0, SETTLE_SECONDS, IDLE_SECONDS):
            if self.ended or any(ring.pending() for ring, _sock in self._pairs) or self._wait(timeout):
                break
        for ring, _sock in self._pairs:
            ring.set_asleep(False)

    def _wait(self, timeout: float) -> bool:
        if not timeout or not select.select([self.wake_fd], [], [], timeout)[0]:
            return False
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass
        return True


class Relay:
    """The rings of one run's ranks, and the supervisor's threads that send them on.

    Make it before forking the ranks (they inherit the rings), ``start`` it
    once they are forked, and call ``rank_ended`` once a rank's exit is
    reaped, before reporting it.
    """

    def __init__(self, sockets: list[tuple[socket.socket, socket.socket]]) -> None:
        global _rings
        self._sockets = sockets
        self._ranks = [_RankRelay() for _ in sockets]
        _rings = [(relay.out, relay.err) for relay in self._ranks]

    def start(self) -> None:
        """Start sending; takes copies of the output sockets, so the caller may close its own."""
        for rank, (relay, (out, err)) in enumerate(zip(self._ranks, self._sockets)):
            relay.start(out, err, name=f"xla_magic-relay-{rank}")

    def rank_ended(self, rank: int) -> None:
        self._ranks[rank].end()

    def all_ended(self) -> None:
        for relay in self._ranks:
            relay.end()


# --- the ranks' side --------------------------------------------------------------


class _RankFile:
    """The binary stream under a rank's stdout or stderr: its ring, or its socket.

    A plain object rather than an ``io.RawIOBase``: a line-buffered text
    stream above looks up ``closed``, ``write`` and ``flush`` on it for every
    line, and these lookups are then as cheap as they get. ``write`` is the
    ring's own method, set on the instance, so nothing runs in between.
    """

    closed = False
    # Called after every line; there is nothing to flush (int() is a no-op in C).
    flush = int

    def __init__(self, ring: Ring | None, sock: socket.socket, fd: int) -> None:
        self.ring = ring
        self.sock = sock
        self._fd = fd
        self.write = ring.write if ring is not None else self._send

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True

    def _send(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.sock.sendall(view)
        except OSError:
            pass  # the kernel is gone; this process is about to be ended too
        return len(view)

    def unshare(self) -> None:
        """In a process forked from the rank: write to the socket, not the rank's ring."""
        self.ring = None
        self.write = self._send

    def wait_sent(self) -> None:
        if self.ring is not None:
            self.ring.wait_sent()


def _text_stream(raw: _RankFile) -> io.TextIOWrapper:
    # Line-buffered: each line (or "\r" update, or flush) goes into the ring as
    # one write; text that ends no line yet waits in the text layer, as on a terminal.
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", line_buffering=True)  # type: ignore[arg-type]


class OwnStreams:
    """``sys.stdout`` / ``sys.stderr`` of a one-rank process."""

    def __init__(self, out: _RankFile, err: _RankFile) -> None:
        self.streams = [_text_stream(out), _text_stream(err)]
        sys.stdout, sys.stderr = self.streams

    def flush(self) -> None:
        for stream in self.streams:
            try:
                stream.flush()
            except ValueError:  # a cell closed it; nothing more can come through it
                pass


class RankStreams:
    """Where one rank's output goes: its rings (or its sockets, with no relay), by stream."""

    def __init__(self, rank: int, out: socket.socket, err: socket.socket) -> None:
        self.rank = rank
        rings = _rings[rank] if _rings is not None and rank < len(_rings) else (None, None)
        self.out = _RankFile(rings[0], out, 1)
        self.err = _RankFile(rings[1], err, 2)
        self.own: OwnStreams | None = None

    def flush(self) -> None:
        """Return once everything written so far is in the sockets (a DONE may follow)."""
        if self.own is not None:
            self.own.flush()
        self.out.wait_sent()
        self.err.wait_sent()

    def unshare(self) -> None:
        self.out.unshare()
        self.err.unshare()


class _Router:
    """Which rank's streams the current thread writes to."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.default: RankStreams | None = None
        self.registered: list[RankStreams] = []
        self.lock = threading.Lock()

    def current(self) -> RankStreams | None:
        return getattr(self.local, "streams", None) or self.default

    def flush_all(self) -> None:
        for streams in list(self.registered):
            streams.flush()


_router = _Router()


class RankTextStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` in a process of rank threads."""

    def __init__(self, which: str, fd: int) -> None:
        self._which = which
        self._fd = fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "replace"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        streams = _router.current()
        if streams is None or not text:
            return len(text)
        (streams.out if self._which == "stdout" else streams.err).write(text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass  # what was written is already in the ring or the socket

    @property
    def buffer(self) -> "_BinaryView":  # some libraries write bytes to sys.stdout.buffer
        return _BinaryView(self._which)


class _BinaryView(io.RawIOBase):
    def __init__(self, which: str) -> None:
        self._which = which

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        streams = _router.current()
        if streams is None:
            return memoryview(data).nbytes
        return (streams.out if self._which == "stdout" else streams.err).write(data)


# --- attaching a rank ----------------------------------------------------------------


def attach(streams: RankStreams) -> None:
    """Make this thread write to ``streams``; set up the process on first use."""
    with _router.lock:
        _router.registered.append(streams)
        if _router.default is None:
            _router.default = streams
            _take_process_output(streams)
    _router.local.streams = streams


def _take_process_output(streams: RankStreams) -> None:
    """Point fds 1/2 and ``sys.stdout``/``sys.stderr`` of this process at its first rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(streams.out.sock.fileno(), 1)
    os.dup2(streams.err.sock.fileno(), 2)
    # A native crash then leaves a Python traceback on the rank's stderr
    # socket, which outlives the process.
    faulthandler.enable(file=2, all_threads=True)
    os.register_at_fork(after_in_child=_forked_child)
    if threading.current_thread() is threading.main_thread():
        streams.own = OwnStreams(streams.out, streams.err)  # the only rank of its process
        return
    sys.stdout = RankTextStream("stdout", 1)
    sys.stderr = RankTextStream("stderr", 2)


def _forked_child() -> None:
    for streams in _router.registered:
        streams.unshare()


def flush_all() -> None:
    _router.flush_all()
