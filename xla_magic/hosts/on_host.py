"""One host's part of a pool across several hosts. Runs in that host's ipyparallel engine (XLA-free).

The kernel calls these functions on every engine at once (``DirectView.apply``).
Each host runs this package's own single-host machinery: a
:class:`~xla_magic.runs.runner.Runner` (launcher, private directory) and a
:class:`~xla_magic.pools.this_host.LocalPool`, told which part of the world it is
(global rank offset, world size, the TCP store on host 0). It knows nothing
of the kernel's session. Its output goes to the engine's stdout, tagged
``[hH rN]``, which ipyparallel streams to the kernel; every call answers with
a :class:`HostOutcome`, so that a failure, an interrupt or a timeout on this
host reaches the kernel as facts, not as a folded remote traceback. The
kernel's values a cell reads arrive only when they changed
(``hosts.shipping``): the engine keeps them between cells.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, TypedDict

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache
from xla_magic.ranks import memory_answers
from xla_magic.runs import watch
from xla_magic.runs.errors import RankError, RunInterrupted
from xla_magic.runs.history import History
from xla_magic.hosts import link as kernel_link
from xla_magic.hosts.metrics import Publisher
from xla_magic.hosts import profiles
from xla_magic.pools.this_host import LocalPool
from xla_magic.cell.options import Cell, PoolOptions
from xla_magic.runs.record import RunRecord
from xla_magic.runs.runner import Runner, plan
from xla_magic.runs.sink import Sink
from xla_magic.wire import protocol


NEWS = "xla_magic"  # the key of a host's live news in its call's ipyparallel data
ASKED = "xla_magic_asked"  # the key of the last question's id, sent after the output before it (hosts/link.py)
QUIET_NEWS = 0.25  # s: a running cell's news start this long after it began (a trivial cell's never go)


class HostFailure(TypedDict):
    rank: int  # local to the host
    type: str
    message: str
    traceback: str
    exit_code: int | None


class HostOutcome(TypedDict, total=False):
    """What one call on one host came to (engine -> kernel)."""

    outcome: str  # ok, failed, interrupted, refused; the kernel adds lost (the engine died or did not answer)
    value: Any  # ok: the call's value
    message: str  # interrupted, refused, lost
    summary: str  # failed
    failures: list[HostFailure]  # failed
    debuggable: list[int]  # failed: the failed ranks that keep the cell's frames for %debug, by local rank
    results: dict[int, Any]  # failed, interrupted: the values of the ranks that finished, by local rank
    broken: str | None  # the host's pool broke: why
    stacks: dict[int, dict[str, Any]]  # failed, interrupted: where each rank was at the stop, by local rank
    stacks_when: str  # failed, interrupted: when that was (the watch's words: "at the interrupt", ...)
    profile: list[profiles.SentTrace]  # a --profile cell: this host's trace files (hosts/profiles.py)
    accounts: list[dict[str, Any]]  # a cell: what XLA did in each rank process (its ranks local), however it ended
    ordinals: dict[int, int]  # a cell in fresh ranks: each one's global rank (torch_xla's ordinal), by local rank


class Here:
    """This host's part: its runner, its pool, and the kernel's values it holds."""

    def __init__(self, world: protocol.World) -> None:
        self.world = world
        self.runs = History()
        self.runs.listeners.append(self._tell_kernel)
        self.logged = Publisher(self._global_rank)  # what its ranks log(), sent on to the kernel's chart
        self.runs.listeners.append(self.logged.notice)
        self.runner = Runner(self.runs, HostRelay())  # it prints (ipyparallel relays it); questions go to the kernel
        self.pool: LocalPool | None = None
        self.values: dict[str, Any] = {}
        self.received: tuple[str, ...] = ()  # the names the last cell brought (the others were here already)
        self._told: Any = None  # the last news sent, so that nothing goes twice

    def _tell_kernel(self, record: RunRecord) -> None:
        """The running cell's news, live, for the kernel's one view of every host's ranks (hosts/request.py):
        each rank's state and place, where its sampler last said it was and for how long, by local rank.

        Sent as ipyparallel data (``publish_data``) on the engine's IOPub while the call runs: the engine
        answers nothing else until the call ends. Never raises: it is a listener."""
        try:
            if record.outcome != "running" or (not record.stacks and time.time() - record.started < QUIET_NEWS):
                return  # its end comes as the call's answer; a cell this short has no news for the panel yet
            news = {"run": record.run_id, "ranks": {rank: (state.state, state.where)
                                                    for rank, state in record.ranks.items()},
                    "stacks": dict(record.stacks), "since": dict(record.arrived), "ordinals": _ordinals(record)}
            if news == self._told:
                return
            self._told = news
            now = time.monotonic()
            waited = {rank: now - since for rank, since in record.arrived.items()}
            from ipyparallel.datapub import publish_data

            publish_data({NEWS: dict(news, waited=waited)})
        except Exception:  # noqa: BLE001 - not in an engine, or the news cannot travel: the kernel waits for the end
            pass

    def _global_rank(self, record: RunRecord, local: int) -> int:
        """A rank's global rank: as it said when it started (fresh ranks), or as the pool's said at its start."""
        state = record.ranks.get(local)
        if state is not None and state.ordinal is not None:
            return state.ordinal
        if self.pool is not None:
            return self.pool.ranks.global_rank(local)
        return self.world["rank_offset"] + local

    def renew(self, world: protocol.World) -> None:
        """This host's part of a new world: its pool's ranks end; its launcher and values stay."""
        pool, self.pool = self.pool, None
        self.world = world
        if pool is not None:
            pool.stop()

    def close(self) -> None:
        try:
            if self.pool is not None:
                self.pool.stop()
        finally:
            self.runner.close()


_here: Here | None = None
_link: kernel_link.Link | None = None  # to the kernel, for its ranks' questions
_asked = 0  # the last question's id


def identify() -> dict[str, Any]:
    """Which host this engine is (its index as the kernel gave it), and its pids."""
    return {"index": int(os.environ.get("XLA_MAGIC_HOST_INDEX", "-1")), "hostname": socket.gethostname(),
            "pid": os.getpid()}


def free_port(address: str) -> int:
    """A port free now on ``address`` (host 0's, for the world's TCP store)."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def link(ticket: dict[str, Any], index: int) -> HostOutcome:
    """Link to the kernel (hosts/link.py) as host ``index``; once per engine, again only when it starts anew."""

    def connect() -> None:
        global _link
        old, _link = _link, None
        if old is not None:
            old.close()
        try:
            _link = kernel_link.connect(ticket, index, _cluster_key())
        except kernel_link.LinkError as exc:
            raise UsageError(f"this host could not link to the kernel: {exc}") from None

    return _outcome(connect)


