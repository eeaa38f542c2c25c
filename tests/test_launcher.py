"""The launcher's life: its channel, its files, its environment, whom it dies with.

Real launchers and real signals: SIGSTOP holds a launcher still where a busy
or hung one would be, SIGINT to this process is the notebook's stop button.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import psutil
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from helpers import Listening, assert_nothing_left, interrupt_when, main_thread_in
import xla_magic
from xla_magic.ranks import launcher_client
from xla_magic.ranks import policy
from xla_magic.wire import protocol, transport
from xla_magic.cell.options import Cell
from xla_magic.ranks.ranks import Ranks
from xla_magic.runs import stopping
from xla_magic.runs.runner import plan
from xla_magic.runs.errors import RankError, RunInterrupted


def own_sockets() -> set[str]:
    """The sockets this process holds open."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def open_files() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return found


def resume(launcher: launcher_client.Launcher) -> None:
    if launcher.alive():
        os.kill(launcher.pid, signal.SIGCONT)


def interrupt_once_sent(launcher: launcher_client.Launcher) -> threading.Event:
    """Press the stop button once the launcher has the job and the kernel waits for its answer (sits in recv)."""
    return interrupt_when(lambda: not launcher.in_step and main_thread_in(protocol.Channel.recv))


def test_an_interrupt_while_the_launcher_takes_a_cell_costs_the_launcher_not_the_next_cell(ip, spawn):
    """Its STARTED would otherwise be read by the next cell, which would then
    signal a dead process group on timeout, interrupt and failure."""
    session = ip._xla_magic_session
    old = session.host.ready_launcher()
    os.kill(old.pid, signal.SIGSTOP)  # takes the job into its socket buffer, never answers
    pressed = interrupt_once_sent(old)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            spawn("--devices 2", "rank")
    finally:
        resume(old)
    assert pressed.is_set()
    assert type(info.value) is RunInterrupted, repr(info.value)
    assert "the launcher was stopped" in str(info.value)
    assert not old.alive() and session.host.launcher is None
    assert session.history[-1].outcome == "interrupted"

    with pytest.raises(RankError, match="timed out after 1 s"):
        spawn("--devices 2 --timeout 1", "import time\ntime.sleep(600)")
    assert_nothing_left(ip)  # the timeout reached this cell's own ranks


def test_ranks_take_their_policy_from_their_job_and_refuse_a_job_that_names_none(ip, spawn):
    """The kernel decides one-shot or pool once and tells the ranks; they infer nothing from the job's request."""
    session = ip._xla_magic_session

    class Unnamed(policy.OneShot):
        name = "kept"  # neither protocol.ONE_SHOT nor protocol.POOL

    ranks = Ranks(plan("cpu", 2, "%%xla_spawn"), Unnamed(), "cpu", session.host.workdir)
    try:
        with capture_output(), pytest.raises(RankError) as info:
            session.host.cell(ranks, Cell("rank", backend="cpu"))
    finally:
        ranks.stop()
    text = "\n".join(info.value._render_traceback_())
    assert "the ranks could not be started" in text
    assert "a job is one-shot with its request or a pool without one, not 'kept' with a request" in text
    assert spawn("--devices 2 --backend cpu", "rank").value == [0, 1]  # a job that says so runs
    assert_nothing_left(ip)


def test_a_launcher_that_does_not_take_a_cell_is_replaced_without_leaks(ip, spawn, monkeypatch):
    session = ip._xla_magic_session
    old = session.host.ready_launcher()
    monkeypatch.setattr(launcher_client, "SUBMIT_TIMEOUT", 1.0)
    os.kill(old.pid, signal.SIGSTOP)
    try:
        with pytest.raises(UsageError, match=r"did not take the cell within 1 s.*next cell starts a new one") as info:
            spawn("--devices 2", "rank")
    finally:
        resume(old)
        monkeypatch.undo()
    assert type(info.value) is UsageError
    assert session.history[-1].outcome == "failed"  # not "running" forever (the panel's Interrupt button)
    assert not old.alive() and not os.path.exists(old.dir) and old.channel.sock.fileno() == -1
    assert spawn("--devices 2", "rank").value == [0, 1]

    # One killed from outside is noticed at the next cell: its socket and directory go too.
    dead = session.host.launcher
    psutil.Process(dead.pid).kill()
    dead.process.wait()
    assert spawn("--devices 2", "rank").value == [0, 1]
    assert session.host.launcher is not dead and session.host.launcher.alive()
    assert not os.path.exists(dead.dir) and dead.channel.sock.fileno() == -1


