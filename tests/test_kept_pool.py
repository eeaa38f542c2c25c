"""Kept pools: ranks that outlive their kernel, through real Jupyter kernels, real restarts and a real SIGKILL.

``%xla_pool start --keep NAME`` in one kernel; ``KernelManager.restart_kernel``
(which kills the kernel's process group, as Jupyter does) or SIGKILL of the
kernel; then a new kernel's ``%load_ext`` names the pool, ``%xla_pool
attach`` drives it, its old names are there, and a graph compiled before is
not compiled again (torch_xla's own counters, as the report reads them).
Idle expiry, the owner-only socket (a user made by the test, as root), one
kernel at a time and --steal, the devices-held refusal, and the refusal of
--keep across hosts. Every kept pool a test makes is ended in its teardown,
and the test checks its launcher is gone.
"""

from __future__ import annotations

import ast
import os
import pickle
import pwd
import shutil
import signal
import struct
import subprocess
import tempfile
import time

import pytest
from IPython.core.error import UsageError

from helpers import Kernel, pool_magic, wait_gone
from xla_magic.pools import kept as kept_pools
from xla_magic.runs import log as run_log
from xla_magic.wire import kept

MODEL = ("import torch\n"
         "torch.manual_seed(0)\n"
         "model = torch.nn.Linear(4, 2).to(device)\n"
         "steps = 3\n"
         "out = model(torch.ones(1, 4, device=device) * (rank + 1))\n"
         "round(out.sum().item(), 4)")
AGAIN = "out = model(torch.ones(1, 4, device=device) * (rank + 1))\nround(out.sum().item(), 4), steps"
COMPILES = "[state.xla['compiles'] for state in get_ipython()._xla_magic_session.last_cell.ranks.values()]"
WAIT = 60.0  # bound on waiting for a process to go


@pytest.fixture
def pools_home(tmp_path_factory, monkeypatch):
    """Kept pools under a folder of the test's (short: a Unix socket's path has at most 107 bytes); every pool
    left there is ended, and its launcher waited for, after the test."""
    home = tmp_path_factory.mktemp("kp")
    runtime = home / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the kernels the test starts inherit it
    try:
        yield runtime
    finally:
        for name in kept.names():
            record = kept.read_record(name) or {}
            try:
                kept_pools.end_by_name(name)
            except UsageError:
                pass
            pid = record.get("pid")
            if pid and kept.process_alive(pid):
                os.kill(pid, signal.SIGKILL)
            gone(pid)


def gone(pid: int | None) -> bool:
    """``pid`` (a kept pool's launcher, say) ended within WAIT (None: there was none)."""
    return not pid or wait_gone([pid], WAIT) == []


def ok(kernel: Kernel, code: str) -> str:
    reply, text = kernel.run(code)
    assert reply["status"] == "ok", text
    return text


def launcher_pid(name: str) -> int:
    record = kept.read_record(name)
    assert record is not None, f"no record for kept pool {name}"
    return record["pid"]


