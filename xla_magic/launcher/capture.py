"""Route everything a rank writes to that rank's own output sockets.

Runs in rank processes. Each rank owns two stream sockets that the kernel
reads directly (one for stdout, one for stderr), so bytes written before a
crash are already out of the process when it dies. File descriptors 1 and 2
are pointed at the sockets of the process's first rank (C code, subprocesses,
faulthandler); ``sys.stdout``/``sys.stderr`` route by thread, so several rank
threads in one process (the tpu launch path) each keep their own streams.

Python-level writes are batched briefly: a chunk goes out when it ends a line
and the last send is over 2 ms old, when it grows large, on ``flush()``, or
from the pump thread at most 5 ms later.
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import sys
import threading
import time

_BATCH_BYTES = 16 * 1024
_BATCH_SECONDS = 0.002
_PUMP_SECONDS = 0.005


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
    """The stdout and stderr sinks of one rank."""

    def __init__(self, rank: int, out: socket.socket, err: socket.socket) -> None:
        self.rank = rank
        self.out = Sink(out)
        self.err = Sink(err)

    def flush(self) -> None:
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
        self.pump: threading.Thread | None = None

    def current(self) -> RankStreams | None:
        return getattr(self.local, "streams", None) or self.default

    def flush_all(self) -> None:
        for streams in list(self.registered):
            streams.flush()


_router = _Router()


class RankTextStream(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` inside a rank."""

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


def attach(streams: RankStreams) -> None:
    """Make this thread write to ``streams``; set up the process on first use."""
    with _router.lock:
        _router.registered.append(streams)
        if _router.default is None:
            _router.default = streams
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(streams.out.sock.fileno(), 1)
            os.dup2(streams.err.sock.fileno(), 2)
            sys.stdout = RankTextStream("stdout", 1)
            sys.stderr = RankTextStream("stderr", 2)
            # A native crash then leaves a Python traceback on the rank's
            # stderr socket, which outlives the process.
            faulthandler.enable(file=2, all_threads=True)
            _router.pump = threading.Thread(target=_pump, name="xla_magic-output", daemon=True)
            _router.pump.start()
    _router.local.streams = streams


def flush_all() -> None:
    _router.flush_all()
