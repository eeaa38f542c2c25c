"""Kept pools seen from the kernel: start one, attach to one, list them, end one. Runs in the kernel.

A kept pool (``%xla_pool start --keep NAME``) is a pool on this host whose
launcher lives in its own session and outlives the kernel
(launcher/keeper.py). The kernel drives its ranks exactly as a pool's
(:class:`KeptPool` is a :class:`~xla_magic.pools.this_host.LocalPool`); what
differs is the link: one socket to the kept launcher, inherited at start
or connected through the pool's Unix socket at ``%xla_pool attach``, which
hands over the kernel's ends of the ranks' sockets (SCM_RIGHTS). A new
kernel's next cell then finds the old names, and the graphs compiled
before, in the ranks.

A cell running in the pool is named in the pool's ``run.json`` while it
runs, and a background run's log is kept in the pool's directory: a kernel
that attaches after the one that sent it went takes the run over
(:meth:`KeptPool.follow_run`, runs/background.py's ``Runs.adopt``).
"""

from __future__ import annotations

import dataclasses
import os
import select
import selectors
import shutil
import socket
import time
from types import SimpleNamespace
from typing import Any

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache, payload
from xla_magic.ranks import probe
from xla_magic.ranks.launcher_client import Launcher, LauncherError, PrivateDir
from xla_magic.ranks import policy
from xla_magic.cell.options import PoolOptions
from xla_magic.pools.this_host import LocalPool
from xla_magic.ranks.ranks import Conn, Ranks
from xla_magic.runs.request import Request
from xla_magic.runs.runner import Runner
from xla_magic.runs.background import first_line
from xla_magic.wire import kept, protocol

MAX_FDS = 253  # SCM_RIGHTS limit on Linux: a supervisor and 4 sockets a rank, for up to 63 ranks
ANSWER_TIMEOUT = 10.0  # for the kept launcher to answer an attach or an end
END_WAIT = 10.0  # for its launcher to be gone once it said ENDING


def check_name(name: str) -> str:
    if not kept.NAME.match(name):
        raise UsageError(f"a kept pool's name is letters, digits, '.', '_' or '-' (at most 40, starting with a "
                         f"letter or digit), like %xla_pool start --keep model; not {name!r}")
    return name


# --- the link -----------------------------------------------------------------------


class Link:
    """The kernel's one socket to a kept pool's launcher, inherited at start or connected at attach."""

    def __init__(self, name: str, channel: protocol.Channel, pid: int, process: Any = None) -> None:
        self.name = name
        self.channel = channel
        self.pid = pid
        # What Ranks.launcher_death reads: the Popen of the launcher this kernel started, else its pid's state
        self.process = process or SimpleNamespace(returncode=None)

    def alive(self) -> bool:
        return kept.process_alive(self.pid)

    def hold(self, ranks: Ranks) -> None:
        """Give the launcher a copy of the kernel's ends of the ranks' sockets, and what drives them."""
        self.channel.send_with_fds(held_sockets(ranks), kept.HOLD, **held_fields(ranks))

    def taken_over(self) -> str | None:
        """Why this kernel may no longer drive the pool (another kernel took it, its launcher went), or None."""
        sock = self.channel.sock
        if sock.fileno() < 0:
            return f"this kernel left kept pool {self.name}"
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return None
        try:
            event, fds = self.channel.recv_with_fds(MAX_FDS)
        except (OSError, ConnectionError):
            event, fds = protocol.Event(protocol.CLOSED, {}), []
        for fd in fds:
            os.close(fd)
        sock.close()
        if event.kind == kept.STOLEN:
            return (f"kept pool {self.name} was taken over by the kernel with pid {event.fields.get('pid')}; "
                    f"%xla_pool attach {self.name} --steal takes it back")
        return f"kept pool {self.name}'s launcher is gone ({_log_hint(self.name)})"

    def end(self) -> None:
        """Tell the launcher to end the pool; wait until it said so (its ranks go as it goes)."""
        try:
            self.channel.sock.settimeout(ANSWER_TIMEOUT)
            self.channel.send_with_fds([], kept.END)
            self.channel.recv_with_fds(MAX_FDS)
        except (OSError, ConnectionError):
            pass
        finally:
            self.channel.sock.close()

    def close(self) -> None:
        self.channel.sock.close()


