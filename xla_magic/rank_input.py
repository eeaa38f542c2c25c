"""A rank's question (``input()``, getpass, pdb's prompt), asked with the kernel's own input. Runs in the kernel.

A rank asks with an INPUT event (launcher/debugger.py) and waits for the
INPUT_REPLY. The request (request.py) answers it from its pump, in the
thread that runs the cell, one prompt at a time: ipykernel sends an
``input_request`` to the frontend only from there (``builtins.input`` and
``getpass.getpass`` are its own while a cell runs), and a terminal IPython
reads the terminal. The prompt is tagged with the rank (``[rank 0] your
name? ``) and follows what the rank printed on that line before it asked.
No stdin (a frontend that sends no input, ``allow_stdin`` off; Ctrl-D; a
kernel whose stdin is closed) is an ``eof`` reply, which the rank raises as
EOFError with that reason. An interrupt at the prompt is the cell's interrupt.
"""

from __future__ import annotations

import builtins
import getpass
from typing import Any, Callable

from IPython.core.error import StdinNotImplementedError

NO_STDIN = ("this frontend sends no input to the kernel (allow_stdin is off, as in nbconvert and nbclient runs), "
            "so nothing can answer {what} on {who}")
ENDED = "the kernel's input ended (Ctrl-D, or its stdin is closed), so nothing answers {what} on {who}"
STOPPING = "the cell is being stopped, so {what} on {who} is not asked"


Ask = Callable[[dict[str, Any]], dict[str, Any]]  # a question -> its reply: {"text": ...} or {"eof": why}


def answer(ranks: Any, record: Any, output: Any, rank: int, fields: dict[str, Any], stopping: bool,
           on_update: Callable[[Any], None], ask: Ask | None = None) -> dict[str, Any]:
    """The INPUT_REPLY's fields for ``rank``'s question: the line typed, or why there is none.

    ``ranks`` names the rank, ``record`` holds the panel's "where", ``output`` the rank's line in progress
    (request.py's); ``stopping``: the request is being stopped, so nothing is asked. ``ask`` asks the question
    (``ask_here``, the kernel's own input; on one host of several, the kernel's through the host's link).
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
    reply = (ask or ask_here)(question)
    if state is not None and "text" in reply:
        state.where = before_where  # answered: the sampler says where it is next
    return reply


def where_at(why: str, line: int | None) -> str:
    """The panel's "where" of a rank at a prompt."""
    at = f"line {line}" if line is not None else "post-mortem" if why == "debugger" else "outside the cell's lines"
    return f"in the debugger ({at})" if why == "debugger" else f"waiting for input ({at})"


def ask_here(question: dict[str, Any]) -> dict[str, Any]:
    """``question`` asked with this process's own input: the kernel's (the notebook's input box, the terminal)."""
    prompt = question["prompt"]
    try:
        text = getpass.getpass(prompt) if question.get("password") else builtins.input(prompt)
    except StdinNotImplementedError:
        return {"eof": NO_STDIN.format(what=question["what"], who=question["who"])}
    except (EOFError, OSError):  # OSError: a stdin that cannot be read at all (pytest's capture, say)
        return {"eof": ENDED.format(what=question["what"], who=question["who"])}
    return {"text": text}
