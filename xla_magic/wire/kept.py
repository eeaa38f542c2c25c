"""Where kept pools live and what each one's record says. Runs in the kernel and in a kept pool's launcher.

A kept pool (``%xla_pool start --keep NAME``) is a launcher in its own
session that outlives the kernel which started it. It lives in a directory
only its user can enter (mode 0700), under ``$XDG_RUNTIME_DIR/xla_magic/pools``
where the system gives that directory (systemd's per-user tmpfs, which goes
at logout), else under ``~/.cache/xla_magic/pools``:

- ``NAME/socket``: the Unix socket a kernel attaches through; the launcher
  checks the peer's uid (SO_PEERCRED) as well. No TCP port is ever opened.
- ``NAME/record.json``: what ``%xla_pool list`` and ``%load_ext`` show
  (devices, pid, when started, since when no kernel is attached, the
  attached kernel's pid); written by the launcher alone, atomically.
- ``NAME/store``: the collectives' store of its ranks (the simulation's gloo).
- ``NAME/run.json``: the run going on in it, written by the kernel that sent it
  (its id, its request's seq, its cell, its log), removed by the kernel that
  saw it end: a kernel that went meanwhile leaves it for the next to attach.
- ``NAME/runs/``: the logs of the background runs in it (runs/log.py), kept
  with the pool rather than with a kernel's session, so that a kernel
  attached later replays them.
- ``NAME.log`` beside the directory: the launcher's own output, kept after the
  pool ends, so that a pool that ended itself (idle) says so there.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
DEFAULT_NAME = "pool"
DEFAULT_IDLE = 2 * 3600.0  # --keep-idle's default: a forgotten pool frees the TPU after two hours
SOCKET = "socket"
RECORD = "record.json"
RUN = "run.json"
RUNS = "runs"

# kernel -> kept launcher, after its JOB and STARTED: the kernel's ends of the ranks' sockets (``fds``) and what a
# later kernel needs to drive them (``fields``), to hand on at each attach
HOLD = "hold"
# kernel -> kept launcher, on a new connection: ``pid`` (the kernel's), ``steal`` (take it from another kernel)
ATTACH = "attach"
# kept launcher -> kernel: the answer to ATTACH, with the held descriptors
HELD = "held"
# kept launcher -> kernel: the answer to ATTACH or STOP that says no, and why (``message``)
REFUSED = "refused"
# kept launcher -> the kernel it was attached to, as another kernel takes the pool over (``pid``: that kernel's)
STOLEN = "stolen"
# kernel -> kept launcher: end the pool (the launcher answers ENDING, then ends its ranks and itself)
END = "end"
ENDING = "ending"


def root() -> str:
    """The directory that holds this user's kept pools (not made here)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _owned_directory(runtime):
        return os.path.join(runtime, "xla_magic", "pools")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xla_magic", "pools")


def _owned_directory(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def directory(name: str) -> str:
    return os.path.join(root(), name)


def log_path(name: str) -> str:
    return os.path.join(root(), f"{name}.log")


def make_directory(name: str) -> str:
    """The pool's directory, made 0700 (and its parents, the root 0700 too); FileExistsError if it is there."""
    top = root()
    os.makedirs(top, mode=0o700, exist_ok=True)
    os.chmod(top, 0o700)
    path = os.path.join(top, name)
    os.mkdir(path, 0o700)
    return path


def names() -> list[str]:
    """The kept pools' names, as their directories say (some may have ended without tidying)."""
    try:
        found = os.listdir(root())
    except OSError:
        return []
    return sorted(name for name in found if NAME.match(name) and os.path.isdir(os.path.join(root(), name)))


def read_record(name: str) -> dict[str, Any] | None:
    """What the pool's launcher last wrote about it, or None (no such pool, or not yet written)."""
    try:
        with open(os.path.join(directory(name), RECORD), encoding="utf-8") as file:
            found = json.load(file)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def write_record(path: str, record: dict[str, Any], file_name: str = RECORD) -> None:
    """Write ``record`` into the pool directory ``path`` at once (a reader never sees half of it)."""
    partial = os.path.join(path, f"{file_name}.{os.getpid()}.new")
    with open(partial, "w", encoding="utf-8") as file:
        json.dump(record, file)
    os.replace(partial, os.path.join(path, file_name))


def read_run(name: str) -> dict[str, Any] | None:
    """The run going on in kept pool ``name`` as the kernel that sent it wrote it (``run.json``), or None."""
    try:
        with open(os.path.join(directory(name), RUN), encoding="utf-8") as file:
            found = json.load(file)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def process_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the system vouches for it (SO_PEERCRED)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid
