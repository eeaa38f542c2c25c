"""Start the ranks of one run. Runs in a supervisor process, forked per run.

The supervisor leads a new process group (so the kernel can signal the whole
run at once), dies with the launcher, and reports each rank's exit to the
kernel on its own socket. It is a child subreaper: once its ranks are gone
it ends every process they left behind, however they detached, and only
then says ENDED (see lifetime.py). When the launcher dies (with the
kernel) it does the same before it goes.

Every rank runs serve.serve(), as the job's ``policy`` says: one-shot (its
ranks answer the job's ``first`` request and leave) or a pool (they serve
until the kernel closes their sockets); see serve.Serving.

- cpu: one forked process per rank, each with a single XLA CPU device
  (PJRT_DEVICE=CPU), joined in a gloo process group on loopback.
- tpu: torch_xla's ``xmp.spawn(..., start_method="fork")``, one process per
  chip, each calling the rank with its global ordinal in a thread; a rank
  alone in its process moves to the process's main thread. One chip: a forked
  process of its own runs torch_xla's ``nprocs=1`` layout (which runs the
  rank in the calling process). With PJRT_DEVICE=CPU it runs the same code
  path as CPU_NUM_DEVICES threads.
- SPMD (a job with ``spmd``, on either backend): one forked process that
  owns every device, with spmd.environment() applied before the runtime
  starts and spmd.setup() for its names; no xmp.spawn.

Every rank process opens torch_xla's persistent compilation cache in its
set-up, once its device exists and before anything compiles: a directory
of its own, named by which of the world's devices it drives
(compile_cache.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import threading
import traceback
from typing import Any, Callable

from xla_magic.wire import protocol
from xla_magic.launcher import capture, compile_cache, interrupt, lifetime, place, serve, simulate, spmd
from xla_magic.launcher import rank as rank_module
from xla_magic.launcher import strategy as strategy_module

# Left behind by Colab and Kaggle notebook images; with them set, the runtime
# tries to join a multi-host job that does not exist.
STALE_TPU_VARIABLES = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


SOCKETS_PER_RANK = 4  # events, stdout, stderr, stacks (rank.RankSockets)

# This supervisor's pid, for the ranks it forks (see _tpu_rank).
_supervisor_pid: int | None = None


def supervise(job: dict[str, Any], fds: list[int], launcher_pid: int) -> None:
    """Entry point of the forked supervisor; never returns."""
    global _supervisor_pid
    code = 0
    supervisor = protocol.Channel(socket.socket(fileno=fds[0]))
    try:
        _apply_environment(job["environment"])
        compile_cache.configure(job.get("compile_cache"))  # the ranks open it in their set-up
        os.setsid()
        # Not SIGKILL: as their subreaper, the supervisor first ends what its
        # ranks started (a pool keeps what its cells start), then goes.
        _supervisor_pid = os.getpid()
        signal.signal(signal.SIGHUP, _launcher_gone)
        lifetime.die_with_parent(launcher_pid, signal.SIGHUP)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ranks handle interrupts
        # The kernel's SIGTERM to the run's group is for the ranks: the
        # supervisor stays to relay their last output and report their exits.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lifetime.become_subreaper()
        ranks = [
            rank_module.RankSockets(*(socket.socket(fileno=fd) for fd in fds[i : i + SOCKETS_PER_RANK]))
            for i in range(1, len(fds), SOCKETS_PER_RANK)
        ]
        serving = serve.Serving.of(job)
        if job.get("spmd"):
            run_spmd(serving, ranks, supervisor, job["spmd"])
        elif job["backend"] == "cpu":
            run_cpu(serving, job["run_id"], ranks, supervisor, job["store"], job.get("world"))
        else:
            run_tpu(serving, job["run_id"], ranks, supervisor, cpu_threads=job["cpu_threads"], world=job.get("world"))
    except BaseException:
        code = 1
        try:
            supervisor.send(protocol.ENDED, error=traceback.format_exc())
        except OSError:
            pass
    finally:
        os._exit(code)


def _launcher_gone(signum: int, frame: Any) -> None:
    """The launcher died (and so the kernel, most likely): end every process below us, then go."""
    if os.getpid() != _supervisor_pid:  # a rank process, which inherited this handler: SIGHUP as ever
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGHUP)
        return
    lifetime.end_descendants()
    os._exit(1)


def _apply_environment(changes: dict[str, Any]) -> None:
    """Bring the kernel's later changes to its environment (XLA_FLAGS, PJRT_DEVICE,
    tokens) into this run. Only the changes: torch_xla's import set variables
    of its own in the launcher, and they stay (its flags too, merged with the
    kernel's: launcher/place.py)."""
    for name in changes["unset"]:
        if name in place.FLAG_VARIABLES:  # the kernel's part goes; torch_xla's import-time flags stay
            place.put_flags_left(name, os.environ.get(name, ""))
        else:
            os.environ.pop(name, None)
    for name, value in changes["set"].items():
        if name in place.FLAG_VARIABLES:
            value = place.merge_flags(value, place.torch_xlas_flags(name, os.environ.get(name, "")))
        os.environ[name] = value



# matplotlib's backend in ranks, as ipykernel sets it in a notebook: figures
# become image/png display data (shell.py) instead of windows.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
_HAS_INLINE_BACKEND = importlib.util.find_spec("matplotlib_inline") is not None


def _rank_environment(world: protocol.World | None = None) -> None:
    for name in STALE_TPU_VARIABLES:
        os.environ.pop(name, None)
    if _HAS_INLINE_BACKEND:
        os.environ.setdefault("MPLBACKEND", INLINE_BACKEND)  # unless the user chose one
    # A notebook kernel sets FORCE_COLOR, which tells rich (Lightning's progress
    # bar where rich is installed) that it writes to a terminal: it would then
    # redraw with cursor moves that a cell's output cannot show. Not interactive,
    # rich prints each bar's final state, as it does into a file.
    os.environ.setdefault("TTY_INTERACTIVE", "0")
    if world:  # several hosts: a user's own process group meets on host 0, over this host's address only
        os.environ.setdefault("MASTER_ADDR", world["store_address"])
        interface = _interface_of(world["address"])
        if interface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (a host's address toward the others), if any here."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(address, None)}
    except OSError:
        return None
    for interface, addresses in psutil.net_if_addrs().items():
        if any(entry.address in wanted for entry in addresses):
            return interface
    return None


# --- cpu: the simulation --------------------------------------------------


def run_cpu(
    serving: serve.Serving,
    run_id: int,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    store: str,
    world: protocol.World | None = None,
) -> None:
    """Fork the ranks; ``store`` is the kernel's directory for the run's gloo
    store (the kernel owns it and removes it when the ranks end). ``world``:
    these ranks are one host's of several (host, rank_offset, world_size, the
    TCP store on host 0)."""
    supervisor_pid = os.getpid()
    _fork_and_wait(
        ranks, supervisor,
        lambda rank: _cpu_rank(rank, ranks, supervisor, serving, run_id, store, supervisor_pid, world),
    )


def _fork_and_wait(
    ranks: list[rank_module.RankSockets], supervisor: protocol.Channel, rank_main: Callable[[int], None]
) -> None:
    """Fork one process per rank (``rank_main`` never returns), report each exit, then ENDED."""
    pids: dict[int, int] = {}
    relay = capture.Relay([(s.out, s.err) for s in ranks])  # output rings, shared with the ranks
    for rank in range(len(ranks)):
        pid = os.fork()
        if pid == 0:
            rank_main(rank)
        pids[pid] = rank
    relay.start()
    for sockets in ranks:
        for sock in sockets.all():
            sock.close()
    supervisor.send(protocol.SPAWNED, pids={rank: pid for pid, rank in pids.items()})
    while pids:
        pid, status = os.wait()
        if pid in pids:
            relay.rank_ended(pids[pid])  # what the rank wrote before it died goes out before its EXIT
            supervisor.send(protocol.EXIT, rank=pids.pop(pid), code=lifetime.exit_code(status))
    lifetime.end_descendants()
    supervisor.send(protocol.ENDED, error=None)


def _cpu_rank(
    rank: int,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    serving: serve.Serving,
    run_id: int,
    store: str,
    supervisor_pid: int,
    world: protocol.World | None,
) -> None:
    """A simulated device: one process, one XLA CPU device; never returns.

    ``rank`` is its index on this host; with ``world`` its global rank is offset by the hosts before."""
    code = 1
    local_size = len(ranks)
    global_rank = rank + (world["rank_offset"] if world else 0)
    world_size = world["world_size"] if world else local_size
    try:
        _forked_rank(rank, ranks, supervisor, supervisor_pid, world)
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = "1"

        def setup() -> dict[str, Any]:
            import torch
            import torch_xla

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
            device = torch_xla.device()
            compile_cache.start(f"rank-{global_rank}-of-{world_size}")
            # Before the cell: xm/xr across ranks (and hosts).
            simulate.install(global_rank, world_size, store, dict(world, local_size=local_size) if world else None)
            strategy = strategy_module.RankStrategy(global_rank, world_size, device, simulated=True, local_rank=rank)
            strategy_module.activate(strategy)
            names = {"rank": global_rank, "world_size": world_size, "device": device, "strategy": strategy}
            if world:
                names.update(local_rank=rank, host=world["host"])
            return names

        # Across hosts no directory is shared: the ranks meet on the world's store.
        closing = simulate.leave(simulate.closing_across_hosts(run_id) if world else
                                 strategy_module.closing_on_store(os.path.join(store, "closing"), run_id, world_size))
        ok = serve.serve(rank, ranks[rank], setup, serving, closing)
        code = 0 if ok else 1
    finally:
        lifetime.flush_c_stdio()
        os._exit(code)


def _forked_rank(rank: int, ranks: list[rank_module.RankSockets], supervisor: protocol.Channel,
                 supervisor_pid: int, world: protocol.World | None = None) -> None:
    """The start of every forked rank: dies with the supervisor, holds only its own sockets."""
    lifetime.die_with_parent(supervisor_pid)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the supervisor's SIG_IGN is not for ranks
    # Only the supervisor speaks on its socket, and a rank's children
    # must not hold it (nor other ranks' sockets) open.
    supervisor.close()
    for other, sockets in enumerate(ranks):
        if other != rank:
            for sock in sockets.all():
                sock.close()
    _rank_environment(world)


# --- SPMD: one process, every device ------------------------------------------


def run_spmd(
    serving: serve.Serving,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    layout: dict[str, Any],
) -> None:
    """Fork the one SPMD process; ``layout`` holds its device count, mesh and axes, and whether on CPU."""
    supervisor_pid = os.getpid()
    _fork_and_wait(ranks, supervisor, lambda rank: _spmd_process(ranks, supervisor, serving, layout, supervisor_pid))


def _spmd_process(
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    serving: serve.Serving,
    layout: dict[str, Any],
    supervisor_pid: int,
) -> None:
    """The SPMD process: never returns."""
    code = 1
    try:
        _forked_rank(0, ranks, supervisor, supervisor_pid)
        # Before anything starts the runtime: it reads these once.
        os.environ.update(spmd.environment(layout["devices"], on_cpu=layout["on_cpu"]))

        def setup() -> dict[str, Any]:
            names = spmd.setup(layout["devices"], layout["mesh"], layout["axes"])
            compile_cache.start(f"spmd-{layout['devices']}")  # the mesh is in each graph, and so in its key
            return names

        ok = serve.serve(0, ranks[0], setup, serving)
        code = 0 if ok else 1
    finally:
        lifetime.flush_c_stdio()
        os._exit(code)


# --- tpu: torch_xla's own launcher ----------------------------------------


def run_tpu(
    serving: serve.Serving,
    run_id: int,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    cpu_threads: bool,
    world: protocol.World | None = None,
) -> None:
    """torch_xla's spawn. With ``world`` (one host of a multi-host slice) nothing of the slice's shape is set
    here: torch_xla reads it from the TPU VM's metadata (or GKE's TPU_WORKER_* variables) itself."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    if not cpu_threads and len(ranks) == 1:
        # One chip: torch_xla's nprocs=1 runs the function in the calling process, which must not be
        # this one (the rank's fate, a SIGKILL or the interrupt's SIGTERM, would be the supervisor's).
        supervisor_pid = os.getpid()
        _fork_and_wait(ranks, supervisor, lambda rank: _one_chip(ranks, supervisor, serving, run_id, world,
                                                                 supervisor_pid))
        return
    _rank_environment(world)
    if cpu_threads:
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = str(len(ranks))
        nprocs = None
    else:
        nprocs = None
    # xmp.spawn's worker processes are forked from here and inherit this handler
    # instead of the supervisor's SIG_IGN; the ranks are their threads. They
    # must also die of SIGTERM, and only the main thread can say so: here.
    interrupt.install_handler()
    interrupt.allow_handoff()  # a rank alone in its process runs on that process's main thread (see _tpu_rank)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    supervisor.send(protocol.SPAWNED, pids={})
    relay = capture.Relay([(s.out, s.err) for s in ranks])  # output rings, shared with the ranks
    relay.start()
    try:
        xmp.spawn(_tpu_rank, args=(ranks, supervisor.sock, serving, run_id, world), nprocs=nprocs, start_method="fork")
    except BaseException:
        error = traceback.format_exc()
    else:
        error = None
    relay.all_ended()
    lifetime.end_descendants()
    supervisor.send(protocol.ENDED, error=error)


def _one_chip(ranks: list[rank_module.RankSockets], supervisor: protocol.Channel, serving: serve.Serving,
              run_id: int, world: protocol.World | None, supervisor_pid: int) -> None:
    """The one rank on one chip: a process of its own, where torch_xla's nprocs=1 layout runs it; never returns."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    code = 1
    try:
        _forked_rank(0, ranks, supervisor, supervisor_pid, world)
        interrupt.install_handler()
        xmp.spawn(_tpu_rank, args=(ranks, supervisor.sock, serving, run_id, world), nprocs=1)
        code = 0 if _served_ok else 1
    finally:
        lifetime.flush_c_stdio()
        os._exit(code)


_served_ok = False  # in a one-chip rank: what its serve() said


def _tpu_rank(
    ordinal: int,
    ranks: list[rank_module.RankSockets],
    supervisor: socket.socket,
    serving: serve.Serving,
    run_id: int,
    world: protocol.World | None = None,
) -> None:
    """Called by xmp.spawn in each rank, process or thread (its arguments are pickled, so no Channel).

    ``ordinal`` is torch_xla's global ordinal (``runtime.global_ordinal()``): the cell's ``rank``, which is
    not its index among this host's sockets on a pod slice's later hosts."""
    import torch_xla
    import torch_xla.runtime as xr

    if os.getpid() != _supervisor_pid:  # a process xmp.spawn forked, not a thread of the supervisor
        lifetime.die_with_parent(_supervisor_pid)
        lifetime.become_subreaper()
        supervisor.close()  # the supervisor's alone; a cell's children must not hold it

    # Its socket: its place on this host (torch_xla's local ordinal; the runtime is up, xmp.spawn's
    # initialize_multiprocess made the device). Its global rank is the ordinal, which torch_xla does not
    # promise to be contiguous on a host (runtime.global_ordinal): the rank says it when ready (serve.py),
    # and the kernel names the socket by it.
    local = index = xr.local_ordinal()

    def setup() -> dict[str, Any]:
        device = torch_xla.device()
        world_size = xr.world_size()
        # Rank threads share their process's cache: the first to get here opens it for them all.
        compile_cache.start(f"process-{xr.process_index()}-of-{xr.process_count()}-world-{world_size}"
                            if xr.addressable_runtime_device_count() > 1 else f"rank-{ordinal}-of-{world_size}")
        strategy = strategy_module.RankStrategy(ordinal, world_size, device, simulated=False, local_rank=local)
        strategy_module.activate(strategy)
        names = {"rank": ordinal, "world_size": world_size, "device": device, "strategy": strategy}
        if world:
            names.update(local_rank=local, host=world["host"])
        return names

    def serve_rank() -> bool:
        return serve.serve(index, ranks[index], setup, serving, strategy_module.closing_on_xla(run_id))

    global _served_ok
    if (threading.current_thread() is not threading.main_thread() and xr.addressable_runtime_device_count() == 1
            and interrupt.can_hand_off()):
        # torch_xla's thread for the process's one device; its main thread waits for it. There, as a process
        # of its own on the cpu backend, SIGINT stops the cell at once (native code too) and the stack
        # sampler reads the cell's frames.
        device = torch_xla._XLAC._xla_get_default_device()  # the thread's; the main thread's is the same one

        def on_main_thread() -> bool:
            torch_xla._XLAC._xla_set_default_device(device)
            return serve_rank()

        _served_ok = interrupt.on_main_thread(on_main_thread)
    else:
        _served_ok = serve_rank()
    lifetime.flush_c_stdio()
