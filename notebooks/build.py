"""Writes the three notebooks from the cells below. Runs as a script, by hand.

    python notebooks/build.py               # write all three; run quickstart to keep its outputs
    python notebooks/build.py --no-execute  # write them without running anything

The cells live here, not in the .ipynb files, so the training example is one
text shared by all three notebooks and a reviewer reads Python, not JSON.
tests/test_notebooks.py checks that the committed notebooks are what this
script writes.

Cell tags the tests read:
- ``install``: installs packages; skipped where the package is already installed.
- ``needs-tpu``: only meaningful on a TPU; skipped on the CPU simulation.
- ``raises-exception``: the cell shows an error on purpose (nbclient's own tag).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def md(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text.strip("\n"))


def code(text: str, *tags: str) -> nbformat.NotebookNode:
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


# --- shared by every notebook ------------------------------------------------

LOAD = "%load_ext xla_magic"

DATA = '''
import torch  # the kernel may use torch freely; it never imports torch_xla

true_weights = [2.0, -3.0, 0.5, 1.0]  # three slopes and a bias
generator = torch.Generator().manual_seed(0)
features = torch.randn(512, 3, generator=generator)
noise = 0.1 * torch.randn(512, generator=generator)
targets = (features @ torch.tensor(true_weights[:3]) + true_weights[3] + noise).unsqueeze(1)


def shard(tensor, rank, world_size):
    """This rank's share of the rows: every rank trains on different data."""
    return tensor[rank::world_size]
'''

# The magic line is filled in per notebook: the quickstart names a device
# count, the TPU notebooks use every device the TPU has.
TRAIN = '''
%%xla_spawn{options} --out weights
import torch
import torch_xla
import torch_xla.core.xla_model as xm

model = torch.nn.Linear(3, 1).to(device)
with torch.no_grad():  # the same start on every rank (no shared random state needed)
    model.weight.zero_()
    model.bias.zero_()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = shard(features, rank, world_size).to(device)
y = shard(targets, rank, world_size).to(device)
losses = []  # this rank's loss at every step, for the curve

for step in range(40):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    xm.optimizer_step(optimizer)  # average the gradients over all ranks, then step
    torch_xla.sync()  # run the step's graph now
    losses.append(loss.detach())
    if step % 10 == 0:
        mean_loss = strategy.reduce(loss.detach(), reduce_op="mean")
        if strategy.is_global_zero:
            print(f"step {{step:2d}}  loss {{mean_loss.item():.5f}}")

if strategy.is_global_zero:  # a plot from rank 0 appears in the notebook, as from any cell
    import matplotlib.pyplot as plt

    plt.figure(figsize=(5, 3))
    plt.semilogy([value.item() for value in losses])
    plt.xlabel("step")
    plt.ylabel("loss on rank 0's shard")
    plt.show()

[round(value, 4) for value in model.weight.flatten().tolist() + model.bias.tolist()]
'''

TRAIN_CHECK = '''
same = all(w == weights[0] for w in weights)
print(f"{len(weights)} ranks, all with the same weights: {same}")
print("learned:", weights[0])
print("true:   ", true_weights)
'''

KERNEL_XLA_FREE = '''
import sys

print("torch_xla imported in this kernel:", "torch_xla" in sys.modules)
'''

STATUS = "%xla_status"

POOL_START = "%xla_pool start --devices 4"

POOL_BUILD = '''
%%xla_spawn
import torch

model = torch.nn.Linear(3, 1).to(device)
steps_done = 0
'''

POOL_USE = '''
%%xla_spawn
steps_done += 1  # the model and this counter are still here from the last cell
(rank, steps_done, str(model.weight.device))
'''

POOL_STOP = "%xla_pool stop"

# --- quickstart: Lightning in a cell (self-contained; needs `pip install lightning`) ---

LIGHTNING_INTRO = '''
## Lightning in a cell

