"""The one-shot/pool policy of a set of ranks: every way the two lives differ, in one place. Runs in the kernel.

A set of ranks (ranks.py) lives one of two lives, as CPython's process
workers do with or without ``max_tasks_per_child``: a one-shot set is
launched with its one request, and its ranks answer it and leave; a pool's
ranks serve request after request and keep their namespaces, devices and
compiled graphs. The policy is decided once, when the set is made
(runner.py: one-shot; pools/this_host.py: a pool), and sent to the ranks with
their job under its name (``protocol.ONE_SHOT`` or ``protocol.POOL``,
read by launcher/serve.py). A request (request.py) asks the set's policy
what each event means for the ranks and how to word what happened; the
set (ranks.py) moves its own state.
"""

from __future__ import annotations

from xla_magic.wire import protocol

RESTART_HINT = "%xla_pool restart starts fresh ranks (their namespaces are lost)"


class Policy:
    """What a set of ranks does after a result, a failure, a lost rank or connection, and a stop."""

    name: str  # what the ranks are told with their job: protocol.ONE_SHOT or protocol.POOL
    # After a lost rank or connection (a rank's exit, its events socket or the supervisor's closing, a
    # garbled message, a start that was stopped): whether the set is broken (it cannot serve again), or
    # that is only its request's news.
    loss_breaks: bool
    # After a failure, a timeout or an interrupt: whether only the cells are stopped (SIGINT to the asked
    # ranks, repeated until they answer; ranks that do not are killed), or the ranks themselves (SIGINT,
    # SIGTERM, SIGKILL to their process group).
    stops_cells_only: bool
    # After any request: whether what is left of a broken set ends now, and its untaken results go, or
    # all of it goes when the set is stopped (a one-shot set is, once its one request is over).
    settles_after_each_request: bool

    def __repr__(self) -> str:
        return f"<{self.name} policy>"

    def stopped_note(self, one_value: bool, broken: bool) -> str:
        """What became of the ranks, once a request was stopped (a timeout)."""
        raise NotImplementedError

    def others_stopped(self) -> str:
        """What became of the ranks that had not failed, once the request stopped at a failure."""
        raise NotImplementedError

    def broken_note(self, broken: bool) -> str:
        """What a failure's summary adds about the set: whether it can serve again."""
        raise NotImplementedError

    def interrupted(self, one_value: bool, problem: str | None) -> str:
        """The message of an interrupted request; ``problem``: why the set broke, if it did."""
        raise NotImplementedError


class OneShot(Policy):
    """Ranks spawned for one cell: they answer the request that came with their job and leave."""

    name = protocol.ONE_SHOT
    loss_breaks = False
    stops_cells_only = False
    settles_after_each_request = False

    def stopped_note(self, one_value: bool, broken: bool) -> str:
        return "the SPMD process was stopped" if one_value else "the ranks were stopped"

    def others_stopped(self) -> str:
        return "; the other ranks were stopped"

    def broken_note(self, broken: bool) -> str:
        return ""

    def interrupted(self, one_value: bool, problem: str | None) -> str:
        who = "the SPMD process was" if one_value else "the ranks were"
        return (f"interrupted; {who} stopped (SIGINT, then SIGTERM/SIGKILL if needed). "
                "Results of ranks that finished are on this error's .results.")


class Kept(Policy):
    """A pool's ranks: they serve request after request until the kernel closes their sockets."""

    name = protocol.POOL
    loss_breaks = True
    stops_cells_only = True
    settles_after_each_request = True

    def stopped_note(self, one_value: bool, broken: bool) -> str:
        if broken:
            return f"the pool is broken: {RESTART_HINT}"
        return "the pool keeps its ranks and their namespaces"

    def others_stopped(self) -> str:
        return "; the others' cells were stopped"

    def broken_note(self, broken: bool) -> str:
        return f"; the pool is broken: {RESTART_HINT}" if broken else ""

    def interrupted(self, one_value: bool, problem: str | None) -> str:
        if problem is not None:
            return f"interrupted; {problem}, so the pool is broken. {RESTART_HINT}."
        return ("interrupted; the cell was stopped in every rank, and the pool keeps its ranks and "
                "their namespaces. Results of ranks that finished are on this error's .results.")


ONE_SHOT: Policy = OneShot()
POOL: Policy = Kept()
