"""Logged device values read on a thread of the rank's own, so that the cell never waits for a read. Runs in a rank.

A read of an XLA tensor waits until the graph that computed it has run. A
sync launches its graph without waiting for the one before, so the host may
run ahead of the device by more than a step, and a value logged two syncs
ago may still be computing: read on the rank's main thread, it stopped the
cell until the device caught up, a host sync in effect (one process of the
CPU simulation: 255 ms, for a 250 ms graph launched after the value's own).
In a 4-rank pool of the CPU simulation on 2 shared cores a read stopped the
cell about 10 ms, and the ranks waiting at each other's all-reduce made it
every rank's. Here the wait and the transfer happen on a reader thread, with
the GIL released (torch_xla releases it for both), while the main thread
goes on.

What is handed over was checked on the main thread: nothing changed it after
it was logged, and its graph has run, so reading it runs no graph. The reader
checks each value's version again just before it reads, which leaves a
window of microseconds in which a value changed in place could be read; a
read that fails is dropped, and the rank says so once.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any, Callable

Row = tuple  # (step, name, value, time)


class Reader:
    """One rank's reads of held device values, in order, on one daemon thread started at the first read."""

    def __init__(self, read: Callable[[list[Any]], list[Row]]) -> None:
        self.read = read  # held values -> rows, one transfer
        self.queue: "queue.SimpleQueue[list[Any] | None]" = queue.SimpleQueue()
        self.rows: list[Row] = []
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.pending = 0  # batches handed over and not yet read
        self.thread: threading.Thread | None = None
        self.told_failed = False

    def submit(self, held: list[Any]) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._serve, name="xla_magic log reader", daemon=True)
            self.thread.start()
        with self.lock:
            self.pending += 1
        self.queue.put(held)

    def take(self) -> list[Row]:
        """The rows read so far (and no longer kept here)."""
        with self.lock:
            rows, self.rows = self.rows, []
        return rows

    def drain(self) -> list[Row]:
        """Every row handed over, once read (the end of a cell: what it logged is all sent)."""
        with self.lock:
            while self.pending:
                self.done.wait(0.1)  # in turns: an interrupt sent to a rank's thread lands between them
            rows, self.rows = self.rows, []
        return rows

    def _serve(self) -> None:
        while True:
            held = self.queue.get()
            rows: list[Row] = []
            try:
                held = [entry for entry in held if entry[2]._version == entry[4]]
                if held:
                    rows = self.read(held)
            except Exception as error:  # a value changed in place in the last moment (its buffer donated)
                if not self.told_failed:
                    self.told_failed = True
                    print(f"log: {len(held)} logged value(s) could not be read ({error}) and are not drawn; "
                          f"log new tensors, not ones the cell changes in place", file=sys.stderr)
            with self.lock:
                self.rows += rows
                self.pending -= 1
                self.done.notify_all()
