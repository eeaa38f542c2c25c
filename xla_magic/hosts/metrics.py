"""What the ranks of a pool across hosts log(), from each host to the kernel's one chart. Runs in each host's
engine (:class:`Publisher`) and in the kernel (:class:`Taker`).

On one host the ranks' METRICS batches (launcher/metrics.py) land in the
cell's record and the kernel draws them (metrics_view.py). On several hosts
each host's runner keeps its own ranks' rows in its own record and draws
nothing (one host's part of a world). Its engine sends them on, named by
their global rank, as ipyparallel data of the running call
(``publish_data``: the engine's IOPub, the connection its output already
takes; no listener of ours), at most every FLUSH_SECONDS and once more when
the cell ends: what travels is the rows the ranks' batches already hold.
Each send has a key of its own (KEY and its number), since a call's data
keeps only the last value of a key; the kernel takes the sends in order,
drops them from the call's data once taken, and adds their rows to the
kernel's record, where the chart and ``%xla_metrics`` read them as on one
host. A call's data all arrives before its output ends, which the kernel
waits for before the cell's end (hosts/request.py).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from xla_magic.runs.record import RunRecord

KEY = "xla_magic_metrics"  # + " N": a host's Nth send of rows in its call's ipyparallel data
FLUSH_SECONDS = 0.2  # the longest a host holds rows its ranks sent
NO_METRICS_DIR = ("--metrics-dir writes each rank's TensorBoard files where it runs, which a pool across hosts does "
                  "not do yet; leave it out: the chart and %xla_metrics have every rank's values, and "
                  "torch.utils.tensorboard's SummaryWriter writes them where you choose")


class Publisher:
    """A listener of a host's runs (its History): the running cell's new rows, sent on to the kernel.

    ``global_rank(record, local)``: the global rank of the host's local rank in ``record``."""

    def __init__(self, global_rank: Callable[[RunRecord, int], int],
                 send: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.global_rank = global_rank
        self.send = send or _publish
        self.record: RunRecord | None = None
        self.sent_rows = 0  # rows of the record sent so far
        self.sends = 0  # sends for this record (its call's data keys)
        self.sent_at = 0.0

    def notice(self, record: RunRecord) -> None:
        """Send the record's rows not sent yet, at most every FLUSH_SECONDS while it runs. Never raises."""
        if record.outcome == "running" and time.monotonic() - self.sent_at < FLUSH_SECONDS:
            return
        self.flush(record)

    def flush(self, record: RunRecord | None) -> None:
        """Every row of ``record`` not sent yet, now (the call's end: nothing is left on the host)."""
        if record is None or not record.metrics:
            return
        if record is not self.record:
            self.record, self.sent_rows, self.sends = record, 0, 0
        rows = record.metrics[self.sent_rows:]
        if not rows:
            return
        try:
            ranks = {local: self.global_rank(record, local) for local in {row[0] for row in rows}}
            self.send({f"{KEY} {self.sends}": [(ranks[local], *rest) for local, *rest in rows]})
        except Exception:  # noqa: BLE001 - not in an engine, or the data cannot travel: the kernel's chart misses them
            return
        self.sent_rows += len(rows)
        self.sends += 1
        self.sent_at = time.monotonic()


def _publish(data: dict[str, Any]) -> None:
    from ipyparallel.datapub import publish_data

    publish_data(data)


class Taker:
    """In the kernel, for one request to every host: each host's sends into ``record``, whose listeners (the
    cell's chart: notebook/cell_view.py) draw them (None: a request that is no cell takes nothing)."""

    def __init__(self, calls: list[Any], record: RunRecord | None, history: Any) -> None:
        self.calls = calls
        self.record = record
        self.history = history
        self.next = [0] * len(calls)  # each host's next send

    def take(self) -> None:
        """The rows every host sent since the last look, in each host's order; the chart redraws when due."""
        if self.record is None:
            return
        came = False
        for index, call in enumerate(self.calls):
            data = getattr(call, "data", None) or {}
            while f"{KEY} {self.next[index]}" in data:
                self.record.metrics += data.pop(f"{KEY} {self.next[index]}")
                self.next[index] += 1
                came = True
        if came:
            self.history.notify(self.record)

    def close(self) -> None:
        """The cell is over (its hosts' output, and so their data, all came): the last rows taken."""
        self.take()
