"""One request to a set of ranks, followed from the kernel to the end. Runs in the kernel.

The same for every request: a one-shot cell (its request went to the ranks
with their job), a pool's start, a pool cell, a push or a pull. It runs in
the thread that runs the cell, so output lands in the running cell and
Ctrl-C / the stop button arrive here as KeyboardInterrupt: events and raw
output from every rank, fail-fast, interrupt and timeout escalation,
results, and what a rank asks to display (DISPLAY: rank_display.py).
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

import signal
import time
from typing import Any, Callable

from IPython.core.error import UsageError

from xla_magic import rank_display, rank_input
from xla_magic.wire import protocol, transport
from xla_magic.display import (DEFAULT_LINES_PER_RANK, DebuggerQuit, LiveLines, RankError, RankFailure, RunInterrupted,
                               TaggedOutput)
from xla_magic.launcher_client import PrivateDir
from xla_magic.policy import RESTART_HINT
from xla_magic.ranks import Conn, Ranks, describe_exit
from xla_magic.record import RankState, RunRecord
from xla_magic.watch import Watch

FAIL_GRACE = 0.5  # after a rank fails, how long to collect the others' errors
STOP_GRACE = 1.5  # between SIGINT, SIGTERM and SIGKILL; how long a pool's ranks get to answer SIGINT
EXIT_CODE_WAIT = 1.0  # after a rank is gone, how long to wait for its exit code
TICK_INTERVAL = 0.5  # how often listeners hear of a running request with no news
# Rank threads (the tpu launch path) take an interrupt only between bytecodes,
# so one in native code (an XLA compile, .item(), a sleep) gets this long.
THREAD_STOP_GRACE = 30.0
RESEND_INTERRUPT = 0.25  # while a pool rank has not answered, SIGINT again this often


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
        live_lines: bool = False,
        hang_after: float | None = None,
        ask: rank_input.Ask | None = None,
    ) -> None:
        self.ranks = ranks
        self.ask = ask  # how a rank's question is asked (rank_input.ask_here, or a host's link to the kernel)
        self.record = record
        self.seq = seq
        self.frame = frame  # None: it went with the ranks' job, or there is nothing to send (a start)
        self.has_result = has_result
        self.timeout = timeout
        self.targets = list(range(ranks.size)) if targets is None else targets
        self.on_update = on_update
        self.sent = frame is None
        self.delivered = frame is None  # every asked rank got the whole request
        self._live = LiveLines(label=ranks.label) if live_lines else None
        # Folded logs outlive the request: the cell printed their paths. One host of several folds nothing:
        # it relays every line to the kernel, which keeps what it cannot show where the notebook can open it.
        self.output = TaggedOutput(
            lines_per_rank=None if ranks.world else DEFAULT_LINES_PER_RANK,
            log_dir=lambda: workdir.new(f"logs-{record.run_id}-"), on_line=self._on_line, live=self._live,
            label=ranks.label, quiet=ranks.quiet_line,
        )
        self.results: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        self.debuggable: list[int] = []  # failed ranks that keep the cell's frames for %debug, in the order they failed
        self.done: set[int] = set()  # answered DONE
        self.lost: dict[int, float] = {}  # gone before DONE -> when that was noticed
        self.exit_codes: dict[int, int] = {}
        self.launch_error: str | None = None
        self.first_failure_at: float | None = None
        self.stop_reason: str | None = None  # failure, timeout or interrupt, once we stop the request
        self._last_tick = 0.0
        self._lines_counted = 0
        record.ranks = {rank: RankState(pid=ranks.pids.get(rank)) for rank in range(ranks.size)}
        self.watch = Watch(self, hang_after, notebook=live_lines)  # where the ranks are; the hang watchdog

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
            self._finish("failed")
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
                    self.ranks.send(rank, self.frame)
                except OSError as exc:
                    self.ranks.mark_broken(f"{self.ranks.name(rank)} could not be reached ({exc})")
                    self._fail(rank, "RankDied", f"{self.ranks.name(rank)} could not be reached: {exc}")
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

    # -- following -------------------------------------------------------

    def wait(self) -> list[Any] | None:
        """Pump events until every asked rank is accounted for; results by rank."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while self._running():
                if self.first_failure_at is not None and time.monotonic() - self.first_failure_at > FAIL_GRACE:
                    self._stop("failure")
                    break
                if deadline is not None and time.monotonic() > deadline:
                    stopped = self.watch.stopped_ranks()
                    self._stop("timeout")
                    raise self._error(f"timed out after {self.timeout:g} s (--timeout){stopped}; {self._stopped_note()}")
                if self.record.interrupt_requested:
                    raise KeyboardInterrupt
                self.pump(0.1)
                self._tick()
        except KeyboardInterrupt:
            self._stop("interrupt")
            self._finish("interrupted")
            raise RunInterrupted(self._interrupted_message(), dict(self.results), where=self.watch.where_lines()) from None
        finally:
            self._after()
        self._account_for_missing_ranks()
        if self.failures:
            self._finish("failed")
            raise self._error(self._failure_summary())
        self._finish("done")
        if not self.has_result:
            return None
        # Handed over, not kept: a finished request may live on in reference
        # cycles, and a result's memory must go when the notebook drops it.
        results, self.results = self.results, {}
        return [results.get(rank) for rank in range(self.ranks.size)]

    def _after(self) -> None:
        """However the request ended: the output it left, its untaken results, the set's state."""
        self._drain_output()
        if self.record.outcome == "running":  # the stop itself was broken off
            self._finish("interrupted" if self.stop_reason == "interrupt" else "failed")
        self.ranks.request_over(self.has_result)

    def _settled(self, rank: int) -> bool:
        return rank in self.done or rank in self.lost

    def unsettled(self, ranks: list[int] | None = None) -> list[int]:
        return [rank for rank in (self.targets if ranks is None else ranks) if not self._settled(rank)]

    def _running(self) -> bool:
        if not self.sent:
            self._send()
        if self.unsettled():
            if self.ranks.ended or not self.ranks.selector.get_map():
                self._drain_events()
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
            self.output.feed(conn.rank, conn.kind, data)
        else:
            for event in conn.reader.feed(data):
                self._handle(conn, event)

    def _drain(self, conns: list[Conn]) -> None:
        """Read what ``conns`` hold now, without waiting for more."""
        for conn in conns:
            left = conn.bytes_waiting()
            while left > 0 and conn.sock.fileno() >= 0:
                before = conn.sock.fileno()
                self._read(conn)
                if conn.sock.fileno() < 0 or before < 0:
                    break
                left = conn.bytes_waiting()

    def _drain_output(self) -> None:
        """What the ranks wrote before their DONE, or before they died: their output sockets hold it now.

        A rank's background thread may go on printing; what it writes after
        this moment shows in the next request.
        """
        self._drain([conn for conn in self.ranks.outputs if conn.rank in self.targets])

    def _drain_events(self) -> None:
        self._drain([conn for conn in self.ranks.events if conn.rank in self.targets])

    def _closed(self, conn: Conn) -> None:
        try:
            self.ranks.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.reader is not None and conn.reader.pending():
            self._fail(conn.rank if conn.rank is not None else -1, "ProtocolError",
                       f"truncated message ({conn.reader.pending()} bytes) when the channel closed")
        if conn.kind == "supervisor":
            self._supervisor_ended(None)
        elif conn.kind == "events" and conn.rank in self.targets and not self._settled(conn.rank):
            self._lose(conn.rank)
        if conn.kind in ("supervisor", "events"):
            who = "the pool's supervisor" if conn.rank is None else self.ranks.name(conn.rank)
            self.ranks.lost(self.ranks.launcher_death() or f"{who} ended", guess=True)

    def _lose(self, rank: int) -> None:
        """The rank is gone before answering; its exit code says how, when it comes."""
        self.lost[rank] = time.monotonic()
        self.rank_state(rank, "killed" if self.stop_reason else "failed")

    def _handle(self, conn: Conn, event: protocol.Event) -> None:
        kind, fields = event
        rank = conn.rank
        if kind == protocol.BROKEN:
            self._fail(rank if rank is not None else -1, "ProtocolError", f"garbled message: {fields['reason']}")
            self.ranks.lost(f"a garbled message from the ranks ({fields.get('reason')})")
        elif conn.kind == "supervisor":
            self._handle_supervisor(kind, fields)
        elif kind == protocol.STATUS:
            self._take_status(rank, fields)
        elif kind == protocol.DISPLAY:
            self._show(rank, fields)
        elif kind == protocol.INPUT:
            self._answer_input(rank, fields)
        elif kind == protocol.STACKS:
            self.watch.take(rank, fields)
        elif fields.get("seq") != self.seq:
            return  # a reply to a request the kernel gave up on
        elif kind == protocol.RESULT:
            self._take_result(rank, fields)
        elif kind in (protocol.XLA, protocol.PROFILE):  # what a rank process tells of the cell, with its reply
            self.record.take(kind, fields["account" if kind == protocol.XLA else "profile"])
            if kind == protocol.PROFILE:  # (after its account) a listener may take it at once: profile_lanes.Reader
                self.on_update(self.record)
        elif kind == protocol.ERROR:
            if self.stop_reason is not None and fields.get("type") == "KeyboardInterrupt":
                self.rank_state(rank, "killed")  # our own SIGINT, not a fault of the rank
            else:
                self._fail(rank, fields["type"], fields["message"], fields.get("traceback", ""))
                if fields.get("post_mortem") and rank not in self.debuggable:
                    self.debuggable.append(rank)
        elif kind == protocol.DONE:
            self.done.add(rank)
            self.record.ranks[rank].processes = list(fields.get("processes", ()))
            if rank not in self.failures:
                self.rank_state(rank, "done")

    def _take_status(self, rank: int, fields: dict[str, Any]) -> None:
        state = self.record.ranks[rank]
        if fields.get("pid"):
            state.pid = self.ranks.pids[rank] = fields["pid"]
        if fields.get("thread"):
            self.ranks.thread_ranks.add(rank)
        if fields.get("memory") is not None:
            state.memory = fields["memory"]
        if fields.get("state") == "ready":
            self.ranks.cache_reported(rank, fields.get("compile_cache"))
        if fields.get("state") == "ready" and rank in self.targets and self.sent and self.frame is None:
            self.rank_state(rank, "running")  # its request came with the job: it runs it now
        else:
            self.on_update(self.record)

    def _show(self, rank: int, fields: dict[str, Any]) -> None:
        """Display what a rank asked to show, after the output it wrote before asking; then let it go on."""
        self._drain([self.ranks.outputs[2 * rank], self.ranks.outputs[2 * rank + 1]])
        try:
            rank_display.show(self.ranks.label(rank), fields.get("what"), fields.get("data"))
        finally:
            try:
                self.ranks.send(rank, protocol.encode(protocol.SHOWN))
            except OSError:
                pass  # the rank is gone; its events socket says so

    def _answer_input(self, rank: int, fields: dict[str, Any]) -> None:
        """A rank asks for a line (input(), pdb): asked here, in the cell's thread, after what it printed before."""
        self._drain([self.ranks.outputs[2 * rank], self.ranks.outputs[2 * rank + 1]])
        reply = rank_input.answer(self.ranks, self.record, self.output, rank, fields, on_update=self.on_update,
                                  stopping=self.stop_reason is not None or self.watch.capturing,  # ^C: the cell's
                                  ask=self.ask)
        try:
            self.ranks.send(rank, protocol.encode(protocol.INPUT_REPLY, **reply))
        except OSError:
            pass  # the rank is gone; its events socket says so

    def _handle_supervisor(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == protocol.SPAWNED:
            for rank, pid in fields["pids"].items():
                self.record.ranks[rank].pid = self.ranks.pids[rank] = pid
        elif kind == protocol.EXIT:
            rank, code = fields["rank"], fields["code"]
            self.exit_codes[rank] = code
            self.ranks.lost(f"{self.ranks.name(rank)} died: {describe_exit(code)}")
            # Its last words may still sit in its sockets (its children may
            # hold them open, so no end-of-file need come): read them now.
            self._drain([self.ranks.events[rank], self.ranks.outputs[2 * rank], self.ranks.outputs[2 * rank + 1]])
            if rank in self.targets and not self._settled(rank):
                self._lose(rank)
            if code != 0 and rank not in self.failures and rank not in self.done and self.stop_reason is None:
                self._fail(rank, "RankDied", f"{self.ranks.name(rank)} died: {describe_exit(code)}", exit_code=code)
        elif kind == protocol.ENDED:
            self._supervisor_ended(fields.get("error"))

    def _supervisor_ended(self, error: str | None) -> None:
        """Every rank process is gone, and whatever they left behind was ended."""
        if error:
            self.launch_error = error
        # Under a running pool: the tpu launch path reports rank processes
        # that died this way, and so does a launcher's death.
        death = self.ranks.launcher_death()
        cause = f": {error.strip().splitlines()[-1]}" if error else ""
        if not self.ranks.processes_ended(death or f"the pool's rank processes ended{cause}"):
            return
        for rank in self.unsettled():
            if rank not in self.failures and self.stop_reason is None:
                self._fail(rank, "RankDied", death or f"{self.ranks.name(rank)}'s process ended{cause}")

    def _take_result(self, rank: int, fields: dict[str, Any]) -> None:
        if fields.get("empty"):
            return
        try:
            self.results[rank] = transport.load_result(fields["value"])
        except transport.ResultRefused as exc:
            self._fail(rank, "ResultRefused", str(exc))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # loading runs the result's own code, which may raise anything (SystemExit too)
            self._fail(
                rank,
                type(exc).__name__,
                f"the kernel could not load {self.ranks.name(rank)}'s result: {exc!r}. "
                f"Return types the kernel can import (tensors, numbers, dicts).",
            )

    def _fail(self, rank: int, type_: str, message: str, traceback: str = "", exit_code: int | None = None) -> None:
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
                self._fail(rank, "LauncherDied", death, exit_code=code)
            elif self.launch_error and code is None and rank in self.ranks.pids:
                # The tpu path: the rank's process died mid-cell and xmp.spawn
                # raised; its traceback is torch_xla's, its last line the news.
                cause = self.launch_error.strip().splitlines()[-1]
                self._fail(rank, "RankDied", f"{self.ranks.name(rank)}'s process ended during the cell: {cause}")
            elif self.launch_error and code is None:
                self._fail(rank, "LaunchError", "the ranks could not be started", self.launch_error)
            else:
                self._fail(rank, "RankDied", f"{self.ranks.name(rank)} ended without reporting: {describe_exit(code)}",
                           exit_code=code)

    # -- stopping --------------------------------------------------------

    def _stop(self, reason: str) -> None:
        """Stop the asked ranks' work: the cell only in a live pool, else the ranks themselves."""
        self.watch.capture(reason)  # where every rank is, before the stop moves them
        self.stop_reason = reason
        pending = self.unsettled()
        if self.ranks.state == "starting":
            self.ranks.lost(f"its start was stopped ({reason})")
        if not self.ranks.policy.stops_cells_only:
            self._escalate(signal.SIGTERM if reason == "failure" else signal.SIGINT)
        else:
            if pending and self.ranks.state != "broken":
                self._interrupt(pending, reason)
            if self.ranks.state == "broken":
                self.ranks.kill_ranks()
                self._wait_for_ranks(pending, EXIT_CODE_WAIT)
        for rank in self.targets:
            if not self._settled(rank) or self.record.ranks[rank].state in ("starting", "running", "stopped"):
                self.rank_state(rank, "killed")
        self._drain_output()

    def _escalate(self, first_signal: int) -> None:
        """SIGINT -> SIGTERM -> SIGKILL on the set's process group, until every asked rank is gone or answered."""
        signals = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
        for sig in signals[signals.index(first_signal):]:
            if not self.unsettled() or not self.ranks.signal_group(sig):
                return
            if not self._wait_for_ranks(self.unsettled(), STOP_GRACE if sig != signal.SIGKILL else EXIT_CODE_WAIT * 3):
                continue  # a second interrupt: escalate at once

    def _interrupt(self, ranks: list[int], reason: str) -> None:
        """SIGINT to a pool's ``ranks`` until each answered; those that do not in time break the pool.

        Rank threads in native code get THREAD_STOP_GRACE, unless the person
        interrupts again.
        """
        self.ranks.interrupt(ranks)
        answered = self._wait_for_ranks(ranks, STOP_GRACE, resend=True)
        waiting = self.unsettled(ranks)
        grace = STOP_GRACE
        if answered and waiting and all(rank in self.ranks.thread_ranks for rank in waiting):
            grace = THREAD_STOP_GRACE
            again = "again " if reason == "interrupt" else ""
            print(f"waiting up to {grace:g} s for rank(s) {_listed(waiting)} to leave native code; "
                  f"interrupt {again}to stop {'it' if len(waiting) == 1 else 'them'} now", flush=True)
            answered = self._wait_for_ranks(waiting, grace - STOP_GRACE, resend=True)
            waiting = self.unsettled(ranks)
        if not waiting:
            return
        if answered:
            self.ranks.mark_broken(f"rank(s) {_listed(waiting)} did not stop on SIGINT within {grace:g} s "
                                   f"and were killed")
        else:
            self.ranks.mark_broken(f"rank(s) {_listed(waiting)} were still running at a second interrupt "
                                   f"and were killed")

    def _wait_for_ranks(self, ranks: list[int], seconds: float, resend: bool = False) -> bool:
        """Pump until every one of ``ranks`` answered or is gone, or ``seconds`` passed; False at a second interrupt.

        With ``resend``, SIGINT goes again every RESEND_INTERRUPT to those
        still at it: a pool rank still reading the request was not yet
        listening (it takes one interrupt per request, so a repeat never
        reaches its cell twice).
        """
        now = time.monotonic()
        end, again = now + seconds, now + RESEND_INTERRUPT
        while self.unsettled(ranks) and time.monotonic() < end and not self.ranks.ended:
            try:
                self.pump(0.05)
            except KeyboardInterrupt:
                return False
            if resend and time.monotonic() >= again:
                self.ranks.interrupt(self.unsettled(ranks))
                again = time.monotonic() + RESEND_INTERRUPT
        return True

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
        return self.ranks.label(ranks[0]) if self.ranks.one_value else f"rank {_listed(ranks)}"

    def rank_state(self, rank: int, value: str) -> None:
        state = self.record.ranks[rank]
        if state.state in ("failed", "killed"):
            return
        state.state = value
        if value in _ENDED_STATES:
            state.ended = time.monotonic()
        self.on_update(self.record)

    def _finish(self, outcome: str) -> None:
        if self._live is not None:
            self._live.clear()
        for path in self.output.finish():
            print(f"(complete log: {path})")
        self.record.outcome = outcome
        self.record.duration = time.time() - self.record.started
        self.on_update(self.record)

    def _stopped_note(self) -> str:
        return self.ranks.policy.stopped_note(self.ranks.one_value, self.ranks.state == "broken")

    def _failure_summary(self) -> str:
        ranks = sorted(r for r in self.failures if r >= 0)
        summary = "the SPMD process failed" if self.ranks.one_value else f"rank(s) {_listed(ranks)} failed"
        if self.stop_reason == "failure" and len(ranks) < len(self.targets):
            summary += self.ranks.policy.others_stopped()
        return summary + self.ranks.policy.broken_note(self.ranks.state == "broken")

    def _interrupted_message(self) -> str:
        broken = self.ranks.state == "broken"
        return self.ranks.policy.interrupted(self.ranks.one_value, self.ranks.problem if broken else None)

    def _error(self, summary: str) -> RankError:
        if self.record.outcome == "running":
            self._finish("timeout" if self.stop_reason == "timeout" else "failed")
        failures = list(self.failures.values())
        if failures and all(failure.type == "BdbQuit" for failure in failures):  # pdb quit (q): no traceback
            quit = DebuggerQuit(failures, dict(self.results), summary, label=self.ranks.label)
            others = self.ranks.policy.others_stopped() if self.stop_reason == "failure" else ""
            for failure in failures:
                print(f"[{self.ranks.label(failure.rank)}] {failure.message}: the cell stopped there{others}"
                      f"{self.ranks.policy.broken_note(self.ranks.state == 'broken')}", flush=True)
            return quit
        error = RankError(failures, dict(self.results), summary, label=self.ranks.label,
                          where=self.watch.where_lines())
        error.debuggable = list(self.debuggable)
        return error


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

