"""A ``%%xla_spawn`` cell that does not compile, shown as IPython shows a plain cell's. Runs in the kernel."""

from __future__ import annotations

import linecache
from types import FrameType

class CellSyntaxError(Exception):
    """A ``%%xla_spawn`` cell that does not compile, found before anything ran.

    IPython shows the frames a SyntaxError passed through when it leaves a
    magic (ours and IPython's own); a plain cell's shows only its line, the
    caret and the message. This shows it as the plain cell's, through
    IPython's own SyntaxTB, and keeps the SyntaxError as ``error`` (raised
    as its ``__cause__``, for anything outside IPython).
    """

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(f"{type(error).__name__}: {error.msg} ({error.filename}, line {error.lineno})")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        return get_ipython().SyntaxTB.structured_traceback(type(self.error), self.error, [])


def syntax_error_in_cell(error: SyntaxError, code: str, shell: object, magic_frame: FrameType | None) -> CellSyntaxError:
    """The cell body's syntax error, as IPython's compiler words it, placed in the notebook cell that ran the magic.

    ``code`` is the body as Python (IPython's transformation of it). IPython
    parses a plain cell with codeop's flags, under which an unclosed bracket
    at the end is "incomplete input": the body is parsed the same way, and
    that error is the one shown, where it finds one.

    ``magic_frame`` is the magic's own frame. Where the magic was run from a
    cell, which IPython compiles into one ``get_ipython().run_cell_magic(...)``
    call at the magic's line (and caches in linecache under the cell's
    filename), the error takes that filename, which IPython shows as
    ``Cell In[N]``, and the line the body's line has in the cell. Called from
    other code (``run_cell_magic`` in a script or a test), it keeps the body's own.
    """
    from IPython.core.interactiveshell import InteractiveShell

    try:
        shell.compile.ast_parse(code, filename=error.filename)
    except SyntaxError as plain:
        error = plain.with_traceback(None)
        error.__context__ = None  # raised while the first was handled: IPython would show both
    frame = magic_frame
    while frame is not None and frame.f_code is not InteractiveShell.run_cell_magic.__code__:
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is None or not isinstance(error.lineno, int):
        return CellSyntaxError(error)
    calling_line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    if calling_line.lstrip().startswith("get_ipython().run_cell_magic("):
        shift = caller.f_lineno  # the magic's line: the body starts on the next one
        error.filename = caller.f_code.co_filename
        error.lineno += shift
        if getattr(error, "end_lineno", None) is not None:
            error.end_lineno += shift
    return CellSyntaxError(error)