def _log_hint(name: str) -> str:
    return f"its log: {kept.log_path(name)}"


# --- what the launcher holds for the next kernel ------------------------------------------


def held_sockets(ranks: Ranks) -> list[int]:
    """The kernel's ends, in the order the job handed over the far ends: supervisor, then per rank its four."""
    assert ranks.supervisor is not None
    fds = [ranks.supervisor.sock.fileno()]
    for rank in range(ranks.size):
        fds += [ranks.events[rank].sock.fileno(), ranks.outputs[2 * rank].sock.fileno(),
                ranks.outputs[2 * rank + 1].sock.fileno(), ranks.samplers[rank].sock.fileno()]
    return fds


def held_fields(ranks: Ranks) -> dict[str, Any]:
    """Plain values only: the launcher keeps them without importing anything of the kernel's side."""
    cache = ranks.cache
    return {
        "placement": dataclasses.asdict(ranks.placement), "requested_backend": ranks.requested_backend,
        "cache": {"root": cache.root, "forced": cache.forced, "source": cache.source},
        "supervisor_pid": ranks.supervisor_pid, "pids": dict(ranks.pids), "thread_ranks": sorted(ranks.thread_ranks),
        "started": ranks.started, "start_seconds": ranks.start_seconds, "store": ranks.store,
        "hang_after": ranks.hang_after, "cache_facts": dict(ranks.cache_facts),
        "describe": ranks.describe().split(", up ")[0].removeprefix("ready: "), "backend": ranks.backend,
    }


def attached_ranks(fields: dict[str, Any], fds: list[int], workdir: PrivateDir, link: Link) -> Ranks:
    """A ready Ranks for the sockets the launcher handed over, as the kernel that started them left them."""
    placement = probe.Placement(**{key: tuple(value) if isinstance(value, list) else value
                                   for key, value in fields["placement"].items()})
    ranks = Ranks(placement, policy.POOL, fields["requested_backend"], workdir,
                  cache=compile_cache.CacheSetting(**fields["cache"]))
    socks = [socket.socket(fileno=fd) for fd in fds]
    ranks.supervisor = Conn(socks[0], None, "supervisor")
    ranks.selector.register(socks[0], selectors.EVENT_READ, ranks.supervisor)
    for rank in range(ranks.size):
        events, stdout, stderr, stacks = socks[1 + 4 * rank: 5 + 4 * rank]
        for sock, kind, into in ((events, "events", ranks.events), (stdout, "stdout", ranks.outputs),
                                 (stderr, "stderr", ranks.outputs), (stacks, "stacks", ranks.samplers)):
            conn = Conn(sock, rank, kind)
            into.append(conn)
            ranks.selector.register(sock, selectors.EVENT_READ, conn)
    ranks.launcher = link  # type: ignore[assignment]  # what launcher_death asks: alive(), process.returncode
    ranks.supervisor_pid = fields["supervisor_pid"]
    ranks.pids = {int(rank): pid for rank, pid in fields["pids"].items()}
    ranks.thread_ranks = set(fields["thread_ranks"])
    ranks.started, ranks.start_seconds, ranks.store = fields["started"], fields["start_seconds"], fields["store"]
    ranks.hang_after = fields["hang_after"]
    ranks.cache_facts = {int(rank): fact for rank, fact in fields["cache_facts"].items()}
    ranks.state = "ready"
    # A rank answers a request whose seq differs from the last it answered: the old kernel's counted from 1
    ranks._seq = int(time.time() * 1000)
    return ranks


# --- the pool ---------------------------------------------------------------------------


