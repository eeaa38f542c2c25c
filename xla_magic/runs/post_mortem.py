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

from xla_magic.runs.errors import RankError
from xla_magic.wire import protocol

if TYPE_CHECKING:
    from xla_magic.ranks.ranks import Ranks

NOT_KEPT = ("no rank of that cell kept its frames: a rank keeps them for %debug until its next cell, a one-shot "
            "rank until the next cell or until the debugger is left; one-shot ranks that are threads of one process "
            "(the tpu launch path) leave with their cell, so run it in a pool (%xla_pool start) to debug it; a --fresh "
            "cell across hosts does not keep them: run it in the pool across hosts to debug it")


NOT_KEPT_FRESH_HOSTS = ("that cell ran in --fresh ranks across hosts, which end with it: run it in the pool across "
                        "hosts to debug it")
# What a rank's stop, a quit pdb or a death leaves: nothing to debug.
STOPPED = ("KeyboardInterrupt", "BdbQuit", "SystemExit", "RankDied", "LauncherDied", "LaunchError", "ProtocolError")


class PostMortem:
    """The last failed cell's ranks that keep its frames (first failure first), and their set."""

    def __init__(self, ranks: Ranks, error: RankError, run_id: int) -> None:
        self.ranks = ranks
        self.name = ranks.name  # a rank in a sentence
        self.size = ranks.size  # how many ranks the cell ran on
        self.run_id = run_id
        self.debuggable = list(error.debuggable)
        self.failures = {failure.rank: failure for failure in error.failures}
        self.parked = not ranks.policy.stops_cells_only  # a one-shot set, kept only for this
        self.error = error
        self.gone = ""  # once let go: why (a %debug of this cell's error says it)

    def choose(self, rank: int | None) -> int:
        """Rank ``rank``, or the first that failed; a UsageError naming those there are, for any other."""
        if rank is None:
            return self.debuggable[0]
        kept = ", ".join(map(str, self.debuggable))
        if not 0 <= rank < self.size:
            raise UsageError(f"cell {self.run_id} ran on ranks 0-{self.size - 1}, so it has no rank {rank}; "
                             f"%xla_debug --rank {self.debuggable[0]} opens the frame of a rank that failed"
                             if self.size > 1 else f"cell {self.run_id} ran on one rank, 0: %xla_debug alone opens "
                             f"its frame")
        if rank not in self.debuggable:
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

    def release(self, why: str) -> None:
        """A one-shot set kept for it ends now; a pool's ranks drop the frames at their next request.

        ``why``: what let it go, said by a later %debug of this cell's error.
        """
        self.gone = why
        if self.parked:
            self.ranks.stop()

    def gone_message(self) -> str:
        """What %debug of this cell's error says once its frames were let go."""
        why = f" ({self.gone})" if self.gone else ""
        return (f"cell {self.run_id}'s ranks no longer hold its frames{why}: run the cell again, and %debug once "
                f"it fails")


def why_not(ranks: Ranks, error: RankError) -> str:
    """Why no rank of a failed cell kept its frames, for %debug after it: what to do instead."""
    stopped = not error.failures or all(failure.type in STOPPED for failure in error.failures)
    if error.summary.startswith("timed out"):
        return ("that cell was stopped by --timeout, and a stopped rank keeps no frames to debug: %xla_stacks "
                "--locals shows where each rank was, with its values; put breakpoint() where to look, and run it again")
    if error.failures and all(failure.type == "BdbQuit" for failure in error.failures):
        return ("the debugger was quit (q) in that cell, which ends it where it stood, with no error to debug: "
                "run it again to stop there again")
    if ranks.state == "broken":
        return (f"that cell broke the pool ({ranks.problem or 'its ranks are gone'}), so no rank is left to debug: "
                f"%xla_pool restart, then run the cell again")
    if ranks.thread_ranks and not ranks.policy.stops_cells_only:
        return ("that cell's ranks were threads of one process (the tpu launch path), which ends with its cell: "
                "run it in a pool (%xla_pool start), where a failed rank keeps its frames for %debug")
    if ranks.world is not None and not ranks.policy.stops_cells_only:
        return NOT_KEPT_FRESH_HOSTS
    if stopped:
        return ("no rank of that cell raised an error in its code (they were stopped, or their processes died), "
                "so none has a frame to debug: %xla_stacks shows where each rank was")
    return NOT_KEPT


def keeps(ranks: Ranks, error: RankError) -> bool:
    """Whether a failed request's set is worth keeping for %debug: a rank kept frames, and the set can answer."""
    # One host of several keeps a pool's failed ranks (%debug reaches them through its engine); not one-shot ones.
    return bool(error.debuggable) and (ranks.world is None or ranks.policy.stops_cells_only) and ranks.state != "broken"
