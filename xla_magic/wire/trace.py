"""A rank process's ``--profile`` trace, read into a lane of events by kind. Runs on both sides: standard library only, XLA-free.

Each rank process records the cell with torch_xla's profiler
(launcher/profiling.py); torch_xla writes a Chrome-trace JSON
(``trace.json.gz``) beside its ``xplane.pb``. This module reads the JSON
and sorts its complete events (``"ph": "X"``) into kinds, thread by
thread, then groups each kind's events that touch at the timeline's widest
zoom into runs (:class:`Run`); profile_view.py draws the runs. The rank
process reads its own trace (:func:`digest`, sent with its reply, or by a
pool's rank written beside the trace after it: :func:`wait_digest`) and the
kernel rebuilds the lane from that; it reads the files itself only where
no digest came (a ``Reader`` then reads each as soon as its rank says
where it is, while the others still run).

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

import glob
import gzip
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

KINDS = ("compile", "execute", "device→host", "host→device", "collective/wait", "annotation", "device op", "Python")
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
_SYNC_STEPS = ("StepMarker", "XLAGraphExecutor::Compile")  # the first of them names the cell's thread
OURS = "xla_magic: "  # the annotations the rank put in the trace itself (the sampled lines' clock)
DIGEST_VERSION = 2  # of what digest() sends
DIGEST_WAIT = 60.0  # how long a digest is waited for while its rank lives (reading 100 steps takes ~0.1 s)
DIGEST_POLL = 0.002  # how often its file is looked for
# A rank's profile files: what torch_xla writes under plugins/profile/<time>/ in the rank's folder, and the
# sampled lines beside them (launcher/profiling.py); FILE_KEYS name their paths in a rank's PROFILE fact.
TRACE_FILE = "trace.json.gz"
XPLANE_FILE = "xplane.pb"
LINES_FILE = "python-lines.json"
FILE_KEYS = ("trace", "xplane", "lines")
# Kinds whose events a lane keeps one by one (the text lists compiles; they are few): the others only as runs.
KEPT = ("compile", "execute", "device→host", "host→device", "annotation")
# The digest's resolution: events of one kind closer than a step of a lane's span cut into STEPS are one run,
# each event counted at least THINNEST_STEPS long. The timeline draws no finer than that at its widest zoom
# (profile_view.py derives its geometry from these), so runs draw exactly as their events would.
STEPS = 14_720
THINNEST_STEPS = 4.8


@dataclass(slots=True)
class Event:
    kind: str
    name: str
    start: float  # µs from the rank's first event
    duration: float  # µs
    label: str = ""


@dataclass(slots=True)
class Run:
    """A lane's events of one kind that touch at the widest zoom of the lane's own timeline, in time order.

    What the picture draws as one mark, or as part of one (a lane shorter
    than the longest is drawn at a coarser scale, where runs can join):
    made where the trace is read, so that the kernel handles a few hundred
    runs a lane instead of every event (a 100-step cell's trace has about
    10,000 a rank).
    """

    kind: str
    start: float  # the first event's start, µs
    last_start: float  # the last event's start
    end: float  # the latest end of any of its events
    last_end: float  # the last event's end
    count: int
    busy: float  # its events' durations added up, µs
    names: dict[str, int]  # how many of its events bear each name
    first: Event  # its first event (a run of one is that event)


@dataclass
class Lane:
    """One rank process's trace: its events as runs by kind (the named kinds also one by one), and its files."""

    ranks: list[int]
    where: dict[str, Any]
    events: list[Event] = field(default_factory=list)  # the KEPT kinds' events, in time order
    runs: list[Run] = field(default_factory=list)  # every kind's events, as runs, in order of their start
    ops: dict[str, list[float]] = field(default_factory=dict)  # device op name -> [how many, µs in all]
    span: float = 0.0  # µs from its first event to its last one's end
    problem: str = ""
    lines: dict[int, list[Event]] = field(default_factory=dict)  # rank -> its cell's lines, as sampled
    period_ms: float = 0.0  # how often they were sampled
    _totals: dict[str, float] | None = field(default=None, repr=False, compare=False)

    def time_by_kind(self) -> dict[str, float]:
        """µs by kind (summed once: the tables ask again and again; the runs are not changed after reading)."""
        if self._totals is None:
            totals = dict.fromkeys(KINDS, 0.0)
            for run in self.runs:
                totals[run.kind] += run.busy
            self._totals = totals
        return dict(self._totals)


