"""Where each rank's time went in a ``--profile`` cell, drawn from its trace. Runs in the kernel (XLA-free).

Each rank process records the cell with torch_xla's profiler
(launcher/profiling.py); torch_xla writes a Chrome-trace JSON
(``trace.json.gz``) beside its ``xplane.pb``. This module reads the JSON
with the standard library only, sorts its complete events (``"ph": "X"``)
into kinds, and draws one lane per rank as an SVG (a notebook) or a text
summary (a terminal), with a table of time by kind, the top device ops and
the slowest rank against the others.

Kinds, by torch_xla's own event names:

- compile: ``XLAGraphExecutor::Compile`` (its ``graph_hash`` names it as the
  XLA report does: the cell line and the shapes);
- execute: ``PjRtComputationClient::ExecuteComputation``/``ExecuteReplicated``;
- device→host: ``PjRtComputationClient::TransferFromDevice``;
- host→device: ``PjRtComputationClient::TransferToDevice``;
- collective/wait: names of collectives and waits (all-reduce, all-gather, rendezvous,
  torch_xla's ``Wait for ...``), outside a compile (whose passes are named alike);
- annotation: what the cell named itself (``xp.Trace``, ``xp.StepTrace``,
  ``xp.trace_me``): events of the cell's thread with no ``::`` in their
  name and only annotations around them;
- device op: what ran on the device (XLA:CPU's client thread, a TPU's
  ``/device:`` process);
- Python: the cell's thread where no event is (torch_xla's in-process
  profiler records no Python frames);
- line: the cell's line, by line, as the rank sampled it every few ms
  beside the trace (``python-lines.json``, launcher/profiling.py), one row
  per rank thread, drawn as sampled, not traced.
"""

from __future__ import annotations

import gzip
import html
import json
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from xla_magic.display import in_notebook
from xla_magic.record import RunRecord

KINDS = ("compile", "execute", "device→host", "host→device", "collective/wait", "annotation", "device op", "Python")
COLORS = {"compile": "#f59e0b", "execute": "#16a34a", "device→host": "#dc2626", "host→device": "#f472b6",
          "collective/wait": "#2563eb", "annotation": "#7c3aed", "device op": "#0d9488", "Python": "#cbd5e1"}
ROWS = (("host", ("annotation", "compile", "device→host", "host→device", "Python")),
        ("runtime", ("execute", "collective/wait")), ("device", ("device op",)))
NAMED = {"XLAGraphExecutor::Compile": "compile",
         "PjRtComputationClient::ExecuteComputation": "execute",
         "PjRtComputationClient::ExecuteReplicated": "execute",
         "PjRtComputationClient::TransferFromDevice": "device→host",
         "PjRtComputationClient::TransferToDevice": "host→device"}
COLLECTIVE = re.compile(r"all[-_ ]?reduce|all[-_ ]?gather|reduce[-_ ]?scatter|all[-_ ]?to[-_ ]?all|collective"
                        r"|rendezvous|barrier|^Wait for", re.I)
# The cell's thread's own steps that are torch_xla's, not the user's (they hold no "::").
HOST_STEPS = {"StepMarker", "SyncLiveTensorsGraph", "SyncTensorsGraph", "SyncTensorsGraphInternal",
              "CollectSyncTensors", "ScheduleSyncTensorsGraph", "RunInvariantCheckers", "Codegen"}
NOT_OPS = re.compile(r"^end: |ThreadpoolListener|ThunkExecutor|^Wait for|TaskDispatcher|::")
# What a collective or a wait is called outside a compile (a compile's passes are named like them).
TOP_OPS = 8
MARKS_KEPT = 4000  # events drawn per rank (the rest are in the trace files)
OURS = "xla_magic: "  # the annotations the rank put in the trace itself (the sampled lines' clock)
LINE_COLORS = ("#94a3b8", "#64748b", "#a5b4fc", "#818cf8", "#fdba74", "#fb923c")


@dataclass
class Event:
    kind: str
    name: str
    start: float  # µs from the rank's first event
    duration: float  # µs
    label: str = ""


