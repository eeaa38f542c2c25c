"""The kernel's working directory, sys.path and environment, applied in a rank. Runs in a rank (process or thread).

A cell's request carries the kernel's place when it changed (see the kernel
side, xla_magic/cell/place.py): its directory, and the entries of its sys.path
that are the user's. The rank moves there and adds the entries it lacks:
those the kernel has ahead of every entry the two share go in front, the
others at the end, so ``sys.path.insert(0, ...)`` and
``sys.path.append(...)`` in the kernel keep their meaning. Entries added for
an earlier request that the kernel has since dropped are removed again;
what a cell added itself stays. Environment variables the kernel set or
unset since the launcher started are set or unset here, and put back when
the kernel undoes them.

Both are per process: on the tpu launch path several rank threads share one
process, and each applies the same place.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
from typing import Any

_lock = threading.Lock()
_added: list[str] = []  # sys.path entries this process added for the kernel
_env_before: dict[str, str | None] = {}  # variables set for the kernel -> their value before (None: unset)


class PlaceError(Exception):
    """What the cell needs of the kernel's place (its directory, its modules) is not here: the message says what to do."""


def apply(place: dict[str, Any]) -> None:
    """Move to the kernel's directory and bring its sys.path entries in (PlaceError if the directory is not here)."""
    with _lock:
        cwd = place.get("cwd")
        if cwd is not None:
            try:
                os.chdir(cwd)
            except OSError as exc:
                raise PlaceError(
                    f"the kernel's working directory {cwd} cannot be used here (on {socket.gethostname()}): "
                    f"{exc.strerror}. The cell runs in the kernel's directory; %cd to one that exists "
                    f"for the ranks too."
                ) from None
        _set_path(list(place.get("path", ())))
        importlib.invalidate_caches()  # a relative entry ('') now means another directory
        if "env" in place:
            _set_environment(place["env"])


def _set_environment(changes: dict[str, Any]) -> None:
    """The kernel's changes to its environment, here; one it has since undone is undone here too."""
    wanted: dict[str, str | None] = dict(changes["set"])
    wanted.update((name, None) for name in changes["unset"])
    for name in [name for name in _env_before if name not in wanted]:
        _put(name, _env_before.pop(name))
    for name, value in wanted.items():
        _env_before.setdefault(name, os.environ.get(name))
        _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None and name in FLAG_VARIABLES:
        put_flags_left(name, _env_before.get(name) or "")
    elif value is None:
        os.environ.pop(name, None)
    elif name in FLAG_VARIABLES:
        os.environ[name] = merge_flags(value, torch_xlas_flags(name, _env_before.get(name) or ""))
    else:
        os.environ[name] = value


# Flags torch_xla's import merges its own into (LIBTPU_INIT_ARGS only where it found chips): a
# later value from the kernel is merged the same way, its own flags first and winning, in place of
# the kernel's value as the launcher got it; unset in the kernel, torch_xla's flags stay.
FLAG_VARIABLES = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")


_given: dict[str, str] = {}  # each one's value as the kernel gave it to the launcher, before torch_xla's import


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0].lstrip("-")


def merge_flags(given: str, here: str) -> str:
    """``given``'s flags, then each of ``here``'s whose name ``given`` does not set (torch_xla's
    ``_set_missing_flags``, with the launcher's value as the defaults)."""
    flags = given.split()
    named = {_flag_name(flag) for flag in flags}
    flags += [flag for flag in here.split() if _flag_name(flag) not in named]
    return " ".join(flags)


def note_given_flags() -> None:
    """In the launcher, before it imports torch_xla: the kernel's own flags, which a later unset in the kernel
    takes away (torch_xla's import adds its defaults to them, and those stay)."""
    _given.update((name, os.environ.get(name, "")) for name in FLAG_VARIABLES)


def torch_xlas_flags(name: str, here: str) -> str:
    """``here`` without the kernel's own flags as the launcher got them: torch_xla's import-time ones (a flag of
    the kernel's that replaced one of torch_xla's leaves neither)."""
    theirs = {_flag_name(flag) for flag in _given.get(name, "").split()}
    return " ".join(flag for flag in here.split() if _flag_name(flag) not in theirs)


def put_flags_left(name: str, here: str) -> None:
    """The kernel unset ``name``: its part of ``here`` goes, torch_xla's stays."""
    left = torch_xlas_flags(name, here)
    if left:
        os.environ[name] = left
    else:
        os.environ.pop(name, None)


def _set_path(kernel: list[str]) -> None:
    global _added
    own = [entry for entry in sys.path if entry not in _added]
    shared = [index for index, entry in enumerate(kernel) if entry in own]
    split = shared[0] if shared else len(kernel)
    front = _missing(kernel[:split], own)
    back = _missing(kernel[split:], own + front)
    sys.path[:] = front + own + back
    _added = front + back


def _missing(entries: list[str], present: list[str]) -> list[str]:
    missing: list[str] = []
    for entry in entries:
        if entry not in present and entry not in missing:
            missing.append(entry)
    return missing
