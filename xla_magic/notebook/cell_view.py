"""The notebook's sink: what a run writes, shown in the running cell. Runs in the kernel.

The session is given one :class:`CellView` when the extension loads; every
request of its runner (and a pool's, and a pool across hosts') writes to
it. In a Jupyter kernel it shows each rank's line in progress in place, what
ranks display as real display data, the chart of what they log, the line
under the cell and the profile; in a terminal IPython the same as text. A
rank's question is asked with the kernel's own input (rank_input.py).
A background run hands the same sink on, behind its log (runs/background.py).
"""

from __future__ import annotations

from typing import Any

from xla_magic.notebook import metrics_view, profile_view, rank_display, rank_input, xla_report
from xla_magic.notebook.live_lines import LiveLines
from xla_magic.runs.sink import Sink, in_notebook


class CellView(Sink):
    """The running cell of ``shell``'s notebook (or terminal) as a run's sink."""

    draws_profiles = True

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    @property
    def notebook(self) -> bool:  # type: ignore[override]
        return in_notebook(self.shell)

    def note(self, line: str) -> None:
        xla_report.say(line)

    def live_lines(self, label: Any) -> LiveLines | None:
        return LiveLines(label=label) if self.notebook else None

    def line_in_place(self) -> Any:
        if not self.notebook:
            return super().line_in_place()
        from IPython.display import display

        handle: list[Any] = []

        def show(line: str) -> None:
            shown = {"text/plain": line}
            if not handle:
                handle.append(display(shown, raw=True, display_id=True))
            else:
                handle[0].update(shown, raw=True)

        return show

    def display(self, label: str, what: Any, data: Any) -> None:
        rank_display.show(label, what, data)

    def show_data(self, data: dict[str, Any], metadata: dict[str, Any] | None, key: str | None, update: bool,
                  handles: dict[str, Any]) -> None:
        if not self.notebook:
            super().show_data(data, metadata, key, update, handles)
            return
        from IPython.display import display

        if key and key in handles:
            handles[key].update(data, raw=True, metadata=metadata or {})
        elif key:
            handles[key] = display(data, raw=True, metadata=metadata or {}, display_id=True)
        else:
            display(data, raw=True, metadata=metadata or {})

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        return rank_input.ask_here(question)

    def before_cell(self) -> None:
        profile_view.wait_drawn()  # the last cell's profile, filled in once its ranks' digests came, comes first

    def follow_cell(self, record: Any, per_rank: bool = False, reads_profile: bool = False) -> CellViews:
        return CellViews(record, per_rank, reads_profile, self.notebook)

    def show_profile(self, record: Any) -> None:
        profile_view.after_cell(record)


class CellViews:
    """One cell's views: the chart of what its ranks log, drawn as rows come; the reader of its ranks' traces;
    at its end the line under it and its profile."""

    def __init__(self, record: Any, per_rank: bool, reads_profile: bool, notebook: bool) -> None:
        self.record = record
        self.chart = metrics_view.Chart(record, per_rank, notebook)
        # --profile: a trace that comes undigested is read as soon as its rank says where it is (profile_view.Reader).
        self.reader = profile_view.Reader() if reads_profile else None

    def notice(self, record: Any) -> None:
        self.chart.notice(record)
        if self.reader is not None:
            self.reader.notice(record)

    def ended(self, request: Any = None) -> None:
        self.chart.close()
        xla_report.after_cell(self.record)
        if self.reader is not None:
            profile_view.after_cell(self.record, self.reader, start=request.tell_digest if request else None)
