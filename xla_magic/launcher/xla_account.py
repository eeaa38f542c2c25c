"""What XLA did during a cell, counted where it happened. Runs in a rank (process or thread).

The account of one cell is plain data (see ``Span.account``): compilations
with their time and cause, executions, cache hits, device-to-host
transfers and CPU fallbacks. Counts are deltas of torch_xla's own counters
(``torch_xla._XLAC``, what ``torch_xla.debug.metrics`` reads) between the
cell's start and end. Causes come from torch_xla's compilation analysis
(``PT_XLA_DEBUG_LEVEL=1``): one block per compilation naming its cause,
the graph's hash and the Python frames that triggered it. ``claim_analysis``
points that analysis at a private file per process before the runtime
first compiles (torch_xla reads the variables once); a user who set the
variables keeps torch_xla's own output and the account has no causes.

Costs: a cell that does no XLA work pays two reads of the counters (a few
microseconds); one that did waits at its end for the device work it
started (``torch_xla.sync()`` returns before its graph ran), so that work
counts in its own cell. The analysis is written only when XLA compiles,
which takes far longer itself. ``.item()`` and ``.tolist()`` of XLA
tensors note the cell line they were called from, so syncs have a line
(torch.compile sees the original methods).

Environment: the rank sets PT_XLA_DEBUG_LEVEL, PT_XLA_DEBUG_FILE and
PT_XLA_DEBUG_MAX_FRAME in its own process; processes a cell starts
inherit them (their compilations land in the same file). On a host where
xmp.spawn starts several processes, torch_xla writes the analysis only in
local process 0 (PJRT_LOCAL_PROCESS_RANK): other processes' accounts have
counts but no causes.

Ranks that are threads of one process (the tpu launch path on CPU, v2/v3
cores) share its counters: one span covers every rank thread that is in a
cell, and the last to leave reports it for all of them (``ranks``).

The CPU simulation's own copies (its collectives move tensors through the
host) are not the user's: ``simulate.exchange`` counts what they add, and
that is taken off.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from xla_magic import protocol

# Set by a user, these give torch_xla's own debug output: then we set nothing.
DEBUG_VARIABLES = ("PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE")
# Frames the analysis keeps per compilation (torch_xla's default is 8): a sync deep in a library still reaches the cell.
ANALYSIS_FRAMES = 32
SYNC_FRAMES = 12  # how far up from .item() to look for a cell's line
# The op torch_xla counts as aten::_local_scalar_dense is .item() and friends: a sync, not a fallback.
SCALAR_READ = "aten::_local_scalar_dense"
TRANSFERS = "TransferFromDeviceTime"
COMPILE_TIME = "CompileTime"
EXECUTE_TIMES = ("ExecuteTime", "ExecuteReplicatedTime")
_FRAME = re.compile(r"^\s*(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")
_GB = re.compile(r"Graph input size: ([0-9.]+) GB")


# --- the analysis file --------------------------------------------------------------

_claim_lock = threading.Lock()
_claimed_pid: int | None = None
_analysis_file: str | None = None
_user_debug: bool | None = None  # decided once, before we set anything; inherited by forks


def claim_analysis() -> str | None:
    """Have this process's compilation analysis written to a private file; its path.

    Call in each rank process before it compiles anything. None when the
    user set torch_xla's debug variables themselves (their output stays
    theirs, as without xla_magic).
    """
    global _claimed_pid, _analysis_file, _user_debug
    with _claim_lock:
        if _claimed_pid == os.getpid():
            return _analysis_file
        if _user_debug is None:
            _user_debug = any(os.environ.get(name) for name in DEBUG_VARIABLES)
        _claimed_pid = os.getpid()
        _analysis_file = None
        if _user_debug:
            return None
        descriptor, path = tempfile.mkstemp(prefix=f"xla_magic-analysis-{os.getpid()}-", suffix=".txt")
        os.close(descriptor)
        os.environ.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=path, PT_XLA_DEBUG_MAX_FRAME=str(ANALYSIS_FRAMES))
        _analysis_file = path
        return path


def release_analysis() -> None:
    """Remove this process's analysis file (at the rank's end)."""
    global _analysis_file
    with _claim_lock:
        if _analysis_file is not None and _claimed_pid == os.getpid():
            try:
                os.unlink(_analysis_file)
            except OSError:
                pass
            _analysis_file = None


ANALYSIS_KEPT = 1 << 20  # bytes of analysis kept while no account reads it (--xla-report off)


_unread_cells = 0


def forget_analysis() -> None:
    """Keep the analysis file small while cells ask for no account: what compiled then is nobody's.

    Looks every hundredth such cell, so a cell with the report off costs nothing measurable.
    """
    global _unread_cells
    _unread_cells += 1
    path = _analysis_file
    if _unread_cells % 100:
        return
    try:
        if path is not None and os.stat(path).st_size > ANALYSIS_KEPT:
            os.truncate(path, 0)
    except OSError:
        pass


def read_analysis(path: str | None) -> str:
    """What the analysis wrote since the last read; the file is emptied for the next."""
    if path is None:
        return ""
    try:
        with open(path, "r+", errors="replace") as file:
            text = file.read()
            if text:
                file.truncate(0)
            return text
    except OSError:
        return ""


def parse_analysis(text: str) -> list[dict[str, Any]]:
    """torch_xla's compilation analysis blocks, as one dict per compilation.

    Keys: ``cause``, ``hash``, ``inputs`` (count), ``input_bytes`` (from the
    post-compilation analysis; GB with six decimals, so about 1 KB apart),
    ``frames`` ([(function, file, line)], innermost first).
    """
    compilations: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    expecting_cause = in_frames = False
    for raw in text.splitlines():
        if raw.startswith("Post Compilation Analysis: "):
            size = _GB.search(raw)
            if size and compilations and compilations[-1].get("input_bytes") is None:
                compilations[-1]["input_bytes"] = int(float(size.group(1)) * (1 << 30))
            continue
        prefix, _, body = raw.partition("Compilation Analysis: ")
        if not _ or prefix:  # not ours, or the "Unexpected Execution" kind
            continue
        content = body.strip()
        if content.startswith("=") or content.startswith("-"):
            in_frames = False
            continue
        if content == "Compilation Cause":
            current = {"cause": "", "hash": "", "inputs": None, "input_bytes": None, "frames": []}
            compilations.append(current)
            expecting_cause, in_frames = True, False
        elif current is None:
            continue
        elif expecting_cause:
            current["cause"], expecting_cause = content, False
        elif content.startswith("Graph Hash:"):
            current["hash"] = content.partition(":")[2].strip()
        elif content.startswith("Number of Graph Inputs:"):
            current["inputs"] = int(content.partition(":")[2])
        elif content.startswith("Python Frame Triggered Execution"):
            in_frames = True
        elif in_frames:
            frame = _FRAME.match(body)
            if frame:
                current["frames"].append((frame["function"], frame["file"], int(frame["line"])))
    return compilations


# --- reading the counters --------------------------------------------------------------


def _xlac() -> Any:
    import torch_xla

    return torch_xla._XLAC


# Read at every cell's start and end: one of them moves whenever XLA compiled, ran a
# graph or copied to the CPU (every fallback does). Only then is the rest read. The
# compile counters must be here: torch_xla.sync() compiles at once but runs the graph
# in the background, maybe after the cell's end was read.
ACTIVITY = ("UncachedCompile", "CachedCompile", "ExecuteComputation", "ExecuteReplicated",
            "xla::_to_copy", "xla::_to_cpu")


def read_activity() -> tuple[int, ...]:
    value = _xlac()._xla_counter_value
    return tuple(value(name) or 0 for name in ACTIVITY)


def read_counters() -> dict[str, int]:
    """ACTIVITY's counters and every aten:: one (CPU fallbacks), by name."""
    xlac = _xlac()
    return {name: xlac._xla_counter_value(name) or 0 for name in xlac._xla_counter_names()
            if name in ACTIVITY or name.startswith("aten::")}