Lightning code runs in a `%%xla_spawn` cell as it is written, with nothing of
xla_magic imported: `Trainer(accelerator="tpu")` and `Fabric(accelerator="tpu")`
take the cell's ranks as their devices. Lightning spawns nothing, since the
ranks already exist; it sees `world_size` devices and this rank's global rank,
shards the data with its `DistributedSampler`, averages the gradients, and
shows its progress bar, logs and checkpoints from rank 0 only. The same cell
runs on a TPU. (Needs `pip install lightning`: where it is not installed, as on
Colab and Kaggle, the `%%needs lightning` line defined below skips these cells
with a one-line note.)
'''

# Colab's and Kaggle's images have no Lightning: there its cells say so and run nothing.
NEEDS = '''
import importlib.util
from IPython.core.magic import register_cell_magic


@register_cell_magic
def needs(package, cell):
    """%%needs PACKAGE: run the rest of the cell where PACKAGE is installed, else say so in one line."""
    if importlib.util.find_spec(package) is None:
        print(f"skipped: this cell needs {package}, which is not installed here (pip install {package})")
    else:
        get_ipython().run_cell(cell).raise_error()
'''

LIGHTNING_TRAINER = '''
%%needs lightning
%%xla_spawn --devices 4 --out lightning_weights
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
'''

LIGHTNING_CHECK = '''
%%needs lightning
same = all(w == lightning_weights[0] for w in lightning_weights)
print(f"Lightning on {len(lightning_weights)} ranks, the same weights everywhere: {same}")
print("learned:", lightning_weights[0])
'''

LIGHTNING_FABRIC_INTRO = '''
Fabric's own loop works the same way: `fabric.launch(train, ...)` calls
`train` in every rank, `fabric.print` prints on rank 0, and `fabric.all_reduce`
combines over the ranks.
'''

LIGHTNING_FABRIC = '''
%%needs lightning
%%xla_spawn --devices 4
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
'''


# --- SPMD: one process drives every device (self-contained: the quickstart and Kaggle splice it in) ---

SPMD_INPUTS = '''
import torch

torch.manual_seed(0)
a, b = torch.randn(8, 8), torch.randn(8, 4)
'''

SPMD_MATMUL = '''
%%xla_spawn --spmd --mesh 4,2 --out product
import torch_xla.distributed.spmd as xs

print(f"one process, {world_size} devices, mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}")
xa, xb = a.to(device), b.to(device)
xs.mark_sharding(xa, mesh, ("data", "model"))   # a: 4 x 2 blocks, one per device
xs.mark_sharding(xb, mesh, (None, "model"))     # b: columns over "model", rows everywhere
show_sharding(xa)
xa @ xb
'''

SPMD_MATMUL_CHECK = '''
print("one value, whole on the CPU:", type(product).__name__, tuple(product.shape), product.device)
print("equals the kernel's a @ b:", torch.allclose(product, a @ b, atol=1e-5))
'''

FSDP_POOL_START = "%xla_pool start --spmd --mesh 8,1 --axes fsdp,model"

# torch_xla's FSDPv2 example: shard the batch over "fsdp", wrap the model, step an ordinary optimizer.
FSDP_BUILD = '''
%%xla_spawn
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
'''

FSDP_TRAIN = '''
%%xla_spawn
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
'''


def spmd_cells() -> list[nbformat.NotebookNode]:
    """The quickstart's SPMD section: a sharded matmul, then FSDPv2 in an SPMD pool."""
    return [
        md('''
## One process, every device: `--spmd`

torch_xla recommends SPMD for new work, and FSDPv2 and tensor parallelism need
it: one process drives all the devices, you say how tensors are sharded over a
`mesh` of them, and the compiler splits the program. `%%xla_spawn --spmd` runs
the cell once, in such a process (never the kernel). The cell sees `device`,
`mesh` and `world_size` (the device count); its output is tagged `[spmd]` and
its value is one value, whole on the CPU. `show_sharding(t)` draws which device
holds which block of `t`.
'''),
        code(SPMD_INPUTS),
        code(SPMD_MATMUL),
        code(SPMD_MATMUL_CHECK),
        md('''
### FSDPv2 in an SPMD pool

`%xla_pool start --spmd` keeps the SPMD process between cells, with its
sharded model, optimiser and compiled graphs: the training cell below can be
run again and goes on training, compiling nothing new.
'''),
        code(FSDP_POOL_START),
        code(FSDP_BUILD),
        code(FSDP_TRAIN),
        code(POOL_STOP),
    ]


KAGGLE_FSDP = '''
%%xla_spawn --spmd --mesh 8,1 --axes fsdp,model
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

