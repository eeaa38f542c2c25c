"""Unchanged Lightning code in %%xla_spawn cells: Trainer and Fabric train across the cell's ranks.

The cells are Lightning code as its docs write it, with no import of ours:
``Trainer(accelerator="tpu")`` and ``Fabric(accelerator="tpu")`` in every
rank, on the CPU simulation and on the tpu launch path run as CPU threads.
Every result is checked against plain torch in this process: full-batch
gradient descent over the same data, which is what data parallel training
with averaged gradients computes when each step sees every sample once.
"""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch

from conftest import kernel_is_xla_free
from helpers import Kernel, interrupt_when
from xla_magic.runs.errors import RankError, RunInterrupted

SAMPLES, EPOCHS, LR = 16, 3, 0.1

# What a user pastes from Lightning's docs, shaped to be checked: each sample
# carries its index, and the model records what Lightning told it.
MODEL = f"""
import torch
from torch.utils.data import DataLoader, Dataset
import {{package}} as L

class Points(Dataset):
    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn({SAMPLES}, 4, generator=g), torch.randn({SAMPLES}, 1, generator=g)
    def __len__(self):
        return {SAMPLES}
    def __getitem__(self, i):
        return i, self.x[i], self.y[i]

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []
        self.told = set()
    def forward(self, x):
        return self.layer(x)
    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.extend(index.tolist())
        self.told.add((self.trainer.world_size, self.global_rank))
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr={LR})

def loader(world, seed=1):
    return DataLoader(Points(seed), batch_size={SAMPLES} // world)

def params(module):
    return {{name: value.detach().cpu() for name, value in module.state_dict().items()}}
"""

QUIET = "enable_model_summary=False, log_every_n_steps=1"


def reference(epochs: int = EPOCHS) -> dict[str, torch.Tensor]:
    """Single-process full-batch gradient descent on the cells' data."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1, generator=g)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)
    for _ in range(epochs):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        optimizer.step()
    return {f"layer.{name}": value.detach() for name, value in layer.state_dict().items()}


def assert_params_match_reference(per_rank: list[dict], epochs: int = EPOCHS) -> None:
    expected = reference(epochs)
    for rank, got in enumerate(per_rank):
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], per_rank[0][name]), f"rank {rank} {name} differs from rank 0"
            assert torch.allclose(got[name], expected[name], atol=1e-5), f"rank {rank} {name}: {got[name]} != {expected[name]}"


def assert_each_epoch_is_shared_out(seen: list[list[int]]) -> None:
    """Lightning's DistributedSampler (shuffled for training) gave every rank a disjoint part of each epoch."""
    per_epoch = SAMPLES // len(seen)
    for epoch in range(EPOCHS):
        parts = [indices[epoch * per_epoch : (epoch + 1) * per_epoch] for indices in seen]
        assert sorted(i for part in parts for i in part) == list(range(SAMPLES)), f"epoch {epoch}: {parts}"


def lines_from_other_ranks(run, fragment: str) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if fragment in line and "[rank 0]" not in line]


TRAINER_CELL = MODEL.replace("{package}", "lightning") + f"""
import torchmetrics

class Evaluated(Regression):
    def __init__(self):
        super().__init__()
        self.mse = torchmetrics.MeanSquaredError()
    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        prediction = self(x)
        self.mse(prediction, y)
        self.log("val_mse", self.mse)
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y), sync_dist=True)
        self.gathered = self.all_gather(index)
    def test_step(self, batch, batch_idx):
        index, x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)
    def predict_step(self, batch, batch_idx):
        index, x, y = batch
        return index, self(x)

refused = None
try:
    L.Trainer(accelerator="tpu", devices=2)
except ValueError as error:
    refused = str(error)
model = Evaluated()
trainer = L.Trainer(accelerator="tpu", devices="auto", max_epochs={EPOCHS}, default_root_dir=ROOT, {QUIET})
trainer.fit(model, loader(world_size))
validated = trainer.validate(model, loader(world_size, seed=2), verbose=False)
tested = trainer.test(model, loader(world_size, seed=2), verbose=False)
predicted = trainer.predict(model, loader(world_size, seed=2))
dict(
    params=params(model), seen=model.seen, told=sorted(model.told), refused=refused,
    validated=validated, tested=tested, gathered=model.gathered.cpu(),
    predicted=[(i.tolist(), p.cpu()) for i, p in predicted],
    strategy=type(trainer.strategy).__name__, world=(trainer.world_size, trainer.global_rank),
)
"""