class KeptPool(LocalPool):
    """A pool on this host whose ranks outlive the kernel: driven as any, linked to its kept launcher."""

    def __init__(self, runner: Runner, ranks: Ranks, xla_report: str | None, link: Link, idle: float) -> None:
        super().__init__(runner, ranks, xla_report)
        self.link = link
        self.name = link.name
        self.idle = idle
        self.left = False  # this kernel let go of the pool: a run it followed goes on for the next one

    @classmethod
    def start_kept(cls, runner: Runner, options: PoolOptions) -> KeptPool:
        """``%xla_pool start --keep NAME``: the pool's own launcher in its directory, then its ranks, held there."""
        name = check_name(options.keep or kept.DEFAULT_NAME)
        idle = options.keep_idle if options.keep_idle is not None else kept.DEFAULT_IDLE
        found = describe_kept(name)
        if found is not None:
            raise UsageError(f"a pool named {name} is kept already ({found}): %xla_pool attach {name} to use it, "
                             f"%xla_pool stop {name} to end it, or give another name")
        shutil.rmtree(kept.directory(name), ignore_errors=True)  # what a pool that ended without tidying left
        try:
            path = kept.make_directory(name)
        except OSError as exc:
            raise UsageError(f"cannot make the kept pool's directory {kept.directory(name)}: {exc}") from exc
        launcher = Launcher(runner.workdir, kept=(name, path, idle))
        try:
            launcher.wait_ready()
        except LauncherError as exc:
            launcher.stop()
            raise UsageError(str(exc)) from exc
        link = Link(name, launcher.channel, launcher.pid, launcher.process)
        try:
            ranks = cls.start_ranks(runner, options, launcher=launcher, store_home=path)
        except BaseException:
            link.end()
            launcher.stop()
            raise
        ranks.launcher = link  # type: ignore[assignment]
        link.hold(ranks)
        return cls(runner, ranks, options.xla_report, link, idle)

    @classmethod
    def attach(cls, runner: Runner, name: str, steal: bool) -> KeptPool:
        """``%xla_pool attach NAME``: connect to the kept pool, take its ranks' sockets, and drive them."""
        check_name(name)
        channel = connect(name)
        try:
            channel.send_with_fds([], kept.ATTACH, pid=os.getpid(), steal=steal)
            event, fds = channel.recv_with_fds(MAX_FDS)
        except (OSError, ConnectionError) as exc:
            channel.sock.close()
            raise UsageError(f"kept pool {name} did not answer ({exc}); {_log_hint(name)}") from exc
        if event.kind != kept.HELD:
            channel.sock.close()
            raise UsageError(event.fields.get("message") or f"kept pool {name} went while attaching "
                             f"({_log_hint(name)})")
        channel.sock.settimeout(None)
        record = kept.read_record(name) or {}
        link = Link(name, channel, int(record.get("pid") or 0))
        ranks = attached_ranks(event.fields, fds, runner.workdir, link)
        return cls(runner, ranks, None, link, float(record.get("idle_limit") or kept.DEFAULT_IDLE))

    # -- the run going on, which outlives the kernel that sent it --------------------------

    def runs_directory(self) -> str:
        """Where the background runs in this pool keep their logs: the pool's own directory, not the session's."""
        path = os.path.join(kept.directory(self.name), kept.RUNS)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def run_admitted(self, cell: Any) -> Any:
        """A cell in the kept ranks, named in ``run.json`` while it runs: a kernel that attaches after this one
        went follows it to its end (:meth:`follow_run`)."""
        # The ids the runner gives this request next: its run's (a background run's has it), then the seq.
        run_id = cell.run_id or self.runner.history.run_count + 1
        log = os.path.join(self.runs_directory(), f"run-{run_id}-kernel-{os.getpid()}.jsonl")
        has_result, _, _ = payload.analyse(cell.source, "<xla_spawn cell>")
        kept.write_record(kept.directory(self.name), {
            "id": run_id, "seq": self.ranks._seq + 1, "cell": cell.source, "has_result": has_result,
            "log": log if os.path.exists(log) else None, "started": time.time(), "kernel": os.getpid(),
        }, kept.RUN)
        try:
            return super().run_admitted(cell)
        finally:
            self._followed(run_id)

    def _followed(self, run_id: int) -> None:
        """This kernel stopped following run ``run_id``: it ended, unless the kernel let go of the pool while the
        run went on (:meth:`leave` said so in ``run.json``)."""
        if not self.left:
            self.run_ended(run_id)

    def run_going(self) -> dict[str, Any] | None:
        """The run a kernel that went left going in the pool (``run.json``), if any."""
        going = kept.read_run(self.name)
        if going is None or kept.process_alive(going.get("kernel")):
            return None  # (a kernel that still runs follows it itself: one whose pool was taken over with --steal)
        return going

    def run_adopted(self, going: dict[str, Any], log: str) -> None:
        """This kernel follows the run now: ``run.json`` says so (and where its log goes on)."""
        kept.write_record(kept.directory(self.name), {**going, "log": log, "kernel": os.getpid()}, kept.RUN)

    def run_ended(self, run_id: int) -> None:
        going = kept.read_run(self.name)
        if going is not None and going.get("id") == run_id and going.get("kernel") == os.getpid():
            try:
                os.unlink(os.path.join(kept.directory(self.name), kept.RUN))
            except FileNotFoundError:
                pass

    def follow_run(self, going: dict[str, Any]) -> Any:
        """The work of the adopted run's thread: its request, sent by the kernel that went, followed to its end
        on the sockets this kernel got at attach (what the ranks wrote meanwhile waits in them), with its value."""
        runner, ranks = self.runner, self.ranks

        def work(sink: Any) -> Any:
            record = runner.record(int(going["id"]), going["cell"], ranks)
            record.xla_report = "off"
            request = Request(ranks, record, int(going["seq"]), None, workdir=runner.workdir,
                              has_result=bool(going.get("has_result")), on_update=runner.history.notify,
                              hang_after=ranks.hang_after, sink=sink)
            runner.history.remember(record)
            try:
                request.start()
                return ranks.value(request.wait())
            finally:
                self._followed(int(going["id"]))

        return work

    # -- what differs from a pool that is not kept ------------------------------------

    def admit(self, cell: Any) -> None:
        self.check_linked()
        super().admit(cell)

    def push(self, names: list[str], user_ns: Any) -> None:
        self.check_linked()
        super().push(names, user_ns)

    def pull(self, name: str, rank: int | None) -> Any:
        self.check_linked()
        return super().pull(name, rank)

    def check_linked(self) -> None:
        """Before a request: another kernel may have taken the pool over, or its launcher ended it (idle)."""
        why = self.link.taken_over()
        if why is not None:
            self.leave()
            raise UsageError(why)

    def restart(self, options: PoolOptions) -> KeptPool:
        """New ranks, kept as before under the same name (unless another is given)."""
        self.stop()
        return KeptPool.start_kept(self.runner, options.but(
            keep=options.keep or self.name, keep_idle=options.keep_idle if options.keep_idle is not None else self.idle,
            devices=options.devices or self.ranks.devices, backend=options.backend or self.ranks.requested_backend))

    def stop(self) -> None:
        """End the pool: its launcher first (it holds the ranks' sockets too), then the ranks as any pool's."""
        self.link.end()
        self.ranks.stop()

    def leave(self) -> None:
        """The kernel lets go of the pool (its session closes, or another kernel took it): the pool stays."""
        if self.left:
            return
        self.left = True
        going = kept.read_run(self.name)
        if going is not None and going.get("kernel") == os.getpid():  # a run it followed: any kernel may now
            try:
                kept.write_record(kept.directory(self.name), {**going, "kernel": None}, kept.RUN)
            except OSError:
                pass  # the pool is gone meanwhile
        ranks = self.ranks
        ranks.selector.close()
        for conn in ranks.events + ranks.outputs + ranks.samplers + ([ranks.supervisor] if ranks.supervisor else []):
            conn.sock.close()
        self.link.close()
        ranks.release_memory()
        ranks.state = "stopped"

    def describe(self) -> str:
        return f"kept as {self.name} (%xla_pool stop {self.name} ends it): {self.ranks.describe()}"

    def facts(self) -> list[tuple[str, str]]:
        return [("Pool", self.describe())]