def test_a_restart_keeps_names_a_model_and_compiled_graphs(pools_home):
    first = Kernel()
    second = None
    try:
        ok(first, "%load_ext xla_magic")
        started = ok(first, "%xla_pool start --keep model --devices 2 --backend cpu")
        assert "kept as model" in started, started
        before = ok(first, "%%xla_spawn\n" + MODEL)
        assert all(count > 0 for count in ast.literal_eval(ok(first, COMPILES))), "the first run compiles"
        pid = launcher_pid("model")
        rank_pids = ast.literal_eval(ok(first, "sorted(set(get_ipython()._xla_magic_session.pool.pids.values()))"))
        old_kernel = first.pid

        first.manager.restart_kernel(now=True)  # kills the kernel's process group, as Jupyter's restart does
        assert first.pid != old_kernel and not kept.process_alive(old_kernel)
        assert kept.process_alive(pid) and all(kept.process_alive(rank) for rank in rank_pids)

        loaded = ok(first, "%load_ext xla_magic")
        assert "pool model is kept (2 ranks on the cpu backend" in loaded and "%xla_pool attach model" in loaded, \
            loaded
        listed = ok(first, "%xla_pool list")
        assert listed.startswith("model: 2 ranks on the cpu backend") and f"pid {pid}" in listed, listed
        assert "no kernel attached for" in listed, listed
        attached = ok(first, "%xla_pool attach model")
        assert "attached: kept as model" in attached, attached
        # The names the old kernel's cells made, in the same rank processes; the graph it compiled is reused.
        again = ok(first, "%%xla_spawn\n" + AGAIN)
        values = [float(part) for part in before.strip().strip("[]").split(", ")]
        assert again.strip() == str([(value, 3) for value in values]), (before, again)
        assert ok(first, COMPILES).strip() == "[0, 0]"
        assert "attached to this kernel" in ok(first, "%xla_pool list")

        # A SIGKILL of the kernel leaves it too; a new kernel attaches as well.
        os.kill(first.pid, signal.SIGKILL)
        gone(first.pid)
        second = Kernel()
        ok(second, "%load_ext xla_magic")
        ok(second, "%xla_pool attach model")
        assert ok(second, "%%xla_spawn\nsteps += 1\nsteps").strip() == "[4, 4]"
        stopped = ok(second, "%xla_pool stop model")
        assert "kept pool model stopped" in stopped or "pool stopped" in stopped, stopped
        assert gone(pid) and not any(kept.process_alive(rank) for rank in rank_pids)
        assert kept.names() == [] and (pools_home / "xla_magic" / "pools" / "model.log").exists()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_one_kernel_at_a_time_steal_and_the_devices_held_message(pools_home):
    holder, other = Kernel(), Kernel()
    try:
        ok(holder, "%load_ext xla_magic")
        ok(holder, "%xla_pool start --keep shared --devices 2 --backend cpu")
        ok(holder, "%%xla_spawn\nx = rank + 10")
        ok(other, "%load_ext xla_magic")
        # New ranks on the devices the kept pool holds are refused, naming it (never the runtime's "TPU in use").
        reply, text = other.run("%%xla_spawn --devices 2 --backend cpu\nrank")
        assert reply["status"] == "error" and "%%xla_spawn refused: kept pool shared holds the devices" in text, text
        assert "%xla_pool attach shared" in text and "%xla_pool stop shared" in text, text
        reply, text = other.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "error" and "kept pool shared holds the devices" in text, text
        # Attached elsewhere: refused, naming the holder; --steal takes it over.
        reply, text = other.run("%xla_pool attach shared")
        assert reply["status"] == "error" and f"attached to another kernel (pid {holder.pid})" in text, text
        assert "--steal" in text, text
        ok(other, "%xla_pool attach shared --steal")
        assert ok(other, "%%xla_spawn\nx").strip() == "[10, 11]"
        reply, text = holder.run("%%xla_spawn\nx")
        assert reply["status"] == "error" and f"taken over by the kernel with pid {other.pid}" in text, text
        ok(other, "%xla_pool stop shared")
        assert kept.names() == []
    finally:
        holder.close()
        other.close()


def test_a_pool_nobody_attaches_ends_itself_and_says_so(pools_home):
    kernel = Kernel()
    try:
        ok(kernel, "%load_ext xla_magic")
        ok(kernel, "%xla_pool start --keep idle --keep-idle 1 --devices 2 --backend cpu")
        pid = launcher_pid("idle")
        ok(kernel, "%%xla_spawn\nx = 1")
        assert kept.process_alive(pid)  # attached: no expiry while a kernel holds it
    finally:
        kernel.close()  # the kernel goes; the pool waits --keep-idle, then ends itself
    assert gone(pid), "the idle pool's launcher did not end"
    log = (pools_home / "xla_magic" / "pools" / "idle.log").read_text()
    assert "idle: no kernel attached for" in log and "--keep-idle 1" in log and "ending it" in log, log
    assert kept.names() == []


OTHER_USER = "xlamagic45"


