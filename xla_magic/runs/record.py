"""What the status panel shows of a request and of each rank in it. Runs in the kernel.

Written by the request that runs (request.py), read by ``%xla_status``
(notebook/status.py) and kept in the session's recent history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    state: str = "starting"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    lines: int = 0
    last_line: str = ""
    pid: int | None = None
    memory: dict[str, Any] | None = None
    processes: list[int] = field(default_factory=list)  # live processes below the rank, as of its last DONE
    ordinal: int | None = None  # one host's rank of several: its global rank (torch_xla's ordinal), once it said
    # What XLA did in the rank during the cell (launcher/xla_account.py), once it ended;
    # rank threads of one process share one account, which names them all.
    xla: dict[str, Any] | None = None
    where: str = ""  # what the rank was doing when last asked (stacks.summary), while the cell runs
    # Where its process's profile of the cell is (--profile; launcher/profiling.py), shared like ``xla``.
    profile: dict[str, Any] | None = None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started


@dataclass
class RunRecord:
    """What the status panel shows of a request."""

    run_id: int
    cell: str
    backend: str
    devices: int
    mesh: str = ""  # an SPMD run's mesh, as in "data=4 × model=2"; empty for one rank per device
    one_value: bool = False  # its value is one value (the SPMD process's), not a list by rank
    started: float = field(default_factory=time.time)
    duration: float | None = None
    outcome: str = "running"
    ranks: dict[int, RankState] = field(default_factory=dict)
    # Set from any thread (the status panel's Interrupt button); the request
    # stops as if the notebook's stop button had been pressed.
    interrupt_requested: bool = False
    xla_report: str = "auto"  # --xla-report: auto, full or off
    # Where each rank was, as its sampler last answered (launcher/stacks.py), and when that was
    # (at the watchdog's warning, when interrupted ...); the watchdog's line, if it spoke.
    stacks: dict[int, dict[str, Any]] = field(default_factory=dict)
    stacks_when: str = ""
    hang: str | None = None
    # Since when (time.monotonic, on the host that asked) each rank has been where its last answer put it.
    arrived: dict[int, float] = field(default_factory=dict)
    profile: str = ""  # --profile: the directory its ranks' traces went to; empty when not profiled
    # What its cells logged (log(): launcher/metrics.py), in the order it came: (rank, step, name, value, time).
    # %xla_metrics and the chart (metrics_view.py) read it; a run's log on disk would keep it with its output.
    metrics: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    # Its last complete checkpoint (checkpoints(DIR) in its cell: launcher/checkpoints.py): step, path, time, size.
    checkpoint: dict[str, Any] | None = None

    def take(self, kind: str, fact: dict[str, Any]) -> None:
        """A rank process's fact about the cell, for every rank it covers: its account of what XLA did
        (protocol.XLA, into ``RankState.xla``) or where its profile is (protocol.PROFILE, ``RankState.profile``)."""
        attribute = {"xla": "xla", "profile": "profile"}[kind]
        for rank in fact.get("ranks", ()):
            if rank in self.ranks:
                setattr(self.ranks[rank], attribute, fact)