def connect(name: str) -> protocol.Channel:
    """A connection to kept pool ``name``'s socket, or the UsageError that says why there is none."""
    path = os.path.join(kept.directory(name), kept.SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ANSWER_TIMEOUT)
        sock.connect(path)
    except FileNotFoundError:
        sock.close()
        known = ", ".join(kept.names()) or "none"
        raise UsageError(f"no kept pool named {name} (kept pools here: {known}); %xla_pool list shows them") from None
    except PermissionError as exc:
        sock.close()
        raise UsageError(f"kept pool {name} is not yours: its directory belongs to another user ({exc})") from exc
    except OSError as exc:
        sock.close()
        shutil.rmtree(kept.directory(name), ignore_errors=True)
        raise UsageError(f"kept pool {name} is gone ({exc}); {_log_hint(name)}") from exc
    return protocol.Channel(sock)


def end_by_name(name: str) -> None:
    """``%xla_pool stop NAME`` for a kept pool this kernel is not attached to: its launcher ends it."""
    check_name(name)
    record = kept.read_record(name) or {}
    channel = connect(name)
    try:
        channel.send_with_fds([], kept.END)
        event, fds = channel.recv_with_fds(MAX_FDS)
        for fd in fds:
            os.close(fd)
    except (OSError, ConnectionError) as exc:
        raise UsageError(f"kept pool {name} did not answer ({exc}); {_log_hint(name)}") from exc
    finally:
        channel.sock.close()
    if event.kind == kept.REFUSED:
        raise UsageError(event.fields.get("message", f"kept pool {name} refused to end"))
    deadline = time.monotonic() + END_WAIT
    while kept.process_alive(record.get("pid")) and time.monotonic() < deadline:
        time.sleep(0.01)


