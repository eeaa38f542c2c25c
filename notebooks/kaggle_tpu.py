# ---
# jupyter:
#   accelerator: TPU
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
# # xla_magic on Kaggle TPUs
#
# Run notebook cells on every TPU device with `%%xla_spawn`, while the kernel
# itself never starts an XLA runtime: no "Runtime is already initialized"
# errors, no restarting the runtime between attempts, and tagged output from
# every rank.
#
# In a Kaggle notebook: **Settings → Accelerator → TPU** (Kaggle lists
# **TPU v5e-8**; older notebooks ran on a **TPU VM v3-8**). Installing from a git
# URL needs **Settings → Internet on**; a wheel added as a Kaggle dataset does not.
# Then run the cells from the top.
#
# Everything here except the install cell and the one marked *TPU only* also runs
# on a laptop, on xla_magic's CPU simulation (that is how the project tests this
# notebook).

# %% [markdown]
# ## Install xla_magic without touching the runtime's torch
#
# The TPU image already has torch, torch_xla and libtpu built to work together.
# Reinstalling any of them is the most common way to break a TPU notebook, so the
# cell below installs xla_magic alone (`--no-deps`) and then checks that none of
# them changed. A plain `pip install` would change nothing either: xla_magic
# requires only IPython, ipywidgets and cloudpickle, never torch, at versions the
# image already has (Colab's IPython 7.34 and ipywidgets 7.7.1 are the lower
# bounds); `--no-deps` also works offline. (The `[local]` extra, which does bring
# torch and torch_xla, is for laptops only.)

# %% tags=["install"]
# xla_magic is not on PyPI yet. Build a wheel where you cloned the repository
#   pip wheel --no-deps -w dist .
# and add dist/xla_magic-*.whl to this notebook as a dataset (it appears under
# /kaggle/input), or set XLA_MAGIC_SOURCE to a git URL (needs Internet on).
import glob

XLA_MAGIC_SOURCE = (sorted(glob.glob("/kaggle/input/*/xla_magic-*.whl")) or ["xla_magic"])[-1]

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
# %pip install -q --no-deps {XLA_MAGIC_SOURCE}
if importlib.util.find_spec("cloudpickle") is None:  # the one requirement an image may lack
    # %pip install -q cloudpickle
after = versions(RUNTIME)
assert after == before, f"the install changed the runtime: {before} -> {after}"
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
about_us = [line for line in check.splitlines() if line.lower().startswith(("xla-magic", "xla_magic"))]
assert not about_us, about_us
print("xla_magic", importlib.metadata.version("xla_magic"), "installed; runtime unchanged:", after)

# %% [markdown]
# ## What the TPU looks like to torch_xla here
#
# torch_xla's spawn starts **one process per TPU chip**. On TPU v2 and v3 each
# chip has two TensorCores, and each is its own XLA device driven by a thread of
# that chip's process; from v4 on, a chip is one device.
#
# | Kaggle accelerator | chips | XLA devices | ranks: processes × threads | `--devices` |
# |---|---|---|---|---|
# | TPU v5e-8 | 8 | 8 | 8 × 1 | `1` or `8` |
# | TPU VM v3-8 (earlier Kaggle TPU) | 4 | 8 | 4 × 2 | `1` or `8` |
#
# `--devices` takes **1 or every device**: torch_xla's spawn runs on one device or
# on all of them, and xla_magic refuses other counts with a message that lists
# the ones that work. With no `--devices`, a cell uses every device.
#
# On a v3-8 two ranks share each process as threads, so a cell must be
# thread-safe there: no shared global random state for initialisation (the
# training example below starts from zeros for that reason), no writes to the
# same file from every rank.
#
# What we know vs. what to check: the table follows Kaggle's accelerator list and
# PyTorch/XLA's documentation as of late 2025 (sources in the repository's
# `docs/tpu-services.md`). The cell below (and the next one,
# which spawns) shows what *your* session has.

# %%
# What this runtime has, without starting XLA in the kernel.
import importlib.metadata
import os

from xla_magic.ranks import probe


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

# %%
# %load_ext xla_magic

# %% [markdown]
# ## Hello from every rank, and how they are laid out
#
# Each rank reports its process and thread. On a TPU v2/v3 you will see two
# ranks per process; on v4 and later, one. (In the CPU simulation every rank is
# its own process.)

# %%
# %%xla_spawn --out layout
import os
import threading

print(f"rank {rank} of {world_size} on {device}: process {os.getpid()}, thread {threading.get_ident()}")
os.getpid()

# %%
processes = len(set(layout))
print(f"{len(layout)} ranks = {processes} processes x {len(layout) // processes} thread(s) each")

# %% [markdown]
# ## TPU only: device memory
#
# `--backend tpu` insists on the TPU (it fails at once, with a clear message,
# where there is none). Here one rank reports its device's memory.

# %% tags=["needs-tpu"]
# %%xla_spawn --backend tpu --devices 1
import torch_xla.core.xla_model as xm

memory = xm.get_memory_info(device)
print(memory)
memory

# %% [markdown]
# ## The training example, on the TPU
#
# The same small data-parallel run as in the quickstart, now on every TPU device:
# each rank trains on its own share of the data and `xm.optimizer_step`
# averages the gradients across ranks with torch_xla's all-reduce.

# %%
import os

import torch  # the kernel may use torch freely; it never imports torch_xla