def _own_counts() -> dict[str, int]:
    """What the CPU simulation's own copies added to the counters (empty outside it)."""
    exchange = sys.modules.get("xla_magic.launcher.simulate.exchange")
    active = getattr(exchange, "_active", None) if exchange is not None else None
    return dict(active.own_counts) if active is not None else {}


def _seconds_since(names: tuple[str, ...], since: float, count: int) -> float:
    """The seconds that ``count`` samples of the timing metrics ``names`` posted since ``since`` (wall clock) add up to.

    torch_xla keeps only the latest samples of a metric (with their times);
    when more than it keeps came in, the total is scaled from those kept.
    """
    recent: list[float] = []
    for name in names:
        data = _xlac()._xla_metric_data(name)
        if data:
            recent += [value for stamp, value in data[2] if stamp >= since]
    seconds = sum(recent) / 1e9
    if count > len(recent) and recent:
        seconds *= count / len(recent)
    return seconds


def _transfers_total() -> int:
    data = _xlac()._xla_metric_data(TRANSFERS)
    return int(data[0]) if data else 0


class Reading:
    """The counters at one moment."""

    def __init__(self, activity: tuple[int, ...]) -> None:
        self.wall = time.time()
        self.activity = activity
        self.own = _own_counts()
        self.counters = read_counters()
        self.transfers = _transfers_total()

    @classmethod
    def now(cls, last: "Reading | None") -> "Reading":
        """The counters now: ``last`` itself while none of ACTIVITY moved since (nothing ran, so nothing else did)."""
        activity = read_activity()
        return last if last is not None and last.activity == activity else cls(activity)


