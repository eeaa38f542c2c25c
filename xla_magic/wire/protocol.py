"""Event types and framing shared by the kernel, the launcher and the ranks. Runs on both sides.

Runs in every process. Imports nothing heavy and nothing from the rest of the
package, so the launcher side can use it without touching the kernel side.

A message is one frame: a 4-byte big-endian length, then a pickle of
``(VERSION, kind, fields)``. Channels are private socket pairs inherited by
the processes at fork time or handed over with SCM_RIGHTS; nothing here ever
listens on a port, and only frames from such channels are unpickled.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any, NamedTuple, TypedDict

VERSION = 1
_HEADER = struct.Struct("!I")
# A frame larger than this is treated as corruption, not as a request to
# allocate gigabytes: large data travels through shared memory instead.
MAX_FRAME = (1 << 31) - 1
_LENT_FDS = 64  # descriptors one read of a rank's events channel takes at most (a LEND carries at most 8)

# kernel -> launcher
JOB = "job"
STOP = "stop"
# launcher -> kernel
READY = "ready"
FATAL = "fatal"
STARTED = "started"
# a job's ``policy``: how its ranks live (decided in the kernel, xla_magic/ranks/policy.py; read by launcher/serve.py)
ONE_SHOT = "one-shot"  # they answer the request that came with the job (its ``first``) and leave
POOL = "pool"  # they serve request after request until the kernel closes their sockets
# supervisor (one per run) -> kernel
SPAWNED = "spawned"
EXIT = "exit"
ENDED = "ended"
# kernel -> rank, on the rank's events socket, or with a one-shot JOB as its
# ``first`` (see launcher/serve.py); each carries a ``seq`` that the rank's
# RESULT, ERROR and DONE echo
CELL = "cell"
PUSH = "push"
PULL = "pull"
SHOWN = "shown"  # a rank's DISPLAY is shown: its cell may go on (not a request)
INPUT_REPLY = "input_reply"  # the answer to a rank's INPUT: ``text``, or ``eof`` (why there is none) (not a request)
DEBUG = "debug"  # pdb's post-mortem in the frames of the rank's last failed cell, which it keeps until its next request
# segments the next request's large results may be written over (wire/result_memory.py): their ``numbers``,
# their descriptors sent with the frame's first byte (SCM_RIGHTS) (not a request)
LEND = "lend"
# the request is over on every rank: a rank that holds a --profile cell's trace reads it now (launcher/profiling.py),
# not while other ranks still run their cells (not a request)
DIGEST = "digest"
# rank -> kernel (output travels as raw bytes on the stdout/stderr sockets)
RESULT = "result"
ERROR = "error"
STATUS = "status"
DONE = "done"
# rank -> kernel, while a cell runs: something to display in the cell, as plain
# data (``what`` names the kernel's view of it, e.g. "sharding"); the rank
# waits for SHOWN, so what it prints next comes after the picture
DISPLAY = "display"
# rank -> kernel, while a request runs: a line to ask for (``input()``, getpass, pdb's prompt:
# launcher/debugger.py), with its ``prompt``, ``password``, ``why`` (input or debugger) and the cell
# ``line`` it asks at; the rank waits for INPUT_REPLY, which the kernel sends once it has asked
INPUT = "input"
# rank -> kernel, with a cell's reply: what XLA did during the cell (launcher/xla_account.py)
# (none from a rank in which XLA did nothing during the cell)
XLA = "xla"
# kernel -> rank on the rank's stacks socket, and its answer back on it: where
# the rank is (launcher/stacks.py), read by a thread of its own; ``probe``
# names the question, so a late answer to an older one is told apart
STACKS = "stacks"
# the same, for what holds the rank's device memory (launcher/memory.py: %xla_memory); read without a sync
MEMORY = "memory"
# rank -> kernel, with a cell's reply under --profile: where its process's trace files are (launcher/profiling.py)
PROFILE = "profile"
# rank -> kernel, while a cell runs: values its cell logged (launcher/metrics.py), a batch of ``rows``, each
# (step, name, value, time), never one event per log call
METRICS = "metrics"
# rank 0 -> kernel, once a checkpoint of its cell's is complete (launcher/checkpoints.py): its ``step``, ``path``,
# ``time``, ``size``; %xla_runs shows a run's last
CHECKPOINT = "checkpoint"
# made up by a reader, never sent
BROKEN = "broken"
CLOSED = "closed"


# -- what crosses a process boundary, declared (as CPython's _CallItem / _ResultItem) --


class World(TypedDict):
    """One host's part of a world across several hosts: kernel -> engine -> launcher -> ranks (a job's ``world``)."""

    host: int  # this host's index
    hosts: int
    rank_offset: int  # the global rank of this host's local rank 0
    world_size: int
    address: str  # this host's address toward the others
    store_address: str  # host 0's: the collectives' TCP store
    store_port: int


class XlaAccount(TypedDict):
    """What XLA did in one cell, in the ranks it covers (rank -> kernel, an XLA event's ``account``)."""

    ranks: list[int]
    cell: str
    analysis: str  # "ours" or "user": whose compilation analysis file the causes came from
    compiles: int
    compile_seconds: float
    cached: int  # graphs found in the in-memory cache
    loaded: int  # graphs loaded from the persistent compilation cache instead of compiled
    load_seconds: float
    load_failures: int  # graphs the persistent cache held but could not load (compiled again)
    cannot_load: bool  # this torch_xla cannot load executables here at all (XLA:CPU, pytorch/xla#9094 on TPU)
    executions: int
    execute_seconds: float
    transfers: int
    scalar_reads: int
    fallbacks: dict[str, int]
    compilations: list[dict[str, Any]]
    sync_lines: list[dict[str, Any]]


class Event(NamedTuple):
    kind: str
    fields: dict[str, Any]


def encode(kind: str, **fields: Any) -> bytes:
    body = pickle.dumps((VERSION, kind, fields), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Turns a byte stream into events; never raises on bad input.

    Anything that is not a well-formed frame of our version becomes one
    ``broken`` event describing the problem, and the reader stops decoding
    (a stream that lost its framing cannot be trusted again).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.broken = False

    def feed(self, data: bytes) -> list[Event]:
        if self.broken:
            return []
        self._buffer += data
        events: list[Event] = []
        offset = 0
        buffer = self._buffer
        while len(buffer) - offset >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, offset)
            if length > MAX_FRAME:
                events.append(self._break(f"frame length {length} exceeds the limit"))
                return events
            end = offset + _HEADER.size + length
            if len(buffer) < end:
                break
            events.append(self._decode(bytes(buffer[offset + _HEADER.size : end])))
            offset = end
            if self.broken:
                return events
        del buffer[:offset]
        return events

    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buffer)

    def _decode(self, body: bytes) -> Event:
        try:
            message = pickle.loads(body)
        except Exception as exc:  # corrupt data may raise almost anything
            return self._break(f"undecodable frame ({type(exc).__name__}: {exc})")
        if not (isinstance(message, tuple) and len(message) == 3):
            return self._break(f"not an event: {type(message).__name__}")
        version, kind, fields = message
        if version != VERSION:
            return self._break(f"protocol version {version!r}, expected {VERSION}")
        if not isinstance(kind, str) or not isinstance(fields, dict):
            return self._break("event without a kind or fields")
        return Event(kind, fields)

    def _break(self, reason: str) -> Event:
        self.broken = True
        self._buffer.clear()
        return Event(BROKEN, {"reason": reason})


