"""The per-kernel session: what the extension started in one kernel. Runs in the kernel.

Decides where a cell goes (the pool, or a set of ranks that lives for this
cell only), owns the launcher, the pool and its commands, and the recent
requests (the status panel's history). Every cell, push and pull becomes
one :class:`~xla_magic.request.Request` to one :class:`~xla_magic.ranks.Ranks`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, Mapping

from IPython.core.error import UsageError

from xla_magic import payload, place, probe, profile_view, protocol, sharding, transport, watch, xla_report
from xla_magic.display import RunInterrupted
from xla_magic.launcher_client import READY_TIMEOUT, Launcher, LauncherError, PrivateDir
from xla_magic.ranks import Ranks
from xla_magic.record import RunRecord
from xla_magic.request import Request


def plan(
    backend: str, devices: int | None, action: str, spmd: sharding.SpmdOptions | None = None
) -> probe.Placement:
    """Where ``action`` would run, or the UsageError that says why it cannot.

    With ``spmd``: one process over the same devices, with the mesh that
    ``--mesh`` / ``--axes`` ask for.
    """
    try:
        placement = probe.place(backend, devices)
    except probe.PlacementError as exc:
        raise UsageError(str(exc)) from exc
    if spmd is not None:
        mesh, axes = spmd.layout(placement.devices)
        placement = dataclasses.replace(placement, mesh=mesh, axes=axes)
    refuse_if_kernel_holds_devices(action)
    return placement


def refuse_if_kernel_holds_devices(action: str) -> None:
    refusal = probe.kernel_xla_runtime() or probe.kernel_holds_libtpu()
    if refusal:
        raise UsageError(f"{action} refused: {refusal}")


def old_spmd_options(pool: Ranks, devices: int | None) -> sharding.SpmdOptions:
    """A restarted SPMD pool's --mesh / --axes: its own, unless the device count changes (then the defaults)."""
    placement = pool.placement
    if devices is not None and devices != placement.devices:
        return sharding.SpmdOptions()
    return sharding.SpmdOptions(",".join(map(str, placement.mesh or ())), ",".join(placement.axes or ()))


