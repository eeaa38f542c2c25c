"""One request to every host of a pool across hosts, followed to the end. Runs in the kernel.

As :class:`~xla_magic.runs.request.Request` follows every rank, this follows
every host's engine: it shows each host's output as it streams in (lines
already tagged ``[hH rN]`` by the host), and when one host fails, is
interrupted or loses its engine, it interrupts every other host (fail-fast
across hosts) and raises one error that shows each failing rank's
traceback, tagged with its host. A Ctrl-C in the kernel interrupts every
host the same way.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from typing import Any

from IPython.core.error import UsageError

from xla_magic.runs import questions, stacks
from xla_magic.runs.errors import DebuggerQuit, RankError, RankFailure, RunInterrupted
from xla_magic.runs.output import TaggedOutput
from xla_magic.hosts import link
from xla_magic.hosts.metrics import Taker
from xla_magic.ranks.naming import RESTART, Numbering
from xla_magic.hosts.on_host import ASKED, NEWS, QUIET_NEWS, HostOutcome
from xla_magic.runs.record import RunRecord
from xla_magic.runs.sink import Sink
from xla_magic.runs.watch import HANG_AFTER, HangLine, confirm_after

OUTPUT_PATIENCE = 10.0  # for a host's output to catch up with its reply (ipyparallel sends them apart)
STOP_PATIENCE = 60.0  # for hosts told to stop (SIGINT to their engines) to answer
# A line as a host relays it: its rank's tag (red on stderr), then the line.
TAGGED = re.compile(r"(?:\x1b\[31m)?\[h\d+ r(?P<rank>\d+)\](?:\x1b\[0m)? ")


class HostsRequest:
    """``calls``: one ipyparallel AsyncResult per host, in host order, to ``pool`` (hosts/pool.py's HostsPool).

    Every rank is named by its global rank, torch_xla's ordinal (``numbering``: the pool's, or for fresh ranks
    what their hosts say as they start), in tags, results, stacks, the watchdog's line and the record.

    With a ``record`` (a run in the session's history), the request keeps its
    ranks' states and lines as the hosts' output and outcomes come in, and
    stops every host when the record asks (the status panel's Interrupt).
    """

    def __init__(self, pool: Any, calls: list[Any], timeout: float | None = None, echo: bool = True,
                 record: RunRecord | None = None, devices: int | None = None, hang_after: float | None = None,
                 sink: Sink | None = None, numbering: Numbering | None = None, metrics: bool = False) -> None:
        self.pool = pool
        self.sink = sink or pool.runner.sink  # where what happens goes: the session's (the notebook's), or a run's
        self.calls = calls
        self.timeout = timeout
        self.echo = echo
        self.record = record
        self.devices = devices if devices is not None else pool.devices  # ranks per host in this request
        # Each host's ranks' global ordinals: the pool's, or (fresh ranks) as their hosts' news and replies say.
        self.numbering = numbering if numbering is not None else Numbering(self.devices)
        self.outcomes: dict[int, HostOutcome] = {}
        self.shown: dict[tuple[int, str], int] = {}
        self.stopping: str | None = None  # why the other hosts were told to stop: failure, interrupt, timeout
        self.broken: str | None = None  # what broke the pool during the request, for the pool to take on
        self.history = pool.runner.history  # the session's: the record's listeners (the panel)
        self.stopped_at: float | None = None
        tags = self.numbering.label
        self.output = TaggedOutput(label=tags, log_dir=lambda: pool.workdir.new("logs-hosts-"),
                                   log_stem=lambda rank: tags(rank).replace(" ", ""), on_line=self._on_line,
                                   write=self.sink.write)
        self._lines_counted = 0
        # The watchdog across hosts: each host's own watch asks its ranks where they are when they stop moving and
        # sends what they answered (on_host's news); the judgement and its line are made here, over every rank.
        self.hang_after = HANG_AFTER if hang_after is None else hang_after
        self.line = HangLine(self.sink)
        self._news: dict[int, tuple[Any, float]] = {}  # host -> (its last news, when it came)
        self._answered: dict[int, str] = {}  # rank -> the prompt's "where" it left: a host's later news may still say it
        self.lost_links: dict[int, str] = {}  # host -> why its link to the kernel was lost (hosts/link.py)
        self._began = time.monotonic()
        # What the ranks log(), as their hosts send it (hosts/metrics.py), into a cell's record (``metrics``), where
        # the cell's views draw it.
        self.logged = Taker(calls, record if metrics else None, self.history)

    def wait(self) -> list[Any]:
        """Every host's value, in host order, or the error that says what went wrong where."""
        try:
            return self._wait()
        finally:
            self.logged.close()  # the last values drawn, however the cell ended

    def _wait(self) -> list[Any]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while len(self.outcomes) < len(self.calls):
            try:
                self._collect()
                self._show()
                self.logged.take()
                self._follow_news()
                self._answer_questions()
                if self.stopping is None and deadline is not None and time.monotonic() > deadline:
                    self._stop_hosts("timeout")
                if self.stopping is None and self.record is not None and self.record.interrupt_requested:
                    raise KeyboardInterrupt
                if self.stopped_at is not None and time.monotonic() - self.stopped_at > STOP_PATIENCE:
                    self._give_up()
                pending = [call for index, call in enumerate(self.calls) if index not in self.outcomes]
                if pending:
                    pending[0].wait(0.02)
            except KeyboardInterrupt:
                if self.stopping == "interrupt":
                    self._give_up()  # a second Ctrl-C: stop waiting for the hosts
                self._stop_hosts("interrupt")
        for index, call in enumerate(self.calls):  # a host's reply can come before the last of its output
            if self.outcomes[index]["outcome"] != "lost":
                call.wait_for_output(OUTPUT_PATIENCE)
        self._show(final=True)
        self._drop_questions()
        self._keep_where(self.outcomes)
        for path in self.output.finish():
            self.sink.write("stdout", f"(complete log: {path})\n")
        try:
            return self._result()
        except RunInterrupted:
            self._finish("interrupted")
            raise
        except RankError:
            self._finish("timeout" if self.stopping == "timeout" else "failed")
            raise
        except BaseException:
            self._finish("failed")
            raise
        finally:
            self._finish("done")

    def reached(self) -> list[bool]:
        """Which hosts' engines got the call (they answered, whatever the answer): they hold its values now."""
        return [self.outcomes.get(index, {"outcome": "lost"})["outcome"] != "lost" for index in range(len(self.calls))]

    def _finish(self, outcome: str) -> None:
        """The record's end, once: every rank's state from its host's outcome."""
        record = self.record
        if record is None or record.outcome != "running":
            return
        for index in range(len(self.calls)):
            said = self.outcomes.get(index, {"outcome": "lost"})
            failed = {f["rank"] for f in said.get("failures", ())}
            for local in range(self.devices):
                state = record.ranks.get(self.numbering.rank(index, local))
                if state is None or state.ended is not None:
                    continue
                state.state = ("done" if said["outcome"] == "ok" else "failed" if local in failed
                               else "killed" if said["outcome"] in ("interrupted", "failed") else "failed")
                state.ended = time.monotonic()
        for index, said in self.outcomes.items():  # what XLA did on every host, by global rank
            for account in said.get("accounts", ()):
                record.take("xla", dict(account, ranks=[self.numbering.rank(index, rank) for rank in account["ranks"]]))
        record.outcome = outcome
        record.duration = time.time() - record.started
        self.history.notify(record)

    # -- following ----------------------------------------------------------------

    def _collect(self) -> None:
        for index, call in enumerate(self.calls):
            if index in self.outcomes or not call.ready():
                continue
            try:
                outcome = call.get()
            except Exception as exc:  # the engine died or could not run the call
                outcome = {"outcome": "lost", "message": _engine_problem(exc)}
                self._broke(f"the engine of host h{index} ({self.pool.hosts[index]}) {outcome['message']}")
            self.numbering.learn(index, outcome.get("ordinals"))
            self.outcomes[index] = outcome
            if outcome["outcome"] == "ok":
                self._host_done(index)
            if outcome.get("broken"):
                self._broke(f"host h{index} ({self.pool.hosts[index]}): {outcome['broken']}")
            if outcome["outcome"] != "ok" and self.stopping is None:
                self._stop_hosts("failure")

    def _host_done(self, index: int) -> None:
        """Every rank of a host that answered is done, for the panel, while the other hosts still run."""
        record = self.record
        if record is None:
            return
        for rank in self.numbering.ranks_of(index):
            state = record.ranks.get(rank)
            if state is not None and state.ended is None:
                state.state, state.ended = "done", time.monotonic()
        self.history.notify(record)

    def _show(self, final: bool = False) -> None:
        """The whole lines each host printed since last time, host by host (the rest once the call ended)."""
        if not self.echo:
            return
        for index, call in enumerate(self.calls):
            for stream in ("stdout", "stderr"):
                text = getattr(call, stream) or ""
                start = self.shown.get((index, stream), 0)
                end = len(text) if final else text.rfind("\n", start) + 1
                if end > start:
                    self._relay(stream, text[start:end])
                    self.shown[(index, stream)] = end

    def _relay(self, stream: str, text: str) -> None:
        """A host's lines, tagged by the host with their global rank, to the kernel's output of the cell: the
        first lines of each rank shown, the rest folded into a log per rank in the kernel's session directory."""
        rank, run = None, []
        for line in text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"):
            tagged = TAGGED.match(line)
            line_rank = int(tagged["rank"]) if tagged else None
            if run and line_rank != rank:
                self._flush_run(rank, stream, run)
                run = []
            rank = line_rank
            run.append(line[tagged.end():] if tagged else line)
        if run:
            self._flush_run(rank, stream, run)
        (sys.stderr if stream == "stderr" else sys.stdout).flush()

    def _flush_run(self, rank: int | None, stream: str, lines: list[str]) -> None:
        if rank is None:  # the host's own words (a notice), not a rank's
            self.sink.write(stream, "\n".join(lines) + "\n")
        else:
            self.output.feed_lines(rank, stream, lines)

    def _on_line(self, rank: int, stream: str, line: str) -> None:
        """A batch of a rank's lines (the output's running total says how many): the panel's lines and last line."""
        batch, self._lines_counted = self.output.lines - self._lines_counted, self.output.lines
        state = self.record.ranks.get(rank) if self.record is not None else None
        if state is not None:
            state.lines += batch
            state.last_line = line
            self.history.notify(self.record)

    def _follow_news(self) -> None:
        """Every host's live news into the record (each rank's state and place, for the panel), then the watchdog's
        judgement over every global rank, as one host's watch judges its own."""
        record = self.record
        now = time.monotonic()
        if record is None or self.stopping is not None or now - self._began < QUIET_NEWS:
            return  # the hosts send none this early: a quick cell never reads its calls' data
        changed = False
        for index, call in enumerate(self.calls):
            news = (getattr(call, "data", None) or {}).get(NEWS)
            if not news or news.get("run") is None or self._news.get(index, (None,))[0] is news:
                continue
            self._news[index] = (news, now)
            self.numbering.learn(index, news.get("ordinals"))
            changed = True
            for local, (state, where) in news["ranks"].items():
                rank_state = record.ranks.get(self.numbering.rank(index, local))
                if rank_state is not None and rank_state.ended is None:
                    stale = self._answered.get(self.numbering.rank(index, local)) == where  # sent before the answer
                    rank_state.state, rank_state.where = state, rank_state.where if stale else where
                    if state in ("done", "failed", "killed"):
                        rank_state.ended = now
        if changed:
            self.history.notify(record)
            self._judge(now)

    def _answer_questions(self) -> None:
        """Each running host's ranks' questions (input(), pdb: hosts/link.py), one at a time, asked with the
        kernel's own input (the sink's) as one host asks them (runs/questions.py), tagged with the global rank."""
        for index in range(len(self.calls)):
            each = self.pool.links.get(index)
            if each is None or index in self.outcomes or index in self.lost_links:
                continue
            try:
                frame = each.receive(0)
                if frame is None or frame.get("kind") != link.ASK:
                    continue
                reply = self._ask(index, frame)
                each.send(link.ANSWER, id=frame["id"], reply=reply)
            except link.LinkError as exc:
                self._lose_link(index, str(exc))

    def _ask(self, index: int, question: dict[str, Any]) -> dict[str, Any]:
        if self.stopping is not None:
            return {"eof": questions.STOPPING.format(what=question["what"], who=question["who"])}
        call = self.calls[index]
        patience = time.monotonic() + OUTPUT_PATIENCE  # what the host's ranks printed before they asked comes first
        while (getattr(call, "data", None) or {}).get(ASKED, 0) < question["id"] and time.monotonic() < patience:
            call.wait(0.005)
        self._show()
        state = self.record.ranks.get(question["rank"]) if self.record is not None else None
        before = state.where if state is not None else ""
        at_prompt = questions.where_at(question["why"], question["line"])
        self._answered.pop(question["rank"], None)
        if state is not None:  # the panel's "where" at once (the host's news says the same, later)
            state.where = at_prompt
            self.history.notify(self.record)
        reply = self.sink.ask(question)
        if state is not None and "text" in reply:
            state.where = before
            self._answered[question["rank"]] = at_prompt
        return reply

    def _lose_link(self, index: int, why: str) -> None:
        """A host whose link broke or lied: the kernel hangs up. Its engine, if alive, says so to a rank that
        asks (an EOFError); the pool is broken once the request is over (``_drop_questions``), as for a dead
        engine, whose death ipyparallel names meanwhile (a killed engine's link breaks first)."""
        self.pool.links[index].close()
        self.lost_links.setdefault(index, why)

    def _drop_questions(self) -> None:
        """Questions of calls that have ended (asked as a host was stopped): nobody waits for their answers.
        Then every lost link breaks the pool, naming its host."""
        for index in range(len(self.calls)):
            each = self.pool.links.get(index)
            try:
                while each is not None and index not in self.lost_links and each.receive(0) is not None:
                    pass
            except link.LinkError as exc:
                self._lose_link(index, str(exc))
        for index, why in sorted(self.lost_links.items()):
            self._broke(f"the link of host h{index} ({self.pool.hosts[index]}) to the kernel was lost ({why})")

    def _judge(self, now: float) -> None:
        where: dict[int, dict[str, Any]] = {}
        waited: dict[int, float] = {}
        for index in range(len(self.calls)):
            said = self.outcomes.get(index)
            news, came = self._news.get(index, ({}, now))
            for local in range(self.devices):
                rank = self.numbering.rank(index, local)
                state = news.get("ranks", {}).get(local, ("",))[0]
                if (said is not None and said["outcome"] == "ok") or state == "done":
                    where[rank] = {"phase": "finished"}
                elif local in news.get("stacks", {}):
                    where[rank] = news["stacks"][local]
                    waited[rank] = news.get("waited", {}).get(local, 0.0) + (now - came)
        if len(where) < len(self.calls) * self.devices:
            return  # a rank not heard of yet: it may still move
        line = stacks.hang(where, waited, self.hang_after, confirm=confirm_after(self.hang_after),
                           label=self.numbering.label)
        if line is not None:
            self.record.hang = line
            self.record.stacks = dict(where)
            self.record.stacks_when = "at the watchdog's warning"
            self.line.show(line)

    def _keep_where(self, outcomes: dict[int, HostOutcome]) -> None:
        """Where every rank was when the cell was stopped, by global rank, for ``%xla_stacks`` to show again."""
        merged, when = self._merged_stacks([outcomes.get(index, {}) for index in range(len(self.calls))])
        if merged and self.record is not None:
            self.record.stacks, self.record.stacks_when = merged, when

    def _stop_hosts(self, why: str) -> None:
        """SIGINT to every host still running: each stops its ranks as an interrupted cell does."""
        self.stopping = why
        self.stopped_at = time.monotonic()
        running = [self.pool.engines[index] for index in range(len(self.calls)) if index not in self.outcomes]
        if running and self.pool.client is not None:
            try:
                # Blocking: each nanny answers once its signal is sent, so none arrives in a later request.
                self.pool.client.send_signal(signal.SIGINT, targets=running, block=True)
            except Exception as exc:  # noqa: BLE001 - a lost controller must not hide the failure
                self._broke(f"could not interrupt the hosts ({type(exc).__name__}: {exc})")

    def _give_up(self) -> None:
        hosts = [f"h{index} ({self.pool.hosts[index]})" for index in range(len(self.calls))
                 if index not in self.outcomes]
        for index in range(len(self.calls)):
            self.outcomes.setdefault(index, {"outcome": "lost", "message": "did not stop when told to"})
        self._broke(f"host(s) {', '.join(hosts)} did not stop when told to")

    # -- the end ----------------------------------------------------------------------

    def _result(self) -> list[Any]:
        outcomes = [self.outcomes[index] for index in range(len(self.calls))]
        if all(outcome["outcome"] == "ok" for outcome in outcomes):
            return [outcome["value"] for outcome in outcomes]
        refused = [(index, o) for index, o in enumerate(outcomes) if o["outcome"] == "refused"]
        if refused and all(o["outcome"] in ("refused", "interrupted") for o in outcomes):
            raise UsageError("; ".join(f"host h{index}: {o['message']}" for index, o in refused))
        if self.stopping == "interrupt" and all(o["outcome"] in ("ok", "interrupted") for o in outcomes):
            raise RunInterrupted(f"interrupted; the cell was stopped on every host. {self._pool_note()}",
                                 self._results(outcomes), where=self._where(outcomes))
        raise self._error(outcomes)

    def _error(self, outcomes: list[dict[str, Any]]) -> RankError:
        failures: list[RankFailure] = []
        problems: list[str] = []
        number = self.numbering.rank
        for index, outcome in enumerate(outcomes):
            if outcome["outcome"] == "failed":
                failures += [RankFailure(number(index, f["rank"]), f["type"], f["message"], f["traceback"],
                                         f["exit_code"]) for f in outcome["failures"]]
                if not outcome["failures"]:
                    problems.append(f"host h{index}: {outcome['summary']}")
            elif outcome["outcome"] in ("lost", "refused"):
                problems.append(f"host h{index} ({self.pool.hosts[index]}): {outcome['message']}")
        where = sorted({f.rank for f in failures})
        parts = [f"rank(s) {', '.join(self.numbering.label(rank) for rank in where)} failed"] if where else []
        parts += problems
        if self.stopping == "failure" and len(outcomes) > 1:
            parts.append("the other hosts' cells were stopped")
        if self.stopping == "timeout":
            parts.insert(0, f"timed out after {self.timeout:g} s")
        summary = "; ".join(parts) + f"; {self._pool_note()}"
        if not failures:  # nothing with a traceback: say it as one failure of the first host that went wrong
            failures = [RankFailure(-1, "HostFailure", summary)]
        if all(failure.type == "BdbQuit" for failure in failures):  # pdb quit (q); the host said where
            return DebuggerQuit(failures, self._results(outcomes), summary, label=self._failure_label)
        error = RankError(failures, self._results(outcomes), summary, label=self._failure_label,
                          where=self._where(outcomes))
        error.debuggable = [number(index, local) for index, outcome in enumerate(outcomes)
                            for local in outcome.get("debuggable", ())]
        return error

    def _merged_stacks(self, outcomes: list[Any]) -> tuple[dict[int, dict[str, Any]], str]:
        merged: dict[int, dict[str, Any]] = {}
        when = ""
        for index, outcome in enumerate(outcomes):
            for rank, answer in (outcome.get("stacks") or {}).items():
                merged[self.numbering.rank(index, rank)] = answer
            when = when or outcome.get("stacks_when", "")
        return merged, when

    def _where(self, outcomes: list[dict[str, Any]]) -> list[str]:
        """Where every rank on every host was at the stop, grouped across hosts as on one host."""
        merged, when = self._merged_stacks(outcomes)
        if not merged:
            return []
        return [f"Where each rank was {when}:"] + stacks.render(merged, label=self.numbering.label)

    def _results(self, outcomes: list[dict[str, Any]]) -> dict[int, Any]:
        results: dict[int, Any] = {}
        for index, outcome in enumerate(outcomes):
            for rank, value in (outcome.get("results") or {}).items():
                results[self.numbering.rank(index, rank)] = value
        return results

    def by_rank(self, values_by_host: list[Any]) -> list[Any]:
        """Every host's values (each by local rank) as one list by global rank, however the slice numbered them."""
        every: list[Any] = [None] * (self.devices * len(values_by_host))
        for index, values in enumerate(values_by_host):
            for local, value in enumerate(values or [None] * self.devices):
                every[self.numbering.rank(index, local)] = value
        return every

    def _failure_label(self, rank: int) -> str:
        return "hosts" if rank < 0 else self.numbering.label(rank)

    def _broke(self, problem: str) -> None:
        """The pool is broken: the pool itself says so once the request is over (``broken``), its one writer."""
        if self.broken is None:
            self.broken = problem

    def _pool_note(self) -> str:
        problem = self.broken or (self.pool.problem if self.pool.state == "broken" else None)
        if problem is not None:
            return f"the pool is broken ({problem}): {RESTART}"
        return "the pool keeps its ranks and their namespaces on every host"


def _engine_problem(exc: Exception) -> str:
    name = type(exc).__name__
    if name == "EngineError" or "died" in str(exc):
        return f"died ({exc})"
    return f"failed: {name}: {exc}"
