"""A rank's IPython shell: line magics, ``!`` commands, ``get_ipython()`` and display, as in a notebook cell. Runs in a rank.

Each rank has a real IPython ``InteractiveShell`` (no ZMQ kernel) whose user
namespace is the rank's namespace. The kernel turned the cell's IPython
syntax into Python (``%time x`` into ``get_ipython().run_line_magic(...)``,
see the kernel's payload.py); the rank runs that code in its namespace,
between the shell's cell events (``pre_execute``, ``pre_run_cell``,
``post_execute``, ``post_run_cell``), so ``%load_ext autoreload`` and
matplotlib's inline backend (which shows the figures a cell left open at
``post_execute``) work as in a notebook.

A shell is made on first use, once per rank: a cell that uses none of it
pays nothing (warm()-ing the launcher imports what making one needs). Ranks
may be threads of one process (the tpu launch path), so IPython's own
``get_ipython()`` (``InteractiveShell.instance()``) answers, in a rank
process, with a stand-in for the shell of the rank that calls it.

Display has one seam (as in ipykernel and ipyparallel's engines): the
shell's ``display_pub``. Every ``display()``, rich repr and inline figure
goes through :class:`RankPublisher`, which sends it to the kernel as a
DISPLAY event (displays.display) and waits until it is shown, so it lands in
order with the rank's printed lines.
"""

from __future__ import annotations

import builtins
import inspect
import threading
from typing import Any

from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell
from IPython.display import display
from traitlets import Type
from traitlets.config import Config

from xla_magic.launcher import displays

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("an ipywidgets widget, shown as text: widgets need a connection (a comm) to the notebook's "
               "front end, which ranks do not have; build widgets in the kernel from the cell's results")

# No history database (and no thread writing to it) in ranks.
_CONFIG = Config({"HistoryAccessor": {"enabled": False}, "HistoryManager": {"enabled": False}})


class RankPublisher(DisplayPublisher):
    """The rank shell's display_pub: every display goes to the kernel as a DISPLAY event."""

    def publish(self, data: dict[str, Any], metadata: dict[str, Any] | None = None, source: Any = None, *,
                transient: dict[str, Any] | None = None, update: bool = False, **kwargs: Any) -> None:
        bundle = {"data": dict(data), "metadata": dict(metadata or {}), "transient": dict(transient or {}),
                  "update": bool(update)}
        if WIDGET_VIEW in bundle["data"]:
            bundle["data"] = {"text/plain": str(bundle["data"].get("text/plain", "<widget>"))}
            bundle["note"] = WIDGET_NOTE
        displays.display("mime", bundle)

    def clear_output(self, wait: bool = False) -> None:
        """Ignored: the cell's output belongs to every rank, and one rank must not erase the others'."""


class RankShell(InteractiveShell):
    """A rank's shell: IPython's own, displaying through the kernel."""

    display_pub_class = Type(RankPublisher)

    def enable_gui(self, gui: str | None = None) -> None:
        """Inline figures need no event loop; a rank has no screen for a GUI's windows."""
        if gui not in (None, "inline"):
            raise RuntimeError(
                f"a rank has no screen for {gui} windows: use %matplotlib inline (the default in ranks), "
                f"and its figures show in the notebook"
            )


class Home:
    """One rank's shell, made on first use over the rank's namespace."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self._shell: RankShell | None = None
        namespace["get_ipython"] = self.get_ipython  # the shell's own replaces it once made

    def get_ipython(self) -> RankShell:
        if self._shell is None:
            self._shell = RankShell(user_ns=self.namespace, config=_CONFIG)
        return self._shell

    def run(self, source: str, body: Any, last: Any) -> Any:
        """Run compiled cell code in the namespace between the shell's cell events (if it has a shell); its value."""
        shell = self._shell
        info = _execution_info(source) if shell is not None else None
        if shell is not None:
            shell.events.trigger("pre_execute")
            shell.events.trigger("pre_run_cell", info)
        result = None
        try:
            exec(body, self.namespace)
            value = eval(last, self.namespace) if last is not None else None
        except BaseException as exc:
            result = exc
            raise
        finally:
            shell = self._shell  # the cell may have made it (a magic, pyplot, display)
            if shell is not None:
                shell.events.trigger("post_execute")
                outcome = ExecutionResult(info or _execution_info(source))
                if isinstance(result, BaseException):
                    outcome.error_in_exec = result
                shell.events.trigger("post_run_cell", outcome)
        return value


# --- which rank's shell IPython's get_ipython() means ------------------------------

_homes = threading.local()
_process_home: Home | None = None
_installed = False
_install_lock = threading.Lock()


def enter(home: Home) -> None:
    """``home`` is this thread's (a rank's own thread) and, for threads its cells start, this process's.

    From here on IPython's get_ipython() and display() mean this rank's shell,
    as in a notebook cell, even before the shell is made.
    """
    global _process_home
    _homes.home = _process_home = home
    _install_stand_in()
    builtins.__dict__.setdefault("display", display)  # a builtin in every IPython shell


def calling_home() -> Home:
    home = getattr(_homes, "home", None) or _process_home
    if home is None:
        raise RuntimeError("no rank's IPython shell here: this thread is not a rank's")
    return home


class _CallingRanksShell(RankShell):
    """``InteractiveShell.instance()`` in a rank process: stands for the shell of the rank that calls it."""

    def __new__(cls) -> _CallingRanksShell:
        return object.__new__(cls)

    def __init__(self) -> None:
        pass

    def __getattribute__(self, name: str) -> Any:
        return getattr(calling_home().get_ipython(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(calling_home().get_ipython(), name, value)


def _install_stand_in() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            stand_in = _CallingRanksShell()
            for cls in _CallingRanksShell._walk_mro():
                cls._instance = stand_in
            _installed = True


_INFO_FIELDS = set(inspect.signature(ExecutionInfo.__init__).parameters)


def _execution_info(source: str) -> ExecutionInfo:
    """What IPython's cell events get about the cell (its fields differ between IPython 7 and 9)."""
    fields = {"raw_cell": source, "store_history": False, "silent": False, "shell_futures": True,
              "cell_id": None}
    return ExecutionInfo(**{name: value for name, value in fields.items() if name in _INFO_FIELDS})


def warm() -> None:
    """Import what making a shell needs, once, in the launcher: each rank's first shell then costs milliseconds."""
    RankShell(user_ns={}, config=_CONFIG)