class Session:
    """Everything the extension started in one kernel."""

    HISTORY = 20

    def __init__(self) -> None:
        self.workdir = PrivateDir()
        self.launcher: Launcher | None = None
        self.run_count = 0
        self.history: list[RunRecord] = []
        self.listeners: list[Callable[[RunRecord], None]] = []
        self.pool: Ranks | None = None  # the kept ranks, while a pool runs (or is broken)
        self.one_value = False  # whether the last cell's value was one value (SPMD), not a list by rank
        self.world: dict[str, Any] | None = None  # an engine's session on one of several hosts: its part of the world
        self.kernel_place: dict[str, Any] | None = None  # there: the kernel's place, which cells follow, not the engine's
        self.hosts: Any = None  # the kernel's pool across several hosts (xla_magic.hosts.pool.HostsPool)
        self.pool_xla_report = "auto"  # the pool's --xla-report, for cells that give none
        self.last_cell: RunRecord | None = None
        self.last_profiled: RunRecord | None = None  # the last --profile cell, for %xla_profile

    # -- the launcher ------------------------------------------------------

    def ensure_launcher(self) -> Launcher:
        """The launcher, started if there is none (LauncherError if it cannot be)."""
        if self.launcher is not None and not self.launcher.alive():
            self.drop_launcher()  # a dead one: its socket and directory go too
        if self.launcher is None:
            self.launcher = Launcher(self.workdir)
        return self.launcher

    def ready_launcher(self) -> Launcher:
        """The launcher, ready for jobs, or the UsageError that says what to do."""
        try:
            launcher = self.ensure_launcher()
            launcher.wait_ready()
        except LauncherError as exc:
            self.drop_launcher()
            raise UsageError(str(exc)) from exc
        return launcher

    def drop_launcher(self) -> None:
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            launcher.stop()

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
    ) -> Any:
        """A ``%%xla_spawn`` cell: in the pool while one runs (unless ``fresh``), else in new ranks.

        Its value: the list by rank, or (SPMD) the one value.
        """
        hosts = self.current_hosts()
        if hosts is not None and not fresh:
            if spmd is not None:
                raise UsageError("the pool runs on several hosts, one rank per device; --spmd cells cannot run there")
            if profile:
                raise UsageError("--profile records the ranks of one host; the pool runs on several hosts, where it "
                                 "is not supported yet (run the cell with --fresh, or stop the pool)")
            self.one_value = False
            return hosts.run_cell(cell, user_ns, hidden, timeout)
        pool = self.current_pool()
        if pool is not None and not fresh:
            pool.check_fits(devices, backend, spmd)
            pool.check_usable()
            self._guard_kernel(pool)
            return self._cell(pool, cell, user_ns, hidden, timeout, live_lines, xla_report or self.pool_xla_report,
                              profile, hang_after=hang_after or pool.hang_after)
        if pool is not None:
            pool.check_fresh_allowed()
        placement = plan(backend, devices, "%%xla_spawn", spmd)
        ranks = Ranks(placement, keep=False, requested_backend=backend, workdir=self.workdir)
        try:
            return self._cell(ranks, cell, user_ns, hidden, timeout, live_lines, xla_report or "auto", profile,
                              hang_after=hang_after)
        finally:
            ranks.stop()

    def _cell(
        self,
        ranks: Ranks,
        cell: str,
        user_ns: Mapping[str, Any],
        hidden: Mapping[str, Any],
        timeout: float | None,
        live_lines: bool,
        report: str = "auto",
        profile: bool = False,
        hang_after: float | None = None,
    ) -> Any:
        """Ship what the cell reads, send it to ``ranks`` (launching them with it if new), follow it."""
        run_id = self.next_run_id()
        # --profile: each rank process's trace goes to a folder of its own in there (launcher/profiling.py)
        profiled = {"profile": self.workdir.new(f"profile-{run_id}-")} if profile else {}
        filename = f"<xla_spawn cell {run_id}>"
        has_result, names, code = payload.analyse(cell, filename)
        values = payload.select_names(names, user_ns, hidden)
        here = self.kernel_place or place.current(
            self.launcher.environment_changes() if self.launcher is not None else None)
        delivered = False
        try:
            shipping, changed = ranks.shipping.fields(values)
            seq = ranks.next_seq()
            # With IPython syntax the ranks run its transformation (``code``) and show the cell's lines.
            transformed = {"code": code} if code != cell else {}
            frame = protocol.encode(protocol.CELL, seq=seq, run_id=run_id, source=cell, filename=filename,
                                    has_result=has_result, results_to=ranks.results.prefix,
                                    xla_report=report != "off", **profiled, **transformed,
                                    **place.changed(here, ranks.place),
                                    **shipping)
            launching = ranks.state == "starting"
            record = self._record(run_id, cell, ranks)
            record.xla_report = report
            record.profile = profiled.get("profile", "")
            self.last_cell = record  # %xla_report shows what XLA did in it
            if profile:
                self.last_profiled = record  # %xla_profile shows it again
            request = Request(ranks, record, seq, None if launching else frame, workdir=self.workdir,
                              has_result=has_result, timeout=timeout, on_update=self._notify,
                              live_lines=live_lines, hang_after=hang_after)
            if launching:
                self._launch(ranks, record, first=frame)
            else:
                self.remember(record)
            request.start()
            self.one_value = ranks.one_value
            try:
                return ranks.value(request.wait())
            finally:
                xla_report.after_cell(record)
                if profile:
                    profile_view.after_cell(record)
                delivered = request.delivered
                if delivered:
                    ranks.shipping.sent(changed, shipping)
                    ranks.place = here
                    ranks.cells += 1
        finally:
            ranks.shipping.settle(delivered)

    def _launch(self, ranks: Ranks, record: RunRecord, first: bytes | None) -> None:
        """Start the ranks' job; launcher trouble becomes a UsageError, Ctrl-C a RunInterrupted."""
        launcher = self.ready_launcher()
        self.remember(record)
        try:
            ranks.launch(launcher, record.run_id, first)
        except BaseException as exc:
            record.outcome = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            self._notify(record)
            given_up = not launcher.alive()  # stopped while the job was in flight
            if given_up and self.launcher is launcher:
                self.drop_launcher()
            if isinstance(exc, LauncherError):
                raise UsageError(str(exc)) from exc
            if isinstance(exc, KeyboardInterrupt):
                where = "; the launcher was stopped, and the next cell starts a new one" if given_up else ""
                raise RunInterrupted(
                    f"interrupted while handing the cell to the launcher, before it ran{where}", {}
                ) from None
            raise

    def _guard_kernel(self, pool: Ranks) -> None:
        """The kernel guard of every pool cell, without its /proc scan while no module was imported since."""
        if len(sys.modules) != pool.modules_checked:
            refuse_if_kernel_holds_devices("%%xla_spawn")
            pool.modules_checked = len(sys.modules)
        elif probe.kernel_xla_runtime():  # a runtime torch_xla had imported may start any time
            refuse_if_kernel_holds_devices("%%xla_spawn")

    # -- the pool ------------------------------------------------------------

    def current_hosts(self) -> Any:
        """The pool across several hosts, unless there is none or it was stopped."""
        hosts = self.hosts
        return None if hosts is None or hosts.state == "stopped" else hosts

    def start_hosts(self, hosts: list[str], template: str | None, devices: int | None, backend: str | None,
                    spmd: sharding.SpmdOptions | None = None) -> Any:
        """``%xla_pool start --hosts``: one engine per host, each running its host's launcher and ranks."""
        from xla_magic.hosts.pool import HostsPool

        if spmd is not None and (backend or "auto") != "tpu":
            raise UsageError("--spmd on several hosts needs TPUs: in the CPU simulation XLA's CPU client is one "
                             "process and cannot span hosts. Leave --spmd out (one rank per device), or run on TPU "
                             "hosts with --backend tpu")
        if spmd is not None:
            raise UsageError("--spmd on several hosts is not supported yet: leave --spmd out (one rank per device)")
        if self.current_hosts() is not None or self.current_pool() is not None:
            raise UsageError("a pool is already running: %xla_pool stop it first, or %xla_pool restart")
        pool = HostsPool(hosts, devices, backend or "auto", template, self.workdir)
        pool.start()
        self.hosts = pool
        print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
        return pool

    def current_pool(self) -> Ranks | None:
        """The session's pool, unless there is none or it was stopped."""
        pool = self.pool
        return None if pool is None or pool.state == "stopped" else pool

    def start_pool(
        self,
        devices: int | None,
        backend: str | None,
        live_lines: bool = False,
        spmd: sharding.SpmdOptions | None = None,
        xla_report: str | None = None,
        hang_after: float | None = None,
    ) -> Ranks:
        """``%xla_pool start``: a pool of ready ranks (or, with ``spmd``, an SPMD process), or the one already running."""
        if self.current_hosts() is not None:
            raise UsageError("a pool across hosts is running: %xla_pool stop it first, then start one on this host")
        running = self.current_pool()
        if running is not None:
            running.check_usable()
            running.check_fits(devices, backend or "auto", spmd)
            print(f"the pool is already running: {running.describe()}")
            return running
        placement = plan(backend or "auto", devices, "%xla_pool start", spmd)
        pool = Ranks(placement, keep=True, requested_backend=backend or "auto", workdir=self.workdir, world=self.world)
        pool.hang_after = hang_after
        record = self._record(self.next_run_id(), "%xla_pool start", pool)
        start = Request(pool, record, 0, None, workdir=self.workdir, has_result=False, timeout=READY_TIMEOUT,
                        on_update=self._notify, live_lines=live_lines)
        began = time.monotonic()
        try:
            self._launch(pool, record, first=None)
            start.start()
            start.wait()
        except BaseException:
            pool.stop()
            raise
        pool.start_seconds = time.monotonic() - began
        pool.state = "ready"
        self.pool = pool
        self.pool_xla_report = xla_report or "auto"
        self._notify(record)  # a panel on show learns of the pool now, not at its next redraw
        print(f"pool ready in {pool.start_seconds:.1f} s: {pool.describe()}")
        return pool

    def stop_pool(self) -> bool:
        """``%xla_pool stop`` and the status panel's Stop pool: True when there was a pool to stop."""
        hosts, self.hosts = self.current_hosts(), None
        if hosts is not None:
            hosts.stop()
            return True
        pool, self.pool = self.current_pool(), None
        if pool is None:
            return False
        pool.stop()
        return True

    def restart_pool(
        self,
        devices: int | None,
        backend: str | None,
        live_lines: bool = False,
        spmd: sharding.SpmdOptions | None = None,
        xla_report: str | None = None,
        hang_after: float | None = None,
    ) -> Ranks:
        """Fresh ranks for the pool: what is not given is as before (an SPMD pool stays SPMD, with its mesh)."""
        old = self.current_pool()
        if old is not None:
            if spmd is None and old.one_value:
                spmd = old_spmd_options(old, devices)
            devices = devices if devices is not None else old.devices
            backend = backend or old.requested_backend
            xla_report = xla_report or self.pool_xla_report
            hang_after = hang_after or old.hang_after
            plan(backend, devices, "%xla_pool restart", spmd)  # bad options keep the old pool
            self.stop_pool()
        return self.start_pool(devices, backend, live_lines, spmd, xla_report, hang_after)

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        """``%xla_pool push NAME...``: the kernel's values into every rank's namespace."""
        if self.current_hosts() is not None:
            return self.hosts.push(names, user_ns)
        self._usable_pool()
        missing = [name for name in names if name not in user_ns]
        if missing:
            raise UsageError(f"no notebook variable named {', '.join(missing)} to push")
        values = {name: user_ns[name] for name in names}
        segments = transport.RunSegments()  # large values: mapped by every rank, unlinked once all have
        try:
            self._exchange(protocol.PUSH, f"%xla_pool push {' '.join(names)}", None, False,
                           values=payload.pickle_namespace(values, segments))
        finally:
            segments.sweep()

    def pull(self, name: str, rank: int | None) -> Any:
        """``%xla_pool pull NAME``: every rank's value (a list by rank), or rank ``rank``'s."""
        if self.current_hosts() is not None:
            if rank is not None and not 0 <= rank < self.hosts.world_size:
                raise UsageError(f"--rank must be between 0 and {self.hosts.world_size - 1} (the pool across hosts "
                                 f"has {self.hosts.world_size} ranks)")
            values = self.hosts.pull(name)
            return values if rank is None else values[rank]
        pool = self._usable_pool()
        if rank is not None and pool.one_value:
            raise UsageError("an SPMD pool is one process, so its value has no --rank: leave --rank out")
        if rank is not None and not 0 <= rank < pool.devices:
            raise UsageError(f"--rank must be between 0 and {pool.devices - 1} (the pool has {pool.devices} ranks)")
        request = self._exchange(protocol.PULL, f"%xla_pool pull {name}", None if rank is None else [rank], True,
                                 name=name, results_to=pool.results.prefix)
        if rank is not None:
            return request.results.get(rank)
        return pool.value([request.results.get(r) for r in range(pool.size)])

    def stacks(self, rank: int | None, everything: bool) -> list[str]:
        """``%xla_stacks``: where the ranks were when the last cell was stuck or stopped; a pool's now."""
        return watch.report(self.history, self.current_pool(), rank, everything)

    def describe_pool(self) -> str:
        if self.current_hosts() is not None:
            return f"pool across hosts {self.hosts.describe()}"
        pool = self.current_pool()
        if pool is None:
            return ("no pool is running. %xla_pool start [--devices N] starts one; %%xla_spawn cells "
                    "then keep their ranks, namespaces and compiled graphs between cells.")
        return f"pool {pool.describe()}"

    def _usable_pool(self) -> Ranks:
        pool = self.current_pool()
        if pool is None:
            raise UsageError("no pool is running; start one with %xla_pool start [--devices N]")
        pool.check_usable()
        return pool

    def _exchange(self, kind: str, label: str, targets: list[int] | None, has_result: bool,
                  **fields: Any) -> Request:
        pool = self._usable_pool()
        seq = pool.next_seq()
        record = self._record(self.next_run_id(), label, pool)
        request = Request(pool, record, seq, protocol.encode(kind, seq=seq, **fields), workdir=self.workdir,
                          has_result=has_result, targets=targets, on_update=self._notify)
        request.start()
        request.wait()
        return request

    # -- the record ------------------------------------------------------------

    @staticmethod
    def _record(run_id: int, cell: str, ranks: Ranks) -> RunRecord:
        return RunRecord(run_id, cell, ranks.backend, ranks.devices, mesh=ranks.placement.describe_mesh())

    def next_run_id(self) -> int:
        self.run_count += 1
        return self.run_count

    def remember(self, record: RunRecord) -> None:
        """Keep the record in the recent runs (the status panel's history)."""
        self.history = (self.history + [record])[-self.HISTORY :]

    def _notify(self, record: RunRecord) -> None:
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a broken display must never break a run
                pass

    def close(self) -> None:
        """Stop the pool and the launcher, and remove the session's directory."""
        try:
            if self.hosts is not None:
                self.hosts, hosts = None, self.hosts
                hosts.stop()
            if self.pool is not None:
                self.pool.stop()
        finally:
            self.pool = None
            try:
                self.drop_launcher()
            finally:
                self.workdir.close()

