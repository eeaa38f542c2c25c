"""xla_magic: run notebook cells on every TPU core, with the kernel XLA-free. Runs in the kernel.

``%load_ext xla_magic`` registers the magics. This module and everything it
imports run in the kernel and never import torch_xla.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from xla_magic.notebook.strategy import strategy

__all__ = ["strategy", "log", "checkpoints", "load_ipython_extension", "unload_ipython_extension"]
__version__ = "0.1.0"

def log(step: int | None = None, **values: Any) -> None:
    """Record named numbers from a ``%%xla_spawn`` cell, on any rank: ``log(loss=loss, lr=0.1)``.

    A value may be an XLA tensor of one element (read once a sync the cell
    makes anyway has run its graph: logging adds none), a Python or NumPy
    number or a one-element array. ``step`` defaults to the rank's next
    (counted from 0 in each cell). The kernel draws the values under the cell,
    and ``%xla_metrics`` returns them. Anything but a number raises TypeError.
    """
    # The launcher package exists only in rank processes; never import it here.
    module = sys.modules.get("xla_magic.launcher.metrics")
    logger = None if module is None else module.current()
    if logger is None:
        raise RuntimeError("log() records values from inside a %%xla_spawn cell, on its ranks; the kernel has "
                           "none to record. Call it in the cell, or in a function that the cell calls.")
    logger.log(step, values)


def checkpoints(directory: str, every: int | str | None = None, keep: int | None = None,
                before: str | float | None = None) -> Any:
    """Checkpoints of a training loop in a ``%%xla_spawn`` cell: ``ckpt = checkpoints(DIR, every="10min", keep=3)``.

    ``ckpt.restore(model=model, opt=opt)`` loads the last complete one in
    place and returns the step to go on from; ``ckpt.save(step, model=model,
    opt=opt)`` writes only when due, off the step's path (the docs' "Long runs" page).
    """
    # The launcher package exists only in rank processes; never import it here.
    module = sys.modules.get("xla_magic.launcher.checkpoints")
    if module is None:
        raise RuntimeError("checkpoints() saves a training loop from inside a %%xla_spawn cell, on its ranks; the "
                           "kernel holds no model on an XLA device. Call it in the cell (use %xla_checkpoints DIR "
                           "here to list what a run saved).")
    return module.checkpoints(directory, every=every, keep=keep, before=before)


def load_ipython_extension(ipython: Any) -> None:
    from xla_magic.notebook.cell_view import CellView
    from xla_magic.notebook.magics import XlaMagics
    from xla_magic.notebook.run_magics import RunMagics
    from xla_magic.session import Session

    if getattr(ipython, "_xla_magic_session", None) is not None:
        return
    session = Session(sink=CellView(ipython))
    magics = XlaMagics(ipython, session)
    ipython.register_magics(magics)
    run_magics = RunMagics(ipython, session)
    ipython.register_magics(run_magics)
    ipython._xla_magic_session = session
    ipython._xla_magic_magics = magics
    ipython._xla_magic_run_magics = run_magics
    _announce_kept_pools()
    if os.environ.get("XLA_MAGIC_PREWARM", "1") != "0":
        _prewarm(session)


def _announce_kept_pools() -> None:
    """One line for each kept pool of this user's that no kernel is attached to, with how to attach."""
    from xla_magic.pools import kept

    line = kept.announcement()
    if line:
        print(line)


def _prewarm(session: Any) -> None:
    """Start the launcher now, so it imports torch_xla while the user types.

    Never fails %load_ext: a launcher that cannot start says why at first use.
    """
    from xla_magic.ranks.launcher_client import LauncherError

    try:
        session.host.ensure_launcher()
    except LauncherError:
        pass


def unload_ipython_extension(ipython: Any) -> None:
    session = getattr(ipython, "_xla_magic_session", None)
    if session is None:
        return
    try:
        # The names the class registered, read from it, so a new magic is unregistered too.
        table = ipython.magics_manager.magics
        for registered in (ipython._xla_magic_magics, getattr(ipython, "_xla_magic_run_magics", None)):
            for kind, names in (registered.magics.items() if registered is not None else ()):
                for name in names:
                    table[kind].pop(name, None)
        original = ipython._xla_magic_magics.ipython_debug
        if original is not None:
            table["line"]["debug"] = original  # IPython's own %debug again, which ours stood in for
        session.close()
    finally:
        # Even if closing was cut short: a later %load_ext must start afresh.
        ipython._xla_magic_session = None
        ipython._xla_magic_magics = None
        ipython._xla_magic_run_magics = None
