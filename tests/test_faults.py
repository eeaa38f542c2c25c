"""Real faults: crashes, signals, hangs, interrupts, timeouts, floods, bad data.

Each case asserts the message, that the cell ended well within a bound (a
hang is the bug these tests exist for), that nothing the extension started
is left but the idle launcher, and that the next cell works.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from helpers import (assert_nothing_left, extension_processes, interrupt_once_shown, shown, strip_ansi, wait_for,
                     wait_gone, when)
from xla_magic.wire import protocol
from xla_magic.runs.errors import RankError, RunInterrupted

def assert_next_cell_works(spawn) -> None:
    assert spawn("--devices 2", "rank + 1").value == [1, 2]


# --- the crash table: every case in one-shot runs and in a pool ------------------


@dataclass
class Case:
    """One hostile cell and what a user must see.

    ``expect`` is the error the cell raises (None: it succeeds and returns
    ``[0, 1]``); ``pattern`` must be in what the error shows, ``absent`` must
    not. ``pool_breaks``: True or False where the case must (or must not)
    break a pool, None where either is honest. ``during(ip)`` runs once every
    rank printed its first line; ``prepare(marks)`` returns names the cell reads.
    """

    id: str
    cell: str | None  # None: a line magic, ``magic`` and ``line`` only
    expect: type | None
    pattern: str = ""
    absent: tuple[str, ...] = ()
    line: str = ""
    magic: str = "xla_spawn"
    failed: list[int] | None = None
    pool_breaks: bool | None = None
    last_words: int = 0  # rank 0 printed "line 0" ... and every one must arrive, in order
    during: Callable[[Any], None] | None = None
    prepare: Callable[[str], dict[str, Any]] | None = None


# A cell whose finished ranks left a child behind must end at once; the
# timeout only bounds the test where it does not ("timed out" is then the failure).
HELD_OPEN_GUARD = "--timeout 25"
DEVICE_ADVICE = "bfloat16"  # only XLA's own device-memory errors get this
HOST_ADVICE = "the host (not a device) probably ran out of memory"
LAST_WORDS = 900


def last_words_then(death: str) -> str:
    """Rank 0 prints LAST_WORDS short lines as fast as it can, then dies; rank 1 sleeps."""
    return (
        "import faulthandler, os, signal, time\n"
        "if rank == 0:\n"
        f"    for i in range({LAST_WORDS}):\n"
        "        print('line', i)\n"
        f"    {death}\n"
        "time.sleep(600)"
    )


# Cell code: every rank notes it is running the cell and waits until all are, so a death that follows
# comes while every rank runs (never before another one started).
ALL_HERE = (
    "import os, time\n"
    "open(f'{marks}/here-{rank}', 'w').close()\n"
    "while len([name for name in os.listdir(marks) if name.startswith('here-')]) < world_size:\n"
    "    time.sleep(0.01)\n"
)


def record(pid: str) -> str:
    """Cell code that notes a process the cell started, so the test can look for it after."""
    return f"open(f'{{marks}}/{{{pid}}}', 'w').close()\n"


def kill_the_launcher(ip) -> None:
    os.kill(ip._xla_magic_session.host.launcher.pid, signal.SIGKILL)


def _own_group(controller: str) -> str:
    """This process's group in the hierarchy of ``controller`` ("" for cgroup v2's unified one), from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as groups:
        for line in groups:
            _, names, path = line.rstrip("\n").split(":", 2)
            if names.split(",") == [controller] or (controller == "" and names == ""):
                return path
    return ""


def _memory_group_v2() -> tuple[str, str]:
    """A child group with memory.max under this process's cgroup v2 group (the kernel's cgroup-v2.rst)."""
    roots = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")  # unified alone, or beside v1's (systemd's hybrid)
    for root in roots:
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            break
    else:
        raise OSError(f"no cgroup v2 hierarchy is mounted (no cgroup.controllers in {' or '.join(roots)})")
    parent = os.path.normpath(os.path.join(root, _own_group("").lstrip("/")))
    with open(os.path.join(parent, "cgroup.controllers")) as available:
        offered = available.read().split()
    if "memory" not in offered:  # a hybrid host binds it to v1's hierarchy instead
        raise OSError(f"{parent}/cgroup.controllers offers {' '.join(offered) or 'no controller'}, not memory")
    with open(os.path.join(parent, "cgroup.subtree_control")) as enabled:
        if "memory" not in enabled.read().split():
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as enable:
                enable.write("+memory")  # refused (EBUSY) where the group holds processes and is not the root
    return os.path.join(parent, f"xla_magic-test-{os.getpid()}"), "memory.max"


