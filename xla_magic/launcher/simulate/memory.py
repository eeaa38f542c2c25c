"""The simulated device's memory: a limit, a count, ``get_memory_info`` and RESOURCE_EXHAUSTED. Runs in a rank.

XLA:CPU reports no device memory (its ``get_memory_info`` is
UNIMPLEMENTED), so on a laptop code that reads it, the memory views and
the out-of-memory path would never run. Here each simulated device has a
limit: ``XLA_MAGIC_SIM_HBM`` (a size such as ``16G``, ``512M``, ``1.5GiB``,
a number of bytes, or a TPU kind: ``v2``, ``v3``, ``v4``, ``v5e``, ``v5p``,
``v6e``), by default a v5e's 16 GiB; ``off`` counts nothing (XLA:CPU's own
``get_memory_info``, which is UNIMPLEMENTED).

After every ``torch_xla.sync`` (``xm.mark_step`` and ``torch_xla.step``
call it) the rank counts what holds its device: the XLA tensors the user
can name (launcher/memory.py: the namespace and the cell's frames),
laid out as XLA:TPU lays them out (layout.py), plus the temporaries of the
graph that the sync ran, from torch_xla's compilation analysis
(xla_analysis.py; remembered by the line that synced, since a cached graph
is not analysed again). Before it syncs, it marks where the tensors made
since were made (memory.mark), for %xla_memory's unnamed tensors. A
``.to(device)`` (``Tensor.to``, and so ``Module.to``) allocates on a TPU at
its line: it is counted there, and freed again when the tensor goes. Past
the limit, the sync or the transfer raises RuntimeError with the TPU
runtime's wording. The figures answer ``xm.get_memory_info``
(``torch_xla._XLAC._xla_memory_info``).

How far this is from a TPU: tensors no name reaches (a library's caches)
are not counted, nor, at a sync, tensors held only as a plain object's
attribute (a trainer's ``self.model``: %xla_memory finds those); XLA:CPU's
temporaries differ from a TPU's (other fusion, no tile padding inside the
graph); a transfer made by a DataLoader's thread (``MpDeviceLoader``) is
counted at the next sync.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import sys
import threading
import weakref
from typing import Any, Callable

from xla_magic.launcher import layout, memory, shell, xla_analysis

VARIABLE = "XLA_MAGIC_SIM_HBM"
GIB = 1 << 30
DEFAULT_LIMIT = 16 * GIB  # a v5e's HBM
# HBM per device (a core on v2/v3, a chip from v4 on)
TPU_KINDS = {"v2": 8 * GIB, "v3": 16 * GIB, "v4": 32 * GIB, "v5e": 16 * GIB, "v5litepod": 16 * GIB,
             "v5p": 95 * GIB, "v6e": 32 * GIB}
_SIZE = re.compile(r"^\s*(?P<number>\d+(\.\d+)?)\s*(?P<unit>[kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_limit(text: str | None) -> int:
    """``XLA_MAGIC_SIM_HBM``'s bytes (binary units, as TPU runtimes count); ValueError saying what it takes."""
    if text is None or not text.strip():
        return DEFAULT_LIMIT
    kind = text.strip().lower().removeprefix("tpu ").removeprefix("tpu")
    if kind in TPU_KINDS:
        return TPU_KINDS[kind]
    found = _SIZE.match(text)
    if found is None or float(found["number"]) <= 0:
        raise ValueError(f"{VARIABLE}={text!r} is not a size: give bytes (1000000), a size (512M, 16G, 1.5GiB) "
                         f"or a TPU kind ({', '.join(TPU_KINDS)})")
    return int(float(found["number"]) * _UNITS[found["unit"].lower()])