@dataclass
class Lane:
    """One rank process's trace: its events by kind, and its files."""

    ranks: list[int]
    where: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    ops: dict[str, list[float]] = field(default_factory=dict)  # device op name -> durations (µs)
    span: float = 0.0  # µs from its first event to its last one's end
    problem: str = ""
    lines: dict[int, list[Event]] = field(default_factory=dict)  # rank -> its cell's lines, as sampled
    period_ms: float = 0.0  # how often they were sampled

    def time_by_kind(self) -> dict[str, float]:
        totals = dict.fromkeys(KINDS, 0.0)
        for event in self.events:
            totals[event.kind] += event.duration
        return totals


def read_trace(path: str) -> dict[str, Any]:
    """A Chrome-trace JSON, gzipped (as torch_xla writes it) or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as file:
        return json.load(file)


def lane(where: dict[str, Any], labels: dict[str, str] | None = None) -> Lane:
    """A rank process's trace as a lane; ``labels`` names compiles by graph hash (from the XLA report)."""
    found = Lane(sorted(where.get("ranks", ())), where)
    if where.get("unsent"):  # on several hosts: a trace its host could not send
        found.problem = f"n/a: {where['unsent']}"
        return found
    if where.get("error"):
        found.problem = f"the profiler did not run: {where['error']}"
        return found
    if not where.get("trace"):
        found.problem = "the profiler wrote no trace.json.gz"
        return found
    try:
        trace = read_trace(where["trace"])
    except (OSError, ValueError, EOFError) as exc:
        found.problem = f"its trace could not be read: {type(exc).__name__}: {exc}"
        return found
    events = _fill(found, trace.get("traceEvents", []), labels or {})
    if where.get("lines") and events:
        _lines(found, events, where["lines"])
    return found


def _lines(found: Lane, events: list[dict[str, Any]], path: str) -> None:
    """The sampled cell lines, on the trace's clock (the rank's ORIGIN annotation ties the two)."""
    try:
        with open(path, encoding="utf-8") as file:
            sampled = json.load(file)
        marker = next(e for e in events if e["name"] == sampled["origin_event"])
    except (OSError, ValueError, KeyError, StopIteration):
        return  # no lines: the trace still stands
    shift = marker["ts"] - sampled["origin"] - events[0]["ts"]
    found.period_ms = sampled["period_ms"]
    for rank, spans in sampled["ranks"].items():
        if not spans:  # a cell shorter than one period
            continue
        found.lines[int(rank)] = [Event("line", f"line {line}", start + shift, end - start, text)
                                  for line, text, start, end in spans]
        found.span = max([found.span] + [event.start + event.duration for event in found.lines[int(rank)]])