def test_a_bad_interpreter_fails_the_first_cell_not_load_ext(ip, spawn, monkeypatch):
    ip.run_line_magic("unload_ext", "xla_magic")
    monkeypatch.setenv("XLA_MAGIC_PYTHON", "/nonexistent/python3")
    sockets = own_sockets()
    try:
        ip.run_line_magic("load_ext", "xla_magic")  # its prewarm fails quietly
        assert "xla_spawn" in ip.magics_manager.magics["cell"]
        session = ip._xla_magic_session
        assert session.host.launcher is None
        ip.user_ns["big"] = torch.ones(1 << 20)  # 4 MiB: it travels through shared memory
        with pytest.raises(UsageError, match="/nonexistent/python3.*XLA_MAGIC_PYTHON") as info:
            spawn("--devices 2", "float(big.sum())")
        assert type(info.value) is UsageError
        # The traceback (held here, as IPython's sys.last_traceback would) keeps
        # the payload alive; its segments must be gone anyway.
        assert info.value.__traceback__ is not None
        assert transport.segment_names(transport.kernel_prefix()) == []
        assert own_sockets() == sockets
        assert os.listdir(session.host.workdir.path) == []  # no launcher directory left behind
    finally:
        ip.user_ns.pop("big", None)
        monkeypatch.undo()
        if getattr(ip, "_xla_magic_session", None) is None:
            ip.run_line_magic("load_ext", "xla_magic")
    assert spawn("--devices 2", "rank").value == [0, 1]


def test_ranks_see_the_kernel_environment_as_it_is_now(ip, spawn, monkeypatch):
    session = ip._xla_magic_session
    monkeypatch.setenv("XLA_MAGIC_TEST_DROPPED", "set before the launcher started")
    monkeypatch.setenv("XLA_MAGIC_TEST_CHANGED", "before")
    session.host.drop_launcher()
    launcher = session.host.ready_launcher()
    monkeypatch.delenv("XLA_MAGIC_TEST_DROPPED")
    monkeypatch.setenv("XLA_MAGIC_TEST_CHANGED", "after")
    monkeypatch.setenv("XLA_MAGIC_TEST_ADDED", "added later")
    cell = (
        "import os\n"
        "[os.environ.get(name) for name in ('XLA_MAGIC_TEST_DROPPED', 'XLA_MAGIC_TEST_CHANGED', "
        "'XLA_MAGIC_TEST_ADDED', 'PYTHONPATH')]"
    )
    values = spawn("--devices 2", cell).value
    import_dir = os.path.join(launcher.dir, "import")
    kernel_path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    for dropped, changed, added, pythonpath in values:
        assert (dropped, changed, added) == (None, "after", "added later")
        # Only a link to this package goes before the stdlib, not the directory it sits in.
        assert pythonpath.split(os.pathsep) == [import_dir, *kernel_path]
    assert os.listdir(import_dir) == ["xla_magic"]
    assert os.path.realpath(os.path.join(import_dir, "xla_magic")) == os.path.dirname(
        os.path.realpath(xla_magic.__file__)
    )
    assert os.path.exists(os.path.join(import_dir, "xla_magic", "launcher", "__main__.py"))

    # A pool's job is built through the launcher too.
    with capture_output():
        ip.run_line_magic("xla_pool", "start --devices 1")
    try:
        assert spawn("", "import os\nos.environ.get('XLA_MAGIC_TEST_ADDED')").value == ["added later"]
    finally:
        with capture_output():
            ip.run_line_magic("xla_pool", "stop")


def test_the_gloo_store_goes_when_the_kernel_kills_a_failing_run(ip):
    session = ip._xla_magic_session
    cell = (
        "import sys, time\n"
        "frame = sys._getframe()\n"
        "while 'store' not in frame.f_locals:\n"
        "    frame = frame.f_back\n"
        "print('store', frame.f_locals['store'], flush=True)\n"
        "if rank == 1:\n"
        "    time.sleep(0.5)\n"
        "    raise RuntimeError('boom')\n"
        "time.sleep(600)\n"
    )
    with capture_output() as captured, pytest.raises(RankError, match="boom"):
        ip.run_cell_magic("xla_spawn", "--devices 2", cell)
    stores = set(re.findall(r"\] store (\S+)", captured.stdout))
    assert len(stores) == 1, captured.stdout
    store = stores.pop()
    assert store.startswith(session.host.workdir.path + os.sep)
    assert session.host.post_mortem is not None and os.path.exists(store)  # rank 1 is kept for %debug, with its set
    session.host.release_post_mortem()  # as the next cell does
    assert not os.path.exists(store)  # the others were SIGTERMed, the kept rank let go: the kernel removed it


