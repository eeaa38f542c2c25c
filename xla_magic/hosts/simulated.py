"""Simulated hosts on one Linux machine, for tests and for users without a slice. Runs in the kernel or a test, as root.

Each host is a network namespace on a bridge, with its own address, and a
holder process (``unshare --uts --mount``) that gives it its own hostname
and private ``/tmp`` and ``/dev/shm``. Commands run "on" a host by entering
the holder's namespaces (``nsenter``), so whatever only works on one real
machine (a unix socket, a file in /tmp, shared memory, 127.0.0.1) fails
here as it would between real hosts.

    python -m xla_magic.hosts.simulated up 2          # prints the hosts' addresses
    python -m xla_magic.hosts.simulated exec 10.213.7.11 -- hostname
    python -m xla_magic.hosts.simulated down

The machine itself is the kernel's host: it holds the bridge's address
(``.1``), which is the one the controller listens on. ``down`` removes every
namespace, link and holder of the set; so does a second ``up``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

STATE_ROOT = "/run/xla_magic-sim-hosts"


@dataclass
class SimulatedHosts:
    """A set of simulated hosts: ``name`` prefixes every namespace and link (at most 5 characters)."""

    name: str = "xmh"
    subnet: int = 7  # hosts are 10.213.<subnet>.11, .12, ...; the kernel's side is .1

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def kernel_address(self) -> str:
        """The machine's own address on the bridge: where the hosts reach the kernel's controller."""
        return f"10.213.{self.subnet}.1"

    def address(self, index: int) -> str:
        return f"10.213.{self.subnet}.{11 + index}"

    def namespace(self, index: int) -> str:
        return f"{self.name}-{index}"

    def hostname(self, index: int) -> str:
        return f"{self.name}-host{index}"

    @property
    def state_dir(self) -> str:
        return os.path.join(STATE_ROOT, self.name)

    # -- up and down ---------------------------------------------------------

    def up(self, count: int) -> list[str]:
        """Make ``count`` hosts (after removing any left from before); their addresses."""
        self.down()
        os.makedirs(self.state_dir, mode=0o700)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.kernel_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index in range(count):
                self._add_host(index)
        except BaseException:
            self.down()
            raise
        return self.addresses()

    def _add_host(self, index: int) -> None:
        namespace, outside = self.namespace(index), f"{self.name}v{index}"
        _ip("netns", "add", namespace)
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        for args in (("addr", "add", f"{self.address(index)}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
            _ip("-n", namespace, *args)
        # The holder: its own hostname, /tmp and /dev/shm, for as long as the host lives.
        script = (f"hostname {self.hostname(index)} && mount -t tmpfs -o mode=1777 tmpfs /tmp && "
                  f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && echo ready && exec sleep infinity")
        holder = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        assert holder.stdout is not None
        line = holder.stdout.readline()
        holder.stdout.close()
        if line.strip() != b"ready":
            holder.kill()
            raise RuntimeError(f"could not set up simulated host {index}: its holder exited ({holder.wait()})")
        with open(os.path.join(self.state_dir, "hosts.json"), "a") as state:
            state.write(json.dumps({"index": index, "address": self.address(index), "pid": holder.pid}) + "\n")

    def hosts(self) -> list[dict]:
        """The hosts that are up: index, address and holder pid."""
        try:
            with open(os.path.join(self.state_dir, "hosts.json")) as state:
                return [json.loads(line) for line in state if line.strip()]
        except FileNotFoundError:
            return []

    def addresses(self) -> list[str]:
        return [host["address"] for host in self.hosts()]

    def down(self) -> None:
        """End every process in the hosts' namespaces, then remove namespaces, links and state."""
        for host in self.hosts():
            _kill_namespace_processes(host["pid"])
        for namespace in _namespaces():
            if namespace.startswith(self.name + "-"):
                for pid in _run(["ip", "netns", "pids", namespace]).split():
                    _kill(int(pid))
                subprocess.run(["ip", "netns", "del", namespace], check=False)
        # A namespace goes away asynchronously, and its veth pairs with it: delete our ends now.
        for link in _run(["ip", "-o", "link", "show"]).splitlines():
            fields = link.split(":")
            name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
            if name == self.bridge or re.fullmatch(rf"{re.escape(self.name)}v\d+", name):
                subprocess.run(["ip", "link", "del", name], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- running on a host --------------------------------------------------------

    def command(self, address: str) -> list[str]:
        """The prefix that runs a command on the host with ``address``."""
        for host in self.hosts():
            if host["address"] == address:
                # --wd=.: keep the caller's working directory (entering a mount namespace would reset it to /).
                return ["nsenter", "-t", str(host["pid"]), "--net", "--uts", "--mount", "--wd=.", "--"]
        raise KeyError(f"no simulated host has the address {address}; up: {', '.join(self.addresses()) or 'none'}")

    def processes(self, address: str) -> list[int]:
        """Every process on the host (in its network namespace) but its holder."""
        index = next(host["index"] for host in self.hosts() if host["address"] == address)
        holder = next(host["pid"] for host in self.hosts() if host["address"] == address)
        pids = [int(pid) for pid in _run(["ip", "netns", "pids", self.namespace(index)]).split()]
        return [pid for pid in pids if pid != holder]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_namespace_processes(holder: int) -> None:
    """SIGKILL the holder and every process sharing its mount namespace (what ran on the host)."""
    try:
        mine = os.readlink(f"/proc/{holder}/ns/mnt")
    except OSError:
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == mine:
                    _kill(int(entry))
            except OSError:
                continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sim-hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="xmh", help="prefix of every namespace and link (default xmh)")
    parser.add_argument("--subnet", type=int, default=7, help="hosts get 10.213.SUBNET.11 and up (default 7)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("up", help="make N hosts").add_argument("count", type=int)
    sub.add_parser("down", help="remove the hosts and everything running on them")
    sub.add_parser("list", help="the hosts' addresses")
    run = sub.add_parser("exec", help="run a command on a host: exec ADDRESS -- COMMAND...")
    run.add_argument("address")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    hosts = SimulatedHosts(args.name, args.subnet)
    if args.action == "up":
        print("\n".join(hosts.up(args.count)))
    elif args.action == "down":
        hosts.down()
    elif args.action == "list":
        print("\n".join(hosts.addresses()))
    else:
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        os.execvp("nsenter", hosts.command(args.address) + command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
