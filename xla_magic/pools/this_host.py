"""A pool on one host: ranks kept between cells. Runs in the kernel, and in each host's engine.

:class:`LocalPool` is the :class:`~xla_magic.pools.interface.Pool` of one host: one
kept :class:`~xla_magic.ranks.ranks.Ranks` and the :class:`~xla_magic.runs.runner.Runner`
that runs its requests. On one of several hosts, an engine holds one with
its part of the world; the kernel's pool across hosts drives those.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache, payload, sharding
from xla_magic.pools import admission
from xla_magic.ranks import policy
from xla_magic.runs import watch
from xla_magic.wire import protocol, transport
from xla_magic.ranks.launcher_client import READY_TIMEOUT, Launcher
from xla_magic.cell.options import Cell, PoolOptions
from xla_magic.pools.interface import check_names, check_rank
from xla_magic.ranks.ranks import Ranks
from xla_magic.runs.request import Request
from xla_magic.runs.runner import Runner, plan


def old_spmd_options(ranks: Ranks, devices: int | None) -> sharding.SpmdOptions:
    """A restarted SPMD pool's --mesh / --axes: its own, unless the device count changes (then the defaults)."""
    placement = ranks.placement
    if devices is not None and devices != placement.devices:
        return sharding.SpmdOptions()
    return sharding.SpmdOptions(",".join(map(str, placement.mesh or ())), ",".join(placement.axes or ()))


