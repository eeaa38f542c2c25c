"""What each event from a rank (or its supervisor) means for the request that reads it. Runs in the kernel.

The request (request.py) pumps its ranks' sockets and hands every event
here, in the thread that runs the cell: a rank's status, a display or a
question for the kernel (DISPLAY, INPUT: answered before the rank goes on),
where it is (STACKS, for the watch), what its cell logged (METRICS, kept in
the record) and the checkpoints it completed (CHECKPOINT), its result, its error, its DONE, and
the supervisor's news of processes spawned and exited. A reply to a request
the kernel gave up on (another ``seq``) is dropped.
"""

from __future__ import annotations

import time
from typing import Any

from xla_magic.ranks import memory_answers
from xla_magic.runs import questions
from xla_magic.ranks.ranks import Conn, describe_exit
from xla_magic.wire import protocol, transport


def handle(run: Any, conn: Conn, event: protocol.Event) -> None:
    kind, fields = event
    rank = conn.rank
    if kind == protocol.BROKEN:
        run.fail(rank if rank is not None else -1, "ProtocolError", f"garbled message: {fields['reason']}")
        run.ranks.lost(f"a garbled message from the ranks ({fields.get('reason')})")
    elif conn.kind == "supervisor":
        handle_supervisor(run, kind, fields)
    elif kind == protocol.STATUS:
        take_status(run, rank, fields)
    elif kind == protocol.DISPLAY:
        show(run, rank, fields)
    elif kind == protocol.INPUT:
        answer_input(run, rank, fields)
    elif kind == protocol.STACKS:
        run.watch.take(rank, fields)
    elif kind == protocol.MEMORY:  # %xla_memory asked while this request runs
        memory_answers.take(rank, fields)
    elif fields.get("seq") != run.seq:
        return  # a reply to a request the kernel gave up on
    elif kind == protocol.RESULT:
        take_result(run, rank, fields)
    elif kind == protocol.METRICS:  # a batch of what the rank's cell logged: the chart draws it (metrics_view.py)
        run.record.metrics += [(rank, *row) for row in fields["rows"]]
        run.on_update(run.record)
    elif kind == protocol.CHECKPOINT:  # rank 0's, once complete: %xla_runs shows the run's last
        run.record.checkpoint = {key: fields.get(key) for key in ("step", "path", "time", "size")}
    elif kind in (protocol.XLA, protocol.PROFILE):  # what a rank process tells of the cell, with its reply
        run.record.take(kind, fields["account" if kind == protocol.XLA else "profile"])
        if kind == protocol.PROFILE:  # (after its account) a listener may take it at once: profile_lanes.Reader
            run.on_update(run.record)
    elif kind == protocol.ERROR:
        stopping = run.stop_reason is not None or run.watch.capturing  # (a prompt then ends: pdb raises BdbQuit)
        if stopping and fields.get("type") in ("KeyboardInterrupt", "BdbQuit"):
            run.rank_state(rank, "killed")  # our own SIGINT, or the prompt we ended, not a fault of the rank
        else:
            run.fail(rank, fields["type"], fields["message"], fields.get("traceback", ""))
            if fields.get("post_mortem") and rank not in run.debuggable:
                run.debuggable.append(rank)
    elif kind == protocol.DONE:
        run.done.add(rank)
        run.record.ranks[rank].processes = list(fields.get("processes", ()))
        if fields.get("memory") is not None:  # the cell's last sample (rank.MemoryReporter)
            run.record.ranks[rank].memory = fields["memory"]
        if rank not in run.failures:
            run.rank_state(rank, "done")


def take_status(run: Any, rank: int, fields: dict[str, Any]) -> None:
    state = run.record.ranks[rank]
    if fields.get("pid"):
        state.pid = run.ranks.pids[rank] = fields["pid"]
    if fields.get("thread"):
        run.ranks.thread_ranks.add(rank)
    if fields.get("memory") is not None:
        state.memory = fields["memory"]
    if fields.get("state") == "ready":
        run.ranks.cache_reported(rank, fields.get("compile_cache"))
        if fields.get("ordinal") is not None and run.ranks.world:  # one host of several: its global rank
            state.ordinal = run.ranks.ordinals[rank] = fields["ordinal"]
    if fields.get("state") == "ready" and rank in run.targets and run.sent and run.frame is None:
        run.rank_state(rank, "running")  # its request came with the job: it runs it now
    else:
        run.on_update(run.record)


