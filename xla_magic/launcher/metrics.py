"""Values a cell logs (``log(step=None, **values)``), read without a sync of their own. Runs in a rank (process or thread).

``xla_magic.log`` hands each call to the rank's :class:`Logger`. A number
(a Python or NumPy number, a CPU tensor, a 0-d array) is taken at once. An
XLA tensor is held, unread: reading it now would cut the lazy graph (a host
sync), so it is read only once a sync the cell makes anyway has run its
graph. The logger queues one of torch_xla's step closures
(``xm.add_step_closure``) per step that logged a device value; the closure
runs in ``torch_xla.sync()`` (``xm.mark_step`` calls it) after the step's
graph was launched, and notes that what was held before that sync now has
its data. Those values are read later, in one transfer
(``_xla_get_cpu_tensors``) for READ_AT of them or when the rank sends a
batch, once a later sync launched the next step's graph (so theirs has run,
unless the host runs ahead of the device). The read happens on a thread of
its own (metric_reader.py): a read waits for the value's graph to end, and
the cell's thread must not wait for the device. They are not held longer:
torch_xla walks every live device tensor at each sync, so each one held
makes every step of the cell slower (about 0.5 us a tensor a sync on a CPU
host). That
transfer is the logger's own, not the cell's: the cell's XLA account
(xla_account.py) takes it off, as it takes off the CPU simulation's copies.

Values travel to the kernel as one METRICS event per batch (rows of
``(step, name, value, time)``), at most every FLUSH_SECONDS and at the
cell's end, never one per call (and, with ``--metrics-dir``, as TensorBoard
event files: :class:`Board`). At the cell's end a value whose graph never
ran (logged after the cell's last sync) is read then, which runs its graph:
the account shows that execution, as it would show the ``.item()`` it
replaces.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import threading
import time
from typing import Any, Iterator

import torch

from xla_magic.launcher import metric_reader
from xla_magic.wire import protocol

FLUSH_SECONDS = 0.2  # the longest a logged value waits on the rank before it is sent
# Device values held before they are read. Each live device tensor costs every sync of the cell (torch_xla walks
# them all: about 0.7 us each on a CPU host), each transfer costs (tens of us, less per value the more it reads):
# reading every 16 to 32 values costs a step least (benchmarks/bench_metrics.py).
READ_AT = 32
_loggers = threading.local()
_process_logger: "Logger | None" = None
_lock = threading.Lock()
Held = tuple  # a device value held until read: (step, name, tensor, time, the tensor's _version when logged)
own_transfers = 0  # device-to-host transfers the loggers of this process made (xla_account takes them off)
_Tensor = torch.Tensor
_wall, _monotonic = time.time, time.monotonic
_step_closures: Any = None  # torch_xla's xm.add_step_closure, once imported


def current() -> "Logger | None":
    """The logger of the rank this thread serves (or, for threads a cell starts, of its process)."""
    return getattr(_loggers, "logger", None) or _process_logger


class Logger:
    """One rank's logged values, between the ``log`` calls of its cells and the kernel."""

    def __init__(self, rank: int, channel: protocol.Channel, namespace: dict[str, Any] | None = None) -> None:
        global _process_logger
        self.rank = rank
        self.channel = channel
        self.seq: Any = None  # the cell's request, while one runs; its METRICS echo it
        self.next_step = 0
        self.rows: list[tuple[int, str, float, float]] = []  # read, to send
        self.waiting: list[Held] = []  # device values whose graph has not been launched
        self.launched: list[Held] = []  # device values whose graph the last sync launched
        self.ran: list[Held] = []  # ... an earlier sync launched: run by now, or nearly
        self.queued = False  # a step closure waits for the next sync
        self.told_changed = False  # the rank said that a value changed in place after it was logged
        self.sent = time.monotonic()
        self.board = Board(None, rank)
        self.reader = metric_reader.Reader(lambda held: _read(held, counted=True))
        _loggers.logger = _process_logger = self
        if namespace is not None:
            namespace.setdefault("log", log)

    @contextlib.contextmanager
    def cell(self, fields: dict[str, Any]) -> Iterator[None]:
        """A cell's logging: steps count from 0, and what it logged is all sent by its end."""
        self.seq, self.next_step = fields.get("seq"), 0
        self.rows, self.waiting, self.launched, self.ran, self.queued = [], [], [], [], False
        self.told_changed = False
        self.board = Board(fields.get("metrics_dir"), self.rank)
        ended = False
        try:
            yield
            ended = True
        finally:
            try:  # a cell that raised (an interrupt) runs no graph for what it logged last: that is dropped
                self.flush(ending=True, everything=ended)
            finally:
                self.seq = None
                self.waiting, self.launched, self.ran = [], [], []
                self.board.close()

    def log(self, step: Any, values: dict[str, Any]) -> None:
        # Called every step of a training loop: a few us of Python against a step of a ms or less on a small
        # model, so the common case (device scalars, no step given) takes the shortest path (bench_metrics.py).
        if self.seq is None:
            raise RuntimeError("log() records values while a cell runs on this rank; none runs now")
        if step is None:
            step = self.next_step
        elif isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"log(step=...) takes a whole number, not {type(step).__name__} ({step!r})")
        else:
            step = int(step)
        self.next_step = step + 1
        now = _wall()
        waiting = self.waiting
        for name, value in values.items():
            if isinstance(value, _Tensor) and value.is_xla:
                if value.numel() != 1 or value.is_complex():
                    _check_tensor(name, value)
                if value._is_view():
                    # torch_xla regenerates a view (model.weight[0, 0]) from its base when read: once the optimizer
                    # changed the base, reading it would run the pending graph. Its copy is computed with the step.
                    value = value.detach().clone()
                waiting.append((step, name, value, now, value._version))
            else:
                self.rows.append((step, name, _number(name, value), now))
        if waiting and not self.queued:
            _add_step_closure()(self._synced)
            self.queued = True
        if _monotonic() - self.sent >= FLUSH_SECONDS:
            self.flush()

    def _synced(self) -> None:
        """A step closure: the graph of what was logged before this sync is launched (and the last one's has run,
        the device runs graphs in order: reading those waits for this step's graph no longer than it must).
        What has run is read once READ_AT values wait: every device tensor held alive makes each sync of the
        cell slower (torch_xla walks all live tensors at a sync), so none is held longer than that."""
        self.queued = False
        self.ran += self.launched
        self.launched, self.waiting = self.waiting, []
        if self.seq is None:
            return
        if _monotonic() - self.sent >= FLUSH_SECONDS:
            self.flush()
        elif len(self.ran) >= READ_AT:
            self.read()

    def read(self) -> None:
        """Hand what has run to the reader thread (one transfer there); it is sent with a later batch."""
        held, self.ran = self.ran, []
        held = self._unchanged(held, at_end=False)
        if held:
            self.reader.submit(held)

    def flush(self, ending: bool = False, everything: bool = False) -> None:
        """Send what is read so far as one METRICS event. ``ending``: the cell's end, every value handed to the
        reader is sent; ``everything``: and what the last sync launched and what no sync launched, read here."""
        self.read()
        self.rows += self.reader.drain() if ending else self.reader.take()
        if everything:
            held, self.launched, self.waiting = self.launched + self.waiting, [], []
            held = self._unchanged(held, at_end=True)
            if held:
                self.rows += _read(held, counted=not any(_need_graphs(held)))
        self.sent = time.monotonic()
        if not self.rows or self.seq is None:
            return
        rows, self.rows = self.rows, []
        self.channel.send(protocol.METRICS, seq=self.seq, rows=rows)
        self.board.write(rows)

    def _unchanged(self, held: list[Held], at_end: bool) -> list[Held]:
        """What nothing changed since it was logged (and, but ``at_end``, what a sync materialized). A value
        changed in place after it was logged (``total += 1`` after ``log(total=total)``) holds a later value,
        and may have a pending graph again, which reading would run (a sync of ours). It is dropped, and the rank
        says so once."""
        needs = [False] * len(held) if at_end else _need_graphs(held)
        same = [not pending and entry[2]._version == entry[4] for entry, pending in zip(held, needs)]
        kept = [entry for entry, unchanged in zip(held, same) if unchanged]
        if len(kept) < len(held) and not self.told_changed:
            self.told_changed = True
            name = next(entry[1] for entry, unchanged in zip(held, same) if not unchanged)
            print(f"log: {name} was changed in place after it was logged, before it was read, so those values "
                  f"are not drawn: log a copy ({name}.clone()) or a new tensor", file=sys.stderr)
        return kept


