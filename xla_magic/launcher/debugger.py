"""A rank's stdin, ``input()``, ``getpass`` and pdb, answered at the kernel's prompt. Runs in a rank (process or thread).

A rank has no terminal. What asks it for a line (``input()``,
``getpass.getpass``, ``sys.stdin.readline``, and so pdb: ``breakpoint()``,
``pdb.set_trace()``, ``torch.distributed.breakpoint()``, whose pdb reads
with ``input()`` too) sends an INPUT event to the kernel and waits for its
INPUT_REPLY, as a display waits for SHOWN. The kernel asks with its own
input, the prompt tagged with the rank: the notebook's input box (ipykernel's
stdin channel) or the terminal. No input there (a frontend without stdin,
Ctrl-D) is an EOFError here with the kernel's reason. SIGINT while waiting
stops the cell as anywhere else in it.

A failed cell's traceback stays with the rank until its next request, for
the kernel's ``%debug`` (a DEBUG request: pdb's post-mortem in the cell's
frames, at the cell's line numbers, with its source for ``l``).
"""

from __future__ import annotations

import bdb
import builtins
import getpass
import io
import os
import pdb
import signal
import sys
import threading
import types
from typing import Any

from xla_magic.wire import protocol

CELL_FILE = "<xla_spawn cell"
REPLY_POLL = 0.2  # a rank thread takes an interrupt between bytecodes, so it waits for the reply in slices
_DEBUGGER_FILES = ("/pdb.py", "/bdb.py", "/cmd.py")
_THIS_FILE = os.path.join("xla_magic", "launcher", "debugger.py")  # input() and getpass, as the rank asks

_consoles = threading.local()
_process_console: Console | None = None
_installed = False
_install_lock = threading.Lock()


