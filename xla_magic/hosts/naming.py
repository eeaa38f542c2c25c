"""How a rank of a pool across hosts is named: ``hH rN``, N its global rank. Runs in the kernel and in each
host's engine, which tag the same ranks alike."""

from __future__ import annotations

from typing import Callable

# What restarts a broken pool across hosts.
RESTART = "%xla_pool restart (or %xla_pool stop, then %xla_pool start --hosts ...) starts it anew"


def tag(host: int, rank: int) -> str:
    """Global rank ``rank`` on host ``host``."""
    return f"h{host} r{rank}"


def label(devices: int) -> Callable[[int], str]:
    """The tag of each global rank, with ``devices`` ranks on every host."""
    return lambda rank: tag(rank // devices, rank)
