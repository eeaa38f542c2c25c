"""``from xla_magic import strategy``: one object for the kernel and the ranks. Runs on both sides.

Imported in the kernel and, through pickling, in ranks. Inside a rank it
stands for that rank's strategy; in the kernel, where no rank runs, using it
raises a clear error instead of touching an XLA device.
"""

from __future__ import annotations

import sys
from typing import Any

from xla_magic.wire.help import see


class OutsideSpawnError(RuntimeError):
    """A strategy attribute was used where no rank runs (the kernel)."""


def _rank_strategy() -> Any:
    # The launcher package exists only in rank processes; never import it here.
    module = sys.modules.get("xla_magic.launcher.strategy")
    return None if module is None else module.current()


class StrategyProxy:
    """Delegates to the current rank's strategy; refuses outside ranks."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = _rank_strategy()
        if target is None:
            raise OutsideSpawnError(
                f"strategy.{name} is only available inside a %%xla_spawn cell, where each "
                f"rank has its own device. The kernel never starts an XLA runtime (that would "
                f"stop any later spawn), so move this call into a %%xla_spawn cell or into a "
                f"function that such a cell calls. " + see("strategy-outside-cell")
            )
        return getattr(target, name)

    def __reduce__(self) -> str:
        return "strategy"  # pickled by reference: each rank resolves its own

    def __repr__(self) -> str:
        target = _rank_strategy()
        return repr(target) if target is not None else "<xla_magic strategy: use inside %%xla_spawn>"


strategy = StrategyProxy()
