"""What a background run's thread shows: into the run's log, then under the cell that started it. Runs in the
kernel.

A background run is followed by a thread of the kernel while other cells
run. Everything that thread shows (the ranks' tagged lines, the kernel's own
lines: errors, the watchdog, the XLA report; ``display()`` calls) is first
written to the run's log (log.py), and then shown under the run's own cell:

- streams: while a background run lives, ``sys.stdout`` and ``sys.stderr``
  are :class:`Routed`, which hands a write from a run's thread to that run's
  log and passes every write on to the stream it stands for; other threads'
  writes pass untouched. The kernel's streams are put back once no run lives.
- the cell: ipykernel (6.29 and later) lets a thread name the parent of what
  it sends (``set_thread_parent`` on its streams and on the shell's display
  publisher), so the thread's messages carry the starting cell's header and
  a front end puts them under that cell, whatever cell runs now. An older
  ipykernel (Colab's 6.17) has no such thing: there the thread's stream
  writes are sent as stream messages of their own, with the starting cell as
  their parent, on the kernel's IOPub socket, which is its own thread's and
  safe to send to from any.
- displays: the display publisher's hooks are the calling thread's own
  (``register_hook``); the thread's hook writes each display to the log and
  names the starting cell as its parent (what an older ipykernel needs).
- in a terminal IPython the lines print as they come.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from xla_magic.runs.sink import Sink

_local = threading.local()
_lock = threading.Lock()
_living = 0
_kernel_streams: dict[str, Any] = {}  # the kernel's own stdout and stderr, as they were when the first run began


class Routed:
    """``sys.stdout`` / ``sys.stderr`` while a background run lives: a run thread's writes go to its log too."""

    def __init__(self, name: str, original: Any) -> None:
        self._name = name
        self._original = original

    def write(self, text: str) -> int:
        sink = getattr(_local, "sink", None)
        if sink is not None and text:
            sink(self._name, text)
        send = getattr(_local, "send", None)
        if send is not None:  # an ipykernel whose streams cannot take a thread's parent
            if text:
                send(self._name, text)
            return len(text)
        return self._original.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def route_streams() -> None:
    """One more run lives: the kernel's streams are routed (once, for all runs)."""
    global _living
    with _lock:
        _living += 1
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(sys, name), Routed):
                _kernel_streams[name] = getattr(sys, name)
                setattr(sys, name, Routed(name, getattr(sys, name)))


def unroute_streams() -> None:
    """One run less: with none left, the kernel's own streams again (unless something replaced ours since)."""
    global _living
    with _lock:
        _living = max(0, _living - 1)
        if _living:
            return
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(stream, Routed):
                setattr(sys, name, stream._original)


def original(stream: Any) -> Any:
    return stream._original if isinstance(stream, Routed) else stream


class ThreadOutput:
    """The calling thread's output, for one run: into ``sink`` (the log) and under the cell ``parent`` names."""

    def __init__(self, shell: Any, parent: dict[str, Any] | None, stream: Callable[[str, str], None],
                 display: Callable[[dict[str, Any]], None]) -> None:
        self.shell = shell
        self.parent = parent
        self.stream = stream
        self.display = display
        self._hooked: Any = None

    def __enter__(self) -> ThreadOutput:
        _local.sink = self.stream
        if self.parent:
            streams = (original(sys.stdout), original(sys.stderr))
            for target in (*streams, getattr(self.shell, "display_pub", None)):
                if hasattr(target, "set_thread_parent"):
                    target.set_thread_parent(self.parent)  # this thread's only: a context variable
            kernel = getattr(self.shell, "kernel", None)
            if kernel is not None and not all(hasattr(stream, "set_thread_parent") for stream in streams):
                _local.send = self._send_stream
        publisher = getattr(self.shell, "display_pub", None)
        if hasattr(publisher, "register_hook"):  # ipykernel's: this thread's hooks only
            publisher.register_hook(self._hook)
            self._hooked = publisher
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream at the kernel's exit
                pass
        if self._hooked is not None:
            self._hooked.unregister_hook(self._hook)
        _local.sink = None
        _local.send = None

    def _send_stream(self, name: str, text: str) -> None:
        kernel = self.shell.kernel
        kernel.session.send(kernel.iopub_socket, "stream", {"name": name, "text": text}, parent=self.parent,
                            ident=b"stream." + name.encode())

    def _hook(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.parent:
            from jupyter_client.session import extract_header

            msg["parent_header"] = extract_header(self.parent)
        if msg.get("msg_type") in ("display_data", "update_display_data"):
            self.display(msg)
        return msg


def show(name: str, text: str) -> None:
    """``text`` under the calling run's cell, past its log: on the kernel's own stream (named parents, where the
    ipykernel takes them), or sent as the cell's own stream message (an older ipykernel's)."""
    send = getattr(_local, "send", None)
    if send is not None:
        send(name, text)
        return
    stream = _kernel_streams.get(name) or original(getattr(sys, name))
    stream.write(text)


class RunSink(Sink):
    """A background run's sink: what its requests write goes into its log (``log``) first, whatever the kernel's
    cells do meanwhile (a ``%%capture`` cell takes the kernel's streams, not the run's lines), then under the
    run's own cell; displays, charts and lines under the cell are ``shown``'s (the session's sink), written to
    the log by the thread's display hook (ThreadOutput); a rank's question is the run's to ask (``ask``)."""

    def __init__(self, shown: Sink, log: Callable[[str, str], None], ask: Callable[[dict[str, Any]], dict[str, Any]]):
        self.shown = shown
        self.notebook = shown.notebook
        self.draws_profiles = shown.draws_profiles
        self._log = log
        self._ask = ask

    def write(self, stream: str, text: str) -> None:
        if text:
            self._log(stream, text)
            show(stream, text)

    def note(self, line: str) -> None:
        self.shown.note(line)

    def live_lines(self, label: Any) -> Any:
        return self.shown.live_lines(label)

    def line_in_place(self) -> Any:
        return self.shown.line_in_place()

    def display(self, label: str, what: Any, data: Any) -> None:
        self.shown.display(label, what, data)

    def ask(self, question: dict[str, Any]) -> dict[str, Any]:
        return self._ask(question)

    def before_cell(self) -> None:
        self.shown.before_cell()

    def follow_cell(self, record: Any, per_rank: bool = False, reads_profile: bool = False) -> Any:
        return self.shown.follow_cell(record, per_rank, reads_profile)

    def show_profile(self, record: Any) -> None:
        self.shown.show_profile(record)
