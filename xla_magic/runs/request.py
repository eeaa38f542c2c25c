"""One request to a set of ranks, followed from the kernel to the end. Runs in the kernel.

The same for every request: a one-shot cell (its request went to the ranks
with their job), a pool's start, a pool cell, a push or a pull. It runs in
the thread that runs the cell, so output lands in the running cell and
Ctrl-C / the stop button arrive here as KeyboardInterrupt: events and raw
output from every rank, fail-fast, interrupt and timeout escalation,
results, and what a rank asks to display (DISPLAY). Everything it has to say goes to the sink it is
given (sink.py): the cell's views, a background run's log, or a host's relay; it imports no view.
The set's placement names its ranks in output and errors (``[rank N]``, or
``[spmd]`` for the one SPMD process).

A request is over when every rank it asked has answered (DONE) or is gone
(its events socket closed, or the supervisor reported its exit), whatever
children the ranks left holding their sockets: the supervisor ends those.

What an event means for the ranks, how the request stops and how its end
is worded follow from the set's policy (policy.py), which the request asks;
the set moves its own state from what the request reports. A one-shot
set's ranks are signalled as a group: SIGINT, then SIGTERM, then SIGKILL.
A pool's ranks only have their cell interrupted (SIGINT, repeated until
they answer), so the pool lives on; ranks that will not answer are killed
and the pool is broken.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic.runs import events, stopping, wording
from xla_magic.runs.stopping import EXIT_CODE_WAIT
from xla_magic.runs.output import DEFAULT_LINES_PER_RANK, TaggedOutput
from xla_magic.runs.sink import Sink
from xla_magic.runs.errors import RankFailure, RunInterrupted
from xla_magic.ranks.launcher_client import PrivateDir
from xla_magic.ranks.policy import RESTART_HINT
from xla_magic.ranks.ranks import Conn, Ranks, describe_exit
from xla_magic.runs.record import RankState, RunRecord
from xla_magic.runs.watch import Watch
from xla_magic.wire.help import see
from xla_magic.wire import protocol, result_memory

FAIL_GRACE = 0.5  # after a rank fails, how long to collect the others' errors
TICK_INTERVAL = 0.5  # how often listeners hear of a running request with no news


_ENDED_STATES = ("done", "failed", "killed")


class Request:
    """One request to ``ranks``, followed until every rank it asked has answered or gone."""

    def __init__(
        self,
        ranks: Ranks,
        record: RunRecord,
        seq: int,
        frame: bytes | None,
        *,
        workdir: PrivateDir,
        has_result: bool,
        timeout: float | None = None,
        targets: list[int] | None = None,
        on_update: Callable[[RunRecord], None] = lambda record: None,
        sink: Sink | None = None,
        hang_after: float | None = None,
        tells_digest: bool = True,
    ) -> None:
        self.ranks = ranks
        # A pool's ranks read their --profile traces once told (DIGEST): by this request when it is over, or
        # by the kernel's drawing of the profile once the kernel is done with the cell (profile_drawer.py).
        self.tells_digest = tells_digest
        self.sink = sink or Sink()  # where what happens goes: the cell's views, a run's log, a host's relay
        self.record = record
        self.seq = seq
        self.frame = frame  # None: it went with the ranks' job, or there is nothing to send (a start)
        self.has_result = has_result
        self.timeout = timeout
        self.targets = list(range(ranks.size)) if targets is None else targets
        self.on_update = on_update
        self.sent = frame is None
        self.delivered = frame is None  # every asked rank got the whole request
        self._live = self.sink.live_lines(ranks.label)
        # Folded logs outlive the request: the cell printed their paths. One host of several folds nothing:
        # it relays every line to the kernel, which keeps what it cannot show where the notebook can open it.
        self.output = TaggedOutput(
            lines_per_rank=None if ranks.world else DEFAULT_LINES_PER_RANK,
            log_dir=lambda: workdir.new(f"logs-{record.run_id}-"), on_line=self._on_line, live=self._live,
            label=ranks.label, quiet=ranks.quiet_line, write=self.sink.write,
        )
        self.results: dict[int, Any] = {}
        self.lent: list[result_memory.Segment] = []  # result segments lent to the ranks for this request
        self.failures: dict[int, RankFailure] = {}
        self.debuggable: list[int] = []  # failed ranks that keep the cell's frames for %debug, in the order they failed
        self.done: set[int] = set()  # answered DONE
        self.lost: dict[int, float] = {}  # gone before DONE -> when that was noticed
        self.exit_codes: dict[int, int] = {}
        self.launch_error: str | None = None
        self.first_failure_at: float | None = None
        self.stop_reason: str | None = None  # failure, timeout or interrupt, once we stop the request
        self.prompt_seconds = 0.0  # spent at the kernel's prompt for a rank, which --timeout does not count
        self._last_tick = 0.0
        self._lines_counted = 0
        record.ranks = {rank: RankState(pid=ranks.pids.get(rank)) for rank in range(ranks.size)}
        self.watch = Watch(self, hang_after)  # where the ranks are; the hang watchdog

    # -- starting --------------------------------------------------------

    def start(self) -> None:
        """Check that the ranks can take the request; a kept set first reads its news from between requests."""
        for rank in range(self.ranks.size):
            if rank not in self.targets:
                self.done.add(rank)
                self.record.ranks[rank].state = "done"
        if self.ranks.state == "starting":
            return
        self.pump(0)  # a rank that died since, stray output
        if self.ranks.state == "broken":
            self.finish("failed")
            self._after()  # what is left of the pool ends now, with all its cells started
            raise UsageError(
                f"the pool lost a rank before this request ({self.ranks.problem}); nothing ran. {RESTART_HINT}."
            )
        self.ranks.request_began()

    def _send(self) -> None:
        """Send the request to every asked rank.

        Called from inside :meth:`wait`, so an interrupt while sending stops
        the ranks that got the request like any other interrupt; a rank that
        got none of it is not waited for, one that got part of it broke the
        set (:meth:`Ranks.send`). An interrupt can land just as a send has
        finished, before it is counted: that rank may have the whole request
        and be running its cell, so it stays to be interrupted and waited for.
        One that lands before the first byte went (``Ranks.writing``) leaves
        that rank out, as the ranks not reached yet are: it has nothing to stop.
        """
        self.sent = True
        for rank in self.targets:
            self.record.ranks[rank].state = "running"
        self.on_update(self.record)
        asked: set[int] = set()
        try:
            for rank in self.targets:
                self.ranks.writing = None
                try:
                    if self.has_result:
                        self._lend(rank)
                    self.ranks.send(rank, self.frame)
                except OSError as exc:
                    self.ranks.mark_broken(f"{self.ranks.name(rank)} could not be reached ({exc})")
                    self.fail(rank, "RankDied", f"{self.ranks.name(rank)} could not be reached: {exc}")
                    self.done.add(rank)
                    continue
                asked.add(rank)
        finally:
            # ``writing`` names at most the rank being sent to: a rank neither asked nor written to got nothing.
            for rank in self.targets:
                if rank not in asked and rank not in self.done and self.ranks.writing != rank:
                    self.done.add(rank)
                    self.rank_state(rank, "killed")
            self.delivered = len(asked) == len(self.targets)

    def _lend(self, rank: int) -> None:
        """Free segments of results the notebook dropped, for ``rank``'s large results to reuse (result_memory)."""
        segments = result_memory.MEMORY.lend(rank)
        if segments:
            self.lent += segments  # taken back when the request is over, whatever happens next
            self.ranks.lend(rank, segments)

    # -- following -------------------------------------------------------

    def wait(self) -> list[Any] | None:
        """Pump events until every asked rank is accounted for; results by rank."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while self._running():
                if self.first_failure_at is not None and time.monotonic() - self.first_failure_at > FAIL_GRACE:
                    stopping.stop(self, "failure")
                    break
                if deadline is not None and time.monotonic() - self.prompt_seconds > deadline:
                    stopped = self.watch.stopped_ranks()
                    stopping.stop(self, "timeout")
                    raise wording.error(self, f"timed out after {self.timeout:g} s (--timeout){stopped}; {wording.stopped_note(self)}")
                if self.record.interrupt_requested:
                    raise KeyboardInterrupt
                self.pump(0.1)
                self._tick()
        except KeyboardInterrupt:
            stopping.stop(self, "interrupt")
            self.finish("interrupted")
            raise RunInterrupted(wording.interrupted_message(self), dict(self.results), where=self.watch.where_lines()) from None
        finally:
            self._after()
        self._account_for_missing_ranks()
        if self.failures:
            self.finish("failed")
            raise wording.error(self, wording.failure_summary(self))
        self.finish("done")
        if not self.has_result:
            return None
        # Handed over, not kept: a finished request may live on in reference
        # cycles, and a result's memory must go when the notebook drops it.
        results, self.results = self.results, {}
        return [results.get(rank) for rank in range(self.ranks.size)]

    def _after(self) -> None:
        """However the request ended: the output it left, its untaken results, the set's state."""
        self.drain_output()
        result_memory.MEMORY.take_back(self.lent)  # what the ranks did not write over: they closed it
        if self.record.profile and self.tells_digest:
            self.tell_digest()
        if self.record.outcome == "running":  # the stop itself was broken off
            self.finish("interrupted" if self.stop_reason == "interrupt" else "failed")
        self.ranks.request_over(self.has_result)

    def tell_digest(self) -> None:
        """A pool's ranks read their --profile traces now (a one-shot rank read its own before it replied)."""
        if self.ranks.policy.stops_cells_only:
            self.ranks.tell(self.targets, protocol.encode(protocol.DIGEST))

    def settled(self, rank: int) -> bool:
        return rank in self.done or rank in self.lost

    def unsettled(self, ranks: list[int] | None = None) -> list[int]:
        return [rank for rank in (self.targets if ranks is None else ranks) if not self.settled(rank)]

    def _running(self) -> bool:
        if not self.sent:
            self._send()
        if self.unsettled():
            if self.ranks.ended or not self.ranks.selector.get_map():
                self.drain_events()
                for rank in self.unsettled():  # nothing more can come from them
                    self.lost[rank] = time.monotonic()
                return False
            return True
        return self._waiting_for_exit_codes()

    def _waiting_for_exit_codes(self) -> bool:
        """A rank is gone: give its exit code a moment to arrive."""
        missing = [rank for rank in self.lost if rank not in self.exit_codes and rank not in self.done]
        if not missing or self.ranks.ended:
            return False
        return time.monotonic() - min(self.lost[rank] for rank in missing) < EXIT_CODE_WAIT

    def _tick(self) -> None:
        """Let listeners show lines and elapsed time, and notice stopped ranks, at most every TICK_INTERVAL."""
        now = time.monotonic()
        if now - self._last_tick >= TICK_INTERVAL:
            self._last_tick = now
            self.watch.tick()
            self.on_update(self.record)

    def pump(self, timeout: float) -> None:
        if not self.ranks.selector.get_map():
            time.sleep(timeout)
            return
        for key, _mask in self.ranks.selector.select(timeout):
            self._read(key.data)

    def _read(self, conn: Conn) -> None:
        data = conn.receive()
        if data is None:
            return
        if not data:
            self._closed(conn)
        elif conn.reader is None:
            if self.ranks.world and conn.rank not in self.ranks.ordinals:  # its tag needs the global rank it said
                self.drain([self.ranks.events[conn.rank]])
            self.output.feed(conn.rank, conn.kind, data)
        else:
            for event in conn.reader.feed(data):
                events.handle(self, conn, event)

    def drain(self, conns: list[Conn]) -> None:
        """Read what ``conns`` hold now, without waiting for more."""
        for conn in conns:
            left = conn.bytes_waiting()
            while left > 0 and conn.sock.fileno() >= 0:
                before = conn.sock.fileno()
                self._read(conn)
                if conn.sock.fileno() < 0 or before < 0:
                    break
                left = conn.bytes_waiting()

    def drain_output(self) -> None:
        """What the ranks wrote before their DONE, or before they died: their output sockets hold it now.

        A rank's background thread may go on printing; what it writes after
        this moment shows in the next request.
        """
        self.drain([conn for conn in self.ranks.outputs if conn.rank in self.targets])

    def drain_events(self) -> None:
        self.drain([conn for conn in self.ranks.events if conn.rank in self.targets])

    def _closed(self, conn: Conn) -> None:
        try:
            self.ranks.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.reader is not None and conn.reader.pending():
            self.fail(conn.rank if conn.rank is not None else -1, "ProtocolError",
                       f"truncated message ({conn.reader.pending()} bytes) when the channel closed")
        if conn.kind == "supervisor":
            events.supervisor_ended(self, None)
        elif conn.kind == "events" and conn.rank in self.targets and not self.settled(conn.rank):
            self.lose(conn.rank)
        if conn.kind in ("supervisor", "events"):
            who = "the pool's supervisor" if conn.rank is None else self.ranks.name(conn.rank)
            self.ranks.lost(self.ranks.launcher_death() or f"{who} ended", guess=True)

    def lose(self, rank: int) -> None:
        """The rank is gone before answering; its exit code says how, when it comes."""
        self.lost[rank] = time.monotonic()
        self.rank_state(rank, "killed" if self.stop_reason else "failed")

    def fail(self, rank: int, type_: str, message: str, traceback: str = "", exit_code: int | None = None) -> None:
        self.failures.setdefault(rank, RankFailure(rank, type_, message, traceback, exit_code))
        if rank >= 0:
            # Errors that follow our own stop signals are the stop, not a fault.
            self.rank_state(rank, "killed" if self.stop_reason else "failed")
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _account_for_missing_ranks(self) -> None:
        """Asked ranks that ended without a word: say how, from their exit code or the launcher's end."""
        death = self.ranks.launcher_death()
        for rank in self.targets:
            if rank in self.failures or rank in self.results or self.record.ranks[rank].state == "done":
                continue
            code = self.exit_codes.get(rank)
            if self.stop_reason is not None:
                self.rank_state(rank, "killed")
            elif death is not None:
                self.fail(rank, "LauncherDied", death, exit_code=code)
            elif self.launch_error and code is None and rank in self.ranks.pids:
                # The tpu path: the rank's process died mid-cell and xmp.spawn
                # raised; its traceback is torch_xla's, its last line the news.
                cause = self.launch_error.strip().splitlines()[-1]
                self.fail(rank, "RankDied", f"{self.ranks.name(rank)}'s process ended during the cell: {cause}")
            elif self.launch_error and code is None:
                self.fail(rank, "LaunchError", "the ranks could not be started", self.launch_error)
            elif code is None and rank not in self.ranks.pids and self.ranks.backend == "tpu":
                self.fail(rank, "NotStarted", self._never_started())
            else:
                self.fail(rank, "RankDied", f"{self.ranks.name(rank)} ended without reporting: {describe_exit(code)}",
                           exit_code=code)

    def _never_started(self) -> str:
        """The tpu path's ranks that torch_xla's spawn did not start: how many it did, and what it went by."""
        started = len(set(self.ranks.pids.values()))
        missing = [rank for rank in self.targets if rank not in self.ranks.pids]
        info = (self.ranks.launcher.info or {}) if self.ranks.launcher is not None else {}
        device = f" (torch_xla's PJRT_DEVICE in the launcher: {info['pjrt_device']})" if info.get("pjrt_device") else ""
        return (f"torch_xla's spawn started {started} process{'' if started == 1 else 'es'} of the "
                f"{len(self.targets)} expected: rank(s) {', '.join(map(str, missing))} never started{device}; "
                f"torch_xla counts the processes itself, from the chips, PJRT_DEVICE and TPU_PROCESS_BOUNDS. "
                + see("spawn-started-fewer"))

    # -- stopping --------------------------------------------------------

    # -- bookkeeping -----------------------------------------------------

    def _on_line(self, rank: int, stream: str, line: str) -> None:
        # Called once per batch of complete lines with the batch's last line;
        # the output's running total says how many lines the batch held.
        batch = self.output.lines - self._lines_counted
        self._lines_counted = self.output.lines
        state = self.record.ranks.get(rank)
        if state is not None:
            state.lines += batch
            state.last_line = line

    def tag_of(self, ranks: list[int]) -> str:
        return self.ranks.label(ranks[0]) if self.ranks.one_value else f"rank {wording.listed(ranks)}"

    def rank_state(self, rank: int, value: str) -> None:
        state = self.record.ranks[rank]
        if state.state in ("failed", "killed"):
            return
        state.state = value
        if value in _ENDED_STATES:
            state.ended = time.monotonic()
        self.on_update(self.record)

    def finish(self, outcome: str) -> None:
        if self._live is not None:
            self._live.clear()
        for path in self.output.finish():
            self.sink.write("stdout", f"(complete log: {path})\n")
        self.record.outcome = outcome
        self.record.duration = time.time() - self.record.started
        self.on_update(self.record)
