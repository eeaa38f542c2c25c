"""torch_xla's persistent compilation cache, opened once per rank process. Runs in the supervisor and the ranks.

The supervisor takes the job's setting (``configure``); every rank's
set-up calls ``start`` once its device exists (the runtime must be up to
say which device it is) and before anything compiles: torch_xla reads
``XLA_PERSISTENT_CACHE_PATH`` once, when its computation cache is made at
the first compile. Rank threads of one process share that cache, so the
first of them opens it for all.

One directory per rank process, none shared. torch_xla's PersistentCache
(torch_xla/csrc/runtime/cache.h) writes each executable straight to its
final name with no temporary file and no lock between processes, and a
reader that finds a file it cannot load deletes it (unless read-only): a
second process in the same directory can read a half-written file and
delete it under its writer. One writer with the others read-only avoids
that, but then each reader loads only what rank 0 compiled, and ranks
compile different graphs (a constant such as ``x * rank`` is baked into
the graph), which readers would never write. A directory per process
costs disk (every rank stores its own copy) and is what vLLM's TPU worker
does (``tp{world}_rank{rank}``).

The directory is keyed by what makes an executable loadable: torch_xla's
version, the PJRT platform's version (libtpu's build on a TPU), the device
kind, and which of the world's devices the process drives. A directory
that is not writable, or a disk without room, leaves the rank without the
cache (it never fails the rank), and its report says why; the kernel says
so in one line (xla_magic/cell/compile_cache.py). A user who set
``XLA_PERSISTENT_CACHE_PATH`` themselves keeps their own.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from typing import Any

MIN_FREE_BYTES = 256 << 20  # below this the disk counts as full: an executable of a large model takes hundreds of MB
_PROBE_BYTES = 64 << 10

_setting: dict[str, Any] | None = None  # the job's: its root, or None (off); set in the supervisor
_lock = threading.Lock()
_started_pid: int | None = None
_fact: dict[str, Any] | None = None


def configure(setting: dict[str, Any] | None) -> None:
    """The job's setting, before the ranks are forked (they inherit it)."""
    global _setting
    _setting = setting


def reported() -> dict[str, Any] | None:
    """What this process's cache is, for the rank's ready status: None when it opened none."""
    return _fact if _started_pid == os.getpid() else None


def start(place: str) -> dict[str, Any] | None:
    """Open this process's cache, in ``place`` (which devices of the world it drives) under the root; its fact.

    Never raises: a cache that cannot be opened is a fact, not the rank's failure.
    """
    global _started_pid, _fact
    with _lock:
        if _started_pid == os.getpid():
            return _fact
        _started_pid = os.getpid()
        _fact = None
        if _setting is not None:
            try:
                _fact = _open(_setting["root"], place)
            except Exception as exc:  # torch_xla's API moved, a strange file system: never the rank's failure
                _fact = {"dir": _setting["root"], "on": False, "why": f"{type(exc).__name__}: {exc}"}
        return _fact


def _open(root: str, place: str) -> dict[str, Any]:
    import torch_xla
    import torch_xla.runtime as xr

    theirs = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if theirs:
        return {"dir": theirs, "on": True, "user": True}
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        return {"dir": root, "on": False, "why": "torch_xla had compiled before the rank could open the cache"}
    directory = os.path.join(root, build_key(), _name(_device_kind()), place)
    why = unusable(directory, root)
    if why:
        return {"dir": directory, "on": False, "why": why}
    xr.initialize_cache(directory, readonly=False)
    return {"dir": directory, "on": True}


def build_key() -> str:
    """torch_xla's version and the platform's (libtpu's build on a TPU, short-hashed: it is a paragraph)."""
    import hashlib

    import torch_xla

    platform = str(torch_xla._XLAC._xla_get_platform_version())
    digest = hashlib.sha256(platform.encode()).hexdigest()[:12]
    return _name(f"torch_xla-{torch_xla.__version__}-pjrt-{digest}")


def _device_kind() -> str:
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    try:
        return str(xm.xla_device_kind())
    except RuntimeError:  # an SPMD process's device is virtual, with no kind of its own: its chips'
        kind = str(xr.device_type())
        if kind == "TPU":
            from torch_xla._internal import tpu

            kind += f" v{tpu.version()}"
        return kind


def _name(text: str) -> str:
    """A directory name from any text: TPU v5 lite -> tpu-v5-lite."""
    return re.sub(r"[^a-z0-9._+-]+", "-", text.lower()).strip("-") or "unknown"


def unusable(directory: str, root: str) -> str | None:
    """Why the cache cannot live in ``directory`` (not writable, no room), or None; said of ``root``, the
    same for every rank, so that the kernel says it once.

    torch_xla's cache makes the directory in its constructor, where a
    failure would throw at the first compile, and writes without checking:
    so the rank makes it and writes a file here first.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".xla_magic-probe-{os.getpid()}")
        try:
            with open(probe, "wb") as file:
                file.write(b"\0" * _PROBE_BYTES)
                file.flush()
                os.fsync(file.fileno())
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        free = os.statvfs(directory)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{_shown(root)} is on a full disk"
        return f"{_shown(root)} is not writable ({exc.strerror or exc})"
    room = free.f_bavail * free.f_frsize
    if room < MIN_FREE_BYTES:
        return f"{_shown(root)} is on a full disk ({room >> 20} MB free, under the {MIN_FREE_BYTES >> 20} MB it needs)"
    return None


def _shown(path: str) -> str:
    return path.replace(os.path.expanduser("~"), "~", 1) if path.startswith(os.path.expanduser("~") + os.sep) else path
