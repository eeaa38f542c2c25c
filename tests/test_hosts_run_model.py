"""Several hosts say what one host says: the watchdog's line names every global rank while the cell runs, the
panel's "where" moves, %xla_stacks asks every rank on every host where it is now, and --compile-cache goes to
every host's ranks. 2 simulated hosts (network namespaces) x 2 ranks, one real IPython shell."""

from __future__ import annotations

import html
import math
import os
import re
import shutil
import tempfile
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from helpers import Listening, stacks_with_a_thread_left
from tests.hosts_fixtures import hosts, pool, pool_of_the_module  # noqa: F401 (fixtures)
from xla_magic.notebook import status
from xla_magic.runs.errors import RunInterrupted
from xla_magic.runs.record import RunRecord

HOSTS_TAG = 5  # this module's hosts' names and addresses (tests/hosts_fixtures.py)
HANG_AFTER = 2.0


def test_the_watchdog_names_every_rank_on_every_host_while_the_cell_runs(ip, pool):
    # Rank 0 waits in a rendezvous the others never join; they finish, on both hosts. The line must say so of
    # all four while the cell still runs, and the panel's rows must read as they do on one host at that moment.
    cell = ("import torch_xla.core.xla_model as xm\n"
            "print('in place', flush=True)\n"
            "if rank == 0:\n"
            "    xm.rendezvous('save')\n")
    seen: dict[str, object] = {}

    def listener(record: RunRecord) -> None:
        if record.hang and "hang" not in seen:
            seen["hang"] = record.hang
            seen["states"] = {rank: state.state for rank, state in record.ranks.items()}
            seen["panel"] = status.ranks_html(record)
            record.interrupt_requested = True  # as the panel's Interrupt button does

    with Listening(ip._xla_magic_session, listener), capture_output() as shown, pytest.raises(RunInterrupted):
        ip.run_cell_magic("xla_spawn", f"--hang-after {HANG_AFTER:g} --timeout 200", cell)
    line = seen.get("hang")
    assert line, f"no watchdog line while the cell ran; the cell showed: {shown.stdout}"
    assert re.search(r"h0 r0 has waited \d+ s in xm\.rendezvous\('save'\) \(line 4\)", line), line
    assert "h0 r1, h1 r2, h1 r3 finished the cell" in line, line
    assert line in shown.stdout  # said once under the cell, as on one host
    assert seen["states"] == {0: "running", 1: "done", 2: "done", 3: "done"}
    waiting = html.escape("waiting in xm.rendezvous('save') (line 4)")
    assert f'<td class="xla-where">{waiting}</td>' in seen["panel"]
    # %xla_stacks tells the watchdog's line again, with every rank's place by its host.
    with capture_output() as captured:
        ip.run_line_magic("xla_stacks", "")
    assert "h0 r0: waiting in xm.rendezvous('save') (line 4)" in captured.stdout


def test_xla_stacks_asks_every_rank_on_every_host_where_it_is_now(ip, pool):
    lines, now = stacks_with_a_thread_left(ip)
    assert lines[now + 1:now + 4] == ["h0 r0, h0 r1, h1 r2, h1 r3: idle (no cell running)",
                                      "  thread 'napper': sleeping in time.sleep (line 3)",
                                      "    line 3 in nap: time.sleep(600)"], lines
    with capture_output() as captured:
        ip.run_line_magic("xla_stacks", "--rank 3")
    assert "h1 r3: idle (no cell running)" in captured.stdout
    assert "h0 r0" not in captured.stdout.split("Where the pool's ranks are now:")[-1]


def test_the_panel_s_where_moves_on_every_host_as_the_ranks_move(ip, pool):
    # Each rank sleeps at one line, then at another: the kernel's record (what the panel draws) follows both.
    cell = ("import time\n"
            "time.sleep(3 + rank)\n"
            "print('moved', flush=True)\n"
            "time.sleep(600)\n")
    places: dict[int, list[str]] = {rank: [] for rank in range(4)}
    done = threading.Event()

    def listener(record: RunRecord) -> None:
        for rank, state in record.ranks.items():
            if state.where and (not places[rank] or places[rank][-1] != state.where):
                places[rank].append(state.where)
        if all(len(seen) >= 2 for seen in places.values()) and not done.is_set():
            done.set()
            record.interrupt_requested = True

    deadline = time.monotonic() + 240
    with Listening(ip._xla_magic_session, listener), capture_output(), pytest.raises(RunInterrupted):
        ip.run_cell_magic("xla_spawn", f"--hang-after {HANG_AFTER:g} --timeout 200", cell)
    assert time.monotonic() < deadline
    for rank, seen in places.items():
        assert seen[:2] == ["sleeping in time.sleep (line 2)", "sleeping in time.sleep (line 4)"], (rank, places)