def _cluster_key() -> bytes:
    """The cluster's key, as this engine got it on its stdin (hosts/engine.py): the link's token is made from it."""
    from ipyparallel.engine.app import IPEngine

    if not IPEngine.initialized():
        raise UsageError("this is not an ipyparallel engine, so it holds no cluster key to link to the kernel with")
    return bytes(IPEngine.instance().session.key)


class HostRelay(Sink):
    """One host's sink: what its requests write is printed, which ipyparallel relays to the kernel as the call's
    output (hosts/request.py tags and shows it); a rank's question goes to the kernel through the link."""

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        return _ask_kernel(question)


def _ask_kernel(question: dict[str, Any]) -> dict[str, Any]:
    """A rank's question (runs/questions.py), asked in the kernel through the link; the kernel's reply. The kernel's
    interrupt (SIGINT: ``_interrupt``) ends the wait as it ends a cell; a lost link is an end of input here."""
    global _link, _asked
    if _link is None:
        return {"eof": f"this host has no link to the kernel, so nothing answers {question['what']} on "
                       f"{question['who']}"}
    _asked += 1
    asked = _asked
    sys.stdout.flush()  # what the ranks printed before they asked goes first: the kernel waits for ASKED
    sys.stderr.flush()
    try:
        from ipyparallel.datapub import publish_data

        publish_data({ASKED: asked})
    except Exception:  # noqa: BLE001 - not in an engine: the kernel asks without waiting for the output
        pass
    try:
        _link.send(kernel_link.ASK, id=asked, **question)
        while True:
            record = _running_record()
            if record is not None and record.interrupt_requested:
                raise KeyboardInterrupt
            frame = _link.receive(0.1)
            if frame is not None and frame.get("kind") == kernel_link.ANSWER and frame.get("id") == asked:
                return dict(frame["reply"])
    except kernel_link.LinkError as exc:
        lost, _link = _link, None
        lost.close()
        return {"eof": f"this host's link to the kernel is lost ({exc}), so nothing answers {question['what']} on "
                       f"{question['who']}"}