torch.manual_seed(0)
model = FSDPv2(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)), mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 256).to(device), torch.randn(64, 256).to(device)
xs.mark_sharding(x, mesh, ("fsdp", None))
xs.mark_sharding(y, mesh, ("fsdp", None))
for step in range(10):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
    if step % 3 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
show_sharding(next(model.parameters()))
(world_size, round(loss.item(), 4))
'''


def spmd_tpu_cells() -> list[nbformat.NotebookNode]:
    """FSDPv2 over every chip, in one SPMD process (the Kaggle notebook's v5e-8)."""
    return [
        md('''
## FSDPv2 over the 8 chips: one SPMD process

torch_xla's recommended way to use every chip is SPMD: one process drives all
8 devices, and FSDPv2 shards the model's parameters over a mesh of them (here
8 x 1, axes `fsdp` and `model`). `%%xla_spawn --spmd` starts that process
outside the kernel; output is tagged `[spmd]` and the value is one value.
`show_sharding` draws which chip holds which rows of the first weight;
`%xla_pool start --spmd` would keep the process, model and compiled graphs
between cells.
'''),
        code(KAGGLE_FSDP),
    ]


def train_cell(options: str) -> nbformat.NotebookNode:
    return code(TRAIN.format(options=options))


# --- quickstart: the CPU simulation ------------------------------------------

QUICKSTART = [
    md('''
# xla_magic quickstart: a TPU's worth of devices on your CPU

`%%xla_spawn` runs a notebook cell on every XLA device at once, one *rank* per
device, and brings each rank's output and result back into the notebook. The
kernel itself never starts an XLA runtime, so you can spawn again in the next
cell, as often as you like.

This notebook needs no TPU: on a machine without one, xla_magic uses its CPU
simulation, where every simulated device is a real process with its own XLA
CPU device, so XLA really traces and compiles your code. The same cells run
unchanged on a TPU (see `colab_tpu.ipynb` and `kaggle_tpu.ipynb`).

Set-up, from the repository root: `make demo` (or `pip install ".[local]"`
into an environment with Jupyter).
'''),
    code(LOAD),
    md('''
## Hello from every rank

