"""Which rank strategy runs on this thread. Runs in a rank.

Apart from strategy.py so that what reads it (the frameworks' patches,
frameworks.py) need not import the strategy that installs those patches.
"""

from __future__ import annotations

import threading
from typing import Any

_here = threading.local()


def strategy() -> Any:
    """The RankStrategy of the rank running on this thread, or None."""
    return getattr(_here, "strategy", None)


def set_strategy(strategy: Any) -> None:
    _here.strategy = strategy