class Console:
    """One rank's way to the kernel's prompt: ``server`` is its RankServer (channel, inbox, output, phase)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.asking: tuple[str, int | None] | None = None  # (why, cell line) while waiting for the kernel's answer
        self.last_asked: tuple[str, int | None] | None = None  # the last question's, once answered

    def ask(self, prompt: str, password: bool = False) -> str:
        """The line the kernel's user typed at ``prompt``; EOFError (with the kernel's reason) when there is none."""
        server = self.server
        in_debugger = _in_debugger()
        debugger = _debugger() if in_debugger else None
        if debugger is not None:
            # pdb's `c` would take SIGINT for itself (Ctrl-C breaks into pdb in a terminal), in this rank
            # process for good: the kernel's interrupt and --timeout must stop the cell, as anywhere else.
            debugger.nosigint = True
        why, line = ("debugger", _debugger_line(debugger)) if in_debugger else ("input", _cell_line())
        server.flush_output()  # what the cell printed comes before the prompt
        self.asking = (why, line)
        try:
            server.channel.send(protocol.INPUT, seq=server.seq, prompt=prompt, password=password, why=why, line=line)
            reply = None
            while reply is None:
                reply = server.inbox.take_next(protocol.INPUT_REPLY, REPLY_POLL)
        finally:
            self.asking, self.last_asked = None, self.asking
        if reply.kind != protocol.INPUT_REPLY:
            raise EOFError("the kernel is gone, so nothing answers input() on this rank")
        if "eof" in reply.fields:
            raise EOFError(reply.fields["eof"])
        return str(reply.fields.get("text", ""))


def enter(console: Console) -> None:
    """``console`` answers this thread (a rank's own) and, for threads its cells start, this process."""
    global _process_console
    _consoles.console = _process_console = console
    _install()


def current() -> Console | None:
    return getattr(_consoles, "console", None) or _process_console


# --- what asks for a line, in this process ---------------------------------------------

_builtin_input = builtins.input
_builtin_getpass = getpass.getpass


def _input(prompt: object = "") -> str:
    console = current()
    if console is None:
        return _builtin_input(prompt)
    return console.ask(str(prompt))


def _getpass(prompt: str = "Password: ", stream: Any = None) -> str:
    console = current()
    if console is None:
        return _builtin_getpass(prompt, stream)
    return console.ask(str(prompt), password=True)


class RankStdin(io.TextIOBase):
    """``sys.stdin`` in a rank: each line read is asked at the kernel's prompt; its end, an end of file."""

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        console = current()
        if console is None:
            return ""
        try:
            return console.ask("") + "\n"
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        return self.readline()


SKIPPED = ("xla_magic.*",)  # stepping out of the cell goes on to the next cell code, not into the rank's loop


def _breakpoint(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` in a cell: pdb there (unless PYTHONBREAKPOINT names another hook, or 0)."""
    if os.environ.get("PYTHONBREAKPOINT", "pdb.set_trace") not in ("", "pdb.set_trace") or args or kwargs:
        sys.__breakpointhook__(*args, **kwargs)
        return
    pdb.Pdb(skip=SKIPPED).set_trace(sys._getframe(1))


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        builtins.input = _input
        getpass.getpass = _getpass
        sys.stdin = RankStdin()
        sys.breakpointhook = _breakpoint
        _installed = True


# --- where the rank asks from ---------------------------------------------------------


def _in_debugger() -> bool:
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_DEBUGGER_FILES):
            return True
        frame = frame.f_back
    return False


def _cell_line(frame: types.FrameType | None = None) -> int | None:
    """The innermost cell line on the calling thread's stack."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(CELL_FILE):
            return frame.f_lineno
        frame = frame.f_back
    return None


def _debugger() -> pdb.Pdb | None:
    """The pdb asking on this thread: the one whose command loop is on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        debugger = frame.f_locals.get("self") if frame.f_code.co_name in ("cmdloop", "interaction") else None
        if isinstance(debugger, pdb.Pdb):
            return debugger
        frame = frame.f_back
    return None


def _debugger_line(debugger: pdb.Pdb | None) -> int | None:
    """The cell line pdb is showing (its current frame: a post-mortem has no cell frame on the stack)."""
    current_frame = getattr(debugger, "curframe", None)
    if current_frame is not None:
        return current_frame.f_lineno if current_frame.f_code.co_filename.startswith(CELL_FILE) else None
    return _cell_line()


# --- a failed cell, kept for %debug -------------------------------------------------------


def keeps(exc: BaseException) -> bool:
    """Whether a cell's error is one to debug: not an interrupt, nor a debugger the user quit."""
    return not isinstance(exc, (KeyboardInterrupt, bdb.BdbQuit, SystemExit))


def from_cell(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the cell's first frame on: pdb's ``up`` stops at the cell, not in the rank's loop.

    Without our input() underneath (this module's frames last): an EOFError from ``input()`` opens at the
    cell's line that called it, as a plain cell's builtin input() does.
    """
    start = tb
    while start is not None and not start.tb_frame.f_code.co_filename.startswith(CELL_FILE):
        start = start.tb_next
    start = start or tb
    entries = []
    while start is not None:
        entries.append(start)
        start = start.tb_next
    while len(entries) > 1 and entries[-1].tb_frame.f_code.co_filename.endswith(_THIS_FILE):
        entries.pop()
    trimmed = None
    for entry in reversed(entries):  # a copy: the exception keeps its own traceback
        trimmed = types.TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return trimmed


def post_mortem(tb: types.TracebackType) -> None:
    """pdb in the frames of ``tb``, where its exception was raised, until the user leaves it (``q``, ``c``, EOF)."""
    debugger = pdb.Pdb()
    debugger.reset()
    debugger.interaction(None, tb)


def park() -> None:
    """A one-shot rank that keeps its failed cell for %debug outlives the stop of the others: SIGTERM is theirs.

    Only a rank that owns its process: rank threads share theirs with the ranks being stopped.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def quit_message(console: Console) -> str:
    """What a BdbQuit from the cell says: the user quit pdb (``q``) at the line it last asked at, as IPython takes it."""
    asked = console.last_asked
    line = asked[1] if asked is not None and asked[0] == "debugger" else None
    return f"the debugger was quit{f' at line {line}' if line is not None else ''}"
