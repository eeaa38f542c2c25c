"""Where each rank's time went in a ``--profile`` cell, drawn from its trace. Runs in the kernel (XLA-free).

The ranks' traces are read into lanes by wire/trace.py (which says what
each kind of event is); this module draws one lane per rank as an SVG (a
notebook) or a text summary (a terminal), with a table of time by kind, the
top device ops and the slowest rank against the others.
"""

from __future__ import annotations

import html
import os
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from xla_magic.runs.sink import in_notebook
from xla_magic.ranks.naming import tag
from xla_magic.runs.profile_drawer import DRAWER, after_this_cell
from xla_magic.notebook.profile_lanes import Reader, digests_to_come, lanes
from xla_magic.runs.record import RunRecord
from xla_magic.wire.trace import KINDS, STEPS, THINNEST_STEPS, Event, Lane, Run

# The timeline's geometry, in viewBox units: a unit is about a pixel at 1× (the notebook's width); at the widest
# zoom (16×) a sixteenth of one is a pixel, which is the traces' own resolution (wire/trace.py's STEPS).
WIDTH = 1000  # across
LEFT = 70  # where time starts (the rows' names are left of it)
PLOT = WIDTH - LEFT - 10  # the units time spans: the longest lane fills it
PIXEL = PLOT / STEPS  # marks of one kind closer than that are one mark, as the eye sees them at 16×
THINNEST = THINNEST_STEPS * PIXEL  # the narrowest mark drawn

TOP_OPS = 8
MARKS_KEPT = 4000  # marks drawn per row of a lane (the rest are in the trace files)
COLORS = {"compile": "#f59e0b", "execute": "#16a34a", "device→host": "#dc2626", "host→device": "#f472b6",
          "collective/wait": "#2563eb", "annotation": "#7c3aed", "device op": "#0d9488", "Python": "#cbd5e1"}
ROWS = (("host", ("annotation", "compile", "device→host", "host→device", "Python")),
        ("runtime", ("execute", "collective/wait")), ("device", ("device op",)))
_ROW_OF = {kind: row for row, (_name, kinds) in enumerate(ROWS) for kind in kinds}  # kind -> its row's index
LINE_COLORS = ("#94a3b8", "#64748b", "#a5b4fc", "#818cf8", "#fdba74", "#fb923c")


# --- the tables -------------------------------------------------------------------


def _ms(microseconds: float) -> str:
    milliseconds = microseconds / 1000
    return f"{milliseconds:.3g} ms" if milliseconds < 1000 else f"{milliseconds / 1000:.3g} s"


def kind_rows(found: list[Lane]) -> list[list[str]]:
    """Time by kind: all ranks' median, and the slowest rank's."""
    if not found:
        return []
    by_lane = [one.time_by_kind() for one in found]
    slowest = max(range(len(found)), key=lambda i: found[i].span)
    return [[kind, _ms(statistics.median(t[kind] for t in by_lane)), _ms(by_lane[slowest][kind])]
            for kind in KINDS if any(t[kind] for t in by_lane)]


def op_rows(found: list[Lane]) -> list[list[str]]:
    """The device ops that took the most time, all ranks together."""
    totals: dict[str, list[float]] = {}
    for one in found:
        for name, (count, total) in one.ops.items():
            tally = totals.setdefault(name, [0, 0.0])
            tally[0] += count
            tally[1] += total
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_OPS]
    return [[name, str(count), _ms(total)] for name, (count, total) in ranked]


def slowest(found: list[Lane]) -> str:
    """The slowest rank against the others, and the kind where it spent the most more."""
    timed = [one for one in found if one.span and one.ranks]
    if len(timed) < 2:
        return ""
    worst = max(timed, key=lambda one: one.span)
    others = [one for one in timed if one is not worst]
    typical = statistics.median(one.span for one in others)
    by_lane = [one.time_by_kind() for one in others]
    theirs = {kind: statistics.median(totals[kind] for totals in by_lane) for kind in KINDS}
    mine = worst.time_by_kind()
    kind = max(KINDS, key=lambda k: mine[k] - theirs[k])
    more = mine[kind] - theirs[kind]
    told = f"slowest: {_who(worst.ranks, worst.where)}, {_ms(worst.span)} against a median of {_ms(typical)} for the others"
    return told + (f" ({_ms(more)} more {kind})" if more > 0 else "")