def ranks_here(devices: int | None, backend: str) -> HostOutcome:
    """How many ranks this host would run for ``--devices`` / ``--backend`` (its own devices decide)."""

    def count() -> dict[str, Any]:
        placement = plan(backend, devices, "%xla_pool start --hosts")
        return {"ranks": placement.ranks, "backend": placement.backend}

    return _outcome(count)


def start(world: protocol.World, devices: int, backend: str,
          cache: compile_cache.CacheSetting | None = None) -> HostOutcome:
    """Start this host's pool ranks as the ``world`` part the kernel says, with the kernel's ``--compile-cache``
    (None: this host's default); the value: their pids, and how each opened its compile cache, by local rank.

    Again on a host that has a pool (the kernel's ``%xla_pool restart``): its ranks end and new ones start,
    with the same launcher and the kernel's values this host holds."""
    global _here
    here = _here
    if here is None:
        here = _here = Here(world)
        atexit.register(stop)
    else:
        here.renew(world)

    def start_pool() -> dict[str, Any]:
        here.pool = LocalPool.start(here.runner, PoolOptions(devices=devices, backend=backend, compile_cache=cache),
                                    world)
        return {"pids": dict(here.pool.pids), "cache": dict(here.pool.ranks.cache_facts),
                "ordinals": dict(here.pool.ranks.ordinals)}  # each one's global rank: the kernel names them so

    return _outcome(start_pool)


def run_cell(source: str, sent: dict[str, bytes], names: tuple[str, ...], timeout: float | None,
             kernel_place: dict[str, Any], profile: bool = False, hang_after: float | None = None,
             run_id: int | None = None, xla_report: str = "auto") -> HostOutcome:
    """A cell in this host's pool; ``sent``: the kernel's values it reads that changed since this host got them.

    The cell runs in the kernel's place (``xla_magic.cell.place``), not the engine's: its ranks get it when it
    changed since they last did, as on one host. ``profile``: --profile, whose files come with the answer.
    ``run_id``: the kernel's number of the cell, which names it here too (``<xla_spawn cell N>``)."""
    here = _require()
    _number(here, run_id)
    values = _take(here, sent, names)
    cell = Cell(source, values, timeout=timeout, place=kernel_place, profile=profile, hang_after=hang_after,
                xla_report=xla_report)
    return _told(here, cell, lambda: _pool(here).run_cell(cell))


def run_fresh(source: str, sent: dict[str, bytes], names: tuple[str, ...], timeout: float | None,
              kernel_place: dict[str, Any], world: protocol.World, devices: int, profile: bool = False,
              hang_after: float | None = None, run_id: int | None = None,
              cache: compile_cache.CacheSetting | None = None, xla_report: str = "auto") -> HostOutcome:
    """A cell in ranks spawned for it on this host, as its part of a fresh ``world`` across the hosts."""
    here = _require()
    _number(here, run_id)
    values = _take(here, sent, names)
    pool = _pool(here)
    cell = Cell(source, values, devices=devices, backend=pool.ranks.backend, timeout=timeout, fresh=True,
                place=kernel_place, profile=profile, hang_after=hang_after, compile_cache=cache,
                xla_report=xla_report)
    return _told(here, cell, lambda: pool.run_fresh(cell, world))


