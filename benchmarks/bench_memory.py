"""What device memory accounting costs: a training step with the simulation's count on against off, and
``%xla_memory`` on an 8-rank pool holding 1,000 tensors.

Runs under benchmarks/run.py (``python benchmarks/run.py memory``, ``make bench``;
``main()`` returns the rows). The simulation counts a device's memory after every
``torch_xla.sync`` (launcher/simulate/memory.py). On a pool of STEP_RANKS ranks, one
cell runs a small model's training step (forward, backward, Adam's step,
``torch_xla.sync()``; in a second row the step also moves its batch from the host,
``.to(device)``, which the simulation counts at its line) STEPS times, alternating step by step between the count on
and off (the simulation's book set aside: its sync wrapper returns at once; on, it
also notes torch_xla's tensor counter for unnamed tensors' places and checks a
compiled graph's needs against the limit), so
both sides see the same machine load; the figure is each side's median step, the
median over the ranks. The target: on/off at
most 1.03. (Pools started with ``XLA_MAGIC_SIM_HBM=off`` differ also in having no
memory sampler thread; on a shared machine, whole pools side by side were too noisy
to tell a few percent apart.)

``%xla_memory`` is timed in the kernel on a pool of RANKS ranks whose each rank holds
1,000 named XLA tensors (and a model), against a trivial cell's round trip on the
same pool (the baseline: what asking the ranks anything costs). The target: under 1 s.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from bench_pool import median_round_trip, quietly, start_shell

STEP_RANKS = int(os.environ.get("BENCH_MEMORY_STEP_RANKS", "2"))
RANKS = int(os.environ.get("BENCH_MEMORY_RANKS", "8"))
STEPS = 600  # alternating on, off, each step timed
MODEL = """
import time, torch, torch_xla
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data, target = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)

def step():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(data), target).backward()
    optimizer.step()
    torch_xla.sync()

batch = torch.randn(64, 256)  # on the host: moved to the device at every step, as a DataLoader's batch is

def step_moving():
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(batch.to(device)), target).backward()
    optimizer.step()
    torch_xla.sync()

for _ in range(5):
    step()
    step_moving()
"""
TIMED = f"""
import statistics
from xla_magic.launcher.simulate import memory as _memory
_book, _on, _off = _memory._book, [], []
try:
    for _step in range({{steps}}):
        _memory._book = _book if _step % 2 == 0 else None
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        started = time.perf_counter()
        {{step}}()
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        (_on if _step % 2 == 0 else _off).append(time.perf_counter() - started)
finally:
    _memory._book = _book
(statistics.median(_on), statistics.median(_off))
"""
HOLD = """
import torch, torch_xla
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to(device)
held = [torch.full((32, 32), float(i), device=device) for i in range(1000)]
torch_xla.sync()
"""

Row = tuple[str, float, float, str, str]


def step_times(shell: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """(on, off) seconds per training step, alternating in one pool (the median over the ranks): the step on
    device data, and the step whose batch moves to the device (``.to(device)``, counted at its line)."""
    quietly(lambda: shell.run_line_magic("xla_pool", f"start --devices {STEP_RANKS} --backend cpu"))()
    try:
        info = shell.run_cell_magic("xla_spawn", "", "import torch_xla.core.xla_model as xm\nxm.get_memory_info(device)")
        if "bytes_limit" not in info[0]:
            raise AssertionError(f"get_memory_info: {info[0]}: the simulation does not count memory")
        quietly(lambda: shell.run_cell_magic("xla_spawn", "", MODEL))()
        medians = []
        for step in ("step", "step_moving"):
            pairs = shell.run_cell_magic("xla_spawn", "--xla-report off",
                                         TIMED.replace("{steps}", str(STEPS)).replace("{step}", step))
            medians.append((statistics.median(on for on, _off in pairs), statistics.median(off for _on, off in pairs)))
        return medians[0], medians[1]
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()


def xla_memory_time(shell: Any) -> tuple[float, float]:
    quietly(lambda: shell.run_line_magic("xla_pool", f"start --devices {RANKS} --backend cpu"))()
    try:
        quietly(lambda: shell.run_cell_magic("xla_spawn", "", HOLD))()
        shown = quietly(lambda: shell.run_line_magic("xla_memory", ""))()
        if "1016 tensors" not in shown or "not read" in shown:
            raise AssertionError(f"%xla_memory did not name every tensor:\n{shown}")
        asking = median_round_trip(quietly(lambda: shell.run_line_magic("xla_memory", "")))
        trivial = median_round_trip(quietly(lambda: shell.run_cell_magic("xla_spawn", "", "a = 1")))
        return asking, trivial
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()


def main() -> list[Row]:
    shell, loaded_here = start_shell()
    try:
        (on, off), (moving_on, moving_off) = step_times(shell)
        print(f"step on {on * 1000:.2f} ms, off {off * 1000:.2f} ms; with a batch moved, on {moving_on * 1000:.2f} ms,"
              f" off {moving_off * 1000:.2f} ms", file=sys.stderr, flush=True)
        asking, trivial = xla_memory_time(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    return [
        (f"training step on {STEP_RANKS} ranks, memory accounting on (vs off, alternating in one cell)",
         on * 1000, off * 1000, "ms",
         f"MLP + Adam, {STEPS} steps alternating, each timed in the rank; target ratio <= 1.03"),
        (f"training step on {STEP_RANKS} ranks moving its batch .to(device), memory accounting on (vs off, "
         f"alternating in one cell)", moving_on * 1000, moving_off * 1000, "ms",
         f"the transfer counted at its line, the count at the sync; {STEPS} steps; target ratio <= 1.03"),
        (f"%xla_memory on {RANKS} ranks holding 1,000 tensors each (vs a trivial cell's round trip)",
         asking * 1000, trivial * 1000, "ms", "target: under 1000 ms"),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name}: {ours:.2f} {unit} vs {base:.2f} {unit} (ratio {ours / base:.3f}); {note}")