def _who(ranks: list[int], where: dict[str, Any] | None = None) -> str:
    """"rank 0", "ranks 0, 1"; on several hosts as the output is tagged: "h1 r2", "h1 r2, r3"."""
    if where is not None and "host_index" in where:
        return f"h{where['host_index']} " + ", ".join(f"r{rank}" for rank in ranks)
    return f"rank{'s' * (len(ranks) > 1)} " + ", ".join(map(str, ranks))


def _tag(rank: int, where: dict[str, Any]) -> str:
    return tag(where["host_index"], rank) if "host_index" in where else f"r{rank}"


def files(record: RunRecord, found: list[Lane]) -> list[str]:
    """Where the trace files are, and how to open them."""
    lines = [f"{_who(one.ranks, one.where)} on {one.where.get('host', '?')}: "
             + (", ".join(p for p in (one.where.get("trace"), one.where.get("xplane")) if p) or one.problem)
             + (f" ({'copied from' if one.where.get('trace') else 'its folder on'} the host's {one.where['on_host']})"
                if one.where.get("on_host") else "")
             for one in found]
    missing = {rank: state.state for rank, state in sorted(record.ranks.items()) if state.profile is None}
    if missing:  # a rank stopped before its cell ended (fail-fast, an interrupt) sent no trace
        lines.append(f"no trace from {_who(list(missing))}: " + ", ".join(f"{r} {s}" for r, s in missing.items()))
    lines += [f"XProf (or TensorBoard's profile plugin): xprof --logdir {record.profile} (one run per rank); "
              "Perfetto: open a trace.json.gz at https://ui.perfetto.dev",
              "the files are in the kernel's session directory, removed when the kernel ends: copy them to keep them"]
    return lines


# --- text ---------------------------------------------------------------------------


def text(record: RunRecord, found: list[Lane] | None = None) -> str:
    found = lanes(record) if found is None else found
    head = f"Profile of run {record.run_id} ({len(found)} trace{'s' * (len(found) != 1)}):"
    if not found:
        return head + " no rank sent a trace (did the cell run to its end?)"
    lines = [head]
    for one in found:
        totals = one.time_by_kind()
        parts = ", ".join(f"{kind} {_ms(totals[kind])}" for kind in KINDS if totals[kind])
        lines.append(f"  {_who(one.ranks, one.where)}: {_ms(one.span)}" + (f" — {parts}" if parts else "")
                     + (f" ({one.problem})" if one.problem else ""))
        compiles = [event for event in one.events if event.kind == "compile"]
        for event in compiles[:4]:
            lines.append(f"      compile {_ms(event.duration)}" + (f": {event.label}" if event.label else ""))
        for rank, marks_of_lines in sorted(one.lines.items()):
            lines.append(f"      {_tag(rank, one.where)} lines (sampled every {one.period_ms:g} ms): "
                         f"{top_lines(marks_of_lines)}")
    table = op_rows(found)
    if table:
        lines += ["", "Top device ops:"] + [f"  {name[:60]:<60} ×{count:<6} {total}" for name, count, total in table]
    told = slowest(found)
    if told:
        lines += ["", told]
    note = line_note(found)
    lines += [""] + ([note] if note else []) + files(record, found)
    return "\n".join(lines)


# --- the picture ---------------------------------------------------------------------

ROW = 12
LANE_GAP = 8
_CSS = {kind: "xla-" + re.sub(r"[^a-z]+", "-", kind.lower()).strip("-") for kind in KINDS + ("line",)}


@dataclass(slots=True)
class Mark:
    """What one rect draws: a lane's events of one kind in one row that touch at the widest zoom (its runs)."""

    kind: str
    left: float  # viewBox units
    right: float
    runs: list[Run]

    @property
    def count(self) -> int:
        return sum(run.count for run in self.runs)

    def tip(self) -> str:
        first = self.runs[0].first
        count = self.count
        if count == 1:
            return f"{first.kind}: {first.label or first.name} — {_ms(first.duration)} at {_ms(first.start)}"
        names: Counter[str] = Counter()
        for run in self.runs:
            names.update(run.names)
        top = ", ".join(f"{name} ×{times}" for name, times in names.most_common(3))
        more = ", …" if len(names) > 3 else ""
        busy = sum(run.busy for run in self.runs)
        return (f"{first.kind}: {count} events ({top}{more}) — {_ms(busy)} within "
                f"{_ms(self.runs[-1].last_end - first.start)} at {_ms(first.start)}")


