"""Where a rank is: its stack sampler. Runs in a rank (process or thread).

A thread of its own per rank sleeps on a blocking read of the rank's stacks
socket (no polling: an idle sampler costs nothing). Asked (protocol.STACKS),
it reads the frames of the thread that serves the rank's cells with
``sys._current_frames()``, which needs nothing from that thread, so it
answers while the cell is blocked in native code that releases the GIL: a
gloo wait, XLA execution, ``time.sleep``, a blocking read. A C call that
holds the GIL stops it too; the kernel then names the rank as not answering
(and reads it from outside with py-spy where installed).

The answer is plain data: each frame as (file, line, function, code, is a
cell line), innermost first, with the cell's frames at their cell line
numbers (a cell is compiled under ``<xla_spawn cell N>``, counted from the
first line under the magic, as the XLA report counts them), and what the
innermost call is doing (``doing``): a collective and its tag, a sync
(compile or device execution), a host transfer, a sleep, or Python. Other
threads that run cell code (left running by an earlier cell) come too.
"""

from __future__ import annotations

import ast
import dis
import linecache
import os
import socket
import sys
import threading
import types
from typing import Any, Callable

from xla_magic.wire import protocol

CELL_FILE = "<xla_spawn cell"
OFF_SWITCH = "XLA_MAGIC_STACKS"  # "0" in the kernel's environment: ranks started then have no sampler
FRAMES_KEPT = 80  # innermost frames kept per thread; a deeper stack loses its outer ones

# The innermost function a rank waits in -> what it is doing there, by the module it is in.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute", "send", "recv",
    "rendezvous", "xla_rendezvous", "mesh_reduce", "barrier", "broadcast", "reduce", "gather", "scatter",
    "all_gather_object", "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor",
    "all_to_all_single", "monitored_barrier", "wait", "collective_broadcast",
})
SYNCS = frozenset({"mark_step", "sync", "wait_device_ops", "_xla_sync_multi", "_run_step_closures"})
TRANSFERS = frozenset({"item", "cpu", "tolist", "numpy", "_to_cpu", "to_cpu", "__repr__", "__str__", "__format__"})
SLEEPS = frozenset({"sleep"})
COLLECTIVE_MODULES = ("xla_magic/launcher/simulate/", "torch_xla/core/xla_model.py", "torch/distributed/",
                      "torch_xla/distributed/", "torch_xla/core/functions.py")
ALIASES = (("xla_magic/launcher/simulate/", "xm."), ("torch_xla/core/xla_model.py", "xm."),
           ("torch/distributed/", "dist."), ("torch_xla/runtime.py", "xr."), ("torch_xla/", "torch_xla."),
           ("time", "time."))

_serving: set[int] = set()  # the threads that serve cells in this process (rank threads share one)