def _memory_group_v1() -> tuple[str, str]:
    root = "/sys/fs/cgroup/memory"
    own = _own_group("memory")
    return os.path.join(root + (own if os.path.isdir(root + own) else ""), f"xla_magic-test-{os.getpid()}"), "memory.limit_in_bytes"


def memory_cgroup(marks: str) -> dict[str, Any]:
    """A memory cgroup limited to 512 MiB (v2's memory.max, else v1's limit); the cell moves rank 0 into it."""
    refusals = []
    for make in (_memory_group_v2, _memory_group_v1):
        try:
            path, limit_file = make()
            os.mkdir(path)
        except OSError as exc:
            refusals.append(f"{make.__name__}: {exc}")
            continue
        _cgroups.append(path)
        try:
            with open(os.path.join(path, limit_file), "w") as limit:
                limit.write(str(512 << 20))
            if limit_file == "memory.max" and os.path.exists(os.path.join(path, "memory.swap.max")):
                with open(os.path.join(path, "memory.swap.max"), "w") as swap:
                    swap.write("0")  # killed at the limit, not swapped
        except OSError as exc:
            refusals.append(f"{path}/{limit_file}: {exc}")
            continue
        return {"cgroup": path}
    pytest.skip("neither a cgroup v2 nor a v1 memory controller is writable here: " + "; ".join(refusals))


_cgroups: list[str] = []


def remove_cgroups() -> None:
    for path in _cgroups:
        for _ in range(50):  # its last task may still be exiting
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    _cgroups.clear()


CASES = [
    Case("raise-while-others-sleep", "if rank == 1:\n    raise RuntimeError('boom')\nimport time; time.sleep(600)",
         RankError, r"RuntimeError: boom", failed=[1], pool_breaks=False),
    Case("os-exit", "print('last words', flush=True)\n" + ALL_HERE + "if rank == 0:\n    os._exit(3)\ntime.sleep(600)",
         RankError, r"exit code 3", failed=[0], pool_breaks=True),
    Case("sigkill", "import signal\nprint('about to die', flush=True)\n" + ALL_HERE + "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)",
         RankError, r"SIGKILL: killed; usually the host ran out of memory[\s\S]*What to do: " + re.escape(HOST_ADVICE),
         absent=(DEVICE_ADVICE,), failed=[1], pool_breaks=True),
    Case("segfault", "import faulthandler\n" + ALL_HERE + "if rank == 0:\n    faulthandler._sigsegv()\ntime.sleep(600)",
         RankError, r"SIGSEGV: a native crash", failed=[0], pool_breaks=True),
    Case("hang-in-collective", ALL_HERE + "if rank == 1:\n    raise ValueError('left the others in a collective')\nstrategy.barrier()",
         RankError, r"ValueError: left the others in a collective", failed=[1]),
    Case("900-lines-then-os-exit", last_words_then("os._exit(1)"), RankError, r"exit code 1",
         failed=[0], pool_breaks=True, last_words=LAST_WORDS),
    Case("900-lines-then-sigkill", last_words_then("os.kill(os.getpid(), signal.SIGKILL)"), RankError, r"SIGKILL",
         absent=(DEVICE_ADVICE,), failed=[0], pool_breaks=True, last_words=LAST_WORDS),
    Case("900-lines-then-segfault", last_words_then("faulthandler._sigsegv()"), RankError, r"SIGSEGV",
         failed=[0], pool_breaks=True, last_words=LAST_WORDS),
    Case("fork-and-sleep",
         "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(300)\n    os._exit(0)\n" + record("pid") + "rank",
         None, line=HELD_OPEN_GUARD, pool_breaks=False),
    Case("setsid-and-sleep",
         "import os\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '300'])\n" + record("pid") + "rank",
         None, line=HELD_OPEN_GUARD, pool_breaks=False),
    Case("double-fork",
         "import os, time\nmiddle = os.fork()\nif middle == 0:\n    daemon = os.fork()\n    if daemon == 0:\n"
         "        time.sleep(300)\n        os._exit(0)\n    " + record("daemon") + "    os._exit(0)\nos.waitpid(middle, 0)\nrank",
         None, line=HELD_OPEN_GUARD, pool_breaks=False),
    Case("popen-long-sleep",
         "import subprocess\nchild = subprocess.Popen(['sleep', '300'])\n" + record("child.pid") + "rank",
         None, line=HELD_OPEN_GUARD, pool_breaks=False),
    Case("launcher-killed-mid-cell", "import time\nprint('sleeping', flush=True)\ntime.sleep(600)",
         RankError, r"the launcher process died \(SIGKILL[\s\S]*the next cell starts a new launcher",
         absent=("lost a rank", "ended without reporting", "smaller batch"),  # host memory, never the device's advice
         pool_breaks=True, during=kill_the_launcher),
    Case("oom-kill-in-a-memory-cgroup",
         "import time\nif rank == 0:\n    import os\n    with open(f'{cgroup}/cgroup.procs', 'w') as procs:\n"
         "        procs.write(str(os.getpid()))\n    hog = b'x' * (2 << 30)\ntime.sleep(600)",
         RankError, r"SIGKILL[\s\S]*What to do: " + re.escape(HOST_ADVICE), absent=(DEVICE_ADVICE,),
         failed=[0], pool_breaks=True, prepare=memory_cgroup),
    Case("sigstop-with-timeout",
         "import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\ntime.sleep(600)",
         RankError, r"timed out after 3 s[\s\S]*SIGSTOP|SIGSTOP[\s\S]*timed out after 3 s", line="--timeout 3"),
    Case("out-named-for", "rank", UsageError, r"keyword 'for'", line="--out for"),
    Case("out-named-None", "rank", UsageError, r"keyword 'None'", line="--out None"),
    Case("push-named-True", None, UsageError, r"keyword 'True'", magic="xla_pool", line="push True"),
    Case("pull-named-None", None, UsageError, r"keyword 'None'", magic="xla_pool", line="pull None"),
]