def marks(one: Lane, scale: float, kinds: tuple[str, ...] = KINDS) -> list[Mark]:
    """The lane's runs of ``kinds`` as the marks drawn at ``scale`` (viewBox units per µs), in order of start.

    Every run, and so every event, is in exactly one mark, so the picture
    and the tables tell the same counts; a trace's thousands of
    sub-microsecond ops become a few dozen rects, which the notebook draws
    and zooms without effort. A lane's runs were made at its own scale, the
    finest it is drawn at (wire/trace.py's Run): here they join as its events
    would.
    """
    found: list[Mark] = []
    open_marks: dict[str, Mark] = {}  # the last mark of each kind
    for run in one.runs:
        kind = run.kind
        if kind not in kinds:
            continue
        left = LEFT + run.start * scale
        right = _right(run, scale)
        mark = open_marks.get(kind)
        if mark is not None and left <= mark.right + PIXEL:
            mark.runs.append(run)
            if right > mark.right:
                mark.right = right
        else:
            mark = open_marks[kind] = Mark(kind, left, right, [run])
            found.append(mark)
    return found


def rows_of_marks(one: Lane, scale: float) -> list[list[Mark]]:
    """The lane's marks for each of ROWS, in order of start: one pass over its runs (as ``marks`` per row)."""
    rows: list[list[Mark]] = [[] for _ in ROWS]
    for mark in marks(one, scale):
        rows[_ROW_OF[mark.kind]].append(mark)
    return rows


def _end(found: list[Lane]) -> float:
    return max((one.span for one in found), default=0.0) or 1.0


def scale(found: list[Lane]) -> float:
    """The timeline's viewBox units per µs: the longest lane fills it."""
    return PLOT / _end(found)


def svg(found: list[Lane]) -> str:
    """One lane per rank, three rows each (host, runtime, device) and a row of cell lines per rank thread where
    they were sampled, on one time axis (each rank from its own start)."""
    end, per_us = _end(found), scale(found)
    height = 24 + sum((len(ROWS) + len(one.lines)) * ROW + LANE_GAP for one in found)
    parts = [f'<svg class="xla-timeline" viewBox="0 0 {WIDTH} {height}" preserveAspectRatio="none" '
             f'xmlns="http://www.w3.org/2000/svg" font-size="9" font-family="sans-serif">']
    for tick in range(6):
        x = LEFT + tick * PLOT / 5
        parts.append(f'<line x1="{x:.1f}" y1="12" x2="{x:.1f}" y2="{height}" stroke="#e5e7eb"/>'
                     f'<text x="{x:.1f}" y="9" text-anchor="middle" fill="#666">{_ms(end * tick / 5)}</text>')
    y = 16
    for one in found:
        parts.append(f'<text x="2" y="{y + ROW + 3}" fill="#111">{html.escape(_who(one.ranks, one.where))}</text>')
        rows = list(zip((name for name, _kinds in ROWS), rows_of_marks(one, per_us)))
        rows += [(f"{_tag(rank, one.where)} lines", [_line_mark(event, per_us) for event in sampled])
                 for rank, sampled in sorted(one.lines.items())]
        for row, (name, drawn) in enumerate(rows):
            top = y + row * ROW
            parts.append(f'<text x="{LEFT - 4}" y="{top + 9}" text-anchor="end" fill="#999" font-size="7">{name}</text>')
            for mark in drawn[:MARKS_KEPT]:
                if mark.kind == "line":
                    event = mark.runs[0].first
                    tip = (f"{event.name}: {event.label} — {_ms(event.duration)} at {_ms(event.start)} "
                           f"(sampled every {one.period_ms:g} ms)")
                    color = LINE_COLORS[int(event.name.split()[-1]) % len(LINE_COLORS)]
                else:
                    tip, color = mark.tip(), COLORS[mark.kind]
                parts.append(f'<rect class="{_CSS[mark.kind]}" x="{mark.left:.2f}" y="{top + 1}" '
                             f'width="{mark.right - mark.left:.2f}" height="{ROW - 2}" fill="{color}">'
                             f'<title>{html.escape(tip)}</title></rect>')
        y += len(rows) * ROW + LANE_GAP
    parts.append("</svg>")
    return "".join(parts)


