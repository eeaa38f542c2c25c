"""What the ranks' Python has, asked before a cell starts: ``--metrics-dir`` needs tensorboard there. Runs in the kernel.

The ranks run the launcher's interpreter: the running launcher's, else the
one a launcher would start with (``XLA_MAGIC_PYTHON``, else the kernel's
own). The kernel's own is asked with ``importlib.util.find_spec``, which
imports nothing; another is asked once, in a short process of its own.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

from IPython.core.error import UsageError

ASK_TIMEOUT = 60.0  # a Python that cannot answer this in a minute cannot run the ranks either


def interpreter(running: str | None = None) -> str:
    """The ranks' Python: ``running`` (the running launcher's), else XLA_MAGIC_PYTHON, else the kernel's."""
    return running or os.environ.get("XLA_MAGIC_PYTHON") or sys.executable


@functools.lru_cache(maxsize=16)
def _has_in(python: str, module: str) -> bool:
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # (a venv's python links to its base's: not realpath)
        return importlib.util.find_spec(module) is not None
    try:
        asked = subprocess.run([python, "-c", f"import importlib.util, sys; "
                                              f"sys.exit(importlib.util.find_spec({module!r}) is None)"],
                               capture_output=True, timeout=ASK_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return True  # it cannot be asked: the ranks say so themselves when they start
    return asked.returncode == 0


def refuse_metrics_dir_without_tensorboard(running: str | None = None) -> None:
    """UsageError, before anything starts, where the ranks' Python has no tensorboard (``--metrics-dir``
    writes TensorBoard files with torch.utils.tensorboard's SummaryWriter, which needs it)."""
    python = interpreter(running)
    if not _has_in(python, "tensorboard"):
        raise UsageError(f"--metrics-dir writes TensorBoard files with torch.utils.tensorboard, which needs the "
                         f"tensorboard package in the ranks' Python ({python}), and it has none: "
                         f"{python} -m pip install tensorboard (or %pip install tensorboard where that is the "
                         f"kernel's), then run the cell again")