class Board:
    """--metrics-dir: the cell's values also as TensorBoard event files, in ``DIR/run-N/rank-R`` (one writer per cell).

    Written with torch.utils.tensorboard's SummaryWriter (its own thread writes
    the files), which needs the tensorboard package on the ranks; without it,
    rank 0 says so once and nothing is written.
    """

    def __init__(self, directory: str | None, rank: int) -> None:
        self.directory = os.path.join(directory, f"rank-{rank}") if directory else None
        self.rank = rank
        self.writer: Any = None

    def write(self, rows: list[tuple[int, str, float, float]]) -> None:
        if self.directory is None:
            return
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if self.rank == 0:
                    print("log: --metrics-dir writes TensorBoard files with torch.utils.tensorboard, which needs "
                          "the tensorboard package where the ranks run: pip install tensorboard", file=sys.stderr)
                self.directory = None
                return
            self.writer = SummaryWriter(self.directory)
        for step, name, value, when in rows:
            self.writer.add_scalar(name, value, step, walltime=when)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _add_step_closure() -> Any:
    """torch_xla's ``xm.add_step_closure`` (imported on the first use, not with this module: ranks log without it)."""
    global _step_closures
    if _step_closures is None:
        import torch_xla.core.xla_model as xm

        _step_closures = xm.add_step_closure
    return _step_closures