class Book:
    """One simulated device's memory: the limit, the last count, the peak and each sync line's temporaries."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # the last count (at a sync)
        self.peak = 0
        self.lock = threading.Lock()
        self.temporaries: dict[tuple[str, int], int] = {}  # by the line that synced
        self.analysis_seen = 0  # how far into the analysis file this book has read
        self.compiled: list[dict[str, Any]] = []  # the analysis blocks of the graphs the last sync compiled
        # Tensors moved to the device since the last count and still alive: key -> (weak reference, bytes).
        # A freed one's key is queued by its weak reference's callback (which takes no lock: it may run
        # wherever the tensor's last reference goes) and taken off under the lock.
        self.transfers: dict[int, tuple[weakref.ref, int]] = {}
        self.transferred = 0
        self.freed: collections.deque[int] = collections.deque()
        self.keys = itertools.count()

    def figures(self) -> dict[str, int]:
        with self.lock:
            held = self._held()
            return {"bytes_used": held, "bytes_limit": self.limit, "peak_bytes_used": self.peak}

    def _held(self) -> int:
        """The last count and what was moved to the device since and is still alive (under the lock)."""
        while self.freed:
            entry = self.transfers.pop(self.freed.popleft(), None)
            if entry is not None:
                self.transferred -= entry[1]
        return self.used + self.transferred

    def on_transfer(self, tensor: Any) -> None:
        """A tensor just moved to the device (``.to(device)``): a TPU allocates its buffer here, at this line,
        so past the limit this raises the TPU runtime's RESOURCE_EXHAUSTED here, not at the next sync."""
        size = layout.padded_bytes(tuple(tensor.shape), tensor.element_size())
        with self.lock:
            held = self._held()
            if held + size > self.limit:
                error = RuntimeError(f"RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
                                     f"{memory.human(size)}. That was not possible. There are "
                                     f"{memory.human(max(self.limit - held, 0))} free.")
                error.temporaries = 0  # type: ignore[attr-defined]
                raise error
            key = next(self.keys)
            self.transfers[key] = (weakref.ref(tensor, lambda _gone, key=key: self.freed.append(key)), size)
            self.transferred += size
            self.peak = max(self.peak, held + size)

    def after_sync(self, where: tuple[str, int], frame: Any) -> None:
        """Count after a sync ran a graph; RuntimeError, as a TPU's compiler or runtime words it, past the limit."""
        try:
            namespace = shell.calling_home().namespace
        except RuntimeError:
            namespace = {}
        self.compiled = []
        temporaries = self._temporaries(where)
        for block in self.compiled:  # a graph this sync compiled that no device could hold: the compiler refuses it
            needs = block["memory"]
            if sum(needs.get(key, 0) for key in COMPILE_NEEDS) > self.limit:
                raise compile_error(needs, self.limit, where, namespace, frame)
        used = memory.count(namespace, frame)  # the tensors moved to the device since, where a name holds them
        with self.lock:
            was = self._held()
            self.used = used
            self.transfers.clear()  # (their weak references go with them: no callback comes)
            self.transferred = 0
            self.peak = max(self.peak, used + temporaries)
        if used + temporaries > self.limit:
            asked = max(used - was, 0) + temporaries
            free = max(self.limit - was, 0)
            error = RuntimeError(f"RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
                                 f"{memory.human(asked)}. That was not possible. There are {memory.human(free)} free.")
            error.temporaries = temporaries  # type: ignore[attr-defined]
            raise error

    def _temporaries(self, where: tuple[str, int]) -> int:
        """The temporaries of the graph this sync ran: what the analysis gained (a compile), else the line's last."""
        path = xla_analysis._analysis_file
        if path is None:
            return self.temporaries.get(where, 0)
        try:
            size = os.stat(path).st_size
        except OSError:
            return self.temporaries.get(where, 0)
        if size < self.analysis_seen:  # the cell's account read it (and emptied it)
            self.analysis_seen = 0
        if size > self.analysis_seen:
            with open(path, errors="replace") as file:
                file.seek(self.analysis_seen)
                text = file.read()
            self.analysis_seen = size
            blocks = xla_analysis.parse_analysis(text)
            self.compiled = blocks
            if blocks:
                self.temporaries[where] = max(block["memory"].get("temporaries", 0) for block in blocks)
        return self.temporaries.get(where, 0)


COMPILE_NEEDS = ("inputs", "outputs", "temporaries", "program")  # what a graph needs at once on its device
ALLOCATIONS_LISTED = 5
RULE = "=" * 26


