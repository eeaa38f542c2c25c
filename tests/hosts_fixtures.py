"""Simulated hosts for the multi-host tests: network namespaces, made and removed per module (root only).

Also the module's pool across them (``pool``, with ``pool_of_the_module``): a
test module that imports both gets a ready pool in every test, started on
first use and again where an earlier test broke or stopped it, so its tests
pass in any order; it is stopped when the module ends.

A module names its hosts apart from other modules' with ``HOSTS_TAG``; it may
set ``HOSTS`` (how many, default 2) and ``RANKS_PER_HOST`` (default 2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import pytest

from helpers import pool_magic
from xla_magic.hosts.simulated import SimulatedHosts

HOSTS = 2
RANKS_PER_HOST = 2  # the machine has 2 cores: 2 hosts x 2 ranks


def namespaces_refused() -> str | None:
    """Why this machine cannot make network namespaces, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, bridges, mounts)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"simulated hosts need {tool} (iproute2 / util-linux)"
    probe = f"xmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def make_hosts(tag: int, count: int = 2) -> SimulatedHosts:
    """``count`` hosts named and addressed apart from any other run's (tag: a small number)."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    hosts = SimulatedHosts(name=f"x{os.getpid() % 100:02d}{tag}", subnet=100 + (os.getpid() + tag) % 150)
    hosts.up(count)
    return hosts


def shape(module) -> tuple[int, int]:
    """A test module's hosts and ranks per host (its HOSTS and RANKS_PER_HOST, or 2 x 2)."""
    return getattr(module, "HOSTS", HOSTS), getattr(module, "RANKS_PER_HOST", RANKS_PER_HOST)


@pytest.fixture(scope="module")
def hosts(request) -> Iterator[SimulatedHosts]:
    """The module's simulated hosts (``HOSTS`` of them), named by its HOSTS_TAG (apart from other modules' and runs')."""
    simulated = make_hosts(request.module.HOSTS_TAG, shape(request.module)[0])
    try:
        yield simulated
    finally:
        simulated.down()


@pytest.fixture(scope="module")
def pool_of_the_module(ip):
    """The module's pool across its hosts, stopped at the end whatever state its tests left it in."""
    try:
        yield
    finally:
        pool_magic(ip, "stop")


@pytest.fixture
def pool(request, ip, hosts, pool_of_the_module):
    """The module's pool across ``hosts`` (the module's fixture), ready for this test."""
    running = ip._xla_magic_session.current_pool()
    if running is None:
        ranks = shape(request.module)[1]
        shown = pool_magic(ip, start_line(hosts, ranks))
        assert "pool ready" in shown and f"{len(hosts.addresses())} hosts x {ranks} ranks" in shown, shown
    elif running.state == "broken":
        assert "pool ready" in pool_magic(ip, "restart")
    yield ip._xla_magic_session.pool


@pytest.fixture
def kernel_place():
    """A directory every host has (the simulated hosts share the file system but /tmp and /dev/shm), holding a
    module; the kernel's directory, sys.path and environment put back afterwards."""
    shared = tempfile.mkdtemp(prefix="xla_magic-place-", dir=os.path.expanduser("~"))
    os.makedirs(os.path.join(shared, "other"))
    with open(os.path.join(shared, "placed_module.py"), "w") as module:
        module.write("WHERE = 'the kernel put me on the path'\n")
    cwd, path, environment = os.getcwd(), list(sys.path), dict(os.environ)
    try:
        yield shared
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environment)
        shutil.rmtree(shared, ignore_errors=True)


def launch_template(hosts: SimulatedHosts) -> str:
    return f"{sys.executable} -m xla_magic.hosts.simulated --name {hosts.name} --subnet {hosts.subnet} exec {{host}} --"


def start_line(hosts: SimulatedHosts, ranks: int = RANKS_PER_HOST) -> str:
    return (f"start --hosts {','.join(hosts.addresses())} --devices {ranks} --backend cpu "
            f"--launch '{launch_template(hosts)}'")


def on_host(hosts: SimulatedHosts, index: int, *argv: str) -> str:
    """What ``argv`` prints, run on host ``index``."""
    return subprocess.run(hosts.command(hosts.address(index)) + list(argv), capture_output=True, text=True,
                          check=True).stdout


def listeners(hosts: SimulatedHosts, index: int) -> list[tuple[str, str]]:
    """(local address, process) of every TCP listener on host ``index``."""
    rows = []
    for line in on_host(hosts, index, "ss", "-Hltnp").splitlines():
        fields = line.split()
        rows.append((fields[3], fields[-1] if len(fields) > 5 else ""))
    return rows


def wait_until_empty(hosts: SimulatedHosts, within: float = 60.0) -> dict[str, list[str]]:
    """Wait until no process is left on any host (processes end in their own time after a stop);
    what is still there when ``within`` seconds are up."""
    deadline = time.monotonic() + within
    while True:
        left = {address: [_cmdline(pid) for pid in hosts.processes(address)] for address in hosts.addresses()}
        if not any(left.values()) or time.monotonic() > deadline:
            return {address: pids for address, pids in left.items() if pids}
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return f"{pid}: " + cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return f"{pid}: (gone)"


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (the controller leads its own, with its heart monitor)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def controllers_on(address: str) -> list[int]:
    """Live controller processes (and their forked heart monitors) listening for hosts on ``address``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    words = cmdline.read().split(b"\0")
                with open(f"/proc/{entry}/stat") as stat:
                    state = stat.read().rpartition(")")[2].split()[0]
            except OSError:
                continue
            if b"xla_magic.hosts.controller" in words and f"--ip={address}".encode() in words and state != "Z":
                found.append(int(entry))
    return found


def start_kernel(hosts: SimulatedHosts, busy: bool = False) -> subprocess.Popen:
    """tests/hosts_kernel.py, a stand-in kernel that starts a pool on ``hosts``, as a process of its own;
    ``busy``: it then runs a cell that spins on every rank."""
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen(
        [sys.executable, os.path.join(here, "hosts_kernel.py"), start_line(hosts), *(["BUSY"] if busy else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(here),
                                                                        os.environ.get("PYTHONPATH")]))},
    )


def kernel_ready(kernel: subprocess.Popen, busy: bool = False) -> tuple[int, str]:
    """Wait until the stand-in kernel's pool is ready (and, ``busy``, every rank spins): its controller's
    pid and the cluster's directory."""
    said: dict[str, str] = {}
    spinning = 0
    assert kernel.stdout is not None
    for line in kernel.stdout:
        word, _, rest = line.partition(" ")
        said[word] = said.get(word, "") + rest
        spinning += line.rstrip().endswith("] spinning")  # a rank's tagged line
        if "PROFILE" in said and (not busy or spinning == 2 * RANKS_PER_HOST):
            return int(said["READY"]), said["PROFILE"].strip()
    raise AssertionError(f"the kernel did not start its pool (exit {kernel.poll()}): {said}")
