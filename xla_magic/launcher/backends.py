"""Start the ranks of one run. Runs in a supervisor process, forked per run.

The supervisor leads a new process group (so the kernel can signal the whole
run at once), dies with the launcher, and reports each rank's exit to the
kernel on its own socket.

- cpu: one forked process per rank, each with a single XLA CPU device
  (PJRT_DEVICE=CPU), joined in a gloo process group on loopback.
- tpu: torch_xla's ``xmp.spawn(..., start_method="fork")``. With
  PJRT_DEVICE=CPU it runs the same code path as CPU_NUM_DEVICES threads.
"""

from __future__ import annotations

import os
import signal
import socket
import traceback
from typing import Any

from xla_magic import protocol
from xla_magic.launcher import interrupt, lifetime, pool as pool_module, rank as rank_module, simulate, strategy as strategy_module

# Left behind by Colab and Kaggle notebook images; with them set, the runtime
# tries to join a multi-host job that does not exist.
STALE_TPU_VARIABLES = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


# This supervisor's pid, for the ranks it forks (see _tpu_rank).
_supervisor_pid: int | None = None


def supervise(job: dict[str, Any], fds: list[int], launcher_pid: int) -> None:
    """Entry point of the forked supervisor; never returns."""
    global _supervisor_pid
    code = 0
    supervisor = protocol.Channel(socket.socket(fileno=fds[0]))
    try:
        _apply_environment(job["environment"])
        os.setsid()
        lifetime.die_with_parent(launcher_pid)
        _supervisor_pid = os.getpid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ranks handle interrupts
        ranks = [
            rank_module.RankSockets(*(socket.socket(fileno=fd) for fd in fds[i : i + 3]))
            for i in range(1, len(fds), 3)
        ]
        cell = None if job.get("mode") == protocol.POOL_JOB else _cell_job(job)
        if job["backend"] == "cpu":
            run_cpu(cell, ranks, supervisor, job["store"])
        else:
            run_tpu(cell, ranks, supervisor, cpu_threads=job["cpu_threads"])
    except BaseException:
        code = 1
        try:
            supervisor.send(protocol.ENDED, error=traceback.format_exc())
        except OSError:
            pass
    finally:
        os._exit(code)


def _apply_environment(changes: dict[str, Any]) -> None:
    """Bring the kernel's later changes to its environment (XLA_FLAGS, PJRT_DEVICE,
    tokens) into this run. Only the changes: torch_xla's import set variables
    of its own in the launcher, and they stay."""
    for name in changes["unset"]:
        os.environ.pop(name, None)
    os.environ.update(changes["set"])


def _cell_job(job: dict[str, Any]) -> rank_module.CellJob:
    return rank_module.CellJob(
        run_id=job["run_id"],
        source=job["source"],
        filename=job["filename"],
        has_result=job["has_result"],
        namespace=job["namespace"],
    )


def _rank_environment() -> None:
    for name in STALE_TPU_VARIABLES:
        os.environ.pop(name, None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


# --- cpu: the simulation --------------------------------------------------


def run_cpu(
    cell: rank_module.CellJob | None,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    store: str,
) -> None:
    """Fork the ranks; ``store`` is the kernel's directory for gloo's file store
    (the kernel removes it, however the run ends)."""
    world_size = len(ranks)
    supervisor_pid = os.getpid()
    pids: dict[int, int] = {}
    for rank, sockets in enumerate(ranks):
        pid = os.fork()
        if pid == 0:
            _cpu_rank(rank, world_size, ranks, cell, store, supervisor_pid)
        pids[pid] = rank
    for sockets in ranks:
        for sock in sockets.all():
            sock.close()
    supervisor.send(protocol.SPAWNED, pids={rank: pid for pid, rank in pids.items()})
    while pids:
        pid, status = os.wait()
        if pid in pids:
            supervisor.send(protocol.EXIT, rank=pids.pop(pid), code=lifetime.exit_code(status))
    supervisor.send(protocol.ENDED, error=None)


def _cpu_rank(
    rank: int,
    world_size: int,
    ranks: list[rank_module.RankSockets],
    cell: rank_module.CellJob | None,
    store: str,
    supervisor_pid: int,
) -> None:
    """A simulated device: one process, one XLA CPU device; never returns.

    With no ``cell`` it is a pool rank, serving requests until the kernel
    closes its socket.
    """
    code = 1
    try:
        lifetime.die_with_parent(supervisor_pid)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for other, sockets in enumerate(ranks):
            if other != rank:
                for sock in sockets.all():
                    sock.close()
        _rank_environment()
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = "1"

        def setup() -> dict[str, Any]:
            import torch
            import torch_xla

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            device = torch_xla.device()
            simulate.install(rank, world_size, store)  # before the cell: xm/xr across ranks
            strategy = strategy_module.RankStrategy(rank, world_size, device, simulated=True)
            strategy_module.activate(strategy)
            return {"rank": rank, "world_size": world_size, "device": device, "strategy": strategy}

        if cell is None:
            ok = pool_module.serve(rank, ranks[rank], setup)
        else:
            closing = simulate.leave(strategy_module.closing_on_store(os.path.join(store, "closing"), cell.run_id, world_size))
            ok = rank_module.execute(rank, ranks[rank], cell, setup, closing)
        code = 0 if ok else 1
    finally:
        lifetime.flush_c_stdio()
        os._exit(code)


# --- tpu: torch_xla's own launcher ----------------------------------------


def run_tpu(
    cell: rank_module.CellJob | None,
    ranks: list[rank_module.RankSockets],
    supervisor: protocol.Channel,
    cpu_threads: bool,
) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp

    _rank_environment()
    if cpu_threads:
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = str(len(ranks))
        nprocs = None
    else:
        nprocs = 1 if len(ranks) == 1 else None
    # xmp.spawn's worker processes are forked from here and inherit this handler
    # instead of the supervisor's SIG_IGN; the ranks are their threads.
    interrupt.install_handler()
    supervisor.send(protocol.SPAWNED, pids={})
    try:
        xmp.spawn(_tpu_rank, args=(ranks, cell), nprocs=nprocs, start_method="fork")
    except BaseException:
        supervisor.send(protocol.ENDED, error=traceback.format_exc())
    else:
        supervisor.send(protocol.ENDED, error=None)


def _tpu_rank(index: int, ranks: list[rank_module.RankSockets], cell: rank_module.CellJob | None) -> None:
    """Called by xmp.spawn in each rank, process or thread; with no ``cell``, a pool rank."""
    import torch_xla
    import torch_xla.runtime as xr

    if os.getpid() != _supervisor_pid:  # a process xmp.spawn forked, not a thread of the supervisor
        lifetime.die_with_parent(_supervisor_pid)

    def setup() -> dict[str, Any]:
        device = torch_xla.device()
        world_size = xr.world_size()
        strategy = strategy_module.RankStrategy(
            index, world_size, device, simulated=False, local_rank=xr.local_ordinal()
        )
        strategy_module.activate(strategy)
        return {"rank": index, "world_size": world_size, "device": device, "strategy": strategy}

    if cell is None:
        pool_module.serve(index, ranks[index], setup)
    else:
        rank_module.execute(index, ranks[index], cell, setup, strategy_module.closing_on_xla(cell.run_id))
    lifetime.flush_c_stdio()