@pytest.fixture(params=["one-shot", "pool"])
def mode(request, ip):
    """Run the case in fresh ranks, or in a 2-rank pool started for it and stopped after."""
    if request.param == "pool":
        with capture_output():
            ip.run_line_magic("xla_pool", "start --devices 2 --backend cpu")
    try:
        yield request.param
    finally:
        if request.param == "pool":
            with capture_output():
                ip.run_line_magic("xla_pool", "stop")
        remove_cgroups()


def pool_processes(ip) -> set[int]:
    pool = ip._xla_magic_session.pool
    if pool is None or pool.state in ("broken", "stopped"):
        return set()
    return {pool.ranks.supervisor_pid, *pool.pids.values()}


def run_case(ip, case: Case, mode: str, marks: str) -> tuple[Any, BaseException | None, str]:
    names = {"marks": marks, **(case.prepare(marks) if case.prepare else {})}
    ip.user_ns.update(names)
    if case.during is not None:
        when(lambda: shown("[rank ") >= 2, lambda: case.during(ip))  # once every rank printed its first line
    value, error = None, None
    with capture_output() as captured:
        try:
            if case.cell is None:
                value = ip.run_line_magic(case.magic, case.line)
            else:
                line = ("--devices 2 " if mode == "one-shot" else "") + case.line
                value = ip.run_cell_magic(case.magic, line, case.cell)
        except Exception as exc:  # the case says which
            error = exc
    return value, error, captured.stdout


def what_it_shows(error: BaseException) -> str:
    render = getattr(error, "_render_traceback_", None)
    return "\n".join(render()) if render else f"{type(error).__name__}: {error}"