# At 4 ranks: more than the pool test's and the Fabric test's 2, so every shard, gather and message below is one
# of several ranks' beyond the first two (Lightning does nothing else at 8).
def test_trainer_fits_validates_tests_and_predicts_across_4_ranks(spawn, tmp_path):
    world = 4
    run = spawn(f"--devices {world} --backend cpu", TRAINER_CELL, ROOT=str(tmp_path))
    assert len(run.value) == world
    assert_params_match_reference([value["params"] for value in run.value])
    val = torch.Generator().manual_seed(2)
    val_x, val_y = torch.randn(SAMPLES, 4, generator=val), torch.randn(SAMPLES, 1, generator=val)
    layer = torch.nn.Linear(4, 1)
    layer.load_state_dict({name.removeprefix("layer."): value for name, value in reference().items()})
    for rank, value in enumerate(run.value):
        shard = list(range(SAMPLES))[rank::world]
        assert value["strategy"] == "XLAStrategy"
        assert value["told"] == [(world, rank)]
        assert value["world"] == (world, rank)  # still the cell's rank after fit returns
        assert len(value["seen"]) == len(shard) * EPOCHS
        assert "runs 4 ranks" in value["refused"] and "--devices 2" in value["refused"]
        # torchmetrics syncs through torch.distributed, which XLAStrategy leaves
        # uninitialised, so on a TPU (and here) its value is this rank's own.
        with torch.no_grad():
            own = torch.nn.functional.mse_loss(layer(val_x[shard]), val_y[shard])
            full = torch.nn.functional.mse_loss(layer(val_x), val_y)
        assert value["validated"][0]["val_mse"] == pytest.approx(own.item(), abs=1e-5)
        assert value["validated"][0]["val_loss"] == pytest.approx(full.item(), abs=1e-5)  # sync_dist: mean
        assert value["tested"][0]["test_loss"] == pytest.approx(full.item(), abs=1e-5)
        # self.all_gather of the last validation batch's indices: every rank's shard in rank
        # order, joined along dim 0 (XLAStrategy uses xm.all_gather, which concatenates)
        assert value["gathered"].tolist() == [i for r in range(world) for i in list(range(SAMPLES))[r::world]]
        assert [index for indices, _ in value["predicted"] for index in indices] == shard
    assert_each_epoch_is_shared_out([value["seen"] for value in run.value])
    # Progress bar and Lightning's messages from rank 0 only; files written once.
    assert "Epoch 2" in run.stdout + run.stderr
    assert not lines_from_other_ranks(run, "Epoch")
    assert "TPU available: True, using: 4 TPU cores" in run.stderr
    assert not lines_from_other_ranks(run, "TPU available")
    logs = list((tmp_path / "lightning_logs").iterdir())
    assert [p.name for p in logs] == ["version_0"]
    assert [p.name for p in (logs[0] / "checkpoints").iterdir()] == [f"epoch={EPOCHS - 1}-step={EPOCHS}.ckpt"]
    # Lightning's default logger, written once: TensorBoard's where tensorboard is installed (the test extra
    # has it, for --metrics-dir), else a CSV file.
    if (logs[0] / "metrics.csv").exists():
        with open(logs[0] / "metrics.csv", newline="") as metrics:
            rows = list(csv.DictReader(metrics))
        assert [row["step"] for row in rows if row.get("train_loss")] == [str(step) for step in range(EPOCHS)]
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(logs[0]))
        events.Reload()
        assert [event.step for event in events.Scalars("train_loss")] == list(range(EPOCHS))
    assert kernel_is_xla_free()