def test_a_restart_keeps_every_host_s_engine_and_starts_fresh_ranks(ip, pool):
    with capture_output():
        ip.run_cell_magic("xla_spawn", "", "kept = rank")
    engines, ranks = list(pool.engine_pids), dict(pool.pids)
    with capture_output() as shown:
        ip.run_line_magic("xla_pool", "restart")
    assert "pool ready" in shown.stdout
    assert ip._xla_magic_session.pool is pool and pool.engine_pids == engines  # the same cluster, no new engine
    assert set(pool.pids) == set(ranks) and not set(pool.pids.values()) & set(ranks.values())  # new ranks
    with capture_output():
        value = ip.run_cell_magic("xla_spawn", "", "'kept' in dir()")
    assert value == [False] * 4


def test_the_compile_cache_goes_to_every_host_s_ranks_as_on_one_host(ip, pool):
    # Outside /tmp, which each simulated host has of its own: the hosts share this disk, as a TPU pod's workers
    # share nothing but their own; each rank process writes its own folder either way.
    root = tempfile.mkdtemp(prefix="xla-magic-hosts-cache-", dir="/var/tmp")
    try:
        with capture_output() as shown:
            ip.run_line_magic("xla_pool", f"restart --compile-cache {root}")
        assert "pool ready" in shown.stdout and "compile cache" not in shown.stdout, shown.stdout
        with capture_output():
            value = ip.run_cell_magic("xla_spawn", "", "import torch\n(torch.ones(2, device=device) * rank).sum().item()")
        assert value == [0.0, 2.0, 4.0, 6.0]
        leaves = sorted(folder.rpartition(os.sep)[2] for folder, dirs, files in os.walk(root) if files)
        assert leaves == [f"rank-{rank}-of-4" for rank in range(4)], leaves
        with capture_output() as status:
            ip.run_line_magic("xla_status", "--text")
        cache_line = next((line for line in status.stdout.splitlines() if line.strip().startswith("Cache:")), "")
        assert f"h0: {root}: " in cache_line and f"h1: {root}: " in cache_line, status.stdout
        with pytest.raises(UsageError, match="opened their compilation cache when they started"):
            ip.run_cell_magic("xla_spawn", "--compile-cache off", "rank")
        # A place no rank can write: the cells run without it, and the kernel says so once for every host.
        with capture_output() as shown:
            ip.run_line_magic("xla_pool", "restart --compile-cache /proc/xla-magic-cache")
        said = [line for line in shown.stdout.splitlines() if "compile cache" in line]
        assert len(said) == 1 and said[0].startswith("compile cache: not used (every rank: /proc/xla-magic-cache "
                                                     "is not writable"), shown.stdout
        with capture_output() as shown:
            assert ip.run_cell_magic("xla_spawn", "", "rank") == [0, 1, 2, 3]
        assert "compile cache" not in shown.stdout
    finally:
        with capture_output():
            ip.run_line_magic("xla_pool", "restart --compile-cache off")
        shutil.rmtree(root, ignore_errors=True)


def test_what_xla_did_on_every_host_is_told_under_the_cell_and_by_xla_report(ip, pool):
    # Each rank recompiles as its tensor doubles: the line under the cell says so once, for the world, and
    # %xla_report holds every global rank's account, as on one host.
    cell = ("import torch\nx = torch.ones(4, device=device) * rank\nfor step in range(3):\n"
            "    x = torch.cat([x, x])\n    x.sum().item()\n")
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "", cell)
    said = [line for line in shown.stdout.splitlines() if line.startswith("XLA:")]
    assert len(said) == 1 and "recompiled at line 5" in said[0] and "f32[8] → f32[16]" in said[0], shown.stdout
    record = ip._xla_magic_session.last_cell
    assert record.cell == cell and sorted(record.ranks) == [0, 1, 2, 3]
    for rank, state in record.ranks.items():
        assert state.xla is not None and rank in state.xla["ranks"] and state.xla["compiles"] == 3, (rank, state.xla)
    with capture_output() as shown:
        ip.run_line_magic("xla_report", "--text")
    assert shown.stdout.startswith(f"What XLA did in run {record.run_id}:"), shown.stdout
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "--xla-report off", cell)
    assert "XLA" not in shown.stdout and all(state.xla is None
                                              for state in ip._xla_magic_session.last_cell.ranks.values())


