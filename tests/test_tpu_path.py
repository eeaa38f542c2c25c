"""torch_xla's real multi-process TPU path, on a fake TPU host (fake_tpu_host.py): only the chips'
PCI ids, the slice's metadata and libtpu's device runtime are faked (tests/fake_tpu/fake_libtpu.py).

Root only (a mount namespace); skipped elsewhere with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from typing import Iterator

import psutil
import pytest
from IPython.utils.capture import capture_output
from IPython.core.error import UsageError

from fake_tpu_host import fake_tpu_host
from helpers import Terminal, assert_nothing_left, interrupt_once_shown, stop_on_record, the_watchdog_spoke
from xla_magic.runs.errors import RankError, RunInterrupted

SHOW = """
import os, torch, torch_xla.runtime as xr
(rank, xr.global_ordinal(), xr.world_size(), os.environ["TPU_VISIBLE_CHIPS"], os.getpid(),
 (torch.ones(2, device=device) * rank).cpu().tolist())
"""


def test_v5e_8_runs_one_process_per_chip_with_ordinals_0_to_7_and_results_in_order(ip, spawn):
    with fake_tpu_host(ip, "v5litepod-8"):
        run = spawn("--devices 8", SHOW)
    values = run.value
    assert [value[:4] for value in values] == [(r, r, 8, str(r)) for r in range(8)]
    assert len({value[4] for value in values}) == 8  # one process per chip
    assert os.getpid() not in {value[4] for value in values}
    assert [value[5] for value in values] == [[float(r)] * 2 for r in range(8)]


def test_v5e_1_runs_the_rank_in_a_process_of_its_own_that_can_fail_die_and_be_debugged(ip, spawn):
    session = ip._xla_magic_session
    with fake_tpu_host(ip, "v5litepod-1"):
        (value,) = spawn("", SHOW).value
        assert value[:4] == (0, 0, 1, "0")  # torch_xla's one-chip layout: TPU_VISIBLE_CHIPS=0
        # killed as a rank is, the supervisor reports it as with 8 chips
        with pytest.raises(RankError, match="SIGKILL"):
            spawn("", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        # a failure keeps the rank for %debug, in its own process
        with pytest.raises(RankError, match="ZeroDivisionError"):
            spawn("", "x = 1\nx / 0")
        post_mortem = session.post_mortem
        assert post_mortem is not None and list(post_mortem.debuggable) == [0]
        assert post_mortem.ranks.pids[0] not in (os.getpid(), post_mortem.ranks.supervisor_pid)
        session.release_post_mortem()
        # an interrupt whose SIGTERM the rank ignores ends in SIGKILL, for the rank alone
        sent = interrupt_once_shown("deaf", 1)
        cell = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('deaf', flush=True)\ntime.sleep(600)")
        with pytest.raises(RunInterrupted):
            spawn("", cell)
        assert sent.is_set()
        assert {s.state for s in session.history[-1].ranks.values()} == {"killed"}
        with pytest.raises(RankError, match="timed out"):
            spawn("--timeout 1", "import time\ntime.sleep(600)")
        assert spawn("", "rank + 1").value == [1]
        assert_nothing_left(ip)


def test_ranks_are_counted_as_torch_xla_starts_them_and_an_impossible_count_is_refused_before_start(ip, spawn):
    with fake_tpu_host(ip, "v5litepod-8", TPU_PROCESS_BOUNDS="2,2,1"):  # set by the image
        values = spawn("", SHOW).value
        assert [value[:3] for value in values] == [(r, r, 4) for r in range(4)]
        launchers = ip._xla_magic_session.host.launcher
        with pytest.raises(UsageError, match=r"TPU_PROCESS_BOUNDS=2,2,1: torch_xla's spawn starts one process per "
                                             r"chip on 4 of them.*--devices can be 1 or 4, not 8"):
            spawn("--devices 8", "rank")
        assert ip._xla_magic_session.history[-1].ranks.keys() == set(range(4))  # no run was started
        assert ip._xla_magic_session.host.launcher is launchers
    with fake_tpu_host(ip, "v5litepod-8", TPU_VISIBLE_CHIPS="3"):
        with pytest.raises(UsageError, match="TPU_VISIBLE_CHIPS=3 is set.*--devices 1"):
            spawn("", "rank")
        (value,) = spawn("--devices 1", SHOW).value
        assert value[:4] == (0, 0, 1, "3")  # torch_xla's one-chip layout keeps the user's chip


def test_libtpu_init_args_set_or_unset_in_the_kernel_later_keep_torch_xlas_own_flags(ip, spawn):
    read = 'import os\n[os.environ.get(name, "").split() for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")]'
    with fake_tpu_host(ip, "v5litepod-1", LIBTPU_INIT_ARGS="--xla_given=1"):  # the kernel's as the launcher starts
        ((first, first_xla),) = spawn("", read).value  # the launcher's torch_xla merged its flags in at import
        assert "--xla_given=1" in first
        assert "--xla_tpu_use_enhanced_launch_barrier=false" in first
        assert "--xla_tpu_enable_flash_attention=false" in first
        assert "--xla_cpu_enable_fast_math=false" in first_xla  # torch_xla's XLA_FLAGS at import
        torch_xlas = [flag for flag in first if flag != "--xla_given=1"]
        os.environ["LIBTPU_INIT_ARGS"] = "--xla_tpu_enable_flash_attention=true --xla_mine=1"
        os.environ["XLA_FLAGS"] = "--xla_dump_hlo_as_text"  # a real flag: XLA refuses ones it does not know
        ((flags, xla_flags),) = spawn("", read).value
        del os.environ["LIBTPU_INIT_ARGS"], os.environ["XLA_FLAGS"]
        ((left, xla_left),) = spawn("", read).value
    assert flags[:2] == ["--xla_tpu_enable_flash_attention=true", "--xla_mine=1"]  # the user's, and they win
    assert sorted(flags[2:]) == sorted(f for f in torch_xlas if not f.startswith("--xla_tpu_enable_flash_attention"))
    assert sorted(left) == sorted(torch_xlas)  # unset: the kernel's part goes, torch_xla's stays
    assert sorted(xla_flags) == sorted(first_xla + ["--xla_dump_hlo_as_text"])  # XLA_FLAGS merge the same way
    assert xla_left == first_xla


@contextlib.contextmanager
def held(chip_file: str, command: str) -> Iterator[subprocess.Popen]:
    """A process of ours, named ``command``, holding a chip's device file open until the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time\nchip = open({chip_file!r})\nprint('held', flush=True)\n"
         "time.sleep(600)", command], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def refusal(spawn) -> str:
    with pytest.raises(UsageError) as refused:
        spawn("", "rank")
    return " ".join(str(refused.value).split())