FABRIC_CELL = MODEL.replace("{package}", "lightning") + f"""
def train(fabric, epochs):
    model = Regression()
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    data = fabric.setup_dataloaders(loader(fabric.world_size))
    seen = []
    for _ in range(epochs):
        for index, x, y in data:
            seen.extend(index.tolist())
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
    fabric.barrier()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    gathered = fabric.all_gather(torch.tensor([fabric.global_rank]))
    return dict(params=params(model.module), seen=seen, total=float(total), gathered=gathered.cpu().flatten().tolist(),
                world=(fabric.world_size, fabric.global_rank))

fabric = L.Fabric(accelerator="tpu", devices=DEVICES)
fabric.launch(train, {EPOCHS})
"""


# At 2 ranks: the Trainer test above runs the same XLAStrategy launch at 4.
def test_fabric_launch_with_a_function_trains_across_the_ranks(spawn):
    devices = 2
    run = spawn(f"--devices {devices} --backend cpu", FABRIC_CELL, DEVICES=devices)
    assert len(run.value) == devices
    assert_params_match_reference([value["params"] for value in run.value])
    for rank, value in enumerate(run.value):
        assert value["world"] == (devices, rank)
        assert value["seen"] == list(range(SAMPLES))[rank::devices] * EPOCHS
        assert value["total"] == sum(range(devices))
        assert value["gathered"] == list(range(devices))


SINGLE_CELL = MODEL.replace("{package}", "pytorch_lightning") + f"""
fabric_world = None
import lightning_fabric
fabric = lightning_fabric.Fabric(accelerator="tpu", devices=1)
fabric.launch()
fabric_world = (type(fabric.strategy).__name__, fabric.world_size, fabric.global_rank)
model = Regression()
trainer = L.Trainer(accelerator="tpu", devices=1, max_epochs={EPOCHS}, default_root_dir=ROOT, {QUIET})
trainer.fit(model, loader(1))
dict(params=params(model), seen=model.seen, strategy=type(trainer.strategy).__name__, fabric=fabric_world)
"""


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_one_rank_cell_uses_the_single_device_strategies_with_pytorch_lightning(spawn, monkeypatch, tmp_path, backend):
    if backend == "tpu":
        monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the tpu launch path, as CPU threads
    run = spawn(f"--devices 1 --backend {backend}", SINGLE_CELL, ROOT=str(tmp_path))
    (value,) = run.value
    assert_params_match_reference([value["params"]])
    assert value["strategy"] == "SingleDeviceXLAStrategy"
    assert value["fabric"] == ("SingleDeviceXLAStrategy", 1, 0)
    assert value["seen"] == list(range(SAMPLES)) * EPOCHS


THREADS_CELL = MODEL.replace("{package}", "lightning") + """
import os, time
from lightning.fabric.utilities.rank_zero import rank_zero_only
fabric = L.Fabric(accelerator="tpu", devices="auto")
while rank > 0 and not os.path.exists(f"{marks}/launched-{rank - 1}"):
    time.sleep(0.01)  # the threads set Lightning's rank in rank order: the last to set it is not rank 0
fabric.launch()
open(f"{marks}/launched-{rank}", "w").close()
while len(os.listdir(marks)) < fabric.world_size:
    time.sleep(0.01)  # and rank 0 prints once every thread has set it
fabric.print("printed on rank zero only, by", fabric.global_rank)
data = fabric.setup_dataloaders(loader(fabric.world_size))
(type(fabric.strategy).__name__, fabric.world_size, fabric.global_rank, rank_zero_only.rank,
 [i for index, _, _ in data for i in index.tolist()])
"""


