"""One host's machinery for running requests in ranks. Runs in the kernel, and in each host's engine.

A :class:`Runner` owns what one host needs to run cells: its private
directory and its launcher. It runs one request in one
:class:`~xla_magic.ranks.ranks.Ranks` (a cell, a push, a pull, a pool's start)
and spawns one-shot ranks, writing each run's record into the
:class:`~xla_magic.runs.history.History` it was given. The kernel's session
holds one runner beside its history and its pool; an engine on one of
several hosts holds one with a local pool, and knows nothing of the session.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, Mapping

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache, payload, place, sharding
from xla_magic.runs import post_mortem
from xla_magic.ranks import probe
from xla_magic.ranks import policy
from xla_magic.wire import protocol
from xla_magic.runs.errors import RankError, RunInterrupted
from xla_magic.runs.history import History
from xla_magic.ranks.launcher_client import Launcher, LauncherError, PrivateDir
from xla_magic.cell.options import Cell
from xla_magic.ranks.ranks import Ranks
from xla_magic.runs.record import RunRecord
from xla_magic.runs.request import Request
from xla_magic.runs.sink import Sink


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


class Runner:
    """One host's launcher and private directory; runs requests in ranks, their records kept in ``history``."""

    def __init__(self, history: History, sink: Sink | None = None) -> None:
        self.history = history
        self.sink = sink or Sink()  # where its requests' news goes, unless a cell brings its own (a background run)
        self.workdir = PrivateDir()
        self.launcher: Launcher | None = None
        self.cache_told: set[str] = set()  # why ranks ran without the compilation cache, once said (tell_cache)
        self.post_mortem: Any = None  # what %debug opens, until the next cell (PostMortem, or HostsPostMortem)
        self.let_go: Any = None  # the last one let go, to say why %xla_debug has none
        # One job handed to the launcher at a time: a background run's thread may launch beside the kernel's cell.
        self.launching = threading.Lock()

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

    # -- requests ------------------------------------------------------------

    def one_shot(self, cell: Cell, world: protocol.World | None = None) -> Any:
        """``cell`` in ranks spawned for it alone (one host's part of ``world``, if given), then ended."""
        placement = plan(cell.backend, cell.devices, "%%xla_spawn", cell.spmd)
        ranks = Ranks(placement, policy.ONE_SHOT, requested_backend=cell.backend, workdir=self.workdir, world=world,
                      cache=self.cache_setting(cell.compile_cache))
        try:
            return self.cell(ranks, cell, cell.xla_report or "auto", cell.hang_after)
        finally:
            if self.post_mortem is None or self.post_mortem.ranks is not ranks:
                ranks.stop()  # else its failed ranks are kept for %debug, until the next cell

    def cell(self, ranks: Ranks, cell: Cell, report: str = "auto", hang_after: float | None = None) -> Any:
        """Ship what the cell reads, send it to ``ranks`` (launching them with it if new), follow it."""
        self.release_post_mortem("another cell ran since")  # before it starts: a kept one-shot set may hold the devices
        sink = cell.sink or self.sink
        sink.before_cell()  # what the last cell still draws (its profile, once its digests came) comes first
        run_id = cell.run_id or self.history.next_run_id()
        # --profile: each rank process's trace goes to a folder of its own in there (launcher/profiling.py)
        profiled = {"profile": self.workdir.new(f"profile-{run_id}-")} if cell.profile else {}
        # --metrics-dir: each rank's TensorBoard files in DIR/run-N/rank-R (launcher/metrics.py)
        board = {"metrics_dir": os.path.join(os.path.abspath(cell.metrics_dir), f"run-{run_id}")} if cell.metrics_dir else {}
        filename = f"<xla_spawn cell {run_id}>"
        has_result, names, code = payload.analyse(cell.source, filename)
        values = payload.select_names(names, cell.user_ns, cell.hidden)
        here = cell.place or place.current(self.launcher.environment_changes() if self.launcher is not None else None)
        delivered = False
        try:
            shipping, changed = ranks.shipping.fields(values)
            seq = ranks.next_seq()
            # With IPython syntax the ranks run its transformation (``code``) and show the cell's lines.
            transformed = {"code": code} if code != cell.source else {}
            frame = protocol.encode(protocol.CELL, seq=seq, run_id=run_id, source=cell.source, filename=filename,
                                    has_result=has_result, results_to=ranks.results.prefix,
                                    xla_report=report != "off", **profiled, **board, **transformed,
                                    **place.changed(here, ranks.place), **shipping)
            launching = ranks.state == "starting"
            record = self.record(run_id, cell.source, ranks)
            record.xla_report = report
            record.profile = profiled.get("profile", "")
            self.history.cell_began(record, cell.profile)  # %xla_report shows what XLA did in it, %xla_profile its profile
            # --profile: the kernel draws the profile, unless this is one host's part of a world across hosts
            # (the kernel draws every host's: hosts/profiles.py); then a pool's ranks read their traces once the
            # kernel is done with the cell (profile_drawer.py).
            draws = cell.profile and ranks.world is None and sink.draws_profiles
            request = Request(ranks, record, seq, None if launching else frame, workdir=self.workdir,
                              has_result=has_result, timeout=cell.timeout, on_update=self.history.notify,
                              sink=sink, hang_after=hang_after, tells_digest=not draws)
            if launching:
                self.launch(ranks, record, first=frame)
            else:
                self.history.remember(record)
            request.start()
            # The cell's views (what its ranks log, drawn as it comes; its profile's reader), told of its record as
            # it moves; one host's part of a world has none: the kernel draws every host's.
            views = sink.follow_cell(record, cell.metrics == "ranks", reads_profile=draws) if ranks.world is None else None
            if views is not None:
                self.history.listeners.append(views.notice)
            try:
                return ranks.value(request.wait())
            except RankError as error:
                if post_mortem.keeps(ranks, error):
                    self.keep_for_debug(post_mortem.PostMortem(ranks, error, run_id), error)
                else:
                    error.not_kept = post_mortem.why_not(ranks, error)
                raise
            finally:
                if views is not None:  # the chart closed, the line under the cell, the profile
                    self.history.listeners.remove(views.notice)
                    views.ended(request)
                if launching:
                    self.tell_cache(ranks, sink)
                if ranks.world is None:  # one host's part of a world says nothing: the kernel tells every host's
                    self.tell_unloadable(ranks.placement.on_cpu, record, sink)
                delivered = request.delivered
                if delivered:
                    ranks.shipping.sent(changed, shipping)
                    ranks.place = here
                    ranks.cells += 1
        finally:
            ranks.shipping.settle(delivered)

    def launch(self, ranks: Ranks, record: RunRecord, first: bytes | None, launcher: Launcher | None = None) -> None:
        """Start the ranks' job (on ``launcher``: a kept pool's own, else this host's); launcher trouble becomes a
        UsageError, Ctrl-C a RunInterrupted."""
        self.release_post_mortem("new ranks started since")
        with self.launching:
            self._launch(ranks, record, first, launcher)

    def _launch(self, ranks: Ranks, record: RunRecord, first: bytes | None, launcher: Launcher | None) -> None:
        launcher = launcher or self.ready_launcher()
        if ranks.backend == "tpu" and not ranks.placement.on_cpu:
            without = probe.no_libtpu(launcher.info or {}, ranks.devices)
            if without:
                if launcher is self.launcher:
                    self.drop_launcher()  # the next cell's imports torch_xla again, and finds what was installed
                raise UsageError(f"%%xla_spawn refused: {without}")
            held = probe.held_tpu(exclude=self._ours(launcher))
            if held:
                raise UsageError(f"%%xla_spawn refused: {held}")
        self.history.remember(record)
        try:
            ranks.launch(launcher, record.run_id, first)
        except BaseException as exc:
            record.outcome = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            self.history.notify(record)
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

    @staticmethod
    def _ours(launcher: Launcher) -> set[int]:
        """The launcher and what runs below it (a kept set's ranks): xla_magic's own to manage."""
        import psutil

        ours = {launcher.pid}
        try:
            ours.update(child.pid for child in psutil.Process(launcher.pid).children(recursive=True))
        except psutil.Error:
            pass
        return ours

    def exchange(self, ranks: Ranks, kind: str, label: str, targets: list[int] | None, has_result: bool,
                 **fields: Any) -> list[Any] | None:
        """A push, a pull or a DEBUG to ``ranks``, followed to the end: the results by rank (None for a push)."""
        if kind != protocol.DEBUG:
            self.release_post_mortem(f"{label} reached its ranks since")  # they drop them at any other request
        seq = ranks.next_seq()
        record = self.record(self.history.next_run_id(), label, ranks)
        request = Request(ranks, record, seq, protocol.encode(kind, seq=seq, **fields), workdir=self.workdir,
                          has_result=has_result, targets=targets, on_update=self.history.notify, sink=self.sink)
        request.start()
        return request.wait()

    def debug(self, rank: int | None = None, error: RankError | None = None) -> None:
        """``%debug`` / ``%xla_debug``: pdb in the failed cell's frame on ``rank`` (the first failure), until left.

        ``error``: the exception IPython last showed; it must be the kept cell's.
        """
        kept = self.post_mortem
        if error is not None and (error.post_mortem is None or error.post_mortem is not kept):
            if error.post_mortem is None:
                raise UsageError(error.not_kept or post_mortem.NOT_KEPT)
            raise UsageError(error.post_mortem.gone_message())  # type: ignore[attr-defined]
        if kept is None:
            if self.let_go is not None:
                raise UsageError(self.let_go.gone_message())
            raise UsageError("no %%xla_spawn cell has failed to debug: after one fails, %debug (or %xla_debug "
                             "--rank R) opens the frame where it failed on a rank, until the next cell; to stop a "
                             "rank at a line, put breakpoint() there")
        target = kept.choose(rank)
        print(kept.opening(target), flush=True)
        try:
            kept.open(self, target)
        finally:
            if kept.parked:
                self.release_post_mortem("the debugger was left, which lets a one-shot cell's kept ranks go")

    def keep_for_debug(self, kept: Any, error: RankError) -> None:
        """What %debug opens after ``error``, until the next cell (a PostMortem, or a pool across hosts' own)."""
        self.post_mortem = kept
        error.post_mortem, error.debug_note = kept, kept.note()

    def release_post_mortem(self, why: str = "the session ended") -> None:
        """The kept failed cell's frames are let go (``why``, as a later %debug of it says)."""
        kept, self.post_mortem = self.post_mortem, None
        if kept is not None:
            kept.release(why)
            self.let_go = kept

    def cache_setting(self, given: compile_cache.CacheSetting | None) -> compile_cache.CacheSetting:
        """What new ranks get (the option, else the variable, else the default); a variable that names no usable
        place is said once a session, and the ranks run without the cache."""
        setting = compile_cache.resolve(given)
        line = compile_cache.setting_line(setting, self.cache_told)
        if line:
            self.sink.note(line)
        return setting

    def tell_cache(self, ranks: Ranks, sink: Sink | None = None) -> None:
        """Once new ranks said how their compilation cache went: one line if some run without it, once a session."""
        line = compile_cache.problem_line(ranks.cache_facts, self.cache_told)
        if line:
            (sink or self.sink).note(line)

    def tell_unloadable(self, on_cpu: bool, record: RunRecord, sink: Sink | None = None) -> None:
        """Once a session: ranks on a TPU whose torch_xla could load nothing its compile cache held."""
        accounts = [state.xla for state in record.ranks.values() if state.xla]
        line = compile_cache.unloadable_line(accounts, on_cpu, self.cache_told)
        if line:
            (sink or self.sink).note(line)

    @staticmethod
    def guard_kernel(ranks: Ranks) -> None:
        """The kernel guard of every pool cell, without its /proc scan while no module was imported since."""
        if len(sys.modules) != ranks.modules_checked:
            refuse_if_kernel_holds_devices("%%xla_spawn")
            ranks.modules_checked = len(sys.modules)
        elif probe.kernel_xla_runtime():  # a runtime torch_xla had imported may start any time
            refuse_if_kernel_holds_devices("%%xla_spawn")

    # -- the record ------------------------------------------------------------

    @staticmethod
    def record(run_id: int, cell: str, ranks: Ranks) -> RunRecord:
        return RunRecord(run_id, cell, ranks.backend, ranks.devices, mesh=ranks.placement.describe_mesh(),
                         one_value=ranks.one_value)

    def close(self) -> None:
        """Stop the launcher and remove the private directory."""
        try:
            self.release_post_mortem()
            self.drop_launcher()
        finally:
            self.workdir.close()


def user_values(cell: Cell) -> Mapping[str, Any]:
    """The notebook values ``cell`` reads."""
    _, names, _ = payload.analyse(cell.source, "<xla_spawn cell>")
    return payload.select_names(names, cell.user_ns, cell.hidden)
