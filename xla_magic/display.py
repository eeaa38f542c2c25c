"""Tagged rank output and rank errors, as the kernel shows them. Runs in the kernel.

Every line a rank writes is shown as ``[rank N] line``; stderr lines go to
the cell's stderr with the tag in red. A ``\\r`` rewrites the rank's current
line (progress bars), so only a line's final state is printed; in a notebook
the line in progress is shown live in a small per-rank display area.

When a run prints more than a notebook can bear, the rest of each rank's
lines goes to a log file per rank (which also holds the lines shown), and the
cell says where.
"""

from __future__ import annotations

import bdb
import codecs
import linecache
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Callable

from xla_magic.troubleshooting import see

RED = "\x1b[31m"
RESET = "\x1b[0m"
DEFAULT_LINES_PER_RANK = 1000


def in_notebook(shell: object) -> bool:
    """A Jupyter kernel's shell, where display areas and widgets render.

    ipykernel's ``ZMQInteractiveShell`` or any subclass (Colab's
    ``google.colab._shell.Shell`` is one). A shell of that kind exists only
    once ipykernel is imported, so ipykernel is never imported here.
    """
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    return zmqshell is not None and isinstance(shell, zmqshell.ZMQInteractiveShell)


def rank_label(rank: int) -> str:
    """How output and errors name a rank: ``rank N`` (an SPMD process is named ``spmd``)."""
    return f"rank {rank}"


def tag(rank: int, stream: str, label: Callable[[int], str] = rank_label) -> str:
    if stream == "stderr":
        return f"{RED}[{label(rank)}]{RESET} "
    return f"[{label(rank)}] "


def settle_carriage_returns(line: str) -> str:
    """What a terminal would show for a line containing ``\\r`` rewrites."""
    line = line.rstrip("\r")
    cut = line.rfind("\r")
    return line if cut < 0 else line[cut + 1 :]


def drop_overwritten(partial: str) -> str:
    """The unfinished line without the text a later ``\r`` already replaced.

    Keeps the ``\r`` itself, so what arrives next still overwrites; without
    this an hour of progress-bar updates would make one huge line.
    """
    cut = partial.rfind("\r", 0, len(partial) - 1)
    return partial[cut:] if cut > 0 else partial


@dataclass
class _RankStream:
    rank: int
    stream: str
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    partial: str = ""
    shown: int = 0
    held: list[str] = field(default_factory=list)
    log: IO[str] | None = None


