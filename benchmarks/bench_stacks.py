"""What the stack sampler costs: a warm 8-rank pool's round trip and a training step, sampler on against off.

Runs as a script (``python benchmarks/bench_stacks.py``) or under benchmarks/run.py
(``main()`` returns the rows). Every rank has a sampler thread (launcher/stacks.py)
asleep on a blocking read of its stacks socket; ``XLA_MAGIC_STACKS=0`` in the
kernel's environment starts ranks without one, the baseline. Pools alternate
in one run (on, off, off, on), each measured warm: the median of ROUND_TRIPS
trivial cells, and of STEPS cells that each run one training step of a small
model (forward, backward, ``xm.optimizer_step``, ``torch_xla.sync()``).
The figure is each side's median over its pools; the ratio on/off should be 1.
A freshly started pool's first cells are slower and noisy: each pool first
runs one discarded series of round trips.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

from bench_pool import median_round_trip, quietly, start_shell, timed

RANKS = 8
ROUNDS = 2  # pools per side, alternating (which side goes first alternates too): on, off, off, on
TRIVIAL = "a = 1"
MODEL = """
import torch, torch_xla, torch_xla.core.xla_model as xm
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data, target = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
"""
STEP = """
optimizer.zero_grad()
torch.nn.functional.cross_entropy(model(data), target).backward()
xm.optimizer_step(optimizer)
torch_xla.sync()
"""

Row = tuple[str, float, float, str, str]


def measure(shell: Any, sampler: bool) -> dict[str, float]:
    if sampler:
        os.environ.pop("XLA_MAGIC_STACKS", None)
    else:
        os.environ["XLA_MAGIC_STACKS"] = "0"
    quietly(lambda: shell.run_line_magic("xla_pool", f"start --devices {RANKS} --backend cpu"))()
    try:
        check = "import threading\n[t.name for t in threading.enumerate() if t.name.startswith('xla_magic stacks')]"
        with_sampler = shell.run_cell_magic("xla_spawn", "", check)
        if bool(with_sampler[0]) != sampler:
            raise AssertionError(f"the ranks' sampler threads are {with_sampler}, expected sampler={sampler}")
        trivial = quietly(lambda: shell.run_cell_magic("xla_spawn", "", TRIVIAL))
        median_round_trip(trivial)  # a freshly started pool settles first (its first cells are slower, noisily)
        round_trip = median_round_trip(trivial)
        quietly(lambda: shell.run_cell_magic("xla_spawn", "", MODEL))()
        step = median_round_trip(quietly(lambda: shell.run_cell_magic("xla_spawn", "", STEP)))
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()
        os.environ.pop("XLA_MAGIC_STACKS", None)
    return {"round_trip": round_trip, "step": step}


def main() -> list[Row]:
    shell, loaded_here = start_shell()
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    try:
        for round_ in range(ROUNDS):
            for sampler in ((True, False) if round_ % 2 == 0 else (False, True)):
                (on if sampler else off).append(measure(shell, sampler=sampler))
            print(f"on {on[-1]}, off {off[-1]}", file=sys.stderr, flush=True)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")

    def side(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(run[key] for run in runs) * 1000

    return [
        (f"warm {RANKS}-rank pool round trip, stack sampler on (vs off)", side(on, "round_trip"),
         side(off, "round_trip"), "ms", f"median of {ROUNDS} alternating pools each way; target ratio 1"),
        (f"training step cell on {RANKS} ranks, stack sampler on (vs off)", side(on, "step"), side(off, "step"),
         "ms", "forward, backward, xm.optimizer_step, sync; target ratio 1"),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name}: {ours:.2f} {unit} vs {base:.2f} {unit} (ratio {ours / base:.3f}); {note}")