# --- syncs at cell lines ------------------------------------------------------------------

_current: "Span | None" = None  # the process's open span, while any rank thread is in a cell


def _note_sync(depth: int = 2) -> None:
    span = _current
    if span is None:
        return
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:  # called from the top of a thread's stack
        return
    for _ in range(SYNC_FRAMES):
        if frame is None:
            return
        if frame.f_code.co_filename in span.cells:
            key = (frame.f_code.co_filename, frame.f_lineno)
            span.sync_lines[key] = span.sync_lines.get(key, 0) + 1
            return
        frame = frame.f_back


def _item(self: torch.Tensor) -> Any:
    # Code that dynamo compiles takes the first branch (is_compiling is a constant there), which
    # it knows as Tensor.item itself.
    if torch.compiler.is_compiling():
        return super(torch.Tensor, self).item()
    if _current is not None and self.device.type == "xla":
        _note_sync()
    return _TensorBase_item(self)


def _tolist(self: torch.Tensor) -> Any:
    if torch.compiler.is_compiling():
        return super(torch.Tensor, self).tolist()
    if _current is not None and self.device.type == "xla":
        _note_sync()
    return _TensorBase_tolist(self)


_TensorBase_item = torch._C.TensorBase.item
_TensorBase_tolist = torch._C.TensorBase.tolist
_hooked = False


def _hook_syncs() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        for name, hook in (("item", _item), ("tolist", _tolist)):
            original = getattr(torch.Tensor, name)
            if original is not getattr(torch._C.TensorBase, name):
                continue  # someone else's: leave it alone
            hook.__name__ = hook.__qualname__ = name
            hook.__doc__ = original.__doc__
            setattr(torch.Tensor, name, hook)


# --- one span: what XLA did while rank threads of this process were in a cell ---------------


class Span:
    """What XLA did while rank threads of this process were in a cell (one rank, but for the tpu path's threads)."""

    def __init__(self, analysis: str | None, seen: dict[Any, dict[str, Any]], cells: set[str],
                 last: Reading | None) -> None:
        self.analysis = analysis
        self.seen = seen
        self.cells = cells
        self.ranks: list[int] = []
        self.run: Any = None  # the kernel's run id of the cell
        self.active = 0
        self.sync_lines: dict[tuple[str, int], int] = {}
        self.start = Reading.now(last)
        self.end: Reading | None = None

    def account(self, filename: str) -> protocol.XlaAccount | None:
        """The span's account, as plain data for the kernel (protocol.XLA); None when XLA did nothing.

        A rank that sends none for a cell it finished did nothing on XLA in
        it: the common case costs the kernel nothing at all.
        """
        start = self.start
        if read_activity() == start.activity and not self.sync_lines:
            self.end = start
            return None
        # torch_xla.sync() runs the graph in the background: let what the cell started finish and count.
        _xlac()._xla_wait_device_ops(devices=[])
        end = self.end = Reading(read_activity())

        def grown(name: str) -> int:
            added_by_us = end.own.get(name, 0) - start.own.get(name, 0)
            return max(0, end.counters.get(name, 0) - start.counters.get(name, 0) - added_by_us)

        compiles = grown("UncachedCompile")
        executions = grown("ExecuteComputation") + grown("ExecuteReplicated")
        compile_seconds = _seconds_since((COMPILE_TIME,), start.wall, compiles) if compiles else 0.0
        execute_seconds = _seconds_since(EXECUTE_TIMES, start.wall, executions) if executions else 0.0
        own_transfers = end.own.get(TRANSFERS, 0) - start.own.get(TRANSFERS, 0)
        return {
            "ranks": sorted(self.ranks),
            "cell": filename,
            "analysis": "ours" if self.analysis is not None else "user",
            "compiles": compiles,
            "compile_seconds": compile_seconds,
            "cached": grown("CachedCompile"),
            "executions": executions,
            "execute_seconds": execute_seconds,
            "transfers": max(0, end.transfers - start.transfers - own_transfers),
            "scalar_reads": grown(SCALAR_READ),
            "fallbacks": {
                name: grown(name) for name in end.counters
                if name.startswith("aten::") and name != SCALAR_READ and grown(name)
            },
            "compilations": self._compilations(read_analysis(self.analysis), compiles) if compiles else [],
            "sync_lines": [
                {"cell": file, "line": line, "code": _code(file, line), "count": count}
                for (file, line), count in sorted(self.sync_lines.items(), key=lambda item: -item[1])
            ],
        }

    def _compilations(self, text: str, compiles: int) -> list[dict[str, Any]]:
        # The file may also hold what compiled between cells (a result moved to the CPU): the cell's are the last.
        blocks = parse_analysis(text)[-compiles:]
        seconds = _compile_samples(self.start.wall)
        if len(seconds) != len(blocks):
            seconds = [None] * len(blocks)
        compilations = []
        for block, duration in zip(blocks, seconds):
            frames = block["frames"]
            at = next((i for i, (_fn, file, _line) in enumerate(frames) if file in self.cells), None)
            where = frames[at][1:] if at is not None else None
            code = _code(*where) if where else ""
            # The calls between the cell's line and the compile (a library's own sync points):
            # one cell line may compile several kinds of graph, each on its own path.
            inner = tuple(f"{file}:{line}" for _fn, file, line in frames[:at])
            entry = {
                "cause": _cause(block),
                "hash": block["hash"],
                "inputs": block["inputs"],
                "input_bytes": block["input_bytes"],
                "seconds": duration,
                "cell": where[0] if where else None,
                "line": where[1] if where else None,
                "code": code,
                "path": inner,
                "earlier": None,
            }
            if code:
                earlier = self.seen.get((code, inner))
                if earlier is not None and earlier["run"] != self.run:
                    entry["earlier"] = earlier
            compilations.append(entry)
        for entry in compilations:
            if entry["code"]:
                self.seen[(entry["code"], entry["path"])] = {"run": self.run, **{key: entry[key] for key in
                                                                 ("cell", "line", "hash", "inputs", "input_bytes")}}
        return compilations


