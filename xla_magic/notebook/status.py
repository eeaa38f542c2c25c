"""``%xla_status``: a live panel of devices, launcher, pool, ranks and runs. Runs in the kernel.

Every fact comes from the session (the launcher's READY event, the ranks'
events) or from XLA-free probes; nothing here imports torch_xla. The panel
is redrawn by the session's listeners, which the running cell's own event
loop calls, so there is no polling thread.

The Interrupt button has to be heard while a cell runs, but the kernel's
main thread is busy in that cell and a notebook kernel handles widget
messages only between cells. ipykernel 7.4 and later can route a comm's
messages to a subshell (a thread of its own); the button's comm is routed
to one, and its click only raises a flag that the running cell's event loop
reads. Kernels without subshells hear the click after the cell, so there
the panel says to use the notebook's stop button.
"""

from __future__ import annotations

import concurrent.futures
import html
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError

from xla_magic.cell import compile_cache
from xla_magic.ranks import probe
from xla_magic.notebook import xla_report
from xla_magic.runs.sink import in_notebook
from xla_magic.ranks.launcher_client import Launcher
from xla_magic.pools.interface import Pool
from xla_magic.runs.record import RankState, RunRecord
from xla_magic.session import Session

HISTORY_SHOWN = 10
LAST_LINE_CHARS = 80
CELL_CHARS = 48
PIDS_SHOWN = 4  # pids listed per rank; the count says how many more
REDRAW_INTERVAL = 0.2  # seconds between redraws while a run is in progress
NOTEBOOK_FRONT_ENDS = "JupyterLab, Notebook, VS Code or Colab"
# What each version needs, in one place. The panel uses only widgets and
# traits that ipywidgets 7.7.1 (Colab's) and 8.x both have, with the same
# names: HTML.value, Button (description, icon, button_style, tooltip,
# disabled, on_click, click), HBox/VBox and add_class; both display through
# IPython's display(). What differs is the kernel's: a click heard while a cell
# runs needs ipykernel 7.4 (comm messages routed to a subshell), whichever
# ipywidgets is installed. Without it clicks arrive after the cell.
LIVE_INTERRUPT_NEEDS = "ipykernel 7.4 or later"
STATE_COLOURS = {
    "starting": "#757575",
    "running": "#1565c0",
    "done": "#2e7d32",
    "failed": "#c62828",
    "killed": "#ef6c00",
    "stopped": "#6a1b9a",  # SIGSTOP/SIGTSTP: the cell waits for it
}
OUTCOME_COLOURS = {
    "running": "#1565c0",
    "done": "#2e7d32",
    "failed": "#c62828",
    "interrupted": "#ef6c00",
    "timeout": "#ef6c00",
}


# --- the facts ---------------------------------------------------------------


@dataclass
class Fact:
    """One labelled line of the panel; ``alarm`` draws it in red."""

    label: str
    text: str
    alarm: bool = False
    kind: str = ""


@dataclass
class Snapshot:
    facts: list[Fact]
    run: RunRecord | None
    history: list[RunRecord] = field(default_factory=list)


def snapshot(session: Session) -> Snapshot:
    """Everything the panel shows, read now."""
    return Snapshot(
        facts=[devices_fact(), versions_fact(session.host.launcher), kernel_fact(),
               launcher_fact(session.host.launcher)] + pool_facts(session.current_pool()) + spmd_fact(session)
              + [cache_fact(session)],
        run=session.history[-1] if session.history else None,
        history=list(reversed(session.history[-HISTORY_SHOWN:])),
    )


def devices_fact() -> Fact:
    try:
        placement = probe.place("auto", None)
    except probe.PlacementError as exc:
        return Fact("Devices", str(exc), alarm=True)
    if placement.backend == "cpu":
        return Fact("Devices", f"CPU simulation, {placement.devices} devices (no TPU on this machine)")
    if placement.cpu_threads:
        return Fact("Devices", f"tpu launch path on CPU threads (PJRT_DEVICE=CPU), {placement.devices} devices")
    tpu = probe.find_tpu()
    if tpu is None:
        return Fact("Devices", "TPU (PJRT_DEVICE=TPU; chips not visible under /sys)")
    return Fact("Devices", tpu.describe())