def _number(here: Here, run_id: int | None) -> None:
    """The next run here is the kernel's ``run_id``: a traceback's ``<xla_spawn cell N>`` is the cell the kernel says."""
    if run_id is not None:
        here.runs.run_count = run_id - 1


def _told(here: Here, cell: Cell, call: Callable[[], Any]) -> HostOutcome:
    """``call``'s outcome, with what XLA did in each rank process (``accounts``: the kernel reports every host's)
    and, for a --profile cell, this host's trace files (``profile``), however it ended."""
    before, began = here.runs.last_profiled, here.runs.last_cell
    outcome = _outcome(call)
    record = here.runs.last_cell
    here.logged.flush(record if record is not began else None)  # what it logged last, before the answer
    if record is not None and record is not began:
        shared = {id(state.xla): state.xla for state in record.ranks.values() if state.xla is not None}
        outcome["accounts"] = list(shared.values())  # rank threads of one process share one
        outcome["ordinals"] = _ordinals(record)
    if cell.profile:
        record = here.runs.last_profiled
        outcome["profile"] = profiles.collect(record if record is not before else None)
    return outcome


def _ordinals(record: RunRecord) -> dict[int, int]:
    """The global rank each rank of ``record`` said it is when it started (fresh ranks; a pool's said at its start)."""
    return {rank: state.ordinal for rank, state in record.ranks.items() if state.ordinal is not None}


def _take(here: Here, sent: dict[str, bytes], names: tuple[str, ...]) -> dict[str, Any]:
    """Keep what the kernel sent; the values of ``names``, as this host holds them."""
    import cloudpickle

    got: dict[str, Any] = {}
    for blob in sent.values():
        got.update(cloudpickle.loads(blob))
    here.values.update(got)  # all or nothing: the kernel counts them as held once this call answers
    here.received = tuple(sorted(got))
    return {name: here.values[name] for name in names if name in here.values}


def received() -> tuple[str, ...]:
    """The names of the kernel's values the last cell brought to this host."""
    return _require().received


def push(names: bytes) -> HostOutcome:
    import cloudpickle

    def push_all() -> None:
        values = cloudpickle.loads(names)
        _pool(_require()).push(list(values), values)

    return _outcome(push_all)


def pull(name: str) -> HostOutcome:
    return _outcome(lambda: _pool(_require()).pull(name, None))


def debug(rank: int | None) -> HostOutcome:
    """``%debug`` on this host: pdb in local ``rank``'s kept frames of its last failed cell, until left (the
    kernel said which, and printed it); ``None``: another host's rank, nothing to do here."""
    if rank is None:
        return {"outcome": "ok", "value": None}
    here = _require()

    def open_frames() -> None:
        kept = here.runner.post_mortem
        if kept is None or rank not in kept.debuggable:
            raise UsageError("this host's ranks no longer hold that cell's frames: a rank keeps them until the next "
                             "cell")
        kept.open(here.runner, rank)

    return _outcome(open_frames)


def where_now(everything: bool, with_locals: bool = False) -> dict[int, dict[str, Any]]:
    """Where this host's pool ranks are now, by local rank, threads a cell left running included (``%xla_stacks``
    between cells: the engine is free then); empty when its pool does not run."""
    here = _here
    pool = here.pool if here is not None else None
    if pool is None or pool.state != "ready":
        return {}
    return watch.where_now(pool.ranks, everything, with_locals)


def memory_now(full: int | None) -> dict[int, dict[str, Any]]:
    """What holds this host's pool ranks' device memory, by local rank (``%xla_memory`` between cells); local rank
    ``full`` lists its holders. Empty when its pool does not run."""
    here = _here
    pool = here.pool if here is not None else None
    if pool is None or pool.state != "ready":
        return {}
    return memory_answers.ask(pool, list(range(pool.world_size)), -1 if full is None else full)


