"""A pool across several hosts: 2 simulated hosts (network namespaces) x 2 ranks, one real IPython shell,
a real ipyparallel controller and engines, real launchers and ranks on each host."""

from __future__ import annotations

import os
import signal
import sys

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from tests.hosts_fixtures import (RANKS_PER_HOST, controllers_on, group_members, launch_template,
                                  wait_until_empty)
from tests.hosts_fixtures import hosts, pool, pool_of_the_module  # noqa: F401 (fixtures)
from helpers import interrupt_once_shown, pool_magic, shown, wait_for, when
from xla_magic.runs.errors import RankError, RunInterrupted

WORLD = 2 * RANKS_PER_HOST


HOSTS_TAG = 1  # this module's hosts' names and addresses (tests/hosts_fixtures.py)


@pytest.fixture
def no_pool(ip):
    """No pool is running (the module's is stopped, if an earlier test started it; the next ``pool`` starts it again)."""
    if ip._xla_magic_session.current_pool() is not None:
        assert "pool stopped" in pool_magic(ip, "stop")


def cell(ip, source: str, line: str = ""):
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", line, source)
    return value, shown.stdout, shown.stderr


# --- one world ------------------------------------------------------------------


def test_output_is_tagged_with_host_and_rank_and_values_come_in_rank_order(ip, pool, hosts):
    value, out, _ = cell(ip, "import socket\nprint('on', socket.gethostname(), 'local', local_rank)\n"
                             "(rank, world_size, host, local_rank)")
    assert value == [(r, WORLD, r // RANKS_PER_HOST, r % RANKS_PER_HOST) for r in range(WORLD)]
    for r in range(WORLD):
        h = r // RANKS_PER_HOST
        assert f"[h{h} r{r}] on {hosts.hostname(h)} local {r % RANKS_PER_HOST}" in out.splitlines()


def test_names_the_cell_reads_reach_every_host(ip, pool):
    ip.user_ns["scale"] = 3
    ip.user_ns["offset"] = lambda r: r + 100  # a notebook function, by value
    value, _, _ = cell(ip, "offset(rank) * scale")
    assert value == [(r + 100) * 3 for r in range(WORLD)]


def test_all_reduce_across_hosts_equals_one_process(ip, pool):
    import torch

    value, _, _ = cell(ip, "import torch, torch_xla.core.xla_model as xm\n"
                           "t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + rank\n"
                           "xm.all_reduce(xm.REDUCE_SUM, t.to(device)).cpu()")
    expected = sum(torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) + r for r in range(WORLD))
    for got in value:
        assert torch.equal(got, expected)


TRAIN = """
import torch, torch_xla.core.xla_model as xm
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = inputs.chunk(world_size)[rank].to(device), targets.chunk(world_size)[rank].to(device)
for step in range(5):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    xm.optimizer_step(opt)  # averages the gradients over every rank of every host
[p.detach().cpu() for p in model.parameters()]
"""


def test_training_across_hosts_equals_a_single_process_reference(ip, pool):
    import torch

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8 * WORLD, 4, generator=generator)
    targets = torch.randn(8 * WORLD, 1, generator=generator)
    ip.user_ns.update(inputs=inputs, targets=targets)
    value, _, _ = cell(ip, TRAIN)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):  # the whole batch in one process: the mean of equal shards' mean gradients
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        opt.step()
    for params in value:
        for got, expected in zip(params, model.parameters()):
            assert torch.allclose(got, expected.detach(), atol=1e-6)


def test_the_pool_keeps_each_rank_s_state_between_cells(ip, pool):
    cell(ip, "kept = rank * 10")
    value, _, _ = cell(ip, "kept + 1")
    assert value == [r * 10 + 1 for r in range(WORLD)]


def test_push_and_pull_reach_every_host(ip, pool):
    ip.user_ns["pushed"] = {"a": 1}
    with capture_output():
        ip.run_line_magic("xla_pool", "push pushed")
    cell(ip, "pulled = (pushed['a'], rank)")
    with capture_output():
        ip.run_line_magic("xla_pool", "pull pulled")
    assert ip.user_ns["pulled"] == [(1, r) for r in range(WORLD)]


