"""A rank's question asked with the kernel's own input: the notebook's input box, or the terminal. Runs in the
kernel.

ipykernel sends an ``input_request`` to the frontend only from the cell's
thread (``builtins.input`` and ``getpass.getpass`` are its own while a cell
runs); runs/questions.py words the question and calls this from there.
"""

from __future__ import annotations

import builtins
import getpass
from typing import Any

from IPython.core.error import StdinNotImplementedError

NO_STDIN = ("this frontend sends no input to the kernel (allow_stdin is off, as in nbconvert and nbclient runs), "
            "so nothing can answer {what} on {who}")
ENDED = "the kernel's input ended (Ctrl-D, or its stdin is closed), so nothing answers {what} on {who}"


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
