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
from typing import TYPE_CHECKING, Any

from IPython.core.error import StdinNotImplementedError

if TYPE_CHECKING:
    from xla_magic.request import Request

NO_STDIN = ("this frontend sends no input to the kernel (allow_stdin is off, as in nbconvert and nbclient runs), "
            "so nothing can answer {what} on {who}")
ENDED = "the kernel's input ended (Ctrl-D, or its stdin is closed), so nothing answers {what} on {who}"
STOPPING = "the cell is being stopped, so {what} on {who} is not asked"


def answer(request: Request, rank: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The INPUT_REPLY's fields for ``rank``'s question: the line typed, or why there is none."""
    ranks = request.ranks
    why = fields.get("why", "input")
    what = "the debugger's prompt" if why == "debugger" else "getpass" if fields.get("password") else "input()"
    who = ranks.name(rank)
    if request.stop_reason is not None or request.watch.capturing:
        return {"eof": STOPPING.format(what=what, who=who)}
    line = fields.get("line")
    state = request.record.ranks.get(rank)
    before_where = state.where if state is not None else ""
    if state is not None:  # the status panel's "where", while the prompt is open
        at = f"line {line}" if line is not None else "post-mortem" if why == "debugger" else "outside the cell's lines"
        state.where = f"in the debugger ({at})" if why == "debugger" else f"waiting for input ({at})"
        request.on_update(request.record)
    before = request.output.take_partial(rank, "stdout")  # print('name:', end=''); input()
    prompt = f"[{ranks.label(rank)}] {before}{fields.get('prompt', '')}"
    try:
        text = getpass.getpass(prompt) if fields.get("password") else builtins.input(prompt)
    except StdinNotImplementedError:
        return {"eof": NO_STDIN.format(what=what, who=who)}
    except (EOFError, OSError):  # OSError: a stdin that cannot be read at all (pytest's capture, say)
        return {"eof": ENDED.format(what=what, who=who)}
    if state is not None:
        state.where = before_where  # answered: the sampler says where it is next
    return {"text": text}
