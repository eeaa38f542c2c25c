"""A fake TPU host for the tests of torch_xla's real TPU path (test_tpu_path.py); root only.

The test's own process (the shell that runs the cells, as a kernel does) enters a mount namespace
of its own for the test, where a tmpfs over ``/sys/bus/pci/devices`` holds the fake chips' PCI ids
(what the kernel's probe and torch_xla both read), and leaves it afterwards: the namespace goes
with the last process in it, so nothing is left on the machine. The launcher the kernel starts in
there (and every supervisor and rank below it) inherits the namespace and the slice's metadata as
GKE's variables, and loads tests/fake_tpu/fake_libtpu.py (libtpu's place; its docstring says what is
fake and why there) through tests/fake_tpu/sitecustomize.py.

Run as a command (``python tests/fake_tpu_host.py --kind v4-16 --worker I --hostnames A,B -- COMMAND``), it
makes the host it runs on a fake TPU host for COMMAND alone: a simulated host's launch template puts it in
front of the host's engine (test_hosts_tpu.py), which, with everything it starts, lives in a mount
namespace of its own that goes with it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys
from typing import Iterator

import pytest

FAKE_TPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_tpu")
CLONE_NEWNS, CLONE_FS = 0x00020000, 0x00000200
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
VFIO = "/dev/vfio"

# accelerator type -> (PCI device id, GKE's TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS)
KINDS = {
    "v5litepod-8": ("0x0063", "1,1,1", "2,4,1"),
    "v5litepod-4": ("0x0063", "1,1,1", "2,2,1"),
    "v5litepod-1": ("0x0063", "1,1,1", "1,1,1"),
    "v4-8": ("0x005e", "1,1,1", "2,2,1"),
    "v4-16": ("0x005e", "1,1,2", "2,2,1"),  # 2 hosts of 4 chips (set TPU_WORKER_ID, TPU_WORKER_HOSTNAMES)
}
# The chips' device files: v4 and before open /dev/accelN, v5e and later /dev/vfio/N.
ACCEL_KINDS = {"0x005e"}

_libc = ctypes.CDLL(None, use_errno=True)


def refused() -> str | None:
    """Why this machine cannot fake a TPU host, or None."""
    if os.geteuid() != 0:
        return "a fake TPU host needs root (a mount namespace over /sys/bus/pci)"
    if not os.path.isdir("/sys/bus/pci/devices"):
        return "no /sys/bus/pci/devices to mount over"
    return None


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _drop_launcher(ip) -> None:
    """The kernel's launcher lives in the mount namespace it started in: a new one starts where it is next."""
    session = getattr(ip, "_xla_magic_session", None)
    if session is not None:
        session.host.drop_launcher()


@contextlib.contextmanager
def fake_tpu_host(ip, kind: str = "v5litepod-8", libtpu: bool = True, chip_files: bool = False,
                  **env: str) -> Iterator[None]:
    """This process (and what it starts) on a TPU host of ``kind``, until the block ends.

    ``chip_files``: the chips' device files too: /dev/vfio/N (plain files on a tmpfs of the namespace's;
    /dev/vfio is made for it where the machine has none, and removed afterwards), or on a v4 /dev/accelN
    (plain files made in /dev where the machine has none, and removed afterwards: a file cannot take a mount)."""
    reason = refused()
    if reason:
        pytest.skip(reason)
    variables = _variables(kind, libtpu, env)
    chips = _chips(kind)
    saved = dict(os.environ)
    cwd = os.getcwd()
    _drop_launcher(ip)
    accel = KINDS[kind][0] in ACCEL_KINDS
    made_vfio = chip_files and not accel and not os.path.isdir(VFIO)
    if made_vfio:
        os.mkdir(VFIO)
    made_accel = [path for path in (f"/dev/accel{chip}" for chip in range(chips))
                  if chip_files and accel and not os.path.exists(path)]
    for path in made_accel:
        open(path, "x").close()
    home = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    try:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        try:
            _mount_chips(kind)
            if chip_files and not accel:
                _check(_libc.mount(b"fake-vfio", VFIO.encode(), b"tmpfs", 0, None), "mount tmpfs")
                for chip in range(chips):
                    open(os.path.join(VFIO, str(chip)), "w").close()
            _enter_environment(variables)
            yield
        finally:
            try:
                _drop_launcher(ip)
            finally:
                os.environ.clear()
                os.environ.update(saved)
                # Threads started meanwhile share this thread's filesystem context, and setns wants it alone.
                _check(_libc.unshare(CLONE_FS), "unshare(CLONE_FS)")
                _check(_libc.setns(home, CLONE_NEWNS), "setns back")
                os.chdir(cwd)
    finally:
        os.close(home)
        if made_vfio:
            os.rmdir(VFIO)
        for path in made_accel:
            os.unlink(path)


