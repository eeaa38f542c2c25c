"""The kernel's ipyparallel controller: ``python -m xla_magic.hosts.controller --parent-pid P [ipcontroller args]``. Runs in the kernel's controller process.

Runs on the kernel's host, as a child of kernel P. ipyparallel's own
controller, which ends as soon as the kernel does, however it ends
(SIGKILL included), with its heart monitor process: the engines on every host then miss its heartbeats and
end, and with them every host's launcher and ranks.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading


def end_with(pid: int) -> None:
    """Exit this process as soon as process ``pid`` ends (watched through a pidfd, no polling)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        # The controller forks its heart monitor (which would go on pinging the engines, and so keep
        # them alive): end the whole process group, which the launcher made ours alone.
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(0)

    threading.Thread(target=watch, name="end-with-kernel", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--parent-pid"] or len(argv) < 2:
        sys.exit("usage: python -m xla_magic.hosts.controller --parent-pid P [ipcontroller arguments]")
    end_with(int(argv[1]))
    from ipyparallel.controller.app import main as ipcontroller

    sys.argv = [sys.argv[0], *argv[2:]]
    ipcontroller()


if __name__ == "__main__":
    main()
