"""Where a run's news goes: the machinery writes to a sink, and whoever listens shows it. Runs in the kernel and in
each host's engine.

A request (request.py), the runner that makes it (runner.py) and a run across
hosts (hosts/request.py) never ask who listens: a notebook's cell
(notebook/cell_view.py), a terminal, a background run's log
(background.py) or, on one host of several, the kernel through the host's
relay. They hand what happens to the :class:`Sink` they were given:

- ``write``: text for a stream, already tagged (the ranks' lines, the run's own lines);
- ``note``: one line of its own under the cell (a compile-cache fact, the XLA report);
- ``live_lines``: where each rank's line in progress is shown while ``\\r`` rewrites it, if anywhere;
- ``display``: what a rank asked to display (a mime bundle, a sharding picture);
- ``show_data``: a display bundle replayed from a run's log;
- ``ask``: a rank's question (``input()``, pdb's prompt), answered with a reply;
- ``before_cell`` / ``follow_cell``: a cell's views, told of its record as it moves and when it is over;
  ``show_profile``: a profile whose traces are all in (a pool across hosts gathers them itself).

This base sink is the plain one: it prints, shows text for displays, follows
no cell and answers no question (a rank's ``input()`` then raises EOFError,
saying why). A host's engine uses it, since ipyparallel relays what the engine
prints; the notebook's sink is the extension's own (notebook/cell_view.py).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol


def in_notebook(shell: object) -> bool:
    """A Jupyter kernel's shell, where display areas and widgets render.

    ipykernel's ``ZMQInteractiveShell`` or any subclass (Colab's
    ``google.colab._shell.Shell`` is one). A shell of that kind exists only
    once ipykernel is imported, so ipykernel is never imported here.
    """
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    return zmqshell is not None and isinstance(shell, zmqshell.ZMQInteractiveShell)


class LiveLines(Protocol):
    """Each rank's line in progress, shown in place while a request runs."""

    def __call__(self, rank: int, text: str) -> None: ...

    def clear(self) -> None: ...


class CellFollower(Protocol):
    """A cell's views (its chart, its profile's reader): told of each change to the record, and of the end."""

    def notice(self, record: Any) -> None: ...

    def ended(self, request: Any = None) -> None:
        """The cell is over (``request``: the one that ran it on this host, whose ranks a profile's reading tells
        when to read their traces): charts closed, the XLA report's line, the profile."""


class _Unfollowed:
    """No views: a cell that nobody draws (a terminal test, a host's part of a world)."""

    def notice(self, record: Any) -> None:
        pass

    def ended(self, request: Any = None) -> None:
        pass


NO_STDIN = "nothing here answers {what} on {who}: run the cell from a notebook or an IPython terminal"


class Sink:
    """The plain sink: prints, and draws nothing. Subclasses show more."""

    notebook = False  # display areas render here (lines updated in place, charts, widgets)
    draws_profiles = False  # a --profile cell's timeline is drawn here (else its ranks are told to read their traces)

    def write(self, stream: str, text: str) -> None:
        (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    def note(self, line: str) -> None:
        print(line, flush=True)

    def live_lines(self, label: Any) -> LiveLines | None:
        return None

    def line_in_place(self) -> Callable[[str], None]:
        """One line under the cell that later calls change (the watchdog's): here said once, its changes not."""
        said: list[str] = []

        def show(line: str) -> None:
            if not said:
                said.append(line)
                self.write("stdout", line + "\n")
                sys.stdout.flush()

        return show

    def display(self, label: str, what: Any, data: Any) -> None:
        text = data.get("text/plain") if isinstance(data, dict) else None
        if text:
            self.write("stdout", f"[{label}] {text}\n")

    def show_data(self, data: dict[str, Any], metadata: dict[str, Any] | None, key: str | None, update: bool,
                  handles: dict[str, Any]) -> None:
        """A display bundle from a run's log (``key``: its display id, ``update``: it updates that display in
        place; ``handles``: the replay's displays so far, by key)."""
        text = data.get("text/plain", "")
        if text and not update:
            print(text, flush=True)

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        return {"eof": NO_STDIN.format(what=question["what"], who=question["who"])}

    def before_cell(self) -> None:
        """A cell is about to run: what the last one still draws comes first."""

    def follow_cell(self, record: Any, per_rank: bool = False, reads_profile: bool = False) -> CellFollower:
        """The cell's views, from its record (``per_rank``: its chart draws each rank, not their mean;
        ``reads_profile``: a --profile trace that comes undigested is read as soon as its rank says where)."""
        return _Unfollowed()

    def show_profile(self, record: Any) -> None:
        """A --profile cell's timeline, its lanes all in the record."""
