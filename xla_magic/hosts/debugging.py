"""What ``%debug`` opens after a failed cell of a pool across hosts: a failed rank on its host. Runs in the kernel.

Each host's engine keeps its failed pool ranks for %debug as one host does
(post_mortem.py, in the engine's runner). Between cells the engines are
free, so ``%debug`` is an ipyparallel call to the failed rank's host, which
sends that rank its DEBUG request; pdb's prompts come to the kernel through
the host's link (hosts/link.py), answered by the request that follows the
call (hosts/request.py).
"""

from __future__ import annotations

from typing import Any

from xla_magic.runs.errors import RankError
from xla_magic.runs.post_mortem import PostMortem


class HostsPostMortem(PostMortem):
    """The failed ranks of a hosts pool's cell that keep its frames, by global rank (first failure first)."""

    def __init__(self, pool: Any, error: RankError, run_id: int) -> None:  # pool: hosts/pool.py's HostsPool
        self.pool = pool
        self.ranks = None  # type: ignore[assignment]  # on their hosts
        self.name = lambda rank: f"rank {pool.label(rank)}"
        self.size = pool.world_size
        self.run_id = run_id
        self.debuggable = list(error.debuggable)
        self.failures = {failure.rank: failure for failure in error.failures}
        self.parked = False  # pool ranks: they drop the frames at their next request
        self.error = error
        self.gone = ""

    def open(self, runner: Any, rank: int) -> None:
        self.pool.debug(rank, self.run_id)