def test_another_interrupt_while_the_ranks_are_stopped_still_ends_the_run(ip):
    session = ip._xla_magic_session
    # The rank ignores SIGINT, so the first stop button press leaves the run
    # waiting to escalate; the second press comes during that wait.
    cell = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "for i in range(1100):\n"
        "    print(i)\n"
        "time.sleep(600)\n"
    )
    printed = threading.Event()

    def listener(record):
        if record.ranks[0].lines >= 1100:
            printed.set()

    # The first press once the rank printed it all (it ignores SIGINT by then); the second once the kernel
    # is in the escalation that the first started.
    pressed = interrupt_when(printed.is_set, then=lambda: main_thread_in(stopping.escalate))
    with Listening(session, listener), capture_output() as captured, pytest.raises(KeyboardInterrupt) as info:
        ip.run_cell_magic("xla_spawn", "--devices 1", cell)
    assert pressed.is_set()
    assert type(info.value) is RunInterrupted, repr(info.value)
    assert session.history[-1].outcome == "interrupted"
    log = re.search(r"every line goes to (\S+)", captured.stdout).group(1)
    assert log not in open_files()  # the rank's log was closed
    with open(log) as lines:
        assert lines.read().split() == [str(i) for i in range(1100)]


def test_an_interrupted_unload_still_ends_the_session(ip, spawn):
    session = ip._xla_magic_session
    run = spawn("--devices 1", "for i in range(1100):\n    print(i)")
    log = re.search(r"every line goes to (\S+)", run.stdout).group(1)
    workdir = session.host.workdir.path
    assert log.startswith(workdir + os.sep) and os.path.exists(log)  # the cell showed its path: it stays
    launcher = session.host.ready_launcher()
    os.kill(launcher.pid, signal.SIGSTOP)  # it will not answer STOP, so unloading waits for it
    pressed = interrupt_when(lambda: main_thread_in(launcher_client.Launcher.stop))  # the wait
    try:
        with pytest.raises(KeyboardInterrupt):
            ip.run_line_magic("unload_ext", "xla_magic")
    finally:
        resume(launcher)
    assert pressed.is_set()
    try:
        assert ip._xla_magic_session is None
        assert not launcher.alive()
        assert not os.path.exists(workdir)
    finally:
        ip.run_line_magic("reload_ext", "xla_magic")
    assert "xla_spawn" in ip.magics_manager.magics["cell"]
    assert spawn("--devices 2", "rank").value == [0, 1]


def test_the_session_directory_goes_when_the_kernel_exits_without_closing():
    script = (
        "from xla_magic.session import Session\n"
        "session = Session()\n"
        "launcher = session.host.ensure_launcher()\n"
        "print(session.host.workdir.path, launcher.dir, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    workdir, launcher_dir = done.stdout.split()
    assert launcher_dir.startswith(workdir + os.sep)
    assert not os.path.exists(workdir)


def test_a_killed_kernel_s_directory_is_removed_by_the_next_session():
    script = (
        "from xla_magic.session import Session\n"
        "session = Session()\n"
        "print(session.host.workdir.new('logs-1-'), flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    # The same temporary folder as this process's (conftest.py gives the tests one of their own).
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": tempfile.gettempdir()})
    try:
        logs = kernel.stdout.readline().strip()
    finally:
        kernel.kill()  # no atexit, no finalizer: the directory stays behind
        kernel.wait()
        kernel.stdout.close()
    workdir = os.path.dirname(logs)
    assert os.path.isdir(logs)
    fresh = launcher_client.PrivateDir()
    try:
        assert fresh.path != workdir
        assert not os.path.exists(workdir)
    finally:
        fresh.close()


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --pid (root, or user namespaces)")
def test_a_kernel_that_is_pid_1_keeps_its_launcher():
    """``docker run ... ipython``: the kernel is its container's first process."""
    script = textwrap.dedent(
        """
        import os
        from xla_magic.session import Session

        assert os.getpid() == 1, os.getpid()
        session = Session()
        try:
            print("RESULT", session.run_cell("rank * 10", 2, "cpu", None, False, {}, {}), flush=True)
        finally:
            session.close()
        """
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "RESULT [0, 10]" in done.stdout
