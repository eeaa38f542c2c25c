"""The CPU simulation's collectives against the same computation done in one process.

Each cell makes many calls (every cell costs a process start per rank); the
expected values are computed here, in the test process, with plain torch
from every rank's inputs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_every_rank, kernel_is_xla_free


def inputs(rank: int, n: int) -> torch.Tensor:
    """What rank ``rank`` holds in the cells: (2n, 3), distinct on every rank."""
    return torch.arange(6 * n, dtype=torch.float32).reshape(2 * n, 3) + 100 * rank


# --- torch_xla's own calls ------------------------------------------------------

XM = """
import os, torch, torch_xla, torch.distributed as dist
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

n, r, dev = world_size, rank, device
x = (torch.arange(6 * n, dtype=torch.float32).reshape(2 * n, 3) + 100 * r).to(dev)
half = max(1, n // 2)
groups = [list(range(s, s + half)) for s in range(0, n, half)]
met.clear_all()
out = {"initialized": dist.is_initialized()}
out["all_to_all"] = xm.all_to_all(x, 0, 1, n).cpu()
out["all_to_all_groups"] = xm.all_to_all(x, 0, 0, half, groups=groups).cpu()
ring = [[i, (i + 1) % n] for i in range(n)]
out["permute_ring"] = xm.collective_permute(x, ring).cpu()
out["permute_one"] = xm.collective_permute(x[:1], [[0, n - 1]]).cpu()
if r == 0:
    xm.send(x * 2, channel_id=7)
if r == n - 1:
    out["recv"] = xm.recv(torch.zeros(2 * n, 3, device=dev), channel_id=7).cpu()
shard = torch.zeros(2 * n, 3, device=dev)  # the full shape: torch_xla rebinds it to the shard
returned = xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, 0, n, output=shard, pin_layout=False)
out["scatter_out"] = [shard.cpu(), returned is shard]
outs = [torch.zeros(1, device=dev), torch.zeros(1, device=dev)]
gathered = xm.all_gather([x, x[:, :1]], dim=1, output=outs, pin_layout=False)
out["gather_out_list"] = [t.cpu() for t in outs] + [gathered is outs]
out["gather_bucketized"] = [t.cpu() for t in xm.all_gather_bucketized([x, x * 3], bucket_cap_mb=0)]
out["scatter_bucketized"] = [
    t.cpu() for t in xm.reduce_scatter_bucketized(xm.REDUCE_MAX, [x, x + 1, -x], 0.5, 0, n, bucket_cap_mb=0)
]
grads = [x.clone(), x[0].clone()]
xm.all_reduce_bucketized_gradients(grads, scale=1.0 / n, groups=None, pin_layout=False, bucket_cap_mb=0)
out["reduce_bucketized"] = [g.cpu() for g in grads]
int_x = x.to(torch.int32)
out["int_all_to_all"] = xm.all_to_all(int_x, 0, 0, n).cpu()
met.clear_all()
xm.all_to_all(x, 0, 0, n)  # what a TPU counts: the collective, not the simulation's copies
out["counters"] = sorted(c for c in met.counter_names() if c.startswith("xla::"))
out["after_initialized"] = dist.is_initialized()
out
"""


def expected_xm(n: int, r: int) -> dict:
    xs = [inputs(i, n) for i in range(n)]
    half = max(1, n // 2)
    group = [g for g in (list(range(s, s + half)) for s in range(0, n, half)) if r in g][0]
    pos = group.index(r)
    blocks = lambda t, k: list(t.chunk(k, dim=0))  # noqa: E731
    shard = lambda t, k, i: t.chunk(k, dim=0)[i]  # noqa: E731
    total = sum(xs)
    expected = {
        "initialized": False,
        "all_to_all": torch.cat([blocks(xs[i], n)[r] for i in range(n)], dim=1),
        "all_to_all_groups": torch.cat([blocks(xs[i], half)[pos] for i in group], dim=0),
        "permute_ring": xs[(r - 1) % n],
        "permute_one": xs[0][:1] if r == n - 1 else torch.zeros(1, 3),
        "scatter_out": [shard(total, n, r), True],
        "gather_out_list": [torch.cat(xs, dim=1), torch.cat([t[:, :1] for t in xs], dim=1), True],
        "gather_bucketized": [torch.cat(xs), torch.cat([t * 3 for t in xs])],
        "scatter_bucketized": [
            shard(torch.stack(v).amax(0) * 0.5, n, r) for v in (xs, [t + 1 for t in xs], [-t for t in xs])
        ],
        "reduce_bucketized": [total * (1.0 / n), total[0] * (1.0 / n)],
        "counters": ["xla::AllToAll"],
        "after_initialized": False,
    }
    ints = [t.to(torch.int32) for t in xs]
    expected["int_all_to_all"] = torch.cat([ints[i].chunk(n, dim=0)[r] for i in range(n)], dim=0)
    if r == n - 1:
        expected["recv"] = xs[0] * 2
    return expected


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_xm_collectives_match_one_process(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", XM)
    assert_every_rank(run.value, lambda rank: expected_xm(devices, rank))
    assert kernel_is_xla_free()


# --- torch.distributed over the "xla" process group, DDP, torch.compile ------------

DIST = """
import torch, torch_xla, torch.distributed as dist
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_backend
import torch_xla.debug.metrics as met
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

