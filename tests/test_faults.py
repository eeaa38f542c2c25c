"""Real faults: crashes, signals, hangs, interrupts, timeouts, floods, bad data.

Each case asserts the message, that the cell ended well within a bound (a
hang is the bug these tests exist for), that nothing the extension started
is left but the idle launcher, and that the next cell works.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import psutil
import pytest
from IPython.core.error import UsageError

from xla_magic import protocol
from xla_magic.display import RankError, RunInterrupted

HANG_BOUND = 30.0  # seconds; generous for a loaded 2-core machine


def extension_processes(ip) -> list[psutil.Process]:
    """Every live process this kernel started, except the launcher itself."""
    launcher = ip._xla_magic_session.launcher
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if launcher is not None and child.pid == launcher.pid:
                continue
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def assert_nothing_left(ip) -> None:
    deadline = time.monotonic() + 10
    while extension_processes(ip) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert extension_processes(ip) == []
    launcher = ip._xla_magic_session.launcher
    assert launcher is not None and launcher.alive(), "the launcher must survive faults"


def assert_next_cell_works(spawn) -> None:
    assert spawn("--devices 2", "rank + 1").value == [1, 2]


CRASHES = [
    pytest.param(
        "if rank == 1:\n    raise RuntimeError('boom')\nimport time; time.sleep(600)",
        [1], r"RuntimeError: boom", id="raise-while-others-sleep",
    ),
    pytest.param(
        "print('last words', flush=True)\nif rank == 0:\n    import time; time.sleep(0.3); import os; os._exit(3)\nimport time; time.sleep(600)",
        [0], r"exit code 3", id="os-exit",
    ),
    pytest.param(
        "import os, signal, time\nprint('about to die', flush=True)\ntime.sleep(0.3)\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)",
        [1], r"SIGKILL: killed; usually the host ran out of memory", id="sigkill",
    ),
    pytest.param(
        "import faulthandler, time\nif rank == 0:\n    time.sleep(0.3); faulthandler._sigsegv()\ntime.sleep(600)",
        [0], r"SIGSEGV: a native crash", id="segfault",
    ),
    pytest.param(
        "import time\nif rank == 1:\n    time.sleep(0.5)\n    raise ValueError('left the others in a collective')\nstrategy.barrier()",
        [1], r"ValueError: left the others in a collective", id="hang-in-collective",
    ),
]


@pytest.mark.parametrize("cell, failed, pattern", CRASHES)
def test_a_failing_rank_fails_the_cell_fast(ip, spawn, cell, failed, pattern):
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn("--devices 2", cell)
    took = time.monotonic() - started
    error = info.value
    assert took < HANG_BOUND
    assert error.ranks == failed
    rendered = "\n".join(error._render_traceback_())
    assert re.search(pattern, rendered), rendered
    assert f"[rank {failed[0]}]" in rendered
    record = ip._xla_magic_session.history[-1]
    assert record.outcome == "failed"
    assert {record.ranks[r].state for r in failed} == {"failed"}
    assert_nothing_left(ip)
    assert_next_cell_works(spawn)


def test_output_before_death_reaches_the_cell(ip):
    from IPython.utils.capture import capture_output

    with capture_output() as captured, pytest.raises(RankError):
        ip.run_cell_magic(
            "xla_spawn", "--devices 2",
            "import os\nprint('goodbye from', rank)\nos.write(2, b'raw stderr\\n')\nos._exit(5)",
        )
    for r in range(2):
        assert f"[rank {r}] goodbye from {r}" in captured.stdout
        assert re.search(rf"\[rank {r}\]\S* raw stderr", captured.stderr)


def test_segfault_shows_the_native_traceback(ip):
    from IPython.utils.capture import capture_output

    with capture_output() as captured, pytest.raises(RankError):
        ip.run_cell_magic("xla_spawn", "--devices 1", "import faulthandler\nfaulthandler._sigsegv()")
    assert "Segmentation fault" in captured.stderr
    assert re.search(r"\[rank 0\]\S* Fatal Python error", captured.stderr)


def test_all_ranks_failing_the_same_way_are_folded(spawn):
    with pytest.raises(RankError) as info:
        spawn("--devices 8", "raise KeyError('same everywhere')")
    error = info.value
    # Ranks slower to fail than the fail-fast grace are stopped instead; on a
    # loaded machine that can be any of them but the first.
    assert len(error.ranks) >= 2
    rendered = "\n".join(error._render_traceback_())
    assert rendered.count("KeyError: 'same everywhere'") == 2  # one traceback, one summary line
    others = ", ".join(map(str, error.ranks[1:]))
    assert f"ranks {others} failed the same way" in rendered
    assert isinstance(error.__cause__, Exception) and "KeyError" in str(error.__cause__)


def test_unpicklable_result_names_its_type_and_keeps_the_others(spawn):
    cell = "import threading\nthreading.Lock() if rank == 1 else rank * 10"
    with pytest.raises(RankError) as info:
        spawn("--devices 3", cell)
    error = info.value
    assert error.ranks == [1]
    assert "_thread.lock" in str(error)
    assert error.results == {0: 0, 2: 20}


def test_object_whose_reduce_fails_stops_before_launch(ip, spawn):
    ip.run_cell(
        "class Stubborn:\n"
        "    def __reduce__(self):\n"
        "        raise TypeError('I refuse to travel')\n"
        "stubborn = Stubborn()"
    )
    before = len(ip._xla_magic_session.history)
    with pytest.raises(UsageError, match=r"'stubborn' \(__main__\.Stubborn\).*I refuse to travel") as info:
        spawn("--devices 2", "stubborn")
    assert type(info.value) is UsageError
    assert len(ip._xla_magic_session.history) == before


def test_timeout_stops_the_ranks_and_says_so(ip, spawn):
    started = time.monotonic()
    with pytest.raises(RankError, match=r"timed out after 1 s \(--timeout\)"):
        spawn("--devices 2 --timeout 1", "import time\ntime.sleep(600)")
    assert time.monotonic() - started < HANG_BOUND
    assert ip._xla_magic_session.history[-1].outcome == "timeout"
    assert_nothing_left(ip)
    assert_next_cell_works(spawn)


def interrupt_when_running(ip, delay: float = 0.3) -> threading.Event:
    """Send SIGINT to this process once every rank of the next run is running."""
    sent = threading.Event()
    session = ip._xla_magic_session

    def listener(record):
        if not sent.is_set() and all(s.state == "running" for s in record.ranks.values()):
            sent.set()
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()

    session.listeners.append(listener)
    return sent


def test_interrupt_stops_the_ranks_and_the_next_cell_works(ip, spawn):
    session = ip._xla_magic_session
    sent = interrupt_when_running(ip)
    started = time.monotonic()
    try:
        with pytest.raises(RunInterrupted, match="interrupted; the ranks were stopped"):
            spawn("--devices 2", "import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    finally:
        session.listeners.clear()
    assert sent.is_set()
    assert time.monotonic() - started < HANG_BOUND
    assert session.history[-1].outcome == "interrupted"
    assert_nothing_left(ip)
    assert_next_cell_works(spawn)


def test_interrupt_escalates_when_ranks_ignore_sigint(ip, spawn):
    session = ip._xla_magic_session
    interrupt_when_running(ip)
    cell = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"
    try:
        with pytest.raises(RunInterrupted):
            spawn("--devices 2", cell)
    finally:
        session.listeners.clear()
    assert {s.state for s in session.history[-1].ranks.values()} == {"killed"}
    assert_nothing_left(ip)


def test_garbled_message_becomes_an_error_not_a_crash(spawn):
    # The cell finds its own events socket and writes a frame that is not an event.
    cell = (
        "import gc\n"
        "from xla_magic import protocol\n"
        "channel = next(o for o in gc.get_objects() if isinstance(o, protocol.Channel) and o.sock.fileno() >= 0)\n"
        "channel.sock.sendall(b'\\x00\\x00\\x00\\x05garbage')\n"
        "import time; time.sleep(600)"
    )
    with pytest.raises(RankError, match="garbled message") as info:
        spawn("--devices 2", cell)
    assert "ProtocolError" in "\n".join(info.value._render_traceback_())
    assert_next_cell_works(spawn)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00\x00\x03abc",  # not a pickle
        protocol.encode("output", text="x")[:-2],  # truncated (pending, not broken)
        b"\xff\xff\xff\xff" + b"x" * 10,  # absurd length
        b"\x00\x00\x00\x0c" + __import__("pickle").dumps((99, "x", {}))[:12],
        __import__("struct").pack("!I", 10) + __import__("pickle").dumps([1, 2])[:10],
    ],
)
def test_reader_turns_garbage_into_events(data):
    reader = protocol.FrameReader()
    events = reader.feed(data)
    assert all(event.kind == protocol.BROKEN for event in events)
    assert events or reader.pending() == len(data)
    later = reader.feed(protocol.encode("done"))  # never raises, whatever came before
    assert all(event.kind in (protocol.BROKEN, protocol.DONE) for event in later)


def test_reader_reassembles_frames_split_anywhere():
    frames = b"".join(protocol.encode("output", text=f"line {i}") for i in range(50))
    reader = protocol.FrameReader()
    events = []
    for i in range(0, len(frames), 7):
        events.extend(reader.feed(frames[i : i + 7]))
    assert [e.fields["text"] for e in events] == [f"line {i}" for i in range(50)]


def _listeners(pids: set[int]) -> list:
    found = []
    for conn in psutil.net_connections(kind="all"):
        if conn.pid in pids and conn.status == psutil.CONN_LISTEN:
            found.append(conn)
        elif conn.pid in pids and conn.family == socket.AF_UNIX and conn.laddr:
            found.append(conn)  # a named unix socket others could connect to
    return found


def test_no_listener_is_open_during_a_run(ip, spawn):
    """Our channel is inherited socket pairs: nothing anyone could connect to.

    gloo (only once a cell uses a collective) and the XLA runtime open ports of
    their own on loopback; this cell uses neither, so nothing may listen at all.
    """
    seen: list = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            pids = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
            seen.extend(_listeners(pids))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        spawn("--devices 2", "import time\ntime.sleep(1.5)\nrank")
    finally:
        done.set()
        watcher.join()
    assert seen == []


def test_collectives_listen_on_loopback_only(ip, spawn):
    seen: list = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            pids = {p.pid for p in psutil.Process().children(recursive=True)}
            seen.extend(c for c in _listeners(pids) if c.family != socket.AF_UNIX)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        spawn("--devices 2", "import time\nstrategy.barrier()\ntime.sleep(1.5)\nrank")
    finally:
        done.set()
        watcher.join()
    assert seen, "gloo opened no listener: the cell did not exercise a collective"
    assert all(conn.laddr.ip in ("127.0.0.1", "::1") for conn in seen), seen


def test_flood_keeps_every_line_and_folds_the_display(spawn):
    lines = 200_000
    run = spawn("--devices 8", f"for i in range({lines}):\n    print(i)")
    logs = dict(re.findall(r"\[rank (\d)\] \.\.\. more stdout .* every line goes to (\S+)", run.stdout))
    assert sorted(logs) == [str(r) for r in range(8)]
    assert len(run.stdout.splitlines()) < 8 * 1100
    for r, path in logs.items():
        with open(path) as log:
            numbers = log.read().split()
        assert numbers == [str(i) for i in range(lines)], f"rank {r}"


@pytest.mark.parametrize(
    "message, advice",
    [
        ("The TPU is already in use by process with pid 4242.", "another process holds the TPU"),
        ("open(/dev/accel0): Operation not permitted: Operation not permitted", "TPU build of TensorFlow"),
        ("Couldn't open iommu group /dev/vfio/0", "TPU build of TensorFlow"),
        ("RESOURCE_EXHAUSTED: Attempting to reserve 12.5G at the bottom of memory", "ran out of memory"),
    ],
)
def test_known_tpu_runtime_conflicts_are_explained(spawn, message, advice):
    """The runtime's own messages, raised where the runtime raises them: in a rank."""
    with pytest.raises(RankError) as info:
        spawn("--devices 2", f"raise RuntimeError({message!r})")
    rendered = "\n".join(info.value._render_traceback_())
    assert "What to do: " in rendered and advice in rendered