def _chips(kind: str) -> int:
    chips = 1
    for dim in KINDS[kind][2].split(","):
        chips *= int(dim)
    return chips


def _variables(kind: str, libtpu: bool, env: dict[str, str]) -> dict[str, str]:
    """The fake host's environment: sitecustomize on the path, and the slice's metadata as GKE gives it."""
    _, host_bounds, chips_bounds = KINDS[kind]
    variables = {
        "PYTHONPATH": os.pathsep.join(filter(None, [FAKE_TPU_DIR, os.environ.get("PYTHONPATH")])),
        "XLA_MAGIC_FAKE_TPU": "1",
        # GKE's: torch_xla reads the slice's metadata from these instead of asking the metadata server
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": kind,
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_HOST_BOUNDS": host_bounds,
        "TPU_CHIPS_PER_HOST_BOUNDS": chips_bounds,
        **env,
    }
    if libtpu:
        variables["TPU_LIBRARY_PATH"] = os.path.join(FAKE_TPU_DIR, "fake_libtpu.py")
    return variables


def _mount_chips(kind: str) -> None:
    """In a mount namespace of this process's own: the chips' PCI ids over /sys/bus/pci/devices."""
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"fake-pci", b"/sys/bus/pci/devices", b"tmpfs", 0, None), "mount tmpfs")
    for chip in range(_chips(kind)):
        path = f"/sys/bus/pci/devices/0000:00:{4 + chip:02x}.0"
        os.mkdir(path)
        with open(os.path.join(path, "vendor"), "w") as file:
            file.write("0x1ae0\n")
        with open(os.path.join(path, "device"), "w") as file:
            file.write(KINDS[kind][0] + "\n")


def _enter_environment(variables: dict[str, str]) -> None:
    os.environ.pop("PJRT_DEVICE", None)  # a TPU VM's default: torch_xla picks TPU itself
    os.environ.pop("CPU_NUM_DEVICES", None)
    for name in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME"):  # conftest's, for the simulation: a TPU VM has none
        os.environ.pop(name, None)
    os.environ.update(variables)


def main(argv: list[str] | None = None) -> None:
    """Run a command on this host as one worker of a fake TPU slice (a simulated host's engine)."""
    parser = argparse.ArgumentParser(prog="fake_tpu_host.py")
    parser.add_argument("--kind", default="v4-16", choices=sorted(KINDS))
    parser.add_argument("--worker", required=True, help="this host's TPU_WORKER_ID")
    parser.add_argument("--hostnames", required=True, help="TPU_WORKER_HOSTNAMES: every host's address, in order")
    parser.add_argument("--ordinals", help="XLA_MAGIC_FAKE_TPU_ORDINALS: the slice's ordinal of each task")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {"TPU_WORKER_ID": args.worker, "TPU_WORKER_HOSTNAMES": args.hostnames}
    if args.ordinals:
        env["XLA_MAGIC_FAKE_TPU_ORDINALS"] = args.ordinals
    variables = _variables(args.kind, True, env)
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")  # the command's alone; it goes with it
    _mount_chips(args.kind)
    _enter_environment(variables)
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
