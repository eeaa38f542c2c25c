"""What a cell's ranks log, drawn under the cell while it runs, and ``%xla_metrics``'s table. Runs in the kernel.

The request keeps each rank's METRICS rows in the run's record
(``RunRecord.metrics``); a :class:`Chart` listens to the record's updates
(as the status panel does), takes the rows it has not seen into running
sums, and redraws at most every REDRAW_SECONDS, however fast the ranks log
(less often once a drawing costs more than DRAWING_SHARE of that time): in
a notebook an SVG of our own (one panel per name, the ranks' mean or
every rank's line, the last value and step in each title) in one display
area updated in place; elsewhere (a terminal IPython) one text line,
rewritten in place on a terminal, and written once at the cell's end where
the output is not a terminal (a log, a pipe), so it never runs into the
ranks' lines. Plain SVG in HTML renders in JupyterLab, Notebook 7,
VS Code, Colab and Kaggle, and needs nothing installed. A NaN or inf is a
gap in its line, said once per name (its step and rank). A name that some
ranks log is drawn from those ranks only.
"""

from __future__ import annotations

import html
import math
import sys
import time
from typing import Any, Callable

from xla_magic.runs.record import RunRecord

REDRAW_SECONDS = 0.3  # the chart is redrawn at most this often
DRAWING_SHARE = 0.04  # and drawing takes at most this share of the kernel's time (a long run's chart costs more)
POINTS = 400  # a line's most points: longer runs are drawn from buckets of steps
WIDTH, PANEL, LEFT, TOP = 560, 150, 64, 26
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
COLUMNS = ("run", "rank", "step", "name", "value", "time")


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def _number(value: float) -> str:
    if not _finite(value):
        return str(value)
    return f"{value:.4g}"


class Series:
    """One name's values: by step, the ranks' running mean (NaN once any rank's is not finite), and each rank's."""

    def __init__(self) -> None:
        self.sums: dict[int, list[float]] = {}  # step -> [sum, count]
        self.ranks: dict[int, dict[int, float]] = {}  # rank -> step -> value
        self.steps: list[int] = []  # sorted when ``ordered``: steps mostly come in order
        self.ordered = True

    def take(self, rank: int, step: int, value: float) -> None:
        total = self.sums.get(step)
        if total is None:
            self.sums[step] = [value, 1]
            if self.steps and step < self.steps[-1]:
                self.ordered = False
            self.steps.append(step)
        else:
            total[0] += value
            total[1] += 1
        self.ranks.setdefault(rank, {})[step] = value

    def mean(self) -> list[tuple[int, float]]:
        if not self.ordered:
            self.steps.sort()
            self.ordered = True
        sums = self.sums
        return [(step, sums[step][0] / sums[step][1]) for step in self.steps]

    def of_rank(self, rank: int) -> list[tuple[int, float]]:
        return sorted(self.ranks[rank].items())

    def last(self, per_rank: bool) -> tuple[int, str]:
        """The last step and what was logged at it (the mean, of the ranks that logged it then; or each rank's)."""
        step = max(self.steps) if not self.ordered else self.steps[-1]
        if not per_rank:
            total, count = self.sums[step]
            return step, f"{_number(total / count)} at step {step}, mean of {count} rank{'s' if count != 1 else ''}"
        values = [(rank, steps[step]) for rank, steps in sorted(self.ranks.items()) if step in steps]
        return step, ", ".join(f"{_number(value)} (rank {rank})" for rank, value in values)


def _buckets(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most POINTS points: the mean of each run of steps, NaN (a gap) where one of them was not finite."""
    if len(points) <= POINTS:
        return points
    size = math.ceil(len(points) / POINTS)
    drawn = []
    for start in range(0, len(points), size):
        chunk = points[start:start + size]
        drawn.append((chunk[-1][0], sum(value for _step, value in chunk) / len(chunk)))
    return drawn


def _polylines(points: list[tuple[int, float]], x: Callable[[float], float], y: Callable[[float], float],
               colour: str) -> str:
    """The line through ``points``, broken where a value is not finite."""
    runs: list[list[str]] = [[]]
    for step, value in points:
        if _finite(value):
            runs[-1].append(f"{x(step):.1f},{y(value):.1f}")
        elif runs[-1]:
            runs.append([])
    drawn = []
    for run in runs:
        if len(run) == 1:
            cx, cy = run[0].split(",")
            drawn.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
        elif run:
            drawn.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(run)}"/>')
    return "".join(drawn)


def svg(series: dict[str, Series], per_rank: bool) -> str:
    """One panel per name, in the order the names came: its line(s), its axes' ends, its last value and step."""
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{PANEL * len(series)}" '
             f'font-family="sans-serif" font-size="11" class="xla-metrics">']
    for index, (name, one) in enumerate(series.items()):
        top = index * PANEL
        lines = ([(rank, _buckets(one.of_rank(rank))) for rank in sorted(one.ranks)] if per_rank
                 else [(None, _buckets(one.mean()))])
        finite = [value for _rank, points in lines for _step, value in points if _finite(value)]
        steps = [step for _rank, points in lines for step, _value in points]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        if high == low:
            low, high = low - 0.5, high + 0.5
        first, final = min(steps), max(steps)
        span = max(final - first, 1)
        plot_h = PANEL - TOP - 18

        def x(step: float) -> float:
            return LEFT + (WIDTH - LEFT - 10) * (step - first) / span

        def y(value: float) -> float:
            return top + TOP + plot_h * (high - value) / (high - low)

        step, last = one.last(per_rank)
        at = "" if not per_rank else f" at step {step}"
        parts.append(f'<text x="{LEFT}" y="{top + 16}" font-weight="bold">{html.escape(name)} = '
                     f'{html.escape(last)}{at}</text>')
        parts.append(f'<rect x="{LEFT}" y="{top + TOP}" width="{WIDTH - LEFT - 10}" height="{plot_h}" '
                     f'fill="none" stroke="#ccc"/>')
        parts.append(f'<text x="{LEFT - 4}" y="{top + TOP + 8}" text-anchor="end">{_number(high)}</text>')
        parts.append(f'<text x="{LEFT - 4}" y="{top + TOP + plot_h}" text-anchor="end">{_number(low)}</text>')
        parts.append(f'<text x="{LEFT}" y="{top + PANEL - 4}">{first}</text>')
        parts.append(f'<text x="{WIDTH - 10}" y="{top + PANEL - 4}" text-anchor="end">step {final}</text>')
        for number, (rank, points) in enumerate(lines):
            colour = COLOURS[number % len(COLOURS)] if per_rank else COLOURS[index % len(COLOURS)]
            parts.append(_polylines(points, x, y, colour))
            if per_rank and len(lines) > 1:
                parts.append(f'<text x="{WIDTH - 10}" y="{top + TOP + 12 + 12 * number}" text-anchor="end" '
                             f'fill="{colour}">rank {rank}</text>')
    parts.append("</svg>")
    return "".join(parts)


