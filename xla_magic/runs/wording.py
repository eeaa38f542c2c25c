"""How a request's end is worded: the failure's summary, the interrupt's, what became of the ranks. Runs in the kernel.

The set's policy (ranks/policy.py) says what a stop means for a one-shot
set and a pool; these put it together with what the request saw.
"""

from __future__ import annotations

from typing import Any

from xla_magic.runs.errors import DebuggerQuit, RankError


def stopped_note(run: Any) -> str:
    return run.ranks.policy.stopped_note(run.ranks.one_value, run.ranks.state == "broken")


def failure_summary(run: Any) -> str:
    ranks = sorted(r for r in run.failures if r >= 0)
    summary = "the SPMD process failed" if run.ranks.one_value else f"rank(s) {listed(ranks)} failed"
    if run.stop_reason == "failure" and len(ranks) < len(run.targets):
        summary += run.ranks.policy.others_stopped()
    return summary + run.ranks.policy.broken_note(run.ranks.state == "broken")


def interrupted_message(run: Any) -> str:
    broken = run.ranks.state == "broken"
    return run.ranks.policy.interrupted(run.ranks.one_value, run.ranks.problem if broken else None)


def error(run: Any, summary: str) -> RankError:
    if run.record.outcome == "running":
        run.finish("timeout" if run.stop_reason == "timeout" else "failed")
    failures = list(run.failures.values())
    if failures and all(failure.type == "BdbQuit" for failure in failures):  # pdb quit (q): no traceback
        quit = DebuggerQuit(failures, dict(run.results), summary, label=run.ranks.label)
        others = run.ranks.policy.others_stopped() if run.stop_reason == "failure" else ""
        for failure in failures:
            run.sink.write("stdout", f"[{run.ranks.label(failure.rank)}] {failure.message}: the cell stopped there"
                           f"{others}{run.ranks.policy.broken_note(run.ranks.state == 'broken')}\n")
        return quit
    error = RankError(failures, dict(run.results), summary, label=run.ranks.label,
                      where=run.watch.where_lines())
    error.debuggable = list(run.debuggable)
    return error


def listed(ranks: list[int]) -> str:
    """``0, 2, 3``."""
    return ", ".join(map(str, ranks))