def test_status_shows_each_host_with_its_engine_launcher_and_ranks(ip, pool, hosts):
    with capture_output() as shown:
        ip.run_line_magic("xla_status", "--text")
    for index, address in enumerate(hosts.addresses()):
        line = next(line for line in shown.stdout.splitlines() if f"Host h{index} {address}" in line)
        assert hosts.hostname(index) in line and "engine" in line and "launcher pid" in line
        assert f"r{index * 2}-r{index * 2 + 1}: ready" in line


def test_the_kernel_and_every_engine_stay_xla_free(ip, pool):
    cell(ip, "import torch_xla\nrank")  # the ranks do use XLA
    assert "torch_xla" not in sys.modules
    assert [row["xla_free"] for row in ip._xla_magic_session.pool.status()] == [True, True]

def test_spmd_on_several_simulated_hosts_is_refused_with_the_reason(ip, pool, hosts):
    with pytest.raises(UsageError, match="XLA's CPU client is one process"):
        ip.run_line_magic("xla_pool", f"start --hosts {','.join(hosts.addresses())} --spmd --backend cpu")


def test_the_controller_listens_only_on_the_hosts_side_and_its_files_are_private(ip, pool, hosts):
    import psutil

    controller = psutil.Process(pool.cluster.controller.process.pid)
    listening = [c.laddr for c in controller.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    # The hosts' side, and loopback for ipyparallel's own links between its schedulers (no host can reach it).
    assert listening and {address.ip for address in listening} <= {hosts.kernel_address, "127.0.0.1"}
    assert any(address.ip == hosts.kernel_address for address in listening)
    security = os.path.join(pool.cluster.profile_dir, "security")
    files = os.listdir(security)
    assert files and all(os.stat(os.path.join(security, f)).st_mode & 0o777 == 0o600 for f in files)


def test_a_fresh_cell_spawns_one_new_world_across_every_host_and_the_pool_goes_on(ip, pool, hosts):
    cell(ip, "kept = rank")
    source = ("import os, socket, torch, torch_xla.core.xla_model as xm\n"
              "total = xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device)).item()\n"
              "(rank, world_size, socket.gethostname(), os.getpid(), 'kept' in globals(), total)")
    value, _, _ = cell(ip, source, line="--fresh")
    assert [row[0] for row in value] == list(range(WORLD)) and {row[1] for row in value} == {WORLD}
    assert [row[2] for row in value] == [hosts.hostname(r // RANKS_PER_HOST) for r in range(WORLD)]
    assert not {row[3] for row in value} & set(pool.pids.values())  # new processes, not the pool's
    assert [row[4] for row in value] == [False] * WORLD and {row[5] for row in value} == {float(WORLD)}
    assert cell(ip, "kept")[0] == list(range(WORLD))  # the pool's ranks kept their namespaces


def test_the_panel_s_interrupt_button_stops_the_cell_on_every_host(ip, pool):
    from tests.test_widget import history_rows, rank_rows
    from xla_magic.notebook import status

    session = ip._xla_magic_session
    panel = status.status_panel(session)
    seen_running: list[str] = []

    def press_when_running(record) -> None:
        # Called from the running cell's own loop, after the panel redrew.
        if record.outcome == "running" and len(record.ranks) == WORLD and all(
                s.state == "running" and s.lines for s in record.ranks.values()):
            if not seen_running:
                panel.redraw()
                seen_running.append(panel.ranks.value)
                assert not panel.interrupt.disabled
                panel.interrupt.click()

    session.listeners.append(press_when_running)
    try:
        with capture_output(), pytest.raises(RunInterrupted, match="stopped on every host"):
            ip.run_cell_magic("xla_spawn", "", "import time\nprint('working', rank, flush=True)\n"
                                               "while True:\n    time.sleep(0.05)\n")
    finally:
        session.listeners.remove(press_when_running)
    assert seen_running, "the panel never showed every host's ranks running"
    assert seen_running[0].count('data-state="running"') == WORLD
    assert all(f"working {r}" in seen_running[0] for r in range(WORLD))  # each rank's last line, live
    panel.redraw()
    assert {row["state"] for row in rank_rows(panel)} == {"killed"}
    assert history_rows(panel)[0]["outcome"] == "interrupted" and panel.interrupt.disabled
    assert cell(ip, "rank")[0] == list(range(WORLD))  # the pool goes on


def test_a_value_crosses_to_each_host_only_when_it_changed(ip, pool):
    from xla_magic.hosts import on_host

    def received() -> list[tuple[str, ...]]:  # what each host's engine got with the last cell
        return pool.client[pool.engines].apply_sync(on_host.received)

    ip.user_ns.update(table=list(range(1000)), step=5)
    assert cell(ip, "(len(table), step)")[0] == [(1000, 5)] * WORLD
    assert received() == [("step", "table")] * 2
    assert cell(ip, "(len(table), step)")[0] == [(1000, 5)] * WORLD
    assert received() == [(), ()]  # nothing changed: nothing crossed
    ip.user_ns["table"].append(1000)  # the same object, changed in place
    assert cell(ip, "(len(table), step)")[0] == [(1001, 5)] * WORLD
    assert received() == [("table",)] * 2
    ip.user_ns["step"] = 6
    assert cell(ip, "(len(table), step)")[0] == [(1001, 6)] * WORLD
    assert received() == [("step",)] * 2
    assert pool.shipping.last_sent == [("step",)] * 2


# --- faults -------------------------------------------------------------------------


def test_a_failing_rank_on_one_host_stops_the_cell_on_every_host(ip, pool):
    source = ("import torch, torch_xla.core.xla_model as xm\n"
              "if rank == 3:\n    raise ValueError('bad shard on the second host')\n"
              "xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device))  # the others wait for rank 3 here\n")
    with pytest.raises(RankError) as raised:
        cell(ip, source)
    shown = "\n".join(raised.value.render_lines())
    assert "h1 r3" in raised.value.summary and "other hosts' cells were stopped" in raised.value.summary
    assert "[h1 r3]" in shown and "ValueError: bad shard on the second host" in shown
    value, _, _ = cell(ip, "rank")  # the pool keeps working on every host
    assert value == list(range(WORLD))


def test_interrupt_stops_the_cell_on_every_host_and_keeps_the_pool(ip, pool):
    cell(ip, "survivor = rank + 1")
    # Global rank 0 sleeps (line 4), every other rank spins (lines 5-6): the error says where each was, by host.
    source = ("import time\nprint('spinning', flush=True)\nif rank == 0:\n    time.sleep(3600)\n"
              "while True:\n    spin = 1\n")
    with capture_output():
        pressed = interrupt_once_shown("spinning", WORLD)
        with pytest.raises(RunInterrupted, match="stopped on every host") as raised:
            ip.run_cell_magic("xla_spawn", "", source)
    assert pressed.is_set()
    where = raised.value.where
    assert where and where[0].startswith("Where each rank was"), raised.value._render_traceback_()
    heads = [line for line in where[1:] if not line.startswith(" ")]
    assert heads[0] == "h0 r0: sleeping in time.sleep (line 4)", where
    others = ", ".join(f"h{rank // RANKS_PER_HOST} r{rank}" for rank in range(1, WORLD))
    assert len(heads) == 2 and heads[1].startswith(f"{others}: "), where
    assert "(line 5)" in heads[1] or "(line 6)" in heads[1], where  # the loop: its test or its body
    value, _, _ = cell(ip, "survivor")
    assert value == [r + 1 for r in range(WORLD)]


def test_timeout_stops_every_host(ip, pool):
    with pytest.raises(RankError, match="timed out"):
        cell(ip, "while True:\n    spin = 1\n", line="--timeout 2")
    assert cell(ip, "rank")[0] == list(range(WORLD))


def test_a_killed_engine_fails_the_cell_naming_its_host_and_breaks_the_pool(ip, pool, hosts):
    engine = pool.engine_pids[1]
    with pytest.raises(RankError) as raised:
        kill_once_every_rank_waits(ip, engine)
    assert f"host h1 ({hosts.address(1)})" in raised.value.summary and "died" in raised.value.summary
    assert "%xla_pool restart" in raised.value.summary
    with pytest.raises(UsageError, match="broken.*%xla_pool restart"):
        cell(ip, "rank")
    # Host 1's launcher and ranks die with its engine.
    assert not wait_until_empty_of(hosts, 1)
    with capture_output() as shown:
        ip.run_line_magic("xla_pool", "restart")
    assert "pool ready" in shown.stdout
    assert cell(ip, "rank")[0] == list(range(WORLD))


def test_a_dead_launcher_fails_the_cell_naming_its_host_and_breaks_the_pool(ip, pool, hosts):
    session = ip._xla_magic_session
    launcher = next(row for row in session.pool.status() if row["index"] == 0)["launcher"]["pid"]
    with pytest.raises(RankError) as raised:
        kill_once_every_rank_waits(ip, launcher)  # its ranks die with it
    summary = raised.value.summary
    assert f"host h0 ({hosts.address(0)})" in summary and "launcher" in summary and "%xla_pool restart" in summary
    with pytest.raises(UsageError, match="broken.*%xla_pool restart"):
        cell(ip, "rank")
    with capture_output() as shown:
        ip.run_line_magic("xla_pool", "restart")
    assert "pool ready" in shown.stdout
    assert cell(ip, "rank")[0] == list(range(WORLD))


def wait_until_empty_of(hosts, index: int, within: float = 60.0) -> list[int]:
    """What is still running on host ``index`` once it is empty (``[]``) or ``within`` s passed."""
    wait_for(lambda: not hosts.processes(hosts.address(index)), within, every=0.2)
    return hosts.processes(hosts.address(index))


def test_nothing_is_left_on_any_host_after_stop(ip, pool, hosts):
    assert any(hosts.processes(address) for address in hosts.addresses())  # engines, launchers, ranks
    controller = ip._xla_magic_session.pool.cluster.controller.process.pid
    with capture_output() as shown:
        ip.run_line_magic("xla_pool", "stop")
    assert "pool stopped" in shown.stdout
    assert wait_until_empty(hosts) == {}
    assert group_members(controller) == []



def test_a_launch_command_that_fails_says_which_host_and_leaves_nothing(ip, hosts, no_pool):
    # Host 1's launch fails (as an ssh to a host that is down would); host 0's engine starts, and must go again.
    unless = os.path.join(os.path.dirname(__file__), "launch_unless.sh")
    template = f"sh {unless} 1 {{index}} {{host}} " + launch_template(hosts)
    with pytest.raises(UsageError, match=f"(?s)the engine of {hosts.address(1)} did not start.*cannot reach") as raised:
        ip.run_line_magic("xla_pool", f"start --hosts {','.join(hosts.addresses())} --backend cpu "
                                      f"--launch '{template}'")
    assert hosts.address(0) not in str(raised.value)
    assert ip._xla_magic_session.current_pool() is None
    assert controllers_on(hosts.kernel_address) == []
    assert wait_until_empty(hosts) == {}


def test_bad_host_options_are_usage_errors(ip, no_pool):
    with pytest.raises(UsageError, match=r"\{host\} and \{index\} only"):
        ip.run_line_magic("xla_pool", "start --hosts 10.213.250.2 --launch 'ssh {user}@{host}'")
    with pytest.raises(UsageError, match="names a host twice"):
        ip.run_line_magic("xla_pool", "start --hosts 10.213.250.2,10.213.250.2")
    with pytest.raises(UsageError, match="give the hosts too"):
        ip.run_line_magic("xla_pool", "start --launch 'ssh {host}'")
    with pytest.raises(UsageError, match="go with %xla_pool start and restart only"):
        ip.run_line_magic("xla_pool", "stop --hosts 10.213.250.2")


def kill_once_every_rank_waits(ip, pid: int) -> None:
    """Run a cell whose every rank prints 'waiting' and spins; SIGKILL ``pid`` once all have printed it."""
    source = "print('waiting', flush=True)\nwhile True:\n    spin = 1\n"
    with capture_output():
        when(lambda: shown("waiting") >= WORLD, lambda: os.kill(pid, signal.SIGKILL))
        ip.run_cell_magic("xla_spawn", "", source)