def versions_fact(launcher: Launcher | None) -> Fact:
    info = launcher_info(launcher)
    if info is None:
        return Fact("Versions", "known once the launcher has imported torch_xla")
    return Fact(
        "Versions",
        f"torch {info.get('torch', '?')}, torch_xla {info.get('torch_xla', '?')}, "
        f"Python {info.get('python_version', '?')} (as the launcher sees them)",
    )


def kernel_fact() -> Fact:
    refusal = probe.kernel_xla_runtime()
    if refusal:
        return Fact("Kernel", f"kernel holds an XLA runtime: {refusal}", alarm=True, kind="held")
    if probe.kernel_imported_torch_xla():
        return Fact("Kernel", "kernel is XLA-free (torch_xla is imported here, but no runtime is started)", kind="free")
    return Fact("Kernel", "kernel is XLA-free", kind="free")


def launcher_fact(launcher: Launcher | None) -> Fact:
    if launcher is None:
        return Fact("Launcher", "not started (the first %%xla_spawn starts it)")
    if not launcher.alive():
        return Fact("Launcher", f"exited ({launcher.process.returncode}); the next %%xla_spawn starts a new one",
                    alarm=True)
    state = "running" if launcher_info(launcher) is not None else "importing torch_xla"
    uptime = format_seconds(time.time() - launcher.started_at)
    return Fact("Launcher", f"{state}, pid {launcher.pid}, up {uptime}")


def launcher_info(launcher: Launcher | None) -> dict[str, Any] | None:
    """The launcher's READY facts, reading them now if they are waiting.

    Only called between cells or from the running cell's own loop, so no
    one else is reading the launcher's channel at the same time.
    """
    if launcher is None:
        return None
    if launcher.info is None and launcher.alive() and _readable(launcher):
        try:
            launcher.wait_ready(timeout=1.0)
        except Exception:  # LauncherError, or a launcher that just died: the fact says so
            return None
    return launcher.info