n, r, dev = world_size, rank, device
x = (torch.arange(6 * n, dtype=torch.float32).reshape(2 * n, 3) + 100 * r).to(dev)
out = {"before": dist.is_initialized()}
dist.init_process_group("xla", init_method="xla://")
out["group"] = [dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_backend()]
t = x.clone(); dist.all_reduce(t); out["all_reduce"] = t.cpu()
t = x.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX); out["all_reduce_max"] = t.cpu()
parts = [torch.zeros_like(x) for _ in range(n)]; dist.all_gather(parts, x); out["all_gather"] = [p.cpu() for p in parts]
flat = torch.zeros(2 * n * n, 3, device=dev); dist.all_gather_into_tensor(flat, x); out["all_gather_into_tensor"] = flat.cpu()
piece = torch.zeros(2, 3, device=dev); dist.reduce_scatter_tensor(piece, x); out["reduce_scatter_tensor"] = piece.cpu()
outs = [torch.zeros(2, 3, device=dev) for _ in range(n)]; dist.all_to_all(outs, list(x.chunk(n))); out["all_to_all"] = [o.cpu() for o in outs]
single = torch.zeros_like(x); dist.all_to_all_single(single, x); out["all_to_all_single"] = single.cpu()
t = x.clone(); dist.broadcast(t, src=n - 1); out["broadcast"] = t.cpu()
received = torch.full((2 * n, 3), -1.0, device=dev)
if n > 1:
    if r % 2 == 0:
        dist.send(x, (r + 1) % n); dist.recv(received, (r - 1) % n)
    else:
        dist.recv(received, (r - 1) % n); dist.send(x, (r + 1) % n)
out["send_recv_ring"] = received.cpu()
piece = torch.zeros(2 * n, 3, device=dev)
dist.scatter(piece, [x * (i + 1) for i in range(n)] if r == 0 else None, src=0); out["scatter"] = piece.cpu()
t = x.clone(); dist.reduce(t, dst=0); out["reduce"] = t.cpu()
at_0 = [torch.zeros_like(x) for _ in range(n)] if r == 0 else None
dist.gather(x, at_0, dst=0); out["gather"] = [g.cpu() for g in at_0] if r == 0 else None
dist.barrier()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(dev)
ddp = DDP(model, gradient_as_bucket_view=True)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    ddp(x / 100).pow(2).mean().backward()
    optimizer.step()
    torch_xla.sync()
out["ddp"] = [p.detach().cpu() for p in model.parameters()]

def summed(t):
    dist.all_reduce(t)
    return t * 2
compiled = torch.compile(summed, backend="openxla")
met.clear_all()
out["compiled"] = [compiled(x.clone()).cpu(), compiled(x.clone() + 1).cpu()]  # the second call must not replay the first's values
out["compiled_counter"] = "xla::all_reduce" in met.counter_names()
full = torch.compile(lambda t: xm.all_reduce(xm.REDUCE_SUM, t) + 1, backend="openxla", fullgraph=True)
out["compiled_xm"] = [full(x).cpu(), full(x * 2).cpu()]
try:
    torch.compile(lambda t: xm.all_to_all(t, 0, 0, n), backend="openxla", fullgraph=True)(x)
    out["refused"] = "not refused"
