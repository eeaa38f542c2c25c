"""The CPU simulation: unmodified torch_xla code across simulated ranks, via a real shell."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import assert_every_rank, kernel_is_xla_free
from helpers import EACH_REFUSED, assert_refused
from xla_magic.runs.errors import RankError

# --- a data-parallel training cell written for a TPU ---------------------------

# Run in the ranks (inside the training cell) and in the kernel (the reference).
SETUP = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

torch.manual_seed(0)
inputs = torch.randn(256, 8)
targets = inputs @ torch.randn(8, 1) + 0.05 * torch.randn(256, 1)
dataset = TensorDataset(inputs, targets)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
EPOCHS, BATCH, LR = 4, 4, 0.1
"""

TRAIN = """
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler

device = torch_xla.device()
model = model.to(device)
sampler = DistributedSampler(dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=False)
loader = pl.MpDeviceLoader(DataLoader(dataset, batch_size=BATCH, sampler=sampler), device)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
for epoch in range(EPOCHS):
    total = torch.zeros((), device=device)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        xm.optimizer_step(optimizer)
        total += loss.detach()
    xm.master_print(f"epoch {epoch} loss {total.item() / len(loader):.6f}")
[p.detach().cpu() for p in model.parameters()]
"""


def train_in_one_process(world_size: int) -> list[torch.Tensor]:
    """The same model trained by one process on the same global batches."""
    names: dict = {}
    exec(SETUP, names)
    model = names["model"]
    optimizer = torch.optim.SGD(model.parameters(), lr=names["LR"])
    # DistributedSampler without shuffling deals consecutive samples out to
    # the ranks, so step k of all ranks together covers one block of samples.
    loader = torch.utils.data.DataLoader(names["dataset"], batch_size=names["BATCH"] * world_size)
    for _ in range(names["EPOCHS"]):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_tpu_training_cell_runs_unchanged_on_eight_simulated_ranks(spawn):
    run = spawn("--devices 8 --backend cpu", SETUP + TRAIN)

    losses = [float(v) for v in re.findall(r"^\[rank 0\] epoch \d loss (\S+)$", run.stdout, re.M)]
    assert len(losses) == 4, run.stdout
    assert losses[-1] < losses[0] / 4, losses
    assert not re.search(r"\[rank [1-7]\] epoch", run.stdout)  # master_print: rank 0 only

    first, *others = run.value
    for rank, params in enumerate(others, start=1):
        assert all(torch.equal(a, b) for a, b in zip(first, params)), f"rank {rank} drifted from rank 0"
    reference = train_in_one_process(world_size=8)
    for trained, expected in zip(first, reference):
        torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-5)
    assert kernel_is_xla_free()


# --- every replaced call, against what a TPU slice of that size gives ------------

COLLECTIVES = """
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

dev = torch_xla.device()
n, r = xr.world_size(), xr.global_ordinal()
half = max(1, n // 2)
groups = [list(range(start, start + half)) for start in range(0, n, half)]
base = torch.tensor([1.0, 2.0], device=dev) * (r + 1)
out = {}
out["runtime"] = [
    n, r, xr.local_ordinal(), xr.local_process_count(), xr.addressable_device_count(),
    xr.global_device_count(), xm.get_local_ordinal(), xm.is_master_ordinal(local=False),
]
out["sum"] = xm.all_reduce(xm.REDUCE_SUM, base).cpu()
out["max_half"] = xm.all_reduce(xm.REDUCE_MAX, base, scale=0.5).cpu()
out["min"] = xm.all_reduce(xm.REDUCE_MIN, base).cpu()
out["int_sum_in_groups"] = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([r, 1], device=dev), groups=groups).cpu()
in_place = [torch.full((2,), float(r), device=dev), torch.tensor([r + 1], device=dev)]
returned = xm.all_reduce(xm.REDUCE_SUM, in_place, scale=0.5)
out["list"] = [t.cpu() for t in in_place] + [returned is in_place]
out["gather"] = xm.all_gather(torch.tensor([[r, -r]], device=dev)).cpu()
out["gather_last_dim"] = xm.all_gather(torch.tensor([[r], [r + 10]], device=dev), dim=-1).cpu()
out["gather_groups"] = xm.all_gather(torch.tensor([r], device=dev), groups=groups).cpu()
out["gather_list"] = [
    t.cpu() for t in xm.all_gather([torch.tensor([r], device=dev), torch.zeros(2, 3, device=dev) + r], pin_layout=False)
]
target = torch.zeros(n, device=dev)
xm.all_gather(torch.tensor([float(r)], device=dev), output=target)
out["gather_out"] = target.cpu()
out["scatter"] = xm.reduce_scatter(
    xm.REDUCE_SUM, torch.arange(2 * n, dtype=torch.float32, device=dev) * (r + 1), 1.0, 0, n
).cpu()
out["scatter_groups"] = xm.reduce_scatter(
    xm.REDUCE_SUM, torch.arange(2 * half, dtype=torch.float32, device=dev) + r, 1.0, 0, half, groups=groups
).cpu()
out["rendezvous"] = xm.rendezvous("uneven payloads", b"x" * r)
out["mesh"] = xm.mesh_reduce("uneven lists", list(range(r + 1)), lambda lists: [len(l) for l in lists])
weight = torch.nn.Parameter(torch.zeros(2, device=dev))
optimizer = torch.optim.SGD([weight], lr=1.0)
(weight * (r + 1)).sum().backward()
xm.optimizer_step(optimizer)
out["step"] = weight.detach().cpu()
shared = torch.tensor([float(r + 1)], device=dev)
xm.collective_broadcast([shared], root_ordinal=n - 1)
out["broadcast"] = shared.cpu()
out
"""