def complete_events(trace_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's complete events ("ph": "X"), in time order."""
    return sorted((e for e in trace_events if e.get("ph") == "X" and "ts" in e), key=lambda e: (e["ts"], -e.get("dur", 0)))


def _fill(found: Lane, trace_events: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    """The lane's events from the trace's; the trace's complete events, in time order."""
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in trace_events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e.get("pid"): e.get("args", {}).get("name", "") for e in trace_events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = complete_events(trace_events)
    if not events:
        found.problem = "its trace holds no events"
        return events
    origin = events[0]["ts"]
    found.span = max(e["ts"] + e.get("dur", 0) for e in events) - origin
    # The cell's thread: where torch_xla's syncs run (else the one named python).
    marker = next((e for e in events if e["name"] in ("StepMarker", "XLAGraphExecutor::Compile")), None)
    cell_thread = (marker["pid"], marker["tid"]) if marker else next(
        (key for key, name in names.items() if name == "python"), None)
    open_ends: list[tuple[float, str | None]] = []  # the cell thread's enclosing events: end, kind
    compiling_until = -1.0  # the end of the cell thread's compile now open: its passes are skipped at once
    for e in events:
        start, duration, name = e["ts"] - origin, float(e.get("dur", 0)), e["name"]
        key = (e.get("pid"), e.get("tid"))
        if name.startswith(OURS):
            continue
        kind = NAMED.get(name)
        if kind is None and start < compiling_until and key == cell_thread:
            continue
        on_device = processes.get(e.get("pid"), "").startswith("/device:") or "PjRtCpuClient" in names.get(key, "")
        if on_device and kind is None:
            if not NOT_OPS.search(name):
                found.ops.setdefault(name, []).append(duration)
                found.events.append(Event("device op", name, start, duration))
            continue
        if key == cell_thread:
            while open_ends and open_ends[-1][0] <= start:
                open_ends.pop()
            around = {kind_around for _end, kind_around in open_ends}
            if kind is None and "compile" not in around:
                if COLLECTIVE.search(name):
                    kind = "collective/wait"
                elif around <= {"annotation"} and "::" not in name and name not in HOST_STEPS:
                    kind = "annotation"
            open_ends.append((start + duration, kind))
            if kind == "compile":
                compiling_until = start + duration
        elif kind is None and COLLECTIVE.search(name):
            kind = "collective/wait"
        if kind is not None:
            label = labels.get(e.get("args", {}).get("graph_hash", ""), "") if kind == "compile" else ""
            found.events.append(Event(kind, name, start, duration, label))
    if cell_thread is not None:
        found.events += _python(events, cell_thread, origin)
    found.events.sort(key=lambda event: event.start)
    return events


def _python(events: list[dict[str, Any]], thread: tuple[Any, Any], origin: float) -> list[Event]:
    """The cell thread's time outside any event: the cell's Python."""
    gaps, reached = [], None
    for e in events:
        if (e.get("pid"), e.get("tid")) != thread:
            continue
        start, end = e["ts"] - origin, e["ts"] - origin + e.get("dur", 0)
        if reached is not None and start > reached:
            gaps.append(Event("Python", "Python", reached, start - reached))
        reached = end if reached is None else max(reached, end)
    return gaps


def compile_labels(record: RunRecord) -> dict[str, str]:
    """Graph hash -> how the XLA report names the compile: "line 6, x f32[5,16]"."""
    from xla_magic import xla_report

    labels = {}
    for group in xla_report.groups(record) if record.xla_report != "off" else []:
        for compilation in group.account["compilations"]:
            if compilation["hash"]:
                where = xla_report._where(group.account, compilation)
                shapes = xla_report._shapes(compilation, limit=2)
                labels[compilation["hash"]] = where + (f", {shapes}" if shapes else "")
    return labels


def lanes(record: RunRecord) -> list[Lane]:
    """Each rank process's lane, by first rank (rank threads of one process share one)."""
    labels = compile_labels(record)
    seen: dict[int, Lane] = {}
    for rank, state in sorted(record.ranks.items()):
        where = state.profile
        if where is None or id(where) in seen:
            continue
        seen[id(where)] = lane(where, labels)
    return sorted(seen.values(), key=lambda found: found.ranks[0] if found.ranks else -1)


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
        for name, durations in one.ops.items():
            totals.setdefault(name, []).extend(durations)
    ranked = sorted(totals.items(), key=lambda item: -sum(item[1]))[:TOP_OPS]
    return [[name, str(len(durations)), _ms(sum(durations))] for name, durations in ranked]


def slowest(found: list[Lane]) -> str:
    """The slowest rank against the others, and the kind where it spent the most more."""
    timed = [one for one in found if one.span and one.ranks]
    if len(timed) < 2:
        return ""
    worst = max(timed, key=lambda one: one.span)
    others = [one for one in timed if one is not worst]
    typical = statistics.median(one.span for one in others)
    theirs = {kind: statistics.median(one.time_by_kind()[kind] for one in others) for kind in KINDS}
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
    return f"h{where['host_index']} r{rank}" if "host_index" in where else f"r{rank}"


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


def text(record: RunRecord) -> str:
    found = lanes(record)
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
        for rank, marks in sorted(one.lines.items()):
            lines.append(f"      {_tag(rank, one.where)} lines (sampled every {one.period_ms:g} ms): {top_lines(marks)}")
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

WIDTH = 1000  # viewBox units across
ROW = 12
LANE_GAP = 8
LEFT = 70


def svg(found: list[Lane]) -> str:
    """One lane per rank, three rows each (host, runtime, device) and a row of cell lines per rank thread where
    they were sampled, on one time axis (each rank from its own start)."""
    end = max((one.span for one in found), default=0.0) or 1.0
    scale = (WIDTH - LEFT - 10) / end
    height = 24 + sum((len(ROWS) + len(one.lines)) * ROW + LANE_GAP for one in found)
    parts = [f'<svg class="xla-timeline" viewBox="0 0 {WIDTH} {height}" preserveAspectRatio="none" '
             f'xmlns="http://www.w3.org/2000/svg" font-size="9" font-family="sans-serif">']
    for tick in range(6):
        x = LEFT + tick * (WIDTH - LEFT - 10) / 5
        parts.append(f'<line x1="{x:.1f}" y1="12" x2="{x:.1f}" y2="{height}" stroke="#e5e7eb"/>'
                     f'<text x="{x:.1f}" y="9" text-anchor="middle" fill="#666">{_ms(end * tick / 5)}</text>')
    y = 16
    for one in found:
        parts.append(f'<text x="2" y="{y + ROW + 3}" fill="#111">{html.escape(_who(one.ranks, one.where))}</text>')
        rows = [(name, [event for event in one.events if event.kind in kinds]) for name, kinds in ROWS]
        rows += [(f"{_tag(rank, one.where)} lines", marks) for rank, marks in sorted(one.lines.items())]
        for row, (name, marks) in enumerate(rows):
            top = y + row * ROW
            parts.append(f'<text x="{LEFT - 4}" y="{top + 9}" text-anchor="end" fill="#999" font-size="7">{name}</text>')
            for event in marks[:MARKS_KEPT]:
                x, w = LEFT + event.start * scale, max(event.duration * scale, 0.3)
                if event.kind == "line":
                    tip = (f"{event.name}: {event.label} — {_ms(event.duration)} at {_ms(event.start)} "
                           f"(sampled every {one.period_ms:g} ms)")
                    color = LINE_COLORS[int(event.name.split()[-1]) % len(LINE_COLORS)]
                else:
                    tip = f"{event.kind}: {event.label or event.name} — {_ms(event.duration)} at {_ms(event.start)}"
                    color = COLORS[event.kind]
                parts.append(f'<rect class="xla-{_css(event.kind)}" x="{x:.2f}" y="{top + 1}" width="{w:.2f}" '
                             f'height="{ROW - 2}" fill="{color}"><title>{html.escape(tip)}</title></rect>')
        y += len(rows) * ROW + LANE_GAP
    parts.append("</svg>")
    return "".join(parts)


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


def _css(kind: str) -> str:
    return re.sub(r"[^a-z]+", "-", kind.lower()).strip("-")


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


def page(record: RunRecord) -> str:
    """The timeline and its tables, as HTML (zoom: CSS only, so it works where scripts do not run)."""
    found = lanes(record)
    if not found:
        return f'<div class="xla-profile">{html.escape(text(record))}</div>'
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
    """The profile, as HTML in a notebook and text elsewhere."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record

    def _repr_html_(self) -> str:
        return page(self.record)

    def __repr__(self) -> str:
        return text(self.record)


def show(record: RunRecord, text: bool = False) -> None:
    from IPython import get_ipython

    if text or not in_notebook(get_ipython()):
        print(repr(Profile(record)), flush=True)
    else:
        from IPython.display import display

        display(Profile(record))


def after_cell(record: RunRecord) -> None:
    """Under a --profile cell, however it ended: the profile. A fault here never costs the cell its result."""
    try:
        show(record)
    except Exception as exc:  # a trace we cannot read, a display that fails
        print(f"(xla_magic could not show the profile: {type(exc).__name__}: {exc})", flush=True)


def trace_files(folder: str) -> list[str]:
    """Every trace.json.gz under a run's profile folder (for tests and tools)."""
    return sorted(os.path.join(root, name) for root, _dirs, names in os.walk(folder)
                  for name in names if name.endswith(".trace.json.gz"))
