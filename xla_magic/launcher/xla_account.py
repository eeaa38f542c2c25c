"""What XLA did during a cell, counted where it happened. Runs in a rank (process or thread).

The account of one cell is plain data (see ``Span.account``): compilations
with their time and cause, executions, cache hits, graphs loaded from the
persistent compilation cache (compile_cache.py) with their time, and those
it held but could not load, device-to-host transfers and CPU fallbacks. Counts are deltas of torch_xla's own counters
(``torch_xla._XLAC``, what ``torch_xla.debug.metrics`` reads) between the
cell's start and end. Causes come from torch_xla's compilation analysis
(``PT_XLA_DEBUG_LEVEL=1``, xla_analysis.py): one block per compilation
naming its cause, the graph's hash, the Python frames that triggered it
and the graph's memory; a user who set the variables keeps torch_xla's own
output and the account has no causes.

Shapes: where a sync (``torch_xla.sync``, which ``xm.mark_step`` calls,
``.item()``, ``.tolist()``) compiled, the XLA tensors that the cell's frame
names are read (dtype and shape: metadata, nothing syncs) and given to the
compilations at that line. Shapes made on the device count: the graph's
outputs are what the cell holds. Reading the graph's own text instead costs
every step (``XLA_SAVE_TENSORS_FILE`` writes each sync's graph) or doubles
the compile (``XLA_FLAGS=--xla_dump_to`` on XLA:CPU, measured), so the
shapes come from the tensors, after the compile, and only then.

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
import sys
import threading
import time
from typing import Any

import torch

from xla_magic.wire import protocol
from xla_magic.launcher.xla_analysis import claim_analysis, parse_analysis, read_analysis

SYNC_FRAMES = 12  # how far up from .item() to look for a cell's line
# The op torch_xla counts as aten::_local_scalar_dense is .item() and friends: a sync, not a fallback.
SCALAR_READ = "aten::_local_scalar_dense"
TRANSFERS = "TransferFromDeviceTime"
COMPILE_TIME = "CompileTime"
EXECUTE_TIMES = ("ExecuteTime", "ExecuteReplicatedTime")
SHAPES_KEPT = 16  # tensors named per compilation (the cell's scope can hold many)
# XLA's short names of dtypes, as an HLO text writes them
_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "s64", "int32": "s32",
           "int16": "s16", "int8": "s8", "uint8": "u8", "bool": "pred", "complex64": "c64", "complex128": "c128"}


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
# The persistent cache's (torch_xla/csrc/runtime/cache.h): a graph loaded from it also counts as CachedCompile,
# one it could not load as UncachedCompile (it compiles), so ACTIVITY moves with each.
LOADED, LOAD_FAILED, LOAD_TIME = "PersistentCacheHit", "PersistentCacheDeserializeFailure", "PersistentCacheLoad"


_counter_value: Any = None  # torch_xla._XLAC._xla_counter_value, once bound


def read_activity() -> tuple[int | None, ...]:
    """ACTIVITY's counters (None for one torch_xla has not made yet): a few microseconds, twice a cell."""
    global _counter_value
    if _counter_value is None:
        _counter_value = _xlac()._xla_counter_value
    return tuple(map(_counter_value, ACTIVITY))


def read_counters() -> dict[str, int]:
    """ACTIVITY's counters and every aten:: one (CPU fallbacks), by name."""
    xlac = _xlac()
    return {name: xlac._xla_counter_value(name) or 0 for name in xlac._xla_counter_names()
            if name in ACTIVITY or name in (LOADED, LOAD_FAILED) or name.startswith("aten::")}


def _own_counts() -> dict[str, int]:
    """What the CPU simulation's own copies and the logger's reads added to the counters (empty outside them)."""
    exchange = sys.modules.get("xla_magic.launcher.simulate.exchange")
    active = getattr(exchange, "_active", None) if exchange is not None else None
    counts = dict(active.own_counts) if active is not None else {}
    metrics = sys.modules.get("xla_magic.launcher.metrics")  # the logged values it read (log(): metrics.py)
    if metrics is not None and metrics.own_transfers:
        counts[TRANSFERS] = counts.get(TRANSFERS, 0) + metrics.own_transfers
    return counts


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


def _cell_frame(span: "Span", depth: int) -> Any:
    """The innermost frame, within SYNC_FRAMES of ``depth``, that runs one of the cells' code; None if none does."""
    try:
        frame: Any = sys._getframe(depth + 1)
    except ValueError:  # called from the top of a thread's stack
        return None
    for _ in range(SYNC_FRAMES):
        if frame is None or frame.f_code.co_filename in span.cells:
            return frame
        frame = frame.f_back
    return None


def _uncached_compiles() -> int:
    return _xlac()._xla_counter_value("UncachedCompile") or 0


def _shape(tensor: torch.Tensor) -> str:
    """A tensor's type as an HLO text writes it: f32[8,16]."""
    dtype = str(tensor.dtype).rpartition(".")[2]
    return f"{_DTYPES.get(dtype, dtype)}[{','.join(str(size) for size in tensor.shape)}]"


