"""What a one-shot cell starts ends with it, what a pool cell starts ends with the pool; a dead launcher is named.

Real processes in a real shell: subprocesses, forks and daemons started by
cells, a launcher killed with SIGKILL, a result whose loading raises SystemExit.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from IPython.core.error import UsageError

from helpers import DETACHED, alive, pool_magic, wait_gone
from xla_magic.runs.errors import RankError

def test_everything_a_one_shot_cell_starts_ends_with_it(spawn):
    run = spawn("--devices 2", DETACHED)  # it returns: what the cell started does not hold the ranks' output open
    pids = [pid for per_rank in run.value for pid in per_rank]
    assert len(pids) == 4  # the helper and the daemon of each rank
    assert wait_gone(pids) == []


def test_what_a_pool_cell_starts_lives_until_the_pool_stops_however_it_detached(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        run = spawn("", DETACHED)  # it returns, though the children hold the ranks' output open
        # The daemons' middle processes are zombies, as in any Python session that forks and never waits.
        pids = [pid for per_rank in run.value for pid in per_rank if alive(pid)]
        assert len(pids) == 4  # the helper and the daemon of each rank
        assert spawn("", "helper.poll() is None").value == [True, True]
        assert all(alive(pid) for pid in pids)
        # The status panel names them, rank by rank.
        kept = {rank: state.processes for rank, state in ip._xla_magic_session.history[-1].ranks.items()}
        assert sorted(pid for per_rank in kept.values() for pid in per_rank) == sorted(pids)
    finally:
        pool_magic(ip, "stop")
    assert wait_gone(pids) == []


def test_what_a_pool_cell_starts_ends_when_the_pool_restarts(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        run = spawn("", "import subprocess\nhelper = subprocess.Popen(['sleep', '300'])\nhelper.pid")
        assert all(alive(pid) for pid in run.value)
        pool_magic(ip, "restart")
        assert wait_gone(run.value) == []
        assert spawn("", "rank").value == [0, 1]
    finally:
        pool_magic(ip, "stop")


def test_what_a_pool_cell_starts_ends_when_a_rank_dies_however_it_detached(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        run = spawn("", DETACHED)
        pids = [pid for per_rank in run.value for pid in per_rank if alive(pid)]
        assert len(pids) == 4
        victim = ip._xla_magic_session.pool.pids[1]
        os.kill(victim, signal.SIGKILL)
        assert wait_gone([victim]) == []
        with pytest.raises((UsageError, RankError), match="rank 1 died"):  # before or as the cell is sent
            spawn("", "rank")
        assert wait_gone(pids) == []  # the broken pool's, rank 0's too
    finally:
        pool_magic(ip, "stop")


def test_a_result_whose_loading_raises_systemexit_names_the_rank(spawn):
    cell = "class Leaving:\n    def __reduce__(self):\n        return (exit, (3,))\nLeaving() if rank == 1 else rank"
    with pytest.raises(RankError, match=r"rank\(s\) 1 failed.*SystemExit.*could not load rank 1's result") as info:
        spawn("--devices 2", cell)
    assert info.value.results == {0: 0}
    assert spawn("--devices 2", "rank").value == [0, 1]


# A launcher killed mid-cell, named, and the next cell recovering: tests/test_faults.py's crash table
# (launcher-killed-mid-cell, in a one-shot cell and in a pool).


def test_a_pool_whose_launcher_died_says_so(ip, spawn):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        pool = ip._xla_magic_session.pool
        launcher = ip._xla_magic_session.host.launcher.pid
        os.kill(launcher, signal.SIGKILL)
        assert wait_gone([launcher, pool.ranks.supervisor_pid, *pool.pids.values()]) == []  # its pool dies with it
        with pytest.raises(UsageError, match=r"the launcher process died \(SIGKILL.*%xla_pool restart"):
            spawn("", "rank")
        assert re.search(r"broken: the launcher process died", pool_magic(ip, "status"))
        pool_magic(ip, "restart")
        assert spawn("", "rank").value == [0, 1]
    finally:
        pool_magic(ip, "stop")


def test_a_stopped_rank_shows_as_stopped_while_the_cell_waits(ip, spawn):
    from xla_magic.notebook import status

    session = ip._xla_magic_session
    seen: list[str] = []

    def listener(record):
        state = record.ranks.get(1)
        if state is not None and state.state == "stopped" and not seen:
            seen.append(status.status_panel(session).ranks.value)

    session.listeners.append(listener)
    try:
        with pytest.raises(RankError, match=r"timed out after 3 s \(--timeout\) while rank\(s\) 1 stayed stopped by SIGSTOP"):
            spawn("--devices 2 --timeout 3", "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\nrank")
    finally:
        session.listeners.remove(listener)
    assert seen and ">stopped<" in seen[0]
    assert spawn("--devices 2", "rank").value == [0, 1]