def expected_collectives(n: int, r: int) -> dict:
    half = max(1, n // 2)
    group = next(g for g in (list(range(s, s + half)) for s in range(0, n, half)) if r in g)
    pos = group.index(r)
    total = n * (n + 1) / 2
    one_device = n == 1  # torch_xla skips the all_reduce, and its scale, on one device
    return {
        "runtime": [n, r, r, n, 1, n, r, r == 0],
        "sum": torch.tensor([1.0, 2.0]) * total,
        "max_half": torch.tensor([1.0, 2.0]) * (1 if one_device else n * 0.5),
        "min": torch.tensor([1.0, 2.0]),
        "int_sum_in_groups": torch.tensor([sum(group), len(group)]),
        # XLA scales in the tensor's dtype: 0.5 becomes 0 for integers.
        "list": [
            torch.full((2,), 0.0 if one_device else (total - n) * 0.5),
            torch.tensor([1 if one_device else 0]),
            True,
        ],
        "gather": torch.tensor([[i, -i] for i in range(n)]),
        "gather_last_dim": torch.tensor([list(range(n)), [i + 10 for i in range(n)]]),
        "gather_groups": torch.tensor(group),
        "gather_list": [torch.arange(n), torch.cat([torch.zeros(2, 3) + i for i in range(n)])],
        "gather_out": torch.arange(n, dtype=torch.float32),
        "scatter": torch.arange(2 * n, dtype=torch.float32)[2 * r : 2 * r + 2] * total,
        "scatter_groups": (torch.arange(2 * half, dtype=torch.float32) * len(group) + sum(group))[2 * pos : 2 * pos + 2],
        "rendezvous": [b"x" * i for i in range(n)],
        "mesh": list(range(1, n + 1)),
        "step": torch.full((2,), -(n + 1) / 2),
        "broadcast": torch.tensor([float(n)]),
    }


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_replaced_calls_behave_as_on_a_tpu_slice(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", COLLECTIVES)
    assert_every_rank(run.value, lambda rank: expected_collectives(devices, rank))


# --- what a TPU refuses ------------------------------------------------------

REFUSED = """
import torch
import torch_xla
import torch_xla.core.xla_model as xm

dev = torch_xla.device()
n, r = world_size, rank
attempts = {
    "uneven all_reduce": lambda: xm.all_reduce(xm.REDUCE_SUM, torch.zeros(r + 1, device=dev)),
    "uneven all_gather": lambda: xm.all_gather(torch.zeros(r + 1, device=dev)),
    "dtype mix": lambda: xm.all_reduce(xm.REDUCE_SUM, torch.zeros(2, device=dev, dtype=torch.int32 if r else torch.float32)),
    "different calls": lambda: xm.all_reduce(xm.REDUCE_SUM, torch.zeros(1, device=dev)) if r % 2 else xm.rendezvous("t"),
    "indivisible": lambda: xm.reduce_scatter(xm.REDUCE_SUM, torch.zeros(n + 1, device=dev), 1.0, 0, n),
    "shard count": lambda: xm.reduce_scatter(xm.REDUCE_SUM, torch.zeros(2 * n, device=dev), 1.0, 0, 2 * n),
    "partial groups": lambda: xm.all_reduce(xm.REDUCE_SUM, torch.zeros(1, device=dev), groups=[[0]]),
    "unequal groups": lambda: xm.all_gather(torch.zeros(1, device=dev), groups=[[0], list(range(1, n))]) if n > 2 else xm.all_gather(torch.zeros(1, device=dev), groups=[[0, 1, 1]]),
    "cpu tensor": lambda: xm.all_reduce(xm.REDUCE_SUM, torch.zeros(1)),
    "scalar gather": lambda: xm.all_gather(torch.tensor(1.0, device=dev)),
    "pinned list gather": lambda: xm.all_gather([torch.zeros(1, device=dev)]),
    "bad reduce type": lambda: xm.all_reduce("average", torch.zeros(1, device=dev)),
    "text payload": lambda: xm.rendezvous("t", "text"),
    "some replicas": lambda: xm.rendezvous("t", b"", replicas=[0]),
    "all_to_all split count": lambda: xm.all_to_all(torch.zeros(2 * n, device=dev), 0, 0, 2 * n),
    "all_to_all indivisible": lambda: xm.all_to_all(torch.zeros(n + 1, device=dev), 0, 0, n),
    "permute twice to one": lambda: xm.collective_permute(torch.zeros(1, device=dev), [[0, 1], [1, 1]]),
    "permute disagreement": lambda: xm.collective_permute(torch.zeros(1, device=dev), [[0, 1]] if r else [[1, 0]]),
    "permute uneven": lambda: xm.collective_permute(torch.zeros(r + 1, device=dev), [[0, 1], [1, 0]]),
}
after = lambda: xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=dev)).item()
""" + EACH_REFUSED

REFUSAL_PATTERNS = {
    "uneven all_reduce": r"ValueError: xm.all_reduce needs the same shapes and dtypes on every rank .*rank 0: \[1\] float32; rank 1: \[2\] float32",
    "uneven all_gather": r"ValueError: xm.all_gather needs the same shapes",
    "dtype mix": r"rank 0: \[2\] float32; rank 1: \[2\] int32",
    "different calls": r"RuntimeError: the ranks reached different collectives \(rank 0: xm.rendezvous, rank 1: xm.all_reduce",
    "indivisible": r"dimension 0 has size \d+, which \d+ ranks cannot share evenly",
    "shard count": r"shard_count is \d+ but the group has \d+ ranks",
    "partial groups": r"must name every rank from 0 to \d+ exactly once",
    "unequal groups": r"ValueError: xm.all_gather: groups=.*(same number of ranks|exactly once)",
    "cpu tensor": r"TypeError: xm.all_reduce takes tensors on the XLA device.*got one on cpu",
    "scalar gather": r"0-dim tensor has none; use value.unsqueeze\(0\)",
    "pinned list gather": r"RuntimeError: .*pin_layout=True is not yet supported",
    "bad reduce type": r"reduce_type 'average' is not one of xm.REDUCE_SUM",
    "text payload": r"TypeError: `payload` must be bytes",
    "some replicas": r"ValueError: Only global rendezvous is supported",
    "all_to_all split count": r"split_count is \d+ but the group has \d+ ranks",
    "all_to_all indivisible": r"dimension 0 has size \d+, which \d+ blocks cannot share evenly",
    "permute twice to one": r"name a target twice",
    "permute disagreement": r"rank \d expects a value from rank \d, whose pairs .* send nothing to it",
    "permute uneven": r"xm.collective_permute needs the same shapes",
}


PAIRS_OF_0_AND_1 = ("permute disagreement", "permute uneven")


@pytest.mark.parametrize("devices", [2, 8])
def test_what_a_tpu_refuses_fails_on_every_rank_with_a_message(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", REFUSED)
    for rank, messages in enumerate(run.value):
        assert messages.pop("after") == devices, f"rank {rank} fell out of step"
        # Ranks that no pair names take no part in a permute: they get zeros, as on a TPU.
        refused = {name: p for name, p in REFUSAL_PATTERNS.items() if rank < 2 or name not in PAIRS_OF_0_AND_1}
        assert_refused(messages, refused, rank)


def test_a_refused_collective_fails_the_cell_on_every_rank(spawn):
    cell = "import torch, torch_xla.core.xla_model as xm\nxm.all_gather(torch.zeros(rank + 1, device=device))"
    with pytest.raises(RankError) as info:
        spawn("--devices 2 --backend cpu", cell)
    assert info.value.ranks == [0, 1]
    rendered = "\n".join(info.value._render_traceback_())
    assert "needs the same shapes and dtypes on every rank" in rendered
    assert "xm.all_gather(torch.zeros(rank + 1, device=device))" in rendered  # the cell's own line


def test_a_collective_some_ranks_never_make_fails_the_cell_instead_of_hanging(spawn):
    cell = "import torch, torch_xla.core.xla_model as xm\nif rank == 0:\n    xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device))"
    with pytest.raises(RankError) as info:
        spawn("--devices 2 --backend cpu --timeout 60", cell)
    rendered = "\n".join(info.value._render_traceback_())
    # Whichever rank notices first fails the cell (the kernel then stops the other).
    assert info.value.ranks and set(info.value.ranks) <= {0, 1}
    assert re.search(r"rank 0 waits in xm.all_reduce \(its collective #1\).*(ended its cell without making|without making it)", rendered), rendered


# --- the tpu backend replaces nothing ------------------------------------------

UNTOUCHED = """
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.core.xla_model
calls = [xm.all_reduce, xm.all_gather, xm.reduce_scatter, xm.rendezvous, xr.world_size, xr.global_ordinal]
([f.__module__ for f in calls], xr.world_size(), xr.global_ordinal())
"""


def test_the_tpu_backend_replaces_nothing(spawn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path, as CPU threads
    run = spawn("--devices 2 --backend tpu", UNTOUCHED)
    for rank, (modules, world, ordinal) in enumerate(run.value):
        assert modules == ["torch_xla.core.xla_model"] * 4 + ["torch_xla.runtime"] * 2
        assert (world, ordinal) == (2, rank)
    simulated = spawn("--devices 2 --backend cpu", UNTOUCHED)
    assert all(module.startswith("xla_magic.launcher.simulate") for module in simulated.value[1][0])