def test_xla_memory_asks_every_host_s_ranks_between_cells(ip, pool):
    """Each host's engine asks its own ranks; the answers come back by global rank, each under its own tag."""

    def used() -> list[float]:  # each rank's used bytes, as the summary of every rank says them
        with capture_output() as every:
            ip.run_line_magic("xla_memory", "")
        found = re.findall(r"\n  h(\d) r(\d): ([\d.]+)([BKM]) of 16\.00G used; ", every.stdout)
        assert [(int(h), int(r)) for h, r, _, _ in found] == [(r // 2, r) for r in range(4)], every.stdout
        return [float(size) * {"B": 1, "K": 1 << 10, "M": 1 << 20}[unit] for _, _, size, unit in found]

    before = used()  # what the module's earlier cells left on the ranks
    with capture_output():
        ip.run_cell_magic("xla_spawn", "", "import torch, torch_xla\n"
                                            "held = torch.ones(16 * (rank + 1), 128, device=device)\ntorch_xla.sync()")
    with capture_output() as one:
        ip.run_line_magic("xla_memory", "--rank 3")
    assert one.stdout.startswith("Device memory of h1 r3: "), one.stdout
    assert "  held  float32[64, 128]  other" in one.stdout, one.stdout
    grown = [after - earlier for after, earlier in zip(used(), before)]
    # each rank's own share, by its global rank (after the module's earlier cells, every rank also grew by 4 KiB)
    assert [size - grown[0] for size in grown] == [8192 * rank for rank in range(4)] and grown[0] >= 8192, grown


def test_what_the_ranks_log_on_every_host_is_drawn_under_the_cell_by_global_rank(ip, pool):
    # Each host sends its ranks' batches on to the kernel (hosts/metrics.py): the line under the cell is the
    # mean of all four ranks, a NaN on h1 r3 is said once under its global rank, --metrics ranks names every
    # global rank, and %xla_metrics holds each rank's values under its global rank, as on one host.
    cell = ("import torch, torch_xla\nfor step in range(20):\n"
            "    log(loss=torch.tensor(1.0 / (step + 1), device=device) * (rank + 1),\n"
            "        gap=float('nan') if rank == 3 and step >= 10 else 1.0)\n"
            "    torch_xla.sync()\n")
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "", cell)
    mean = (1 + 2 + 3 + 4) / 4 / 20
    drawn = [set(line.split(" · ")) for line in shown.stdout.splitlines() if "(step 19)" in line]
    assert drawn == [{f"loss {mean:.4g} (step 19)", "gap nan (step 19)"}], shown.stdout  # names in the order they came
    said = [line for line in shown.stdout.splitlines() if line.startswith("log: ")]
    assert said == ["log: gap is nan at step 10 on rank 3 (drawn as a gap)"], shown.stdout
    table = ip.run_line_magic("xla_metrics", "")
    rows = [(rank, step, name, value) for rank, step, name, value in
            zip(table["rank"], table["step"], table["name"], table["value"])]
    assert sorted({row[0] for row in rows}) == [0, 1, 2, 3]
    assert len(rows) == 4 * 20 * 2, len(rows)
    for rank, step, name, value in rows:
        if name == "loss":
            assert math.isclose(value, (rank + 1) / (step + 1), rel_tol=1e-6), (rank, step, value)
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "--metrics ranks", "for step in range(3):\n    log(loss=10 * rank + step)")
    assert "loss 2 (rank 0), 12 (rank 1), 22 (rank 2), 32 (rank 3) (step 2)" in shown.stdout, shown.stdout
    # Ranks spawned for one cell say their global rank as they start: their values are named by it too.
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "--fresh", "log(step=7, seen=rank)")
    assert "seen 1.5 (step 7)" in shown.stdout, shown.stdout
    table = ip.run_line_magic("xla_metrics", "")
    assert sorted(zip(table["rank"], table["value"])) == [(rank, float(rank)) for rank in range(4)]
    with pytest.raises(UsageError, match="--metrics-dir writes each rank's TensorBoard files where it runs"):
        ip.run_cell_magic("xla_spawn", "--metrics-dir /var/tmp/xla-magic-never", "rank")
