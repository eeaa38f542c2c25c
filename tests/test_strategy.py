"""The in-cell ``strategy`` (Lightning XLAStrategy's surface) through a real shell."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import assert_every_rank, kernel_is_xla_free
from helpers import EACH_REFUSED, assert_refused
from xla_magic.notebook.strategy import OutsideSpawnError

SURFACE = """
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from xla_magic import strategy as shared

n, r = strategy.world_size, strategy.global_rank
out = {"same_object": shared.global_rank == r and shared.root_device == strategy.root_device}
out["names"] = [str(strategy.root_device).startswith("xla"), strategy.is_global_zero, r, strategy.local_rank, n]

out["gather_scalar"] = strategy.all_gather(torch.tensor(float(r), device=device)).cpu()
out["gather_rows"] = strategy.all_gather(torch.tensor([[r, r + 1]], device=device)).cpu()
from_cpu = strategy.all_gather(torch.tensor([r]))
out["gather_from_cpu"] = [from_cpu.device.type, from_cpu]

mine = torch.tensor([float(r + 1)], device=device, requires_grad=True)
gathered = strategy.all_gather(mine, sync_grads=True)
(gathered.squeeze(1) * torch.arange(1.0, n + 1, device=device)).sum().backward()
out["grad"] = [gathered.requires_grad, mine.grad.cpu()]

strategy.barrier()
strategy.barrier("named")

class Note:
    def __init__(self, text):
        self.text = text

sent = strategy.broadcast({"from": r, "tensor": torch.tensor([r], device=device), "note": Note("hi" * r)}, src=n - 1)
out["broadcast"] = [sent["from"], sent["tensor"].device.type, sent["tensor"].cpu(), sent["note"].text]
out["broadcast_plain"] = strategy.broadcast(list(range(r)))

value = torch.tensor([float(r + 1)], device=device)
out["reduce"] = [
    strategy.reduce(value).cpu(),
    strategy.reduce(value, reduce_op="avg").cpu(),
    strategy.reduce(value, reduce_op="sum").cpu(),
    strategy.reduce(value, reduce_op=dist.ReduceOp.SUM).cpu(),
    strategy.reduce(value, reduce_op=dist.ReduceOp.MAX).cpu(),
    strategy.reduce(torch.tensor([r + 1]), reduce_op="mean"),
    strategy.reduce(3.5),
    strategy.reduce("text", reduce_op="sum"),
]

data = DataLoader(TensorDataset(torch.arange(8.0).reshape(4, 2)), batch_size=2)
loader = strategy.process_dataloader(data)
batches = [batch.device.type for (batch,) in loader]
out["loader"] = [type(loader).__name__, loader.dataset is data.dataset, batches, strategy.process_dataloader(loader) is loader]
out
"""


def expected_surface(n: int, r: int) -> dict:
    total = n * (n + 1) / 2
    return {
        "same_object": True,
        "names": [True, r == 0, r, r, n],
        "gather_scalar": torch.arange(n, dtype=torch.float32),
        "gather_rows": torch.tensor([[[i, i + 1]] for i in range(n)]),
        "gather_from_cpu": ["cpu", torch.tensor([[i] for i in range(n)])],
        # torch_xla's differentiable all_gather: each rank's gradient reaches its own slice.
        "grad": [True, torch.tensor([float(r + 1)])],
        "broadcast": [n - 1, "xla", torch.tensor([n - 1]), "hi" * (n - 1)],
        "broadcast_plain": [],
        "reduce": [
            torch.tensor([total / n]),
            torch.tensor([total / n]),
            torch.tensor([total]),
            torch.tensor([total]),
            torch.tensor([float(n)]),
            torch.tensor([total / n]),
            3.5,
            "text",
        ],
        "loader": ["MpDeviceLoader", True, ["xla", "xla"], True],
    }


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_every_strategy_method_on_the_simulation(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", SURFACE)
    assert_every_rank(run.value, lambda rank: expected_surface(devices, rank), exact=False)


CHECKPOINT = """
import os
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(3, 2).to(device)
with torch.no_grad():
    model.weight.add_(1.0)  # computed on the device, not just copied there
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
checkpoint = {"model": model, "optimizer": optimizer, "weight": model.weight, "writer": rank, "ranks": world_size}
strategy.save_checkpoint(checkpoint, os.path.join(folder, "nested", "model.ckpt"))
strategy.save_checkpoint({"old": torch.ones(1, device=device)}, os.path.join(folder, "old.ckpt"))
strategy.barrier()
seen = os.path.exists(os.path.join(folder, "old.ckpt"))
strategy.barrier()
strategy.remove_checkpoint(os.path.join(folder, "old.ckpt"))
strategy.barrier()
(seen, os.path.exists(os.path.join(folder, "old.ckpt")))
"""


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_save_checkpoint_writes_one_file_the_kernel_can_load(spawn, tmp_path, devices):
    run = spawn(f"--devices {devices} --backend cpu", CHECKPOINT, folder=str(tmp_path))
    assert run.value == [(True, False)] * devices  # every rank saw it; rank 0 removed it
    files = [os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert files == [os.path.join("nested", "model.ckpt")]

    loaded = torch.load(tmp_path / "nested" / "model.ckpt")
    assert (loaded["writer"], loaded["ranks"]) == (0, devices)
    torch.manual_seed(0)
    expected_weight = torch.nn.Linear(3, 2).weight.detach() + 1.0
    for weight in (loaded["model"]["weight"], loaded["weight"]):
        assert type(weight) is torch.Tensor and weight.device.type == "cpu"
        torch.testing.assert_close(weight, expected_weight)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert kernel_is_xla_free()


REFUSALS = """
import pickle
import threading
import torch
import torch.distributed as dist