class TaggedOutput:
    """Renders the byte streams of all ranks of one run, line by line."""

    def __init__(
        self,
        lines_per_rank: int | None = DEFAULT_LINES_PER_RANK,
        log_dir: Callable[[], str] | None = None,
        on_line: Callable[[int, str, str], None] | None = None,
        live: Callable[[int, str], None] | None = None,
        label: Callable[[int], str] = rank_label,
        log_stem: Callable[[int], str] = lambda rank: f"rank{rank}",
        quiet: Callable[[str], bool] | None = None,
    ) -> None:
        self.lines_per_rank = lines_per_rank  # None: show every line (a host relaying to the kernel, which folds)
        self.quiet = quiet  # stderr lines not to show (XLA:CPU's cache warnings, where the cache is forced on there)
        self.label = label
        self.log_stem = log_stem
        self._log_dir = log_dir or (lambda: tempfile.mkdtemp(prefix="xla_magic-logs-"))
        self._dir: str | None = None
        self._streams: dict[tuple[int, str], _RankStream] = {}
        self._on_line = on_line
        self._live = live
        self.lines = 0

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        state = self._streams.get((rank, stream))
        if state is None:
            state = self._streams[(rank, stream)] = _RankStream(rank, stream)
        text = state.partial + state.decoder.decode(data)
        if "\n" in text:
            returns = "\r" in text  # one search of the chunk, not one per line: 80,000 lines a cell add up
            *complete, text = text.split("\n")
            self._emit(state, complete, returns)
        state.partial = drop_overwritten(text)
        self._update_live(state)

    def feed_lines(self, rank: int, stream: str, lines: list[str]) -> None:
        """Whole lines, already settled (a host's relay of its ranks' lines)."""
        state = self._streams.get((rank, stream))
        if state is None:
            state = self._streams[(rank, stream)] = _RankStream(rank, stream)
        self._emit(state, lines)

    def take_partial(self, rank: int, stream: str) -> str:
        """The rank's line in progress, taken (a prompt shows it, as a terminal would before the question)."""
        state = self._streams.get((rank, stream))
        if state is None:
            return ""
        partial, state.partial = settle_carriage_returns(state.partial), ""
        return partial

    def finish(self) -> list[str]:
        """Flush lines still being written; the paths of any folded logs."""
        paths = []
        for state in self._streams.values():
            state.partial += state.decoder.decode(b"", final=True)
            if state.partial:
                self._emit(state, [state.partial])
                state.partial = ""
            if state.log is not None:
                state.log.close()
                paths.append(state.log.name)
        return sorted(paths)

    # -- internals ---------------------------------------------------------

    def _emit(self, state: _RankStream, lines: list[str], returns: bool | None = None) -> None:
        """``returns``: whether any line may hold a carriage return (None: look)."""
        if self.quiet is not None and state.stream == "stderr":
            lines = [line for line in lines if not self.quiet(line)]
            if not lines:
                return
        if returns is None:
            returns = any("\r" in line for line in lines)
        if returns:
            lines = [settle_carriage_returns(line) for line in lines]
        self.lines += len(lines)
        if self._on_line is not None:
            self._on_line(state.rank, state.stream, lines[-1])
        room = len(lines) if self.lines_per_rank is None else max(0, self.lines_per_rank - state.shown)
        shown, folded = lines[:room], lines[room:]
        if shown:
            state.shown += len(shown)
            if state.log is None and self.lines_per_rank is not None:
                state.held.extend(shown)
            self._write(state, shown)
        if folded:
            self._fold(state, folded)

    def _write(self, state: _RankStream, lines: list[str]) -> None:
        prefix = tag(state.rank, state.stream, self.label)
        out = sys.stderr if state.stream == "stderr" else sys.stdout
        out.write(prefix + ("\n" + prefix).join(lines) + "\n")

    def _fold(self, state: _RankStream, lines: list[str]) -> None:
        if state.log is None:
            if self._dir is None:
                self._dir = self._log_dir()
            path = os.path.join(self._dir, f"{self.log_stem(state.rank)}.{state.stream}.log")
            state.log = open(path, "w", encoding="utf-8")
            state.log.write("\n".join(state.held) + "\n")
            state.held = []
            out = sys.stderr if state.stream == "stderr" else sys.stdout
            out.write(
                f"{tag(state.rank, state.stream, self.label)}... more {state.stream} than a notebook can "
                f"show; every line goes to {path}\n"
            )
        state.log.write("\n".join(lines) + "\n")

    def _update_live(self, state: _RankStream) -> None:
        if self._live is not None and "\r" in state.partial:
            self._live(state.rank, settle_carriage_returns(state.partial))


class LiveLines:
    """Per-rank display areas for lines rewritten with ``\\r`` (notebooks only)."""

    def __init__(self, min_interval: float = 0.1, label: Callable[[int], str] = rank_label) -> None:
        self.label = label
        self._handles: dict[int, object] = {}
        self._last: dict[int, float] = {}
        self._min_interval = min_interval

    def __call__(self, rank: int, text: str) -> None:
        from IPython.display import display

        now = time.monotonic()
        if now - self._last.get(rank, 0.0) < self._min_interval:
            return
        self._last[rank] = now
        shown = {"text/plain": f"[{self.label(rank)}] {text}"}
        handle = self._handles.get(rank)
        if handle is None:
            self._handles[rank] = display(shown, raw=True, display_id=True)
        else:
            handle.update(shown, raw=True)

    def clear(self) -> None:
        for handle in self._handles.values():
            handle.update({"text/plain": ""}, raw=True)
        self._handles.clear()


# --- errors from ranks ------------------------------------------------------

