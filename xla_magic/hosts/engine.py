"""One host's ipyparallel engine: ``python -m xla_magic.hosts.engine --host-index I [ipengine args]``. Runs in a host's engine.

Runs on each host, started by the kernel's launch command (ssh, ``ip netns
exec``, ``kubectl exec``...). The controller's connection info (which holds
the cluster's key) arrives as the first line on stdin and goes from there to
ipyparallel's engine as a setting: never on a command line, in a file the
host keeps or in the environment (which the engine's nanny, launcher, ranks
and whatever a cell starts would inherit). The engine is XLA-free: the
cells it is given run in its host's own launcher and ranks
(``hosts.on_host``).

It ends as soon as its controller goes (the controller ends with the
kernel, SIGKILL included): the engine watches its connection to the
controller, and when the controller's end of it closes and the controller's
port refuses a new connection, it ends everything it started on this host
(the nanny, the launcher, the ranks and what cells started) and exits. A
controller that stops answering without closing its connections (its
machine is gone) is noticed by ipyparallel's heartbeats instead, slower.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Any
from urllib.parse import urlsplit

HOST_INDEX = "XLA_MAGIC_HOST_INDEX"
GONE = "xla_magic engine: the controller is gone (the kernel ended); ending everything on this host"
PROBE_PATIENCE = 3.0  # for a controller that closed a connection to show whether it ended
CLEANUP_PATIENCE = 2.0  # for this host's session to remove its files once its processes are killed


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--host-index"] or len(argv) < 2:
        sys.exit("usage: python -m xla_magic.hosts.engine --host-index I [ipengine arguments]")
    os.environ[HOST_INDEX] = argv[1]
    connection = sys.stdin.readline().strip()
    if not connection:
        sys.exit("xla_magic engine: no connection info on stdin (the kernel sends it when it starts the engine)")
    # The engine's profile (its logs) lives on this host, private, for the engine's life.
    profile = tempfile.mkdtemp(prefix="xla_magic-engine-")
    try:
        # Straight to ipyparallel, not through $IPP_CONNECTION_INFO: what is in the engine's environment
        # reaches its launcher, its ranks and every process a cell starts.
        _engine_class(profile).launch_instance([f"--profile-dir={profile}", *argv[2:]], connection_info_env=connection)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _engine_class(profile: str) -> Any:
    from ipyparallel.engine.app import IPEngine

    class HostEngine(IPEngine):
        """ipyparallel's engine, which also ends as soon as its controller's connection closes."""

        async def register(self) -> None:
            await super().register()
            watch_controller(self.registrar, self.registration_url, lambda: _end_host(profile))

    return HostEngine


def watch_controller(registrar: Any, url: str, gone: Any) -> None:
    """Call ``gone()`` (on a thread of its own) once the controller at ``url`` has closed ``registrar``'s
    connection and refuses new ones: it ended. A connection that closes while the controller still
    listens (a network hiccup, which zmq reconnects) is not its end."""
    import zmq

    monitor = registrar.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    address = urlsplit(url)

    def watch() -> None:
        while True:
            try:
                monitor.recv_multipart()
            except zmq.ZMQError:  # the engine closed its sockets: it is ending anyway
                return
            if _refused(address.hostname, address.port):
                gone()
                return

    threading.Thread(target=watch, name="watch-controller", daemon=True).start()


def _refused(host: str | None, port: int | None, patience: float = PROBE_PATIENCE) -> bool:
    """Whether the controller's port refuses connections within ``patience`` seconds: it has ended. (Its
    process closes its connections and its listening sockets one after another as it dies, so a first probe
    may still be let in.) No answer at all is not a refusal: heartbeats decide then."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=patience).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        time.sleep(0.1)  # let in: look again until the controller has gone or clearly stays
    return False


def _end_host(profile: str) -> None:
    """The controller is gone: kill every process this engine started, remove this host's files, exit now.

    At once, not through the engine's event loop, which a running cell may hold."""
    import psutil

    os.write(_log_fd(), (GONE + "\n").encode())
    for child in psutil.Process().children(recursive=True):  # the nanny, the launcher, its ranks, theirs
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    timer = threading.Timer(CLEANUP_PATIENCE, os._exit, (0,))
    timer.daemon = True
    timer.start()
    try:
        from xla_magic.hosts import on_host

        on_host.stop()  # its processes are dead already: it removes the session's directory and shared memory
    finally:
        shutil.rmtree(profile, ignore_errors=True)
        os._exit(0)


def _log_fd() -> int:
    """The engine's own stderr (its log, on the kernel's side), under ipykernel's capture of fd 2."""
    return getattr(sys.stderr, "_original_stdstream_copy", None) or 2


if __name__ == "__main__":
    main()
