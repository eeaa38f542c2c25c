"""The persistent rank pool through a real IPython shell: real ranks, real signals, real crashes."""

from __future__ import annotations

import fcntl
import gc
import os
import re
import select
import signal
import socket
import struct
import sys
import termios

import numpy as np
import psutil
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from conftest import BACKING, kernel_is_xla_free
from helpers import (WITHIN, WRITE_MEET_READ, Kernel, alive, emptied, interrupt_once_written, interrupt_when,
                     main_thread_in, pool_magic, press_stop, shown, stopped, wait_for, wait_gone, when)
from xla_magic.ranks import frame_writer
from xla_magic.wire import transport
from xla_magic.notebook.syntax_error import CellSyntaxError
from xla_magic.runs.errors import RankError, RunInterrupted
from xla_magic.ranks.ranks import Ranks
from xla_magic.runs.request import Request


def pool_pids(ip) -> set[int]:
    return set(ip._xla_magic_session.pool.pids.values())


def segments_left() -> list[str]:
    """This kernel's segments in /dev/shm now."""
    return transport.segment_names(transport.kernel_prefix())


def mapped_here(prefix: str) -> list[str]:
    """The segments under ``prefix`` that this process maps, named or already unlinked."""
    with open("/proc/self/maps") as maps:
        return [line.split(maxsplit=5)[5].strip() for line in maps if prefix in line]


@pytest.fixture
def pool(ip):
    """A 2-rank pool in the shared shell, always stopped afterwards, leaving no shared memory."""
    pool_magic(ip, "start --devices 2 --backend cpu")
    prefix = ip._xla_magic_session.pool.ranks.shipping.held.segments.prefix
    try:
        yield ip._xla_magic_session.pool
    finally:
        pool_magic(ip, "stop")
        assert ip._xla_magic_session.pool is None
    assert segments_left() == [] and mapped_here(prefix) == []


@pytest.fixture
def thread_pool(ip, monkeypatch):
    """A 2-rank pool on the tpu launch path: xmp.spawn's rank threads on the CPU."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    pool_magic(ip, "start --devices 2 --backend tpu")
    try:
        yield ip._xla_magic_session.pool
    finally:
        pool_magic(ip, "stop")


def got_sigint(pid: int) -> bool:
    """SIGINT reached ``pid``: it waits there (a stopped process takes it once continued), or ``pid`` was
    continued already (the kernel sends SIGCONT with its SIGINT), or has gone; as /proc says."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status)
    except FileNotFoundError:
        return True
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return not fields["State"].strip().startswith("T") or bool(pending & (1 << (signal.SIGINT - 1)))


