"""A v4-16 of two hosts run as one pool: two simulated hosts (network namespaces), each a fake TPU host
(fake_tpu_host.py, in front of its engine), torch_xla's real multi-process TPU path on each, and a slice
that numbers a host's ranks other than contiguously (XLA_MAGIC_FAKE_TPU_ORDINALS). One real IPython shell.

Root only (namespaces, mounts); skipped elsewhere with the reason.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from IPython.utils.capture import capture_output

from helpers import Terminal, pool_magic, stop_on_record, the_watchdog_spoke
from xla_magic.runs.errors import RankError, RunInterrupted
from tests.hosts_fixtures import hosts, launch_template  # noqa: F401 (fixtures)

HOSTS = 2
RANKS_PER_HOST = 4  # a v4-16: 4 chips a host
HOSTS_TAG = 7  # this module's hosts' names and addresses (tests/hosts_fixtures.py)
HANG_AFTER = 2.0
ORDINALS = "0,2,4,6,1,3,5,7"  # the slice's ordinal of each task: host 0 holds 0, 2, 4, 6 and host 1 holds 1, 3, 5, 7
FAKE_HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_tpu_host.py")


@pytest.fixture(scope="module")
def tpu_pool(ip, hosts):  # noqa: F811
    addresses = ",".join(hosts.addresses())
    template = (f"{launch_template(hosts)} {sys.executable} {FAKE_HOST} --kind v4-16 --worker {{index}} "
                f"--hostnames {addresses} --ordinals {ORDINALS} --")
    try:
        shown = pool_magic(ip, f"start --hosts {addresses} --backend tpu --launch '{template}'")
        assert "pool ready" in shown and "2 hosts x 4 ranks on the tpu backend" in shown, shown
        yield ip._xla_magic_session.pool
    finally:
        pool_magic(ip, "stop")


def cell(ip, source: str) -> tuple[object, str]:
    with capture_output() as shown:
        value = ip.run_cell_magic("xla_spawn", "", source)
    return value, shown.stdout


def host_of(rank: int) -> int:
    return rank % 2  # ORDINALS: the even ranks on host 0, the odd on host 1


def test_rank_tags_results_and_stacks_use_torch_xlas_global_ordinal_on_every_host(ip, tpu_pool, hosts):  # noqa: F811
    value, shown = cell(ip, "import torch_xla.runtime as xr\nprint('ordinal', xr.global_ordinal(), flush=True)\n"
                            "(rank, xr.global_ordinal(), local_rank, host, world_size)")
    # results by global rank, whatever order the hosts' ranks came in
    assert value == [(r, r, r // 2, host_of(r), 8) for r in range(8)]
    tagged = sorted(line for line in shown.splitlines() if line.startswith("[h"))
    assert tagged == sorted(f"[h{host_of(r)} r{r}] ordinal {r}" for r in range(8))
    assert tpu_pool.label(3) == "h1 r3" and tpu_pool.label(6) == "h0 r6"
    # a failure names the ordinal's rank, on its host
    with capture_output():
        with pytest.raises(RankError) as failed:
            ip.run_cell_magic("xla_spawn", "", "if rank == 5:\n    raise ValueError('five')\nrank")
    assert "rank(s) h1 r5 failed" in str(failed.value)
    assert [f.rank for f in failed.value.failures] == [5]
    finished = failed.value.results  # those that ended before the hosts were stopped, by their ordinal
    assert finished and 5 not in finished and all(value == rank for rank, value in finished.items()), finished
    # %xla_stacks between cells: every rank by its global ordinal, on its host
    with capture_output() as captured:
        ip.run_line_magic("xla_stacks", "")
    lines = captured.stdout.splitlines()
    now = lines.index("Where the pool's ranks are now:")
    assert lines[now + 1] == "h0 r0, h1 r1, h0 r2, h1 r3, h0 r4, h1 r5, h0 r6, h1 r7: idle (no cell running)", lines


XLA_INIT = """
import os, torch.distributed as dist, torch_xla.distributed.xla_backend
dist.init_process_group("xla", init_method="xla://")
store = dist.distributed_c10d._get_default_store()
store.set(f"host-of-{rank}", str(host))
theirs = [int(store.get(f"host-of-{other}")) for other in range(world_size)]  # waits for every rank's key
met = (dist.get_rank(), dist.get_world_size(), theirs, os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"])
dist.destroy_process_group()
met
"""


def test_init_process_group_xla_meets_on_host_0_across_the_hosts(ip, tpu_pool, hosts):  # noqa: F811
    value, _ = cell(ip, XLA_INIT)
    first = hosts.addresses()[0]
    # torch_xla's xla:// rendezvous: a TCP store on host 0 (MASTER_ADDR), every rank of both hosts meeting there
    assert value == [(r, 8, [host_of(o) for o in range(8)], first, "eth0") for r in range(8)]


STUCK_ON_5 = """
import socket
never, _ = socket.socketpair()
if rank == 5:
    never.recv(1)  # a message no other rank sends
rank
"""


def test_the_watchdog_an_interrupt_and_xla_debug_name_the_global_ordinal_across_the_hosts(ip, tpu_pool, monkeypatch):
    session = ip._xla_magic_session
    pids = dict(tpu_pool.pids)
    listening, sent = stop_on_record(session, the_watchdog_spoke)  # the stop button, once the watchdog spoke
    with listening, capture_output(), pytest.raises(RunInterrupted, match="keeps its ranks"):
        ip.run_cell_magic("xla_spawn", f"--hang-after {HANG_AFTER:g}", STUCK_ON_5)
    assert sent.is_set()
    hang = session.history[-1].hang
    assert re.match(r"xla_magic: h1 r5 has waited \d+ s in recv \(line 5\); ", hang), hang
    assert tpu_pool.pids == pids  # the rank processes of both hosts kept, each stopped at its line
    # a failure on h1 r3 (host 1's second chip): %xla_debug --rank takes the ordinal
    with capture_output(), pytest.raises(RankError, match="ValueError: step 6"):
        ip.run_cell_magic("xla_spawn", "", "step = rank + 3\nif rank == 3:\n    raise ValueError(f'step {step}')")
    terminal = Terminal({"[h1 r3] (Pdb) ": ["p step", "q"]})
    monkeypatch.setattr(sys, "stdin", terminal)
    with capture_output() as shown:
        ip.run_cell("%xla_debug --rank 3")
    assert "[h1 r3] (Pdb) [h1 r3] 6\n" in shown.stdout, shown.stdout
    assert cell(ip, "rank")[0] == list(range(8))
