"""A pool across three hosts: what a third host is most likely to break. 3 simulated hosts (network
namespaces) x 1 rank, one real IPython shell: global ranks numbered host by host, one collective world,
every line kept, the kernel's place on every host, and nothing left on any host once the pool stops."""

from __future__ import annotations

import os

import psutil
from IPython.utils.capture import capture_output

from helpers import pool_magic
from tests.hosts_fixtures import controllers_on, group_members, listeners, wait_until_empty
from tests.hosts_fixtures import hosts, kernel_place, pool, pool_of_the_module  # noqa: F401 (fixtures)

HOSTS = 3
RANKS_PER_HOST = 1  # 3 ranks on the machine's 2 cores: a pool starts within a minute under load
WORLD = HOSTS * RANKS_PER_HOST
HOSTS_TAG = 4  # this module's hosts' names and addresses (tests/hosts_fixtures.py)


def cell(ip, source: str) -> tuple[object, str]:
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", "", source)
    return value, shown.stdout


def test_ranks_are_numbered_host_by_host_and_tagged_with_their_host(ip, pool, hosts):
    value, out = cell(ip, "import socket\nprint('on', socket.gethostname(), 'local', local_rank)\n"
                          "(rank, world_size, host, local_rank, socket.gethostname())")
    assert value == [(r, WORLD, r // RANKS_PER_HOST, r % RANKS_PER_HOST, hosts.hostname(r // RANKS_PER_HOST))
                     for r in range(WORLD)]
    tagged = sorted(line for line in out.splitlines() if line.startswith("[h"))  # as each host streamed them
    assert tagged == [f"[h{r // RANKS_PER_HOST} r{r}] on {hosts.hostname(r // RANKS_PER_HOST)} "
                      f"local {r % RANKS_PER_HOST}" for r in range(WORLD)]


def test_collectives_span_the_three_hosts_as_one_world(ip, pool):
    import torch

    value, _ = cell(ip, "import torch, torch_xla.core.xla_model as xm\n"
                        "t = torch.arange(4, dtype=torch.float32) * (rank + 1) + rank\n"
                        "(xm.all_reduce(xm.REDUCE_SUM, t.to(device)).cpu(),\n"
                        " xm.all_gather(torch.tensor([rank * 10.0]).to(device)).cpu())")
    shards = [torch.arange(4, dtype=torch.float32) * (r + 1) + r for r in range(WORLD)]
    total, gathered = sum(shards), torch.tensor([r * 10.0 for r in range(WORLD)])
    for got_total, got_gathered in value:
        assert torch.equal(got_total, total)
        assert torch.equal(got_gathered, gathered)  # the world's order is the global rank order


def test_every_line_past_the_fold_is_in_a_log_per_global_rank_the_notebook_can_open(ip, pool):
    from xla_magic.runs.output import DEFAULT_LINES_PER_RANK

    lines = DEFAULT_LINES_PER_RANK + 200
    _, out = cell(ip, f"for i in range({lines}):\n    print(f'line {{i}} of {{rank}}')")
    for r in range(WORLD):
        tag = f"[h{r // RANKS_PER_HOST} r{r}] "
        notice = next(line for line in out.splitlines() if line.startswith(tag + "... more stdout"))
        path = notice.rpartition(" goes to ")[2]
        assert os.path.basename(path) == f"h{r // RANKS_PER_HOST}r{r}.stdout.log"
        with open(path) as log:  # in the kernel's own file system
            assert log.read().splitlines() == [f"line {i} of {r}" for i in range(lines)]


def test_the_kernel_s_directory_reaches_every_host(ip, pool, hosts, kernel_place):
    ip.run_line_magic("cd", os.path.join(kernel_place, "other"))
    value, _ = cell(ip, "import os, socket\n(socket.gethostname(), os.getcwd())")
    assert value == [(hosts.hostname(r // RANKS_PER_HOST), os.path.join(kernel_place, "other"))
                     for r in range(WORLD)]


def test_nothing_is_left_on_any_host_after_stop(ip, pool, hosts):
    assert all(hosts.processes(address) for address in hosts.addresses())  # an engine, launcher, ranks on each
    assert all(listeners(hosts, index) for index in range(HOSTS))
    controller = pool.cluster.controller.process.pid
    assert "pool stopped" in pool_magic(ip, "stop")
    assert wait_until_empty(hosts) == {}
    assert {index: listeners(hosts, index) for index in range(HOSTS)} == {index: [] for index in range(HOSTS)}
    assert group_members(controller) == [] and controllers_on(hosts.kernel_address) == []
    toward_the_hosts = [c.laddr for c in psutil.net_connections(kind="inet")
                        if c.status == psutil.CONN_LISTEN and c.laddr.ip == hosts.kernel_address]
    assert toward_the_hosts == []  # the kernel's side of the bridge: no listener left either
