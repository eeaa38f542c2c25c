"""Where checkpoints are written and how they are committed: a local disk or an fsspec URL. Runs in a rank.

Every file goes through :class:`Storage`, the one place that knows whether
DIR is a local path (os: write, fsync, rename) or an fsspec URL (``gs://``:
no atomic rename, the manifest written last is the commit). Serialising and
writing happen on one thread of the rank's own (:class:`Writer`), which holds
at most one checkpoint at a time: a save that comes due while the last one is
still being written waits for it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable

from xla_magic.wire import checkpoint_layout as layout

COMMIT_WAIT = 120.0  # how long rank 0 waits for the other ranks' parts of a checkpoint before it gives it up


class Refused(ValueError):
    """checkpoints(DIR) cannot use DIR: the message says why."""


class Storage:
    """DIR, local (``os``) or an fsspec filesystem; paths are relative to DIR."""

    def __init__(self, directory: str) -> None:
        self.url = str(directory)
        self.fs: Any = None
        if "://" in self.url and not self.url.startswith("file://"):
            try:
                import fsspec
            except ImportError:
                raise Refused(f"checkpoints({self.url!r}): a URL needs fsspec (and, for gs://, gcsfs) where the "
                              f"ranks run: pip install fsspec gcsfs") from None
            try:
                self.fs, self.root = fsspec.core.url_to_fs(self.url)
            except (ImportError, ValueError) as exc:
                raise Refused(f"checkpoints({self.url!r}): fsspec cannot open it ({exc}); for gs:// "
                              f"pip install gcsfs") from None
        else:
            self.root = os.path.abspath(os.path.expanduser(self.url.removeprefix("file://")))

    @property
    def local(self) -> bool:
        return self.fs is None

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if not self.local else os.path.join(self.root, *parts)

    def check_writable(self) -> None:
        """Refused naming the reason unless a file can be made, written and removed under DIR."""
        probe = f".probe-{os.getpid()}-{threading.get_ident()}"
        try:
            self.makedirs("")
            self.write_bytes(probe, b"ok", sync=False)
            self.remove(probe)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise Refused(f"checkpoints({self.url!r}): cannot write there: {reason}"
                          f"{f' ({exc.filename})' if exc.filename else ''}") from None

    def makedirs(self, relative: str) -> None:
        if self.local:
            os.makedirs(self.path(relative) if relative else self.root, exist_ok=True)
        else:
            self.fs.makedirs(self.path(relative) if relative else self.root, exist_ok=True)

    def listdir(self, relative: str = "") -> list[str]:
        try:
            if self.local:
                return os.listdir(self.path(relative) if relative else self.root)
            return [entry.rstrip("/").rsplit("/", 1)[-1]
                    for entry in self.fs.ls(self.path(relative) if relative else self.root, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, relative: str) -> bool:
        return os.path.exists(self.path(relative)) if self.local else self.fs.exists(self.path(relative))

    def read_bytes(self, relative: str) -> bytes:
        if self.local:
            with open(self.path(relative), "rb") as file:
                return file.read()
        return self.fs.cat_file(self.path(relative))

    def write_bytes(self, relative: str, data: bytes, sync: bool = True) -> None:
        with self.open_write(relative) as file:
            file.write(data)
            self.sync(file, sync)

    def open_write(self, relative: str) -> Any:
        return open(self.path(relative), "wb") if self.local else self.fs.open(self.path(relative), "wb")

    def sync(self, file: Any, sync: bool = True) -> None:
        if self.local and sync:
            file.flush()
            os.fsync(file.fileno())

    def sync_dir(self, relative: str = "") -> None:
        if self.local:
            descriptor = os.open(self.path(relative) if relative else self.root, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

    def write_json(self, relative: str, value: Any) -> None:
        """A JSON file written whole or not at all (a temporary name renamed, on a local disk)."""
        data = json.dumps(value, indent=1, sort_keys=True).encode()
        if not self.local:
            self.write_bytes(relative, data)
            return
        temporary = relative + ".tmp"
        self.write_bytes(temporary, data)
        os.replace(self.path(temporary), self.path(relative))

    def read_json(self, relative: str) -> Any:
        try:
            return json.loads(self.read_bytes(relative))
        except (OSError, ValueError):
            return None

    def rename(self, source: str, target: str) -> None:
        if self.local:
            os.rename(self.path(source), self.path(target))
        else:
            self.fs.mv(self.path(source), self.path(target), recursive=True)

    def remove(self, relative: str) -> None:
        try:
            if self.local:
                os.remove(self.path(relative))
            else:
                self.fs.rm(self.path(relative))
        except FileNotFoundError:
            pass

    def remove_tree(self, relative: str) -> None:
        try:
            if self.local:
                shutil.rmtree(self.path(relative))
            else:
                self.fs.rm(self.path(relative), recursive=True)
        except FileNotFoundError:
            pass

    def entries(self) -> list[layout.Entry]:
        """The checkpoints in DIR, oldest step first (their manifests read, their files not checked)."""
        found = []
        for name in self.listdir():
            if layout.entry(name, None) is not None:  # a checkpoint's name, complete or not
                found.append(layout.entry(name, self.read_json(f"{name}/{layout.MANIFEST}")))
        return sorted(found, key=lambda item: (item.step, item.complete))  # type: ignore[union-attr]


class _Hashing(io.RawIOBase):
    """A file that counts and hashes what is written through it (torch.save writes here)."""

    def __init__(self, file: Any) -> None:
        self.file, self.hash, self.size = file, hashlib.sha256(), 0
        self.failed: OSError | None = None  # torch.save turns a failed write into its own RuntimeError

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        try:
            self.file.write(view)
        except OSError as exc:
            self.failed = exc
            raise
        self.hash.update(view)
        self.size += view.nbytes
        return view.nbytes


def write_file(storage: Storage, relative: str, payload: Any) -> dict[str, Any]:
    """``payload`` (host tensors and plain values) serialised by torch.save into ``relative``, fsynced: its size, sha256."""
    import torch

    with storage.open_write(relative) as file:
        hashing = _Hashing(file)
        try:
            torch.save(payload, hashing)
        except RuntimeError:
            if hashing.failed is not None:
                raise hashing.failed from None  # the disk's reason (a full disk), not torch's report of it
            raise
        storage.sync(file)
    return {"size": hashing.size, "sha256": hashing.hash.hexdigest()}


def read_file(storage: Storage, relative: str, expected: dict[str, Any]) -> Any:
    """The payload of a file the manifest lists; ValueError when its size or checksum differs."""
    import torch

    data = storage.read_bytes(relative)
    if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise ValueError(f"{relative}: its size or checksum differs from the manifest's")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class Job:
    """One checkpoint for one rank to write: its files, and (rank 0) the commit."""

    def __init__(self, step: int, files: dict[str, Any], manifest: dict[str, Any] | None, key: str, rank: int,
                 world_size: int, keep: int | None) -> None:
        self.step, self.files, self.manifest, self.key = step, files, manifest, key
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self.done = threading.Event()
        self.seq: Any = None  # the request whose cell saved it, for the kernel's CHECKPOINT
        self.error: BaseException | None = None
        self.committed = False


class Writer:
    """The rank's writing thread: one checkpoint at a time, off the cell's thread.

    ``say`` prints once per kind of trouble (a full disk said at every save
    would bury the cell's output).
    """

    def __init__(self, storage: Storage, say: Callable[[str, str], None],
                 committed: Callable[[Job], None] | None = None) -> None:
        self.storage = storage
        self.say = say
        self.committed = committed  # told (on this thread) of each checkpoint rank 0 completed
        self.pending: Job | None = None
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.closed = False

    def submit(self, job: Job) -> None:
        with self._lock:
            self.pending = job
            self._ready.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="xla_magic-checkpoints", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the checkpoint being written is written (or given up); False if it still is after ``timeout``."""
        job = self.pending
        return job is None or job.done.wait(timeout)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while (self.pending is None or self.pending.done.is_set()) and not self.closed:
                    self._ready.wait()
                if self.closed and (self.pending is None or self.pending.done.is_set()):
                    return
                job = self.pending
            try:
                self._write(job)
            except BaseException as exc:  # a full disk, a storage error: the run goes on, said once
                job.error = exc
                self._failed(job, exc)
            finally:
                job.done.set()

    def _write(self, job: Job) -> None:
        storage = self.storage
        partial = layout.partial_name(job.step, job.key)
        if storage.local:
            storage.makedirs(partial)
            where = partial
        else:  # no atomic rename on object storage: written in place, and the manifest written last commits it
            where = layout.step_name(job.step)
            storage.makedirs(where)
        written = {name: write_file(storage, f"{where}/{name}", payload) for name, payload in job.files.items()}
        storage.write_json(f"{where}/{layout.part_file(job.rank)}", written)
        storage.sync_dir(where)
        if job.manifest is not None:
            self._commit(job, where)

    def _commit(self, job: Job, where: str) -> None:
        """Rank 0: once every rank's part is there, the manifest, then (on a local disk) the rename."""
        storage = self.storage
        parts = [layout.part_file(rank) for rank in range(job.world_size)]
        deadline = time.monotonic() + COMMIT_WAIT
        while True:
            present = set(storage.listdir(where))
            missing = [rank for rank, name in enumerate(parts) if name not in present]
            failed = [rank for rank in range(job.world_size) if f"rank-{rank}.failed" in present]
            if failed:
                raise _Abandoned(f"rank {failed[0]} could not write its part")
            if not missing:
                break
            if time.monotonic() > deadline:
                raise _Abandoned(f"rank {missing[0]} never wrote its part (its cell did not call save({job.step}, "
                                 f"...) within {COMMIT_WAIT:.0f} s)")
            time.sleep(0.02)
        files: dict[str, Any] = {}
        for name in parts:
            files.update(storage.read_json(f"{where}/{name}") or {})
        storage.write_json(f"{where}/{layout.MANIFEST}", dict(job.manifest or {}, files=files))
        storage.sync_dir(where)
        final = layout.step_name(job.step)
        if storage.local:
            if storage.exists(final):  # an older run's checkpoint of the same step: replaced by this complete one
                aside = f".old-{final}-{job.key}"
                storage.rename(final, aside)
                storage.rename(where, final)
                storage.remove_tree(aside)
            else:
                storage.rename(where, final)
            storage.sync_dir()
        job.committed = True
        if job.keep is not None:
            self._keep(job)
        if self.committed is not None:
            self.committed(job)

    def _keep(self, job: Job) -> None:
        """keep=K: now that step ``job.step`` is complete, the complete ones beyond the K newest and older partials go."""
        entries = self.storage.entries()
        complete = [item for item in entries if item.complete and item.step <= job.step]
        old = complete[:-job.keep] if job.keep else []
        newest_kept = complete[-job.keep].step if len(complete) >= job.keep else None
        stale = [item for item in entries if not item.complete and item.step < job.step
                 and (newest_kept is None or item.step < newest_kept)]
        for item in old + stale:
            self.storage.remove_tree(item.name)

    def _failed(self, job: Job, exc: BaseException) -> None:
        storage = self.storage
        where = layout.partial_name(job.step, job.key) if storage.local else layout.step_name(job.step)
        try:  # nothing of it left to be loaded, and rank 0 told not to wait for this rank
            for name in job.files:
                storage.remove(f"{where}/{name}")
            storage.remove(f"{where}/{layout.part_file(job.rank)}")
            if job.manifest is not None:
                storage.remove_tree(where)
            else:
                storage.write_bytes(f"{where}/rank-{job.rank}.failed", b"", sync=False)
        except OSError:
            pass
        if job.manifest is None:
            return  # another rank's failure: rank 0, which then cannot commit the checkpoint, says it
        if isinstance(exc, _Abandoned):
            self.say("abandoned", f"checkpoints: step {job.step} was not saved: {exc}; the run goes on")
        elif isinstance(exc, OSError):
            reason = exc.strerror or str(exc)
            self.say("oserror", f"checkpoints: step {job.step} could not be written to {storage.url}: {reason}. "
                                f"The run goes on without it; no partial checkpoint is left to be loaded "
                                f"(said once; later failures are not said)")
        else:
            self.say("error", f"checkpoints: step {job.step} could not be written: {type(exc).__name__}: {exc}")


class _Abandoned(Exception):
    """Rank 0 gives up committing a checkpoint that another rank did not write."""


def tell(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
