"""What every rank needs to run a cell and report on it: its sockets, code, results, errors, memory. Runs in a rank.

A rank is a process of its own on the cpu backend. On the tpu launch path
every rank is a thread of torch_xla's per-device thread pool: alone in its
process on TPU v4 and later, two to a process on v2/v3, all in one process
on CPU threads. Nothing here assumes it owns the process.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import pickle
import socket
import threading
import traceback
import types
from dataclasses import dataclass
from typing import Any

import torch

from xla_magic.wire import protocol, transport
from xla_magic.launcher import spmd


@dataclass
class RankSockets:
    events: socket.socket
    out: socket.socket
    err: socket.socket
    stacks: socket.socket  # the sampler's (stacks.py): asked where the rank is, it answers here

    def all(self) -> list[socket.socket]:
        return [self.events, self.out, self.err, self.stacks]


class _ResultPickler(transport.SharedMemoryPickler):
    """Moves XLA tensors to the CPU as it meets them, sharded ones whole; large ones go to shared memory."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "xla":
            on_cpu = spmd.whole_on_cpu(obj)
            reduced = super().reducer_override(on_cpu)
            return on_cpu.__reduce_ex__(pickle.HIGHEST_PROTOCOL) if reduced is NotImplemented else reduced
        return super().reducer_override(obj)


def dump_result(value: Any, segments: transport.SegmentWriter | None = None) -> bytes:
    """Pickle a result; with ``segments``, large tensors and arrays go to shared memory."""
    import io

    buffer = io.BytesIO()
    _ResultPickler(buffer, segments, transport.RETURN).dump(value)
    return buffer.getvalue()


class ResultSegments:
    """Where a rank writes its large results: new segments under the kernel's results prefix, or lent ones."""

    def __init__(self, rank: int) -> None:
        self.tag = f"r{rank}"  # the kernel lends a segment back to the rank whose tag it has
        self._writer: transport.SegmentWriter | None = None

    def writer(self, prefix: str | None) -> transport.SegmentWriter | None:
        """The writer for the kernel's results prefix (the same for the ranks' life)."""
        if prefix is None:
            return None
        if self._writer is None or self._writer.prefix != prefix:
            self.release()
            self._writer = transport.SegmentWriter(prefix, self.tag)
        return self._writer

    def lend(self, fields: dict[str, Any], channel: protocol.Channel) -> None:
        """LEND: segments of dropped results that the next request's results may be written over."""
        writer = self.writer(fields["results_to"])
        writer.release()
        writer.lent = dict(zip(fields["numbers"], channel.take_fds(len(fields["numbers"]))))

    def release(self) -> None:
        """Close what was lent and not written over: done before every reply."""
        if self._writer is not None:
            self._writer.release()


# Results of these exact types are pickled with plain pickle (no cloudpickle
# Pickler to build): the common case of a cell that returns a number.
_PLAIN_RESULTS = frozenset({int, float, bool, str, bytes, complex, type(None)})


def result_event(value: Any, segments: transport.SegmentWriter | None = None) -> tuple[str, dict[str, Any]]:
    """The RESULT event carrying ``value``, or the ERROR that says why it cannot travel."""
    try:
        if type(value) in _PLAIN_RESULTS:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            data = dump_result(value, segments)
    except Exception as exc:
        return protocol.ERROR, {
            "type": type(exc).__name__,
            "message": (
                f"the result ({type(value).__module__}.{type(value).__qualname__}) "
                f"could not be sent back: {exc}. Return something picklable, "
                f"such as a tensor, a number or a dict of them."
            ),
            "traceback": "",
        }
    return protocol.RESULT, {"value": data, "empty": False}


