"""The kernel's handle on its launcher process, and the session's private directory. Runs in the kernel.

Runs in the kernel. The launcher (``python -m xla_magic.launcher``) is started
here with one end of a socket pair; jobs go to it with their sockets attached
(SCM_RIGHTS), and nothing listens on any port.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any


from xla_magic.cell import place
from xla_magic.wire import protocol, transport
from xla_magic.wire.help import see

READY_TIMEOUT = 300.0
SUBMIT_TIMEOUT = 60.0  # for the launcher to take a job and say STARTED
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # xla_magic/, above ranks/


# --- the session's private directory ----------------------------------------


class PrivateDir:
    """A directory of the session that only this user can enter.

    It holds each launcher's files, each run's gloo store (removed when the run
    ends) and the folded rank logs whose paths a cell printed (kept until the
    session closes). Made at first use; removed by :meth:`close`, when it is
    collected, or when the kernel exits.
    """

    SUFFIX = "session-"

    def __init__(self) -> None:
        self._path: str | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def path(self) -> str:
        if self._path is None:
            sweep_orphan_dirs()
            # Named like the kernel's shared memory: pid namespace and pid (mode 0700).
            self._path = tempfile.mkdtemp(prefix=transport.kernel_prefix() + self.SUFFIX)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, ignore_errors=True)
        return self._path

    def new(self, prefix: str) -> str:
        """A new directory inside, also 0700."""
        return tempfile.mkdtemp(prefix=prefix, dir=self.path)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._path = self._finalizer = None


_SESSION_DIR = re.compile(r"^xla_magic-\d+-(\d+)-" + PrivateDir.SUFFIX)


def sweep_orphan_dirs(root: str | None = None) -> None:
    """Remove the session directories of this pid namespace's kernels that died
    without closing (SIGKILL, the OOM killer), with their stores and logs."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _SESSION_DIR.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if not name.startswith(transport.kernel_prefix(pid) + PrivateDir.SUFFIX) or transport.process_alive(pid):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


# --- the launcher -----------------------------------------------------------


class LauncherError(RuntimeError):
    """The launcher, the process that starts every rank, could not start or died starting: the message says why."""


