"""Route everything a rank writes to that rank's own output sockets. Runs in rank processes.

Each rank owns two stream sockets that the kernel reads directly (one for
stdout, one for stderr), so bytes written before a crash are already out of
the process when it dies. File descriptors 1 and 2 are pointed at the
sockets of the process's first rank (C code, subprocesses, faulthandler).

- A rank that is its process's main thread owns the process (the cpu
  backend, one-shot and pool; a one-device tpu run): ``sys.stdout`` and
  ``sys.stderr`` are C-buffered text streams straight onto its sockets
  (:class:`OwnStreams`), so a print costs what it costs in plain Python.
  Lines go out one by one while they are sparse (a line before a crash is
  already out of the process); when they come in a burst, a pump thread
  sends what is buffered every few milliseconds.
- Rank threads (the tpu launch path) share their process, so
  ``sys.stdout``/``sys.stderr`` route by thread to each rank's
  :class:`Sink`, which batches briefly: a chunk goes out when it ends a line
  and the last send is over 2 ms old, when it grows large, on ``flush()``,
  or from the pump thread at most 5 ms later.
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import sys
import threading
import time
from typing import Any

# Rank threads (Sink)
_BATCH_BYTES = 16 * 1024
_BATCH_SECONDS = 0.002
_PUMP_SECONDS = 0.005
# A rank that owns its process (OwnStreams)
BURST_SECONDS = 0.002  # lines closer together than this are a burst
OWN_PUMP_SECONDS = 0.003  # during a burst, how often the buffered output is sent


# --- a rank that owns its process ------------------------------------------------


class _SocketWriter(io.RawIOBase):
    """The raw layer under an own stream: the rank's socket, noticing bursts."""

    def __init__(self, sock: socket.socket, fd: int, streams: "OwnStreams") -> None:
        super().__init__()
        self._sock = sock
        self._fd = fd
        self._streams = streams
        self._last = 0.0
        self.sent = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd  # fd 1 or 2, which point at the same socket

    def isatty(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        size = len(data)
        try:
            self._sock.sendall(data)
        except OSError:
            pass  # the kernel is gone; this rank is about to be ended too
        self.sent += size
        now = time.monotonic()
        if now - self._last < BURST_SECONDS:
            self._streams.burst()
        self._last = now
        return size


class OwnStreams:
    """``sys.stdout`` / ``sys.stderr`` of a one-rank process, and their pump.

    The streams are line-buffered until lines come in a burst; then the pump
    turns line buffering off and sends what is buffered every
    OWN_PUMP_SECONDS, until a round finds nothing to send.
    """

    def __init__(self, out: socket.socket, err: socket.socket) -> None:
        self._wake = threading.Event()
        self._writers = [_SocketWriter(out, 1, self), _SocketWriter(err, 2, self)]
        self.streams = [
            io.TextIOWrapper(io.BufferedWriter(writer, 1 << 16), encoding="utf-8", errors="replace",
                             line_buffering=True)
            for writer in self._writers
        ]
        sys.stdout, sys.stderr = self.streams
        threading.Thread(target=self._run, name="xla_magic-output", daemon=True).start()

    def burst(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        for stream in self.streams:
            try:
                stream.flush()
            except ValueError:  # a cell closed it; nothing more can come through it
                pass

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._line_buffering(False)
            while True:
                time.sleep(OWN_PUMP_SECONDS)
                before = sum(writer.sent for writer in self._writers)
                self.flush()
                if sum(writer.sent for writer in self._writers) == before:
                    break
            self._line_buffering(True)
            self._wake.clear()

    def _line_buffering(self, on: bool) -> None:
        for stream in self.streams:
            try:
                stream.reconfigure(line_buffering=on)
            except ValueError:
                pass


# --- rank threads ------------------------------------------------------------------


class Sink:
    """Buffered bytes bound for one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._parts: list[bytes] = []
        self._size = 0
        self._last_send = 0.0

    def write(self, data: bytes) -> bool:
        """Queue bytes; True when some are left waiting for the pump."""
        with self._lock:
            self._parts.append(data)
            self._size += len(data)
            if self._size >= _BATCH_BYTES or (
                b"\n" in data and time.monotonic() - self._last_send > _BATCH_SECONDS
            ):
                self._send_locked()
            return self._size > 0

    def flush(self) -> None:
        with self._lock:
            self._send_locked()

    def _send_locked(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts.clear()
        self._size = 0
        self._last_send = time.monotonic()
        try:
            self.sock.sendall(data)
        except OSError:
            pass  # the kernel is gone; this process is about to be ended too


class RankStreams:
    """Where one rank's output goes: its own streams, or its sinks when it is a thread."""

    def __init__(self, rank: int, out: socket.socket, err: socket.socket) -> None:
        self.rank = rank
        self.out = Sink(out)
        self.err = Sink(err)
        self.own: OwnStreams | None = None

    def flush(self) -> None:
        if self.own is not None:
            self.own.flush()
        self.out.flush()
        self.err.flush()


class _Router:
    """Which rank's streams the current thread writes to."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.default: RankStreams | None = None
        self.registered: list[RankStreams] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()

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
        sink = streams.out if self._which == "stdout" else streams.err
        if sink.write(text.encode("utf-8", "replace")) and not _router.wake.is_set():
            _router.wake.set()
        return len(text)

    def flush(self) -> None:
        streams = _router.current()
        if streams is not None:
            (streams.out if self._which == "stdout" else streams.err).flush()

    @property
    def buffer(self):  # some libraries write bytes to sys.stdout.buffer
        return _BinaryView(self)


class _BinaryView(io.RawIOBase):
    def __init__(self, text: RankTextStream) -> None:
        self._text = text

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._text.write(bytes(data).decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._text.flush()


def _pump() -> None:
    while True:
        _router.wake.wait()
        time.sleep(_PUMP_SECONDS)
        _router.wake.clear()
        _router.flush_all()


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
    if threading.current_thread() is threading.main_thread():
        streams.own = OwnStreams(streams.out.sock, streams.err.sock)  # the only rank of its process
        return
    sys.stdout = RankTextStream("stdout", 1)
    sys.stderr = RankTextStream("stderr", 2)
    threading.Thread(target=_pump, name="xla_magic-output", daemon=True).start()


def flush_all() -> None:
    _router.flush_all()