def show(run: Any, rank: int, fields: dict[str, Any]) -> None:
    """Display what a rank asked to show, after the output it wrote before asking; then let it go on."""
    run.drain([run.ranks.outputs[2 * rank], run.ranks.outputs[2 * rank + 1]])
    try:
        run.sink.display(run.ranks.label(rank), fields.get("what"), fields.get("data"))
    finally:
        try:
            run.ranks.send(rank, protocol.encode(protocol.SHOWN))
        except OSError:
            pass  # the rank is gone; its events socket says so


def answer_input(run: Any, rank: int, fields: dict[str, Any]) -> None:
    """A rank asks for a line (input(), pdb): asked here, in the cell's thread, after what it printed before."""
    run.drain([run.ranks.outputs[2 * rank], run.ranks.outputs[2 * rank + 1]])
    asked = time.monotonic()
    try:
        reply = questions.answer(run.ranks, run.record, run.output, rank, fields, on_update=run.on_update,
                                  stopping=run.stop_reason is not None or run.watch.capturing,  # ^C: the cell's
                                  ask=run.sink.ask)
    finally:
        run.prompt_seconds += time.monotonic() - asked  # the person's time, not the cell's (--timeout)
    try:
        run.ranks.send(rank, protocol.encode(protocol.INPUT_REPLY, **reply))
    except OSError:
        pass  # the rank is gone; its events socket says so


def handle_supervisor(run: Any, kind: str, fields: dict[str, Any]) -> None:
    if kind == protocol.SPAWNED:
        for rank, pid in fields["pids"].items():
            run.record.ranks[rank].pid = run.ranks.pids[rank] = pid
    elif kind == protocol.EXIT:
        rank, code = fields["rank"], fields["code"]
        run.exit_codes[rank] = code
        run.ranks.lost(f"{run.ranks.name(rank)} died: {describe_exit(code)}")
        # Its last words may still sit in its sockets (its children may
        # hold them open, so no end-of-file need come): read them now.
        run.drain([run.ranks.events[rank], run.ranks.outputs[2 * rank], run.ranks.outputs[2 * rank + 1]])
        if rank in run.targets and not run.settled(rank):
            run.lose(rank)
        if code != 0 and rank not in run.failures and rank not in run.done and run.stop_reason is None:
            run.fail(rank, "RankDied", f"{run.ranks.name(rank)} died: {describe_exit(code)}", exit_code=code)
    elif kind == protocol.ENDED:
        supervisor_ended(run, fields.get("error"))


def supervisor_ended(run: Any, error: str | None) -> None:
    """Every rank process is gone, and whatever they left behind was ended."""
    if error:
        run.launch_error = error
    # Under a running pool: the tpu launch path reports rank processes
    # that died this way, and so does a launcher's death.
    death = run.ranks.launcher_death()
    cause = f": {error.strip().splitlines()[-1]}" if error else ""
    if not run.ranks.processes_ended(death or f"the pool's rank processes ended{cause}"):
        return
    for rank in run.unsettled():
        if rank not in run.failures and run.stop_reason is None:
            run.fail(rank, "RankDied", death or f"{run.ranks.name(rank)}'s process ended{cause}")


def take_result(run: Any, rank: int, fields: dict[str, Any]) -> None:
    if fields.get("empty"):
        return
    try:
        run.results[rank] = transport.load_result(fields["value"])
    except transport.ResultRefused as exc:
        run.fail(rank, "ResultRefused", str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # loading runs the result's own code, which may raise anything (SystemExit too)
        run.fail(
            rank,
            type(exc).__name__,
            f"the kernel could not load {run.ranks.name(rank)}'s result: {exc!r}. "
            f"Return types the kernel can import (tensors, numbers, dicts).",
        )