def test_fabric_sees_the_ranks_of_the_tpu_launch_path(spawn, monkeypatch, marks):
    """Ranks as threads of one process; XLA's CPU collectives do not join threads, so no training here."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    run = spawn("--devices 4 --backend tpu", THREADS_CELL)
    assert run.value == [("XLAStrategy", 4, r, r, list(range(SAMPLES))[r::4]) for r in range(4)]
    assert [line for line in run.lines() if "printed on rank zero only" in line] == [
        "[rank 0] printed on rank zero only, by 0"
    ]


def test_a_cell_that_does_not_import_lightning_loads_none_of_it(spawn):
    cell = "import sys\nsorted(name for name in sys.modules if 'lightning' in name)"
    run = spawn("--devices 2 --backend cpu", cell)
    assert run.value == [[], []]


def test_a_device_count_that_is_not_the_cells_is_refused(spawn):
    with pytest.raises(RankError) as raised:
        spawn("--devices 2 --backend cpu", "import lightning as L\nL.Trainer(accelerator='tpu', devices=4)")
    message = str(raised.value)
    assert "runs 2 ranks" in message and "%%xla_spawn --devices 4" in message and "devices='auto'" in message


# --- a real Jupyter kernel: a pool, results in the kernel, interrupts ------------

POOL_FIT = MODEL.replace("{package}", "lightning") + f"""
model = Regression()
trainer = L.Trainer(max_epochs=2, default_root_dir=ROOT, {QUIET})  # accelerator and devices "auto"
trainer.fit(model, loader(2))
(type(trainer.strategy).__name__, trainer.global_step)
"""

POOL_FIT_AGAIN = """
trainer.fit_loop.max_epochs = 4
trainer.fit(model, loader(2))
(trainer.global_step, trainer.current_epoch)
"""


def test_fit_again_in_a_pool_and_results_come_back_to_an_xla_free_kernel(tmp_path):
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        reply, text = kernel.run("import sys\nprint(sorted(m for m in ('lightning', 'torch_xla') if m in sys.modules))")
        assert "[]" in text  # %load_ext imports neither
        kernel.run(f"ROOT = {str(tmp_path)!r}")
        reply, text = kernel.run("%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        reply, text = kernel.run("%%xla_spawn\n" + POOL_FIT)
        assert reply["status"] == "ok" and "[('XLAStrategy', 2), ('XLAStrategy', 2)]" in text, text
        reply, text = kernel.run("%%xla_spawn --out steps\n" + POOL_FIT_AGAIN)
        assert reply["status"] == "ok" and "[(4, 4), (4, 4)]" in text, text
        checks = (
            "%%xla_spawn --out back\n"
            "dict(metrics=trainer.callback_metrics, module=model, state=model.state_dict())"
        )
        reply, text = kernel.run(checks)
        assert reply["status"] == "ok", text
        reply, text = kernel.run(
            "import torch\n"
            "got = back[1]\n"
            "print('types', type(got['module']).__name__, sorted(got['metrics']))\n"
            "print('devices', {t.device.type for t in [*got['metrics'].values(), *got['state'].values(), *got['module'].parameters()]})\n"
            "import json\n"
            "print('weight', json.dumps(got['state']['layer.weight'].tolist()))\n"
            "print('modules', sorted(m for m in ('lightning', 'torch_xla', '_XLAC') if m in sys.modules))"
        )
        assert "types Regression ['train_loss']" in text, text
        assert "devices {'cpu'}" in text, text
        assert "modules ['lightning']" in text, text  # unpickling imported Lightning, never torch_xla
        expected = reference(epochs=4)
        weight = json.loads(text.split("weight ")[1].splitlines()[0])
        assert torch.allclose(torch.tensor(weight), expected["layer.weight"], atol=1e-5)

        # An interrupted fit ends the cell promptly and leaves the pool serving, even
        # with rank 0 waiting in the gradients' all-reduce for a rank still in its step.
        reply, text = kernel.run(
            "%%xla_spawn --timeout 4\n"
            "import time\n"
            "class Slow(Regression):\n"
            "    def training_step(self, batch, batch_idx):\n"
            "        time.sleep(60 if self.global_rank == 1 else 0.1)\n"
            "        return super().training_step(batch, batch_idx)\n"
            f"L.Trainer(accelerator='tpu', devices=2, max_epochs=1000, default_root_dir=ROOT, {QUIET}).fit(Slow(), loader(2))",
            timeout=120,  # bounds a hang only: the cell's 4 s, then SIGINT, SIGTERM, SIGKILL 1.5 s apart
        )
        assert reply["status"] == "error" and "timed out after 4 s" in text, text
        assert "Detected KeyboardInterrupt, attempting graceful shutdown" in text  # Lightning's own path
        assert "SystemExit" not in text, text  # ... ends as the interrupt it is, and the ranks live on
        reply, text = kernel.run("%xla_pool")
        pids = re.search(r"rank processes ([0-9, ]+)", text).group(1)
        # Lightning ignores SIGINT after its KeyboardInterrupt: the rank must not, so
        # the next interrupt stops the next cell without costing the pool its ranks.
        reply, text = kernel.run("%%xla_spawn --timeout 2\nimport time\ntime.sleep(600)")
        assert reply["status"] == "error" and "the pool keeps its ranks" in text, text
        reply, text = kernel.run("%xla_pool")
        assert re.search(r"rank processes ([0-9, ]+)", text).group(1) == pids, text
        reply, text = kernel.run("%%xla_spawn\nrank + 10")
        assert reply["status"] == "ok" and "[10, 11]" in text, text

        # In the kernel, with no rank around, Lightning behaves as Lightning does.
        reply, text = kernel.run("%xla_pool stop\nimport lightning as L\nL.Trainer(accelerator='tpu', devices=8)")
        assert reply["status"] == "error" and "can not run on your system" in text, text
    finally:
        kernel.close()


def test_a_rank_ignoring_sigterm_during_a_fit_is_still_stopped(ip, spawn, tmp_path):
    """Lightning's SIGTERM handler only notes the signal; a rank stuck in a step is killed after the grace periods.

    The stop is the notebook's interrupt, sent once every rank has written
    that it is in its step: however slowly a loaded machine gets there.
    """
    cell = MODEL.replace("{package}", "lightning") + f"""
