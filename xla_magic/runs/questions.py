"""A rank's question (``input()``, getpass, pdb's prompt), asked through the run's sink. Runs in the kernel and in
each host's engine.

A rank asks with an INPUT event (launcher/debugger.py) and waits for the
INPUT_REPLY. The request (request.py) answers it from its pump, in the
thread that runs the cell, one prompt at a time: ipykernel sends an
``input_request`` to the frontend only from there (``builtins.input`` and
``getpass.getpass`` are its own while a cell runs), and a terminal IPython
reads the terminal: the notebook's sink asks with them (notebook/rank_input.py).
The prompt is tagged with the rank (``[rank 0] your name? ``) and follows what the rank printed on that line before it asked.
No stdin (a frontend that sends no input, ``allow_stdin`` off; Ctrl-D; a
kernel whose stdin is closed) is an ``eof`` reply, which the rank raises as
EOFError with that reason. An interrupt at the prompt is the cell's interrupt.
"""

from __future__ import annotations

from typing import Any, Callable

STOPPING = "the cell is being stopped, so {what} on {who} is not asked"


Ask = Callable[[dict[str, Any]], dict[str, Any]]  # a question -> its reply: {"text": ...} or {"eof": why}


def answer(ranks: Any, record: Any, output: Any, rank: int, fields: dict[str, Any], stopping: bool,
           on_update: Callable[[Any], None], ask: Ask) -> dict[str, Any]:
    """The INPUT_REPLY's fields for ``rank``'s question: the line typed, or why there is none.

    ``ranks`` names the rank, ``record`` holds the panel's "where", ``output`` the rank's line in progress
    (request.py's); ``stopping``: the request is being stopped, so nothing is asked. ``ask`` asks the question
    (the sink's: the kernel's own input; on one host of several, the kernel's through the host's link).
    """
    why = fields.get("why", "input")
    what = "the debugger's prompt" if why == "debugger" else "getpass" if fields.get("password") else "input()"
    who = f"rank {ranks.label(rank)}" if ranks.world else ranks.name(rank)
    if stopping:
        return {"eof": STOPPING.format(what=what, who=who)}
    line = fields.get("line")
    state = record.ranks.get(rank)
    before_where = state.where if state is not None else ""
    if state is not None:  # the status panel's "where", while the prompt is open
        state.where = where_at(why, line)
        on_update(record)
    before = output.take_partial(rank, "stdout")  # print('name:', end=''); input()
    question = {"rank": ranks.global_rank(rank), "why": why, "line": line,
                "prompt": f"[{ranks.label(rank)}] {before}{fields.get('prompt', '')}",
                "password": bool(fields.get("password")), "what": what, "who": who}
    reply = ask(question)
    if state is not None and "text" in reply:
        state.where = before_where  # answered: the sampler says where it is next
    return reply


def where_at(why: str, line: int | None) -> str:
    """The panel's "where" of a rank at a prompt."""
    at = f"line {line}" if line is not None else "post-mortem" if why == "debugger" else "outside the cell's lines"
    return f"in the debugger ({at})" if why == "debugger" else f"waiting for input ({at})"

