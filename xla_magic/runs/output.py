"""Tagged rank output: each rank's byte streams made into tagged lines for a run's sink. Runs in the kernel and in each host's engine.

Every line a rank writes is shown as ``[rank N] line``; stderr lines go to
the cell's stderr with the tag in red. A ``\\r`` rewrites the rank's current
line (progress bars), so only a line's final state is printed; in a notebook
the line in progress is shown live in a small per-rank display area.

When a run prints more than a notebook can bear, the rest of each rank's
lines goes to a log file per rank (which also holds the lines shown), and the
cell says where.
"""

from __future__ import annotations

import codecs
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import IO, Callable

RED = "\x1b[31m"
RESET = "\x1b[0m"
DEFAULT_LINES_PER_RANK = 1000


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
        write: Callable[[str, str], None] | None = None,
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
        self._out = write or _print  # (stream, text): the run's sink, or this process's own streams

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
        self._out(state.stream, prefix + ("\n" + prefix).join(lines) + "\n")

    def _fold(self, state: _RankStream, lines: list[str]) -> None:
        if state.log is None:
            if self._dir is None:
                self._dir = self._log_dir()
            path = os.path.join(self._dir, f"{self.log_stem(state.rank)}.{state.stream}.log")
            state.log = open(path, "w", encoding="utf-8")
            state.log.write("\n".join(state.held) + "\n")
            state.held = []
            self._out(
                state.stream,
                f"{tag(state.rank, state.stream, self.label)}... more {state.stream} than a notebook can "
                f"show; every line goes to {path}\n"
            )
        state.log.write("\n".join(lines) + "\n")

    def _update_live(self, state: _RankStream) -> None:
        if self._live is not None and "\r" in state.partial:
            self._live(state.rank, settle_carriage_returns(state.partial))


def _print(stream: str, text: str) -> None:
    (sys.stderr if stream == "stderr" else sys.stdout).write(text)