def read_trace(path: str) -> dict[str, Any]:
    """A Chrome-trace JSON, gzipped (as torch_xla writes it) or not (bytes to json: no text layer between)."""
    with open(path, "rb") as file:
        data = file.read()
    return json.loads(gzip.decompress(data) if path.endswith(".gz") else data)


def lane(where: dict[str, Any], labels: dict[str, str] | None = None) -> Lane:
    """A rank process's trace as a lane; ``labels`` names compiles by graph hash (from the XLA report).

    From the rank's own digest of it when it sent one (:func:`digest`), else read here.
    """
    found = Lane(sorted(where.get("ranks", ())), where)
    if where.get("unsent"):  # on several hosts: a trace its host could not send
        found.problem = f"n/a: {where['unsent']}"
        return found
    if where.get("error"):
        found.problem = f"the profiler did not run: {where['error']}"
        return found
    sent = where.get("digest") or wait_digest(where)
    if sent:
        try:
            return _from_digest(found, sent, labels or {})
        except (KeyError, TypeError, ValueError):  # a digest of another version, or none: the files say it all
            found = Lane(found.ranks, where)
    return _read(found, where, labels or {})


def wait_digest(where: dict[str, Any], timeout: float = DIGEST_WAIT) -> dict[str, Any] | None:
    """The digest its rank writes once its reply went (``digest_file``: launcher/profiling.py's write_digest),
    waited for while the rank's process lives, up to ``timeout``; None if there is none to wait for. The
    paths of the trace's files, which come with it, go into ``where``."""
    path = where.get("digest_file")
    if not path:
        return None
    sent = _wait_for(path, where, timeout)
    files = sent.get("files") if isinstance(sent, dict) else None
    if not isinstance(files, dict):  # the rank went before it wrote them: look here, where it wrote the trace
        files = profiler_files(where.get("folder") or "") if where.get("host") == socket.gethostname() else {}
    for key in FILE_KEYS:
        where.setdefault(key, files.get(key) or "")
    return sent