def status() -> dict[str, Any]:
    """The host's engine, launcher and ranks, for %xla_status."""
    here = _here
    facts: dict[str, Any] = {**identify(), "launcher": None, "pool": None,
                             "xla_free": "torch_xla" not in sys.modules and "_XLAC" not in sys.modules}
    if here is not None:
        launcher = here.runner.launcher
        if launcher is not None:
            facts["launcher"] = {"pid": launcher.pid, "alive": launcher.alive()}
        pool = here.pool
        if pool is not None and pool.state != "stopped":
            facts["pool"] = {"state": pool.state, "problem": pool.problem, "pids": dict(pool.pids),
                             "describe": pool.ranks.describe()}
            facts["cache"] = pool.cache_fact()  # its size read here, on this host's disk
    return facts


def stop() -> None:
    """End this host's ranks and launcher, and remove their files."""
    global _here, _link
    here, _here = _here, None
    lost, _link = _link, None
    if lost is not None:
        lost.close()
    if here is not None:
        here.close()


def _require() -> Here:
    if _here is None:
        raise RuntimeError("this host's pool was not started (the kernel starts it with %xla_pool start --hosts)")
    return _here


def _pool(here: Here) -> LocalPool:
    if here.pool is None or here.pool.state == "stopped":
        raise UsageError("this host's pool did not start; %xla_pool restart starts it anew")
    return here.pool


_running = False  # whether a call is in progress: only then does SIGINT (the kernel's interrupt) stop it


def _interrupt(signum: int, frame: Any) -> None:
    """The kernel's SIGINT: the running request stops at its next look, as at the panel's Interrupt button.

    A flag, not an exception, once a request runs: a SIGINT that arrives
    while the host already stops its cell (its own timeout, say) must not
    read as a second interrupt, which kills the ranks. A SIGINT meant for a
    call that has just ended must not hit what the engine does next.
    """
    if not _running:
        return
    running = _running_record()
    if running is None:
        raise KeyboardInterrupt
    running.interrupt_requested = True


def _running_record() -> Any:
    history = _here.runs.records if _here is not None else []
    return history[-1] if history and history[-1].outcome == "running" else None


def _outcome(call: Callable[[], Any]) -> HostOutcome:
    """Run ``call``; what came of it, as plain data: ok (and the value), failed, interrupted or refused.

    ipykernel restores its own SIGINT handler (which ignores it) once the call returns. The engine flushes
    the call's output before it replies (each flush waits for ipykernel's IO thread: not twice)."""
    global _running
    _running = True
    signal.signal(signal.SIGINT, _interrupt)
    try:
        value = call()
    except RankError as exc:
        failures = [HostFailure(rank=f.rank, type=f.type, message=f.message, traceback=f.traceback,
                                exit_code=f.exit_code) for f in exc.failures]
        kept = list(exc.debuggable) if exc.post_mortem is not None else []
        return {"outcome": "failed", "summary": exc.summary, "failures": failures, "results": exc.results,
                "debuggable": kept, "broken": _broken(), **_where()}
    except RunInterrupted as exc:
        return {"outcome": "interrupted", "message": str(exc).split("\n")[0], "results": exc.results,
                "broken": _broken(), **_where()}
    except KeyboardInterrupt:
        return {"outcome": "interrupted", "message": "interrupted", "results": {}, "broken": _broken()}
    except UsageError as exc:
        return {"outcome": "refused", "message": str(exc), "broken": _broken()}
    finally:
        _running = False
    return {"outcome": "ok", "value": value}


def _where() -> HostOutcome:
    """Where this host's ranks were when its last cell was stopped, raw: the kernel groups every host's."""
    history = _here.runs.records if _here is not None else []
    record = history[-1] if history else None
    if record is None or not record.stacks:
        return {}
    return {"stacks": dict(record.stacks), "stacks_when": record.stacks_when}


def _broken() -> str | None:
    pool = _here.pool if _here is not None else None
    return pool.problem if pool is not None and pool.state == "broken" else None
