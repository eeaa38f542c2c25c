"""SIGINT in a rank stops the rank's cell and nothing else. Runs in a rank.

A rank is either the main thread of its own process (the cpu backend) or a
thread of a process it shares (the tpu launch path with several devices per
process: v2/v3's two cores, or PJRT_DEVICE=CPU's threads). A signal only
ever reaches a process's main thread, so the handler raises KeyboardInterrupt
there itself, and in a rank thread as an asynchronous exception, which a
thread blocked in native code (an XLA compile, ``.item()``, ``time.sleep``)
only notices once that call returns.

torch_xla's xmp.spawn calls its function in a worker thread even where its
process has one device (every chip of a v4 and later: ``_run_thread_per_device``
in ``torch_xla/_internal/pjrt.py``), while the process's main thread waits
for that thread. Such a rank hands itself to the main thread
(:func:`on_main_thread`), so it is interrupted as a process of its own is.

A rank wraps each request it answers (a one-shot run, or one pool request)
in :class:`Request`, and the user's code in :class:`Cell`:

- during the request, before its cell: SIGINT is remembered and the cell
  does not run (it raises KeyboardInterrupt as it would have begun);
- in the cell: the first SIGINT raises KeyboardInterrupt; later ones are
  ignored, so the cell's ``except KeyboardInterrupt`` and ``finally`` blocks
  run undisturbed (the kernel escalates by killing, not by more SIGINTs,
  and so may repeat a SIGINT to reach a rank that was not yet listening);
- outside any request (an idle pool rank): SIGINT is ignored, since it can
  only be late news of a request that has already ended.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from typing import Any, Callable

# What each rank thread of this process is doing; idle ranks are absent.
BUSY = "busy"  # answering a request, outside its cell
INTERRUPTED = "interrupted"  # SIGINT came before the cell began: it will not run
IN_CELL = "in cell"
STOPPING = "stopping"  # the cell has been sent its KeyboardInterrupt
_activity: dict[int, str] = {}
_activity_lock = threading.RLock()  # re-entered when the handler runs on a rank's own thread


def install_handler() -> None:
    """Let SIGINT interrupt the cells that this process's ranks run.

    Call from the main thread. Processes forked afterwards inherit the
    handler, which is how xmp.spawn's worker processes (and so the tpu
    launch path's rank threads) get it.
    """
    signal.signal(signal.SIGINT, _on_interrupt)


# A rank thread asks its process's main thread to run it with this signal (on_main_thread); Linux's
# real-time signals (a TPU host's), none elsewhere.
HANDOFF = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
_handed: list[Callable[[], None]] = []  # the work handed to the main thread, oldest first


def allow_handoff() -> None:
    """Let a rank thread of a process forked from here hand its work to that process's main thread.

    Call from the main thread, before the fork (xmp.spawn's worker processes inherit it)."""
    if HANDOFF is not None:
        signal.signal(HANDOFF, _run_handed)


def can_hand_off() -> bool:
    """Whether this process's main thread takes work handed to it (allow_handoff ran before it was forked)."""
    return HANDOFF is not None and signal.getsignal(HANDOFF) is _run_handed


def _run_handed(signum: int, frame: Any) -> None:
    while _handed:
        _handed.pop(0)()


def on_main_thread(work: Callable[[], Any]) -> Any:
    """Run ``work()`` on this process's main thread and return (or raise) what it did; call from another thread.

    The main thread must be waiting in Python code that lets signal handlers run
    (torch_xla's wait for its device threads is a lock's acquire, which does):
    it runs ``work`` in the handler of :data:`HANDOFF`, sent to that thread alone,
    for as long as ``work`` takes, then goes back to its wait."""
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # raised in the calling thread instead
            outcome.append((False, exc))
        finally:
            done.set()

    _handed.append(run)
    signal.pthread_kill(threading.main_thread().ident, HANDOFF)
    done.wait()
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def _on_interrupt(signum: int, frame: Any) -> None:
    me = threading.get_ident()
    interrupt_me = False
    with _activity_lock:
        for ident, doing in list(_activity.items()):
            if doing == BUSY:
                _activity[ident] = INTERRUPTED
            elif doing == IN_CELL:
                _activity[ident] = STOPPING
                if ident == me:
                    interrupt_me = True
                else:
                    _set_async_exception(ident, KeyboardInterrupt)
    if interrupt_me:
        raise KeyboardInterrupt


def _set_async_exception(ident: int, exc_type: type[BaseException] | None) -> None:
    """Raise ``exc_type`` in thread ``ident`` at its next bytecode; None clears a pending one."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)


class Request:
    """The stretch of answering one request: SIGINT then stops its cell, if any."""

    def __enter__(self) -> None:
        with _activity_lock:
            _activity[threading.get_ident()] = BUSY

    def __exit__(self, *exc_info: Any) -> None:
        with _activity_lock:
            _activity.pop(threading.get_ident(), None)


class Cell:
    """The stretch of a request during which SIGINT raises KeyboardInterrupt in the cell."""

    def __enter__(self) -> None:
        me = threading.get_ident()
        with _activity_lock:
            if _activity.get(me) == INTERRUPTED:
                raise KeyboardInterrupt  # the interrupt came while the cell was being prepared
            _activity[me] = IN_CELL

    def __exit__(self, *exc_info: Any) -> None:
        me = threading.get_ident()
        with _activity_lock:
            _activity[me] = BUSY
            if me != threading.main_thread().ident:
                _set_async_exception(me, None)  # one that was sent as the cell ended