class Channel:
    """A blocking, thread-safe sender and receiver on one socket."""

    def __init__(self, sock: socket.socket, takes_fds: bool = False) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self._reader = FrameReader()
        self._inbox: list[Event] = []
        # Descriptors that came with LEND frames, in order (a rank's events channel only): each recvmsg
        # that carries some stops at the end of the bytes sent with them, so they are here by the time
        # their frame is whole.
        self.fds: collections.deque[int] | None = collections.deque() if takes_fds else None

    def send(self, kind: str, **fields: Any) -> None:
        frame = encode(kind, **fields)
        with self.lock:
            self.sock.sendall(frame)

    def recv_with_fds(self, maxfds: int) -> tuple[Event, list[int]]:
        """Next message sent with :meth:`send_with_fds`, reading no further.

        Used by the launcher, whose every incoming message carries its
        (possibly empty) list of descriptors ahead of the frame.
        """
        data, fds, _flags, _addr = socket.recv_fds(self.sock, 1, maxfds)
        if not data:
            return Event(CLOSED, {}), []
        if data != b"F":
            raise ConnectionError("expected a descriptor marker on the channel")
        header = self._recv_exact(_HEADER.size)
        body = self._recv_exact(_HEADER.unpack(header)[0]) if header else b""
        if not header or body is None:
            return Event(CLOSED, {}), fds
        return FrameReader()._decode(body), fds

    def send_with_fds(self, fds: list[int], kind: str, **fields: Any) -> None:
        frame = encode(kind, **fields)
        with self.lock:
            socket.send_fds(self.sock, [b"F"], fds)
            self.sock.sendall(frame)

    def _recv_exact(self, size: int) -> bytes | None:
        chunks = bytearray()
        while len(chunks) < size:
            data = self.sock.recv(size - len(chunks))
            if not data:
                return None
            chunks += data
        return bytes(chunks)

    def recv(self) -> Event:
        """Next event; a ``closed`` event once the peer has gone."""
        while not self._inbox:
            if self.fds is None:
                data = self.sock.recv(1 << 20)
            else:
                # close-on-exec: a process the cell starts must not hold a lent segment's pages
                data, fds, _flags, _address = socket.recv_fds(self.sock, 1 << 20, _LENT_FDS,
                                                              socket.MSG_CMSG_CLOEXEC)
                self.fds.extend(fds)
            if not data:
                return Event(CLOSED, {})
            self._inbox.extend(self._reader.feed(data))
        return self._inbox.pop(0)

    def take_fds(self, count: int) -> list[int]:
        """The next ``count`` descriptors that came with LEND frames (fewer if fewer came)."""
        return [self.fds.popleft() for _ in range(min(count, len(self.fds or ())))]

    def close(self) -> None:
        self.sock.close()


