"""The memory of large results, and its reuse once the notebook drops one. Runs in the kernel.

A rank writes a large result into a segment under /dev/shm, and the kernel
maps it and unlinks it (transport.adopt): the result's memory is then the
kernel's alone, and goes when the notebook's last reference to it goes.
Most of what a fresh segment costs is not the copy but the memory itself:
tmpfs allocates, faults and later frees every 4 KiB page of it. So the
kernel keeps a descriptor of each segment it adopted (at most ``KEPT_MAX``
at a time). Once the notebook drops the result, its segment is *free*: a
request that may bring results lends each rank the free segments that rank
wrote (their descriptors go over the rank's socket, SCM_RIGHTS), the rank
writes its next large result over the same pages where one fits
(transport.SegmentWriter), and the kernel maps the segment again.

A free segment is in neither the kernel's memory nor /dev/shm's names, but
the host still holds its pages, so it is kept briefly: a thread of the
kernel closes it ``hold`` seconds after the notebook dropped its result
(``XLA_MAGIC_RESULT_REUSE``, default 10; 0 turns reuse off), unless a
result was written over it by then; the kernel's exit closes the rest. A
segment is only ever lent while nothing of the notebook's maps it, and the
rank closes its descriptor before it answers. (A child the rank forks while
a request runs, a DataLoader's worker, inherits the lent descriptors and
holds those pages until it exits; it never writes to them.)
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

HOLD = 10  # seconds a free segment waits to be reused, unless XLA_MAGIC_RESULT_REUSE says otherwise
KEPT_MAX = 256  # descriptors kept at once: results beyond these are not reused (their memory goes as before)
LEND_MAX = 8  # segments lent to one rank for one request


_told_bad: list[str] = []  # a bad XLA_MAGIC_RESULT_REUSE, once said


def hold_seconds() -> float:
    """How long a free segment is kept; 0 keeps none, and so does a bad value, said once."""
    text = os.environ.get("XLA_MAGIC_RESULT_REUSE", "").strip()
    try:
        seconds = float(text) if text else HOLD
        if seconds != seconds or seconds < 0:  # NaN or negative
            raise ValueError(text)
        return seconds
    except ValueError:
        if text not in _told_bad:
            _told_bad.append(text)
            print(f"xla_magic: XLA_MAGIC_RESULT_REUSE={text!r} is not a number of seconds, so the memory of "
                  f"results the notebook drops is freed at once; set it to 0 (off) or to seconds such as 10",
                  file=sys.stderr)
        return 0.0


@dataclass(eq=False)
class Segment:
    """A result segment the kernel adopted: its descriptor, and the rank that wrote it."""

    fd: int
    rank: int
    number: int = field(default_factory=itertools.count().__next__)
    freed_at: float = 0.0


class ResultMemory:
    """Every kept segment of this kernel: in use (mapped by a result), free, or lent to a rank."""

    def __init__(self) -> None:
        # Reentrant: a finalizer (_freed) may run in any thread at any allocation, this class's own included.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._kept = 0  # segments with a descriptor here, whatever their state
        self._free: list[Segment] = []
        self._lent: dict[int, Segment] = {}
        self._janitor: threading.Thread | None = None

    # -- adopting ----------------------------------------------------------

    def map(self, fd: int, rank: int | None) -> mmap.mmap:
        """The notebook's mapping of ``fd``; the descriptor is kept for reuse (or closed) here."""
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            keep = rank is not None and self._kept < KEPT_MAX and hold_seconds() > 0
            if keep:
                self._kept += 1
        if not keep:
            os.close(fd)
            return mapping
        segment = Segment(fd, rank)
        finalizer = weakref.finalize(mapping, self._freed, segment)
        finalizer.atexit = False
        return mapping

    def claim(self, number: int) -> tuple[int, int]:
        """A lent segment the rank wrote a result into: its descriptor (now the result's) and its rank."""
        with self._lock:
            segment = self._lent.pop(number, None)
            if segment is None:
                raise ValueError(f"no segment {number} was lent for this result")
            self._kept -= 1  # counted again when mapped
        return segment.fd, segment.rank

    # -- lending -----------------------------------------------------------

    def lend(self, rank: int) -> list[Segment]:
        """The free segments ``rank`` wrote, taken out of the free list for one request (none with reuse off)."""
        if hold_seconds() <= 0:
            return []
        with self._lock:
            mine = [segment for segment in self._free if segment.rank == rank][:LEND_MAX]
            for segment in mine:
                self._free.remove(segment)
                self._lent[segment.number] = segment
        return mine

    def take_back(self, segments: list[Segment]) -> None:
        """The request is over: lent segments its ranks did not write over are free again, as long as they were."""
        with self._lock:
            self._free += [segment for segment in segments if self._lent.pop(segment.number, None) is not None]
            self._changed.notify()

    # -- releasing ---------------------------------------------------------

    def _freed(self, segment: Segment) -> None:
        """The notebook dropped the result mapped from ``segment`` (a finalizer: any thread, any moment)."""
        segment.freed_at = time.monotonic()
        with self._lock:
            self._free.append(segment)
            if self._janitor is None:
                self._janitor = threading.Thread(target=self._expire, name="xla_magic-result-memory", daemon=True)
                self._janitor.start()
            self._changed.notify()

    def _expire(self) -> None:
        """Close free segments once they were free for ``hold`` seconds."""
        with self._lock:
            while True:
                hold = hold_seconds()
                now = time.monotonic()
                expired = [segment for segment in self._free if now - segment.freed_at >= hold]
                for segment in expired:
                    self._free.remove(segment)
                    os.close(segment.fd)
                self._kept -= len(expired)
                if self._free:
                    self._changed.wait(min(segment.freed_at for segment in self._free) + hold - now)
                else:
                    self._changed.wait()


MEMORY = ResultMemory()