def _line_mark(event: Event, per_us: float) -> Mark:
    """A sampled line is a mark of its own (each line its colour)."""
    end = event.start + event.duration
    run = Run("line", event.start, event.start, end, end, 1, event.duration, {event.name: 1}, event)
    return Mark("line", LEFT + event.start * per_us, _right(run, per_us), [run])


def line_note(found: list[Lane]) -> str:
    """What the rows of lines are: samples, not a trace."""
    periods = sorted({one.period_ms for one in found if one.lines})
    if not periods:
        return ""
    return (f"lines: the cell's current line on each rank thread, sampled every {'/'.join(f'{p:g}' for p in periods)}"
            " ms beside the trace (torch_xla's profiler records no Python): a line shorter than that may not show")


def top_lines(marks: list[Event], limit: int = 4) -> str:
    """The lines that took the most sampled time: "line 3 120 ms, line 2 40 ms"."""
    totals: dict[str, float] = {}
    for event in marks:
        totals[event.name] = totals.get(event.name, 0.0) + event.duration
    return ", ".join(f"{name} {_ms(total)}" for name, total in sorted(totals.items(), key=lambda i: -i[1])[:limit])


STYLE = """<style>
.xla-profile { font-size: var(--jp-code-font-size, 13px); }
.xla-profile .xla-zoom { overflow-x: auto; border: 1px solid var(--jp-border-color2, #ddd); }
.xla-profile .xla-zoom svg { display: block; width: 100%; }
.xla-profile input[value="4"]:checked ~ .xla-zoom svg { width: 400%; }
.xla-profile input[value="16"]:checked ~ .xla-zoom svg { width: 1600%; }
.xla-profile table { border-collapse: collapse; margin: 4px 16px 4px 0; display: inline-table; vertical-align: top; }
.xla-profile th, .xla-profile td { text-align: left !important; padding: 1px 10px 1px 0; white-space: nowrap; }
.xla-profile .xla-legend span { display: inline-block; width: 10px; height: 10px; margin: 0 3px 0 10px; }
.xla-profile .xla-note { color: var(--jp-ui-font-color2, #666); font-size: 90%; }
</style>"""