def test_subprocesses_a_cell_leaves_behind_are_ended(ip, spawn):
    cell = "import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nchild.pid"
    started = time.monotonic()
    run = spawn("--devices 2", cell)
    assert time.monotonic() - started < HANG_BOUND
    for pid in run.value:
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_nothing_left(ip)


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param("strategy", id="the-rank-strategy"),
        pytest.param("import torch_xla.core.xla_model as xm\nxm", id="a-torch_xla-module"),
        pytest.param("import torch_xla\ndef uses_xla():\n    return torch_xla.device()\nuses_xla", id="a-function-needing-torch_xla"),
    ],
)
def test_results_that_would_import_torch_xla_into_the_kernel_are_refused(spawn, cell):
    from conftest import kernel_is_xla_free

    with pytest.raises(RankError, match="which the kernel must not import") as info:
        spawn("--devices 2", cell)
    assert info.value.ranks == [0, 1]
    assert kernel_is_xla_free()
    launcher_side = [name for name in __import__("sys").modules if name.startswith("xla_magic.launcher.")]
    assert launcher_side == []


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_an_exception_whose_str_fails_is_still_reported(spawn, monkeypatch, backend):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    cell = (
        "class Unprintable(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no words')\n"
        "if rank == 0:\n"
        "    raise Unprintable()\n"
        "rank"
    )
    started = time.monotonic()
    with pytest.raises(RankError, match="Unprintable") as info:
        spawn(f"--devices 2 --backend {backend}", cell)
    assert time.monotonic() - started < HANG_BOUND
    assert info.value.ranks == [0]
    assert "str() of this Unprintable failed: RuntimeError: no words" in str(info.value)
    assert "raise Unprintable()" in "\n".join(info.value._render_traceback_())