def _wait_for(path: str, where: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or not _alive(where):
            if not os.path.exists(path):  # (it may have come just now)
                return None
            break
        time.sleep(DIGEST_POLL)
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def profiler_files(folder: str) -> dict[str, str]:
    """The files a rank's profile left in ``folder``: the newest trace and xplane the profiler wrote there, and the
    sampled lines (``""`` for one not there)."""
    found = {key: _newest(folder, suffix) for key, suffix in (("trace", TRACE_FILE), ("xplane", XPLANE_FILE))}
    lines = os.path.join(folder, LINES_FILE)
    found["lines"] = lines if folder and os.path.isfile(lines) else ""
    return found


def _newest(folder: str, suffix: str) -> str:
    found = glob.glob(os.path.join(glob.escape(folder), "plugins", "profile", "*", f"*.{suffix}")) if folder else []
    return max(found, key=os.path.getmtime) if found else ""


def _alive(where: dict[str, Any]) -> bool:
    """Whether the rank process that wrote ``where`` still runs (on this host: a digest is waited for only here)."""
    pid = where.get("pid")
    if not isinstance(pid, int) or where.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal: it exists
        return True
    return True


def digest(where: dict[str, Any]) -> dict[str, Any]:
    """The lane of a trace this process wrote, as plain data for its PROFILE fact, where the trace was read.

    Each rank process reads its own trace as soon as torch_xla has written
    it, all at once on their cores, and sends its runs (a 1,000-event lane
    is about 70) and its named events; the kernel only rebuilds the lane.
    Compiles keep their graph hash, which the kernel turns into the XLA
    report's name for them.
    """
    found = _read(Lane(sorted(where.get("ranks", ())), where), where, None)
    return {"version": DIGEST_VERSION, "problem": found.problem, "span": found.span, "period_ms": found.period_ms,
            "events": [_plain(e) for e in found.events],
            "runs": [(r.kind, r.start, r.last_start, r.end, r.last_end, r.count, r.busy, r.names, _plain(r.first))
                     for r in found.runs],
            "ops": found.ops,
            "lines": {rank: [(e.name, e.start, e.duration, e.label) for e in spans]
                      for rank, spans in found.lines.items()}}


def _plain(e: Event) -> tuple[str, str, float, float, str]:
    return e.kind, e.name, e.start, e.duration, e.label


def _from_digest(found: Lane, sent: dict[str, Any], labels: dict[str, str]) -> Lane:
    if sent["version"] != DIGEST_VERSION:
        raise ValueError("another digest version")
    found.problem, found.span, found.period_ms, found.ops = sent["problem"], sent["span"], sent["period_ms"], sent["ops"]

    def event(kind: str, name: str, start: float, duration: float, label: str) -> Event:
        return Event(kind, name, start, duration, labels.get(label, "") if kind == "compile" else label)

    found.events = [event(*sent_event) for sent_event in sent["events"]]
    found.runs = [Run(kind, start, last_start, end, last_end, count, busy, names, event(*first))
                  for kind, start, last_start, end, last_end, count, busy, names, first in sent["runs"]]
    found.lines = {int(rank): [Event("line", name, start, duration, text) for name, start, duration, text in spans]
                   for rank, spans in sent["lines"].items()}
    return found


def every_event(where: dict[str, Any], labels: dict[str, str] | None = None) -> list[Event]:
    """Every event of a rank process's trace files, sorted into kinds, in time order (for tests and tools: a
    lane keeps them as runs)."""
    found = Lane(sorted(where.get("ranks", ())), where)
    if where.get("trace"):
        _fill(found, read_trace(where["trace"]).get("traceEvents", []), labels)
    return found.events


def _runs(events: list[Event], span: float) -> list[Run]:
    """``events`` (in time order) as runs: each joins its kind's last run when it starts within a pixel of the
    widest zoom of that run's end, as profile_view.marks joins marks, at this lane's own scale (the finest it
    is drawn at: the longest lane sets the scale), so that the picture drawn from runs is the one drawn from
    every event."""
    pixel, thinnest = (span / STEPS, span * THINNEST_STEPS / STEPS) if span > 0 else (0.0, 0.0)
    runs: list[Run] = []
    open_runs: dict[str, Run] = {}  # the last run of each kind
    for event in events:
        start, duration = event.start, event.duration
        end = start + duration
        run = open_runs.get(event.kind)
        if run is not None and start <= max(run.end, run.last_start + thinnest) + pixel:
            run.last_start, run.last_end = start, end
            if end > run.end:
                run.end = end
            run.count += 1
            run.busy += duration
            run.names[event.name] = run.names.get(event.name, 0) + 1
        else:
            run = open_runs[event.kind] = Run(event.kind, start, start, end, end, 1, duration, {event.name: 1}, event)
            runs.append(run)
    return runs


def _read(found: Lane, where: dict[str, Any], labels: dict[str, str] | None) -> Lane:
    """The lane from the trace files themselves; ``labels`` None keeps each compile's graph hash as its label."""
    if not where.get("trace"):
        found.problem = "the profiler wrote no trace.json.gz"
        return found
    try:
        trace = read_trace(where["trace"])
    except (OSError, ValueError, EOFError) as exc:
        found.problem = f"its trace could not be read: {type(exc).__name__}: {exc}"
        return found
    filled = _fill(found, trace.get("traceEvents", []), labels)
    if where.get("lines") and filled is not None:
        _lines(found, *filled, where["lines"])
    found.runs = _runs(found.events, found.span)
    found.events = [event for event in found.events if event.kind in KEPT]
    return found


def _lines(found: Lane, origin: float, by_thread: dict[Any, list[dict[str, Any]]], path: str) -> None:
    """The sampled cell lines, on the trace's clock (the rank's ORIGIN annotation ties the two)."""
    try:
        with open(path, encoding="utf-8") as file:
            sampled = json.load(file)
        marker = min((e for there in by_thread.values() for e in there if e["name"] == sampled["origin_event"]),
                     key=_time_order)
    except (OSError, ValueError, KeyError):  # (min of nothing is a ValueError)
        return  # no lines: the trace still stands
    shift = marker["ts"] - sampled["origin"] - origin
    found.period_ms = sampled["period_ms"]
    for rank, spans in sampled["ranks"].items():
        if not spans:  # a cell shorter than one period
            continue
        found.lines[int(rank)] = [Event("line", f"line {line}", start + shift, end - start, text)
                                  for line, text, start, end in spans]
        found.span = max([found.span] + [event.start + event.duration for event in found.lines[int(rank)]])


def complete_events(trace_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's complete events ("ph": "X"), in time order."""
    return sorted((e for e in trace_events if e.get("ph") == "X" and "ts" in e), key=_time_order)


def _time_order(e: dict[str, Any]) -> tuple[float, float]:
    return e["ts"], -e.get("dur", 0)


class _Names:
    """What each event name is, decided once per name (a trace repeats a few hundred names thousands of times)."""

    def __init__(self) -> None:
        self.op: dict[str, bool] = {}
        self.collective: dict[str, bool] = {}
        self.annotation: dict[str, bool] = {}

    def is_op(self, name: str) -> bool:
        found = self.op.get(name)
        if found is None:
            found = self.op[name] = not NOT_OPS.search(name) and not name.startswith(OURS)
        return found

    def is_collective(self, name: str) -> bool:
        found = self.collective.get(name)
        if found is None:
            found = self.collective[name] = bool(COLLECTIVE.search(name))
        return found

    def may_annotate(self, name: str) -> bool:
        found = self.annotation.get(name)
        if found is None:
            found = self.annotation[name] = "::" not in name and name not in HOST_STEPS
        return found


def _fill(found: Lane, trace_events: list[dict[str, Any]],
          labels: dict[str, str] | None) -> tuple[float, dict[Any, list[dict[str, Any]]]] | None:
    """Sort the trace's complete events into the lane's kinds, thread by thread (see the module's docstring).

    Returns the first event's start and the complete events by thread (None
    when there are none); our own annotations (OURS) are in those, not in the lane.
    """
    threads: dict[tuple[Any, Any], str] = {}
    processes: dict[Any, str] = {}
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    origin, last = float("inf"), float("-inf")  # the first event's start, the last one's end
    for e in trace_events:
        phase = e.get("ph")
        if phase == "X":
            ts = e.get("ts")
            if ts is not None:
                key = (e.get("pid"), e.get("tid"))
                events_there = by_thread.get(key)
                if events_there is None:
                    events_there = by_thread[key] = []
                events_there.append(e)
                if ts < origin:
                    origin = ts
                end = ts + e.get("dur", 0)
                if end > last:
                    last = end
        elif phase == "M":
            what = e.get("name")
            if what == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
            elif what == "process_name":
                processes[e.get("pid")] = e.get("args", {}).get("name", "")
    if not by_thread:
        found.problem = "its trace holds no events"
        return None
    found.span = last - origin
    cell_thread = _cell_thread(by_thread, threads)
    known = _Names()
    for key, there in by_thread.items():
        if key == cell_thread:
            _cell_events(found, there, origin, labels, known)
        elif processes.get(key[0], "").startswith("/device:") or "PjRtCpuClient" in threads.get(key, ""):
            _device_events(found, there, origin, labels, known)
        else:
            _other_events(found, there, origin, labels, known)
    found.events.sort(key=_start)
    return origin, by_thread


def _cell_thread(by_thread: dict[tuple[Any, Any], list[dict[str, Any]]], threads: dict[tuple[Any, Any], str]) -> Any:
    """The cell's thread: where torch_xla's syncs run (the earliest StepMarker or compile), else the one named python."""
    first: tuple[float, Any] | None = None
    for key, there in by_thread.items():
        for e in there:
            if e["name"] in _SYNC_STEPS and (first is None or e["ts"] < first[0]):
                first = (e["ts"], key)
    if first is not None:
        return first[1]
    return next((key for key, name in threads.items() if name == "python"), None)


def _device_events(found: Lane, there: list[dict[str, Any]], origin: float, labels: dict[str, str] | None,
                   known: "_Names") -> None:
    """What ran on the device: its ops (all but the runtime's own steps); torch_xla's named steps as elsewhere."""
    events, ops, is_op = found.events, found.ops, known.op
    rest = []
    for e in there:
        name = e["name"]
        op = is_op.get(name)
        if op is None:
            op = known.is_op(name) if name not in NAMED else None
            if op is None:
                rest.append(e)
                continue
        if op:
            start, duration = e["ts"] - origin, float(e.get("dur", 0))
            tally = ops.get(name)
            if tally is None:
                ops[name] = [1, duration]
            else:
                tally[0] += 1
                tally[1] += duration
            events.append(Event("device op", name, start, duration))
    if rest:
        _other_events(found, rest, origin, labels, known)


def _other_events(found: Lane, there: list[dict[str, Any]], origin: float, labels: dict[str, str] | None,
                  known: "_Names") -> None:
    """A runtime thread's events: torch_xla's named steps, and collectives and waits."""
    events = found.events
    for e in there:
        name = e["name"]
        kind = NAMED.get(name)
        if kind is None:
            if not known.is_collective(name) or name.startswith(OURS):
                continue
            kind = "collective/wait"
        events.append(_event(e, kind, origin, labels))


def _cell_events(found: Lane, there: list[dict[str, Any]], origin: float, labels: dict[str, str] | None,
                 known: "_Names") -> None:
    """The cell thread's events in time order: its named steps, collectives and annotations outside a compile
    (whose own passes are skipped), and the Python between them."""
    there.sort(key=_time_order)
    events = found.events
    open_ends: list[tuple[float, str | None]] = []  # the enclosing events: end, kind
    compiling_until = -1.0  # the end of the compile now open: its passes are skipped at once
    for e in there:
        name = e["name"]
        if name.startswith(OURS):
            continue
        start = e["ts"] - origin
        kind = NAMED.get(name)
        if kind is None and start < compiling_until:
            continue
        end = start + float(e.get("dur", 0))
        while open_ends and open_ends[-1][0] <= start:
            open_ends.pop()
        if kind is None and not any(around == "compile" for _end, around in open_ends):
            if known.is_collective(name):
                kind = "collective/wait"
            elif known.may_annotate(name) and all(around == "annotation" for _end, around in open_ends):
                kind = "annotation"
        open_ends.append((end, kind))
        if kind == "compile":
            compiling_until = end
        if kind is not None:
            events.append(_event(e, kind, origin, labels))
    events += _python(there, origin)


def _event(e: dict[str, Any], kind: str, origin: float, labels: dict[str, str] | None) -> Event:
    label = ""
    if kind == "compile":
        graph = e.get("args", {}).get("graph_hash", "")
        label = graph if labels is None else labels.get(graph, "")
    return Event(kind, e["name"], e["ts"] - origin, float(e.get("dur", 0)), label)


def _start(event: Event) -> float:
    return event.start


def _python(there: list[dict[str, Any]], origin: float) -> list[Event]:
    """The cell thread's time outside any of its events (``there``, in time order): the cell's Python."""
    gaps, reached = [], None
    for e in there:
        start = e["ts"] - origin
        end = start + e.get("dur", 0)
        if reached is not None and start > reached:
            gaps.append(Event("Python", "Python", reached, start - reached))
        reached = end if reached is None or end > reached else reached
    return gaps