Inside the cell, `rank`, `world_size`, `device` (this rank's XLA device) and
`strategy` are defined. Every line a rank prints is tagged with its rank.
The last expression of each rank comes back as a list indexed by rank;
`--out sums` also stores that list in a variable.
'''),
    code('''
%%xla_spawn --devices 8 --out sums
import torch

x = torch.ones(3, device=device) * rank
print(f"hello from rank {rank} of {world_size}, on {device}")
x.sum().item()
'''),
    code('''
print("sums by rank:", sums)
print("total:", sum(sums))
'''),
    md('''
## Notebook names travel with the cell

A `%%xla_spawn` cell can use the variables, functions and classes you defined
in the notebook: xla_magic finds the names the cell reads and ships them to the
ranks (functions by value, so you can edit and re-run them). Here: a data set,
and a function that gives each rank its share of it.
'''),
    code(DATA),
    md('''
## A small data-parallel training run

Four ranks fit a linear model, each on its own quarter of the data. The loop is
plain torch_xla training code: `xm.optimizer_step` averages the gradients over
all ranks before each step, so every rank takes the same step and ends with the
same weights. On a TPU that is torch_xla's all-reduce; in the simulation the
same call travels between the rank processes over gloo. `strategy.reduce`
averages the loss for the report, and rank 0 draws its loss curve with
matplotlib: a rank's plots and `display()` calls appear in the notebook, as
from any cell.
'''),
    train_cell(" --devices 4"),
    code(TRAIN_CHECK),
    md('''
## When a rank fails

The cell fails as soon as one rank does: the other ranks are stopped, and the
error shows the failing rank's own traceback, tagged, with the cell's line.
'''),
    code('''
%%xla_spawn --devices 2
if rank == 1:
    raise ValueError(f"rank {rank} found bad data")
rank
''', "raises-exception"),
    md('''
## Keep the ranks between cells: `%xla_pool`

Each cell above started its ranks afresh, so nothing a rank built survived the
cell. A pool keeps the ranks alive: cells run in them, and each rank keeps its
namespace, its device state and its compiled graphs, like ipyparallel engines
on XLA devices. The notebook's names a cell reads are still shipped to it.
'''),
    code(POOL_START),
    code(POOL_BUILD),
    code(POOL_USE),
    code(POOL_STOP),
    md(LIGHTNING_INTRO),
    code(NEEDS),
    code(LIGHTNING_TRAINER),
    code(LIGHTNING_CHECK),
    md(LIGHTNING_FABRIC_INTRO),
    code(LIGHTNING_FABRIC),
    *spmd_cells(),
    md('''
## The kernel stayed XLA-free

Everything XLA happened in the ranks. The kernel has not even imported
torch_xla, which is what lets every cell above spawn again. `%xla_status`
shows it all: the devices, the kernel's state, the launcher, the pool and the
ranks of the last cell (in a notebook as a live panel, elsewhere as text).
'''),
    code(KERNEL_XLA_FREE),
    code(STATUS),
    md('''
## Next

- On a real TPU: `colab_tpu.ipynb` or `kaggle_tpu.ipynb`.
- Every option: `%%xla_spawn?`, or the README's "Magics and options".
'''),
]


# --- the TPU services ----------------------------------------------------------


class Service:
    def __init__(self, name: str, **text: str) -> None:
        self.name = name
        self.text = {key: value.strip("\n") for key, value in text.items()}

    def __getitem__(self, key: str) -> str:
        return self.text[key]


COLAB = Service(
    "Colab",
    select='''
In Colab: **Runtime → Change runtime type → TPU** (the free tier offers
**TPU v5e-1**; paid plans may list other TPU types). Then run the cells from the
top.
''',
    wheel_hint='''
# xla_magic is not on PyPI yet. Build a wheel where you cloned the repository
#   pip wheel --no-deps -w dist .
# and upload dist/xla_magic-*.whl with Colab's Files panel (it lands in /content),
# or set XLA_MAGIC_SOURCE to a git URL of the repository that this runtime can reach.
import glob

XLA_MAGIC_SOURCE = (sorted(glob.glob("/content/xla_magic-*.whl")) or ["xla_magic"])[-1]
''',
    hardware='''
## What the TPU looks like to torch_xla here

torch_xla's spawn starts **one process per TPU chip**. On TPU v2 and v3 each
chip has two TensorCores, and each is its own XLA device driven by a thread of
that chip's process; from v4 on, a chip is one device.

| Colab runtime | chips | XLA devices | ranks: processes × threads | `--devices` |
|---|---|---|---|---|
| TPU v5e-1 (the free tier since September 2025) | 1 | 1 | 1 × 1 | `1` |
| TPU v6e-1 (if your plan lists it) | 1 | 1 | 1 × 1 | `1` |
| TPU v2-8 (retired from Colab in September 2025) | 4 | 8 | 4 × 2 | `1` or `8` |

`--devices` takes **1 or every device**: torch_xla's spawn runs on one device or
on all of them, and xla_magic refuses other counts with a message that lists
the ones that work. With no `--devices`, a cell uses every device.

What we know vs. what to check: the table follows Colab's announcements and
PyTorch/XLA's documentation as of late 2025 (sources in the repository's
`docs/tpu-services.md`); Colab changes its TPU offer from time to time. The cell below (and the next one, which spawns) shows what *your*
runtime has.
''',
    host_memory='''
Colab's TPU runtimes share one host between the kernel and every rank. Check
the host memory that the runtime check near the top printed against what each
rank will load.
''',
    pitfall_extra='''
### TPU v5e-1 has one device

A single-device TPU is still worth spawning for: the kernel stays XLA-free, so
you can re-run, interrupt and change cells without restarting the runtime. Code
written for many devices (all_gather, sharding by rank) runs as one rank.
''',
)

KAGGLE = Service(
    "Kaggle",
    select='''