@pytest.fixture
def other_user():
    """A user made for the test (root only), removed after it."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("making a user needs root and useradd")
    subprocess.run(["userdel", OTHER_USER], capture_output=True)
    subprocess.run(["useradd", "--no-create-home", OTHER_USER], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(OTHER_USER)
    finally:
        subprocess.run(["userdel", OTHER_USER], check=True, capture_output=True)


# What the other user runs, with the system's Python and nothing of ours: connect, read the one answer.
PEER = """
import pickle, socket, struct, sys
sock = socket.socket(socket.AF_UNIX)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print("cannot connect:", exc.errno)
    sys.exit(0)
data = b""
while True:
    chunk = sock.recv(65536)
    if not chunk:
        break
    data += chunk
print(repr(data))
"""


def test_only_its_owner_attaches(pools_home, other_user):
    kernel = Kernel()
    opened: dict[str, int] = {}  # each folder opened to others, with its mode before
    try:
        ok(kernel, "%load_ext xla_magic")
        ok(kernel, "%xla_pool start --keep mine --devices 2 --backend cpu")
        directory = kept.directory("mine")
        socket_path = os.path.join(directory, kept.SOCKET)
        assert os.stat(directory).st_mode & 0o777 == 0o700 and os.stat(socket_path).st_mode & 0o777 == 0o600
        listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
        assert f"pid={launcher_pid('mine')}," not in listening  # no TCP listener
        peer = ["runuser", "-u", OTHER_USER, "--", "/usr/bin/python3", "-c", PEER, socket_path]
        # The directory keeps the other user out...
        done = subprocess.run(peer, capture_output=True, text=True, timeout=WAIT)
        assert done.stdout.strip() == "cannot connect: 13", (done.stdout, done.stderr)  # EACCES
        # ...and were it opened to everyone, the pool itself refuses the peer by its uid (SO_PEERCRED).
        for path in _up_to(directory, os.path.dirname(tempfile.gettempdir().rstrip(os.sep)) or os.sep):
            opened[path] = os.stat(path).st_mode & 0o7777
            os.chmod(path, opened[path] | 0o011)
        os.chmod(socket_path, 0o666)
        done = subprocess.run(peer, capture_output=True, text=True, timeout=WAIT)
        answer = ast.literal_eval(done.stdout.strip()) if done.stdout.startswith("b") else b""
        assert answer[:1] == b"F", (done.stdout, done.stderr)
        length = struct.unpack("!I", answer[1:5])[0]
        _version, kind, fields = pickle.loads(answer[5:5 + length])
        assert kind == kept.REFUSED and "belongs to another user" in fields["message"], fields
        log = (pools_home / "xla_magic" / "pools" / "mine.log").read_text()
        assert f"refused a connection from uid {other_user.pw_uid}" in log, log
        # The owner still attaches after that (here: the kernel holding it is asked again, and says so).
        assert "already attached" in ok(kernel, "%xla_pool attach mine")
        ok(kernel, "%xla_pool stop mine")
    finally:
        for path, mode in opened.items():
            if os.path.exists(path):
                os.chmod(path, mode)
        kernel.close()


def _up_to(path: str, top: str) -> list[str]:
    """``path`` and its parents below ``top``."""
    found = []
    while path != top and path != os.path.dirname(path):
        found.append(path)
        path = os.path.dirname(path)
    return found


def test_keep_is_refused_across_hosts_and_bad_options_say_what_to_do(ip, pools_home):
    with pytest.raises(UsageError, match="--keep works on one host only") as raised:
        ip.run_line_magic("xla_pool", "start --keep x --hosts 10.0.0.2,10.0.0.3")
    assert type(raised.value) is UsageError
    with pytest.raises(UsageError, match="a kept pool's name is letters"):
        ip.run_line_magic("xla_pool", "start --keep ../x --devices 2 --backend cpu")
    with pytest.raises(UsageError, match="--keep-idle is for a kept pool"):
        ip.run_line_magic("xla_pool", "start --keep-idle 10 --devices 2 --backend cpu")
    with pytest.raises(UsageError, match="--steal goes with %xla_pool attach only"):
        ip.run_line_magic("xla_pool", "start --steal")
    with pytest.raises(UsageError, match="no kept pool named nothing"):
        ip.run_line_magic("xla_pool", "attach nothing")
    with pytest.raises(UsageError, match="no kept pool named nothing"):
        ip.run_line_magic("xla_pool", "stop nothing")
    assert kept.names() == []


def test_a_kept_pool_restarts_kept_and_stops_from_the_kernel_attached(ip, pools_home):
    started = pool_magic(ip, "start --keep again --devices 2 --backend cpu --keep-idle 600")
    try:
        assert "kept as again" in started, started
        first = launcher_pid("again")
        restarted = pool_magic(ip, "restart")
        assert "kept as again" in restarted, restarted
        assert launcher_pid("again") != first and gone(first)
        assert kept.read_record("again")["idle_limit"] == 600  # as before
        assert "attached to this kernel" in pool_magic(ip, "list")
    finally:
        pool_magic(ip, "stop")
    assert kept.names() == [] and "no kept pools" in pool_magic(ip, "list")


def test_a_cell_running_when_its_kernel_is_killed_goes_on_and_the_next_kernel_follows_it(pools_home, tmp_path):
    # A foreground cell has no log: what it printed before showed under its own cell. The attached kernel
    # adopts it as a run of its own, follows it live to its end, and then its names are there.
    flag = tmp_path / "go-on"
    first, second = Kernel(), None
    try:
        ok(first, "%load_ext xla_magic")
        ok(first, "%xla_pool start --keep busy --devices 2 --backend cpu")
        first.client.execute(f"%%xla_spawn\nimport os, time\nprint('started', flush=True)\n"
                             f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n"
                             f"print('finished', flush=True)\nx = 7")
        seen = ""
        deadline = time.monotonic() + WAIT
        while seen.count("started") < 2:  # both ranks are in the cell
            assert time.monotonic() < deadline, seen
            message = first.client.get_iopub_msg(timeout=WAIT)
            if message["msg_type"] == "stream":
                seen += message["content"]["text"]
        os.kill(first.pid, signal.SIGKILL)
        assert gone(first.pid)
        second = Kernel()
        ok(second, "%load_ext xla_magic")
        assert "running run 2 (%%xla_spawn" not in ok(second, "%xla_pool list")  # (the cell's first line is its own)
        assert "running run 2 (import os, time)" in ok(second, "%xla_pool list")
        attached = ok(second, "%xla_pool attach busy")
        assert "run 2 (import os, time) went on in kept pool busy" in attached, attached
        flag.write_text("")
        assert ok(second, "%xla_run wait 2").strip() == "", "a cell without a value"
        shown = ok(second, "%xla_run show 2")
        assert "[rank 0] finished" in shown and "[rank 1] finished" in shown, shown
        assert ok(second, "%%xla_spawn\nx").strip().endswith("[7, 7]")
        assert "running run" not in ok(second, "%xla_pool list")
        ok(second, "%xla_pool stop busy")
    finally:
        first.close()
        if second is not None:
            second.close()


RUN = """import os, time
def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.05)
for i in range(3):
    print(f'a{{i}}', flush=True)
