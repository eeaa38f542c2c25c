"""Process lifetime helpers (Linux). Runs in the launcher, its supervisors and the ranks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits.

    ``parent_pid`` is the parent as the parent knew itself (its pid recorded
    before the fork, or passed on the command line). If our parent is someone
    else by the time the signal is armed, it died before the call: exit now.
    PID 1 is a parent like any other (a kernel run as a container's first process).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: pipe EOF still ends us
        return
    if os.getppid() != parent_pid:
        os._exit(1)


_libc: ctypes.CDLL | None = None


def flush_c_stdio() -> None:
    """Flush C stdio buffers so printf output reaches fd 1 (before we exit, after a pool cell).

    libc is looked up once: a pool rank calls this at the end of every cell.
    """
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except (OSError, AttributeError):
        pass


def exit_code(status: int) -> int:
    """A wait status as an exit code, or minus the signal that ended it."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@contextlib.contextmanager
def silenced_stdout() -> Iterator[None]:
    """Send what native code writes to fd 1 to /dev/null for a moment."""
    sys.stdout.flush()
    flush_c_stdio()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


# --- processes a cell starts --------------------------------------------------
#
# A cell may start processes of its own: a subprocess, a forked child, a
# daemon that double-forks and calls setsid. None of them may outlive what
# started them, whatever they do to escape: a new session or process group
# escapes killpg, and a double fork escapes the parent. What no process can
# escape is its place in the tree under a child subreaper
# (PR_SET_CHILD_SUBREAPER): orphans are re-parented to the nearest subreaper
# above them instead of to init. The supervisor and every rank process are
# subreapers, so everything a cell started stays below the rank that ran it
# (then below the supervisor), and ending a tree ends it all. A cgroup would
# do the same but is rarely writable in a notebook container; this needs
# nothing but Linux >= 3.4.
#
# What "started them" is differs by policy. A one-shot rank ends, after its
# request, what that request started. A pool is a session: what its cells
# start (DataLoader workers, a multiprocessing.Pool, a server) lives until
# the pool's ranks end, and then the supervisor ends it.

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def children(pid: int | str = "self", tid: int | None = None) -> list[int]:
    """The children of one thread of ``pid`` (``tid``), or of all its threads."""
    tids = [str(tid)] if tid is not None else _threads(pid)
    found: list[int] = []
    for task in tids:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found.extend(int(child) for child in listing.read().split())
        except (OSError, ValueError):
            continue
    return found


def _threads(pid: int | str) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def end_trees(roots: Callable[[], list[int]]) -> None:
    """SIGKILL the processes ``roots()`` names and everything below them, and reap them.

    In rounds: a process forking meanwhile, or an orphan re-parented to us
    (a subreaper) as its parent dies, is met in the next round.
    """
    for _ in range(20):
        tree = descendants(roots())
        if not tree:
            return
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in tree:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not ours (yet): a grandchild, re-parented to us as its parent ends


def descendants(roots: list[int]) -> list[int]:
    """``roots`` and every process below them, parents before their children."""
    seen: list[int] = []
    todo = list(reversed(roots))
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(reversed(children(pid)))
    return seen


def _has_children() -> bool:
    """Whether this process has any child, alive or ended, without reaping one."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def _quiet_sigchld() -> Iterator[None]:
    """No SIGCHLD handler while we end a request's processes.

    torch's DataLoader installs one that raises in the rank when one of its
    workers dies by a signal; workers we kill are not its failure. Once they
    are reaped, the handler finds nothing to complain of. Only the main
    thread can change a handler (a rank thread's process shares it).
    """
    try:
        previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous if previous is not None else signal.SIG_DFL)


def end_descendants() -> None:
    """End every process below this one (a supervisor, once its ranks are gone)."""
    end_trees(children)


class ChildWatch:
    """The processes below one rank: what it keeps, and (one-shot) ending what a request started.

    It watches the children of the rank's own thread: in a rank that owns
    its process that is the main thread, where orphans land too. Those
    there before the request (what set-up started) are left alone.
    """

    def __init__(self) -> None:
        self._tid = threading.get_native_id()
        self._before: set[int] = set()

    def note_existing(self) -> None:
        self._before = set(children(tid=self._tid)) if _has_children() else set()

    def end_new(self) -> None:
        if _has_children():  # one system call in the common case: a cell that started nothing
            with _quiet_sigchld():
                end_trees(self._new)

    def end_all(self) -> None:
        """End every process below this rank (a pool's end), before the rank's own exit can wait on any."""
        if _has_children():
            with _quiet_sigchld():
                end_trees(lambda: children(tid=self._tid))

    def kept(self) -> list[int]:
        """The live processes below this rank (its children and theirs), for the status panel."""
        if not _has_children():
            return []
        return [pid for pid in descendants(children(tid=self._tid)) if _alive(pid)]

    def _new(self) -> list[int]:
        return [pid for pid in children(tid=self._tid) if pid not in self._before]