attempts = {
    "reduce_op": lambda: strategy.reduce(torch.ones(1, device=device), reduce_op="median"),
    "bitwise op": lambda: strategy.reduce(torch.ones(1, device=device), reduce_op=dist.ReduceOp.BXOR),
    "group": lambda: strategy.all_gather(torch.ones(1, device=device), group=object()),
    "not a tensor": lambda: strategy.all_gather([1, 2]),
    "src": lambda: strategy.broadcast("x", src=world_size),
    "unpicklable": lambda: strategy.broadcast(threading.Lock() if rank == 0 else None),
    "storage_options": lambda: strategy.save_checkpoint({}, "unused.ckpt", storage_options={"a": 1}),
    "uneven gather": lambda: strategy.all_gather(torch.zeros(rank + 1, device=device)),
}
after = lambda: strategy.reduce(torch.ones(1, device=device), reduce_op="sum").item()
""" + EACH_REFUSED

REFUSAL_PATTERNS = {
    "reduce_op": r"ValueError: strategy.reduce: reduce_op must be 'mean', 'avg', 'sum'.* not 'median'",
    "bitwise op": r"ValueError: strategy.reduce: reduce_op must be",
    "group": r"ValueError: strategy.all_gather always spans every rank.*Leave group out",
    "not a tensor": r"TypeError: strategy.all_gather gathers tensors, not list",
    "src": r"ValueError: strategy.broadcast: src must be a rank from 0 to 1",
    "unpicklable": r"TypeError: strategy.broadcast: rank 0's object could not be sent: _thread.lock cannot be pickled",
    "storage_options": r"TypeError: strategy.save_checkpoint does not take storage_options",
    "uneven gather": r"needs the same shapes and dtypes on every rank",
}


def test_bad_arguments_are_refused_clearly_on_every_rank(spawn):
    run = spawn("--devices 2 --backend cpu", REFUSALS)
    for rank, messages in enumerate(run.value):
        assert messages.pop("after") == 2.0, f"rank {rank} fell out of step"
        assert_refused(messages, REFUSAL_PATTERNS, rank)


LATE_LAST_RANK = """
import time
if rank == world_size - 1:
    time.sleep(1.0)
time.monotonic()
"""


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_ranks_leave_a_cell_together(ip, spawn, monkeypatch, backend):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # for tpu: its launch path, as CPU threads
    run = spawn(f"--devices 2 --backend {backend}", LATE_LAST_RANK)
    last_finished = max(run.value)
    record = ip._xla_magic_session.history[-1]
    # Rank 0 ended its cell a second before the last rank did, yet left after it.
    assert all(state.ended >= last_finished for state in record.ranks.values())


def test_strategy_on_the_tpu_launch_path(spawn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    cell = "(strategy.global_rank, strategy.local_rank, strategy.world_size, strategy.is_global_zero, strategy.simulated)"
    run = spawn("--devices 2 --backend tpu", cell)
    assert run.value == [(0, 0, 2, True, False), (1, 1, 2, False, False)]


def test_notebook_helpers_using_strategy_run_in_ranks(ip, spawn):
    ip.run_cell(
        "import torch\n"
        "from xla_magic import strategy\n"
        "def global_mean(value):\n"
        "    return strategy.reduce(torch.tensor(float(value), device=strategy.root_device)).item()\n"
    )
    run = spawn("--devices 2 --backend cpu", "global_mean(rank * 10)")
    assert run.value == [5.0, 5.0]


@pytest.mark.parametrize(
    "use",
    [
        lambda s: s.root_device,
        lambda s: s.is_global_zero,
        lambda s: s.world_size,
        lambda s: s.all_gather(torch.ones(1)),
        lambda s: s.reduce(torch.ones(1)),
        lambda s: s.broadcast(1),
        lambda s: s.barrier(),
        lambda s: s.save_checkpoint({}, "never.ckpt"),
    ],
    ids=["root_device", "is_global_zero", "world_size", "all_gather", "reduce", "broadcast", "barrier", "save_checkpoint"],
)
def test_strategy_in_the_kernel_says_where_to_use_it(use):
    from xla_magic import strategy

    with pytest.raises(OutsideSpawnError, match="only available inside a %%xla_spawn cell"):
        use(strategy)
    assert kernel_is_xla_free()
    assert not os.path.exists("never.ckpt")