In a Kaggle notebook: **Settings → Accelerator → TPU** (Kaggle lists
**TPU v5e-8**; older notebooks ran on a **TPU VM v3-8**). Installing from a git
URL needs **Settings → Internet on**; a wheel added as a Kaggle dataset does not.
Then run the cells from the top.
''',
    wheel_hint='''
# xla_magic is not on PyPI yet. Build a wheel where you cloned the repository
#   pip wheel --no-deps -w dist .
# and add dist/xla_magic-*.whl to this notebook as a dataset (it appears under
# /kaggle/input), or set XLA_MAGIC_SOURCE to a git URL (needs Internet on).
import glob

XLA_MAGIC_SOURCE = (sorted(glob.glob("/kaggle/input/*/xla_magic-*.whl")) or ["xla_magic"])[-1]
''',
    hardware='''
## What the TPU looks like to torch_xla here

torch_xla's spawn starts **one process per TPU chip**. On TPU v2 and v3 each
chip has two TensorCores, and each is its own XLA device driven by a thread of
that chip's process; from v4 on, a chip is one device.

| Kaggle accelerator | chips | XLA devices | ranks: processes × threads | `--devices` |
|---|---|---|---|---|
| TPU v5e-8 | 8 | 8 | 8 × 1 | `1` or `8` |
| TPU VM v3-8 (earlier Kaggle TPU) | 4 | 8 | 4 × 2 | `1` or `8` |

`--devices` takes **1 or every device**: torch_xla's spawn runs on one device or
on all of them, and xla_magic refuses other counts with a message that lists
the ones that work. With no `--devices`, a cell uses every device.

On a v3-8 two ranks share each process as threads, so a cell must be
thread-safe there: no shared global random state for initialisation (the
training example below starts from zeros for that reason), no writes to the
same file from every rank.

What we know vs. what to check: the table follows Kaggle's accelerator list and
PyTorch/XLA's documentation as of late 2025 (sources in the repository's
`docs/tpu-services.md`). The cell below (and the next one,
which spawns) shows what *your* session has.
''',
    host_memory='''
Kaggle's TPU VM is one host shared by the kernel and every rank; the runtime
check near the top printed its memory.
''',
    pitfall_extra='''
### Competitions without internet

Notebooks submitted to a code competition often run with the internet off. Add
the xla_magic wheel as a dataset (see the install cell): that install needs no
network, and it brings no dependencies that could replace the image's own.
''',
)


def install_cell(service: Service) -> nbformat.NotebookNode:
    return code(service["wheel_hint"] + '''

# Install xla_magic alone (--no-deps, which also works offline, from a wheel):
# the runtime's torch, torch_xla, libtpu, IPython and ipywidgets stay exactly as
# this TPU image ships them. The versions before and after, and pip check, show it.
import importlib.metadata
import importlib.util
import subprocess
import sys


def versions(names):
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


RUNTIME = ("torch", "torch_xla", "libtpu", "jax", "tensorflow", "ipython", "ipykernel", "ipywidgets")
before = versions(RUNTIME)
%pip install -q --no-deps {XLA_MAGIC_SOURCE}
if importlib.util.find_spec("cloudpickle") is None:  # the one requirement an image may lack
    %pip install -q cloudpickle
after = versions(RUNTIME)
assert after == before, f"the install changed the runtime: {before} -> {after}"
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
about_us = [line for line in check.splitlines() if line.lower().startswith(("xla-magic", "xla_magic"))]
assert not about_us, about_us
print("xla_magic", importlib.metadata.version("xla_magic"), "installed; runtime unchanged:", after)
''', "install")


RUNTIME_CHECK = '''
# What this runtime has, without starting XLA in the kernel.
import importlib.metadata
import os

from xla_magic import probe


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


for name in ("torch", "torch_xla", "libtpu", "tensorflow", "jax"):
    print(f"{name:12} {version(name)}")
tpu = probe.find_tpu()
print("TPU:", tpu.describe() if tpu else "none found (cells run on the CPU simulation)")
print("CPU cores:", os.cpu_count())
with open("/proc/meminfo") as meminfo:
    total_kb = int(meminfo.readline().split()[1])
