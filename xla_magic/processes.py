"""``xla_magic.keep(process)``: let a process that a cell started outlive its request.

Imported in the kernel and in ranks. Everything a cell starts (subprocesses,
forked children, daemons that detach) is ended when the request that
started it ends (xla_magic/launcher/lifetime.py). A cell that means to
leave a helper running, a TensorBoard server say, names it here; a pool's
ranks then leave it alone until the pool stops. One-shot ranks end with
their cell, and everything below them with them.
"""

from __future__ import annotations

import sys
from typing import Any

from xla_magic.kernel_strategy import OutsideSpawnError


def keep(process: Any) -> int:
    """Keep ``process`` (a ``subprocess.Popen``, or a pid) after this request; its pid."""
    pid = getattr(process, "pid", process)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise TypeError(f"xla_magic.keep takes a subprocess.Popen or a process id, not {process!r}")
    # The launcher package exists only in rank processes; never import it here.
    lifetime = sys.modules.get("xla_magic.launcher.lifetime")
    if lifetime is None or not lifetime.serving():
        raise OutsideSpawnError(
            "xla_magic.keep is for processes started inside a %%xla_spawn cell; the kernel's own "
            "processes are never ended by xla_magic, so a helper started in a plain cell already stays."
        )
    lifetime.keep(pid)
    if lifetime.one_shot():
        print(f"xla_magic.keep: process {pid} still ends with this cell, whose ranks end with it; "
              f"start a pool (%xla_pool start) for ranks, and helpers, that stay between cells.",
              file=sys.stderr, flush=True)
    return pid