except Exception as exc:
    out["refused"] = "simulated on CPU by xla_magic" in str(exc) and "fullgraph" in str(exc)
out
"""


def ddp_in_one_process(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """DDP averages the ranks' gradients: the same as one model on every rank's batch, mean of means."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        (sum(model(x / 100).pow(2).mean() for x in xs) / len(xs)).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def expected_dist(n: int, r: int) -> dict:
    xs = [inputs(i, n) for i in range(n)]
    x, total = xs[r], sum(xs)
    return {
        "before": False,
        "group": [True, r, n, "xla"],
        "all_reduce": total,
        "all_reduce_max": torch.stack(xs).amax(0),
        "all_gather": xs,
        "all_gather_into_tensor": torch.cat(xs),
        "reduce_scatter_tensor": total.chunk(n)[r],
        "all_to_all": [xs[i].chunk(n)[r] for i in range(n)],
        "all_to_all_single": torch.cat([xs[i].chunk(n)[r] for i in range(n)]),
        "broadcast": xs[n - 1],
        "send_recv_ring": xs[(r - 1) % n],
        "scatter": xs[0] * (r + 1),
        "reduce": total if r == 0 else x,
        "gather": xs if r == 0 else None,
        "compiled": [total * 2, (total + n) * 2],
        "compiled_counter": True,
        "compiled_xm": [total + 1, total * 2 + 1],
        "refused": True,
    }


# At 2 and 4 ranks: the simulation's collectives at 8 are test_xm_collectives_match_one_process's; here eight
# ranks would only compile the same graphs four times more on two cores.
@pytest.mark.parametrize("devices", [2, 4])
def test_torch_distributed_ddp_and_compiled_collectives_match_one_process(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", DIST)
    reference = ddp_in_one_process([inputs(i, devices) for i in range(devices)])
    trained = [got.pop("ddp") for got in run.value]
    for rank, params in enumerate(trained):
        assert all(torch.equal(a, b) for a, b in zip(params, trained[0])), f"rank {rank} drifted from rank 0"
    for a, b in zip(trained[0], reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_every_rank(run.value, lambda rank: expected_dist(devices, rank))


# --- collectives that never cross ------------------------------------------------

DIFFERENT = """import torch, torch_xla.core.xla_model as xm
t = torch.ones(rank * 1000 + 1, device=device)
xm.all_reduce(xm.REDUCE_SUM, t) if rank == 0 else xm.all_gather(t)
"""
ONE_MORE_ON_RANK_0 = """import torch, torch_xla.core.xla_model as xm
if rank == 0:
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(4096, device=device))
"""
IN_STEP = "import torch, torch_xla.core.xla_model as xm\nxm.all_reduce(xm.REDUCE_SUM, torch.ones(3, device=device) * (rank + 1)).sum().item()"


def test_ranks_in_different_collectives_at_once_are_named_and_the_pool_goes_on(ip, pool, spawn):
    """Values of different sizes never meet: each rank's call is named before any travels, on both ranks."""
    from xla_magic.runs.errors import RankError

    with pytest.raises(RankError) as failed:
        spawn("", DIFFERENT)
    text = "\n".join(failed.value.render_lines())
    assert failed.value.ranks == [0, 1]
    assert "the ranks reached different collectives (rank 0: xm.all_reduce, rank 1: xm.all_gather)" in text, text
    assert spawn("", IN_STEP).value == [9.0, 9.0]


def test_a_collective_left_half_done_in_a_pool_never_crosses_the_next_ones(ip, pool, spawn):
    """Rank 0 makes one collective more and is stopped in it: gloo's counters are then out of step between
    the ranks (before, the next cells' values met the wrong receives and gloo aborted rank 0: SIGABRT).
    Every rank moves to a new group instead, and the next cells' collectives are right."""
    from xla_magic.runs.errors import RankError

    assert spawn("", IN_STEP).value == [9.0, 9.0]  # the group is made
    with pytest.raises(RankError) as stopped:
        spawn("--timeout 30", ONE_MORE_ON_RANK_0)
    assert "timed out" in "\n".join(stopped.value.render_lines())
    for _ in range(3):
        assert spawn("", IN_STEP).value == [9.0, 9.0]