def register_source(source: str, filename: str) -> None:
    """Let tracebacks show the cell's own lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)


def bind_rank_names(namespace: dict[str, Any], rank_names: dict[str, Any]) -> None:
    """Give notebook functions that were shipped by value the rank's names too.

    cloudpickle rebuilds each function with a small globals dict of its own;
    adding ``rank``, ``device`` ... there lets a notebook helper use them just
    like code written in the cell.
    """
    seen: set[int] = set()
    for value in list(namespace.values()):
        functions: list[types.FunctionType] = []
        if isinstance(value, types.FunctionType):
            functions.append(value)
        elif isinstance(value, type):
            functions.extend(v for v in vars(value).values() if isinstance(v, types.FunctionType))
        for function in functions:
            globals_dict = function.__globals__
            if id(globals_dict) in seen or globals_dict is vars(builtins):
                continue
            if function.__module__ in ("__main__", None):
                seen.add(id(globals_dict))
                for name, rank_value in rank_names.items():
                    globals_dict.setdefault(name, rank_value)


def device_memory(device: Any) -> dict[str, int] | None:
    """The runtime's memory figures for ``device``; None where it reports none.

    TPU runtimes report ``bytes_used``, ``bytes_limit`` and ``peak_bytes_used``;
    the CPU runtime answers UNIMPLEMENTED.
    """
    if device is None:
        return None
    try:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(device)
    except Exception:  # RuntimeError (UNIMPLEMENTED) on CPU; anything from other builds
        return None
    figures = {key: int(value) for key, value in dict(info).items() if isinstance(value, (int, float))}
    return figures or None


class MemoryReporter:
    """Sends the device's memory in STATUS events while a cell runs.

    Made once per rank, where the runtime (or the simulation) reports memory
    at all: one thread for the rank's life takes a sample every INTERVAL
    while a cell runs, so a cell pays no thread of its own. Nothing wakes it
    at a cell's start or end: in an 8-rank pool on 2 cores those two wake-ups
    a rank made a trivial cell measurably slower. ``stop`` returns the last
    sample (the cell's peak), which the rank's DONE carries; no sample goes
    after it.
    """

    INTERVAL = 2.0

    def __init__(self, channel: protocol.Channel, device: Any) -> None:
        self.channel = channel
        self.device = device
        self._lock = threading.Lock()
        self._running = threading.Event()  # set while a cell runs
        self._thread: threading.Thread | None = None
        self._peak_before = self._cell_peak = 0

    def start(self) -> None:
        peak_before = (device_memory(self.device) or {}).get("peak_bytes_used", 0)
        with self._lock:
            self._peak_before, self._cell_peak = peak_before, 0
            self._running.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._sample, name="xla_magic-memory", daemon=True)
            self._thread.start()

    def stop(self) -> dict[str, int] | None:
        """The cell's last sample (its peak), for the rank's DONE to carry: one message fewer a cell."""
        with self._lock:
            self._running.clear()
        return self._send(last=True)

    def _sample(self) -> None:
        ticks = threading.Event()  # never set: a wait of INTERVAL
        while True:
            ticks.wait(self.INTERVAL)
            if self._running.is_set():
                self._send()

    def _send(self, last: bool = False) -> dict[str, int] | None:
        """A sample, sent as STATUS while the cell runs; ``last``: returned instead (the cell is over)."""
        memory = device_memory(self.device)
        if memory is None:
            return None
        with self._lock:
            # The cell's own peak: the runtime's cannot be reset, so the samples' highest, or the runtime's
            # peak where it rose during the cell (then it was reached in this cell).
            self._cell_peak = max(self._cell_peak, memory.get("bytes_used", 0))
            if memory.get("peak_bytes_used", 0) > self._peak_before:
                self._cell_peak = max(self._cell_peak, memory["peak_bytes_used"])
            memory["cell_peak_bytes"] = self._cell_peak
            if last:
                return memory
            if not self._running.is_set():
                return None  # the cell ended while this sample was read: its last one is the rank's own
            try:
                self.channel.send(protocol.STATUS, state="running", memory=memory)
            except OSError:  # the kernel stopped listening; the run is over
                self._running.clear()
        return None


def compile_cell(source: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """The cell's code, without its last expression, and that expression (None if it ends otherwise)."""
    tree = ast.parse(source, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last


# Where input() and pdb ask the kernel (debugger.py): the machinery under the cell's call, not the user's frames.
_ASKING_FILE = os.path.join("xla_magic", "launcher", "debugger.py")
# What xla_magic puts under a sync (its account, the simulation's memory count): not the user's frames either.
_UNDER_SYNC = (_ASKING_FILE, os.path.join("xla_magic", "launcher", "xla_account.py"),
               os.path.join("xla_magic", "launcher", "simulate", "memory.py"))


def format_error(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the cell on, like IPython's (and without our input() underneath)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is None:
        tb = exc.__traceback__
    error = traceback.TracebackException(type(exc), exc, tb, compact=True)
    error.stack = traceback.StackSummary.from_list([frame for frame in error.stack
                                                    if not frame.filename.endswith(_UNDER_SYNC)])
    return "".join(error.format())


def exception_message(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``__str__`` itself raises."""
    try:
        return str(exc)
    except Exception as broken:
        return f"<str() of this {type(exc).__name__} failed: {type(broken).__name__}: {broken}>"