class Sampler:
    """One rank's sampler thread: answers STACKS on ``sock`` with where ``thread`` is."""

    def __init__(self, rank: int, sock: socket.socket, thread: int, phase: Callable[[], str],
                 namespace: Callable[[], dict[str, Any]] = dict) -> None:
        self.rank = rank
        self.channel = protocol.Channel(sock)
        self.thread = thread
        self.phase = phase  # what the rank is at: setup, idle, cell, closing
        self.namespace = namespace  # the rank's names, for what holds its device memory (MEMORY)
        _serving.add(thread)
        self._thread = threading.Thread(target=self._run, name=f"xla_magic stacks r{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                request = self.channel.recv()
            except OSError:
                return
            if request.kind == protocol.MEMORY:
                self._memory(request.fields)
                continue
            if request.kind != protocol.STACKS:
                return  # closed, broken, or not for us: the rank is going
            try:
                answer = sample(self.thread, self.phase(), everything=bool(request.fields.get("all")),
                                with_locals=bool(request.fields.get("locals")))
            except Exception as exc:  # never lose the sampler to a frame it could not read
                answer = {"phase": "unknown", "frames": [], "doing": {"kind": "unknown", "call": repr(exc)}}
            try:
                self.channel.send(protocol.STACKS, probe=request.fields.get("probe"), rank=self.rank,
                                  pid=os.getpid(), **answer)
            except OSError:
                return


    def _memory(self, fields: dict[str, Any]) -> None:
        """What holds the device's memory (launcher/memory.py), read while the cell runs or between cells."""
        from xla_magic.launcher import memory

        try:
            full = bool(fields.get("full", True))  # the rank shown in full; the others send their totals
            answer = memory.sample(self.namespace(), sys._current_frames().get(self.thread), everything=full,
                                   limit=200 if full else 0)
        except Exception as exc:  # a name that changed under the walk, a tensor torch_xla cannot read
            answer = {"unreadable": f"{type(exc).__name__}: {exc}"}
        try:
            self.channel.send(protocol.MEMORY, probe=fields.get("probe"), rank=self.rank, **answer)
        except OSError:
            pass


def sample(thread: int, phase: str, everything: bool = False, with_locals: bool = False) -> dict[str, Any]:
    """Where ``thread`` is (and the other threads running cell code), as plain data.

    ``with_locals``: also each cell frame's local names with short reprs (``locals``: frame index -> pairs).
    """
    frames = sys._current_frames()
    mine = frames.get(thread)
    stack = _frames(mine) if mine is not None else []
    answer: dict[str, Any] = {"phase": phase, "frames": stack, "doing": doing(stack, mine)}
    if with_locals:
        answer["locals"] = cell_locals(mine)
    names = {t.ident: t.name for t in threading.enumerate()}
    others = []
    for ident, frame in frames.items():
        if ident == thread or ident in _serving or ident == threading.get_ident():
            continue
        other = _frames(frame)
        if everything or any(f[4] for f in other):
            others.append({"name": names.get(ident, str(ident)), "frames": other, "doing": doing(other, frame)})
    answer["threads"] = others
    return answer


LOCALS_KEPT = 24  # names per frame
REPR_CHARS = 60  # characters per value


def cell_locals(frame: types.FrameType | None) -> dict[int, list[tuple[str, str]]]:
    """Each cell frame's local names (a module frame's: the names its code uses) with short reprs, by frame index.

    Read from another thread while the cell runs, so nothing here runs the
    cell's code: no ``repr`` but of plain values; tensors and arrays as their
    dtype and shape (never their values, which would wait for the device).
    """
    found: dict[int, list[tuple[str, str]]] = {}
    index = 0
    while frame is not None and index < FRAMES_KEPT:
        code = frame.f_code
        if code.co_filename.startswith(CELL_FILE):
            try:
                names = dict(frame.f_locals)
            except Exception:
                names = {}
            wanted = _cell_names(code) if code.co_name == "<module>" else code.co_varnames + code.co_cellvars
            pairs = [(name, short_repr(names[name])) for name in dict.fromkeys(wanted)
                     if name in names and not name.startswith("__") and not _is_definition(names[name])]
            found[index] = pairs[:LOCALS_KEPT]
        frame = frame.f_back
        index += 1
    return found


_names_of_cells: dict[str, tuple[str, ...]] = {}


def _cell_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a cell's source uses, in order (its last expression runs as code of its own, which names fewer)."""
    filename = code.co_filename
    if filename not in _names_of_cells:
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
            found = tuple(dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name)))
        except (SyntaxError, ValueError):  # IPython syntax: what this code names
            found = ()
        if len(_names_of_cells) > 64:
            _names_of_cells.clear()
        _names_of_cells[filename] = found
    return _names_of_cells[filename] or code.co_names


def _is_definition(value: Any) -> bool:
    return isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type))


_PLAIN = (int, float, bool, complex, str, bytes, type(None))


def short_repr(value: Any, depth: int = 0) -> str:
    """A bounded repr that runs no user code: plain values and their containers; tensors by dtype and shape."""
    text = _short(value, depth)
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


def _short(value: Any, depth: int) -> str:
    kind = type(value)
    if kind in _PLAIN:
        return repr(value) if kind not in (str, bytes) or len(value) <= REPR_CHARS else repr(value[:REPR_CHARS]) + "..."
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.device):
        return repr(value)
    if torch is not None and isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).removeprefix('torch.')}, {list(value.shape)}, {value.device})"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return f"ndarray({value.dtype}, {list(value.shape)})"
    if kind in (list, tuple, set, dict) and depth < 2:
        items = list(value.items())[:6] if kind is dict else list(value)[:6]
        parts = [f"{_short(k, depth + 1)}: {_short(v, depth + 1)}" for k, v in items] if kind is dict else \
                [_short(item, depth + 1) for item in items]
        more = ", ..." if len(value) > 6 else ""
        open_, close = {list: "[]", tuple: "()", set: "{}", dict: "{}"}[kind]
        return f"{open_}{', '.join(parts)}{more}{close}"
    return f"<{kind.__module__}.{kind.__qualname__}>" if kind.__module__ != "builtins" else f"<{kind.__qualname__}>"