# Known TPU-notebook failures: a pattern in a rank's error, and what to do.
KNOWN_PROBLEMS = [
    (
        r"TPU is already in use|already in use by process|device or resource busy",
        "another process holds the TPU: a previous kernel, or a process it left "
        "behind. Find it with `sudo lsof -w /dev/accel* /dev/vfio/*`, end it (or "
        "restart the runtime), then run the cell again. " + see("tpu-in-use"),
    ),
    (
        r"/dev/accel\d.*(Operation not permitted|Permission denied)|Couldn't open iommu group|"
        r"failed to open (the )?TPU|libtpu.*already (loaded|in use)",
        "libtpu is already held in this process, usually by a TPU build of "
        "TensorFlow that an import pulled in (common on Kaggle and Colab). Don't "
        "import tensorflow in %%xla_spawn cells or in modules they import, or "
        "uninstall tensorflow-tpu, then restart the kernel. " + see("accel-operation-not-permitted"),
    ),
    (
        r"Runtime is already initialized",
        "an XLA runtime was started before the ranks: keep every use of the XLA "
        "device inside %%xla_spawn cells and restart the kernel if it touched one. "
        + see("runtime-already-initialized"),
    ),
    (
        r"before processes have spawned",
        "Lightning asked for its XLA device before any rank existed: create the Trainer "
        "or Fabric inside a %%xla_spawn cell, and restart the kernel if it touched the device. "
        + see("lightning-device-before-spawn"),
    ),
    (
        # HF Trainer's default optimizer (adamw_torch_fused) on XLA tensors.
        r"`?fused=True`? requires all the params to be floating point Tensors of supported devices",
        "torch's fused AdamW does not run on XLA devices, and it is the HF Trainer's default "
        "optimizer: pass optim=\"adamw_torch\" to TrainingArguments (or fused=False to "
        "torch.optim.AdamW). " + see("fused-adamw"),
    ),
    # The host's memory before the device's: our own SIGKILL hint says "ran out
    # of memory", and the device advice would contradict it.
    (
        r"SIGKILL: killed|^MemoryError\b|DefaultCPUAllocator: (can't allocate|not enough memory)",
        "the host (not a device) probably ran out of memory: every rank holds its own copy "
        "of what it loads, so 8 ranks need 8 times the host memory. Load one rank at a time "
        "(a loop over `rank` with `strategy.barrier()`), move weights to the device right "
        "away, load in a smaller dtype, or use fewer ranks (--devices). `dmesg` or "
        "`journalctl -k` says \"Out of memory: Killed process\" when this was the cause. "
        + see("sigkill-out-of-memory"),
    ),
    # A device out-of-memory error that the rank explained (launcher/memory.py): advice by what dominates.
    (
        r"Most of it: parameters, gradients and optimizer state\.",
        "load the model in bfloat16 (model.to(torch.bfloat16)), shard it across the devices with FSDPv2 "
        "(%%xla_spawn --spmd), or use a lighter optimizer (SGD, Adafactor) than Adam's two states per "
        "parameter. " + see("oom-weights"),
    ),
    (
        r"Most of it: the graph's temporaries",
        "use a smaller batch, or gradient checkpointing (torch_xla.utils.checkpoint.checkpoint) around the "
        "largest layers. " + see("oom-temporaries"),
    ),
    (
        r"Most of it: tensors left from earlier cells",
        "del the names listed above (a sync then frees them), or %xla_pool restart. " + see("oom-leftovers"),
    ),
    (
        r"RESOURCE_EXHAUSTED|Attempting to (reserve|allocate)|Ran out of memory in memory space|"
        r"Error allocating device buffer",
        "a device ran out of memory: use a smaller batch or model, or bfloat16. " + see("resource-exhausted"),
    ),
]


def known_problem(text: str) -> str | None:
    for pattern, advice in KNOWN_PROBLEMS:
        if re.search(pattern, text, re.IGNORECASE | re.MULTILINE):
            return advice
    return None