# --- what there is ------------------------------------------------------------------------


def live_records() -> list[dict[str, Any]]:
    """The records of kept pools whose launcher runs; the directories of those that ended untidily go."""
    found = []
    for name in kept.names():
        record = kept.read_record(name)
        if record is None:
            continue
        if not kept.process_alive(record.get("pid")):
            shutil.rmtree(kept.directory(name), ignore_errors=True)
            continue
        found.append(record)
    return found


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def summary(record: dict[str, Any]) -> str:
    """Devices, pid, age, idle time (or the kernel attached) of one kept pool."""
    now = time.time()
    if record.get("kernel"):
        holder = "this kernel" if record["kernel"] == os.getpid() else f"kernel {record['kernel']}"
        use = f"attached to {holder}"
    else:
        idle = now - (record.get("detached_at") or now)
        use = f"no kernel attached for {_ago(idle)} (ends itself at {_ago(record.get('idle_limit') or 0)})"
    going = kept.read_run(record["name"]) if record.get("name") else None
    run = ""
    if going is not None:
        run = f", running run {going.get('id')} ({first_line(str(going.get('cell', '')))})"
    return (f"{record.get('devices')}, pid {record.get('pid')}, up {_ago(now - record.get('started', now))}, {use}"
            f"{run}")


def describe_kept(name: str) -> str | None:
    record = kept.read_record(name)
    if record is None or not kept.process_alive(record.get("pid")):
        return None
    return summary(record)


def listing() -> str:
    """``%xla_pool list``."""
    records = live_records()
    if not records:
        return "no kept pools. %xla_pool start --keep NAME starts one that outlives this kernel"
    return "\n".join(f"{record['name']}: {summary(record)}" for record in records)


def announcement() -> str | None:
    """What ``%load_ext xla_magic`` says of kept pools no kernel is attached to: one line each."""
    lines = [f"pool {record['name']} is kept ({summary(record)}) — %xla_pool attach {record['name']}"
             for record in live_records() if not record.get("kernel") or not kept.process_alive(record["kernel"])]
    return "\n".join(lines) or None


def refuse_if_held(backend: str, devices: int | None, action: str) -> None:
    """New ranks on ``backend`` while a kept pool of another kernel's (or none's) holds its devices: name it.

    The simulation refuses as a TPU would, where the chips are the pool's alone (the runtime's own refusal,
    "TPU in use", names no one)."""
    records = live_records()
    if not records:
        return
    try:
        backend = probe.place(backend, devices).backend
    except probe.PlacementError:
        return  # the start itself says why
    for record in records:
        if record.get("backend") != backend or record.get("kernel") == os.getpid():
            continue
        name = record["name"]
        raise UsageError(f"{action} refused: kept pool {name} holds the devices ({summary(record)}). "
                         f"%xla_pool attach {name} runs cells in it; %xla_pool stop {name} ends it")
