"""``checkpoints(DIR, every=..., keep=..., before=...)`` in a cell: saves off the step's path, resumed anywhere. Runs in a rank.

::

    ckpt = checkpoints("/kaggle/working/ckpt", every="10min", keep=3)
    start = ckpt.restore(model=model, opt=opt)   # loaded in place; the step to go on from (0 when none)
    for step in range(start, 20_000):
        ...
        torch_xla.sync()
        ckpt.save(step, model=model, opt=opt)    # writes only when due

The shape is torch_xla's ``CheckpointManager``
(torch_xla/experimental/distributed_checkpoint/manager.py) for the
one-process-per-chip path: ``save`` writes only when due; a due save copies
the state to the host on the step (checkpoint_state.py) and hands
serialising and writing to the rank's writing thread (checkpoint_store.py),
one checkpoint at a time; a SIGTERM makes the next ``save`` write at once and
then ends the run (``reached_preemption``). Orbax's commit: a temporary
directory, fsynced, renamed, with a manifest.

The ranks agree without a collective per step. Where a due step is known in
advance (``every=N``: steps 0, N, 2N...) each rank computes it alone. Where it
is not (a time cadence, ``before=``, a SIGTERM that reaches the ranks at
different steps) one rank opens a round on the board (a directory under DIR
every rank sees, checkpoint_layout.py); each rank's watcher thread sees it,
posts the last step its cell saved at, and once every rank has posted, every
rank takes the same step: one past the highest posted. The watcher raises
``alert`` before it reads the rank's step and ``save`` writes the step before
it reads ``alert``, so no rank can have passed that step unwarned. A ``save``
that is not due is two comparisons (under 5 us: benchmarks/bench_checkpoints.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import uuid
import weakref
from typing import Any, Iterator

from xla_magic.launcher import checkpoint_state as state_module
from xla_magic.launcher import checkpoint_store as store
from xla_magic.launcher import current, metrics
from xla_magic.wire import protocol
from xla_magic.wire import checkpoint_layout as layout

POLL = 0.1  # how often a watcher reads the board on a local disk (object storage: POLL_REMOTE)
POLL_REMOTE = 2.0
ROUND_WAIT = 120.0  # how long a save waits for every rank to post its step in a round
NEVER = math.inf

Refused = store.Refused
Mismatch = state_module.Mismatch


class Preempted(BaseException):
    """The run stopped after a SIGTERM, its checkpoint saved: not an Exception, so no ``except Exception`` keeps it going."""


_live: "weakref.WeakSet[Checkpoints]" = weakref.WeakSet()
_cell = threading.local()  # the request this thread's cell answers: its run id (for manifests), while one runs
_previous_term: Any = None


@contextlib.contextmanager
def cell(fields: dict[str, Any], namespace: dict[str, Any]) -> Iterator[None]:
    """A cell on this thread, with ``checkpoints`` among its names (unless it has its own): SIGTERM is a
    preemption while it runs; at its end, what it saved is written."""
    namespace.setdefault("checkpoints", checkpoints)
    _cell.run = str(fields.get("run_id") or fields.get("seq") or "")
    try:
        yield
    finally:
        _cell.run = None
        for ckpt in [ckpt for ckpt in list(_live) if ckpt.thread == threading.get_ident()]:
            ckpt.flush()


def checkpoints(directory: str, every: int | str | None = None, keep: int | None = None,
                before: str | float | None = None) -> Checkpoints:
    """Checkpoints in ``directory``, saved every ``every`` steps (an int) or time (``"10min"``), the ``keep`` newest kept.

    ``before="8h50m"`` also saves once before that much time has passed since
    the ranks started (Kaggle's 9-hour session). Call it on every rank, at
    the same place: it agrees once with the other ranks. A ``directory`` that
    cannot be written is refused here.
    """
    return Checkpoints(directory, every=every, keep=keep, before=before)


class Checkpoints:
    """One run's checkpoints in DIR, on this rank (every rank holds one)."""

    def __init__(self, directory: str, every: int | str | None = None, keep: int | None = None,
                 before: str | float | None = None) -> None:
        self.every_steps: int | None = None
        self.every_seconds: float | None = None
        if isinstance(every, int) and not isinstance(every, bool):
            if every < 1:
                raise ValueError(f"checkpoints(every=...) is a number of steps of 1 or more, not {every}")
            self.every_steps = every
        elif every is not None:
            self.every_seconds = layout.parse_duration(every, "checkpoints(every=...)")
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"checkpoints(keep=...) is a number of checkpoints of 1 or more, not {keep!r}")
        self.before = layout.parse_duration(before, "checkpoints(before=...)") if before is not None else None
        self.keep = keep
        strategy = current.strategy()
        self.rank = strategy.global_rank if strategy is not None else 0  # one process (SPMD) or none to agree with
        self.world_size = strategy.world_size if strategy is not None else 1
        self.device = strategy.root_device if strategy is not None else _spmd_device()
        self.storage = store.Storage(directory)
        self.storage.check_writable()
        agreed = (uuid.uuid4().hex[:16], _process_age())
        if self.rank == 0:  # the board, before the others hear of it: each checks that it sees it
            self.storage.makedirs(f"{layout.BOARD}/{agreed[0]}")
        if self.world_size > 1:
            agreed = strategy.broadcast(agreed if self.rank == 0 else None)
        self.key, age = agreed
        self.deadline = time.monotonic() - age + self.before if self.before is not None else NEVER
        self.board = f"{layout.BOARD}/{self.key}"
        if not self.storage.exists(self.board):  # several hosts, a disk of each one's own
            raise Refused(f"checkpoints({self.storage.url!r}): rank {self.rank} (on {os.uname().nodename}) does not see what "
                          f"rank 0 wrote there: DIR must be storage every host sees (a gs:// URL, a shared "
                          f"filesystem), not a disk of each host's own")
        self.thread = threading.get_ident()
        self.last = -1  # the step of this rank's last save() call: what its watcher posts in a round
        self.due = 0 if self.every_steps else NEVER  # the next cadence step (a time cadence: once agreed)
        self.alert = False  # a round is open or a step of one is ahead: every save takes the slow path
        self.extra: dict[int, str] = {}  # steps that rounds agreed on -> why ("preempt", "before", "cadence")
        self.open: set[str] = set()  # rounds this rank posted in, not yet decided
        self.posted: set[str] = set()
        self.sigterm = False
        self._lock = threading.Condition()
        self._said: set[str] = set()
        self.values: dict[str, Any] = {}  # the plain values of the checkpoint restore() loaded
        self.restored: int | None = None
        self.last_saved: int | None = None
        logger = metrics.current()  # the rank's channel to the kernel, which CHECKPOINT takes (none outside a rank)
        self._channel = logger.channel if logger is not None else None
        self.writer = store.Writer(self.storage, self._say, self._committed)
        _live.add(self)
        _listen_for_sigterm()
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self), self._stopped),
                                         name="xla_magic-checkpoint-board", daemon=True)
        self._watcher.start()
        weakref.finalize(self, _finish, self.writer, self._stopped)  # a pool's cells make many: no thread outlives one

    def close(self) -> None:
        """Write what is pending, then end this object's threads (its checkpoints stay in DIR)."""
        self.flush()
        _finish(self.writer, self._stopped)
        _live.discard(self)

    def __repr__(self) -> str:
        cadence = (f"every={self.every_steps}" if self.every_steps else
                   f"every={self.every_seconds:g}s" if self.every_seconds else "on SIGTERM")
        return f"checkpoints({self.storage.url!r}, {cadence}, keep={self.keep}) on rank {self.rank}"

    # -- saving ---------------------------------------------------------------

    def save(self, step: int, /, **state: Any) -> bool:
        """Save ``state`` at ``step`` if it is due (True when it was); call it on every rank, every step."""
        self.last = step
        if step < self.due and not self.alert:
            return False
        return self._due_save(step, state)

    def _due_save(self, step: int, state: dict[str, Any]) -> bool:
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"ckpt.save(step, ...) takes the step as a whole number, not {type(step).__name__}")
        why = None
        with self._lock:
            if self.open and not self._lock.wait_for(lambda: not self.open, ROUND_WAIT):
                self._say("round", f"checkpoints: rank {self.rank} waited {ROUND_WAIT:.0f} s for the other ranks "
                                   f"to agree on a step to save at; it goes on without them")
                self.open.clear()
            why = self.extra.pop(step, None)
            for missed in [ahead for ahead in self.extra if ahead < step]:
                self._say(f"missed{missed}", f"checkpoints: rank {self.rank} passed step {missed} without "
                                             f"calling save({missed}, ...): the ranks agreed to save it there")
                why = why or self.extra.pop(missed)
            if step >= self.due:
                if self.every_steps:
                    why = why or ("cadence" if step % self.every_steps == 0 else None)
                    self.due = (step // self.every_steps + 1) * self.every_steps
                else:
                    why = why or "cadence"
                    self.due = (self.due + self.every_cadence) if self.due == step else step + self.every_cadence
            if not self.open and not self.extra:
                self.alert = False
        if why is None:
            return False
        self._write(step, state)
        if why == "preempt":
            self._end_preempted(step)
        return True

    def _write(self, step: int, state: dict[str, Any]) -> None:
        if not self.writer.wait(0.0):
            self._say("pending", f"checkpoints: step {step} waits for step {self.writer.pending.step} to be "
                                 f"written (one checkpoint is written at a time; said once)")
            self.writer.wait()
        files: dict[str, Any] = {layout.rank_file(self.rank): {"step": step,
                                                                "random": state_module.random_state(self.device)}}
        manifest = None
        if self.rank == 0:
            files[layout.REPLICATED] = state_module.to_host(state_module.capture(state))
            manifest = {"format": layout.FORMAT, "step": step, "time": time.time(), "world_size": self.world_size,
                        "run": getattr(_cell, "run", None) or "", "names": sorted(state)}
        job = store.Job(step, files, manifest, self.key, self.rank, self.world_size, self.keep)
        logger = metrics.current()
        job.seq = logger.seq if logger is not None else None
        self.writer.submit(job)
        self.last_saved = step

    def _committed(self, job: store.Job) -> None:
        """The writing thread's, on rank 0: the kernel hears of each complete checkpoint (%xla_runs shows the last)."""
        if self._channel is None or job.seq is None:
            return
        try:
            size = sum(entry["size"] for entry in (self.storage.read_json(
                f"{layout.step_name(job.step)}/{layout.MANIFEST}") or {}).get("files", {}).values())
            self._channel.send(protocol.CHECKPOINT, seq=job.seq, step=job.step, size=size, time=time.time(),
                               path=self.storage.path(layout.step_name(job.step)))
        except (OSError, ValueError):  # the kernel went, or the manifest cannot be read back: the files stand
            pass

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was saved is written; False if still pending after ``timeout``."""
        return self.writer.wait(timeout)

    def _end_preempted(self, step: int) -> None:
        self.writer.wait()
        job = self.writer.pending
        final = self.storage.path(layout.step_name(step))
        if job is not None and job.error is None and self.rank != 0:  # rank 0 commits: wait until it has
            deadline = time.monotonic() + store.COMMIT_WAIT
            while not self.storage.exists(f"{layout.step_name(step)}/{layout.MANIFEST}") and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        if job is not None and job.error is not None:
            raise Preempted(f"preempted (SIGTERM): the run stopped at step {step}, whose checkpoint could not "
                            f"be written ({job.error}); the last complete one in {self.storage.url} is the one "
                            f"to resume from")
        raise Preempted(f"preempted (SIGTERM): the run stopped after saving step {step} to {final}; "
                        f"a new session resumes from it with ckpt.restore(...)")

    # -- restoring ------------------------------------------------------------

    def restore(self, **targets: Any) -> int:
        """Load the last complete checkpoint into ``targets`` in place; the step to go on from (0 when none).

        Plain values saved with it are in ``ckpt.values``. A checkpoint that
        does not fit a target raises Mismatch naming the first difference,
        and nothing is changed.
        """
        entries = self.storage.entries()
        skipped: list[str] = []
        chosen = saved = mine = None
        for item in reversed([item for item in entries if item.complete]):
            files = item.manifest.get("files", {})
            try:
                saved = store.read_file(self.storage, f"{item.name}/{layout.REPLICATED}", files[layout.REPLICATED])
                own = layout.rank_file(self.rank)
                mine = store.read_file(self.storage, f"{item.name}/{own}", files[own]) \
                    if item.manifest.get("world_size") == self.world_size else None
            except (KeyError, ValueError, OSError) as exc:
                skipped.append(f"step {item.step} ({exc if not isinstance(exc, KeyError) else 'a file missing'})")
                continue
            chosen = item
            break
        newer = [item for item in entries if not item.complete and (chosen is None or item.step > chosen.step)]
        skipped = [f"step {item.step} (partial: its writing never completed)" for item in newer] + skipped
        said = f"; skipped {', '.join(skipped)}" if skipped else ""
        if chosen is None:
            self._tell(f"checkpoints: none to restore in {self.storage.url}{said}: starting at step 0")
            return 0
        state_module.check(saved, targets)
        state_module.load(saved, targets)
        if mine is not None:
            state_module.set_random_state(mine["random"], self.device)
            random_said = ""
        else:
            random_said = (f"; its random state was not restored: it was saved by {chosen.manifest.get('world_size')} "
                           f"ranks and this run has {self.world_size}")
        self.values = {name: value for name, value in saved.items() if name not in targets}
        self.restored = chosen.step
        with self._lock:
            self.last = chosen.step
            if self.every_steps:
                self.due = (chosen.step // self.every_steps + 1) * self.every_steps
        self._tell(f"checkpoints: restored step {chosen.step} from {self.storage.path(chosen.name)}{said}"
                   f"{random_said}", everywhere=bool(random_said) and self.rank == 0)
        return chosen.step + 1

    def list(self) -> list[layout.Entry]:
        """The checkpoints in DIR, oldest first (complete or not)."""
        return self.storage.entries()

    # -- the board --------------------------------------------------------------

    @property
    def every_cadence(self) -> int:
        return getattr(self, "_cadence_steps", 1)

    def _post(self, name: str) -> None:
        """Join round ``name``: raise the alert, then post this rank's step (in that order: see the docstring)."""
        with self._lock:
            self.alert = True
            self.open.add(name)
        self.storage.write_json(f"{self.board}/{name}.at-{self.rank}", {"step": self.last})
        self.posted.add(name)

    def _decide(self, name: str, present: set[str]) -> None:
        steps = []
        for rank in range(self.world_size):
            if f"{name}.at-{rank}" not in present:
                return
            posted = self.storage.read_json(f"{self.board}/{name}.at-{rank}")
            if posted is None:
                return
            steps.append(int(posted["step"]))
        at = max(steps) + 1
        with self._lock:
            if name == "cadence":
                found = self.storage.read_json(f"{self.board}/cadence") or {}
                self._cadence_steps = max(1, int(found.get("every", 1)))
                self.due = at
            else:
                self.extra[at] = "preempt" if name == "preempt" or self.extra.get(at) == "preempt" else name
            self.open.discard(name)
            self.posted.add(f"{name}:decided")
            self._lock.notify_all()

    def _look(self, measure: list[Any]) -> None:
        """One look at the board (the watcher's): open rounds this rank proposes, join and decide the others'."""
        board = self.storage
        if self.sigterm and "preempt-mine" not in self.posted:
            board.write_json(f"{self.board}/preempt-{self.rank}", {"step": self.last})
            self.posted.add("preempt-mine")
            store.tell(f"checkpoints: SIGTERM on rank {self.rank}: saving at the ranks' next step, then stopping")
        if self.rank == 0:
            if self.every_seconds and "cadence-proposed" not in self.posted and (every := _calibrated(
                    self, measure)) is not None:
                board.write_json(f"{self.board}/cadence", {"every": every})
                self.posted.add("cadence-proposed")
            if time.monotonic() >= self.deadline and "before-proposed" not in self.posted:
                board.write_json(f"{self.board}/before", {"seconds": self.before})
                self.posted.add("before-proposed")
        present = set(board.listdir(self.board))
        for name in ("cadence", "before", "preempt"):
            opened = name in present or (name == "preempt" and any(n.startswith("preempt-") for n in present))
            if opened and name not in self.posted:
                self._post(name)
                present = set(board.listdir(self.board))
            if name in self.posted and f"{name}:decided" not in self.posted:
                self._decide(name, present)

    # -- saying -------------------------------------------------------------------

    def _say(self, kind: str, text: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            store.tell(text)

    def _tell(self, text: str, everywhere: bool = False) -> None:
        if self.rank == 0 or everywhere:
            store.tell(text)


def _calibrated(ckpt: Checkpoints, measure: list[Any]) -> int | None:
    """Rank 0's watcher: the time cadence as a number of steps, once the steps' pace is measured (else None).

    The pace is read from the cell's save() calls, skipping the first two
    (their compiles), over a twentieth of the cadence (1 s to 60 s).
    """
    now, last = time.monotonic(), ckpt.last
    if not measure:
        if last >= 0:
            measure.extend([last, None, None])
        return None
    if measure[1] is None:
        if last >= measure[0] + 2:
            measure[1:] = [now, last]
        return None
    window = min(max((ckpt.every_seconds or 0) / 20, 1.0), 60.0)
    if now - measure[1] < window or last <= measure[2]:
        return None
    pace = (last - measure[2]) / (now - measure[1])
    return max(1, round((ckpt.every_seconds or 0) * pace))


def _finish(writer: store.Writer, stopped: threading.Event) -> None:
    stopped.set()
    writer.close()


def _watch(owner: "weakref.ref[Checkpoints]", stopped: threading.Event) -> None:
    """A rank's watcher thread: reads the board while its checkpoints live."""
    measure: list[Any] = []
    while not stopped.is_set():
        ckpt = owner()
        if ckpt is None:
            return
        poll = POLL if ckpt.storage.local else POLL_REMOTE
        try:
            ckpt._look(measure)
        except OSError as exc:
            ckpt._say("board", f"checkpoints: cannot read the ranks' board in {ckpt.storage.url}: {exc}")
        del ckpt
        stopped.wait(poll)


def _process_age() -> float:
    """Seconds since this process started (the ranks', for before=): /proc's start time."""
    try:
        with open("/proc/self/stat") as file:
            started = int(file.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as file:
            return max(0.0, float(file.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def _spmd_device() -> Any:
    try:
        import torch_xla

        return torch_xla.device()
    except Exception:  # no runtime: a plain CPU test
        return None


def _listen_for_sigterm() -> None:
    """SIGTERM, while a cell with checkpoints runs on this process, is a preemption (else what it was before)."""
    global _previous_term
    if threading.current_thread() is not threading.main_thread():
        return  # rank threads (the tpu launch path with several per process): their process dies of SIGTERM
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        return
    _previous_term = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    running = [ckpt for ckpt in list(_live) if getattr(_cell, "run", None) is not None]
    if not running or any(ckpt.sigterm for ckpt in running):  # none to save, or a second SIGTERM: die as before
        signal.signal(signal.SIGTERM, _previous_term if _previous_term is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    for ckpt in running:  # no printing here: the handler may have interrupted a write to stderr
        ckpt.alert = True
        ckpt.sigterm = True