def text_line(series: dict[str, Series], per_rank: bool) -> str:
    """Each name's last value and step, in one line."""
    shown = []
    for name, one in series.items():
        step, last = one.last(per_rank)
        shown.append(f"{name} {last.split(' at step ')[0]} (step {step})")
    return " · ".join(shown)


def _on_a_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a stream of someone's without isatty, or closed
        return False


class Drawing:
    """The chart as a notebook shows it (HTML with our SVG) and as text (its line)."""

    def __init__(self, svg_text: str, line: str) -> None:
        self.svg, self.line = svg_text, line

    def _repr_html_(self) -> str:
        return f'<div class="xla-metrics">{self.svg}</div>'

    def __repr__(self) -> str:
        return self.line


class Chart:
    """The running cell's chart: takes its record's new rows, redraws at most every REDRAW_SECONDS."""

    def __init__(self, record: RunRecord, per_rank: bool = False, notebook: bool = False,
                 say: Callable[[str], None] = print) -> None:
        self.record = record
        self.per_rank = per_rank
        self.notebook = notebook
        self.say = say
        self.series: dict[str, Series] = {}
        self.taken = 0  # rows of record.metrics taken so far
        self.drawn_at = 0.0
        self.interval = REDRAW_SECONDS  # grows with what a drawing costs (DRAWING_SHARE)
        self.drawn_rows = 0
        self.handle: Any = None
        self.said: set[str] = set()  # names whose non-finite value was said
        self.redraws = 0
        self._line = ""  # the text line last drawn (not in a notebook)

    def notice(self, record: RunRecord) -> None:
        """A listener of the session's history (history.notify): redraw when due. Rows that came too soon after
        a drawing are drawn at a later notice (the request's tick) even when no more rows come: a rank that
        waits (a long step, a gated background run) leaves its last values drawn."""
        if record is not self.record:
            return
        if len(record.metrics) != self.taken:
            self.take()
        if self.drawn_rows != self.taken and time.monotonic() - self.drawn_at >= self.interval:
            self.draw()

    def take(self) -> None:
        rows = self.record.metrics
        for rank, step, name, value, _when in rows[self.taken:]:
            one = self.series.get(name)
            if one is None:
                one = self.series[name] = Series()
            one.take(rank, step, value)
            if not _finite(value) and name not in self.said:
                self.said.add(name)
                self.say(f"log: {name} is {value} at step {step} on rank {rank} (drawn as a gap)")
        self.taken = len(rows)

    def draw(self) -> None:
        started = self.drawn_at = time.monotonic()
        if not self.series or self.drawn_rows == self.taken:
            return
        self.drawn_rows = self.taken
        self.redraws += 1
        line = text_line(self.series, self.per_rank)
        if not self.notebook:
            if _on_a_terminal():  # rewritten in place, the cursor left at its start for the ranks' next line
                sys.stdout.write("\r\x1b[K" + line + "\r")
                sys.stdout.flush()
            self._line = line
        else:
            from IPython.display import display

            drawing = Drawing(svg(self.series, self.per_rank), line)
            if self.handle is None:
                self.handle = display(drawing, display_id=True)
            else:
                self.handle.update(drawing)
        self.interval = max(REDRAW_SECONDS, (time.monotonic() - started) / DRAWING_SHARE)

    def close(self) -> None:
        """The cell is over: its last values drawn, and a text line ended."""
        if len(self.record.metrics) != self.taken:
            self.take()
        self.draw()
        if self._line:  # its last state, as a line of its own (all that output that is not a terminal gets)
            sys.stdout.write(("\r\x1b[K" if _on_a_terminal() else "") + self._line + "\n")
            sys.stdout.flush()


def table(records: list[RunRecord]) -> Any:
    """What ``records`` logged: a pandas DataFrame where pandas is installed, else a dict of lists (COLUMNS)."""
    columns: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for record in records:
        for rank, step, name, value, when in record.metrics:
            for column, item in zip(COLUMNS, (record.run_id, rank, step, name, value, when)):
                columns[column].append(item)
    try:
        import pandas
    except ImportError:
        return columns
    return pandas.DataFrame(columns)