wait_for({restarted!r})
for i in range(3):
    print(f'b{{i}}', flush=True)
open({printed!r} + str(rank), 'w').close()
wait_for({attached!r})
for i in range(3):
    print(f'c{{i}}', flush=True)
rank * 10 + 1"""


def test_a_background_run_goes_on_through_a_restart_and_the_next_kernel_replays_then_follows_it(pools_home,
                                                                                              tmp_path):
    restarted, printed, attached = tmp_path / "restarted", str(tmp_path / "printed-"), tmp_path / "attached"
    kernel = Kernel()
    try:
        ok(kernel, "%load_ext xla_magic")
        ok(kernel, "%xla_pool start --keep long --devices 2 --backend cpu")
        ok(kernel, "%%xla_spawn --bg -o run\n" + RUN.format(restarted=str(restarted), printed=printed,
                                                              attached=str(attached)))
        # The run's log is in the kept pool's directory, and holds the lines of before the restart.
        logs = pools_home / "xla_magic" / "pools" / "long" / "runs"
        deadline = time.monotonic() + WAIT
        while True:
            found = list(logs.glob("run-*.jsonl")) if logs.exists() else []
            shown = run_log.text(run_log.read(str(found[0]))) if found else ""
            if shown.count("a2") == 2:
                break
            assert time.monotonic() < deadline, shown
            time.sleep(0.05)
        assert "running run 2 (import os, time)" in ok(kernel, "%xla_pool list")

        kernel.manager.restart_kernel(now=True)
        restarted.write_text("")  # the b lines are printed while no kernel is attached: they wait in the sockets
        deadline = time.monotonic() + WAIT
        while not all(os.path.exists(printed + str(rank)) for rank in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok(kernel, "%load_ext xla_magic")
        assert "running run 2 (import os, time)" in ok(kernel, "%xla_pool list")
        chunks: list[str] = []
        reply = kernel.client.execute_interactive(
            "%xla_pool attach long", timeout=WAIT,
            output_hook=lambda msg: chunks.append(msg["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", chunks
        text = "".join(chunks)
        assert "run 2 (import os, time) went on in kept pool long" in text, text
        assert all(f"[rank {rank}] a{i}" in text for rank in range(2) for i in range(3)), text  # from the log
        attached.write_text("")
        # The rest comes under the attaching cell, live: what waited in the sockets, then what follows.
        deadline = time.monotonic() + WAIT
        while "run 2 ended after" not in text:
            assert time.monotonic() < deadline, text
            message = kernel.client.get_iopub_msg(timeout=WAIT)
            if message["msg_type"] == "stream" and message["parent_header"].get("msg_id") == reply["parent_header"][
                    "msg_id"]:
                text += message["content"]["text"]
        assert ok(kernel, "%xla_run wait 2").strip() == "[1, 11]"
        listed = ok(kernel, "%xla_runs")
        assert "import os, time" in listed and "done" in listed, listed
        shown = ok(kernel, "%xla_run show 2")
        for output in (text, shown):  # under the attaching cell, and replayed from the log
            for rank in range(2):
                lines = [line.split("] ", 1)[1] for line in output.splitlines() if line.startswith(f"[rank {rank}] ")]
                assert lines == ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"], output  # each once, in order
        assert "run 2 ended after" in shown, shown
        assert "running run" not in ok(kernel, "%xla_pool list")
        ok(kernel, "%xla_pool stop long")
    finally:
        kernel.close()


def test_a_background_run_goes_on_when_the_extension_unloads_and_a_reload_follows_it(pools_home, tmp_path):
    # The session closes (%unload_ext) while a run goes on in its kept pool: the run is left to the pool, its
    # log stops without an end, and the same kernel, loading the extension again, takes it over.
    flag = tmp_path / "go-on"
    kernel = Kernel()
    try:
        ok(kernel, "%load_ext xla_magic")
        ok(kernel, "%xla_pool start --keep again --devices 2 --backend cpu")
        ok(kernel, f"%%xla_spawn --bg\nimport os, time\nprint('one', flush=True)\n"
                   f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\nprint('two', flush=True)\nrank")
        logs = pools_home / "xla_magic" / "pools" / "again" / "runs"
        deadline = time.monotonic() + WAIT
        while True:
            found = list(logs.glob("run-*.jsonl")) if logs.exists() else []
            if found and run_log.text(run_log.read(str(found[0]))).count("one") == 2:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok(kernel, "%unload_ext xla_magic")
        assert not any("end" in entry for entry in run_log.read(str(found[0]))), "no end: the run goes on"
        ok(kernel, "%load_ext xla_magic")
        text = ok(kernel, "%xla_pool attach again")
        assert "run 2 (import os, time) went on in kept pool again" in text and "[rank 1] one" in text, text
        flag.write_text("")
        assert ok(kernel, "%xla_run wait 2").strip() == "[0, 1]"
        shown = ok(kernel, "%xla_run show 2")
        assert [line for line in shown.splitlines() if line.startswith("[rank 0]")] == ["[rank 0] one", "[rank 0] two"]
        ok(kernel, "%xla_pool stop again")
    finally:
        kernel.close()