import signal, time
class Stuck(Regression):
    def training_step(self, batch, batch_idx):
        with open(f"{{ROOT}}/stuck{{rank}}", "w") as marker:
            marker.write(type(signal.getsignal(signal.SIGTERM)).__name__)
        while True:
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                pass
L.Trainer(accelerator='tpu', devices=2, max_epochs=1, default_root_dir=ROOT, {QUIET}).fit(Stuck(), loader(2))
"""
    markers = [tmp_path / f"stuck{rank}" for rank in range(2)]
    in_steps = interrupt_when(lambda: all(marker.exists() and marker.read_text() for marker in markers))
    with pytest.raises(RunInterrupted, match="interrupted; the ranks were stopped"):
        spawn("--devices 2 --backend cpu", cell, ROOT=str(tmp_path))
    assert in_steps.is_set(), "the ranks never reached training_step"
    for marker in markers:  # each rank was in its step, under Lightning's own SIGTERM handler
        assert marker.read_text() == "_HandlersCompose"
    assert {s.state for s in ip._xla_magic_session.history[-1].ranks.values()} == {"killed"}


# A torchmetrics Metric logged on epoch syncs over torch.distributed's default group (here the "xla" group, as
# torch_xla's docs make it) while Lightning's own reductions and barriers go through xm: 20 fits in a row on 8
# ranks, in one cell of one pool (the fits after the first reuse its compiled graphs).
METRIC_FITS = 20
METRIC_CELL = f"""
import time, torch, torchmetrics, torch.distributed as dist, lightning as L
from torch.utils.data import DataLoader, TensorDataset
if not dist.is_initialized():
    dist.init_process_group("xla", init_method="xla://")

class Mean(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.mean = torchmetrics.MeanMetric()
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.mean(loss)
        self.log("mean_loss", self.mean, on_epoch=True, on_step=False)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(rank)
data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
means, started = [], time.monotonic()
for fit in range({METRIC_FITS}):
    trainer = L.Trainer(accelerator="tpu", devices="auto", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, {QUIET})
    trainer.fit(Mean(), DataLoader(data, batch_size=2))
    means.append(float(trainer.callback_metrics["mean_loss"]))
(means, time.monotonic() - started)
"""


def test_a_torchmetrics_metric_logged_on_epoch_fits_20_times_on_8_ranks(ip):
    from helpers import pool_magic, spawn_cell

    pool_magic(ip, "start --devices 8 --backend cpu")
    try:
        value, out, err, _ = spawn_cell(ip, "", METRIC_CELL)
    finally:
        pool_magic(ip, "stop")
    means = [means for means, _seconds in value]
    # each rank has its own data: the metric agrees on every rank only where it was synced across them
    assert all(len(got) == METRIC_FITS for got in means)
    assert all(got == means[0] for got in means), means
    print(f"{METRIC_FITS} fits on 8 ranks: {max(seconds for _means, seconds in value):.1f} s")