print(f"host memory: {total_kb / 2**20:.0f} GiB")
for name in ("PJRT_DEVICE", "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "TPU_ACCELERATOR_TYPE"):
    print(f"{name} = {os.environ.get(name)!r}")
'''

RANK_LAYOUT = '''
%%xla_spawn --out layout
import os
import threading

print(f"rank {rank} of {world_size} on {device}: process {os.getpid()}, thread {threading.get_ident()}")
os.getpid()
'''

RANK_LAYOUT_CHECK = '''
processes = len(set(layout))
print(f"{len(layout)} ranks = {processes} processes x {len(layout) // processes} thread(s) each")
'''

TPU_MEMORY = '''
%%xla_spawn --backend tpu --devices 1
import torch_xla.core.xla_model as xm

memory = xm.get_memory_info(device)
print(memory)
memory
'''

STALE_ADDRESSES = '''
%%xla_spawn --devices 1
import os

{name: os.environ.get(name) for name in ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")}
'''

LIBTPU_IN_KERNEL = '''
import sys


def kernel_holds_libtpu():
    """Whether this kernel process has loaded libtpu (which then owns the chips)."""
    with open("/proc/self/maps") as maps:
        return any("libtpu" in line for line in maps)


print("tensorflow imported in this kernel:", "tensorflow" in sys.modules)
print("libtpu loaded in this kernel:", kernel_holds_libtpu())
'''

STAGGERED_LOAD = '''
def build_model():
    """Stands in for loading a large checkpoint into host memory."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
'''

STAGGERED_LOAD_CELL = '''
%%xla_spawn --out loaded
import gc

# One rank at a time loads into host memory and moves the weights to its device;
# the others wait at the barrier, so the host holds one copy at a time, not one per rank.
for turn in range(world_size):
    if turn == rank:
        model = build_model().to(device)
        gc.collect()
    strategy.barrier()
sum(p.numel() for p in model.parameters())
'''


def tpu_notebook(service: Service) -> list[nbformat.NotebookNode]:
    return [
        md(f'''
# xla_magic on {service.name} TPUs

Run notebook cells on every TPU device with `%%xla_spawn`, while the kernel
itself never starts an XLA runtime: no "Runtime is already initialized"
errors, no restarting the runtime between attempts, and tagged output from
every rank.

{service["select"]}

Everything here except the install cell and the one marked *TPU only* also runs
on a laptop, on xla_magic's CPU simulation (that is how the project tests this
notebook).
'''),
        md('''
## Install xla_magic without touching the runtime's torch

The TPU image already has torch, torch_xla and libtpu built to work together.
Reinstalling any of them is the most common way to break a TPU notebook, so the
cell below installs xla_magic alone (`--no-deps`) and then checks that none of
them changed. A plain `pip install` would change nothing either: xla_magic
requires only IPython, ipywidgets and cloudpickle, never torch, at versions the
image already has (Colab's IPython 7.34 and ipywidgets 7.7.1 are the lower
bounds); `--no-deps` also works offline. (The `[local]` extra, which does bring
torch and torch_xla, is for laptops only.)
'''),
        install_cell(service),
        md(service["hardware"]),
        code(RUNTIME_CHECK),
        code(LOAD),
        md('''
## Hello from every rank, and how they are laid out

Each rank reports its process and thread. On a TPU v2/v3 you will see two
ranks per process; on v4 and later, one. (In the CPU simulation every rank is
its own process.)
'''),
        code(RANK_LAYOUT),
        code(RANK_LAYOUT_CHECK),
        md('''
## TPU only: device memory

`--backend tpu` insists on the TPU (it fails at once, with a clear message,
where there is none). Here one rank reports its device's memory.
'''),
        code(TPU_MEMORY, "needs-tpu"),
        md('''
## The training example, on the TPU

The same small data-parallel run as in the quickstart, now on every TPU device:
each rank trains on its own share of the data and `xm.optimizer_step`
averages the gradients across ranks with torch_xla's all-reduce.
'''),
        code(DATA),
        train_cell(""),
        code(TRAIN_CHECK),
        *(spmd_tpu_cells() if service.name == "Kaggle" else []),
        md('''
`%xla_status` shows the devices this runtime has, whether the kernel is still
XLA-free, and each rank of the last cell with its device memory.
'''),
        code(STATUS),
        md(f'''
## {service.name} TPU pitfalls, and what xla_magic does about them

### A leftover `TPU_PROCESS_ADDRESSES`

The TPU image sets `TPU_PROCESS_ADDRESSES` and `CLOUD_TPU_TASK_ID` for one
process that uses the whole TPU. torch_xla's spawn sets up each process it
starts itself, and these leftovers get in its way, which is why PyTorch/XLA's
own Kaggle examples `os.environ.pop` both before calling `xmp.spawn`. xla_magic
removes them in every rank before torch_xla starts, and leaves the kernel's
environment alone. The ranks see:
'''),
        code(STALE_ADDRESSES),
        md('''
### A TPU build of TensorFlow holding libtpu

TPU images ship TensorFlow built for the TPU. Importing it in the kernel (or
importing something that imports it: transformers' TF side, keras,
`torch.utils.tensorboard` with TF installed) loads libtpu into the kernel, and
the process that loads libtpu owns the TPU chips. The ranks then fail with
`TPU initialization failed: open(/dev/accel0): Operation not permitted` or
`Couldn't open device: /dev/accel0`, or report that the TPU is in use.

xla_magic itself never imports TensorFlow in the kernel. If you need
TensorFlow (say, for `tf.data` or TFRecords), set `TPU_LOAD_LIBRARY=0` in the
kernel *before* importing it (TensorFlow then runs on the CPU and leaves libtpu
alone), or use it inside the `%%xla_spawn` cells instead. If the kernel already
holds libtpu, restart the runtime. This cell tells you where you stand:
'''),
        code(LIBTPU_IN_KERNEL),
        md(f'''
### Out of host memory when every rank loads a model

Every rank is its own copy of the program, so a model that each rank loads into
host memory is in memory once per rank at the same time. When the host runs
out, Linux's out-of-memory killer picks a rank: xla_magic fails the cell
at once, stops the other ranks, and reports the rank as killed by `SIGKILL`,
"usually the host ran out of memory". It never leaves processes holding the TPU.

{service["host_memory"]} To stay within it, load one rank at a time and move
the weights to the device before the next rank loads (below), load in a smaller
dtype, or have only rank 0 read the checkpoint and `strategy.broadcast` it.
'''),
        code(STAGGERED_LOAD),
        code(STAGGERED_LOAD_CELL),
        md(service["pitfall_extra"]),
        md('''
### The kernel used the XLA device

If a cell outside `%%xla_spawn` touches an XLA device (`xm.xla_device()`,
`torch_xla.device()`, `.to("xla")`), the kernel now owns the runtime and no
process can be spawned on the TPU any more. xla_magic refuses to launch then,
saying so, instead of failing deep inside torch_xla. Restart the runtime and keep
every use of torch_xla inside `%%xla_spawn` cells. This notebook's kernel is
still clean:
'''),
        code(KERNEL_XLA_FREE),
    ]


NOTEBOOKS = {
    "quickstart.ipynb": lambda: QUICKSTART,
    "colab_tpu.ipynb": lambda: tpu_notebook(COLAB),
    "kaggle_tpu.ipynb": lambda: tpu_notebook(KAGGLE),
}


def build(name: str) -> nbformat.NotebookNode:
    notebook = new_notebook(cells=NOTEBOOKS[name]())
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"  # stable ids: rebuilding changes only what changed
    notebook.metadata["kernelspec"] = KERNELSPEC
    notebook.metadata["language_info"] = {"name": "python"}
    if name != "quickstart.ipynb":
        notebook.metadata["accelerator"] = "TPU"
    return notebook


def execute(notebook: nbformat.NotebookNode) -> None:
    from nbclient import NotebookClient

    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(HERE)}}
    )
    client.execute()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="do not run quickstart (its outputs stay empty)")
    args = parser.parse_args(argv)
    for name in NOTEBOOKS:
        notebook = build(name)
        if not args.no_execute and name == "quickstart.ipynb":
            execute(notebook)
        nbformat.validate(notebook)
        nbformat.write(notebook, HERE / name)
        print("wrote", HERE / name, file=sys.stderr)


if __name__ == "__main__":
    main()
