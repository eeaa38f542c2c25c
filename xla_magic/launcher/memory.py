"""What holds a rank's device memory, named the way the user names it. Runs in a rank (process or thread).

``holders`` walks what the user can name (the rank's namespace and the
frames of the running cell): XLA tensors by their variable (``x``,
``batch[0]``), a module's parameters and buffers (``model.layers.3.weight``)
and their gradients (``model.layers.3.weight.grad``), an optimizer's state
(``opt.state[model.layers.3.weight].exp_avg``). Everything it reads is
metadata (dtype, shape, torch_xla's tensor id): nothing syncs, compiles or
waits for the device. ``everything=True`` also walks every object the
garbage collector tracks for XLA tensors no name reaches ("unnamed").

Sizes are ``numel * element_size`` (``bytes``) and that laid out in a
TPU's default tiles (``padded``, layout.py: a vector to a tile of at most
1024 elements, the minor two dimensions to (1 to 8 rows, 128)). The
simulation counts the padded size against its limit (simulate/memory.py);
the views show both.

An unnamed tensor is told by where it was made: torch_xla numbers its
tensors in the order it makes them, and its ``CreateXlaTensor`` counter is
the last number given. ``mark`` notes that counter at each sync the
simulation sees (simulate/memory.py) and at each cell's end (serve.py): a
tensor's number then falls between two marks, which say the cell and the
sync line that computed it (``made``). About a microsecond a mark.

``explain`` turns a device out-of-memory error into the text shown under
the cell: the holders, the totals by kind, what dominates and what to do.
"""

from __future__ import annotations

import bisect
import gc
import linecache
import re
import sys
import threading
import types
from typing import Any, Iterator

import torch

from xla_magic.launcher import layout
from xla_magic.launcher.layout import padded_bytes

KINDS = ("parameters", "gradients", "optimizer state", "other")
DEPTH = 3  # how deep into lists, tuples, dicts and plain objects' attributes the walk goes
SHOWN = 8  # holders named in an out-of-memory explanation
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Error allocating device buffer", "Ran out of memory in memory space")


def _is_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