def test_a_tpu_held_by_another_process_is_named_with_how_to_free_it_before_any_rank_starts(ip, spawn):
    with fake_tpu_host(ip, "v5litepod-4", chip_files=True):
        with held("/dev/vfio/2", "stray-script") as holder:
            runs = len(ip._xla_magic_session.history)
            message = refusal(spawn)
            assert f"the TPU is held by another process, so no rank can open it: pid {holder.pid} (" in message
            assert "stray-script), yours. End it (kill " + str(holder.pid) in message
            assert "%xla_help tpu-held" in message
            assert len(ip._xla_magic_session.history) == runs  # refused before any run started
        assert len(spawn("", "rank").value) == 4  # freed: the ranks start


def test_a_v4_chip_held_through_dev_accel_is_named_too(ip, spawn):
    """v4 and before: the runtime opens /dev/accelN, not /dev/vfio/N."""
    with fake_tpu_host(ip, "v4-8", chip_files=True), held("/dev/accel3", "another-notebook") as holder:
        message = refusal(spawn)
        assert f"the TPU is held by another process, so no rank can open it: pid {holder.pid} (" in message
        assert "another-notebook), yours. End it (kill " + str(holder.pid) in message


def test_failures_at_start_say_what_failed_in_torch_xlas_words_first(ip, spawn):
    # no metadata server (the fake host's is GKE's variables): torch_xla's import itself fails
    with fake_tpu_host(ip, "v5litepod-4", TPU_SKIP_MDS_QUERY=""):
        with pytest.raises(UsageError) as failed:
            spawn("", "rank")
    said = str(failed.value)
    assert "the launcher's import of torch_xla failed with" in said and "ConnectionError" in said
    assert "metadata.google.internal" in said and "TPU_SKIP_MDS_QUERY=1" in said
    assert "Install it there" not in said  # it is installed
    # torch_xla without libtpu: named, with the install line, before any rank starts
    with fake_tpu_host(ip, "v5litepod-4", libtpu=False):
        runs = len(ip._xla_magic_session.history)
        with pytest.raises(UsageError, match=r"found no libtpu .*one CPU process instead of 4 rank\(s\) on the TPU"
                                             r".*pip install torch_xla\[tpu\]"):
            spawn("", "rank")
        assert len(ip._xla_magic_session.history) == runs
    # PJRT_DEVICE=CPU on a TPU host: torch_xla's spawn starts one process, and the others are counted as such
    with fake_tpu_host(ip, "v5litepod-4", PJRT_DEVICE="CPU"):
        with pytest.raises(RankError) as fewer:
            spawn("", "rank")
    said = str(fewer.value)
    assert ("torch_xla's spawn started 1 process of the 4 expected: rank(s) 1, 2, 3 never started "
            "(torch_xla's PJRT_DEVICE in the launcher: CPU)") in said
    assert "ended without reporting" not in said