def assert_next_cell_works_in(ip, spawn, mode: str) -> None:
    pool = ip._xla_magic_session.pool
    if mode == "pool" and pool is not None and pool.state == "broken":
        with pytest.raises(UsageError, match="%xla_pool restart"):
            spawn("", "rank")
        with capture_output():
            ip.run_line_magic("xla_pool", "restart")
    assert spawn("" if mode == "pool" else "--devices 2", "rank + 1").value == [1, 2]


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_crash_table(ip, spawn, mode, case, tmp_path):
    marks = str(tmp_path)
    try:
        check_case(ip, spawn, mode, case, marks)
    finally:
        for name in filter(str.isdigit, os.listdir(marks)):  # whatever the outcome, nothing the case started outlives it
            try:
                os.kill(int(name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def check_case(ip, spawn, mode: str, case: Case, marks: str) -> None:
    value, error, stdout = run_case(ip, case, mode, marks)
    if case.expect is None:
        assert error is None, what_it_shows(error)
        assert value == [0, 1]
    else:
        assert isinstance(error, case.expect), f"expected {case.expect.__name__}, got {error!r}"
        if case.expect is UsageError:
            assert type(error) is UsageError
        text = what_it_shows(error)
        assert re.search(case.pattern, text), text
        for words in case.absent:
            assert words not in text, text
        if case.failed is not None:
            assert error.ranks == case.failed
            assert f"[rank {case.failed[0]}]" in text
            record = ip._xla_magic_session.history[-1]
            assert record.outcome == "failed"
            assert {record.ranks[r].state for r in case.failed} == {"failed"}
    if case.last_words:
        said = [line for line in stdout.splitlines() if line.startswith("[rank 0] line ")]
        assert said == [f"[rank 0] line {i}" for i in range(case.last_words)], (
            f"{len(said)} of {case.last_words} lines arrived, or out of order"
        )
    post_mortem = ip._xla_magic_session.post_mortem
    if mode == "one-shot" and post_mortem is not None:  # the failed ranks stay for %debug until the next cell, alone
        assert isinstance(error, RankError) and error.post_mortem is post_mortem and post_mortem.parked
        parked = {post_mortem.ranks.pids[rank] for rank in post_mortem.debuggable}
        assert set(post_mortem.debuggable) <= set(error.ranks) and all(psutil.pid_exists(pid) for pid in parked)
        ip._xla_magic_session.release_post_mortem()  # as the next cell does
        assert wait_gone(parked) == []
    started = {int(name) for name in os.listdir(marks) if name.isdigit()}
    pool = ip._xla_magic_session.pool
    kept = mode == "pool" and pool is not None and pool.state not in ("broken", "stopped")
    if kept:  # a pool is a session: what its cell started lives until it ends
        assert all(psutil.pid_exists(pid) for pid in started)
    else:
        assert wait_gone(started) == []
    if mode == "pool" and case.pool_breaks is not None and case.cell is not None:
        assert (pool.state == "broken") == case.pool_breaks, f"pool state {pool.state}: {pool.problem}"
    allowed = pool_processes(ip) | (started | kept_below(started) if kept else set()) if mode == "pool" else set()
    assert wait_gone(p.pid for p in extension_processes(ip) if p.pid not in allowed) == []
    if case.during is not kill_the_launcher:
        assert ip._xla_magic_session.host.launcher.alive(), "the launcher must survive faults"
    if kept and started:
        with capture_output():
            ip.run_line_magic("xla_pool", "restart")  # ends the old ranks and all they kept
        assert wait_gone(started) == []
    assert_next_cell_works_in(ip, spawn, mode)


def kept_below(pids: set[int]) -> set[int]:
    """What the processes ``pids`` started in turn (a Popen's exec, a daemon's children)."""
    found = set()
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


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


def test_a_rank_killed_by_sigkill_leaves_no_file_in_the_temporary_directory(ip):
    """The compilation analysis (launcher/xla_analysis.py) is a file with no name, which goes with the process."""
    import glob

    cell = ("import os, signal, tempfile, torch\n(torch.ones(2, device=device) * 2).sum().item()  # compiles\n"
            "print('pid', os.getpid(), 'tmp', tempfile.gettempdir(), 'analysis', os.environ['PT_XLA_DEBUG_FILE'],"
            " os.readlink(os.environ['PT_XLA_DEBUG_FILE']))\nos.kill(os.getpid(), signal.SIGKILL)")
    with capture_output() as captured, pytest.raises(RankError, match="SIGKILL"):
        ip.run_cell_magic("xla_spawn", "--devices 2 --backend cpu", cell)
    said = re.findall(r"pid (\d+) tmp (\S+) analysis (\S+) (\S+ \(deleted\))", captured.stdout)
    assert len(said) == 2, captured.stdout
    for pid, tmp, analysis, target in said:
        assert analysis == f"/proc/{pid}/fd/{analysis.rsplit('/', 1)[1]}" and f"xla_magic-analysis-{pid}-" in target
        wait_for(lambda: not psutil.pid_exists(int(pid)))
        assert glob.glob(os.path.join(tmp, f"xla_magic-analysis-{pid}-*")) == []


def test_segfault_shows_the_native_traceback(ip):
    from IPython.utils.capture import capture_output

    with capture_output() as captured, pytest.raises(RankError):
        ip.run_cell_magic("xla_spawn", "--devices 1", "import faulthandler\nfaulthandler._sigsegv()")
    assert "Segmentation fault" in captured.stderr
    assert re.search(r"\[rank 0\]\S* Fatal Python error", captured.stderr)


def test_all_ranks_failing_the_same_way_are_folded(ip, spawn, tmp_path):
    with pytest.raises(RankError) as info:  # every rank raises once all are running the cell
        spawn("--devices 8", ALL_HERE + "raise KeyError('same everywhere')", marks=str(tmp_path))
    error = info.value
    # Ranks slower to fail than the fail-fast grace are stopped instead (on a loaded machine, any but the
    # first): each rank either failed, named, or was stopped; and at least two failed, to be folded.
    states = {rank: state.state for rank, state in ip._xla_magic_session.history[-1].ranks.items()}
    assert sorted(states) == list(range(8)) and len(error.ranks) >= 2
    assert {rank for rank, state in states.items() if state == "failed"} == set(error.ranks)
    assert {state for rank, state in states.items() if rank not in error.ranks} <= {"killed"}
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
    with pytest.raises(RankError, match=r"timed out after 1 s \(--timeout\)"):
        spawn("--devices 2 --timeout 1", "import time\ntime.sleep(600)")
    assert ip._xla_magic_session.history[-1].outcome == "timeout"
    assert_nothing_left(ip)
    assert_next_cell_works(spawn)


def test_interrupt_stops_the_ranks_and_the_next_cell_works(ip, spawn):
    session = ip._xla_magic_session
    sent = interrupt_once_shown("sleeping", 2)
    with pytest.raises(RunInterrupted, match="interrupted; the ranks were stopped"):
        spawn("--devices 2", "import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    assert sent.is_set()
    assert session.history[-1].outcome == "interrupted"
    assert_nothing_left(ip)
    assert_next_cell_works(spawn)


def test_interrupt_escalates_when_ranks_ignore_sigint(ip, spawn):
    session = ip._xla_magic_session
    sent = interrupt_once_shown("deaf", 2)
    cell = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('deaf', flush=True)\ntime.sleep(600)")
    with pytest.raises(RunInterrupted):
        spawn("--devices 2", cell)
    assert sent.is_set()
    assert {s.state for s in session.history[-1].ranks.values()} == {"killed"}
    assert_nothing_left(ip)


def test_garbled_message_becomes_an_error_not_a_crash(spawn):
    # The cell finds its own events socket and writes a frame that is not an event.
    cell = (
        "import gc\n"
        "from xla_magic.wire import protocol\n"
        "channel = next(o for o in gc.get_objects() if isinstance(o, protocol.Channel) and o.sock.fileno() >= 0)\n"
        "channel.sock.sendall(b'\\x00\\x00\\x00\\x05garbage')\n"
        "import time; time.sleep(600)"
    )
    with pytest.raises(RankError, match="garbled message") as info:
        spawn("--devices 2", cell)
    assert "ProtocolError" in "\n".join(info.value._render_traceback_())
    assert_next_cell_works(spawn)


@pytest.mark.parametrize(
    "data, first, then",
    [
        (b"\x00\x00\x00\x03abc", [protocol.BROKEN], []),  # not a pickle; the reader stops there
        # Truncated: pending, not broken; the next frame's bytes then complete it into garbage.
        (protocol.encode("output", text="x")[:-2], [], [protocol.BROKEN]),
        (b"\xff\xff\xff\xff" + b"x" * 10, [protocol.BROKEN], []),  # absurd length
        (b"\x00\x00\x00\x0c" + __import__("pickle").dumps((99, "x", {}))[:12], [protocol.BROKEN], []),
        (__import__("struct").pack("!I", 10) + __import__("pickle").dumps([1, 2])[:10], [protocol.BROKEN], []),
    ],
    ids=["not-a-pickle", "truncated", "absurd-length", "cut-tuple", "cut-list"],
)
def test_reader_turns_garbage_into_events(data, first, then):
    reader = protocol.FrameReader()
    events = reader.feed(data)
    assert [event.kind for event in events] == first
    assert all(event.fields["reason"] for event in events)
    assert reader.pending() == (0 if first else len(data))
    later = reader.feed(protocol.encode("done"))  # never raises, whatever came before
    assert [event.kind for event in later] == then


def test_reader_reassembles_frames_split_anywhere():
    frames = b"".join(protocol.encode("output", text=f"line {i}") for i in range(50))
    reader = protocol.FrameReader()
    events = []
    for i in range(0, len(frames), 7):
        events.extend(reader.feed(frames[i : i + 7]))
    assert [e.fields["text"] for e in events] == [f"line {i}" for i in range(50)]


@contextlib.contextmanager
def every_bind_and_listen(pids: list[int], folder: str) -> Iterator[list[tuple[str, str]]]:
    """Every bind() and listen() that ``pids`` and all they start make during the block, as strace(1) sees them.

    A check that cannot miss a short-lived listener, as sampling the
    process table can: the calls themselves, from the kernel's own report.
    Yields a list filled, once the block ends, with (call, arguments) pairs.
    """
    if shutil.which("strace") is None:
        pytest.skip("needs strace (scripts/install-browser installs it with the browser)")
    log = os.path.join(folder, "strace.log")
    tracer = subprocess.Popen(["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=bind,listen", "-o", log,
                               *[arg for pid in pids for arg in ("-p", str(pid))]], stderr=subprocess.DEVNULL)
    calls: list[tuple[str, str]] = []
    try:
        assert wait_for(lambda: all(traced_by(pid) == tracer.pid for pid in pids)), "strace did not attach"
        yield calls
    finally:
        tracer.send_signal(signal.SIGINT)  # strace detaches and exits
        tracer.wait(60)
    with open(log) as lines:
        calls.extend(re.findall(r"^\d+\s+(bind|listen)\((.*)$", lines.read(), re.M))


def traced_by(pid: int) -> int:
    """The pid tracing ``pid`` (0: none), as /proc says."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("TracerPid:")))


def test_no_listener_is_open_during_a_run(ip, spawn, tmp_path):
    """Our channel is inherited socket pairs: nothing anyone could connect to.

    gloo (only once a cell uses a collective) and the XLA runtime open ports of
    their own on loopback; this cell uses neither, so nothing may listen at all,
    nor bind a unix socket to a name (a path or an abstract name) others could reach.
    """
    launcher = ip._xla_magic_session.host.ready_launcher().pid
    with every_bind_and_listen([os.getpid(), launcher], str(tmp_path)) as calls:
        spawn("--devices 2", "rank")
    assert [args for call, args in calls if call == "listen"] == []
    assert [args for call, args in calls if "AF_UNIX" in args and "sun_path=" in args] == []


def test_collectives_listen_on_loopback_only(ip, spawn, tmp_path):
    launcher = ip._xla_magic_session.host.ready_launcher().pid
    with every_bind_and_listen([launcher], str(tmp_path)) as calls:
        spawn("--devices 2", "strategy.barrier()\nrank")
    assert [call for call, _ in calls if call == "listen"], "gloo opened no listener: the cell did not exercise a collective"
    inet = [args for call, args in calls if call == "bind" and "AF_INET" in args]
    assert inet and all('inet_addr("127.0.0.1")' in args or '"::1"' in args for args in inet), inet


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


# The runtime's own words, each as a public report quotes it (the runtimes are closed source, or the words
# come from a C++ build we only have compiled); the host allocator's is torch's own, raised for real below.
RUNTIME_MESSAGES = [
    # jax-ml/jax#13260 (libtpu, the same runtime torch_xla's PJRT loads)
    ("ABORTED: The TPU is already in use by process with pid 4242. Not attempting to load libtpu.so in this process.",
     "another process holds the TPU"),
    # pytorch/xla#9604
    ("RuntimeError: Bad StatusOr access: UNKNOWN: TPU initialization failed: open(/dev/accel2): Operation not permitted",
     "TPU build of TensorFlow"),
    # pytorch/xla#3165
    ("Invalid argument: Invalid fd: -1; Couldn't open device: /dev/accel0 (Operation not permitted)",
     "TPU build of TensorFlow"),
    # pytorch/xla#3532
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 29.80G of 7.98G hbm. Exceeded hbm capacity by 21.82G.",
     "a device ran out of memory"),
    # erfanzar/EasyDeL#142 (the TPU compiler's own words, through PJRT)
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 30.21G of "
     "15.48G hbm. Exceeded hbm capacity by 14.73G.", "a device ran out of memory"),
]


@pytest.mark.parametrize("message, advice", RUNTIME_MESSAGES, ids=["tpu-in-use", "accel-not-permitted",
                                                                      "accel-device-not-permitted", "hbm-oom",
                                                                      "hbm-oom-at-compile"])
def test_known_tpu_runtime_conflicts_are_explained(spawn, message, advice):
    """The runtime's own messages, raised where the runtime raises them: in a rank."""
    with pytest.raises(RankError) as info:
        spawn("--devices 2", f"raise RuntimeError({message!r})")
    rendered = "\n".join(info.value._render_traceback_())
    assert "What to do: " in rendered and advice in rendered
    assert re.search(r"What to do: .* %xla_help [a-z0-9-]+ says more\.$", rendered, re.MULTILINE), rendered
    assert HOST_ADVICE not in rendered


def test_the_host_allocators_own_error_gets_the_host_advice(spawn):
    """torch's CPU allocator refusing an allocation no host has (64 TiB), in a rank: its words, not ours."""
    with pytest.raises(RankError) as info:
        spawn("--devices 2", "import torch\ntorch.empty(1 << 46, dtype=torch.uint8)")
    rendered = strip_ansi("\n".join(info.value._render_traceback_()))
    assert "DefaultCPUAllocator" in rendered  # c10/core/impl/alloc_cpu.cpp
    assert "What to do: " in rendered and HOST_ADVICE in rendered
    assert re.search(r"What to do: .* %xla_help [a-z0-9-]+ says more\.$", rendered, re.MULTILINE), rendered
    assert DEVICE_ADVICE not in rendered


def test_subprocesses_a_cell_leaves_behind_are_ended(ip, spawn):
    cell = "import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nchild.pid"
    run = spawn("--devices 2", cell)
    assert wait_gone(run.value) == []
    assert_nothing_left(ip)


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param("strategy", id="the-rank-strategy"),
        pytest.param("import torch_xla.core.xla_model as xm\nxm", id="a-torch_xla-module"),
        pytest.param("import torch_xla\ndef uses_xla():\n    return torch_xla.device()\nuses_xla", id="a-function-needing-torch_xla"),
    ],
)
def test_results_that_would_import_torch_xla_into_the_kernel_are_refused(spawn, cell, monkeypatch):
    import sys

    import xla_magic
    from conftest import kernel_is_xla_free

    # The launcher side's modules that other tests imported into this process (test_spmd's, which read its
    # constants) are hidden for this test, as if it ran first: an import of one by the refused result shows.
    for name in [name for name in sys.modules if name == "xla_magic.launcher" or name.startswith("xla_magic.launcher.")]:
        monkeypatch.delitem(sys.modules, name)
    if hasattr(xla_magic, "launcher"):
        monkeypatch.setattr(xla_magic, "launcher", xla_magic.launcher)  # put back after, as the modules are
    with pytest.raises(RankError, match="which the kernel must not import") as info:
        spawn("--devices 2", cell)
    assert info.value.ranks == [0, 1]
    assert kernel_is_xla_free()
    launcher_side = [name for name in sys.modules if name.startswith("xla_magic.launcher.")]
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
    with pytest.raises(RankError, match="Unprintable") as info:
        spawn(f"--devices 2 --backend {backend}", cell)
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
        "    print('waiting', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n"
        "    open(f'{marks}/{rank}', 'w').close()\n"
        "    raise\n"
    )
    sent = interrupt_once_shown("waiting", 2)
    with pytest.raises(RunInterrupted):
        spawn("--backend tpu --devices 2", cell, marks=str(tmp_path))
    assert sent.is_set()
    assert sorted(os.listdir(tmp_path)) == ["0", "1"]
    assert session.history[-1].outcome == "interrupted"
    assert_nothing_left(ip)


def test_a_rank_process_dying_mid_cell_on_the_tpu_path_is_not_a_launch_failure(spawn, monkeypatch, tmp_path):
    """xmp.spawn's process pool breaks (BrokenProcessPool) when a rank's process
    is killed; ranks that were running the cell died, they were not left unstarted."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path: rank threads in one pool process
    cell = "import signal\n" + ALL_HERE + "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)"
    with pytest.raises(RankError) as info:
        spawn("--backend tpu --devices 2", cell, marks=str(tmp_path))
    rendered = "\n".join(info.value._render_traceback_())
    assert "rank 1's process ended during the cell: " in rendered
    assert "BrokenProcessPool" in rendered
    assert "could not be started" not in rendered