def compile_error(needs: dict[str, int], limit: int, where: tuple[str, int], namespace: dict[str, Any],
                  frame: Any) -> RuntimeError:
    """A TPU compiler's refusal of a graph too large for its device, in its words, with its largest allocations:
    the tensors the sync computes (its outputs, named as %xla_memory names them, at the line that synced) and its
    temporaries (XLA:CPU's analysis gives their total only)."""
    human = memory.human
    total = sum(needs.get(key, 0) for key in COMPILE_NEEDS)
    program = needs.get("temporaries", 0) + needs.get("program", 0)
    low, high = memory.last_span()
    try:
        outputs = [holder for holder in memory.holders(namespace, frame, everything=True)
                   if low < holder["number"] <= high and not holder.get("pending")]
    except Exception:  # the message stands without them
        outputs = []
    filename, line = where
    operator = f'source_file="{filename}" source_line={line}'
    allocations = [(holder["padded"], f'op_name="{holder["name"]}" {operator}', _layout(holder), holder["bytes"],
                    "output") for holder in outputs]
    if needs.get("temporaries"):
        allocations.append((needs["temporaries"], f'op_name="temporaries" {operator}', None, None, "HLO temp"))
    allocations.sort(key=lambda allocation: -allocation[0])
    lines = [f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
             f"Used {human(total)} of {human(limit)} hbm. Exceeded hbm capacity by {human(total - limit)}.",
             "", f"Total hbm usage >= {human(total)}:", f"    program   {human(program):>10}",
             f"    arguments {human(needs.get('inputs', 0)):>10}", "",
             f"Output size {human(needs.get('outputs', 0))}.", "",
             f"Program hbm requirement {human(program)}:", f"    HLO temp  {human(needs.get('temporaries', 0)):>10}",
             "", "  Largest program allocations in hbm:", ""]
    for number, (size, operator_text, shape, unpadded, kind) in enumerate(allocations[:ALLOCATIONS_LISTED], 1):
        lines += [f"  {number}. Size: {human(size)}", f"     Operator: {operator_text}"]
        if shape:
            lines += [f"     Shape: {shape}", f"     Unpadded size: {human(unpadded)}"]
        lines += [f"     Allocation type: {kind}", f"     {RULE}", ""]
    error = RuntimeError("\n".join(lines).rstrip())
    error.temporaries = needs.get("temporaries", 0)  # type: ignore[attr-defined]
    return error


def _layout(holder: dict[str, Any]) -> str:
    """A holder's shape as XLA writes it with its TPU layout (layout.py): f32[512,512]{1,0:T(8,128)}."""
    return layout.text(tuple(holder["shape"]), holder["dtype"], holder["tensor"].element_size())


_book: Book | None = None


def book() -> Book | None:
    return _book


def install() -> None:
    """Give this rank's device a limit and count it (simulate.install calls this, after the collectives)."""
    global _book
    import torch_xla

    if os.environ.get(VARIABLE, "").strip().lower() == "off":  # XLA:CPU's own: no figures, no limit
        return
    _book = Book(parse_limit(os.environ.get(VARIABLE)))
    memory.forget_sizes()  # (the device kind the sizes follow is this run's)
    torch_xla._XLAC._xla_memory_info = memory_info
    _count_transfers()
    package, module = sys.modules["torch_xla"], sys.modules["torch_xla.torch_xla"]
    original = module.sync
    if getattr(original, "_xla_magic_memory", False):
        return
    counted = _counted_sync(original)
    module.sync = package.sync = counted


def memory_info(device: Any = None) -> dict[str, int]:
    """``torch_xla._XLAC._xla_memory_info`` (what ``xm.get_memory_info`` returns): the simulated device's figures."""
    return _book.figures() if _book is not None else {}


def _counted_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync(*args: Any, **kwargs: Any) -> Any:
        current = _book
        if current is None:
            return original(*args, **kwargs)
        caller = _callers_frame(sys._getframe(1))
        where = (caller.f_code.co_filename, caller.f_lineno)
        memory.mark(*where)  # the tensors made since the last mark: this sync computes them
        result = original(*args, **kwargs)
        current.after_sync(where, caller)
        return result

    sync.__name__ = sync.__qualname__ = original.__name__
    sync.__doc__ = original.__doc__
    sync.__wrapped__ = original  # type: ignore[attr-defined]
    sync._xla_magic_memory = True  # type: ignore[attr-defined]
    return sync


def _count_transfers() -> None:
    """``Tensor.to`` (and so ``Module.to``): a tensor moved from the host to the device is counted at its line."""
    import torch

    original = torch.Tensor.to
    if getattr(original, "_xla_magic_memory", False):
        return

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        moved = original(self, *args, **kwargs)
        if moved is not self and _book is not None and moved.is_xla and not self.is_xla \
                and not torch.compiler.is_compiling():
            _book.on_transfer(moved)
        return moved

    to.__name__ = to.__qualname__ = "to"
    to.__doc__ = original.__doc__
    to.__wrapped__ = original  # type: ignore[attr-defined]
    to._xla_magic_memory = True  # type: ignore[attr-defined]
    torch.Tensor.to = to  # type: ignore[method-assign]


_OURS = ("torch_xla", os.path.join("xla_magic", "launcher"))


def _callers_frame(frame: Any) -> Any:
    """The user's frame that synced (xm.mark_step's caller, not mark_step), within a few frames."""
    first = frame
    for _ in range(8):
        if frame is None:
            break
        if not any(part in frame.f_code.co_filename for part in _OURS):
            return frame
        frame = frame.f_back
    return first