class RemoteTraceback(Exception):
    """A rank's traceback as text; the ``__cause__`` of a RankError."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class RankFailure:
    rank: int
    type: str
    message: str
    traceback: str = ""
    exit_code: int | None = None

    def headline(self) -> str:
        """The error in one line: its type and its message's first line (a TPU compiler's runs on for pages)."""
        first = next((line for line in self.message.splitlines() if line.strip()), "") if self.message else ""
        return f"{self.type}: {first}" if first else self.type


class RankError(Exception):
    """One or more ranks failed. ``results`` holds what the healthy ranks returned."""

    SHOW_SAME = 1  # how many identical failures to show in full

    def __init__(
        self,
        failures: list[RankFailure],
        results: dict[int, object],
        summary: str = "",
        label: Callable[[int], str] = rank_label,
        where: list[str] | None = None,
    ) -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.where = where or []  # where every rank was when the request was stopped (watch.py)
        self.results = results
        self.summary = summary
        self.label = label
        self.debuggable: list[int] = []  # the failed ranks that keep their cell's frames for %debug, first failure first
        self.post_mortem: object = None  # what %debug opens (post_mortem.PostMortem), once the runner kept it
        self.debug_note = ""  # the line that says so
        self.not_kept = ""  # when no rank kept them: why, and what to do instead (post_mortem.why_not)
        ranks = ", ".join(str(f.rank) for f in self.failures)
        headline = summary or f"rank(s) {ranks} failed"
        super().__init__(f"{headline}: {self.failures[0].headline()}" if self.failures else headline)
        if self.failures and self.failures[0].traceback:
            self.__cause__ = RemoteTraceback(self.failures[0].traceback)

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def render_lines(self) -> list[str]:
        lines = [f"{RED}{type(self).__name__}{RESET}: {self.summary or 'ranks failed'}"]
        groups: dict[tuple[str, str], list[RankFailure]] = {}
        for failure in self.failures:
            groups.setdefault((failure.type, failure.message), []).append(failure)
        for same in groups.values():
            for failure in same[: self.SHOW_SAME]:
                prefix = tag(failure.rank, "stderr", self.label)
                body = failure.traceback.rstrip("\n") or failure.headline()
                lines.extend(prefix + line for line in body.splitlines())
            if len(same) > self.SHOW_SAME:
                # "ranks 1, 2"; across hosts "ranks h0 r1, h1 r2"
                others = ", ".join(self.label(f.rank).removeprefix("rank ") for f in same[self.SHOW_SAME :])
                lines.append(f"... ranks {others} failed the same way ({same[0].headline()})")
        lines.extend(self.where)
        if self.debug_note:
            lines.append(self.debug_note)
        advice = self.advice()
        if advice:
            lines.append(f"What to do: {advice}")
        return lines

    def advice(self) -> str | None:
        """What to do about a known TPU-notebook failure, if this is one."""
        for failure in self.failures:
            found = known_problem(f"{failure.headline()}\n{failure.traceback}")
            if found:
                return found
        return None

    def _render_traceback_(self) -> list[str]:
        return self.render_lines()


class DebuggerQuit(RankError, bdb.BdbQuit):
    """The user quit pdb in a rank's cell (``q``): the cell ends there, as IPython ends a plain cell, with no traceback.

    IPython takes a BdbQuit from a cell silently; the line that says so is printed as it is raised.
    """


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted (stop button) and its ranks were stopped."""

    def __init__(self, message: str, results: dict[int, object] | None = None,
                 where: list[str] | None = None) -> None:
        self.where = where or []  # where every rank was when it was stopped (watch.py)
        super().__init__("\n".join([message, *self.where]))
        self.results = results or {}

    def _render_traceback_(self) -> list[str]:
        message, *where = self.args[0].split("\n")
        return [f"{RED}RunInterrupted{RESET}: {message}", *where]


class CellSyntaxError(Exception):
    """A ``%%xla_spawn`` cell that does not compile, found before anything ran.

    IPython shows the frames a SyntaxError passed through when it leaves a
    magic (ours and IPython's own); a plain cell's shows only its line, the
    caret and the message. This shows it as the plain cell's, through
    IPython's own SyntaxTB, and keeps the SyntaxError as ``error`` (raised
    as its ``__cause__``, for anything outside IPython).
    """

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(f"{type(error).__name__}: {error.msg} ({error.filename}, line {error.lineno})")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        return get_ipython().SyntaxTB.structured_traceback(type(self.error), self.error, [])


def syntax_error_in_cell(error: SyntaxError, code: str, shell: object, magic_frame: FrameType | None) -> CellSyntaxError:
    """The cell body's syntax error, as IPython's compiler words it, placed in the notebook cell that ran the magic.

    ``code`` is the body as Python (IPython's transformation of it). IPython
    parses a plain cell with codeop's flags, under which an unclosed bracket
    at the end is "incomplete input": the body is parsed the same way, and
    that error is the one shown, where it finds one.

    ``magic_frame`` is the magic's own frame. Where the magic was run from a
    cell, which IPython compiles into one ``get_ipython().run_cell_magic(...)``
    call at the magic's line (and caches in linecache under the cell's
    filename), the error takes that filename, which IPython shows as
    ``Cell In[N]``, and the line the body's line has in the cell. Called from
    other code (``run_cell_magic`` in a script or a test), it keeps the body's own.
    """
    from IPython.core.interactiveshell import InteractiveShell

    try:
        shell.compile.ast_parse(code, filename=error.filename)
    except SyntaxError as plain:
        error = plain.with_traceback(None)
        error.__context__ = None  # raised while the first was handled: IPython would show both
    frame = magic_frame
    while frame is not None and frame.f_code is not InteractiveShell.run_cell_magic.__code__:
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    if caller is None or not isinstance(error.lineno, int):
        return CellSyntaxError(error)
    calling_line = linecache.getline(caller.f_code.co_filename, caller.f_lineno)
    if calling_line.lstrip().startswith("get_ipython().run_cell_magic("):
        shift = caller.f_lineno  # the magic's line: the body starts on the next one
        error.filename = caller.f_code.co_filename
        error.lineno += shift
        if getattr(error, "end_lineno", None) is not None:
            error.end_lineno += shift
    return CellSyntaxError(error)
