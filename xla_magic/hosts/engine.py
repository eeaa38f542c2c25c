"""One host's ipyparallel engine: ``python -m xla_magic.hosts.engine --host-index I [ipengine args]``.

Runs on each host, started by the kernel's launch command (ssh, ``ip netns
exec``, ``kubectl exec``...). The controller's connection info (which holds
the cluster's key) arrives as the first line on stdin, never on a command
line, in a file the host keeps or in the environment (which the engine's launcher, ranks and
whatever a cell starts would inherit): it goes from stdin to ipyparallel's engine as a setting. The engine is XLA-free: the cells it is
given run in its host's own launcher and ranks (``hosts.on_host``).

It ends when the controller stops answering its heartbeats (the kernel
died, or the cluster was stopped), and its host's launcher and ranks end
with it (they die with their parent).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HOST_INDEX = "XLA_MAGIC_HOST_INDEX"


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
        from ipyparallel.engine.app import IPEngine

        # Straight to ipyparallel, not through $IPP_CONNECTION_INFO: what is in the engine's environment
        # reaches its launcher, its ranks and every process a cell starts.
        IPEngine.launch_instance([f"--profile-dir={profile}", *argv[2:]], connection_info_env=connection)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
