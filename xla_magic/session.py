"""The per-kernel session: what the extension started in one kernel. Runs in the kernel.

It holds three things, each the one owner of its part: the history (the
recent runs and who hears of them: history.py), this host's runner (the
launcher and the private directory: runner.py) and at most one pool. A
cell goes to the pool while one runs (unless ``--fresh``), else to ranks
spawned for it alone. The session never asks which kind of pool it holds
(:class:`~xla_magic.pools.interface.Pool`: on this host, or across hosts); only
``%xla_pool start`` chooses, from its options, in :meth:`Session.start_pool`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from IPython.core.error import UsageError

from xla_magic import sharding
from xla_magic.run import watch
from xla_magic.compile_cache import CacheSetting
from xla_magic.history import History
from xla_magic.pools.across_hosts import HostsPool
from xla_magic.pools.this_host import LocalPool
from xla_magic.pools.interface import Cell, Pool, PoolOptions
from xla_magic.record import RunRecord
from xla_magic.runner import Runner, plan, refuse_if_kernel_holds_devices

__all__ = ["Session", "plan", "refuse_if_kernel_holds_devices"]


class Session:
    """Everything the extension started in one kernel."""

    def __init__(self) -> None:
        self.runs = History()
        self.host = Runner(self.runs)
        self.pool: Pool | None = None  # while a pool runs (or is broken)

    # -- what the panel and the magics read back -----------------------------

    @property
    def history(self) -> list[RunRecord]:
        return self.runs.records

    @property
    def listeners(self) -> list[Callable[[RunRecord], None]]:
        return self.runs.listeners

    @property
    def last_cell(self) -> RunRecord | None:
        return self.runs.last_cell

    @property
    def last_profiled(self) -> RunRecord | None:
        return self.runs.last_profiled

    @property
    def one_value(self) -> bool:
        """Whether the last run's value was one value (SPMD), not a list by rank."""
        return bool(self.runs.records) and self.runs.records[-1].one_value

    # -- cells -------------------------------------------------------------

    def run_cell(
        self,
        cell: str,
        devices: int | None,
        backend: str,
        timeout: float | None,
        fresh: bool,
        user_ns: Mapping[str, Any],
        hidden: Mapping[str, Any],
        live_lines: bool = False,
        spmd: sharding.SpmdOptions | None = None,
        xla_report: str | None = None,
        profile: bool = False,
        hang_after: float | None = None,
        compile_cache: CacheSetting | None = None,
        metrics: str = "mean",
        metrics_dir: str | None = None,
    ) -> Any:
        """A ``%%xla_spawn`` cell: in the pool while one runs (``fresh``: in new ranks where it runs), else in new ranks.

        Its value: the list by rank, or (SPMD) the one value.
        """
        request = Cell(cell, user_ns, hidden, devices, backend, timeout, fresh, live_lines, spmd, xla_report,
                       profile=profile, hang_after=hang_after, compile_cache=compile_cache, metrics=metrics,
                       metrics_dir=metrics_dir)
        pool = self.current_pool()
        return self.host.one_shot(request) if pool is None else pool.run_cell(request)

    # -- the pool ------------------------------------------------------------

    def current_pool(self) -> Pool | None:
        """The session's pool, unless there is none or it was stopped."""
        pool = self.pool
        return None if pool is None or pool.state == "stopped" else pool

    def start_pool(self, options: PoolOptions) -> Pool:
        """``%xla_pool start``: a pool (across ``options.hosts``, if given), or the one already running."""
        kind: type[LocalPool] | type[HostsPool] = HostsPool if options.hosts is not None else LocalPool
        kind.check_options(options)
        running = self.current_pool()
        if running is not None:
            running.check_start(options)
            print(f"the pool is already running: {running.describe()}")
            return running
        pool: Pool = kind.start(self.host, options)
        self.pool = pool
        print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
        return pool

    def restart_pool(self, options: PoolOptions) -> Pool:
        """Fresh ranks for the pool: what is not given is as before (an SPMD pool stays SPMD, with its mesh)."""
        old = self.current_pool()
        if old is None or options.hosts is not None:
            self.stop_pool()
            return self.start_pool(options)
        self.pool = None
        try:
            pool = old.restart(options)
        except BaseException:
            self.pool = old if old.state != "stopped" else None  # bad options keep the old pool
            raise
        self.pool = pool
        print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
        return pool

    def stop_pool(self) -> bool:
        """``%xla_pool stop`` and the status panel's Stop pool: True when there was a pool to stop."""
        pool, self.pool = self.current_pool(), None
        self.release_post_mortem("the pool was stopped")
        if pool is None:
            return False
        pool.stop()
        return True

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        """``%xla_pool push NAME...``: the kernel's values into every rank's namespace."""
        self._usable_pool().push(names, user_ns)

    def pull(self, name: str, rank: int | None) -> Any:
        """``%xla_pool pull NAME``: every rank's value (a list by rank), or rank ``rank``'s."""
        return self._usable_pool().pull(name, rank)

    def stacks(self, rank: int | None, everything: bool, with_locals: bool = False) -> list[str]:
        """``%xla_stacks``: where the ranks were when the last cell was stuck or stopped; a pool's ranks now, on
        this host or across hosts (``with_locals``: each cell frame's names too, where the ranks can say)."""
        return watch.report(self.history, self.current_pool(), rank, everything, with_locals)

    # -- debugging a rank (post_mortem.py: this host's runner keeps what %debug opens) ----------------

    @property
    def post_mortem(self) -> Any:
        return self.host.post_mortem

    def debug(self, rank: int | None = None, error: Any = None) -> None:
        """``%debug`` / ``%xla_debug``: pdb in the last failed cell's frame on a rank that failed (runner.debug)."""
        self.host.debug(rank, error)

    def release_post_mortem(self, why: str = "it was let go") -> None:
        self.host.release_post_mortem(why)

    def describe_pool(self) -> str:
        pool = self.current_pool()
        if pool is None:
            return ("no pool is running. %xla_pool start [--devices N] starts one; %%xla_spawn cells "
                    "then keep their ranks, namespaces and compiled graphs between cells.")
        return f"pool {pool.describe()}"

    def _usable_pool(self) -> Pool:
        pool = self.current_pool()
        if pool is None:
            raise UsageError("no pool is running; start one with %xla_pool start [--devices N]")
        return pool

    def close(self) -> None:
        """Stop the pool and the launcher, and remove the session's directory."""
        try:
            pool, self.pool = self.pool, None
            if pool is not None:
                pool.stop()
        finally:
            self.host.close()
