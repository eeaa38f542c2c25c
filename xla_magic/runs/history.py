"""The recent runs of one kernel (or of one host's engine), and who hears of them. Runs in the kernel, and in
each host's engine.

The one owner of what the status panel, ``%xla_report``, ``%xla_profile``
and ``%xla_stacks`` read back: the runs' records in order, their ids, the
last cell and the last profiled cell, and the listeners told of every change
to a running record (the panel, a profile's reader, a host's news to the
kernel). Whoever runs a request writes its record here; nothing else keeps one.
"""

from __future__ import annotations

from typing import Callable

from xla_magic.runs.record import RunRecord

KEPT = 20  # records kept: the panel's history


class History:
    def __init__(self) -> None:
        self.records: list[RunRecord] = []
        self.listeners: list[Callable[[RunRecord], None]] = []
        self.run_count = 0
        self.last_cell: RunRecord | None = None  # the last %%xla_spawn cell on this host, for %xla_report
        self.last_profiled: RunRecord | None = None  # the last --profile cell, for %xla_profile

    def next_run_id(self) -> int:
        self.run_count += 1
        return self.run_count

    def cell_began(self, record: RunRecord, profiled: bool = False) -> None:
        """A %%xla_spawn cell's record: %xla_report shows it next (and %xla_profile, if ``profiled``)."""
        self.last_cell = record
        if profiled:
            self.last_profiled = record

    def remember(self, record: RunRecord) -> None:
        """Keep the record in the recent runs."""
        self.records = (self.records + [record])[-KEPT:]

    def notify(self, record: RunRecord) -> None:
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a broken display must never break a run
                pass
