"""Where a cell runs: the kernel's working directory, sys.path and environment. Runs in the kernel.

A notebook cell reads ``data.csv`` from the kernel's directory and imports
the user's modules from the kernel's ``sys.path``; so do its ranks. Every
cell's request carries both when they changed since that set of ranks last
got them (always, for new ranks), and a rank applies them before it loads
the names the cell reads (launcher/place.py): a notebook function that uses
the user's module is unpickled by the module's name. A pool cell's own
``os.chdir`` therefore lasts until the kernel's directory changes, and a
cell's own environment variable until the kernel changes that variable.

Only the user's entries of ``sys.path`` travel: the kernel's interpreter
directories (its standard library and site-packages) are the launcher's
business, and may be another Python's.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from typing import Any


def current(environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """The kernel's place now: ``{"cwd": ..., "path": (...), "env": ...}`` (no cwd if the kernel's was removed).

    ``environment`` is how the kernel's environment differs from the
    launcher's (Launcher.environment_changes): new ranks get it with their
    job, a pool's ranks with the next cell after it changes.
    """
    place: dict[str, Any] = {"path": user_path(tuple(sys.path))}
    if environment is not None:
        place["env"] = environment
    try:
        place["cwd"] = os.getcwd()
    except OSError:  # the kernel's own directory was removed: the ranks keep theirs
        pass
    return place


def environment_changes(base: dict[str, str]) -> dict[str, Any]:
    """How the kernel's environment differs now from ``base`` (what its launcher, or a pool's hosts, started with)."""
    now = dict(os.environ)
    return {
        "set": {name: value for name, value in now.items() if base.get(name) != value},
        "unset": sorted(name for name in base if name not in now),
    }


def changed(now: dict[str, Any], sent: dict[str, Any] | None) -> dict[str, Any]:
    """The request fields for ``now``: ``{"place": now}`` when the ranks last got something else, else none."""
    return {} if now == sent else {"place": now}


@functools.lru_cache(maxsize=16)
def user_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """The entries of ``path`` that are not the interpreter's own directories."""
    roots = _interpreter_dirs()
    return tuple(
        entry for entry in path
        if not any(entry == root or entry.startswith(root + os.sep) for root in roots)
    )


@functools.lru_cache(maxsize=1)
def _interpreter_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    dirs.add(site.getusersitepackages())
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        dirs.add(os.path.join(prefix, "lib"))
    return tuple(sorted(os.path.normpath(d) for d in dirs if d))