def _compile_samples(since: float) -> list[float]:
    data = _xlac()._xla_metric_data(COMPILE_TIME)
    return [value / 1e9 for stamp, value in data[2] if stamp >= since] if data else []


def _cause(block: dict[str, Any]) -> str:
    cause = block["cause"]
    files = [file for _fn, file, _line in block["frames"]]
    if any("xla_magic/launcher/simulate" in file for file in files):
        return "a collective (simulated on the CPU) needed the tensor's value"
    if cause.startswith("most likely user code trying to access tensor value"):
        return "the code read a tensor's value before the step ended"
    return cause


def _code(filename: str, line: int) -> str:
    """The cell's line, without its comment."""
    import io
    import linecache
    import tokenize

    text = linecache.getline(filename, line).strip()
    try:
        comments = [token for token in tokenize.generate_tokens(io.StringIO(text).readline)
                    if token.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):  # a line that only parses with its neighbours
        return text
    return text[: comments[0].start[1]].rstrip() if comments else text


class Accountant:
    """This process's accounts: one open span at a time, shared by its rank threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.analysis = claim_analysis()
        # (a line's code, the path to the compile) -> its last compilation, across cells
        self.seen: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
        self.cells: set[str] = set()  # every cell this process ran: functions they defined still run
        self.span: Span | None = None
        self.last: Reading | None = None  # the counters at the last span's end
        _hook_syncs()

    def begin(self, rank: int, filename: str, run: Any = None) -> None:
        global _current
        with self.lock:
            self.cells.add(filename)
            if self.span is None:
                self.span = Span(self.analysis, self.seen, self.cells, self.last)
                self.span.run = run
                _current = self.span
            self.span.ranks.append(rank)
            self.span.active += 1

    def end(self, filename: str) -> protocol.XlaAccount | None:
        """The account, for the last rank thread to leave the span; None for the others, and when XLA did nothing."""
        global _current
        with self.lock:
            span = self.span
            if span is None:
                return None
            span.active -= 1
            if span.active:
                return None
            self.span = _current = None
            account = span.account(filename)
            self.last = span.end
            return account


_accountant: Accountant | None = None
_accountant_pid: int | None = None
_accountant_lock = threading.Lock()


def accountant() -> Accountant:
    """This process's accountant, one for all its rank threads (made anew in a forked child)."""
    global _accountant, _accountant_pid
    if _accountant is not None and _accountant_pid == os.getpid():
        return _accountant
    with _accountant_lock:
        if _accountant is None or _accountant_pid != os.getpid():
            _accountant, _accountant_pid = Accountant(), os.getpid()
        return _accountant
