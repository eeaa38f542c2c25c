"""When the kernel dies (SIGKILL: nothing of it can tidy up) in the middle of a cell, every host's engine,
launcher and ranks end, and so does the controller; the engines end because they saw their controller go,
not after missing its heartbeats (benchmarks/bench_hosts.py times both). 2 simulated hosts x 2 ranks, a real
kernel process."""

from __future__ import annotations

import glob
import os
import signal
import time

from tests.hosts_fixtures import group_members, kernel_ready, make_hosts, start_kernel, wait_until_empty
from xla_magic.hosts.engine import GONE


def test_kernel_death_mid_cell_ends_every_host_s_engine_and_ranks_and_the_controller():
    hosts = make_hosts(2)
    kernel = None
    try:
        kernel = start_kernel(hosts, busy=True)
        controller, profile = kernel_ready(kernel, busy=True)
        assert all(hosts.processes(address) for address in hosts.addresses())  # engines and ranks run
        # Open now: once the kernel is dead, the next session on this machine removes its directory.
        logs = [open(os.path.join(profile, "log", f"engine-{index}-{address}.log"))
                for index, address in enumerate(hosts.addresses())]
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
        # The controller ends at once (it watches the kernel); the engines as soon as they see it go.
        left = wait_until_empty(hosts, within=90)
        said = []
        for log in logs:
            with log:
                said.append(log.read())
        assert left == {}, said
        assert not _alive(controller)
        assert group_members(controller) == []  # its heart monitor too, which would keep engines alive
        for text in said:
            assert GONE in text, text  # the engine's own watch ended it, not missed heartbeats
        for host in hosts.hosts():  # and it removed what the host's session and ranks kept in /tmp and /dev/shm
            root = f"/proc/{host['pid']}/root"
            kept = [path for top in ("tmp", "dev/shm") for path in glob.glob(f"{root}/{top}/xla_magic*")]
            assert kept == [], kept
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