def peer_closed(sock) -> bool:
    """The other end of ``sock`` closed (what the kernel reads next is the end), nothing read from it here."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False


def unsent(sock) -> int:
    """Bytes written on ``sock`` that its peer has not read yet (SIOCOUTQ, Linux's unix(7))."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def epoll_descriptors() -> int:
    """How many selectors (epoll instances) this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
        except OSError:
            pass  # the descriptor listdir itself used
    return count


BUSY_UNTIL_INTERRUPTED = "open(f'{marks}/{rank}', 'w').close()\nwhile True:\n    spin = 1\n"


# --- start, state, stop, restart -----------------------------------------------


def test_start_state_restart_and_stop(ip, spawn):
    assert "no pool is running" in pool_magic(ip, "")
    shown = pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        assert "pool ready" in shown and "2 ranks on the cpu backend" in shown
        state = pool_magic(ip, "")
        assert "ready: 2 ranks" in state
        first = pool_pids(ip)
        assert len(first) == 2 and all(psutil.pid_exists(pid) for pid in first)
        spawn("", "kept = rank + 1")
        assert "already running" in pool_magic(ip, "start")

        pool_magic(ip, "restart")
        second = pool_pids(ip)
        assert second.isdisjoint(first) and wait_gone(first) == []
        with pytest.raises(RankError, match="NameError"):
            spawn("", "kept")  # a restart starts fresh namespaces
        assert "1 cell(s) run" in pool_magic(ip, "")
    finally:
        assert "pool stopped" in pool_magic(ip, "stop")
    assert wait_gone(second) == []
    assert "no pool is running" in pool_magic(ip, "")
    assert "no pool is running" in pool_magic(ip, "stop")
    assert spawn("--devices 2", "rank").value == [0, 1]  # one-shot again


def test_restart_can_change_the_size(ip, pool, spawn):
    pool_magic(ip, "restart --devices 3")
    assert spawn("", "world_size").value == [3, 3, 3]


# --- namespaces, devices, shipping ----------------------------------------------


def test_a_model_built_in_one_cell_is_used_in_the_next_on_the_same_device(ip, pool, spawn):
    assert "model" not in ip.user_ns
    spawn("", "import os, torch\nmodel = torch.nn.Linear(2, 1).to(device)\nborn_in = os.getpid()")
    run = spawn("", "(str(next(model.parameters()).device), born_in == os.getpid(), rank)")
    assert run.value == [("xla:0", True, 0), ("xla:0", True, 1)]
    assert "model" not in ip.user_ns  # it never came to the kernel, nor went back
    assert kernel_is_xla_free()


def test_kernel_variables_still_reach_every_cell_and_changes_travel(ip, pool, spawn):
    ip.user_ns.update(offset=1, items=[10])
    assert spawn("", "offset + rank").value == [1, 2]
    ip.user_ns["offset"] = 100
    assert spawn("", "offset + rank").value == [100, 101]
    # A rank's own changes to a kernel value last only for that cell, as if shipped again.
    assert spawn("", "items.append(rank)\noffset = -1\nlen(items)").value == [2, 2]
    assert spawn("", "(len(items), offset)").value == [(1, 100), (1, 100)]
    ip.user_ns["items"] = [10, 20, 30]
    assert spawn("", "len(items)").value == [3, 3]


def test_tagged_output_results_and_errors_work_as_in_one_shot_runs(pool, spawn):
    run = spawn("", "import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)\nrank * 3")
    assert run.value == [0, 3]
    assert "[rank 0] out 0" in run.lines() and "[rank 1] out 1" in run.lines()
    assert "err 1" in run.stderr
    with pytest.raises(RankError) as info:
        spawn("", "if rank == 1:\n    raise ValueError('bad one')\nrank")
    assert info.value.ranks == [1]
    assert "raise ValueError('bad one')" in "\n".join(info.value._render_traceback_())
    assert spawn("", "rank").value == [0, 1]  # an error in a cell does not cost the pool


def test_syntax_errors_and_unpicklable_values_stop_before_the_ranks(ip, pool, spawn):
    import threading

    session = ip._xla_magic_session
    last_run = session.history[-1]  # the pool's start, at least
    with pytest.raises(CellSyntaxError):
        spawn("", "x = (1,\nprint(x")
    ip.user_ns["held_lock"] = threading.Lock()
    with pytest.raises(UsageError, match=r"'held_lock' \(_thread\.lock\)"):
        spawn("", "print(held_lock)")
    assert session.history[-1] is last_run  # no request went out
    assert spawn("--out gathered", "rank").value == [0, 1] and ip.user_ns["gathered"] == [0, 1]


def test_unfinished_last_line_arrives_with_the_cell(pool, spawn):
    run = spawn("", "import sys\nsys.stdout.write(f'no newline {rank}')")
    assert "[rank 0] no newline 0" in run.lines() and "[rank 1] no newline 1" in run.lines()


def test_a_burst_of_lines_arrives_whole_and_in_order(pool, spawn):
    run = spawn("", "import os\nfor i in range(3000):\n    print(rank, i)\nos.write(1, b'fd line\\n')")
    logs = dict(re.findall(r"\[rank (\d)\] \.\.\. more stdout .* every line goes to (\S+)", run.stdout))
    for r in range(2):
        with open(logs[str(r)]) as log:
            lines = log.read().splitlines()
        # Writes to the file descriptor skip Python's buffer, as in any process.
        assert lines.count("fd line") == 1
        lines.remove("fd line")
        assert lines == [f"{r} {i}" for i in range(3000)]


def test_last_words_before_a_crash_reach_the_cell(ip, pool):
    cell = "import os, sys\nprint('last words', rank)\nprint('on stderr', file=sys.stderr)\nos._exit(3)"
    with capture_output() as captured, pytest.raises(RankError):
        ip.run_cell_magic("xla_spawn", "", cell)
    for r in range(2):
        assert f"[rank {r}] last words {r}" in captured.stdout
        assert re.search(rf"\[rank {r}\]\S* on stderr", captured.stderr)
    assert pool.state == "broken"


def test_progress_lines_settle(pool, spawn):
    cell = "import sys\nfor i in range(5):\n    sys.stdout.write(f'\\rstep {i}'); sys.stdout.flush()\nprint()"
    run = spawn("", cell)
    assert "[rank 1] step 4" in run.lines() and "step 2" not in run.stdout


def test_push_and_pull(ip, pool, spawn):
    ip.user_ns["weights"] = [1.0, 2.0]
    pool_magic(ip, "push weights")
    del ip.user_ns["weights"]
    assert spawn("", "total = sum(weights) * (rank + 1)\ntotal").value == [3.0, 6.0]
    pool_magic(ip, "pull total")
    assert ip.user_ns["total"] == [3.0, 6.0]
    pool_magic(ip, "pull total --rank 1")
    assert ip.user_ns["total"] == 6.0
    spawn("", "import torch\non_device = torch.arange(3, device=device) * rank")
    pool_magic(ip, "pull on_device --rank 1")
    assert ip.user_ns["on_device"].device.type == "cpu" and ip.user_ns["on_device"].tolist() == [0, 1, 2]
    with pytest.raises(RankError, match="not defined"):
        pool_magic(ip, "pull never_made")
    with pytest.raises(UsageError, match="no notebook variable"):
        pool_magic(ip, "push never_made")


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("push", "needs a name"),
        ("pull a b", "one name"),
        ("pull 3x", "variable names"),
        ("stop now", "no kept pool named now"),  # stop NAME ends a kept pool (test_kept_pool.py)
        ("stop a b", "takes one kept pool's name"),
        ("restart now", "takes no names"),
        ("push a --rank 1", "--rank goes with"),
        ("pull a --rank 5", "between 0 and 1"),
        ("push a --devices 2", "start and restart only"),
        ("start --devices 3", "contradicts"),
        ("launch", "invalid choice"),
    ],
)
def test_bad_pool_arguments_are_usage_errors(ip, pool, line, pattern):
    ip.user_ns["a"] = 1
    with pytest.raises(UsageError, match=pattern) as info:
        ip.run_line_magic("xla_pool", line)
    assert type(info.value) is UsageError


def test_contradicting_devices_is_an_error_not_a_respawn(ip, pool, spawn):
    before = pool_pids(ip)
    for line in ("--devices 4", "--backend tpu"):
        with pytest.raises(UsageError, match="contradicts") as info:
            spawn(line, "rank")
        assert type(info.value) is UsageError
    assert pool_pids(ip) == before
    assert spawn("--devices 2", "rank").value == [0, 1]


def test_fresh_runs_in_newly_spawned_ranks(ip, pool, spawn):
    spawn("", "only_in_pool = 1")
    run = spawn("--fresh --devices 3", "import os\n('only_in_pool' in dir(), os.getpid())")
    assert [seen for seen, _ in run.value] == [False, False, False]
    assert not {pid for _, pid in run.value} & pool_pids(ip)
    assert spawn("", "only_in_pool").value == [1, 1]


def test_no_pool_commands_without_a_pool(ip):
    with pytest.raises(UsageError, match="no pool is running"):
        ip.run_line_magic("xla_pool", "pull x")


# --- large values: through shared memory, once for every rank ---------------------

BIG = 1 << 20  # float32 elements: 4 MiB, above transport's 1 MiB threshold


# Defined in cells: the segments this rank holds open (descriptors, its own views' included).
OPEN_SEGMENTS = """
import os, re
def open_segments():  # the shipped values' segments this rank holds (not the result segments lent to it now)
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the descriptor listdir itself used
    return sorted(link for link in links if re.search(r"xla_magic-[0-9a-f-]+-kn[0-9]+", link))
"""


def segment_path() -> str:
    return os.path.join(transport.SHM_DIR, transport.kernel_prefix())


def test_large_values_reach_every_rank_through_one_segment_and_stay_private(ip, pool, spawn):
    weights = torch.arange(BIG, dtype=torch.float32).reshape(1024, -1)
    table = np.random.default_rng(0).random((512, 512))
    ip.user_ns.update(weights=weights, table=table)
    cell = BACKING + (
        "seen = (weights.clone(), table.copy())\n"
        "weights[0, 0] = 1000 + rank\n"
        "table[0, 0] = -1 - rank\n"
        "strategy.barrier()\n"
        "(backing(weights.data_ptr()), backing(table.ctypes.data), float(weights[0, 0]), float(table[0, 0]), seen)"
    )
    first = spawn("", cell).value
    files = {(weights_file, table_file) for weights_file, table_file, *_ in first}
    assert len(files) == 1  # both ranks map the same two files: each value went once
    ((weights_file, table_file),) = files
    assert weights_file.startswith(segment_path()) and table_file.startswith(segment_path())
    assert weights_file != table_file
    assert [written for _, _, *written, _ in first] == [[1000.0, -1.0], [1001.0, -2.0]]  # each rank's own
    for *_, (weights_seen, table_seen) in first:
        assert torch.equal(weights_seen, weights) and np.array_equal(table_seen, table)
    assert float(weights[0, 0]) == 0.0 and table[0, 0] != -1.0  # the kernel's values are untouched
    assert segments_left() == []  # the names went with the cell; the ranks keep the memory

    # Unchanged: not written again, and the last cell's writes do not leak into this one.
    second = spawn("", BACKING + "(backing(weights.data_ptr()), float(weights[0, 0]), float(table[0, 0]))").value
    assert second == [(f"{weights_file} (deleted)", 0.0, float(table[0, 0]))] * 2


def test_a_changed_large_value_reaches_the_next_cell_and_a_dropped_one_is_let_go(ip, pool, spawn):
    weights = torch.zeros(BIG)
    ip.user_ns.update(weights=weights, table=np.ones((512, 512)))
    where = BACKING + "(backing(weights.data_ptr()), backing(table.ctypes.data), float(weights[1]), float(table.sum()))"
    before, _ = spawn("", where).value
    weights.numpy()[1] = 7.0  # a write through numpy: torch's version counter does not see it
    ip.user_ns["table"] = np.full((512, 512), 2.0)  # a new object
    after, _ = spawn("", where).value
    assert after[2:] == (7.0, 2.0 * 512 * 512)
    for now, then in zip(after[:2], before[:2]):
        assert now.startswith(segment_path()) and now != then
        assert not now.endswith("(deleted)")  # named: written for this very cell
    assert segments_left() == []

    spawn("", "del weights")  # the rank's own view of it
    del ip.user_ns["weights"], weights  # the kernel's value dies: its segment goes too
    spawn("", "table is None")  # the cell that tells the ranks: each lets the segment go after its reply
    held = spawn("", OPEN_SEGMENTS + "(open_segments(), float(table.sum()))").value
    for segments, total in held:
        assert segments and all(segment == after[1] + " (deleted)" for segment in segments)  # the table's only
        assert total == 2.0 * 512 * 512


def test_a_rank_never_reads_what_the_kernel_changes_after_shipping_it(ip, pool, spawn, tmp_path):
    """The kernel writes its value in place while the cell that shipped it runs, and again between cells: the
    running cell reads the value as it was shipped, a view a rank kept from an earlier cell keeps what it had,
    and only the next cell's own copy has the kernel's change."""
    from helpers import on_every_rank_running

    weights = torch.zeros(BIG)
    ip.user_ns["weights"] = weights
    changed = tmp_path / "changed"

    def change() -> None:
        weights.fill_(5.0)  # in place: the same kernel object, new bytes
        changed.touch()

    cell = (f"import os, time\nkept = weights\nwhile not os.path.exists({str(changed)!r}):\n    time.sleep(0.01)\n"
            "float(weights.sum())")
    with on_every_rank_running(ip._xla_magic_session, change):
        assert spawn("", cell).value == [0.0, 0.0]
    weights.numpy()[:] = 7.0  # through numpy: torch's version counter does not see it
    assert spawn("", "(float(kept.sum()), float(weights.sum()))").value == [(0.0, 7.0 * BIG)] * 2


def _holding(prefix: str) -> list[str]:
    """Every process on this machine that maps or holds open a segment under ``prefix``: ``pid: what``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                found += [f"{pid}: {line.split()[-1]}" for line in maps if prefix in line]
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if prefix in link:
                    found.append(f"{pid}: {link}")
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return found


def test_no_shipped_segment_outlives_its_pool(ip):
    """A pool's shipped segments, held by the kernel and by every rank (a view kept in a rank's namespace too),
    are gone from every process once the pool restarts and once it stops, and nothing is left in /dev/shm."""
    ip.user_ns["weights"] = torch.ones(BIG)
    pool_magic(ip, "start --devices 2 --backend cpu")
    prefix = restarted = ip._xla_magic_session.pool.ranks.shipping.held.segments.prefix
    try:
        with capture_output():
            ip.run_cell_magic("xla_spawn", "", "kept = weights\nfloat(weights.sum())")
        pids = {str(pid) for pid in ip._xla_magic_session.pool.ranks.pids.values()}
        holders = {entry.split(":")[0] for entry in _holding(prefix)}
        assert pids | {str(os.getpid())} <= holders, _holding(prefix)  # while the pool runs: the kernel and each rank
        pool_magic(ip, "restart")
        assert _holding(prefix) == []
        restarted = ip._xla_magic_session.pool.ranks.shipping.held.segments.prefix
        with capture_output():
            ip.run_cell_magic("xla_spawn", "", "kept = weights\nfloat(weights.sum())")
        assert _holding(restarted)
    finally:
        pool_magic(ip, "stop")
        del ip.user_ns["weights"]
    assert _holding(prefix) == [] and _holding(restarted) == [] and segments_left() == []


def test_interrupt_while_a_large_value_is_shipped_leaves_nothing_and_keeps_it(ip, pool, spawn, marks):
    seen: list[list[str]] = []
    ip.user_ns["weights"] = torch.ones(BIG)

    def every_rank_in_its_loop() -> bool:
        if len(os.listdir(marks)) < 2:
            return False
        seen.append(segments_left())  # the segments in /dev/shm at that moment
        return True

    interrupt_when(every_rank_in_its_loop)
    with pytest.raises(RunInterrupted, match="keeps its ranks"):
        spawn("", "summed_before = float(weights.sum())\n" + BUSY_UNTIL_INTERRUPTED)
    assert len(seen[0]) == 1 and segments_left() == []  # there during the cell, gone after
    assert spawn("", "(float(weights.sum()), summed_before)").value == [(float(BIG), float(BIG))] * 2


def test_a_crash_that_breaks_the_pool_leaves_no_shared_memory(ip, pool, spawn):
    prefix = pool.ranks.shipping.held.segments.prefix
    ip.user_ns["weights"] = torch.ones(BIG)
    spawn("", "float(weights.sum())")
    assert len(mapped_here(prefix)) == 1  # the kernel keeps its copy to compare with
    ip.user_ns["fresh"] = torch.zeros(BIG)  # shipped by the cell that crashes
    with pytest.raises(RankError, match="exit code 3"):
        spawn("", "import os\nfloat(fresh.sum())\nif rank == 1:\n    os._exit(3)\nfloat(weights.sum())")
    assert pool.state == "broken"
    assert segments_left() == [] and mapped_here(prefix) == []


def test_push_sends_a_large_value_through_shared_memory(ip, pool, spawn):
    ip.user_ns["pushed"] = torch.arange(BIG, dtype=torch.float32)
    pool_magic(ip, "push pushed")
    assert segments_left() == []
    del ip.user_ns["pushed"]
    run = spawn("", BACKING + "(backing(pushed.data_ptr()), float(pushed[-1]))")
    for backing, last in run.value:
        assert backing.startswith(segment_path()) and backing.endswith("(deleted)") and last == BIG - 1


def test_large_results_and_pulled_values_come_back_through_shared_memory(ip, pool, spawn):
    # A rank's result goes into a new segment under the results prefix, or over the pages of one this kernel's
    # notebook dropped (wire/result_memory.py), which may be named by an earlier pool's prefix.
    prefix = transport.kernel_prefix()
    run = spawn("", f"import torch\nbig = torch.full(({BIG},), float(rank))\nbig")
    assert [float(value[-1]) for value in run.value] == [0.0, 1.0]
    # The kernel maps each rank's segment and unlinked it at once: it owns the memory.
    assert len(mapped_here(prefix)) == 2 and all(line.endswith("(deleted)") for line in mapped_here(prefix))
    pool_magic(ip, "pull big --rank 1")
    assert float(ip.user_ns["big"].sum()) == float(BIG) and len(mapped_here(prefix)) == 3
    assert segments_left() == []
    del run, ip.user_ns["big"]
    gc.collect()  # a finished run's bookkeeping holds its results in reference cycles
    assert mapped_here(prefix) == []


# --- compiled graphs ---------------------------------------------------------------


COMPILE_AND_COUNT = (
    "import torch, torch_xla.debug.metrics as met\n"
    "def compilations():\n"
    "    return (met.metric_data('CompileTime') or (0,))[0]\n"
    "before = compilations()\n"
    "w = torch.ones(8, 8, device=device)\n"
    "y = float(((w @ w).relu() + rank).sum().cpu())\n"
    "(y, compilations() - before)"
)


def test_a_second_identical_cell_compiles_nothing(pool, spawn):
    first = spawn("", COMPILE_AND_COUNT).value
    assert [new for _, new in first] == [1, 1]
    second = spawn("", COMPILE_AND_COUNT).value
    assert second == [(y, 0) for y, _ in first]  # same results, no new CompileTime sample
    fresh = spawn("--fresh --devices 2", COMPILE_AND_COUNT).value
    assert [new for _, new in fresh] == [1, 1]  # new ranks compile again


# --- interrupts and crashes ---------------------------------------------------------


def test_interrupt_stops_the_cell_and_keeps_the_pool(ip, pool, spawn, marks):
    spawn("", "survivor = rank * 7")
    before = pool_pids(ip)
    interrupt_once_written(marks, 2)
    with pytest.raises(RunInterrupted, match="keeps its ranks"):
        spawn("", BUSY_UNTIL_INTERRUPTED)
    assert pool.state == "ready"
    assert pool_pids(ip) == before
    assert spawn("", "survivor").value == [0, 7]


def test_timeout_stops_the_cell_and_keeps_the_pool(ip, pool, spawn):
    spawn("", "survivor = rank")
    with pytest.raises(RankError, match="timed out.*keeps its ranks"):
        spawn("--timeout 1", "while True:\n    spin = 1")
    assert spawn("", "survivor").value == [0, 1]


def test_ranks_that_ignore_interrupts_break_the_pool_and_the_next_cell_says_so(ip, pool, spawn, marks):
    pids = pool_pids(ip)
    interrupt_once_written(marks, 2)
    cell = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + BUSY_UNTIL_INTERRUPTED
    with pytest.raises(RunInterrupted, match="%xla_pool restart"):
        spawn("", cell)
    assert pool.state == "broken" and wait_gone(pids) == []
    with pytest.raises(UsageError, match="broken.*%xla_pool restart"):
        spawn("", "rank")
    assert "broken" in pool_magic(ip, "")
    pool_magic(ip, "restart")
    assert spawn("", "rank").value == [0, 1]


@pytest.mark.parametrize(
    "crash, pattern",
    [
        ("import os\nos._exit(3)", "exit code 3"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
    ids=["os._exit", "SIGKILL"],
)
def test_a_crashed_rank_breaks_the_pool_and_the_next_cell_does_not_hang(ip, pool, spawn, crash, pattern):
    pids = pool_pids(ip)
    cell = "if rank == 1:\n" + "".join(f"    {line}\n" for line in crash.splitlines()) + "rank"
    with pytest.raises(RankError, match=pattern) as info:
        spawn("", cell)
    assert 1 in info.value.ranks
    assert "%xla_pool restart" in "\n".join(info.value._render_traceback_())
    assert wait_gone(pids) == []
    with pytest.raises(UsageError, match="%xla_pool restart"):
        spawn("", "rank")


def test_a_rank_killed_between_cells_is_noticed_before_the_next_cell_runs(ip, pool, spawn):
    spawn("", "rank")
    victim = ip._xla_magic_session.pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    assert wait_for(lambda: peer_closed(pool.ranks.events[1].sock))  # its death is there for the kernel to read
    with pytest.raises(UsageError, match="lost a rank.*nothing ran"):
        spawn("", "rank")
    with pytest.raises(UsageError, match="broken"):
        spawn("", "rank")


def test_an_interrupt_that_comes_before_a_rank_reads_its_request_still_stops_the_cell(ip, pool, spawn):
    spawn("", "survivor = rank")
    pids = list(pool.pids.values())

    def interrupt_then_wake_the_ranks() -> None:
        press_stop()
        wait_for(lambda: all(got_sigint(pid) for pid in pids))  # the kernel's SIGINT reached the stopped ranks
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)  # they take it while idle (ignored), then read the cell
            except ProcessLookupError:
                pass  # the kernel's interrupt woke them already, and the test is over

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    assert all(stopped(pid) for pid in pids)
    # Once the request is in the ranks' sockets (the kernel waits for answers): they are stopped, so it is unread.
    pressed = when(lambda: main_thread_in(Request.pump) and all(unsent(pool.ranks.events[r].sock) for r in pool.pids),
                   interrupt_then_wake_the_ranks)
    try:
        with pytest.raises(RunInterrupted, match="keeps its ranks"):
            spawn("", "while True:\n    spin = 1")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert pressed.is_set() and pool.state == "ready"
    assert spawn("", "survivor").value == [0, 1]


def test_an_interrupt_while_a_request_is_sent_breaks_the_pool_and_leaks_nothing(ip, pool, spawn):
    selectors_before = epoll_descriptors()
    pids = pool.pids
    os.kill(pids[0], signal.SIGSTOP)  # rank 0 reads nothing: the large request below fills its socket
    assert stopped(pids[0])
    ip.user_ns["bulky"] = list(range(2_000_000))  # ~10 MB of pickle, sent inline
    # Once part of it waits in rank 0's socket, the kernel still sending the rest.
    # Once more of it waits in rank 0's socket than a small frame (the rank may not have read the last one).
    pressed = interrupt_when(lambda: main_thread_in(Ranks.send)
                             and unsent(pool.ranks.events[0].sock) > frame_writer.SMALL_FRAME)
    with pytest.raises(RunInterrupted, match="request to rank 0 was cut off.*%xla_pool restart"):
        spawn("", "len(bulky)")
    assert pressed.is_set()
    del ip.user_ns["bulky"]
    assert pool.state == "broken" and wait_gone(pids.values()) == []
    assert ip._xla_magic_session.history[-1].outcome == "interrupted"
    assert epoll_descriptors() == selectors_before  # the pool's own, and no other
    with pytest.raises(UsageError, match="broken"):
        spawn("", "rank")


def test_an_interrupted_large_write_says_exactly_how_much_of_its_frame_went():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    frame = bytes(range(256)) * 40_000  # 10 MB: more than the socket's buffer takes, and no reader yet
    pressed = interrupt_when(lambda: main_thread_in(frame_writer.write_frame)
                             and unsent(ours) > frame_writer.SMALL_FRAME)
    with pytest.raises(frame_writer.Unsent) as caught:
        frame_writer.write_frame(ours, frame, timeout=WITHIN)
    assert pressed.is_set() and isinstance(caught.value.cause, KeyboardInterrupt)
    ours.close()
    with theirs:
        got = b"".join(iter(lambda: theirs.recv(1 << 20), b""))
    assert 0 < caught.value.sent < len(frame) and got == frame[:caught.value.sent]


def test_an_interrupt_as_a_request_begins_to_go_out_leaves_every_rank_out_and_the_pool_ready(ip, pool, spawn):
    """The stop button lands as the kernel begins to write the request to rank 0 (at Ranks.send's first
    line, where Python checks for signals), before any byte went: no rank has anything to stop."""
    spawn("", "left = rank")
    pids = dict(pool.pids)

    def press_as_the_first_send_begins(frame, event, _arg):
        if event == "call" and frame.f_code is Ranks.send.__code__:
            sys.settrace(None)
            press_stop()  # the handler runs as os.kill returns: KeyboardInterrupt from the call's first line
        return None

    sys.settrace(press_as_the_first_send_begins)
    try:
        with pytest.raises(RunInterrupted, match="keeps its ranks"):
            spawn("", "left = -1")
    finally:
        sys.settrace(None)
    assert pool.state == "ready" and pool.pids == pids
    assert ip._xla_magic_session.history[-1].outcome == "interrupted"
    assert spawn("", "left").value == [0, 1]  # no rank ran the interrupted cell


def test_a_rank_that_keeps_printing_in_the_background_does_not_hold_up_its_cells(pool, spawn):
    # Large writes straight to the descriptor: the socket refills faster than the kernel reads it.
    cell = (
        "import os, threading\n"
        "hush = threading.Event()\n"
        "def chatter():\n"
        "    lines = b'background chatter\\n' * 10000\n"
        "    while not hush.is_set():\n"
        "        os.write(1, lines)\n"
        "threading.Thread(target=chatter, daemon=True).start()\n"
        "rank"
    )
    assert spawn("", cell).value == [0, 1]
    assert spawn("", "rank * 2").value == [0, 2]
    assert spawn("", "hush.set()\nrank").value == [0, 1]


# --- the tpu launch path (rank threads) ---------------------------------------------


def test_tpu_launch_path_keeps_namespaces_and_survives_an_interrupt(ip, thread_pool, spawn, marks):
    assert thread_pool.ranks.backend == "tpu" and thread_pool.ranks.cpu_threads
    run = spawn("", "import os, threading\nkept = (rank, os.getpid())\nthreading.current_thread().name")
    assert all(name != "MainThread" for name in run.value)
    # Rank threads share a process, yet each maps its own copy-on-write view.
    ip.user_ns["weights"] = torch.zeros(BIG)
    assert spawn("", WRITE_MEET_READ).value == [[1.0, 0.0], [0.0, 2.0]]  # while both run
    assert spawn("", "weights[:2].tolist()").value == [[0.0, 0.0]] * 2
    assert float(ip.user_ns["weights"].abs().sum()) == 0.0 and segments_left() == []
    interrupt_once_written(emptied(marks), 2)
    with pytest.raises(RunInterrupted, match="keeps its ranks"):
        spawn("", BUSY_UNTIL_INTERRUPTED)
    values = spawn("", "kept").value
    assert [r for r, _ in values] == [0, 1] and len({pid for _, pid in values}) == 1


def test_rank_threads_in_native_code_are_waited_for_and_a_second_interrupt_stops_them(ip, thread_pool, spawn, marks):
    spawn("", "survivor = rank")
    # time.sleep is native code: a rank thread takes its KeyboardInterrupt only once it returns.
    interrupt_once_written(marks, 2)
    sleeper = "import time\nopen(f'{marks}/{rank}', 'w').close()\ntime.sleep(4)\nwhile True:\n    spin = 1\n"
    with capture_output() as captured, pytest.raises(RunInterrupted, match="keeps its ranks"):
        ip.run_cell_magic("xla_spawn", "", sleeper)
    assert "waiting up to 30 s for rank(s) 0, 1 to leave native code; interrupt again" in captured.stdout
    assert thread_pool.state == "ready" and spawn("", "survivor").value == [0, 1]

    # The second press once the kernel says it waits for native code (which asks for one).
    interrupt_once_written(emptied(marks), 2, then=lambda: shown("interrupt again"))
    with capture_output() as captured, pytest.raises(RunInterrupted, match="second interrupt.*%xla_pool restart"):
        ip.run_cell_magic("xla_spawn", "", "import time\nopen(f'{marks}/{rank}', 'w').close()\ntime.sleep(600)")
    assert "waiting up to 30 s" in captured.stdout
    assert thread_pool.state == "broken"


def test_tpu_launch_path_crash_breaks_the_pool(ip, thread_pool, spawn):
    with pytest.raises(RankError, match="%xla_pool restart"):
        spawn("", "import os\nif rank == 1:\n    os._exit(3)\nrank")
    with pytest.raises(UsageError, match="broken"):
        spawn("", "rank")


# --- nothing left behind --------------------------------------------------------------


def test_unload_stops_the_pool_and_every_rank(ip, spawn):
    """%unload_ext ends the pool, its ranks and values, the launcher and every other process of ours, and takes
    the magics with it; %load_ext afterwards works as the first did."""
    pool_magic(ip, "start --devices 2 --backend cpu")
    launcher = ip._xla_magic_session.host.ensure_launcher()
    launcher.wait_ready()
    pids = pool_pids(ip)
    supervisor = ip._xla_magic_session.pool.ranks.supervisor_pid
    prefix = ip._xla_magic_session.pool.ranks.shipping.held.segments.prefix
    assert spawn("", "float(weights.sum())", weights=torch.ones(BIG)).value == [float(BIG)] * 2
    assert len(mapped_here(prefix)) == 1
    ip.run_line_magic("unload_ext", "xla_magic")
    try:
        assert "xla_spawn" not in ip.magics_manager.magics["cell"]
        assert not alive(launcher.pid)  # ended by the unload itself, not later
        assert wait_gone(pids | {supervisor}) == []
        assert [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE] == []
        assert segments_left() == [] and mapped_here(prefix) == []
    finally:
        ip.run_line_magic("load_ext", "xla_magic")
    assert ip._xla_magic_session.pool is None
    assert spawn("--devices 2", "rank").value == [0, 1]


# --- a real Jupyter kernel and its stop button ------------------------------------------


def test_pool_in_a_real_kernel_survives_the_stop_button():
    kernel = Kernel()
    run = kernel.run
    try:
        run("%load_ext xla_magic")
        reply, text = run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok" and "pool ready" in text
        run("%%xla_spawn\nimport torch\nmodel = torch.nn.Linear(2, 1).to(device)")
        pressed = []

        def press_stop(text: str) -> None:
            if not pressed and text.count("spinning") == 2:
                pressed.append(True)
                kernel.manager.interrupt_kernel()

        reply, text = run("%%xla_spawn\nprint('spinning', rank)\nwhile True:\n    pass", on_output=press_stop)
        assert pressed and reply["ename"] == "RunInterrupted" and "keeps its ranks" in text
        reply, text = run("%%xla_spawn\nstr(next(model.parameters()).device)")
        assert reply["status"] == "ok" and "['xla:0', 'xla:0']" in text
        reply, text = run("import sys\n'torch_xla' in sys.modules or '_XLAC' in sys.modules")
        assert "False" in text
        launcher = next(p for p in psutil.Process(kernel.pid).children() if "xla_magic.launcher" in " ".join(p.cmdline()))
        pool_processes = {p.pid for p in launcher.children(recursive=True)}
        assert len(pool_processes) == 3  # the pool's supervisor and its two ranks
        run("%xla_pool stop")
        assert wait_gone(pool_processes) == []
    finally:
        kernel.close()