def page(record: RunRecord, found: list[Lane] | None = None) -> str:
    """The timeline and its tables, as HTML (zoom: CSS only, so it works where scripts do not run)."""
    found = lanes(record) if found is None else found
    if not found:
        return f'<div class="xla-profile">{html.escape(text(record, found))}</div>'
    name = f"xla-zoom-{record.run_id}"
    zoom = "".join(f'<input type="radio" name="{name}" value="{z}"{" checked" if z == 1 else ""}> {z}× '
                   for z in (1, 4, 16))
    legend = "".join(f'<span style="background:{COLORS[kind]}"></span>{html.escape(kind)}' for kind in KINDS)

    def table(columns: tuple[str, ...], body: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
        return f"<table><tr>{head}</tr>{rows}</table>"

    problems = [f"{_who(one.ranks, one.where)}: {one.problem}" for one in found if one.problem]
    parts = [STYLE, '<div class="xla-profile">', f"<h4>Profile of run {record.run_id}</h4>",
             f'<div class="xla-legend">{legend}</div>', f"zoom: {zoom}",
             f'<div class="xla-zoom">{svg(found)}</div>',
             table(("time by kind", "median rank", "slowest rank"), kind_rows(found)),
             table(("top device ops", "count", "time"), op_rows(found))]
    told = slowest(found)
    parts += [f"<div>{html.escape(told)}</div>"] if told else []
    note = line_note(found)
    parts += [f'<div class="xla-note">{html.escape(line)}</div>'
              for line in problems + ([note] if note else []) + files(record, found)]
    parts.append("</div>")
    return "".join(parts)


class Profile:
    """The profile, as HTML in a notebook and text elsewhere (a notebook asks for both: the traces are read once)."""

    def __init__(self, record: RunRecord, reader: Reader | None = None) -> None:
        self.record = record
        self.reader = reader
        self._lanes: list[Lane] | None = None

    def lanes(self) -> list[Lane]:
        if self._lanes is None:
            self._lanes = lanes(self.record, self.reader)
        return self._lanes

    def _repr_html_(self) -> str:
        return page(self.record, self.lanes())

    def __repr__(self) -> str:
        return text(self.record, self.lanes())


class Pending:
    """What a notebook shows under a --profile cell until every rank's digest came; then updated by display id."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record

    def _repr_html_(self) -> str:
        return f'<div class="xla-profile xla-note">{html.escape(repr(self))}</div>'

    def __repr__(self) -> str:
        return f"Profile of run {self.record.run_id}: reading each rank's trace…"


def show(record: RunRecord, text: bool = False, reader: Reader | None = None) -> None:
    from IPython import get_ipython

    wait_drawn()  # a profile still being filled in comes first
    if text or not in_notebook(get_ipython()):
        print(repr(Profile(record, reader)), flush=True)
    else:
        from IPython.display import display

        display(Profile(record, reader))


def wait_drawn() -> None:
    """Until the profile shown last is complete (the next %%xla_spawn cell and %xla_profile wait for it)."""
    DRAWER.wait()


def after_cell(record: RunRecord, reader: Reader | None = None, start: Callable[[], None] | None = None) -> None:
    """Under a --profile cell, however it ended: the profile. A fault here never costs the cell its result.

    Where the ranks digest their traces after their reply (a pool's: once
    ``start`` told them to, when the kernel is done with the cell), the
    cell does not wait for them: a notebook shows a placeholder, updated by
    its display id with the profile once every digest came; a terminal
    prints the text then. Both are done by the drawing thread once the cell
    is over (profile_drawer.py), in the cell's context, so the update goes
    to the cell that ran.
    """
    from IPython import get_ipython

    try:
        wait_drawn()
        if not digests_to_come(record):
            show(record, reader=reader)
            return
        profile = Profile(record, reader)
        if in_notebook(get_ipython()):
            from IPython.display import display

            handle = display(Pending(record), display_id=True)

            def fill() -> None:
                profile.lanes()
                handle.update(profile)
        else:
            out = sys.stdout

            def fill() -> None:
                print(repr(profile), file=out, flush=True)

        done, reader = _filled(fill, reader), None
        DRAWER.submit(done, start)
        start = None
    except Exception as exc:  # a trace we cannot read, a display that fails
        print(f"(xla_magic could not show the profile: {_fault(exc)})", flush=True)
    finally:
        if reader is not None:
            reader.close()
        if start is not None:  # nothing to draw: any rank that holds a trace lets go of it all the same
            after_this_cell(start)


def _filled(fill: Callable[[], None], reader: Reader | None) -> Callable[[], None]:
    def run() -> None:
        try:
            fill()
        except Exception as exc:
            print(f"(xla_magic could not show the profile: {_fault(exc)})", flush=True)
        finally:
            if reader is not None:
                reader.close()

    return run


def _fault(exc: BaseException) -> str:
    """The error and the line of ours it came from, for a report: "TypeError: ... (wire/trace.py:296)"."""
    import traceback

    ours = [frame for frame in traceback.extract_tb(exc.__traceback__) if "xla_magic" in frame.filename]
    where = f" ({'/'.join(ours[-1].filename.split(os.sep)[-2:])}:{ours[-1].lineno})" if ours else ""
    return f"{type(exc).__name__}: {exc}{where}"


def trace_files(folder: str) -> list[str]:
    """Every trace.json.gz under a run's profile folder (for tests and tools)."""
    return sorted(os.path.join(root, name) for root, _dirs, names in os.walk(folder)
                  for name in names if name.endswith(".trace.json.gz"))


def _right(run: Run, per_us: float) -> float:
    """Where a run's mark ends on a timeline of ``per_us`` units per µs (each of its events drawn at least
    THINNEST wide, the last one starting last)."""
    return LEFT + max(run.end * per_us, run.last_start * per_us + THINNEST)
