"""What ``%debug`` opens after a failed cell: the failed ranks that keep its frames. Runs in the kernel.

A rank whose cell raised keeps the traceback until its next request
(launcher/debugger.py) and says so with its ERROR. A pool's rank lives on,
so that is its real frame until the next cell. A one-shot rank that owns
its process stays after its cell for it (parked), until the next cell, or
until the debugger is left: whatever runs next then has the devices (on a
TPU, the chips). ``%debug`` sends the chosen rank a DEBUG request, followed
as any request is (request.py): pdb's output comes tagged with the rank,
its prompt through the kernel's input (rank_input.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from xla_magic.display import RankError
from xla_magic.wire import protocol

if TYPE_CHECKING:
    from xla_magic.ranks import Ranks

NOT_KEPT = ("no rank of that cell kept its frames: a rank keeps them for %debug until its next cell, a one-shot "
            "rank until the next cell or until the debugger is left; one-shot ranks that are threads of one process "
            "(the tpu launch path) leave with their cell, so run it in a pool (%xla_pool start) to debug it; a --fresh "
            "cell across hosts does not keep them: run it in the pool across hosts to debug it")


class PostMortem:
    """The last failed cell's ranks that keep its frames (first failure first), and their set."""

    def __init__(self, ranks: Ranks, error: RankError, run_id: int) -> None:
        self.ranks = ranks
        self.name = ranks.name  # a rank in a sentence
        self.run_id = run_id
        self.debuggable = list(error.debuggable)
        self.failures = {failure.rank: failure for failure in error.failures}
        self.parked = not ranks.policy.stops_cells_only  # a one-shot set, kept only for this
        self.error = error

    def choose(self, rank: int | None) -> int:
        """Rank ``rank``, or the first that failed; a UsageError naming those there are, for any other."""
        if rank is None:
            return self.debuggable[0]
        if rank not in self.debuggable:
            kept = ", ".join(map(str, self.debuggable))
            raise UsageError(f"rank {rank} of cell {self.run_id} kept no frames to debug (it did not fail, or its "
                             f"error was an interrupt); --rank {kept} did" if len(self.debuggable) > 1 else
                             f"rank {rank} of cell {self.run_id} kept no frames to debug; only rank {kept} did: "
                             f"%xla_debug --rank {kept}")
        return rank

    def note(self) -> str:
        """The line under the cell's error that says what %debug opens, and for how long."""
        first = self.name(self.debuggable[0])
        others = (f"; %xla_debug --rank R opens another's ({', '.join(map(str, sorted(self.debuggable[1:])))})"
                  if len(self.debuggable) > 1 else "")
        if self.parked:
            kept = "its process is kept for it until the next cell, or until you leave the debugger"
        else:
            kept = "the rank keeps it until the next cell"
        return f"%debug opens {first}'s frame where it failed{others}: {kept}."

    def opening(self, rank: int) -> str:
        failure = self.failures.get(rank)
        what = f" ({failure.headline()})" if failure is not None else ""
        return f"%debug: {self.name(rank)} of cell {self.run_id}, in the frame where it failed{what}"

    def open(self, runner: Any, rank: int) -> None:
        """pdb in ``rank``'s kept frames: a DEBUG request, followed until the debugger is left."""
        runner.exchange(self.ranks, protocol.DEBUG, f"%debug (rank {rank} of cell {self.run_id})", [rank], False)

    def release(self) -> None:
        """A one-shot set kept for it ends now; a pool's ranks drop the frames at their next request."""
        if self.parked:
            self.ranks.stop()


def keeps(ranks: Ranks, error: RankError) -> bool:
    """Whether a failed request's set is worth keeping for %debug: a rank kept frames, and the set can answer."""
    # One host of several keeps a pool's failed ranks (%debug reaches them through its engine); not one-shot ones.
    return bool(error.debuggable) and (ranks.world is None or ranks.policy.stops_cells_only) and ranks.state != "broken"