def _frames(frame: types.FrameType | None) -> list[tuple[str, int, str, str, bool]]:
    found = []
    while frame is not None and len(found) < FRAMES_KEPT:
        code = frame.f_code
        line = frame.f_lineno or 0
        found.append((code.co_filename, line, code.co_name, linecache.getline(code.co_filename, line).strip(),
                      code.co_filename.startswith(CELL_FILE)))
        frame = frame.f_back
    return found


def doing(stack: list[tuple[str, int, str, str, bool]], innermost: types.FrameType | None) -> dict[str, Any]:
    """What the innermost call is: kind (collective, sync, transfer, sleep, python), call, the cell line."""
    line = next((f[1] for f in stack if f[4]), None)
    cell_at = next((i for i, f in enumerate(stack) if f[4]), None)
    inside = stack[:cell_at] if cell_at is not None else stack  # the library frames below the cell's line
    # Outermost first: the collective the cell called, not the helper it waits in.
    for i in range(len(inside) - 1, -1, -1):
        file, _line, function, _code, _cell = inside[i]
        if function in COLLECTIVES and any(part in file for part in COLLECTIVE_MODULES):
            call = _alias(file) + function
            exchange = _exchange_call(innermost)
            if function in ("rendezvous", "xla_rendezvous"):
                tag = _local(innermost, i, "tag")
                call = f"xm.rendezvous({tag!r})" if isinstance(tag, str) else call
            elif exchange and function not in ("wait", "barrier"):
                call = exchange
            return {"kind": "collective", "call": call, "line": line}
    for i in range(len(inside) - 1, -1, -1):
        file, _line, function, _code, _cell = inside[i]
        if function in SYNCS and "torch_xla" in file:
            return {"kind": "sync", "call": _alias(file) + function, "line": line}
    if inside:
        file, _line, function, _code, _cell = inside[-1]  # the function the cell's line called
        kind = "sleep" if function in SLEEPS else "transfer" if function in TRANSFERS and "torch" in file else "python"
        return {"kind": kind, "call": _alias(file) + function, "line": line}
    callee = _callee(innermost)  # a C function called from the cell's own line: no frame of its own
    if callee in SLEEPS:
        return {"kind": "sleep", "call": f"time.{callee}", "line": line}
    if callee in TRANSFERS:
        return {"kind": "transfer", "call": f".{callee}()", "line": line}
    if callee in COLLECTIVES:
        return {"kind": "collective", "call": callee, "line": line}
    return {"kind": "python", "call": None, "line": line}  # a name read from bytecode is a guess: none


def _alias(file: str) -> str:
    for part, alias in ALIASES:
        if part in file:
            return alias
    return ""


def _nth(frame: types.FrameType | None, n: int) -> types.FrameType | None:
    for _ in range(n):
        frame = frame.f_back if frame is not None else None
    return frame


def _local(innermost: types.FrameType | None, n: int, name: str) -> Any:
    frame = _nth(innermost, n)
    try:
        return frame.f_locals.get(name) if frame is not None else None
    except Exception:
        return None


def _exchange_call(innermost: types.FrameType | None) -> str | None:
    """The simulation names each collective it runs (exchange.exchange's ``call``): the precise name."""
    frame = innermost
    while frame is not None:
        if frame.f_code.co_name == "exchange" and "simulate" in frame.f_code.co_filename:
            try:
                call = frame.f_locals.get("call")
            except Exception:
                return None
            return call if isinstance(call, str) else None
        frame = frame.f_back
    return None


def _callee(frame: types.FrameType | None) -> str | None:
    """The name of what ``frame`` is calling now, read from its bytecode (a C function leaves no frame)."""
    if frame is None:
        return None
    try:
        names = []
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset > frame.f_lasti:
                break
            positions = getattr(instruction, "positions", None)
            if positions is not None and positions.lineno != frame.f_lineno:
                continue  # only what the current line calls
            if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME"):
                names.append(instruction.argval)
        known = [name for name in names if name in SLEEPS or name in TRANSFERS or name in COLLECTIVES]
        return (known or names or [None])[-1]
    except Exception:
        return None