HOST_1_OF_V4_16 = dict(TPU_WORKER_ID="1", TPU_WORKER_HOSTNAMES="10.0.0.1,10.0.0.2")
WORLD_HOST_1 = dict(host=1, hosts=2, rank_offset=4, world_size=8, address="127.0.0.1", store_address="10.0.0.1",
                    store_port=29500)
NAMES = """
import os
print("ordinal", rank, flush=True)
(rank, local_rank, host, world_size, os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"])
"""


def host_part(ip, ordinals: str | None = None) -> tuple[list, str]:
    """Host 1's part of a cell on a v4-16 (2 hosts of 4 chips), as its engine runs it: its values and output."""
    from IPython.utils.capture import capture_output

    from xla_magic.cell.options import Cell

    env = dict(HOST_1_OF_V4_16, **({"XLA_MAGIC_FAKE_TPU_ORDINALS": ordinals} if ordinals else {}))
    with fake_tpu_host(ip, "v4-16", **env), capture_output() as captured:
        cell = Cell(source=NAMES, user_ns=ip.user_ns, devices=4, backend="tpu")
        values = ip._xla_magic_session.host.one_shot(cell, WORLD_HOST_1)
    return values, captured.stdout


def test_on_a_pod_slices_second_host_rank_is_the_global_ordinal_and_master_addr_host_0s(ip):
    values, shown = host_part(ip)
    # torch_xla's spawn calls each rank with its global ordinal (4-7 here): the cell's rank, and the kernel's tag
    assert values == [(4 + local, local, 1, 8, "10.0.0.1", "lo") for local in range(4)]
    for ordinal in range(4, 8):
        assert f"[h1 r{ordinal}] ordinal {ordinal}" in shown


def test_ordinals_not_contiguous_on_a_host_still_reach_the_cell_as_rank(ip):
    values, _ = host_part(ip, ordinals="0,2,4,6,1,3,5,7")  # host 1's tasks 4-7 get ordinals 1, 3, 5, 7
    assert values == [(ordinal, local, 1, 8, "10.0.0.1", "lo") for local, ordinal in enumerate((1, 3, 5, 7))]


LINGER = """
import ctypes, os, threading, time
if rank == 0:  # this rank's process will not exit by itself, nor die with its supervisor, nor with its group
    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
    os.setpgid(0, 0)
    threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: its process waits for it
os.getpid()
"""


def test_a_one_shot_cell_ends_only_once_every_rank_process_has_exited(ip, spawn):
    """A worker that outlives its run's end (the stand-in for one slow to exit) is gone before the next cell."""
    with fake_tpu_host(ip, "v5litepod-4"):
        pids = spawn("", LINGER).value
        assert len(set(pids)) == 4
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in pids)
        assert len(spawn("", "rank").value) == 4



FAILS_ON_RANK_2 = "import os\nstep = rank + 3\nif rank == 2:\n    raise ValueError(f'step {step}')\nos.getpid()"


