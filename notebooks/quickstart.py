# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # xla_magic quickstart: a TPU's worth of devices on your CPU
#
# `%%xla_spawn` runs a notebook cell on every XLA device at once, one *rank* per
# device, and brings each rank's output and result back into the notebook. The
# kernel itself never starts an XLA runtime, so you can spawn again in the next
# cell, as often as you like.
#
# This notebook needs no TPU: on a machine without one, xla_magic uses its CPU
# simulation, where every simulated device is a real process with its own XLA
# CPU device, so XLA really traces and compiles your code. The same cells run
# unchanged on a TPU (see `colab_tpu.ipynb` and `kaggle_tpu.ipynb`).
#
# Set-up, from the repository root: `make demo` (or `pip install ".[local]"`
# into an environment with Jupyter). Cells that need a package this install
# does not bring (Lightning) skip what needs it with a one-line note.

# %%
# %load_ext xla_magic

# %% [markdown]
# ## Hello from every rank
#
# Inside the cell, `rank`, `world_size`, `device` (this rank's XLA device) and
# `strategy` are defined. Every line a rank prints is tagged with its rank.
# The last expression of each rank comes back as a list indexed by rank;
# `--out sums` also stores that list in a variable.

# %%
# %%xla_spawn --devices 8 --out sums
import torch

x = torch.ones(3, device=device) * rank
print(f"hello from rank {rank} of {world_size}, on {device}")
x.sum().item()

# %%
print("sums by rank:", sums)
print("total:", sum(sums))

# %% [markdown]
# ## Notebook names travel with the cell
#
# A `%%xla_spawn` cell can use the variables, functions and classes you defined
# in the notebook: xla_magic finds the names the cell reads and ships them to the
# ranks (functions by value, so you can edit and re-run them). Here: a data set,
# and a function that gives each rank its share of it.

# %%
import os
import tempfile

import torch  # the kernel may use torch freely; it never imports torch_xla

true_weights = [2.0, -3.0, 0.5, 1.0]  # three slopes and a bias
generator = torch.Generator().manual_seed(0)
features = torch.randn(512, 3, generator=generator)
noise = 0.1 * torch.randn(512, generator=generator)
targets = (features @ torch.tensor(true_weights[:3]) + true_weights[3] + noise).unsqueeze(1)


# where the training cell checkpoints: kept through a kernel restart (delete it to start over)
checkpoint_dir = os.path.join(tempfile.gettempdir(), "xla_magic-quickstart-checkpoints")


def shard(tensor, rank, world_size):
    """This rank's share of the rows: every rank trains on different data."""
    return tensor[rank::world_size]


# %% [markdown]
# ## A small data-parallel training run
#
# Four ranks fit a linear model, each on its own quarter of the data. The loop is
# plain torch_xla training code: `xm.optimizer_step` averages the gradients over
# all ranks before each step, so every rank takes the same step and ends with the
# same weights. On a TPU that is torch_xla's all-reduce; in the simulation the
# same call travels between the rank processes over gloo. `log(loss=loss)`
# draws the ranks' mean loss under the cell while it trains, updated in place,
# with no `.item()`: each value is read once the step's graph has run, so
# watching the run adds no sync (see the docs' "Live training metrics" page;
# `%xla_metrics` returns the values). `checkpoints(...)` saves the model and
# the optimizer every 10 steps, off the step's path: run the cell again, even
# after a kernel restart, and `ckpt.restore` goes on from the last complete one
# (see the docs' "Long runs"; `%xla_checkpoints` lists them).

# %%
# %%xla_spawn --devices 4 --out weights
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from xla_magic import log

model = torch.nn.Linear(3, 1).to(device)
with torch.no_grad():  # the same start on every rank (no shared random state needed)
    model.weight.zero_()
    model.bias.zero_()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = shard(features, rank, world_size).to(device)
y = shard(targets, rank, world_size).to(device)
ckpt = checkpoints(checkpoint_dir, every=10, keep=2)  # written off the step's path, never half written
start = ckpt.restore(model=model, optimizer=optimizer)  # a new session goes on where the last one saved

for step in range(start, 40):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    xm.optimizer_step(optimizer)  # average the gradients over all ranks, then step
    torch_xla.sync()  # run the step's graph now
    log(step, loss=loss)  # drawn under the cell as it trains (the ranks' mean), read with no sync of its own
    ckpt.save(step, model=model, optimizer=optimizer)  # writes only when due (steps 0, 10, 20, 30)

[round(value, 4) for value in model.weight.flatten().tolist() + model.bias.tolist()]

# %%
same = all(w == weights[0] for w in weights)
print(f"{len(weights)} ranks, all with the same weights: {same}")
print("learned:", weights[0])
print("true:   ", true_weights)

# %% [markdown]
# ## When a rank fails
#
# The cell fails as soon as one rank does: the other ranks are stopped, and the
# error shows the failing rank's own traceback, tagged, with the cell's line.

# %% tags=["raises-exception"]
# %%xla_spawn --devices 2
if rank == 1:
    raise ValueError(f"rank {rank} found bad data")
rank

# %% [markdown]
# ## Keep the ranks between cells: `%xla_pool`
#
# Each cell above started its ranks afresh, so nothing a rank built survived the
# cell. A pool keeps the ranks alive: cells run in them, and each rank keeps its
# namespace, its device state and its compiled graphs, like ipyparallel engines
# on XLA devices. The notebook's names a cell reads are still shipped to it.

# %%
# %xla_pool start --devices 4

# %%
# %%xla_spawn
import torch

model = torch.nn.Linear(3, 1).to(device)
steps_done = 0

