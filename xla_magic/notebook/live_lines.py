"""The line in progress of each rank (rewritten with ``\\r``), shown live in a display area of its own. Runs in the
kernel, in a notebook.
"""

from __future__ import annotations

import time
from typing import Callable

from xla_magic.runs.output import rank_label


class LiveLines:
    """Per-rank display areas for lines rewritten with ``\\r`` (notebooks only)."""

    def __init__(self, min_interval: float = 0.1, label: Callable[[int], str] = rank_label) -> None:
        self.label = label
        self._handles: dict[int, object] = {}
        self._last: dict[int, float] = {}
        self._min_interval = min_interval

    def __call__(self, rank: int, text: str) -> None:
        from IPython.display import display

        now = time.monotonic()
        if now - self._last.get(rank, 0.0) < self._min_interval:
            return
        self._last[rank] = now
        shown = {"text/plain": f"[{self.label(rank)}] {text}"}
        handle = self._handles.get(rank)
        if handle is None:
            self._handles[rank] = display(shown, raw=True, display_id=True)
        else:
            handle.update(shown, raw=True)

    def clear(self) -> None:
        for handle in self._handles.values():
            handle.update({"text/plain": ""}, raw=True)
        self._handles.clear()