def test_a_failed_one_shot_rank_in_a_process_of_its_own_is_kept_for_debug_rank(ip, spawn, monkeypatch):
    """On torch_xla's one-process-per-chip path, as on the simulation's: the failed rank's process waits for pdb."""
    session = ip._xla_magic_session
    with fake_tpu_host(ip, "v5litepod-4"):
        with pytest.raises(RankError, match="ValueError: step 5"):
            spawn("", FAILS_ON_RANK_2)
        try:
            post_mortem = session.post_mortem
            assert post_mortem is not None and list(post_mortem.debuggable) == [2]
            assert post_mortem.ranks.pids[2] not in (os.getpid(), post_mortem.ranks.supervisor_pid)
            terminal = Terminal({"[rank 2] (Pdb) ": ["p step", "p __import__('threading').current_thread().name", "q"]})
            monkeypatch.setattr(sys, "stdin", terminal)
            with capture_output() as shown:
                ip.run_cell("%xla_debug --rank 2")
            assert "[rank 2] -> raise ValueError(f'step {step}')\n[rank 2] (Pdb) [rank 2] 5\n" in shown.stdout, shown.stdout
            assert "[rank 2] 'MainThread'\n" in shown.stdout  # its process's main thread, not torch_xla's worker
        finally:
            session.release_post_mortem()


HANG_AFTER = 2.0

SLEEPS = """
import time, traceback
print("started", flush=True)
try:
    while True:
        time.sleep(600)
except KeyboardInterrupt as stop:
    stopped_at = [f.lineno for f in traceback.extract_tb(stop.__traceback__) if f.filename.startswith("<xla_spawn")]
    raise
"""


NEVER_ANSWERED = """
import socket
never, _ = socket.socketpair()
print("started", flush=True)
if rank == 0:
    never.recv(1)  # a message no other rank sends
rank
"""


@pytest.fixture(scope="class")
def tpu_pool(ip):
    """A pool of 4 rank processes on a fake v5e-4, one per chip, as torch_xla starts them on a TPU VM."""
    with fake_tpu_host(ip, "v5litepod-4"):
        with capture_output():
            ip.run_line_magic("xla_pool", f"start --hang-after {HANG_AFTER:g}")
        try:
            pool = ip._xla_magic_session.pool
            assert pool.ranks.backend == "tpu" and not pool.ranks.cpu_threads
            yield pool
        finally:
            with capture_output():
                ip.run_line_magic("xla_pool", "stop")


class TestAPoolOfRankProcesses:
    """A pool's rank processes on a fake v5e-4: the pool (a class-scoped fixture), and the fake TPU host (a mount
    namespace) it lives in, last as long as this class's tests, in whatever order the suite runs them."""

    def test_an_interrupt_or_timeout_stops_pool_ranks_sleeping_in_their_processes_at_the_line_and_the_pool_goes_on(
            self, ip, tpu_pool, spawn):
        """torch_xla's spawn calls each rank process's function in a worker thread: SIGINT reaches the main
        thread."""
        pids = spawn("", "import os\nos.getpid()").value
        assert len(set(pids)) == 4 and os.getpid() not in pids
        sent = interrupt_once_shown("started", 4)
        with pytest.raises(RunInterrupted, match="keeps its ranks"):
            spawn("", SLEEPS)
        assert sent.is_set() and tpu_pool.state == "ready"
        assert spawn("", "import os\n(stopped_at, os.getpid())").value == [([6], pid) for pid in pids]
        with pytest.raises(RankError, match="timed out.*keeps its ranks"):
            spawn("--timeout 1", "import time\ntime.sleep(600)")
        assert spawn("", "import os\nos.getpid()").value == pids

    def test_the_watchdog_and_xla_stacks_name_the_cell_line_a_pool_rank_process_is_stuck_at(
            self, ip, tpu_pool, spawn):
        session = ip._xla_magic_session
        pids = dict(tpu_pool.pids)
        listening, sent = stop_on_record(session, the_watchdog_spoke)  # the stop button, once the watchdog spoke
        with listening, pytest.raises(RunInterrupted, match="keeps its ranks") as caught:
            spawn("", NEVER_ANSWERED)
        assert sent.is_set()
        hang = session.history[-1].hang
        assert re.match(r"xla_magic: rank 0 has waited \d+ s in recv \(line 6\); ranks 1-3 finished the cell\. "
                        r"A collective that only some ranks make never completes", hang), hang
        where = caught.value.where
        assert where[1:3] == ["rank 0: waiting in recv (line 6)",
                              "    line 6: never.recv(1)  # a message no other rank sends"], where
        with capture_output() as shown:
            ip.run_line_magic("xla_stacks", "--rank 0")
        assert "rank 0: waiting in recv (line 6)\n    line 6: never.recv(1)" in shown.stdout, shown.stdout
        assert "rank 0: idle (no cell running)" in shown.stdout, shown.stdout  # asked now: its process serves the pool
        assert tpu_pool.pids == pids and spawn("", "rank").value == [0, 1, 2, 3]