true_weights = [2.0, -3.0, 0.5, 1.0]  # three slopes and a bias
generator = torch.Generator().manual_seed(0)
features = torch.randn(512, 3, generator=generator)
noise = 0.1 * torch.randn(512, generator=generator)
targets = (features @ torch.tensor(true_weights[:3]) + true_weights[3] + noise).unsqueeze(1)


# where the training cell checkpoints: /kaggle/working outlives the session
checkpoint_dir = "/kaggle/working/checkpoints"


def shard(tensor, rank, world_size):
    """This rank's share of the rows: every rank trains on different data."""
    return tensor[rank::world_size]


# %%
# %%xla_spawn --out weights
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
# ## FSDPv2 over the 8 chips: one SPMD process
#
# torch_xla's recommended way to use every chip is SPMD: one process drives all
# 8 devices, and FSDPv2 shards the model's parameters over a mesh of them (here
# 8 x 1, axes `fsdp` and `model`). `%%xla_spawn --spmd` starts that process
# outside the kernel; output is tagged `[spmd]` and the value is one value.
# `show_sharding` draws which chip holds which rows of the first weight;
# `%xla_pool start --spmd` would keep the process, model and compiled graphs
# between cells.

# %%
# %%xla_spawn --spmd --mesh 8,1 --axes fsdp,model
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

# %% [markdown]
# `%xla_status` shows the devices this runtime has, whether the kernel is still
# XLA-free, and each rank of the last cell with its device memory.

# %%
# %xla_status

# %% [markdown]
# ## Kaggle TPU pitfalls, and what xla_magic does about them
#
# ### A leftover `TPU_PROCESS_ADDRESSES`
#
# The TPU image sets `TPU_PROCESS_ADDRESSES` and `CLOUD_TPU_TASK_ID` for one
# process that uses the whole TPU. torch_xla's spawn sets up each process it
# starts itself, and these leftovers get in its way, which is why PyTorch/XLA's
# own Kaggle examples `os.environ.pop` both before calling `xmp.spawn`. xla_magic
# removes them in every rank before torch_xla starts, and leaves the kernel's
# environment alone. The ranks see:

# %%
# %%xla_spawn --devices 1
import os

{name: os.environ.get(name) for name in ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")}

# %% [markdown]
# ### A TPU build of TensorFlow holding libtpu
#
# TPU images ship TensorFlow built for the TPU. Importing it in the kernel (or
# importing something that imports it: transformers' TF side, keras,
# `torch.utils.tensorboard` with TF installed) loads libtpu into the kernel, and
# the process that loads libtpu owns the TPU chips. The ranks then fail with
# `TPU initialization failed: open(/dev/accel0): Operation not permitted` or
# `Couldn't open device: /dev/accel0`, or report that the TPU is in use.
#
# xla_magic itself never imports TensorFlow in the kernel. If you need
# TensorFlow (say, for `tf.data` or TFRecords), set `TPU_LOAD_LIBRARY=0` in the
# kernel *before* importing it (TensorFlow then runs on the CPU and leaves libtpu
# alone), or use it inside the `%%xla_spawn` cells instead. If the kernel already
# holds libtpu, restart the runtime. This cell tells you where you stand:

# %%
import sys


def kernel_holds_libtpu():
    """Whether this kernel process has loaded libtpu (which then owns the chips)."""
    with open("/proc/self/maps") as maps:
        return any("libtpu" in line for line in maps)


print("tensorflow imported in this kernel:", "tensorflow" in sys.modules)
print("libtpu loaded in this kernel:", kernel_holds_libtpu())


# %% [markdown]
# ### Out of host memory when every rank loads a model
#
# Every rank is its own copy of the program, so a model that each rank loads into
# host memory is in memory once per rank at the same time. When the host runs
# out, Linux's out-of-memory killer picks a rank: xla_magic fails the cell
# at once, stops the other ranks, and reports the rank as killed by `SIGKILL`,
# "usually the host ran out of memory". It never leaves processes holding the TPU.
#
# Kaggle's TPU VM is one host shared by the kernel and every rank; the runtime
# check near the top printed its memory. To stay within it, load one rank at a time and move
# the weights to the device before the next rank loads (below), load in a smaller
# dtype, or have only rank 0 read the checkpoint and `strategy.broadcast` it.

# %%
def build_model():
    """Stands in for loading a large checkpoint into host memory."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


# %%
# %%xla_spawn --out loaded
import gc

# One rank at a time loads into host memory and moves the weights to its device;
# the others wait at the barrier, so the host holds one copy at a time, not one per rank.
for turn in range(world_size):
    if turn == rank:
        model = build_model().to(device)
        gc.collect()
    strategy.barrier()
sum(p.numel() for p in model.parameters())

# %% [markdown]
# ### Competitions without internet
#
# Notebooks submitted to a code competition often run with the internet off. Add
# the xla_magic wheel as a dataset (see the install cell): that install needs no
# network, and it brings no dependencies that could replace the image's own.

# %% [markdown]
# ### The kernel used the XLA device
#
# If a cell outside `%%xla_spawn` touches an XLA device (`xm.xla_device()`,
# `torch_xla.device()`, `.to("xla")`), the kernel now owns the runtime and no
# process can be spawned on the TPU any more. xla_magic refuses to launch then,
# saying so, instead of failing deep inside torch_xla. Restart the runtime and keep
# every use of torch_xla inside `%%xla_spawn` cells. This notebook's kernel is
# still clean:

# %%
import sys

print("torch_xla imported in this kernel:", "torch_xla" in sys.modules)