class _Walk:
    """One walk over the roots: each XLA tensor once (by torch_xla's tensor id), with its first name and kind."""

    def __init__(self, deep: bool = True) -> None:
        self.deep = deep  # into plain objects' attributes too (a trainer that holds the model), not only containers
        self.found: dict[int, tuple[torch.Tensor, str, str]] = {}  # tensor id -> (tensor, name, kind)
        self.seen_objects: set[int] = set()
        self.param_names: dict[int, str] = {}  # id(parameter) -> its name, for the optimizers' state

    def tensor(self, value: torch.Tensor, name: str, kind: str) -> None:
        key = _tensor_id(value)
        if key not in self.found:
            self.found[key] = (value, name, kind)

    def module(self, value: torch.nn.Module, name: str) -> None:
        for pname, param in value.named_parameters(remove_duplicate=True):
            if _is_xla(param):
                full = f"{name}.{pname}"
                self.param_names.setdefault(id(param), full)
                self.tensor(param, full, "parameters")
                grad = param.grad
                if grad is not None and _is_xla(grad):
                    self.tensor(grad, f"{full}.grad", "gradients")
        for bname, buffer in value.named_buffers():
            if _is_xla(buffer):
                self.tensor(buffer, f"{name}.{bname}", "other")

    def optimizer(self, value: torch.optim.Optimizer, name: str) -> None:
        states = value.state
        for group in value.param_groups:
            for param in group["params"]:
                state = states.get(param) if hasattr(states, "get") else None
                if not state:
                    continue
                pname = self.param_names.get(id(param)) or f"<{'x'.join(map(str, param.shape))}>"
                for key, item in state.items():
                    if _is_xla(item):
                        self.tensor(item, f"{name}.state[{pname}].{key}", "optimizer state")

    def value(self, value: Any, name: str, depth: int) -> None:
        if _is_xla(value):
            self.tensor(value, name, "other")
            return
        if isinstance(value, _SKIPPED) or value is None or type(value).__module__.startswith("IPython."):
            return  # (the shell, as exit and quit, reaches the namespace again)
        if id(value) in self.seen_objects:
            return
        self.seen_objects.add(id(value))
        if isinstance(value, torch.nn.Module):
            self.module(value, name)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizer(value, name)
        elif depth >= DEPTH:
            return
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value[:4096]):
                self.value(item, f"{name}[{index}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in list(value.items())[:4096]:
                label = repr(key) if isinstance(key, (str, int)) else f"<{type(key).__name__}>"
                self.value(item, f"{name}[{label}]", depth + 1)
        elif self.deep and hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            try:
                attributes = list(vars(value).items())
            except TypeError:
                return
            for attribute, item in attributes:
                if not attribute.startswith("__"):
                    self.value(item, f"{name}.{attribute}", depth + 1)


_SKIPPED = (types.ModuleType, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, str, bytes,
            int, float, bool, torch.device, torch.dtype)


_get_tensor_id: Any = None  # torch_xla._XLAC._xla_get_tensor_id, once bound


def _tensor_id(value: torch.Tensor) -> int:
    global _get_tensor_id
    try:
        if _get_tensor_id is None:
            import torch_xla

            _get_tensor_id = torch_xla._XLAC._xla_get_tensor_id
        return int(_get_tensor_id(value))
    except Exception:  # a tensor torch_xla cannot name (a functional wrapper): Python's identity
        return -id(value)


def _roots(namespace: dict[str, Any], frame: types.FrameType | None) -> Iterator[tuple[str, Any]]:
    """The names a user can see: the namespace's, then the locals of the running cell's frames."""
    for name, value in list(namespace.items()):
        if not name.startswith("_"):
            yield name, value
    while frame is not None:
        if frame.f_code.co_filename.startswith("<xla_") and frame.f_code.co_name != "<module>":
            try:
                local = dict(frame.f_locals)
            except Exception:
                local = {}
            for name, value in local.items():
                yield name, value
        frame = frame.f_back


def _walk(namespace: dict[str, Any], frame: types.FrameType | None, deep: bool) -> _Walk:
    """Modules first, then optimizers (their state is named by the parameters' names), then names that hold a
    tensor themselves, then everything else: so each tensor gets its shortest, most telling name."""
    walk = _Walk(deep)
    roots = list(_roots(namespace, frame))
    for name, value in roots:
        if isinstance(value, torch.nn.Module):
            walk.value(value, name, 0)
    for name, value in roots:
        if isinstance(value, torch.optim.Optimizer):
            walk.value(value, name, 0)
    for name, value in roots:
        if _is_xla(value):
            walk.tensor(value, name, "other")
    for name, value in roots:
        walk.value(value, name, 0)
    return walk


def count(namespace: dict[str, Any], frame: types.FrameType | None = None) -> int:
    """The bytes (padded to TPU tiles) of the tensors the names reach, right after a sync (each holds its buffer).

    The simulation's count at every sync: the same roots and order as ``holders``' walk, but containers,
    modules and optimizers only (no plain objects' attributes), no names and no record per tensor, and
    each shape's padded size remembered, so that it costs a small fraction of a training step.
    """
    counter = _Count()
    roots = list(_roots(namespace, frame))
    for value in [value for _name, value in roots if isinstance(value, torch.nn.Module)]:
        counter.value(value, 0)
    for value in [value for _name, value in roots if isinstance(value, torch.optim.Optimizer)]:
        counter.value(value, 0)
    for _name, value in roots:
        if isinstance(value, torch.Tensor) and value.is_xla:
            counter.tensor(value)
    for _name, value in roots:
        counter.value(value, 0)
    return counter.total


_PADDED: dict[tuple[Any, Any], int] = {}  # (shape, dtype) -> padded bytes, for the count at every sync


def forget_sizes() -> None:
    """Forget the remembered padded sizes (the device kind they follow may have changed)."""
    _PADDED.clear()


class _Count:
    """``_Walk(deep=False)``'s traversal, summing padded bytes per distinct tensor instead of naming them."""

    def __init__(self) -> None:
        self.total = 0
        self.ids: set[int] = set()
        self.seen_objects: set[int] = set()
        self.tensor_id = _get_tensor_id or _tensor_id  # torch_xla's own, called directly once bound

    def tensor(self, value: torch.Tensor) -> None:
        try:
            key = int(self.tensor_id(value))
        except Exception:  # as _tensor_id: a tensor torch_xla cannot name
            key = -id(value)
        if key in self.ids:
            return
        self.ids.add(key)
        shape = value.shape
        size = _PADDED.get((shape, value.dtype))
        if size is None:
            if len(_PADDED) > 4096:
                _PADDED.clear()
            size = _PADDED[(shape, value.dtype)] = padded_bytes(tuple(shape), value.element_size())
        self.total += size

    def module(self, value: torch.nn.Module) -> None:
        for param in value.parameters():
            if param.is_xla:
                self.tensor(param)
                grad = param.grad
                if grad is not None and grad.is_xla:
                    self.tensor(grad)
        for buffer in value.buffers():
            if isinstance(buffer, torch.Tensor) and buffer.is_xla:
                self.tensor(buffer)

    def optimizer(self, value: torch.optim.Optimizer) -> None:
        states = value.state
        if not hasattr(states, "get"):
            return
        for group in value.param_groups:
            for param in group["params"]:
                state = states.get(param)
                if state:
                    for item in state.values():
                        if isinstance(item, torch.Tensor) and item.is_xla:
                            self.tensor(item)

    def value(self, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_xla:
                self.tensor(value)
                return
        elif isinstance(value, _SKIPPED) or value is None or type(value).__module__.startswith("IPython."):
            return
        if id(value) in self.seen_objects:
            return
        self.seen_objects.add(id(value))
        if isinstance(value, torch.nn.Module):
            self.module(value)
        elif isinstance(value, torch.optim.Optimizer):
            self.optimizer(value)
        elif depth >= DEPTH:
            return
        elif isinstance(value, (list, tuple)):
            for item in value[:4096]:
                self.value(item, depth + 1)
        elif isinstance(value, dict):
            for item in list(value.values())[:4096]:
                self.value(item, depth + 1)


# --- where a tensor was made ------------------------------------------------------------

MARKS_KEPT = 4096  # past this, the middle marks go (the oldest name long-kept tensors, the newest the last steps)
_marks: list[tuple[int, str | None, int | None]] = []  # (last tensor number before it, cell filename, sync line)
_marks_lock = threading.Lock()  # the cell's thread marks, the sampler's thread reads
_counter: Any = None  # torch_xla._XLAC._xla_counter_value, once bound
_synced = False  # whether a sync was marked (the simulation's): else marks are the cells' ends only


def _made_so_far() -> int | None:
    """torch_xla's number of the last tensor it made (its CreateXlaTensor counter); None where unreadable."""
    global _counter
    if _counter is None and "torch_xla" not in sys.modules:
        return None  # a rank that has not imported it yet made no tensor (and must not pay for the import here)
    try:
        if _counter is None:
            import torch_xla

            _counter = torch_xla._XLAC._xla_counter_value
        return int(_counter("CreateXlaTensor") or 0)
    except Exception:
        return None


def mark(filename: str | None, line: int | None = None) -> None:
    """The tensors made since the last mark were made in cell ``filename``, computed by the sync at ``line``
    (None: the cell's end, a sync or none later)."""
    global _synced
    number = _made_so_far()
    if number is None:
        return
    _synced = _synced or line is not None
    with _marks_lock:
        if _marks and _marks[-1][0] == number:
            return  # nothing made since the last mark
        if _marks and _marks[-1][1:] == (filename, line):
            _marks[-1] = (number, filename, line)  # the same sync again (a loop): one span
            return
        _marks.append((number, filename, line))
        if len(_marks) > MARKS_KEPT:
            start, end = MARKS_KEPT // 4, MARKS_KEPT // 2
            _marks[start:end] = [(_marks[end - 1][0], None, None)]  # those tensors' place is not known any more


def last_span() -> tuple[int, int]:
    """The tensor numbers the last mark covers, (after, up to]: at a sync, the tensors it computes."""
    with _marks_lock:
        if not _marks:
            return (0, 0)
        return (_marks[-2][0] if len(_marks) > 1 else 0, _marks[-1][0])


def made(number: int) -> str | None:
    """Where the tensor numbered ``number`` was made, in words: ``made in cell 4, computed at line 12:
    torch_xla.sync()``, ``made in cell 4``, ``made since the last sync``; None where it is not known."""
    with _marks_lock:
        at = bisect.bisect_left(_marks, (number,))
        if at == len(_marks):
            if not _marks:
                return None
            return "made since the last sync" if _synced else "made since the last cell ended"
        _number, filename, line = _marks[at]
    if filename is None:
        return None
    found = re.match(r"<xla_spawn cell (\d+)>", filename)
    cell = f"cell {found.group(1)}" if found else filename
    if line is None:
        return f"made in {cell}"
    code = linecache.getline(filename, line).strip()
    return f"made in {cell}, computed at line {line}" + (f": {code}" if code else "")


def holders(namespace: dict[str, Any], frame: types.FrameType | None = None,
            everything: bool = False) -> list[dict[str, Any]]:
    """Every XLA tensor the user can name, largest first, as plain data (``tensor`` holds the tensor itself).

    ``everything``: also the XLA tensors no name reaches, found among every object the garbage collector tracks.
    """
    walk = _walk(namespace, frame, deep=True)
    if everything:
        for value in gc.get_objects():
            if _is_xla(value) and _tensor_id(value) not in walk.found:
                walk.tensor(value, "unnamed", "other")
    found = []
    for key, (value, name, kind) in walk.found.items():
        shape = tuple(value.shape)
        itemsize = value.element_size()
        found.append({"name": name, "kind": kind, "shape": list(shape), "dtype": str(value.dtype).removeprefix("torch."),
                      "bytes": value.numel() * itemsize, "padded": padded_bytes(shape, itemsize), "tensor": value,
                      "number": key, "estimate": layout.estimated(itemsize)})
        if name == "unnamed" and key > 0:  # (a negative key: no torch_xla number)
            where = made(key)
            if where:
                found[-1]["made"] = where
    _mark_pending(found)
    found.sort(key=lambda holder: -holder["padded"])
    return found


def _mark_pending(found: list[dict[str, Any]]) -> None:
    """Which tensors are still a graph to run (no buffer yet): metadata, read without a sync."""
    try:
        import torch_xla

        pending = torch_xla._XLAC._check_tensor_need_materialization([holder["tensor"] for holder in found])
    except Exception:
        pending = [False] * len(found)
    for holder, waiting in zip(found, pending):
        holder["pending"] = bool(waiting)


def totals(found: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes (padded) by kind, of the tensors that hold a buffer now."""
    sums = dict.fromkeys(KINDS, 0)
    for holder in found:
        if not holder.get("pending"):
            sums[holder["kind"]] += holder["padded"]
    return sums


def sample(namespace: dict[str, Any], frame: types.FrameType | None = None, everything: bool = True,
           limit: int = 200) -> dict[str, Any]:
    """%xla_memory's answer: the holders (the ``limit`` largest, without the tensors), totals and the runtime's
    figures; ``everything``: unnamed tensors too (a walk over every object the garbage collector tracks)."""
    found = holders(namespace, frame, everything)
    answer: dict[str, Any] = {
        "holders": [{key: value for key, value in holder.items() if key not in ("tensor", "number")}
                    for holder in found[:limit]],
        "count": len(found),
        "totals": totals(found),
        "device": device_figures(),
    }
    return answer


def device_figures() -> dict[str, int] | None:
    """The runtime's (or the simulation's) bytes_used, bytes_limit, peak_bytes_used; None where it reports none."""
    try:
        import torch_xla

        info = torch_xla._XLAC._xla_memory_info(str(torch_xla.device()))
        return {key: int(value) for key, value in dict(info).items() if isinstance(value, (int, float))} or None
    except Exception:
        return None


# --- an out-of-memory error, explained --------------------------------------------------


def is_device_oom(exc: BaseException) -> bool:
    try:
        text = str(exc)
    except Exception:
        return False
    return any(marker in text for marker in OOM_MARKERS)


def human(size: float) -> str:
    """Bytes as XLA writes them in its messages: 196.00M, 1.50G, 512B."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f}{unit}"
    return f"{int(size)}B"


_ASKED = re.compile(r"Attempting to allocate (?P<number>[0-9.]+)(?P<unit>[KMGT]?)")


def _asked(message: str) -> int:
    """The bytes an out-of-memory message says were asked for (XLA writes 196.00M); 0 where it says none."""
    found = _ASKED.search(message)
    if found is None:
        return 0
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[found["unit"]]
    return int(float(found["number"]) * scale)


_ALLOCATION = re.compile(r"^\s*\d+\. Size: (?P<size>[0-9.]+[KMGT]?)B?\s*$")
_FIELD = re.compile(r"^\s*(?P<field>Operator|Shape|Allocation type): (?P<value>.*)$")
_HLO_TEMP = re.compile(r"^\s*HLO temp\s+(?P<size>[0-9.]+[KMGT]?)", re.MULTILINE)


def _bytes(text: str) -> int:
    """XLA's 196.00M, 1.50G, 512B (or 512) as bytes."""
    found = re.match(r"(?P<number>[0-9.]+)(?P<unit>[KMGT]?)", text)
    if found is None:
        return 0
    return int(float(found["number"]) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[found["unit"]])


def compile_allocations(message: str, running: str | None) -> tuple[list[tuple[int, str, str, str, str]], int] | None:
    """A TPU compiler's "Ran out of memory in memory space hbm" message (or the simulation's, in its words):
    its largest program allocations as (bytes, where in the cell, operator, shape, allocation type), and its HLO
    temporaries' bytes; None for any other message. ``running``: the failing cell's filename (its lines are
    named by number alone)."""
    if "Ran out of memory in memory space" not in message:
        return None
    allocations: list[dict[str, str]] = []
    for raw in message.splitlines():
        size = _ALLOCATION.match(raw)
        if size:
            allocations.append({"size": size["size"]})
            continue
        field = _FIELD.match(raw)
        if field and allocations:
            allocations[-1][field["field"]] = field["value"].strip()
    found = []
    for allocation in allocations:
        operator = allocation.get("Operator", "")
        name = re.search(r'op_name="(?P<name>[^"]*)"', operator)
        source = re.search(r'source_file="(?P<file>[^"]*)" source_line=(?P<line>\d+)', operator)
        where = "(no source line)"
        if source:
            filename, line = source["file"], int(source["line"])
            cell = re.match(r"<xla_spawn cell (\d+)>", filename)
            code = linecache.getline(filename, line).strip()
            where = (f"line {line}" if filename == running else f"cell {cell.group(1)} line {line}" if cell
                     else f"{filename.rsplit('/', 1)[-1]}:{line}") + (f": {code}" if code else "")
        shape = re.sub(r"\{.*\}$", "", allocation.get("Shape", ""))
        found.append((_bytes(allocation["size"]), where, name["name"] if name else operator or "an operation", shape,
                      allocation.get("Allocation type", "program")))
    hlo_temp = _HLO_TEMP.search(message)
    temporaries = _bytes(hlo_temp["size"]) if hlo_temp else sum(size for size, *_rest, kind in found if kind == "HLO temp")
    return found, temporaries


def dominant(sums: dict[str, int], temporaries: int) -> str:
    """What fills the device: "weights" (parameters, gradients and optimizer state), "temporaries", or "leftovers"."""
    weights = sums["parameters"] + sums["gradients"] + sums["optimizer state"]
    others = sums["other"]
    if temporaries >= max(weights, others):
        return "temporaries"
    return "weights" if weights >= others else "leftovers"


# What the line under an out-of-memory error says dominates (runs/errors.py chooses the advice by it).
MOSTLY = {
    "weights": "Most of it: parameters, gradients and optimizer state.",
    "temporaries": "Most of it: the graph's temporaries and activations.",
    "leftovers": "Most of it: tensors left from earlier cells ({names}).",
}


def explain(exc: BaseException, namespace: dict[str, Any], rank: int) -> str:
    """The lines shown under the cell for a device out-of-memory error ('' for any other error)."""
    if not is_device_oom(exc):
        return ""
    tb = exc.__traceback__
    frame = None
    cell = None  # the failing cell's file, where its innermost frame is
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith("<xla_"):
            cell = frame.f_code.co_filename
        tb = tb.tb_next
    try:
        found = holders(namespace, frame, everything=True)  # unnamed tensors too, with where they were made
    except Exception as broken:
        return f"\nDevice memory on rank {rank}: the holders could not be read ({type(broken).__name__}: {broken})."
    sums = totals(found)
    # The simulation knows the graph's temporaries; a TPU's runtime says only what it asked for.
    simulated = hasattr(exc, "temporaries")
    temporaries = int(exc.temporaries or 0) if simulated else _asked(str(exc))  # type: ignore[attr-defined]
    lines = ["", f"Device memory on rank {rank} when it ran out (as %xla_memory names it):"]
    for holder in [h for h in found if not h.get("pending")][:SHOWN]:
        made = f", {holder['made']}" if holder.get("made") else ""
        lines.append(f"  {human(holder['padded']):>9}  {holder['name']}  {holder['dtype']}{holder['shape']}  "
                     f"({holder['kind']}{made})")
    compiled = compile_allocations(str(exc), cell)
    if compiled is not None:  # the compiler refused the graph: its largest allocations, at the cell's lines
        allocations, hlo_temp = compiled
        temporaries = temporaries if simulated else hlo_temp
        lines.append("The compiler's largest allocations for the graph, at the cell's lines:")
        for size, where, operator, shape, kind in allocations[:SHOWN]:
            lines.append(f"  {human(size):>9}  {where}  {operator}{'  ' + shape if shape else ''}  ({kind})")
    needed = "the graph's temporaries" if simulated or compiled is not None else "asked for"
    lines.append("  by kind: " + ", ".join(f"{kind} {human(sums[kind])}" for kind in KINDS)
                 + (f", {needed} {human(temporaries)}" if temporaries else ""))
    if sum(sums.values()) + temporaries:  # nothing held and nothing asked: no guess at what dominates
        why = dominant(sums, temporaries)
        names = [h["name"] for h in found if h["kind"] == "other" and not h.get("pending") and h["name"] != "unnamed"]
        lines.append(MOSTLY[why].format(names=", ".join(names[:4]) or "unnamed"))
    lines.append("The rank survived it: a pool keeps its ranks and their names; free memory and run the cell again.")
    return "\n".join(lines)
