"""A run's log: everything a run showed, kept on disk as it arrives. Runs in the kernel, and in any process
that reads a log (a later kernel, a script).

The log is the one path of a background run's output: the kernel appends
what the run shows, and both the live display under the run's cell and
every replay (``show()``, ``%xla_run show``) are read from it, so a replay
can never differ from what was shown.

Format: UTF-8 JSON lines, one object per line, each a complete line once
written (a reader that meets a line without its newline waits for the rest).

- the first line, the run: ``{"log": 1, "run": ID, "cell": SOURCE, "pool": TEXT, "started": UNIX_TIME}``;
- what the run wrote, as the cell showed it (each rank's lines tagged ``[rank N]``, the kernel's own lines
  such as errors, the watchdog and the XLA report untagged): ``{"t": SECONDS, "stream": "stdout" | "stderr",
  "text": TEXT}``, ``t`` counted from ``started``;
- what it displayed: ``{"t": SECONDS, "display": MIMEBUNDLE, "metadata": {...}, "id": DISPLAY_ID | null,
  "update": BOOL}`` (``update``: a new state of the display ``id``, as a progress line's);
- once, if the log reached its bound: ``{"t": SECONDS, "cut": BYTES}``; nothing but the end follows;
- the last line, once the run ended: ``{"t": SECONDS, "end": STATE, "duration": SECONDS}``, STATE being
  ``done``, ``failed`` or ``interrupted``.

A log is bounded (:data:`LIMIT` bytes); a session keeps the last :data:`KEPT` runs' logs.

A run in a kept pool may outlive the kernel that wrote its log: that kernel
stops writing without an end (:meth:`LogWriter.detach`), and the kernel that
attaches next goes on appending to the same log (:meth:`LogWriter.resume`),
after cutting a line the first one may have left half written.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any, Callable, Iterator

LIMIT = 64 * 2**20  # bytes one run's log may hold; what comes after is counted, not kept
KEPT = 50  # runs whose logs a session keeps
FORMAT = 1
ENDED = ("done", "failed", "interrupted")


class LogWriter:
    """The one writer of one run's log; every entry is flushed as it is written, so readers see it at once."""

    def __init__(self, path: str, run_id: int, cell: str, pool: str, started: float | None = None,
                 limit: int | None = None) -> None:
        self.path = path
        self.started = time.time() if started is None else started
        self.limit = LIMIT if limit is None else limit
        self.size = 0
        self.cut = False
        self.ended = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._file: IO[str] = os.fdopen(fd, "w", encoding="utf-8")
        self._append({"log": FORMAT, "run": run_id, "cell": cell, "pool": pool, "started": self.started})

    @classmethod
    def resume(cls, path: str) -> LogWriter:
        """The writer of a log another process began (a kept pool's run, its kernel gone): appends after its
        last whole line."""
        writer = cls.__new__(cls)
        with open(path, "rb+") as raw:
            data = raw.read()
            whole = data.rfind(b"\n") + 1
            raw.truncate(whole)
        head = json.loads(data[: data.find(b"\n")].decode("utf-8"))
        writer.path, writer.started, writer.limit = path, float(head["started"]), LIMIT
        writer.size, writer.cut, writer.ended = whole, b'"cut":' in data[:whole], False
        writer._file = open(path, "a", encoding="utf-8")
        return writer

    def detach(self) -> None:
        """Stop writing, without an end: the run goes on without this process (a kept pool's)."""
        if not self.ended:
            self.ended = True
            self._file.close()

    def stream(self, name: str, text: str) -> None:
        self._entry({"stream": name, "text": text})

    def display(self, data: dict[str, Any], metadata: dict[str, Any] | None = None, display_id: str | None = None,
                update: bool = False) -> None:
        self._entry({"display": data, "metadata": metadata or {}, "id": display_id, "update": update})

    def end(self, state: str, duration: float) -> None:
        if not self.ended:
            self.ended = True
            self._append({"t": round(time.time() - self.started, 3), "end": state, "duration": round(duration, 3)})
            self._file.close()

    def _entry(self, entry: dict[str, Any]) -> None:
        if self.cut or self.ended:
            return
        line = json.dumps({"t": round(time.time() - self.started, 3), **entry}, ensure_ascii=False)
        if self.size + len(line) > self.limit:
            self.cut = True
            self._append({"t": round(time.time() - self.started, 3), "cut": self.size})
            return
        self._append(line)

    def _append(self, entry: dict[str, Any] | str) -> None:
        line = entry if isinstance(entry, str) else json.dumps(entry, ensure_ascii=False)
        self._file.write(line + "\n")
        self._file.flush()
        self.size += len(line) + 1


def follow(path: str, stop: Callable[[], bool] = lambda: False, every: float = 0.05,
           idle: Callable[[], None] | None = None) -> Iterator[dict[str, Any]]:
    """Every entry of the log at ``path``, in order, the head first; then, live, each new one as it is written,
    until the end entry (the last one yielded) or until ``stop()`` says so between polls.

    ``idle`` is called at each poll that found nothing new (a waiter answers a rank's question there).
    Works from any process that can read the file.
    """
    with open(path, encoding="utf-8") as log:
        partial = ""
        while True:
            chunk = log.readline()
            if chunk:
                partial += chunk
                if not partial.endswith("\n"):
                    continue  # the writer is between its write and its newline: the rest comes
                entry = json.loads(partial)
                partial = ""
                yield entry
                if "end" in entry:
                    return
                continue
            if stop():
                return
            if idle is not None:
                idle()
            time.sleep(every)


def read(path: str) -> list[dict[str, Any]]:
    """The log's entries written so far (without following it)."""
    entries = []
    for entry in follow(path, stop=lambda: True):
        entries.append(entry)
    return entries


def text(entries: list[dict[str, Any]]) -> str:
    """What a log's stream entries showed, in order (stdout and stderr together)."""
    return "".join(entry["text"] for entry in entries if "stream" in entry)