def _scope_shapes(frame: Any) -> dict[str, str]:
    """The XLA tensors the cell's frame names, by name, with their shapes (metadata only: nothing syncs)."""
    shapes: dict[str, str] = {}
    for name, value in list(frame.f_locals.items()):
        if isinstance(value, torch.Tensor) and not name.startswith("_") and value.device.type == "xla":
            shapes[name] = _shape(value)
            if len(shapes) == SHAPES_KEPT:
                break
    return shapes


def _synced(original: Any, transfer: bool, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)``, called by a hook from user code: a sync. Its cell line is noted (a
    device-to-host ``transfer``'s, counted) and, when it compiled, the shapes of the tensors the cell's
    frame names (read after the compile: a step that compiles nothing pays two counter reads)."""
    span = _current
    frame = _cell_frame(span, 2) if span is not None else None
    if frame is None:
        return original(*args, **kwargs)
    key = (frame.f_code.co_filename, frame.f_lineno)
    if transfer:
        span.sync_lines[key] = span.sync_lines.get(key, 0) + 1
    before = _uncached_compiles()
    try:
        return original(*args, **kwargs)
    finally:
        compiled = _uncached_compiles() - before
        if compiled > 0:
            span.shapes.append((key, compiled, _scope_shapes(frame)))


def _item(self: torch.Tensor) -> Any:
    # Code that dynamo compiles takes the first branch (is_compiling is a constant there), which
    # it knows as Tensor.item itself.
    if torch.compiler.is_compiling():
        return super(torch.Tensor, self).item()
    if _current is not None and self.device.type == "xla":
        return _synced(_TensorBase_item, True, self)
    return _TensorBase_item(self)


def _tolist(self: torch.Tensor) -> Any:
    if torch.compiler.is_compiling():
        return super(torch.Tensor, self).tolist()
    if _current is not None and self.device.type == "xla":
        return _synced(_TensorBase_tolist, True, self)
    return _TensorBase_tolist(self)


def _sync_hook(original: Any) -> Any:
    def sync(*args: Any, **kwargs: Any) -> Any:
        if _current is None:
            return original(*args, **kwargs)
        return _synced(original, False, *args, **kwargs)

    sync.__name__ = sync.__qualname__ = original.__name__
    sync.__doc__ = original.__doc__
    sync.__wrapped__ = original  # type: ignore[attr-defined]
    return sync


_TensorBase_item = torch._C.TensorBase.item
_TensorBase_tolist = torch._C.TensorBase.tolist
_hooked = False
_sync_hooked = False


def _hook_syncs() -> None:
    """``.item()``/``.tolist()`` of XLA tensors, and ``torch_xla.sync`` (``xm.mark_step`` calls it) once torch_xla
    is imported, note their cell line and the shapes of what compiled (torch.compile sees the original methods)."""
    global _hooked, _sync_hooked
    if not _hooked:
        _hooked = True
        for name, hook in (("item", _item), ("tolist", _tolist)):
            original = getattr(torch.Tensor, name)
            if original is not getattr(torch._C.TensorBase, name):
                continue  # someone else's: leave it alone
            hook.__name__ = hook.__qualname__ = name
            hook.__doc__ = original.__doc__
            setattr(torch.Tensor, name, hook)
    if not _sync_hooked and "torch_xla.torch_xla" in sys.modules:
        _sync_hooked = True
        package, module = sys.modules["torch_xla"], sys.modules["torch_xla.torch_xla"]
        original = getattr(module, "sync", None)
        if original is not None and getattr(package, "sync", None) is original:
            hooked = _sync_hook(original)
            module.sync = package.sync = hooked  # torch_xla.step() and xm.mark_step() look it up there


# --- one span: what XLA did while rank threads of this process were in a cell ---------------


class Span:
    """What XLA did while rank threads of this process were in a cell (one rank, but for the tpu path's threads)."""

    # Made for every cell, on its path: slots are the cheapest object to make (a cell of a woken rank pays
    # each step cold).
    __slots__ = ("analysis", "seen", "cells", "ranks", "run", "active", "sync_lines", "shapes", "start", "end")

    def __init__(self, analysis: str | None, seen: dict[Any, dict[str, Any]], cells: set[str],
                 start: Reading, run: Any) -> None:
        self.analysis = analysis
        self.seen = seen
        self.cells = cells
        self.ranks: list[int] = []
        self.run = run  # the kernel's run id of the cell
        self.active = 0
        self.sync_lines: dict[tuple[str, int], int] = {}  # .item() and .tolist() calls, by cell line
        self.shapes: list[tuple[tuple[str, int], int, dict[str, str]]] = []  # syncs that compiled: line, how many, shapes
        self.start = start
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
        loaded, load_failures = grown(LOADED), grown(LOAD_FAILED)
        tried = loaded + load_failures  # each timed, whether it loaded or not
        return {
            "ranks": sorted(self.ranks),
            "cell": filename,
            "analysis": "ours" if self.analysis is not None else "user",
            "compiles": compiles,
            "compile_seconds": compile_seconds,
            "cached": max(0, grown("CachedCompile") - loaded),  # from memory; ``loaded`` came from disk
            "loaded": loaded,
            "load_seconds": _seconds_since((LOAD_TIME,), start.wall, tried) if tried else 0.0,
            "load_failures": load_failures,
            # Its folder is keyed by torch_xla's and the platform's builds, so a process that fails to load what
            # it holds and never loaded any graph cannot load here at all (XLA:CPU; a TPU with torch_xla 2.8 and
            # 2.9: pytorch/xla#9094), which is not a stale or damaged cache
            "cannot_load": bool(load_failures) and not end.counters.get(LOADED, 0),
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
        shapes: dict[tuple[str, int], list[dict[str, str]]] = {}  # what the syncs that compiled saw, by line
        for key, count, named in self.shapes:
            shapes.setdefault(key, []).extend([named] * count)
        compilations = []
        for block, duration in zip(blocks, seconds):
            frames = block["frames"]
            at = next((i for i, (_fn, file, _line) in enumerate(frames) if file in self.cells), None)
            where = frames[at][1:] if at is not None else None
            seen_there = shapes.get(where) if where else None
            code = _code(*where) if where else ""
            # The calls between the cell's line and the compile (a library's own sync points):
            # one cell line may compile several kinds of graph, each on its own path.
            inner = tuple(f"{file}:{line}" for _fn, file, line in frames[:at])
            entry = {
                "cause": _cause(block),
                "hash": block["hash"],
                "inputs": block["inputs"],
                "input_bytes": block["input_bytes"],
                "memory": block["memory"],
                "shapes": seen_there.pop(0) if seen_there else None,
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
                                                                 ("cell", "line", "hash", "inputs", "input_bytes", "shapes")}}
        return compilations


def _platform() -> str:
    """The PJRT platform's version (its name, on XLA:CPU: cpu)."""
    version = getattr(_xlac(), "_xla_get_platform_version", None)
    return str(version()).lower() if version is not None else ""


def _compile_samples(since: float) -> list[float]:
    data = _xlac()._xla_metric_data(COMPILE_TIME)
    return [value / 1e9 for stamp, value in data[2] if stamp >= since] if data else []


_SIMULATED_COLLECTIVES = ("collectives.py", "exchange.py", "traced.py")  # not memory.py, which every sync passes


def _cause(block: dict[str, Any]) -> str:
    cause = block["cause"]
    files = [file for _fn, file, _line in block["frames"]]
    if any(f"xla_magic/launcher/simulate/{part}" in file for file in files for part in _SIMULATED_COLLECTIVES):
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
        self.last: Reading | None = None  # the counters at the last span's end, or after the last reply
        self.settled = False  # ``last`` was read after this process's last reply went out, no cell since
        _hook_syncs()

    def begin(self, rank: int, filename: str, run: Any = None) -> None:
        global _current
        if not _sync_hooked:
            _hook_syncs()
        with self.lock:
            self.cells.add(filename)
            span = self.span
            if span is None:
                start = self.last if self.settled and self.last is not None else Reading.now(self.last)
                self.settled = False
                span = self.span = _current = Span(self.analysis, self.seen, self.cells, start, run)
            span.ranks.append(rank)
            span.active += 1

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

    def settle(self) -> None:
        """Read the counters for the next cell's start now, after a reply went out, while the rank is idle.

        A rank woken for a cell pays every read cold (a woken process's
        caches are the other ranks'): reading at the cell's start cost
        10-16 µs of the rank's 45-70 µs answer to a trivial cell, measured
        in the rank, against 3-7 µs warm. Read here, after the reply (and
        after what a push, a pull or a result moved to the CPU), the read
        is off the request's path. What a thread of the user's does on XLA
        between a reply and the next cell counts in that cell.
        """
        with self.lock:
            if self.span is None:
                self.settled = False
                self.last = Reading.now(self.last)
                self.settled = True


_accountant: Accountant | None = None
_accountant_pid: int | None = None
_accountant_lock = threading.Lock()


def settle() -> None:
    """After any reply of a rank process that keeps accounts: the next cell's start read (Accountant.settle).
    Never raises: the reply is out, and nothing here may cost the rank its next request."""
    accountant_now = _accountant
    if accountant_now is None or _accountant_pid != os.getpid():
        return
    try:
        accountant_now.settle()
    except Exception:  # the next cell reads at its start instead
        pass


def accountant() -> Accountant:
    """This process's accountant, one for all its rank threads (made anew in a forked child)."""
    global _accountant, _accountant_pid
    if _accountant is not None and _accountant_pid == os.getpid():
        return _accountant
    with _accountant_lock:
        if _accountant is None or _accountant_pid != os.getpid():
            _accountant, _accountant_pid = Accountant(), os.getpid()
        return _accountant