class Launcher:
    """The long-lived ``python -m xla_magic.launcher`` process of this kernel.

    The channel carries one job at a time: a JOB, then its STARTED. From a
    job's first byte until its STARTED is read the channel is out of step, and
    whatever stops the kernel there (an interrupt, a timeout, a lost launcher)
    stops the launcher too, so that no later job reads this one's answer.
    """

    def __init__(self, workdir: PrivateDir, python: str | None = None, kept: tuple[str, str, float] | None = None
                 ) -> None:
        self.python = python or os.environ.get("XLA_MAGIC_PYTHON") or sys.executable
        self.workdir = workdir
        # A kept pool's launcher (name, its directory, --keep-idle) keeps its files in the pool's directory, which
        # outlives the kernel's; its output goes to the pool's log beside that directory.
        self.kept = kept
        self.dir = kept[1] if kept else workdir.new("launcher-")
        self.log_path = (os.path.join(os.path.dirname(kept[1]), f"{kept[0]}.log") if kept
                         else os.path.join(self.dir, "launcher.log"))
        # What the launcher inherits; each job carries the kernel's changes since.
        self.base_environment = dict(os.environ)
        self.in_step = True
        self.info: dict[str, Any] | None = None
        self.started_at = time.time()
        try:
            self.process, self.channel = self._start()
        except BaseException as exc:
            shutil.rmtree(self.dir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise LauncherError(
                    f"could not start the launcher with {self.python}: {exc}. Point XLA_MAGIC_PYTHON "
                    f"at a Python that has torch_xla, or unset it to use the kernel's own ({sys.executable}). "
                    + see("launcher-could-not-start")
                ) from exc
            raise

    def _start(self) -> tuple[subprocess.Popen, protocol.Channel]:
        ours, theirs = socket.socketpair()
        try:
            keep = ["--keep", self.kept[0], "--keep-dir", self.kept[1], "--keep-idle", repr(self.kept[2])] \
                if self.kept else []
            with open(self.log_path, "ab" if self.kept else "wb") as log:
                process = subprocess.Popen(
                    [self.python, "-m", "xla_magic.launcher",
                     "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid()), *keep],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    env=self._environment(),
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return process, protocol.Channel(ours)

    def _environment(self) -> dict[str, str]:
        env = dict(self.base_environment)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [self._import_dir(), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Read when torch is imported: keeps gloo's "Rank N is connected to M
        # peer ranks" chatter out of every cell.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        return env

    def _import_dir(self) -> str:
        """A directory holding only a link to this very package.

        The launcher must import the kernel's xla_magic, wherever the kernel
        found it, and nothing else from there (the package's parent may be a
        whole site-packages, of another Python than the launcher's).
        """
        path = os.path.join(self.dir, "import")
        os.mkdir(path, 0o700)
        os.symlink(PACKAGE_DIR, os.path.join(path, "xla_magic"))
        return path

    def environment_changes(self) -> dict[str, Any]:
        """How the kernel's environment differs now from what the launcher inherited."""
        return place.environment_changes(self.base_environment)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        if self.info is not None:
            return self.info
        self.channel.sock.settimeout(timeout)
        try:
            event = self.channel.recv()
        except TimeoutError:
            raise LauncherError(f"the launcher did not start within {timeout:.0f} s{self._log_excerpt()}") from None
        finally:
            self.channel.sock.settimeout(None)
        if event.kind == protocol.READY:
            self.info = event.fields
            return self.info
        if event.kind == protocol.FATAL and not _not_installed(event.fields):
            raise LauncherError(import_failed(event.fields))
        if event.kind == protocol.FATAL:
            raise LauncherError(
                f"the launcher could not import torch_xla with {self.python}: "
                f"{event.fields['message']}. Install it there (locally: "
                f"pip install '.[local]' in xla_magic's clone; Colab and Kaggle TPU images ship it), "
                f"or point XLA_MAGIC_PYTHON at an interpreter that has it. " + see("launcher-no-torch-xla")
            )
        raise LauncherError(f"the launcher exited while starting{self._log_excerpt()}")

    def submit(self, job: dict[str, Any], fds: list[int]) -> int:
        """Hand a job and its sockets to the launcher; the supervisor's pid.

        The job goes with the kernel's environment changes.
        """
        self.wait_ready()
        job = {**job, "environment": self.environment_changes()}
        self.in_step = False
        try:
            self.channel.sock.settimeout(SUBMIT_TIMEOUT)
            self.channel.send_with_fds(fds, protocol.JOB, **job)
            event = self.channel.recv()
        except TimeoutError as exc:
            raise self._give_up(f"the launcher did not take the cell within {SUBMIT_TIMEOUT:g} s") from exc
        except OSError as exc:
            raise self._give_up(f"lost the launcher ({exc})") from exc
        except BaseException:
            self.stop()
            raise
        if event.kind != protocol.STARTED:
            raise self._give_up("the launcher stopped unexpectedly")
        if event.fields.get("run_id") != job["run_id"]:
            raise self._give_up(f"the launcher answered for run {event.fields.get('run_id')}, not {job['run_id']}")
        self.channel.sock.settimeout(None)
        self.in_step = True
        return event.fields["pid"]

    def _give_up(self, problem: str) -> LauncherError:
        """Stop a launcher whose channel cannot be trusted; the error that says so."""
        excerpt = self._log_excerpt()
        self.stop()
        return LauncherError(f"{problem}; it was stopped, and the next cell starts a new one{excerpt}")

    def stop(self, timeout: float = 5.0) -> None:
        """End the launcher and remove its directory. A ready launcher in step
        is asked to STOP; any other is killed (it holds nothing to tidy)."""
        try:
            if self.in_step and self.info is not None and self.alive():
                self._say_stop()
                self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.channel.close()
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _say_stop(self) -> None:
        try:
            self.channel.sock.settimeout(1.0)
            self.channel.send_with_fds([], protocol.STOP)
        except OSError:
            pass  # gone already

    def _log_excerpt(self, lines: int = 20) -> str:
        """The end of the launcher's log, to quote in an error (its directory may go)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                tail = "".join(log.readlines()[-lines:])
        except OSError:
            return ""
        return f"; its log ends:\n{tail}" if tail.strip() else ""


def _not_installed(fatal: dict[str, Any]) -> bool:
    """Whether the launcher's import failed because torch or torch_xla is not there at all."""
    missing = fatal.get("missing") or ""
    return missing.split(".")[0] in ("torch", "torch_xla")


METADATA_SERVER = "metadata.google.internal"


def import_failed(fatal: dict[str, Any]) -> str:
    """torch_xla is installed and its import raised: that error first, its cause, then what to do."""
    cause = fatal.get("cause")
    said = f"the launcher's import of torch_xla failed with {fatal['python']}: {fatal['message']}"
    if cause and cause not in fatal["message"]:
        said += f" (caused by {cause})"
    if METADATA_SERVER in fatal.get("traceback", "") or "TPU metadata" in fatal["message"]:
        return (said + f". torch_xla saw TPU chips on this host and asked the TPU VM's metadata server "
                f"({METADATA_SERVER}) for the slice's shape, and there is none here (a container, GKE, a VM that "
                f"is not a TPU VM). Give it the shape as GKE does: TPU_SKIP_MDS_QUERY=1 with TPU_ACCELERATOR_TYPE "
                f"(e.g. v5litepod-8), TPU_WORKER_ID=0 and TPU_WORKER_HOSTNAMES=localhost, before the first cell. "
                + see("tpu-metadata"))
    return (said + ". torch_xla is installed; its import raised, and the traceback's last lines say where:\n"
            + "".join(fatal.get("traceback", "").splitlines(keepends=True)[-6:]) + see("launcher-import-failed"))