def _need_graphs(held: list[Held]) -> list[bool]:
    """For each held value: whether reading it would run a graph (torch_xla's own check, no sync)."""
    import torch_xla

    try:
        return list(torch_xla._XLAC._check_tensor_need_materialization([entry[2] for entry in held]))
    except Exception:  # another torch_xla's API: read them all
        return [False] * len(held)


def _read(held: list[Held], counted: bool) -> list[tuple[int, str, float, float]]:
    """Device values, read in one transfer; ``counted``: the transfer is ours, not the cell's."""
    global own_transfers
    import torch_xla

    on_cpu = torch_xla._XLAC._xla_get_cpu_tensors([entry[2] for entry in held])
    if counted:
        with _lock:
            own_transfers += 1
    # .item() (a Python number), then float: a fifth of float(tensor)'s cost, the same value
    return [(entry[0], entry[1], float(value.item()), entry[3]) for entry, value in zip(held, on_cpu)]


def check(name: str, value: Any) -> None:
    """TypeError or ValueError unless ``value`` is one real number that log() takes (nothing is read or copied)."""
    if isinstance(value, torch.Tensor) and value.is_xla:
        _check_tensor(name, value)
    else:
        _number(name, value)


def _check_tensor(name: str, value: Any) -> None:
    if value.numel() != 1:
        raise ValueError(f"log({name}=...) takes one number, but this tensor has shape {tuple(value.shape)}: "
                         f"log a reduction of it, such as {name}.mean()")
    if value.is_complex():
        raise TypeError(f"log({name}=...) takes a real number, not a {value.dtype} tensor")


def _number(name: str, value: Any) -> float:
    """A value the rank holds, as a float; TypeError or ValueError for anything but one real number."""
    if isinstance(value, torch.Tensor):
        _check_tensor(name, value)
        return float(value.detach().reshape(()).double())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
        if value.size != 1 or not numpy.issubdtype(value.dtype, numpy.number) or \
                numpy.issubdtype(value.dtype, numpy.complexfloating):
            raise TypeError(f"log({name}=...) takes one real number, not an array of {value.dtype} "
                            f"with shape {value.shape}")
        return float(value.reshape(()))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"log({name}=...) takes a number, a one-element tensor or array, not "
                    f"{type(value).__name__} ({_short(value)}); log numbers only, and print() anything else")


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        return "?"
    return text if len(text) <= 40 else text[:37] + "..."


def log(step: Any = None, **values: Any) -> None:
    """Record ``values`` (names to numbers or one-element tensors) at ``step`` (default: this rank's next)."""
    logger = current()
    if logger is None:
        raise RuntimeError("log() records values inside a %%xla_spawn cell; this is not a rank serving one")
    logger.log(step, values)