# %%
# %%xla_spawn
steps_done += 1  # the model and this counter are still here from the last cell
(rank, steps_done, str(model.weight.device))

# %%
# %xla_pool stop

# %% [markdown]
# ## Lightning in a cell
#
# Lightning code runs in a `%%xla_spawn` cell as it is written, with nothing of
# xla_magic imported: `Trainer(accelerator="tpu")` and `Fabric(accelerator="tpu")`
# take the cell's ranks as their devices. Lightning spawns nothing, since the
# ranks already exist; it sees `world_size` devices and this rank's global rank,
# shards the data with its `DistributedSampler`, averages the gradients, and
# shows its progress bar, logs and checkpoints from rank 0 only. The same cell
# runs on a TPU. (Needs `pip install lightning`: where it is not installed, as on
# Colab and Kaggle, the `%%needs lightning` line defined below skips these cells
# with a one-line note.)

# %%
import importlib.util
from IPython.core.magic import register_cell_magic


@register_cell_magic
def needs(package, cell):
    """%%needs PACKAGE: run the rest of the cell where PACKAGE is installed, else say so in one line."""
    if importlib.util.find_spec(package) is None:
        print(f"skipped: this cell needs {package}, which is not installed here (pip install {package})")
    else:
        get_ipython().run_cell(cell).raise_error()


# %%
# %%needs lightning
# %%xla_spawn --devices 4 --out lightning_weights
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class LitRegression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = LitRegression()
trainer = L.Trainer(
    accelerator="tpu", devices="auto", max_epochs=15,
    enable_model_summary=False, logger=False, enable_checkpointing=False,
)
trainer.fit(model, DataLoader(TensorDataset(features, targets), batch_size=32))
[round(value, 4) for value in model.layer.weight.flatten().tolist() + model.layer.bias.tolist()]

# %%
# %%needs lightning
same = all(w == lightning_weights[0] for w in lightning_weights)
print(f"Lightning on {len(lightning_weights)} ranks, the same weights everywhere: {same}")
print("learned:", lightning_weights[0])

# %% [markdown]
# Fabric's own loop works the same way: `fabric.launch(train, ...)` calls
# `train` in every rank, `fabric.print` prints on rank 0, and `fabric.all_reduce`
# combines over the ranks.

# %%
# %%needs lightning
# %%xla_spawn --devices 4
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def train(fabric, epochs):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(features, targets), batch_size=32, shuffle=True))
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
        if epoch % 5 == 4:
            fabric.print(f"epoch {epoch + 1}: mean loss {fabric.all_reduce(loss.detach(), reduce_op='mean').item():.4f}")


fabric = L.Fabric(accelerator="tpu", devices=4)
fabric.launch(train, 15)

# %% [markdown]
# ## One process, every device: `--spmd`
#
# torch_xla recommends SPMD for new work, and FSDPv2 and tensor parallelism need
# it: one process drives all the devices, you say how tensors are sharded over a
# `mesh` of them, and the compiler splits the program. `%%xla_spawn --spmd` runs
# the cell once, in such a process (never the kernel). The cell sees `device`,
# `mesh` and `world_size` (the device count); its output is tagged `[spmd]` and
# its value is one value, whole on the CPU. `show_sharding(t)` draws which device
# holds which block of `t`.

# %%
import torch

torch.manual_seed(0)
a, b = torch.randn(8, 8), torch.randn(8, 4)

# %%
# %%xla_spawn --spmd --mesh 4,2 --out product
import torch_xla.distributed.spmd as xs

print(f"one process, {world_size} devices, mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}")
xa, xb = a.to(device), b.to(device)
xs.mark_sharding(xa, mesh, ("data", "model"))   # a: 4 x 2 blocks, one per device
xs.mark_sharding(xb, mesh, (None, "model"))     # b: columns over "model", rows everywhere
show_sharding(xa)
xa @ xb

# %%
print("one value, whole on the CPU:", type(product).__name__, tuple(product.shape), product.device)
print("equals the kernel's a @ b:", torch.allclose(product, a @ b, atol=1e-5))

# %% [markdown]
# ### FSDPv2 in an SPMD pool
#
# `%xla_pool start --spmd` keeps the SPMD process between cells, with its
# sharded model, optimiser and compiled graphs: the training cell below can be
# run again and goes on training, compiling nothing new.

# %%
# %xla_pool start --spmd --mesh 8,1 --axes fsdp,model

# %%
# %%xla_spawn
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

torch.manual_seed(0)
model = FSDPv2(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)), mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 16).to(device), torch.randn(32, 4).to(device)
xs.mark_sharding(x, mesh, ("fsdp", None))
xs.mark_sharding(y, mesh, ("fsdp", None))
show_sharding(next(model.parameters()))   # FSDPv2 split the first weight's rows over the devices

# %%
# %%xla_spawn
losses = []
for step in range(5):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    losses.append(round(loss.item(), 4))
print("losses:", losses)   # run the cell again: training goes on from here
losses[-1] < losses[0]

# %%
# %xla_pool stop

# %% [markdown]
# ## The kernel stayed XLA-free
#
# Everything XLA happened in the ranks. The kernel has not even imported
# torch_xla, which is what lets every cell above spawn again. `%xla_status`
# shows it all: the devices, the kernel's state, the launcher, the pool and the
# ranks of the last cell (in a notebook as a live panel, elsewhere as text).

# %%
import sys

print("torch_xla imported in this kernel:", "torch_xla" in sys.modules)

# %%
# %xla_status

# %% [markdown]
# ## Next
#
# - On a real TPU: `colab_tpu.ipynb` or `kaggle_tpu.ipynb`.
# - Every option: `%%xla_spawn?`, or the README's "Magics and options".
