"""How a request stops its ranks: the cell only in a live pool, the ranks themselves otherwise. Runs in the kernel.

A one-shot set's ranks are signalled as a group: SIGINT, then SIGTERM, then
SIGKILL. A pool's ranks only have their cell interrupted (SIGINT, repeated
until they answer), so the pool lives on; ranks that will not answer are
killed and the pool is broken. Where every rank was is asked first (the
watch), before the stop moves them.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from xla_magic.runs.wording import listed

STOP_GRACE = 1.5  # between SIGINT, SIGTERM and SIGKILL; how long a pool's ranks get to answer SIGINT
# Rank threads (the tpu launch path) take an interrupt only between bytecodes,
# so one in native code (an XLA compile, .item(), a sleep) gets this long.
THREAD_STOP_GRACE = 30.0
RESEND_INTERRUPT = 0.25  # while a pool rank has not answered, SIGINT again this often
EXIT_CODE_WAIT = 1.0  # after a rank is gone, how long to wait for its exit code


def stop(run: Any, reason: str) -> None:
    """Stop the asked ranks' work: the cell only in a live pool, else the ranks themselves."""
    run.watch.capture(reason)  # where every rank is, before the stop moves them
    run.stop_reason = reason
    pending = run.unsettled()
    if run.ranks.state == "starting":
        run.ranks.lost(f"its start was stopped ({reason})")
    if not run.ranks.policy.stops_cells_only:
        escalate(run, signal.SIGTERM if reason == "failure" else signal.SIGINT)
    else:
        if pending and run.ranks.state != "broken":
            interrupt(run, pending, reason)
        if run.ranks.state == "broken":
            run.ranks.kill_ranks()
            wait_for_ranks(run, pending, EXIT_CODE_WAIT)
    for rank in run.targets:
        if not run.settled(rank) or run.record.ranks[rank].state in ("starting", "running", "stopped"):
            run.rank_state(rank, "killed")
    run.drain_output()


def escalate(run: Any, first_signal: int) -> None:
    """SIGINT -> SIGTERM -> SIGKILL on the set's process group, until every asked rank is gone or answered."""
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    for sig in signals[signals.index(first_signal):]:
        if not run.unsettled() or not run.ranks.signal_group(sig):
            return
        if not wait_for_ranks(run, run.unsettled(), STOP_GRACE if sig != signal.SIGKILL else EXIT_CODE_WAIT * 3):
            continue  # a second interrupt: escalate at once


def interrupt(run: Any, ranks: list[int], reason: str) -> None:
    """SIGINT to a pool's ``ranks`` until each answered; those that do not in time break the pool.

    Rank threads in native code get THREAD_STOP_GRACE, unless the person
    interrupts again.
    """
    run.ranks.interrupt(ranks)
    answered = wait_for_ranks(run, ranks, STOP_GRACE, resend=True)
    waiting = run.unsettled(ranks)
    grace = STOP_GRACE
    if answered and waiting and all(rank in run.ranks.thread_ranks for rank in waiting):
        grace = THREAD_STOP_GRACE
        again = "again " if reason == "interrupt" else ""
        run.sink.write("stdout", f"waiting up to {grace:g} s for rank(s) "
                       f"{listed([run.ranks.global_rank(r) for r in waiting])} to leave native code; "
                       f"interrupt {again}to stop {'it' if len(waiting) == 1 else 'them'} now\n")
        answered = wait_for_ranks(run, waiting, grace - STOP_GRACE, resend=True)
        waiting = run.unsettled(ranks)
    if not waiting:
        return
    named = listed([run.ranks.global_rank(rank) for rank in waiting])  # on one host of several: as its tags say
    if answered:
        run.ranks.mark_broken(f"rank(s) {named} did not stop on SIGINT within {grace:g} s and were killed")
    else:
        run.ranks.mark_broken(f"rank(s) {named} were still running at a second interrupt and were killed")


def wait_for_ranks(run: Any, ranks: list[int], seconds: float, resend: bool = False) -> bool:
    """Pump until every one of ``ranks`` answered or is gone, or ``seconds`` passed; False at a second interrupt.

    With ``resend``, SIGINT goes again every RESEND_INTERRUPT to those
    still at it: a pool rank still reading the request was not yet
    listening (it takes one interrupt per request, so a repeat never
    reaches its cell twice).
    """
    now = time.monotonic()
    end, again = now + seconds, now + RESEND_INTERRUPT
    while run.unsettled(ranks) and time.monotonic() < end and not run.ranks.ended:
        try:
            run.pump(0.05)
        except KeyboardInterrupt:
            return False
        if resend and time.monotonic() >= again:
            run.ranks.interrupt(run.unsettled(ranks))
            again = time.monotonic() + RESEND_INTERRUPT
    return True
