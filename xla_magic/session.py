"""The per-kernel session: what the extension started in one kernel.

Runs in the kernel. Decides where a cell runs (``plan``), owns the launcher,
the recent runs (the status panel's history) and the pool, and starts
one-shot runs.
"""

from __future__ import annotations

from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic import payload as payload_module
from xla_magic import probe
from xla_magic.display import RunInterrupted
from xla_magic.launcher_client import Launcher, LauncherError, PrivateDir
from xla_magic.run import Run, RunRecord, RunSpec

def plan(backend: str, devices: int | None, action: str) -> probe.Placement:
    """Where ``action`` would run, or the UsageError that says why it cannot."""
    try:
        placement = probe.place(backend, devices)
    except probe.PlacementError as exc:
        raise UsageError(str(exc)) from exc
    refuse_if_kernel_holds_devices(action)
    return placement


def refuse_if_kernel_holds_devices(action: str) -> None:
    refusal = probe.kernel_xla_runtime() or probe.kernel_holds_libtpu()
    if refusal:
        raise UsageError(f"{action} refused: {refusal}")


# --- the per-kernel session -------------------------------------------------


class Session:
    """Everything the extension started in one kernel."""

    HISTORY = 20

    def __init__(self) -> None:
        self.workdir = PrivateDir()
        self.launcher: Launcher | None = None
        self.run_count = 0
        self.history: list[RunRecord] = []
        self.listeners: list[Callable[[RunRecord], None]] = []
        self.pool: Any = None  # the running xla_magic.pool.Pool, if any

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

    def next_run_id(self) -> int:
        self.run_count += 1
        return self.run_count

    def spawn(
        self,
        cell: str,
        backend: str,
        devices: int | None,
        timeout: float | None,
        user_ns: dict[str, Any],
        hidden: dict[str, Any],
        live_lines: bool = False,
    ) -> list[Any] | None:
        """A ``%%xla_spawn`` cell in newly spawned ranks: results by rank."""
        placement = plan(backend, devices, "%%xla_spawn")
        run_id = self.next_run_id()
        cell_payload = payload_module.build(cell, f"<xla_spawn cell {run_id}>", user_ns, hidden)
        spec = RunSpec(
            payload=cell_payload,
            backend=placement.backend,
            devices=placement.devices,
            cpu_threads=placement.cpu_threads,
            timeout=timeout,
        )
        try:
            return self.run(spec, run_id, cell, live_lines=live_lines)
        finally:
            # However the cell ended (before the run took the segments over,
            # too), nothing it shipped stays in shared memory.
            if cell_payload.segments is not None:
                cell_payload.segments.sweep()

    def run(self, spec: RunSpec, run_id: int, cell: str, live_lines: bool = False) -> list[Any] | None:
        launcher = self.ready_launcher()
        record = RunRecord(run_id, cell, spec.backend, spec.devices)
        self.remember(record)
        run = Run(spec, launcher, record, self._notify, live_lines=live_lines, workdir=self.workdir)
        self.start_run(run)
        return run.wait()

    def remember(self, record: RunRecord) -> None:
        """Keep the record in the recent runs (the status panel's history)."""
        self.history = (self.history + [record])[-self.HISTORY :]

    def start_run(self, run: Run) -> None:
        """Start a run; launcher trouble becomes a UsageError, Ctrl-C a RunInterrupted."""
        try:
            run.start()
        except BaseException as exc:
            given_up = not run.launcher.alive()  # stopped while the job was in flight
            if given_up and self.launcher is run.launcher:
                self.drop_launcher()
            if isinstance(exc, LauncherError):
                raise UsageError(str(exc)) from exc
            if isinstance(exc, KeyboardInterrupt):
                where = "; the launcher was stopped, and the next cell starts a new one" if given_up else ""
                raise RunInterrupted(
                    f"interrupted while handing the cell to the launcher, before it ran{where}", {}
                ) from None
            raise

    def _notify(self, record: RunRecord) -> None:
        for listener in list(self.listeners):
            try:
                listener(record)
            except Exception:  # a broken display must never break a run
                pass

    def close(self) -> None:
        """Stop the pool and the launcher, and remove the session's directory."""
        try:
            if self.pool is not None:
                self.pool.stop()
        finally:
            self.pool = None
            try:
                self.drop_launcher()
            finally:
                self.workdir.close()