class Inbox:
    """What arrives on a channel, read by a thread of its own and kept until the main thread is done with it.

    Python runs signal handlers in the main thread only, after any call of
    its returns; one that raises (torch's SIGCHLD handler does when a
    DataLoader worker dies) just after the main thread read bytes off a
    socket loses them, and a request and the stream's framing with them.
    Here the bytes become events in a thread no handler runs in, and the
    main thread only looks at the first event (:meth:`first`) and, once
    done with it, removes it (:meth:`take`): a handler raising anywhere in
    between leaves it there, to be looked at again.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._events: list[Event] = []  # appended by the reader only, removed by take and take_next (one list call each)
        self._wake, self._woken = os.pipe()  # a byte a new event: what first() waits on
        os.set_blocking(self._wake, False)
        os.set_blocking(self._woken, False)
        threading.Thread(target=self._read, name="xla_magic-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                event = self.channel.recv()
            except OSError:
                event = Event(CLOSED, {})
            self._events.append(event)
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the waiter as well
                os.write(self._woken, b"\0")
            if event.kind in (CLOSED, BROKEN):
                return

    def first(self, timeout: float | None = None) -> Event | None:
        """The first event not yet taken, waiting for one up to ``timeout`` s (forever: None); None if none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._events:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if select.select([self._wake], [], [], left)[0]:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake, 1 << 16)  # each byte stands for an event already appended
        return self._events[0]

    def take(self, event: Event) -> None:
        """Done with ``event``: removed if it is still the first, so taking it twice takes nothing more."""
        if self._events and self._events[0] is event:
            del self._events[0]

    def take_next(self, kind: str, timeout: float) -> Event | None:
        """The first event of ``kind``, removed, waiting up to ``timeout`` s; else CLOSED or BROKEN if the channel
        ended, or None.

        Looks past the events before it: the request being answered stays first until it is answered.
        """
        deadline = time.monotonic() + timeout
        while True:
            for index, event in enumerate(list(self._events)):
                if event.kind == kind:
                    if self._events[index] is event:  # only the reader appends meanwhile
                        del self._events[index]
                    return event
                if event.kind in (CLOSED, BROKEN):
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self._wake], [], [], left)[0]:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake, 1 << 16)
