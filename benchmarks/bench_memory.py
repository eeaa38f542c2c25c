"""What device memory accounting costs: a training step with the simulation's count on against off, and
``%xla_memory`` on an 8-rank pool holding 1,000 tensors.

Runs under benchmarks/run.py (``python benchmarks/run.py memory``, ``make bench``;
``main()`` returns the rows). The simulation counts a device's memory after every
``torch_xla.sync`` (launcher/simulate/memory.py); ``XLA_MAGIC_SIM_HBM=off`` in the
kernel's environment starts ranks that count nothing, the baseline. Pools
alternate in one run (on, off, off, on); in each, a cell times STEPS training steps
of a small model (forward, backward, Adam's step, ``torch_xla.sync()``) inside
the rank, after warm-up steps, and the figure is the median of the ranks' per-step
times, then the median over each side's pools. The target: on/off at most 1.03.

``%xla_memory`` is timed in the kernel on a pool of RANKS ranks whose each rank holds
1,000 named XLA tensors (and a model), against a trivial cell's round trip on the
same pool (the baseline: what asking the ranks anything costs). The target: under 1 s.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from bench_pool import median_round_trip, quietly, start_shell, timed

STEP_RANKS = int(os.environ.get("BENCH_MEMORY_STEP_RANKS", "2"))
RANKS = int(os.environ.get("BENCH_MEMORY_RANKS", "8"))
ROUNDS = 2
STEPS = 30
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

for _ in range(5):
    step()
"""
TIMED = f"""
torch_xla._XLAC._xla_wait_device_ops(devices=[])
started = time.perf_counter()
for _ in range({STEPS}):
    step()
torch_xla._XLAC._xla_wait_device_ops(devices=[])
(time.perf_counter() - started) / {STEPS}
"""
HOLD = """
import torch, torch_xla
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to(device)
held = [torch.full((32, 32), float(i), device=device) for i in range(1000)]
torch_xla.sync()
"""

Row = tuple[str, float, float, str, str]


def step_time(shell: Any, counting: bool) -> float:
    if counting:
        os.environ.pop("XLA_MAGIC_SIM_HBM", None)
    else:
        os.environ["XLA_MAGIC_SIM_HBM"] = "off"
    quietly(lambda: shell.run_line_magic("xla_pool", f"start --devices {STEP_RANKS} --backend cpu"))()
    try:
        info = shell.run_cell_magic("xla_spawn", "", "import torch_xla.core.xla_model as xm\n"
                                                     "try:\n    r = 'answers', xm.get_memory_info(device)\n"
                                                     "except RuntimeError as e:\n    r = 'refuses', str(e)\nr")
        if (info[0][0] == "answers") != counting:
            raise AssertionError(f"get_memory_info: {info[0]}, expected counting={counting}")
        quietly(lambda: shell.run_cell_magic("xla_spawn", "", MODEL))()
        times = []
        for _ in range(3):
            times.extend(shell.run_cell_magic("xla_spawn", "--xla-report off", TIMED))
        return statistics.median(times)
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()
        os.environ.pop("XLA_MAGIC_SIM_HBM", None)


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
    on: list[float] = []
    off: list[float] = []
    try:
        for round_ in range(ROUNDS):
            for counting in ((True, False) if round_ % 2 == 0 else (False, True)):
                (on if counting else off).append(step_time(shell, counting))
            print(f"step on {on[-1] * 1000:.2f} ms, off {off[-1] * 1000:.2f} ms", file=sys.stderr, flush=True)
        asking, trivial = xla_memory_time(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    return [
        (f"training step on {STEP_RANKS} ranks, memory accounting on (vs XLA_MAGIC_SIM_HBM=off)",
         statistics.median(on) * 1000, statistics.median(off) * 1000, "ms",
         f"MLP + Adam, timed in the rank, median of {ROUNDS} alternating pools each way; target ratio <= 1.03"),
        (f"%xla_memory on {RANKS} ranks holding 1,000 tensors each (vs a trivial cell's round trip)",
         asking * 1000, trivial * 1000, "ms", "target: under 1000 ms"),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name}: {ours:.2f} {unit} vs {base:.2f} {unit} (ratio {ours / base:.3f}); {note}")
