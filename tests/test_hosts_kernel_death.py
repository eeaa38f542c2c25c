"""When the kernel dies (SIGKILL: nothing of it can tidy up), every host's engine, launcher and ranks end,
and so does the controller. 2 simulated hosts x 2 ranks, a real kernel process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.hosts_fixtures import group_members, make_hosts, start_line, wait_until_empty

HERE = os.path.dirname(os.path.abspath(__file__))


def test_kernel_death_ends_every_host_s_engine_and_ranks_and_the_controller():
    hosts = make_hosts(2)
    kernel = None
    try:
        kernel = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "hosts_kernel.py"), start_line(hosts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                            os.environ.get("PYTHONPATH")]))},
        )
        ready = ""
        for line in kernel.stdout:
            if line.startswith("READY"):
                ready = line
                break
        assert ready, f"the kernel did not start its pool (exit {kernel.poll()})"
        controller = int(ready.split()[1])
        assert all(hosts.processes(address) for address in hosts.addresses())  # engines and ranks run
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
        # The controller ends at once (it watches the kernel); the engines after missed heartbeats.
        assert wait_until_empty(hosts, within=90) == {}
        assert not _alive(controller)
        assert group_members(controller) == []  # its heart monitor too, which would keep engines alive
    finally:
        if kernel is not None and kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        hosts.down()


def _alive(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # not our child: ChildProcessError; reaped by init otherwise
        except ChildProcessError:
            pass
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return False
        time.sleep(0.1)
    return True
