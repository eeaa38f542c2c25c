"""One training step: FSDPv2 in one SPMD process against data parallelism over 8 rank processes.

Runs as a script or under benchmarks/run.py (``main()`` returns the rows).
The same MLP, the same global batch, the same SGD step, both on 8 XLA CPU
devices of this machine, both as cells in one real IPython shell, in one run:

- Ours: ``%%xla_spawn --spmd --mesh 8,1 --axes fsdp,model``, the SPMD
  placement: the cell wraps the model in FSDPv2, shards the batch over
  ``fsdp`` and times each step (forward, backward, ``optimizer.step()``,
  ``torch_xla.sync()``, waiting for the devices).
- Baseline: one rank per device, ``%%xla_spawn --backend cpu --devices 8``:
  each rank takes its eighth of the batch and steps with
  ``xm.optimizer_step`` (gradients averaged over the simulated ranks), timed
  the same way in rank 0.

Steps after the first WARM_UP (which compile) are timed; the figure is the
median over ROUNDS interleaved rounds of each, so load from elsewhere hits
both alike.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8
WIDTH, BATCH = 512, 64
WARM_UP, STEPS, ROUNDS = 3, 10, 2

MODEL = f"""
import time
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn

torch.manual_seed(0)
inputs, targets = torch.randn({BATCH}, {WIDTH}), torch.randn({BATCH}, {WIDTH})
module = nn.Sequential(nn.Linear({WIDTH}, {WIDTH}), nn.Tanh(), nn.Linear({WIDTH}, {WIDTH}), nn.Tanh(),
                       nn.Linear({WIDTH}, {WIDTH}))

def timed_steps(model, optimizer, x, y, step_optimizer):
    times = []
    for step in range({WARM_UP + STEPS}):
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        step_optimizer(optimizer)
        torch_xla.sync()
        xm.wait_device_ops()
        times.append(time.perf_counter() - started)
    return times[{WARM_UP}:]
"""

FSDP_STEP = """
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

model = FSDPv2(module, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = inputs.to(device), targets.to(device)
xs.mark_sharding(x, mesh, ("fsdp", None))
xs.mark_sharding(y, mesh, ("fsdp", None))
timed_steps(model, optimizer, x, y, lambda optimizer: optimizer.step())
"""

DATA_PARALLEL_STEP = """
share = inputs.shape[0] // world_size
x = inputs[rank * share:(rank + 1) * share].to(device)
y = targets[rank * share:(rank + 1) * share].to(device)
model = module.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
timed_steps(model, optimizer, x, y, xm.optimizer_step)
"""

def spmd_step_times(shell: Any) -> list[float]:
    from IPython.utils.capture import capture_output

    line = f"--spmd --backend cpu --devices {DEVICES} --mesh {DEVICES},1 --axes fsdp,model"
    with capture_output():
        times = shell.run_cell_magic("xla_spawn", line, MODEL + FSDP_STEP)
    if not isinstance(times, list) or len(times) != STEPS:
        raise RuntimeError(f"the SPMD cell returned {times!r}")
    return times


def start_shell() -> tuple[Any, bool]:
    """The shell with the extension loaded; True if it was loaded here."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    loaded_here = getattr(shell, "_xla_magic_session", None) is None
    if loaded_here:
        shell.run_line_magic("load_ext", "xla_magic")
    return shell, loaded_here


def data_parallel_step_times(shell: Any) -> list[float]:
    from IPython.utils.capture import capture_output

    with capture_output():
        times = shell.run_cell_magic("xla_spawn", f"--backend cpu --devices {DEVICES}", MODEL + DATA_PARALLEL_STEP)
    if not isinstance(times, list) or len(times) != DEVICES:
        raise RuntimeError(f"the data-parallel cell returned {times!r}")
    return times[0]


def main() -> list[tuple[str, float, float, str, str]]:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    shell, loaded_here = start_shell()
    ours: list[float] = []
    baseline: list[float] = []
    try:
        for _ in range(ROUNDS):
            ours += spmd_step_times(shell)
            baseline += data_parallel_step_times(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    steps = f"median of {ROUNDS} x {STEPS} steps after {WARM_UP} warm-up"
    return [
        (
            f"training step, {DEVICES} CPU devices: FSDPv2 in one SPMD process vs one rank per device",
            statistics.median(ours),
            statistics.median(baseline),
            "s",
            f"MLP of 3 {WIDTH}x{WIDTH} layers, batch {BATCH}, SGD; {steps}; ours: %%xla_spawn --spmd; "
            "baseline: %%xla_spawn --backend cpu, xm.optimizer_step (whose gradient all-reduce, simulated, "
            "goes through gloo on the CPU)",
        )
    ]


if __name__ == "__main__":
    for row in main():
        print(row)
