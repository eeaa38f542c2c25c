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

import dataclasses
from typing import Any, Callable, Mapping

from IPython.core.error import UsageError

from xla_magic.cell import payload, ranks_python, sharding
from xla_magic.runs import watch
from xla_magic.cell.compile_cache import CacheSetting
from xla_magic.runs.history import History
from xla_magic.pools import admission
from xla_magic.hosts.pool import HostsPool
from xla_magic.pools import kept
from xla_magic.pools.this_host import LocalPool
from xla_magic.cell.options import Cell, PoolOptions
from xla_magic.pools.interface import Pool
from xla_magic.runs.record import RunRecord
from xla_magic.runs.runner import Runner, plan, refuse_if_kernel_holds_devices
from xla_magic.runs.background import BackgroundRun, Runs
from xla_magic.runs.sink import Sink

__all__ = ["Session", "plan", "refuse_if_kernel_holds_devices"]


class Session:
    """Everything the extension started in one kernel."""

    def __init__(self, sink: Sink | None = None) -> None:
        self.runs = History()
        self.host = Runner(self.runs, sink)  # its sink: where what runs say is shown (the notebook's, when loaded)
        self.pool: Pool | None = None  # while a pool runs (or is broken)
        self.background = Runs(self)  # %%xla_spawn --bg runs (runs/background.py)

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
        spmd: sharding.SpmdOptions | None = None,
        xla_report: str | None = None,
        profile: bool = False,
        hang_after: float | None = None,
        compile_cache: CacheSetting | None = None,
        after: bool = False,
        background: Any = None,
        metrics: str = "mean",
        metrics_dir: str | None = None,
    ) -> Any:
        """A ``%%xla_spawn`` cell: in the pool while one runs (``fresh``: in new ranks where it runs), else in new ranks.

        Its value: the list by rank, or (SPMD) the one value. A pool that a background run holds refuses it at
        once, unless ``after``: then it waits for the pool first. ``background`` (the shell): it runs in the
        background, and its value is the run's handle.
        """
        if metrics_dir is not None:  # before anything starts: the ranks would write nothing
            launcher = self.host.launcher
            ranks_python.refuse_metrics_dir_without_tensorboard(launcher.python if launcher is not None else None)
        request = Cell(cell, user_ns, hidden, devices, backend, timeout, fresh, spmd, xla_report,
                       profile=profile, hang_after=hang_after, compile_cache=compile_cache, metrics=metrics,
                       metrics_dir=metrics_dir)
        pool = self.current_pool()
        if after and (pool is None or fresh):
            raise UsageError("--after waits for the pool's background run, then runs the cell in the pool: "
                             + ("no pool is running, so there is nothing to wait for; leave --after out"
                                if pool is None else "leave out --fresh (which runs the cell in new ranks at once)"))
        if pool is not None and not fresh:
            if after:
                self.background.wait_for_pool(pool)
                pool = self.current_pool()
            else:
                self.background.check_free(pool, "%%xla_spawn")
        if pool is None:
            kept.refuse_if_held(backend, devices, "%%xla_spawn")
        if background is not None:
            return self._in_background(request, pool, background)
        return self.host.one_shot(request) if pool is None else pool.run_cell(request)

    def _in_background(self, request: Cell, pool: Pool | None, shell: Any) -> BackgroundRun:
        """``%%xla_spawn --bg``: checked here and now, then run by a thread of the kernel (runs/background.py)."""
        if pool is not None and not isinstance(pool, LocalPool):
            raise UsageError("--bg runs a cell in a pool on this host or in new ranks; a pool across hosts runs its "
                             "cells in the foreground: leave --bg out")
        payload.analyse(request.source, "<xla_spawn cell>")  # its SyntaxError now, under this cell
        held = pool if pool is not None and not request.fresh else None
        if held is not None:
            held.admit(request)
            size = held.world_size
        else:
            if pool is not None:
                admission.check_fresh_allowed(pool.ranks)
            placement = plan(request.backend, request.devices, "%%xla_spawn", request.spmd)
            size = 1 if request.spmd is not None else placement.devices
        run_id = self.runs.next_run_id()

        def work(sink: Any) -> Any:
            cell = dataclasses.replace(request, run_id=run_id, sink=sink)
            return held.run_admitted(cell) if held is not None else self.host.one_shot(cell)

        return self.background.start(request.source, held, size, work, shell, run_id)

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
        if options.hosts is None:
            kept.refuse_if_held(options.backend or "auto", options.devices, "%xla_pool start")
        pool: Pool = kept.KeptPool.start_kept(self.host, options) if options.keep is not None and \
            options.hosts is None else kind.start(self.host, options)
        self.pool = pool
        print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
        return pool

    def attach_pool(self, name: str, steal: bool) -> Pool:
        """``%xla_pool attach NAME``: drive a kept pool's ranks from this kernel (its old names, its graphs)."""
        running = self.current_pool()
        if running is not None:
            if isinstance(running, kept.KeptPool) and running.name == name:
                print(f"already attached: {running.describe()}")
                return running
            raise UsageError(f"a pool is running in this kernel ({running.describe()}): %xla_pool stop it first, "
                             f"then %xla_pool attach {name}")
        pool = kept.KeptPool.attach(self.host, name, steal)
        self.pool = pool
        print(f"attached: {pool.describe()}")
        self.background.adopt(pool)  # a run its last kernel left going: replayed, then followed live
        return pool

    @staticmethod
    def list_kept() -> str:
        return kept.listing()

    def stop_kept(self, name: str) -> None:
        """``%xla_pool stop NAME``: this kernel's pool if it is kept as NAME, else the kept pool of that name."""
        running = self.current_pool()
        if isinstance(running, kept.KeptPool) and running.name == name:
            self.stop_pool()
        else:
            kept.end_by_name(name)

    def restart_pool(self, options: PoolOptions) -> Pool:
        """Fresh ranks for the pool: what is not given is as before (an SPMD pool stays SPMD, with its mesh)."""
        old = self.current_pool()
        self.background.check_free(old, "%xla_pool restart")
        if old is None or options.hosts is not None or (options.keep is not None and not isinstance(old, kept.KeptPool)):
            self.stop_pool()  # a pool that becomes kept needs a launcher of its own
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
        self.background.check_free(self.current_pool(), "%xla_pool stop")
        pool, self.pool = self.current_pool(), None
        self.release_post_mortem("the pool was stopped")
        if pool is None:
            return False
        pool.stop()
        return True

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        """``%xla_pool push NAME...``: the kernel's values into every rank's namespace."""
        self._usable_pool("%xla_pool push").push(names, user_ns)

    def pull(self, name: str, rank: int | None) -> Any:
        """``%xla_pool pull NAME``: every rank's value (a list by rank), or rank ``rank``'s."""
        return self._usable_pool("%xla_pool pull").pull(name, rank)

    def stacks(self, rank: int | None, everything: bool, with_locals: bool = False) -> list[str]:
        """``%xla_stacks``: where the ranks were when the last cell was stuck or stopped; a pool's ranks now, on
        this host or across hosts (``with_locals``: each cell frame's names too, where the ranks can say)."""
        pool = self.current_pool()
        self.background.check_free(pool, "%xla_stacks")
        return watch.report(self.history, pool, rank, everything, with_locals)

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

    def _usable_pool(self, action: str = "this") -> Pool:
        pool = self.current_pool()
        if pool is None:
            raise UsageError("no pool is running; start one with %xla_pool start [--devices N]")
        self.background.check_free(pool, action)
        return pool

    def close(self) -> None:
        """Stop the pool and the launcher, and remove the session's directory."""
        try:
            self.background.close()  # its runs' cells stopped first: the pool's ranks are theirs
            pool, self.pool = self.pool, None
            if pool is not None:
                pool.leave()
        finally:
            self.host.close()
