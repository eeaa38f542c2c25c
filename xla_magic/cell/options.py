"""What a cell and a pool's start ask for, as the magic parsed them: a :class:`Cell`, :class:`PoolOptions`.
Runs in the kernel and in each host's engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from xla_magic.cell import compile_cache, sharding


@dataclass(frozen=True)
class Cell:
    """One ``%%xla_spawn`` cell, as the magic parsed it."""

    source: str
    user_ns: Mapping[str, Any] = field(default_factory=dict)
    hidden: Mapping[str, Any] = field(default_factory=dict)
    devices: int | None = None
    backend: str = "auto"
    timeout: float | None = None
    fresh: bool = False  # in newly spawned ranks, not the pool's (one-shot)
    spmd: sharding.SpmdOptions | None = None
    xla_report: str | None = None
    place: dict[str, Any] | None = None  # on one of several hosts: the kernel's place (xla_magic.cell.place), not this one
    profile: bool = False  # --profile
    hang_after: float | None = None  # --hang-after (watch.py)
    compile_cache: compile_cache.CacheSetting | None = None  # --compile-cache, for new ranks; None: as the default
    run_id: int | None = None  # a background run's id, given when it began (None: the runner numbers it)
    sink: Any = None  # where its run's news goes (runs/sink.py; None: the runner's own, the session's)
    metrics: str = "mean"  # --metrics: the chart of what the ranks log(), their mean ("mean") or every rank's ("ranks")
    metrics_dir: str | None = None  # --metrics-dir: where the ranks also write what they log, for TensorBoard


@dataclass(frozen=True)
class PoolOptions:
    """What ``%xla_pool start`` / ``restart`` asks for; what is None is the default (or, restarting, as before)."""

    devices: int | None = None
    backend: str | None = None
    spmd: sharding.SpmdOptions | None = None
    xla_report: str | None = None
    hosts: list[str] | None = None  # a pool across these hosts (one engine each)
    template: str | None = None  # with hosts: the command that starts an engine on a host
    hang_after: float | None = None  # --hang-after, for the pool's cells that give none
    compile_cache: compile_cache.CacheSetting | None = None  # --compile-cache; None: the default (restart: as before)
    keep: str | None = None  # --keep NAME: a kept pool (pools/kept.py), which outlives the kernel
    keep_idle: float | None = None  # --keep-idle: seconds with no kernel attached and no cell running; None: 2 h

    def but(self, **changes: Any) -> PoolOptions:
        return replace(self, **changes)
