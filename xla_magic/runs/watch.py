"""What a running request's ranks are doing while it waits: stopped by a signal, where they are, whether they hang. Runs in the kernel.

A :class:`Watch` belongs to one request (request.py) and runs in its
thread, from its pump. When progress stops (no output, no rank answering,
no line advancing), it asks every rank still at the cell where it is
(protocol.STACKS on each rank's stacks socket; the answers come back as
events through the request's pump, into the record), and shows one line
under the running cell, once, updated, where the ranks' places can only
be a hang (stacks.hang). When the request is stopped (interrupt,
--timeout, fail-fast) it asks once more and waits up to ANSWER_WAIT for
the answers: a rank that does not answer is named as busy in native code
that holds the GIL, and read from outside with py-spy where installed.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from xla_magic.runs import stacks
from xla_magic.ranks.ranks import process_stopped
from xla_magic.runs.record import RunRecord
from xla_magic.runs.sink import Sink
from xla_magic.wire.help import see


class Followed(Protocol):
    """What the watchdog reads of the run it follows, and the two things it does to it (request.py's Request)."""

    record: RunRecord
    ranks: Any  # the set's naming, pids, world and ask_where (ranks.py)
    targets: list[int]
    done: set[int]
    failures: dict[int, Any]
    output: Any  # its lines so far (.lines)
    sink: Sink  # where what it says goes (sink.py)
    sent: bool
    stop_reason: str | None

    def unsettled(self, ranks: list[int] | None = None) -> list[int]: ...
    def pump(self, timeout: float) -> None: ...
    def rank_state(self, rank: int, value: str) -> None: ...
    def tag_of(self, ranks: list[int]) -> str: ...

# The default hang delay. A collective takes milliseconds once every rank is
# in it; ranks drift apart for longer only when one compiles or evaluates
# alone, which rarely passes a minute. A compile or device op on every rank
# is never a hang, however long.
HANG_AFTER = 60.0
ANSWER_WAIT = 1.0  # how long a rank's sampler gets to answer; past it the rank holds the GIL
WHEN = {"interrupt": "when interrupted", "timeout": "when --timeout stopped it",
        "failure": "when the failure stopped the others"}


class HangLine:
    """The watchdog's one line under the running cell, through the run's sink: updated in place where the sink can
    (a notebook's display), else said once. One a run, whoever judges (a request's Watch, or the kernel for every
    host's ranks)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._line: Any = None
        self._shown: str | None = None

    def show(self, line: str) -> None:
        if line == self._shown:
            return
        if self._line is None:
            self._line = self._sink.line_in_place()
        self._line(line)
        self._shown = line


def confirm_after(hang_after: float) -> float:
    """How often the watchdog looks while nothing moves, which is also how long a wait must be seen to count."""
    return min(max(hang_after / 4, 0.5), 5.0)


class Watch:
    """One request's watchdog and its reading of where the ranks are."""

    def __init__(self, request: Followed, hang_after: float | None) -> None:
        self.request = request
        self.hang_after = HANG_AFTER if hang_after is None else hang_after
        self.every = confirm_after(self.hang_after)  # how often to look while nothing moves
        self.stopped_pids: set[int] = set()  # rank processes seen stopped (SIGSTOP)
        self._probe = 0
        self._asked: dict[int, float] = {}  # rank -> when the open probe asked it
        self._marker: tuple = ()
        self._quiet_since = time.monotonic()
        self._looked = 0.0
        self._at: dict[int, tuple[tuple, float]] = {}  # rank -> (its point, since when it is there)
        # A host of several says nothing itself: the kernel judges every host's ranks together (hosts/request.py).
        self.line = HangLine(request.sink) if request.ranks.world is None else None
        self._capturing = False

    @property
    def capturing(self) -> bool:
        """Asking where the ranks are at a stop (its pump must not open a prompt)."""
        return self._capturing

    # -- answers -----------------------------------------------------------

    def take(self, rank: int, fields: dict[str, Any]) -> None:
        """A rank's STACKS answer to the open probe; a late one (to a probe given up on) is old news, dropped."""
        record = self.request.record
        if rank not in record.ranks or fields.get("probe") != self._probe or rank not in self._asked:
            return
        if self.request.stop_reason is not None:
            return  # the stop has moved the ranks since
        del self._asked[rank]
        complete = not self._asked
        answer = dict(fields)
        record.stacks[rank] = answer
        record.ranks[rank].where = stacks.summary(answer)
        spot = stacks.point(answer)
        before = self._at.get(rank)
        if before is None or before[0] != spot:
            self._at[rank] = (spot, self._quiet_since if before is None else time.monotonic())
        record.arrived[rank] = self._at[rank][1]
        if complete and not self._capturing:
            self._judge(time.monotonic())

    def _unanswered(self, ranks: list[int]) -> None:
        record = self.request.record
        for rank in ranks:
            answer = {"rank": rank, "unanswered": stacks.GIL_BUSY, "pid": self.request.ranks.pids.get(rank)}
            pid = answer["pid"]
            dump = stacks.pyspy_dump(pid) if pid and self._capturing and not process_stopped(pid) else None
            if dump:
                answer["pyspy"] = dump
            record.stacks[rank] = answer
            record.ranks[rank].where = stacks.summary(answer)
            self._asked.pop(rank, None)
            before = self._at.get(rank)
            if before is None or before[0] != stacks.point(answer):  # how long it has not answered
                self._at[rank] = (stacks.point(answer), self._quiet_since if before is None else time.monotonic())

    def _at_cell(self) -> list[int]:
        """The asked ranks still at the cell, whose samplers run (a rank not yet started has none)."""
        request = self.request
        return [rank for rank in request.unsettled() if request.record.ranks[rank].state == "running"]

    def _ask(self, ranks: list[int], with_locals: bool = False) -> None:
        self._probe += 1
        now = time.monotonic()
        self._asked = {rank: now for rank in self.request.ranks.ask_where(ranks, self._probe,
                                                                           with_locals=with_locals)}

    # -- the watchdog --------------------------------------------------------

    def tick(self) -> None:
        """From the request's pump, at most every TICK_INTERVAL: look, judge, show."""
        if self._capturing:
            return
        self.notice_stopped_ranks()
        request = self.request
        now = time.monotonic()
        marker = (request.output.lines, len(request.done), len(request.failures))
        if marker != self._marker:
            self._marker, self._quiet_since = marker, now
            self._at.clear()
        if self._asked and now - min(self._asked.values()) > ANSWER_WAIT:
            self._unanswered(list(self._asked))
            self._judge(now)
        running = self._at_cell()
        if not running or not request.sent or request.stop_reason is not None:
            return
        if now - self._quiet_since >= self.every and now - self._looked >= self.every and not self._asked:
            self._looked = now
            self._ask(running)

    def _judge(self, now: float) -> None:
        request = self.request
        where: dict[int, dict[str, Any]] = {}
        for rank in request.targets:
            if rank in request.done:
                where[rank] = {"phase": "finished"}
            elif rank in request.record.stacks:
                where[rank] = request.record.stacks[rank]
        if len(where) < len(request.targets):
            return
        waited = {rank: now - since for rank, (_spot, since) in self._at.items()}
        line = stacks.hang(where, waited, self.hang_after, confirm=self.every,
                           one_value=request.ranks.one_value, label=request.ranks.label)
        if line is not None:
            request.record.hang = line
            request.record.stacks_when = "at the watchdog's warning"
            if self.line is not None:
                self.line.show(line)

    # -- at the stop -----------------------------------------------------------

    def capture(self, reason: str) -> None:
        """Ask every rank still at the cell where it is, before the stop; wait up to ANSWER_WAIT for them."""
        request = self.request
        running = self._at_cell()
        if not running:
            return
        self._capturing = True
        try:
            for rank in request.unsettled():
                request.record.stacks.pop(rank, None)
                if request.record.ranks[rank].state == "stopped":  # SIGSTOP: it cannot answer, nor be read
                    request.record.stacks[rank] = {"unanswered": "stopped by a signal (SIGSTOP or SIGTSTP)"}
            self._ask(running, with_locals=True)  # for %xla_stacks --locals
            deadline = time.monotonic() + ANSWER_WAIT
            while self._asked and time.monotonic() < deadline:
                request.pump(0.05)
            self._unanswered(list(self._asked))
        except KeyboardInterrupt:
            pass  # a second interrupt: stop now, with what came
        finally:
            self._capturing = False
        for rank in request.targets:
            if rank in request.failures:
                request.record.stacks[rank] = {"phase": "failed"}
            elif rank in request.done and rank not in request.record.stacks:
                request.record.stacks[rank] = {"phase": "finished"}
        request.record.stacks_when = WHEN.get(reason, f"when stopped ({reason})")

    def where_lines(self) -> list[str]:
        """Where every rank was at the stop, grouped (empty when nothing was asked)."""
        record = self.request.record
        if not record.stacks:
            return []
        return [f"Where each rank was {record.stacks_when}:"] + stacks.render(
            record.stacks, one_value=self.request.ranks.one_value, label=self.request.ranks.label)

    # -- ranks stopped by a signal ------------------------------------------------

    def notice_stopped_ranks(self) -> None:
        """A rank stopped by SIGSTOP/SIGTSTP would hang the cell in silence: say so, once."""
        request = self.request
        running = {rank: request.ranks.pids[rank] for rank in request.unsettled() if rank in request.ranks.pids}
        for pid in set(running.values()):
            stopped = process_stopped(pid)
            ranks = [rank for rank, owner in running.items() if owner == pid]
            if stopped and pid not in self.stopped_pids:
                self.stopped_pids.add(pid)
                for rank in ranks:
                    request.rank_state(rank, "stopped")
                request.sink.write("stdout", f"[{request.tag_of(ranks)}] stopped by a signal (SIGSTOP or SIGTSTP; "
                                   f"process {pid}): the cell waits for it. `kill -CONT {pid}` resumes it; interrupt "
                                   f"or --timeout ends the cell. " + see("rank-stopped-by-signal") + "\n")
            elif not stopped and pid in self.stopped_pids:
                self.stopped_pids.discard(pid)
                for rank in ranks:
                    request.rank_state(rank, "running")

    def stopped_ranks(self) -> str:
        """What to add to a timeout's message when ranks were stopped by a signal meanwhile."""
        request = self.request
        ranks = [rank for rank in request.unsettled() if request.ranks.pids.get(rank) in self.stopped_pids]
        if not ranks:
            return ""
        return f" while rank(s) {', '.join(map(str, ranks))} stayed stopped by SIGSTOP/SIGTSTP"


# --- between cells: where a pool's ranks are now ------------------------------------------

_between = 0  # the probes asked between cells count down from -1: never a request's


def where_now(ranks: Any, everything: bool = False, with_locals: bool = False) -> dict[int, dict[str, Any]]:
    """Where a pool's ranks are now, with the threads a cell left running (``%xla_stacks``); no request runs."""
    import selectors

    global _between
    _between -= 1
    probe = _between
    asked = set(ranks.ask_where(list(range(ranks.size)), probe, everything, with_locals))
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + ANSWER_WAIT
    with selectors.DefaultSelector() as selector:
        for rank in asked:
            selector.register(ranks.samplers[rank].sock, selectors.EVENT_READ, ranks.samplers[rank])
        while len(found) < len(asked) and time.monotonic() < deadline:
            for key, _mask in selector.select(max(0.0, deadline - time.monotonic())):
                conn = key.data
                data = conn.receive()
                for event in conn.reader.feed(data or b""):
                    if event.fields.get("probe") == probe:
                        found[conn.rank] = dict(event.fields, between_cells=True)
    for rank in range(ranks.size):
        if rank not in found:
            pid = ranks.pids.get(rank)
            answer: dict[str, Any] = {"unanswered": stacks.GIL_BUSY, "pid": pid}
            if pid and not process_stopped(pid):
                answer["pyspy"] = stacks.pyspy_dump(pid)
            found[rank] = answer
    return found


def report(history: list[Any], pool: Any, rank: int | None, everything: bool, with_locals: bool = False) -> list[str]:
    """``%xla_stacks``: the last stuck or stopped cell's stacks, then where a pool's ranks are now."""
    from IPython.core.error import UsageError

    last = next((record for record in reversed(history) if record.stacks), None)
    size = pool.world_size if pool is not None else len(last.ranks) if last is not None else 0
    if rank is not None and not 0 <= rank < max(size, 1):
        raise UsageError(f"--rank must be between 0 and {max(size, 1) - 1}")
    if last is None and pool is None:
        raise UsageError("no cell has been stuck or stopped yet, and no pool runs: %xla_stacks shows where the ranks "
                         "were when a cell was stopped (interrupt, --timeout, a failure) or the watchdog spoke")
    only = None if rank is None else [rank]
    one_value = pool.one_value if pool is not None else False
    lines: list[str] = []
    if last is not None:
        first = last.cell.strip().splitlines()[0] if last.cell.strip() else ""
        lines.append(f"Where each rank was {last.stacks_when} (cell {last.run_id}, {first[:60]!r}):")
        if last.hang:
            lines.append(last.hang)
        lines.extend(stacks.render(last.stacks, only, everything, one_value=one_value,
                                   label=pool.label if pool is not None else None, with_locals=with_locals))
    if pool is not None and pool.state in ("ready", "running"):
        lines.append("Where the pool's ranks are now:")
        lines.extend(stacks.render(pool.where_now(everything, with_locals), only, everything, one_value=one_value,
                                   label=pool.label, with_locals=with_locals))
    return lines