def _readable(launcher: Launcher) -> bool:
    import select

    try:
        ready, _, _ = select.select([launcher.channel.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(ready)


def pool_facts(pool: Pool | None) -> list[Fact]:
    """The pool, and (across hosts) each host with its engine, launcher and ranks."""
    if pool is None:
        return [Fact("Pool", "none (%xla_pool start keeps ranks alive between cells)")]
    return [Fact(label, text) for label, text in pool.facts()]


def cache_fact(session: Session) -> Fact:
    """torch_xla's persistent compilation cache: the pool's, or what new ranks would get; its size, how to clear it."""
    pool = session.current_pool()
    try:
        if pool is not None:
            return Fact("Cache", pool.cache_fact())
        return Fact("Cache", compile_cache.fact(compile_cache.resolve(None), probe.place("auto", None).on_cpu, None))
    except (UsageError, probe.PlacementError) as exc:
        return Fact("Cache", str(exc), alarm=True)


SPMD_MEMORY_NOTE = "memory per device: torch_xla reports none for an SPMD process (it sees one virtual device)"


def spmd_fact(session: Session) -> list[Fact]:
    """The SPMD process of the pool, or else of the last run, if either is one: mesh, devices, memory."""
    pool = session.current_pool()
    if pool is not None and pool.one_value:
        run = next((r for r in reversed(session.history) if r.mesh), None)  # the pool's start, at the latest
        if run is None:
            return []
        where, mesh, devices = "pool", run.mesh, run.devices
    else:
        run = session.history[-1] if session.history else None
        if run is None or not run.mesh:
            return []
        where, mesh, devices = f"run {run.run_id}", run.mesh, run.devices
    memory = run.ranks.get(0).memory if run is not None and run.ranks.get(0) is not None else None
    said = f"memory {format_memory(memory)}" if memory else SPMD_MEMORY_NOTE
    return [Fact("SPMD", f"{where}: one process, {devices} devices, mesh {mesh}; {said}")]


# --- formatting ----------------------------------------------------------------


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def format_memory(memory: dict[str, Any] | None) -> str:
    if not memory or "bytes_used" not in memory:
        return "-"
    text = format_bytes(memory["bytes_used"])
    if memory.get("bytes_limit"):
        text += f" of {format_bytes(memory['bytes_limit'])}"
    if "peak_bytes_used" in memory:
        text += f", peak {format_bytes(memory['peak_bytes_used'])}"
    if "cell_peak_bytes" in memory:  # the samples' own, since the runtime's peak cannot be reset (rank.MemoryReporter)
        text += f" ({format_bytes(memory['cell_peak_bytes'])} in the cell)"
    return text


def cell_summary(cell: str) -> str:
    first = next((line.strip() for line in cell.splitlines() if line.strip()), "")
    return first if len(first) <= CELL_CHARS else first[: CELL_CHARS - 1] + "…"


def format_processes(pids: list[int], shown: int = PIDS_SHOWN) -> str:
    """The processes a rank keeps: how many, and their pids ("2: 4711 4712"); "-" for none."""
    if not pids:
        return "-"
    listed = " ".join(str(pid) for pid in pids[:shown])
    return f"{len(pids)}: {listed}{' …' if len(pids) > shown else ''}"


def shorten(text: str, limit: int = LAST_LINE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_headline(run: RunRecord, outcome: bool = True) -> str:
    duration = format_seconds(run.duration if run.duration is not None else time.time() - run.started)
    said = f"{run.outcome} ({duration})" if outcome else duration
    return f"run {run.run_id}: {run.devices} devices, {run.backend} backend, {said}"


def rank_memory_note(run: RunRecord) -> str:
    if any(state.memory for state in run.ranks.values()):
        return ""
    if run.backend == "cpu" or probe.auto_backend() == "cpu":
        return "device memory: the CPU runtime does not report it"
    return "device memory: not reported yet"


# --- text (terminals, and where ipywidgets is missing) ---------------------


def render_text(snap: Snapshot) -> str:
    lines = ["xla_magic status"]
    lines += [f"  {fact.label + ':':<10}{'!! ' if fact.alarm else ''}{fact.text}" for fact in snap.facts]
    if snap.run is not None:
        lines.append(f"Ranks of {run_headline(snap.run)}")
        lines.append(f"  {'rank':>4}  {'state':<8} {'elapsed':>10} {'lines':>6}  {'memory':<28} "
                     f"{'processes':<20} {'XLA':<30} {'last line':<40} where")
        for rank, state in sorted(snap.run.ranks.items()):
            lines.append(
                f"  {rank:>4}  {state.state:<8} {format_seconds(state.elapsed):>10} {state.lines:>6}  "
                f"{format_memory(state.memory):<28} {format_processes(state.processes):<20} "
                f"{xla_report.rank_facts(state):<30} {shorten(state.last_line):<40} {state.where or '-'}"
            )
        note = rank_memory_note(snap.run)
        if note:
            lines.append(f"  ({note})")
    else:
        lines.append("Ranks: no run yet")
    if snap.history:
        lines.append("History")
        for run in snap.history:
            lines.append(
                f"  {run.run_id:>4}  {run.outcome:<11} {run.devices:>3} devices  "
                f"{format_seconds(run.duration):>10}  {cell_summary(run.cell)}"
                + ("  [profiled: %xla_profile]" if run.profile else "")
            )
            said = xla_report.summary(run)
            if said:
                lines.append(f"        {said}")
    return "\n".join(lines)


# --- HTML pieces for the widget -------------------------------------------------

STYLE = """<style>
.xla-status table { border-collapse: collapse; font-size: var(--jp-code-font-size, 13px); }
.xla-status th { text-align: left; font-weight: 600; padding: 2px 10px 2px 0;
  border-bottom: 1px solid var(--jp-border-color2, #ccc); }
.xla-status td { padding: 2px 10px 2px 0; vertical-align: top; }
.xla-status .xla-mono { font-family: var(--jp-code-font-family, monospace); white-space: pre; }
.xla-status .xla-chip { display: inline-block; min-width: 5.5em; padding: 0 6px; border-radius: 8px;
  color: white; text-align: center; }
.xla-status .xla-badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: white; }
.xla-status .xla-facts th { border-bottom: none; padding-right: 16px; }
.xla-status h4 { margin: 8px 0 4px 0; }
.xla-status .xla-note { color: var(--jp-ui-font-color2, #666); font-size: 90%; }
</style>"""


def chip(text: str, colour: str) -> str:
    return f'<span class="xla-chip" style="background:{colour}">{html.escape(text)}</span>'


def facts_html(facts: list[Fact]) -> str:
    rows = []
    for fact in facts:
        if fact.kind:
            colour = "#c62828" if fact.alarm else "#2e7d32"
            mark = "✖" if fact.alarm else "✔"
            body = f'<span class="xla-badge xla-{fact.kind}" style="background:{colour}">{mark} {html.escape(fact.text)}</span>'
        else:
            style = ' style="color:#c62828"' if fact.alarm else ""
            body = f"<span{style}>{html.escape(fact.text)}</span>"
        rows.append(f'<tr class="xla-fact" data-label="{fact.label.lower()}"><th>{fact.label}</th><td>{body}</td></tr>')
    return f'{STYLE}<div class="xla-status"><h4>XLA status</h4><table class="xla-facts">{"".join(rows)}</table></div>'


def rank_row(rank: int, state: RankState) -> str:
    return (
        f'<tr class="xla-rank" data-rank="{rank}" data-state="{state.state}">'
        f"<td>{rank}</td><td>{chip(state.state, STATE_COLOURS.get(state.state, '#757575'))}</td>"
        f"<td>{format_seconds(state.elapsed)}</td><td>{state.lines}</td>"
        f"<td>{html.escape(format_memory(state.memory))}</td>"
        f'<td class="xla-processes" data-count="{len(state.processes)}">{format_processes(state.processes)}</td>'
        f'<td class="xla-mono">{html.escape(shorten(state.last_line))}</td>'
        f'<td class="xla-account">{html.escape(xla_report.rank_facts(state))}</td>'
        f'<td class="xla-where">{html.escape(state.where or "-")}</td></tr>'
    )


def ranks_html(run: RunRecord | None) -> str:
    if run is None:
        return '<div class="xla-status"><h4>Ranks</h4><span class="xla-note">no run yet: run a %%xla_spawn cell</span></div>'
    colour = OUTCOME_COLOURS.get(run.outcome, "#757575")
    head = (
        f'<h4>Ranks <span class="xla-run" data-run="{run.run_id}" data-outcome="{run.outcome}">'
        f"{chip(run.outcome, colour)}</span> {html.escape(run_headline(run, outcome=False))}</h4>"
    )
    header = ("<tr><th>rank</th><th>state</th><th>elapsed</th><th>lines</th><th>memory</th><th>processes</th>"
              "<th>last line</th><th>XLA</th><th>where</th></tr>")
    rows = "".join(rank_row(rank, state) for rank, state in sorted(run.ranks.items()))
    note = rank_memory_note(run)
    note_html = f'<div class="xla-note">{html.escape(note)}</div>' if note else ""
    return f'<div class="xla-status">{head}<table>{header}{rows}</table>{note_html}</div>'


# A profiled run's mark in the history: %xla_profile shows its timeline (for the last such run).
PROFILED = ' <span class="xla-profiled" title="profiled: %xla_profile shows its timeline">⏱ profiled</span>'


def history_html(history: list[RunRecord]) -> str:
    if not history:
        return ""
    header = "<tr><th>run</th><th>cell</th><th>devices</th><th>duration</th><th>outcome</th><th>XLA</th></tr>"
    rows = "".join(
        f'<tr class="xla-history" data-run="{run.run_id}" data-outcome="{run.outcome}">'
        f'<td>{run.run_id}</td><td class="xla-mono">{html.escape(cell_summary(run.cell))}'
        f'{PROFILED if run.profile else ""}</td>'
        f"<td>{run.devices}</td><td>{format_seconds(run.duration)}</td>"
        f"<td>{chip(run.outcome, OUTCOME_COLOURS.get(run.outcome, '#757575'))}</td>"
        f'<td class="xla-summary">{html.escape(xla_report.summary(run) or "")}</td></tr>'
        for run in history
    )
    return f'<div class="xla-status"><h4>History</h4><table>{header}{rows}</table></div>'


# --- the live panel ------------------------------------------------------------------


class StatusPanel:
    """The ipywidgets panel of one session; every view of it stays live."""

    def __init__(self, session: Session, kernel: Any = None) -> None:
        import ipywidgets as widgets

        self.session = session
        self.facts = widgets.HTML()
        self.ranks = widgets.HTML()
        self.history = widgets.HTML()
        self.message = widgets.HTML()
        self.interrupt = widgets.Button(description="Interrupt run", icon="stop", button_style="warning",
                                        tooltip="stop the running %%xla_spawn cell (SIGINT, then SIGTERM, SIGKILL)")
        self.stop_pool = widgets.Button(description="Stop pool", icon="power-off", button_style="danger",
                                        tooltip="stop the persistent rank pool")
        self.interrupt.on_click(self._on_interrupt)
        self.stop_pool.on_click(self._on_stop_pool)
        self.live_interrupt = route_to_subshell(self.interrupt, kernel)
        self.widget = widgets.VBox(
            [self.facts, self.ranks, self.history, widgets.HBox([self.interrupt, self.stop_pool]), self.message]
        )
        self.widget.add_class("xla-status-panel")
        self._last_draw = 0.0
        self._last_shape: tuple[Any, ...] = ()
        self._notice = ""
        session.listeners.append(self.on_record)
        self.redraw()

    def on_record(self, record: RunRecord) -> None:
        """Session listener: redraw, sparing the frontend while nothing changes shape."""
        shape = (record.run_id, record.outcome, tuple(s.state for s in record.ranks.values()))
        now = time.monotonic()
        if shape == self._last_shape and now - self._last_draw < REDRAW_INTERVAL:
            return
        self._last_shape = shape
        self.redraw()

    def redraw(self) -> None:
        self._last_draw = time.monotonic()
        snap = snapshot(self.session)
        self.facts.value = facts_html(snap.facts)
        self.ranks.value = ranks_html(snap.run)
        self.history.value = history_html(snap.history)
        running = snap.run is not None and snap.run.outcome == "running"
        self.interrupt.disabled = not running or snap.run.interrupt_requested
        self.stop_pool.disabled = self.session.current_pool() is None
        notes = [self._notice]
        if running and snap.run.interrupt_requested:
            notes.append("interrupt requested: stopping the ranks")
        if not self.live_interrupt:
            notes.append(no_live_interrupt_note())
        self.message.value = "".join(
            f'<div class="xla-status"><span class="xla-note">{html.escape(note)}</span></div>' for note in notes if note
        )

    def _say(self, text: str) -> None:
        self._notice = text

    def _on_interrupt(self, _button: Any) -> None:
        # May run in a subshell thread while the cell runs: only raise the
        # flag; the cell's own loop stops the ranks and redraws the panel.
        run = self.session.history[-1] if self.session.history else None
        if run is not None and run.outcome == "running":
            run.interrupt_requested = True

    def _on_stop_pool(self, _button: Any) -> None:
        try:
            self._say("pool stopped" if self.session.stop_pool() else "no pool to stop")
        except Exception as exc:  # show it in the panel; a button has nowhere else to raise
            self._say(f"stopping the pool failed: {type(exc).__name__}: {exc}")
        finally:
            self.redraw()


def no_live_interrupt_note() -> str:
    """Why the Interrupt button cannot stop a running cell here, and what to use instead."""
    ipykernel = sys.modules.get("ipykernel")
    kernel = f"this kernel (ipykernel {ipykernel.__version__})" if ipykernel is not None else "this kernel"
    return (
        f"The Interrupt button stops a running cell with {LIVE_INTERRUPT_NEEDS} (kernel subshells); "
        f"{kernel} handles widget clicks only between cells. Stop a running cell with the notebook's stop button."
    )


def route_to_subshell(button: Any, kernel: Any) -> bool:
    """Have the button's clicks handled in a subshell thread, so they arrive mid-cell.

    True when this kernel can do it (ipykernel 7.4+ with subshells).
    """
    comm = getattr(button, "comm", None)
    subshell_id = panel_subshell(kernel)
    if subshell_id is None or comm is None or not hasattr(comm, "_reply_subshell_for"):
        return False
    comm._reply_subshell_for = lambda _data, _default: subshell_id
    return True


_subshells: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def panel_subshell(kernel: Any) -> str | None:
    """The id of this kernel's subshell for panel buttons, made on first use."""
    if kernel is None:
        return None
    if kernel in _subshells:
        return _subshells[kernel]
    channel_thread = getattr(kernel, "shell_channel_thread", None)
    manager = getattr(channel_thread, "manager", None)
    if manager is None or not hasattr(manager, "_create_subshell"):
        return None
    created: concurrent.futures.Future[str] = concurrent.futures.Future()

    def create() -> None:  # subshells are made in the shell channel thread
        try:
            created.set_result(manager._create_subshell())
        except Exception as exc:  # report it to the waiting thread
            created.set_exception(exc)

    channel_thread.io_loop.add_callback(create)
    try:
        subshell_id = created.result(timeout=5.0)
    except Exception:  # no subshell: the panel falls back to the stop-button advice
        return None
    _subshells[kernel] = subshell_id
    return subshell_id


# --- the magic's entry point ---------------------------------------------------------

_panels: weakref.WeakKeyDictionary[Session, StatusPanel] = weakref.WeakKeyDictionary()


def status_panel(session: Session, kernel: Any = None) -> StatusPanel:
    """The session's panel (one per session; showing it again adds a live view)."""
    panel = _panels.get(session)
    if panel is None:
        panel = _panels[session] = StatusPanel(session, kernel)
    elif panel.on_record not in session.listeners:  # someone cleared the listeners
        session.listeners.append(panel.on_record)
    return panel


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def panel_hint(notebook: bool, widgets: bool) -> str:
    """How to get the live panel, in words that are true where %xla_status just printed text."""
    if notebook:  # a kernel whose front end draws widgets, without ipywidgets
        return "For the live panel, install ipywidgets in this kernel (%pip install ipywidgets), then run %xla_status again."
    where = f"The live panel shows in a notebook front end ({NOTEBOOK_FRONT_ENDS})"
    if not widgets:
        where += " with ipywidgets installed in its kernel"
    return where + "; this shell is not one, so %xla_status prints text here (--text does everywhere)."


def show_status(session: Session, shell: Any, text: bool = False) -> None:
    """Display the live panel in a notebook; print the facts as text elsewhere."""
    if text or not in_notebook(shell) or not widgets_available():
        print(render_text(snapshot(session)))
        if not text:
            print(panel_hint(in_notebook(shell), widgets_available()))
        return
    from IPython.display import display

    panel = status_panel(session, getattr(shell, "kernel", None))
    panel.redraw()
    display(panel.widget)