def test_one_shot_tpu_path_ranks_get_the_interrupt(ip, spawn, monkeypatch, tmp_path):
    """The tpu launch path's ranks are threads of xmp.spawn's workers: the
    interrupt reaches each as KeyboardInterrupt, so the cell's own handler runs."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    session = ip._xla_magic_session
    cell = (
        "import time\n"
        "try:\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    open(f'{marks}/{rank}', 'w').close()\n"
        "    raise\n"
    )
    sent = interrupt_when_running(ip)
    try:
        with pytest.raises(RunInterrupted):
            spawn("--backend tpu --devices 2", cell, marks=str(tmp_path))
    finally:
        session.listeners.clear()
    assert sent.is_set()
    assert sorted(os.listdir(tmp_path)) == ["0", "1"]
    assert session.history[-1].outcome == "interrupted"
    assert_nothing_left(ip)


def test_a_rank_process_dying_mid_cell_on_the_tpu_path_is_not_a_launch_failure(spawn, monkeypatch):
    """xmp.spawn's process pool breaks (BrokenProcessPool) when a rank's process
    is killed; ranks that were running the cell died, they were not left unstarted."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path: rank threads in one pool process
    cell = "import os, signal, time\ntime.sleep(0.5)\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)"
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn("--backend tpu --devices 2", cell)
    assert time.monotonic() - started < HANG_BOUND
    rendered = "\n".join(info.value._render_traceback_())
    assert "rank 1's process ended during the cell: " in rendered
    assert "BrokenProcessPool" in rendered
    assert "could not be started" not in rendered
