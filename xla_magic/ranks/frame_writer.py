"""Writing one request frame on a rank's socket, knowing exactly how much went when an interrupt stops it. Runs in the kernel.

Runs in the kernel. Python raises KeyboardInterrupt in the main thread at the
end of a call, so an interrupt that lands just as ``sock.send`` returns loses
the count it returned: the kernel could not tell a rank holding part of a
request (its stream is broken) from one holding none (nothing to stop).

A frame the socket's free buffer takes whole is sent at once. A larger one
is written by a thread of its own, where no signal handler ever runs, and the
main thread only waits for it; an interrupt there stops the thread between
two non-blocking writes, and what went is then exact.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

SMALL_FRAME = 1 << 15  # an idle rank's socket takes this much whole (its buffer holds about 200 KB)


class Unsent(Exception):
    """Part of a frame did not go; ``sent`` bytes of it did (0: none; None: not known, see write_frame)."""

    def __init__(self, sent: int | None, cause: BaseException) -> None:
        super().__init__(f"{sent} bytes sent")
        self.sent = sent
        self.cause = cause


def write_frame(sock: socket.socket, frame: bytes, timeout: float) -> None:
    """Write ``frame`` whole on the non-blocking ``sock`` within ``timeout`` s.

    Whatever stops it (an interrupt, the rank gone, the time out) is raised as
    :class:`Unsent` from that cause, with the exact count of bytes that went;
    for a small frame an interrupt just after its one write leaves the count
    unknown, and ``sent`` is then None.
    """
    already = 0
    if len(frame) <= SMALL_FRAME:
        sent: int | None = None
        try:
            sent = sock.send(frame)
        except BlockingIOError:
            sent = 0
        except BaseException as exc:
            raise Unsent(sent, exc) from exc
        if sent == len(frame):
            return
        frame, already = frame[sent:], sent
    writer = _Writer(sock, frame, timeout)
    try:
        writer.start()
        writer.join()  # interruptible: a lock's wait
    except BaseException as exc:
        writer.stop()
        raise Unsent(already + writer.sent, exc) from exc
    finally:
        writer.close()
    if writer.error is not None:
        raise Unsent(already + writer.sent, writer.error) from writer.error


class _Writer(threading.Thread):
    """Writes a frame in non-blocking steps until it has gone, the time is up, or :meth:`stop`."""

    def __init__(self, sock: socket.socket, frame: bytes, timeout: float) -> None:
        super().__init__(name="xla_magic-frame-writer", daemon=True)
        self.sock = sock
        self.frame = memoryview(frame)
        self.deadline = time.monotonic() + timeout
        self.sent = 0  # written by this thread only
        self.error: OSError | None = None
        self._woken, self._wake = os.pipe()

    def run(self) -> None:
        try:
            while self.sent < len(self.frame):
                try:
                    self.sent += self.sock.send(self.frame[self.sent:])
                    continue
                except BlockingIOError:
                    pass
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the rank took none of its request for the whole wait")
                woken, _writable, _ = select.select([self._woken], [self.sock], [], left)
                if woken:
                    return
        except OSError as exc:
            self.error = exc

    def stop(self) -> None:
        """Stop between two writes and wait for that (a few microseconds); a second interrupt is waited through."""
        os.write(self._wake, b"\0")
        while self.ident is not None:
            try:
                self.join()
                return
            except KeyboardInterrupt:
                continue

    def close(self) -> None:
        os.close(self._wake)
        os.close(self._woken)
