"""What a cell asks the kernel to display (protocol.DISPLAY), sent on its rank's events. Runs in a rank.

serve.py sets, for each rank, where a display goes; the cell's shell
(shell.py) and ``show_sharding`` (spmd.py) display through here.
"""

from __future__ import annotations

import threading
from typing import Any

_displays = threading.local()
_process_display: Any = None


def set_display(send: Any) -> None:
    """Where display() sends, for this rank: its thread, and (for threads the cell starts) its process."""
    global _process_display
    _displays.send = _process_display = send


def display(what: str, data: Any) -> None:
    """Have the kernel display ``data`` with its view for ``what`` (protocol.DISPLAY), after the output so far."""
    send = getattr(_displays, "send", None) or _process_display
    if send is None:
        raise RuntimeError("nothing to display on: this is not a rank serving a cell")
    send(what, data)
