"""The launcher: ``python -m xla_magic.launcher --fd N --parent-pid P``. A zygote process. Runs in the launcher.

Started by kernel P with one end of a private socket pair on fd N. It
imports torch and torch_xla once (the 5-7 s a cell should not pay again),
never initialises an XLA runtime, and forks one supervisor per job. It exits
when the kernel says STOP or closes the socket, and dies with the kernel
(PDEATHSIG).

With ``--keep NAME --keep-dir DIR`` it is a kept pool's launcher: it takes
one job (the pool's), does not die with the kernel, and serves the pool
from then on (keeper.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import sys
import time
import traceback

from xla_magic.wire import protocol
from xla_magic.launcher import lifetime, place

MAX_FDS = 253  # SCM_RIGHTS limit on Linux


# torch 2.8 starts inductor's compile-worker pool (a pool process and its
# workers, for the whole session) as soon as torch._inductor.async_compile is
# imported, when triton is installed, as it is with torch's CUDA wheels.
# torch_xla 2.8 imports it on the way: torch_xla/__init__ -> stablehlo ->
# _dynamo.dynamo_bridge -> torch._inductor.fx_passes.post_grad -> ... ->
# select_algorithm -> async_compile. Ranks compile for XLA, not with inductor,
# and a cell that does use inductor still gets a pool on first use.
# TORCH_WARM_POOL=0 is that module's own switch. torch 2.9 warms the pool only
# when the inductor backend is first used, so there it changes nothing.
WARM_POOL = "TORCH_WARM_POOL"


def import_runtime() -> dict[str, str]:
    """Import what every rank needs, without touching any device or starting helpers."""
    place.note_given_flags()  # what torch_xla's import adds to them is told apart from the kernel's
    set_here = WARM_POOL not in os.environ  # a user's own setting wins
    if set_here:
        os.environ[WARM_POOL] = "0"
    try:
        return _import_runtime()
    finally:
        if set_here:  # the ranks get the environment the kernel gave
            del os.environ[WARM_POOL]


def _import_runtime() -> dict[str, str]:
    import torch
    import torch.distributed  # noqa: F401
    import torch_xla
    import torch_xla.core.xla_model  # noqa: F401
    import torch_xla.distributed.parallel_loader  # noqa: F401
    import torch_xla.distributed.xla_multiprocessing  # noqa: F401
    import torch_xla.runtime  # noqa: F401

    import xla_magic.launcher.backends  # noqa: F401
    from xla_magic.launcher import shell

    shell.warm()  # each rank's IPython shell then costs milliseconds, when a cell first uses it

    # Plain str: torch.__version__ is a TorchVersion, whose unpickling would import torch into the kernel.
    return {"torch": str(torch.__version__), "torch_xla": str(torch_xla.__version__),
            # what torch_xla's import made of this host: the device it chose, and whether it found libtpu
            "pjrt_device": os.environ.get("PJRT_DEVICE"), "libtpu": bool(getattr(torch_xla, "_found_libtpu", True))}


def serve(channel: protocol.Channel) -> None:
    while True:
        event, fds = channel.recv_with_fds(MAX_FDS)
        if event.kind in (protocol.CLOSED, protocol.STOP, protocol.BROKEN):
            for fd in fds:
                os.close(fd)
            return
        if event.kind != protocol.JOB:
            for fd in fds:
                os.close(fd)
            continue
        start_job(channel, event, fds)


def start_job(channel: protocol.Channel, event: protocol.Event, fds: list[int], *inherited: socket.socket) -> int:
    """Fork the job's supervisor (which closes what it must not hold: our channel, ``inherited``), say STARTED."""
    from xla_magic.launcher import backends

    launcher_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        channel.sock.close()
        for sock in inherited:
            sock.close()
        backends.supervise(event.fields, fds, launcher_pid)
    for fd in fds:
        os.close(fd)
    channel.send(protocol.STARTED, run_id=event.fields["run_id"], pid=pid)
    return pid


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xla_magic.launcher")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the kernel")
    parser.add_argument("--parent-pid", type=int, required=True, help="the kernel's pid, as the kernel knows it")
    parser.add_argument("--keep", metavar="NAME", help="a kept pool's launcher: outlives the kernel (keeper.py)")
    parser.add_argument("--keep-dir", metavar="DIR", help="with --keep: the pool's 0700 directory")
    parser.add_argument("--keep-idle", type=float, default=7200.0, help="with --keep: seconds with no kernel")
    args = parser.parse_args(argv)

    if not args.keep:
        lifetime.die_with_parent(args.parent_pid)
    # Interrupts are for the ranks; the kernel decides what reaches them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Supervisors are reaped by the system; we never wait for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    channel = protocol.Channel(socket.socket(fileno=args.fd))
    started = time.monotonic()
    try:
        versions = import_runtime()
    except BaseException as exc:
        cause = exc.__cause__ or exc.__context__
        channel.send(
            protocol.FATAL,
            message=f"{type(exc).__name__}: {exc}",
            # not installed (ModuleNotFoundError for it), or installed and its import raised
            missing=exc.name if isinstance(exc, ModuleNotFoundError) else None,
            cause=f"{type(cause).__name__}: {cause}" if cause is not None else None,
            traceback=traceback.format_exc(),
            python=sys.executable,
        )
        sys.exit(1)
    channel.send(
        protocol.READY,
        pid=os.getpid(),
        python=sys.executable,
        python_version=platform.python_version(),
        import_seconds=time.monotonic() - started,
        **versions,
    )
    if args.keep:
        keep(channel, args)
    else:
        serve(channel)


def keep(channel: protocol.Channel, args: argparse.Namespace) -> None:
    """A kept pool's launcher: its one job, then the pool's server until the pool ends (keeper.py)."""
    from xla_magic.launcher import keeper as keeper_module

    # The kernel's restart must not reach us through the terminal or its group: we are in our own session.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    keeper = keeper_module.Keeper(args.keep, args.keep_dir, args.keep_idle, channel, args.parent_pid)
    try:
        event, fds = channel.recv_with_fds(MAX_FDS)
        if event.kind != protocol.JOB:
            for fd in fds:
                os.close(fd)
            return
        keeper.take_job(start_job(channel, event, fds, keeper.listener))
        keeper.run()
    finally:
        keeper.close()


if __name__ == "__main__":
    main()