class LocalPool:
    """Kept ranks on this host; its state is its ranks' (``ranks.state``), which they move as its requests report."""

    def __init__(self, runner: Runner, ranks: Ranks, xla_report: str | None) -> None:
        self.runner = runner
        self.ranks = ranks
        self.xla_report = xla_report or "auto"  # the pool's --xla-report, for cells that give none
        self.options = PoolOptions(devices=ranks.devices, backend=ranks.requested_backend, xla_report=xla_report,
                                   compile_cache=ranks.cache)

    @staticmethod
    def check_options(options: PoolOptions) -> None:
        """What no pool on one host can be: nothing the start itself does not check."""

    @classmethod
    def start(cls, runner: Runner, options: PoolOptions, world: protocol.World | None = None) -> LocalPool:
        """``%xla_pool start``: ready ranks (or, with ``options.spmd``, an SPMD process) on this host."""
        ranks = cls.start_ranks(runner, options, world)
        return cls(runner, ranks, options.xla_report)

    @staticmethod
    def start_ranks(runner: Runner, options: PoolOptions, world: protocol.World | None = None,
                    launcher: Launcher | None = None, store_home: str | None = None) -> Ranks:
        """The pool's ranks, ready (on ``launcher``, a kept pool's own, with its store in ``store_home``)."""
        backend = options.backend or "auto"
        placement = plan(backend, options.devices, "%xla_pool start", options.spmd)
        ranks = Ranks(placement, policy.POOL, requested_backend=backend, workdir=runner.workdir, world=world,
                      cache=runner.cache_setting(options.compile_cache))
        ranks.hang_after = options.hang_after
        ranks.store_home = store_home
        record = runner.record(runner.history.next_run_id(), "%xla_pool start", ranks)
        start = Request(ranks, record, 0, None, workdir=runner.workdir, has_result=False, timeout=READY_TIMEOUT,
                        on_update=runner.history.notify, sink=runner.sink)
        began = time.monotonic()
        try:
            runner.launch(ranks, record, first=None, launcher=launcher)
            start.start()
            try:
                start.wait()
            finally:
                runner.tell_cache(ranks)
        except BaseException:
            ranks.stop()
            raise
        ranks.start_answered(time.monotonic() - began)
        runner.history.notify(record)  # a panel on show learns of the pool now, not at its next redraw
        return ranks

    # -- what the session reads --------------------------------------------------

    @property
    def state(self) -> str:
        return self.ranks.state

    @property
    def problem(self) -> str | None:
        return self.ranks.problem

    @property
    def pids(self) -> dict[int, int]:
        return self.ranks.pids

    @property
    def world_size(self) -> int:
        return self.ranks.size

    @property
    def one_value(self) -> bool:
        return self.ranks.one_value

    @property
    def start_seconds(self) -> float:
        return self.ranks.start_seconds or 0.0

    def label(self, rank: int) -> str:
        return self.ranks.label(rank)

    def where_now(self, everything: bool = False, with_locals: bool = False) -> dict[int, dict[str, Any]]:
        return watch.where_now(self.ranks, everything, with_locals)

    # -- requests ------------------------------------------------------------------

    def check_start(self, options: PoolOptions) -> None:
        if options.hosts is not None:
            raise UsageError("a pool is already running: %xla_pool stop it first, or %xla_pool restart")
        admission.check_usable(self.ranks)
        admission.check_fits(self.ranks, options.devices, options.backend or "auto", options.spmd)

    def run_cell(self, cell: Cell) -> Any:
        if cell.fresh:
            return self.run_fresh(cell)
        self.admit(cell)
        return self.run_admitted(cell)

    def admit(self, cell: Cell) -> None:
        """Whether the pool's ranks can take ``cell`` (the UsageError that says why not), before it is sent."""
        ranks = self.ranks
        admission.check_fits(ranks, cell.devices, cell.backend, cell.spmd)
        if cell.compile_cache is not None:
            on_cpu = ranks.placement.on_cpu
            compile_cache.refuse_for_one_cell(cell.compile_cache, ranks.cache, on_cpu, ranks.cache.describe(on_cpu))
        admission.check_usable(ranks)
        self.runner.guard_kernel(ranks)

    def run_admitted(self, cell: Cell) -> Any:
        """``cell`` in the pool's ranks, once :meth:`admit` let it in (a background run's thread runs this)."""
        ranks = self.ranks
        return self.runner.cell(ranks, cell, cell.xla_report or self.xla_report, cell.hang_after or ranks.hang_after)

    def run_fresh(self, cell: Cell, world: protocol.World | None = None) -> Any:
        """``cell`` in ranks spawned for it beside the pool's (one host's part of a fresh ``world``, if given)."""
        admission.check_fresh_allowed(self.ranks)
        return self.runner.one_shot(cell, world)

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        admission.check_usable(self.ranks)
        check_names(names, user_ns)
        values = {name: user_ns[name] for name in names}
        segments = transport.RunSegments()  # large values: mapped by every rank, unlinked once all have
        try:
            self.runner.exchange(self.ranks, protocol.PUSH, f"%xla_pool push {' '.join(names)}", None, False,
                                 values=payload.pickle_namespace(values, segments))
        finally:
            segments.sweep()

    def pull(self, name: str, rank: int | None) -> Any:
        ranks = self.ranks
        admission.check_usable(ranks)
        if rank is not None and ranks.one_value:
            raise UsageError("an SPMD pool is one process, so its value has no --rank: leave --rank out")
        check_rank(rank, ranks.devices, "the pool")
        results = self.runner.exchange(ranks, protocol.PULL, f"%xla_pool pull {name}",
                                       None if rank is None else [rank], True, name=name,
                                       results_to=ranks.results.prefix)
        if rank is not None:
            return results[rank]
        return ranks.value(results)

    # -- the pool's life -------------------------------------------------------------

    def restart(self, options: PoolOptions) -> LocalPool:
        old = self.ranks
        spmd = options.spmd
        if spmd is None and old.one_value:
            spmd = old_spmd_options(old, options.devices)
        options = options.but(devices=options.devices if options.devices is not None else old.devices,
                              backend=options.backend or old.requested_backend,
                              xla_report=options.xla_report or self.xla_report, spmd=spmd,
                              hang_after=options.hang_after or old.hang_after,
                              compile_cache=options.compile_cache or old.cache)
        plan(options.backend, options.devices, "%xla_pool restart", spmd)  # bad options keep the old pool
        self.stop()
        return LocalPool.start(self.runner, options, old.world)

    def stop(self) -> None:
        self.ranks.stop()

    def leave(self) -> None:
        """The kernel's session closes: a pool that is not kept ends with it."""
        self.stop()

    def describe(self) -> str:
        return self.ranks.describe()

    def facts(self) -> list[tuple[str, str]]:
        return [("Pool", self.ranks.describe())]

    def cache_fact(self) -> str:
        ranks = self.ranks
        return compile_cache.fact(ranks.cache, ranks.placement.on_cpu, ranks.cache_facts)
