"""A pool across several hosts: an ipyparallel cluster, one engine per host. Runs in the kernel.

``%xla_pool start --hosts A,B`` starts the controller here (listening only
on this machine's address toward the hosts, with ipyparallel's key), one
engine per host through the launch template, and in each engine that
host's own launcher and pool ranks (``hosts.on_host``), as one world:
a global rank is torch_xla's global ordinal, as each host's ranks say when
they start (host by host in the simulation; a TPU slice need not number a
host's ranks contiguously), and everything the kernel shows uses it. Cells then go to every host at once
and are followed by :class:`~xla_magic.hosts.request.HostsRequest`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import time
import uuid
from typing import Any, Callable, Mapping

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache, payload, place
from xla_magic.runs.sink import Sink
from xla_magic.wire import protocol
from xla_magic.runs.errors import RankError
from xla_magic.hosts import discovery, link, on_host, profiles
from xla_magic.hosts.debugging import HostsPostMortem
from xla_magic.hosts.metrics import NO_METRICS_DIR
from xla_magic.runs.post_mortem import NOT_KEPT_FRESH_HOSTS
from xla_magic.hosts.discovery import DEFAULT_TEMPLATE, template_words
from xla_magic.ranks.naming import RESTART, Numbering
from xla_magic.hosts.request import HostsRequest
from xla_magic.hosts.shipping import HostShipping
from xla_magic.cell.options import Cell, PoolOptions
from xla_magic.pools.interface import check_names, check_rank
from xla_magic.runs.record import RankState, RunRecord
from xla_magic.runs.runner import Runner, user_values

ENGINES_TIMEOUT = 120.0  # for every engine to register
START_TIMEOUT = 600.0  # for every host's launcher and ranks to be ready
HEARTBEAT_MS = 1000  # the controller's heartbeat period; an engine ends after MISSES silent periods
MISSES = 10
LINK_TIMEOUT = 60.0  # for every engine to link to the kernel (hosts/link.py)
WHERE_TIMEOUT = 30.0  # for a host to say where its ranks are now (each waits a second for its samplers)


class HostsPool:
    """The kernel's handle on a pool across hosts: the cluster, its engines by host, the world.

    A :class:`~xla_magic.pools.interface.Pool`: its cells, pushes and pulls go to every
    host at once, each recorded in ``runner``'s history as one run of every
    global rank (the status panel's, whose Interrupt button stops it).
    """

    one_value = False  # one rank per device on every host: a cell's value is the list by global rank

    def __init__(self, runner: Runner, hosts: list[str], devices: int | None, backend: str, template: str | None,
                 python: str | None = None) -> None:
        self.runner = runner
        self.hosts = hosts
        self.requested_devices = devices
        self.devices = devices or 0  # ranks per host: what the hosts say, once the engines are up
        self.backend = backend
        self.template = template or DEFAULT_TEMPLATE
        self.python = python or os.environ.get("XLA_MAGIC_HOST_PYTHON") or _kernel_python()
        self.workdir = runner.workdir
        self.state = "starting"
        self.problem: str | None = None
        self.cluster: Any = None
        self.client: Any = None
        self.engines: list[int] = []  # ipyparallel engine id, by host index
        self.engine_pids: list[int] = []
        self.pids: dict[int, int] = {}  # global rank -> its process, as the hosts last said
        self.numbering = Numbering(self.devices)  # each host's local ranks' global ranks, as they said at start
        self._rows: list[dict[str, Any]] = []  # each host's status, as its engine last said it
        self.shipping = HostShipping(len(hosts))  # what each host's engine holds of the kernel's values
        self.address = ""
        self.links: dict[int, link.Link] = {}  # each host's link to the kernel, for its ranks' questions
        self.cells = 0
        self.hang_after: float | None = None  # --hang-after, for the pool's cells that give none (watch.py)
        self.xla_report = "auto"  # --xla-report, for the pool's cells that give none
        # torch_xla's compilation cache: what every host's ranks are told (None: each host's own default, under
        # its home), and what each global rank reported when it was ready (its folder, or why it has none).
        self.cache: compile_cache.CacheSetting | None = None
        self.cache_facts: dict[int, dict[str, Any]] = {}
        self.started = time.time()
        self.start_seconds: float | None = None
        # The kernel's environment as the pool started: its changes since then travel to every host's ranks.
        self.base_environment = dict(os.environ)
        for index, host in enumerate(hosts):
            try:
                template_words(self.template, host, index)
            except ValueError as exc:
                raise UsageError(f"--launch: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.devices * len(self.hosts)

    # -- starting and stopping ------------------------------------------------

    @staticmethod
    def check_options(options: PoolOptions) -> None:
        """What no pool across hosts can be, whatever runs now."""
        if options.keep is not None or options.keep_idle is not None:
            raise UsageError("--keep works on one host only: a pool across hosts ends with its kernel (its engines "
                             "and controller would need keeping and reconnecting too). Leave --keep out, or keep a "
                             "pool on this host (%xla_pool start --keep NAME without --hosts)")
        if options.spmd is not None and (options.backend or "auto") != "tpu":
            raise UsageError("--spmd on several hosts needs TPUs: in the CPU simulation XLA's CPU client is one "
                             "process and cannot span hosts. Leave --spmd out (one rank per device), or run on TPU "
                             "hosts with --backend tpu")
        if options.spmd is not None:
            raise UsageError("--spmd on several hosts is not supported yet: leave --spmd out (one rank per device)")
        if importlib.util.find_spec("ipyparallel") is None:
            raise UsageError("a pool across hosts runs on ipyparallel, which is not installed in this kernel: "
                             "pip install 'ipyparallel>=8.6' (the hosts extra) here and on every host, then start it again")

    @classmethod
    def start(cls, runner: Runner, options: PoolOptions) -> HostsPool:
        """``%xla_pool start --hosts``: one engine per host, each running its host's launcher and ranks."""
        cls.check_options(options)
        pool = cls(runner, list(options.hosts or ()), options.devices, options.backend or "auto", options.template)
        pool.hang_after = options.hang_after
        pool.cache = compile_cache.for_hosts(options.compile_cache)
        pool.xla_report = options.xla_report or "auto"
        pool.start_all()
        return pool

    def check_start(self, options: PoolOptions) -> None:
        if options.hosts is not None:
            raise UsageError("a pool is already running: %xla_pool stop it first, or %xla_pool restart")
        raise UsageError("a pool across hosts is running: %xla_pool stop it first, then start one on this host")

    def restart(self, options: PoolOptions) -> HostsPool:
        """Fresh ranks on the same hosts: devices and backend as before unless given.

        A pool that is not broken keeps its cluster: each engine keeps its launcher (torch_xla imported
        once) and the kernel's values it holds, and only the ranks start anew. A broken one may have lost an
        engine or the controller, so everything starts anew, as at ``%xla_pool start``."""
        if self.state != "ready":
            self.stop()
            return HostsPool.start(self.runner, options.but(
                hosts=self.hosts, template=self.template, devices=options.devices or self.devices,
                backend=options.backend or self.backend, hang_after=options.hang_after or self.hang_after,
                compile_cache=options.compile_cache or self.cache, xla_report=options.xla_report or self.xla_report))
        self.check_options(options)
        self.requested_devices = options.devices or self.devices
        self.backend = options.backend or self.backend
        self.hang_after = options.hang_after or self.hang_after
        self.xla_report = options.xla_report or self.xla_report
        if options.compile_cache is not None:
            self.cache = compile_cache.for_hosts(options.compile_cache)
        self.state, self.problem, self.cells, self.started = "starting", None, 0, time.time()
        self.start_all(with_cluster=False)
        return self

    def start_all(self, with_cluster: bool = True) -> None:
        """The controller and an engine per host (unless the cluster is kept), then every host's ranks; on any
        failure nothing is left."""
        began = time.monotonic()
        try:
            if with_cluster:
                self._start_cluster()
            self._start_ranks()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        self.state = "ready"

    def _start_cluster(self) -> None:
        # ipyparallel is the `hosts` extra: imported here, when a pool across hosts starts, never by %load_ext.
        import ipyparallel as ipp

        from xla_magic.hosts.launch import HostEngineSetLauncher, KernelControllerLauncher

        self.address = discovery.kernel_address(self.hosts[0])
        profile = self.workdir.new("cluster-")
        self.cluster = ipp.Cluster(
            profile_dir=profile, cluster_id=uuid.uuid4().hex[:8], n=len(self.hosts), controller_ip=self.address,
            controller_launcher_class=KernelControllerLauncher, engine_launcher_class=HostEngineSetLauncher,
            controller_args=["--usethreads", f"--HeartMonitor.period={HEARTBEAT_MS}"],
            shutdown_atexit=True, log_level=40,
        )
        self.cluster.start_controller_sync()
        self.cluster.start_engines_sync(hosts=self.hosts, template=self.template, python=self.python,
                                        engine_args=[f"--IPEngine.max_heartbeat_misses={MISSES}"])
        self.client = self.cluster.connect_client_sync()
        _private(profile)
        self._wait_for_engines()
        identities = self.client[:].apply_sync(on_host.identify)
        by_index = {facts["index"]: (engine, facts["pid"]) for engine, facts in zip(self.client.ids, identities)}
        self.engines = [by_index[index][0] for index in range(len(self.hosts))]
        self.engine_pids = [by_index[index][1] for index in range(len(self.hosts))]
        self._link_hosts()

    def _link_hosts(self) -> None:
        """Each engine's link to the kernel (hosts/link.py), made once with the cluster: a restart keeps it.

        The listener is on the kernel's address toward the hosts, and closed once every host is linked; the
        token is made from the cluster's key, which each engine holds already, and never travels."""
        listener = link.Listener(self.address, bytes(self.client.session.key))
        try:
            calls = [self.client[engine].apply_async(on_host.link, listener.ticket(), index)
                     for index, engine in enumerate(self.engines)]

            def problem() -> str | None:
                for index, call in enumerate(calls):
                    if call.ready():
                        said = call.get()
                        if said["outcome"] != "ok":
                            return f"host h{index} ({self.hosts[index]}): {said.get('message')}"
                return None

            try:
                self.links = listener.accept(len(self.hosts), LINK_TIMEOUT, problem)
            except link.LinkError as exc:
                raise UsageError(f"the hosts could not link to the kernel for their ranks' questions: {exc}; "
                                 f"check that each host reaches {self.address}") from None
            for call in calls:
                call.get(LINK_TIMEOUT)
        finally:
            listener.close()

    def _wait_for_engines(self) -> None:
        deadline = time.monotonic() + ENGINES_TIMEOUT
        while len(self.client.ids) < len(self.hosts):
            gone = self._engines_gone()
            if gone:
                raise UsageError(f"the engine of {gone} did not start{self._engine_log(gone)}")
            if time.monotonic() > deadline:
                missing = ", ".join(self.hosts[len(self.client.ids):])
                raise UsageError(f"not every host's engine registered within {ENGINES_TIMEOUT:g} s "
                                 f"(still missing: {missing}); check the launch template and that xla_magic "
                                 f"and ipyparallel are installed on every host")
            time.sleep(0.1)  # registrations arrive on the client's own thread

    def _engines_gone(self) -> str | None:
        """A host whose launch command (its engine) already exited."""
        engine_set = next(iter(self.cluster.engines.values()), None)
        if engine_set is None:
            return None
        stopped = engine_set.stop_data.get("engines", {})  # ipyparallel's notice, when its loop ran
        for index, host in enumerate(self.hosts):
            engine = engine_set.launchers.get(str(index))
            if str(index) in stopped or (engine is not None and _exited(engine)):
                return host
        return None

    def _engine_log(self, host: str) -> str:
        """The end of what a host's launch command printed (ipyparallel keeps it once it saw the exit)."""
        index = self.hosts.index(host)
        engine_set = next(iter(self.cluster.engines.values()))
        text = engine_set.outputs.get(str(index))
        if text is None:
            path = os.path.join(self.cluster.profile_dir, "log", f"engine-{index}-{host}.log")
            try:
                with open(path, encoding="utf-8", errors="replace") as log:
                    text = log.read()
            except OSError:
                text = ""
        tail = "".join(text.splitlines(keepends=True)[-15:])
        return f"; its log ends:\n{tail}" if tail.strip() else ""

    def _start_ranks(self) -> None:
        # Each host's own devices decide its ranks (a TPU host: its chips); one world needs the same on each.
        calls = [self.client[engine].apply_async(on_host.ranks_here, self.requested_devices, self.backend)
                 for engine in self.engines]
        here = HostsRequest(self, calls, timeout=START_TIMEOUT, echo=False).wait()
        counts = {index: facts["ranks"] for index, facts in enumerate(here)}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"h{index} {self.hosts[index]}: {count}" for index, count in counts.items())
            raise UsageError(f"the hosts would run different numbers of ranks ({listing}); give --devices "
                             f"a count every host has")
        self.devices = counts[0]
        self.backend = here[0]["backend"]
        calls = [self.client[engine].apply_async(on_host.start, world, self.devices, self.backend, self.cache)
                 for engine, world in zip(self.engines, self._worlds())]
        request = HostsRequest(self, calls, timeout=START_TIMEOUT, echo=False)
        started = request.wait()
        self.numbering = Numbering(self.devices)
        for index, host in enumerate(started):
            self.numbering.learn(index, host.get("ordinals"))
        self._take_pids([host["pids"] for host in started])
        # How every host's ranks' compile cache went, said once for the world (the hosts' own words are not shown).
        self.cache_facts = {self.numbering.rank(index, rank): fact for index, host in enumerate(started)
                            for rank, fact in host["cache"].items()}
        line = compile_cache.problem_line(self.cache_facts, self.runner.cache_told)
        if line:
            self.runner.sink.note(line)

    def _worlds(self) -> list[protocol.World]:
        """Every host's part of one world, meeting at a store port free now on host 0."""
        port = self.client[self.engines[0]].apply_sync(on_host.free_port, self.hosts[0])
        return [
            protocol.World(host=index, hosts=len(self.hosts), rank_offset=index * self.devices,
                           world_size=self.world_size, address=host, store_address=self.hosts[0], store_port=port)
            for index, host in enumerate(self.hosts)
        ]

    def _take_pids(self, by_host: list[dict[int, int]]) -> None:
        self.pids = {self.numbering.rank(index, rank): pid for index, pids in enumerate(by_host)
                     for rank, pid in (pids or {}).items()}

    def leave(self) -> None:
        """The kernel's session closes: a pool across hosts ends with it."""
        self.stop()

    def stop(self) -> None:
        """Every host's ranks and launcher, the engines, then the controller; nothing left anywhere."""
        self.state = "stopped"
        links, self.links = self.links, {}
        for each in links.values():
            each.close()
        client, cluster, self.client, self.cluster = self.client, self.cluster, None, None
        try:
            if client is not None:
                try:
                    if client.ids:
                        client[:].apply_async(on_host.stop).wait(30)
                        client.shutdown(targets="all", block=True)  # each nanny tells a live controller
                finally:
                    client.close()
        finally:
            if cluster is not None:
                controller = getattr(cluster.controller, "pid", None)
                try:
                    cluster.stop_cluster_sync()
                finally:
                    _end_group(controller)

    # -- requests ---------------------------------------------------------------

    def label(self, rank: int) -> str:
        return self.numbering.label(rank)

    def where_now(self, everything: bool = False, with_locals: bool = False) -> dict[int, dict[str, Any]]:
        """Where every host's ranks are now, by global rank (``%xla_stacks`` between cells: every engine is free)."""
        return self.numbering.by_rank(self._call_hosts(on_host.where_now, [(everything, with_locals)] * len(self.hosts)),
                                     WHERE_TIMEOUT)

    def memory_now(self, full: int) -> dict[int, dict[str, Any]]:
        """What holds each rank's device memory, by global rank (``%xla_memory``); rank ``full`` lists its holders."""
        host, local = self.numbering.place(full)
        return self.numbering.by_rank(self._call_hosts(on_host.memory_now, [(local if at == host else None,) for at in
                                                                            range(len(self.hosts))]), WHERE_TIMEOUT)

    def check_usable(self) -> None:
        if self.state == "broken":
            raise UsageError(f"the pool across hosts is broken ({self.problem}); nothing ran. {RESTART}.")

    def mark_broken(self, problem: str) -> None:
        self.state, self.problem = "broken", problem

    def run_cell(self, cell: Cell) -> list[Any]:
        """A cell on every host at once; the list of every global rank's value, in rank order.

        ``cell.fresh``: in ranks spawned for it on every host, one world, ended after it.
        """
        self.check_usable()
        self.runner.release_post_mortem("another cell ran since")  # the ranks drop them at their next request
        if cell.spmd is not None:
            raise UsageError("the pool runs on several hosts, one rank per device; --spmd cells cannot run there")
        if cell.metrics_dir is not None:  # each host's ranks would write theirs on its own disk, by local rank
            raise UsageError(NO_METRICS_DIR)
        if not cell.fresh and cell.devices is not None and cell.devices != self.devices:
            raise UsageError(f"the pool across hosts runs {self.devices} ranks per host, so --devices "
                             f"{cell.devices} contradicts it; leave --devices out, or %xla_pool restart "
                             f"--devices {cell.devices}")
        if cell.compile_cache is not None and not cell.fresh:
            compile_cache.refuse_for_one_cell(cell.compile_cache, self.cache, self.backend == "cpu",
                                              self._cache_described())
        sending = self.shipping.prepare(user_values(cell))  # checked here, run by each host's pool
        # The kernel's place (directory, sys.path, environment) with every cell: each host applies what changed.
        here = place.current(place.environment_changes(self.base_environment))
        hang_after, report = cell.hang_after or self.hang_after, cell.xla_report or self.xla_report
        run_id = self.runner.history.next_run_id()  # the hosts name the cell by it too: <xla_spawn cell N>
        if cell.fresh:
            devices = cell.devices or self.devices
            worlds = [dict(w, rank_offset=w["host"] * devices, world_size=devices * len(self.hosts))
                      for w in self._worlds()]
            calls = self._call_hosts(on_host.run_fresh, [
                (cell.source, sending.for_host(index), sending.names, cell.timeout, here, world, devices,
                 cell.profile, hang_after, run_id, cell.compile_cache, report) for index, world in enumerate(worlds)])
        else:
            devices = self.devices
            calls = self._call_hosts(on_host.run_cell, [
                (cell.source, sending.for_host(index), sending.names, cell.timeout, here, cell.profile, hang_after,
                 run_id, report) for index in range(len(self.hosts))])
        record = self._record(cell.source, devices, run_id)
        record.xla_report = report
        self.runner.history.cell_began(record)  # %xla_report shows what XLA did on every host
        sink = cell.sink or self.runner.sink
        request = HostsRequest(self, calls, timeout=None, record=record, devices=devices, hang_after=hang_after,
                               sink=sink, numbering=None if cell.fresh else self.numbering, metrics=True)
        views = sink.follow_cell(record, cell.metrics == "ranks")  # every host's rows, drawn as they come
        self.runner.history.listeners.append(views.notice)
        try:
            values_by_host = self._follow(request)
        except RankError as error:
            if error.debuggable and not cell.fresh and self.state != "broken":  # %debug opens it (hosts/debugging.py)
                self.runner.keep_for_debug(HostsPostMortem(self, error, record.run_id), error)
            elif cell.fresh:
                error.not_kept = NOT_KEPT_FRESH_HOSTS
            raise
        finally:
            self.shipping.delivered(sending, request.reached())
            self.runner.history.listeners.remove(views.notice)
            views.ended()  # the chart closed; every host's accounts under the cell, as on one host (hosts/request.py)
            self.runner.tell_unloadable(self.backend == "cpu", record, sink)
            if cell.profile:  # every host's traces, however the cell ended (hosts/profiles.py)
                self._show_profile(record, request, devices, sink)
        if not cell.fresh:
            self.cells += 1
        return request.by_rank(values_by_host)

    def _show_profile(self, record: RunRecord, request: HostsRequest, devices: int, sink: Sink) -> None:
        profiles.store(record, request.outcomes, self.hosts, request.numbering,
                       self.workdir.new(f"profile-{record.run_id}-"))
        self.runner.history.cell_began(record, profiled=True)  # %xla_profile shows it again
        sink.show_profile(record)

    def debug(self, rank: int, run_id: int) -> None:
        """pdb in global ``rank``'s kept frames, on its host (hosts/debugging.py), until the debugger is left."""
        self.check_usable()
        host, local = self.numbering.place(rank)
        calls = [self.client[engine].apply_async(on_host.debug, local if index == host else None)
                 for index, engine in enumerate(self.engines)]
        self._follow(HostsRequest(self, calls, record=self._record(f"%debug (rank {self.label(rank)} of cell {run_id})",
                                                                    self.devices), numbering=self.numbering))

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        self.check_usable()
        self.runner.release_post_mortem("%xla_pool push reached its ranks since")
        check_names(names, user_ns)
        blob = payload.pickle_namespace({name: user_ns[name] for name in names})  # once, for every host
        calls = self._call_hosts(on_host.push, [(blob,)] * len(self.hosts))
        self._follow(HostsRequest(self, calls, record=self._record(f"%xla_pool push {' '.join(names)}", self.devices),
                                  numbering=self.numbering))

    def pull(self, name: str, rank: int | None) -> Any:
        self.check_usable()
        self.runner.release_post_mortem("%xla_pool pull reached its ranks since")
        check_rank(rank, self.world_size, "the pool across hosts")
        calls = self._call_hosts(on_host.pull, [(name,)] * len(self.hosts))
        request = HostsRequest(self, calls, record=self._record(f"%xla_pool pull {name}", self.devices),
                               numbering=self.numbering)
        every = request.by_rank(self._follow(request))
        return every if rank is None else every[rank]

    def _call_hosts(self, function: Callable[..., Any], args_by_host: list[tuple[Any, ...]]) -> list[Any]:
        """``function(*args)`` on each host's engine, as one ipyparallel AsyncResult per host, in host order.

        Where every host gets the same arguments (a cell whose values every host holds, a push, a pull) it
        is one apply to every engine: ipyparallel packs the message once and sends it to each in turn.
        """
        if all(args == args_by_host[0] for args in args_by_host):
            return list(self.client[self.engines].apply_async(function, *args_by_host[0]).split())
        return [self.client[engine].apply_async(function, *args) for engine, args in zip(self.engines, args_by_host)]

    def _follow(self, request: HostsRequest) -> list[Any]:
        """``request`` to its end; meanwhile the pool is running (its engines are busy: nothing else asks them)."""
        self.state = "running"
        try:
            return request.wait()
        finally:
            if request.broken is not None and self.state != "broken":
                self.mark_broken(request.broken)
            if self.state == "running":
                self.state = "ready"

    def _record(self, label: str, devices: int, run_id: int | None = None) -> RunRecord:
        """A run of every global rank in the session's history: the panel shows it, and can interrupt it."""
        history = self.runner.history
        record = RunRecord(run_id or history.next_run_id(), label, self.backend, devices * len(self.hosts))
        record.ranks = {rank: RankState(state="running", pid=self.pids.get(rank))
                        for rank in range(devices * len(self.hosts))}
        history.remember(record)
        history.notify(record)
        return record

    # -- describing -----------------------------------------------------------------

    def facts(self) -> list[tuple[str, str]]:
        return [("Pool", f"across hosts: {self.describe()}")] + self.host_lines()

    def cache_fact(self) -> str:
        """Each host's cache, as its engine last said (its size read there); where none said, what it was told."""
        said = [(row["index"], row["cache"]) for row in (self._rows or self.status()) if row.get("cache")]
        if not said:
            return self._cache_described()
        return "; ".join(f"h{index}: {text}" for index, text in said)

    def _cache_described(self) -> str:
        if self.cache is None:
            return ("each host's default (off on XLA:CPU; on a TPU under its own ~/.cache/xla_magic/compile-cache, "
                    "or its XLA_MAGIC_COMPILE_CACHE)")
        return self.cache.describe(self.backend == "cpu")

    def describe(self) -> str:
        state = self.state if self.problem is None else f"{self.state} ({self.problem})"
        return (f"{state}: {len(self.hosts)} hosts x {self.devices} ranks on the {self.backend} backend "
                f"({self.world_size} ranks in all), controller on {self.address}; {self.cells} cell(s) run")

    def status(self, patience: float = 2.0) -> list[dict[str, Any]]:
        """Each host: its address, its engine, launcher and ranks (what the engine says, or why it cannot).

        While a request runs the engines are busy with it: then what they said
        last, and the running request's record says where each rank is.
        """
        if self.state == "running":
            return self._rows or [self._row(index, "busy with a cell") for index in range(len(self.hosts))]
        rows: list[dict[str, Any]] = []
        for index in range(len(self.hosts)):
            row = self._row(index)
            try:
                row.update(self.client[self.engines[index]].apply_async(on_host.status).get(patience))
            except Exception as exc:  # a dead engine, or one that does not answer: say so, the panel must not fail
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
        self._rows = rows
        return rows

    def _row(self, index: int, error: str | None = None) -> dict[str, Any]:
        row: dict[str, Any] = {"host": self.hosts[index], "index": index, "engine": self.engines[index],
                               "ranks": _listed(self.numbering.ranks_of(index))}
        if error is not None:
            row["error"] = error
        return row

    def host_lines(self) -> list[tuple[str, str]]:
        """(name, facts) per host, for %xla_status."""
        lines = []
        for row in self.status():
            name = f"Host h{row['index']} {row['host']}"
            if "error" in row:
                lines.append((name, f"engine {row['engine']} (pid {self.engine_pids[row['index']]}) does not "
                                    f"answer now (busy with a cell, or gone): {row['error']}"))
                continue
            launcher = row.get("launcher") or {}
            pool = row.get("pool") or {}
            alive = "" if launcher.get("alive", True) else " (dead)"
            xla = "XLA-free" if row.get("xla_free") else "holds XLA"
            lines.append((name, f"{row['hostname']}: engine {row['engine']} pid {row['pid']} ({xla}); launcher pid "
                                f"{launcher.get('pid', '-')}{alive}; ranks {row['ranks']}: {pool.get('describe', 'none')}"))
        return lines


def _listed(ranks: list[int]) -> str:
    """``r4-r7``, or ``r1,r3,r5,r7`` where a host's ranks are not contiguous."""
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"r{ranks[0]}-r{ranks[-1]}"
    return ",".join(f"r{rank}" for rank in ranks)


def _exited(engine: Any) -> bool:
    """Whether an engine's launch command has exited (ipyparallel's own notice needs its event loop running)."""
    import psutil

    popen = getattr(engine, "_popen_process", None)  # set by HostEngineLauncher.start
    if popen is not None and popen.poll() is not None:
        return True
    try:
        return engine.process is not None and engine.process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _end_group(leader: int | None) -> None:
    """SIGKILL what is left of the controller's process group (its forked heart monitor)."""
    if leader and leader > 0:
        try:
            os.killpg(leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kernel_python() -> str:
    import sys

    return sys.executable


def _private(profile: str) -> None:
    """Make the cluster's connection files (they hold its key) readable by this user only."""
    security = os.path.join(profile, "security")
    for name in os.listdir(security) if os.path.isdir(security) else []:
        os.chmod(os.path.join(security, name), stat.S_IRUSR | stat.S_IWUSR)


__all__ = ["HostsPool"]
