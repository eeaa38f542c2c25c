"""What the account of what XLA did costs: the same cells with ``--xla-report auto`` and ``off``, in one run.

Runs as a script (``python benchmarks/bench_xla_report.py``, prints a table)
or under benchmarks/run.py (``main()`` returns the rows). One real IPython
shell with the extension loaded, one warm 8-rank pool on the CPU
simulation; cells with the report on (auto, the default) and off
alternate (on-off-off-on), so drift in the machine's load falls on both alike.

- Round trip: the median wall time of a trivial cell (``a = 1``).
- Training step: a cell of TRAIN_STEPS steps of a small MLP (forward,
  backward, SGD, ``torch_xla.sync()`` per step), its wall time in the
  kernel divided by the steps, after the graphs compiled (median of cells).
  This includes the account's reads at the cell's start and end.

Each figure also has the median of the pairs' ratios (each on-cell over the
off-cell beside it): on a machine whose load moves, a pair shares its
moment, so that ratio is steadier than the ratio of two medians.

Target: the report adds at most 5% to the round trip and nothing
measurable to a step (a ratio of 1.00 within noise).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from bench_kernel import MODEL_SETUP
from bench_pool import start_shell

RANKS = 8
ROUND_TRIPS = 200  # cells of each kind
TRAIN_CELLS = 15
TRAIN_STEPS = 10
WARM_UP = 3
TRIVIAL = "a = 1"
# Both sides name the option, so both parse the same line (the on side once ran with none, and so did
# less work in the kernel than the off side: 20-30 µs of the kernel's CPU a cell, measured).
ON, OFF = "--xla-report auto", "--xla-report off"
TRAIN_SETUP = """
import torch, torch_xla""" + MODEL_SETUP
TRAIN = f"""
for step in range({TRAIN_STEPS}):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    torch_xla.sync()
"""

Row = tuple[str, float, float, str, str]


def cell_time(shell: Any, line: str, cell: str) -> float:
    from IPython.utils.capture import capture_output

    with capture_output():
        started = time.perf_counter()
        shell.run_cell_magic("xla_spawn", line, cell)
        return time.perf_counter() - started


def alternating(shell: Any, cell: str, count: int) -> tuple[list[float], list[float]]:
    """Wall times of ``cell`` with the report on and off, pair by pair, in on-off-off-on order.

    The first cell of a pair runs measurably slower (a few percent, whatever
    it is), so each side goes first half the time.
    """
    on, off = [], []
    for _ in range(WARM_UP):
        cell_time(shell, ON, cell)
        cell_time(shell, OFF, cell)
    for i in range(count):
        if i % 2 == 0:
            on.append(cell_time(shell, ON, cell))
            off.append(cell_time(shell, OFF, cell))
        else:
            off.append(cell_time(shell, OFF, cell))
            on.append(cell_time(shell, ON, cell))
    return on, off


def pair_ratio(times: tuple[list[float], list[float]]) -> float:
    """The median over pairs of the on-cell's time over its off-cell's."""
    return statistics.median(on / off for on, off in zip(*times))


def measure(shell: Any) -> dict[str, tuple[list[float], list[float]]]:
    from IPython.utils.capture import capture_output

    with capture_output():
        shell.run_line_magic("xla_pool", f"start --devices {RANKS} --backend cpu")
    try:
        round_trip = alternating(shell, TRIVIAL, ROUND_TRIPS)
        cell_time(shell, "", TRAIN_SETUP)
        return {"round_trip": round_trip, "step": alternating(shell, TRAIN, TRAIN_CELLS)}
    finally:
        with capture_output():
            shell.run_line_magic("xla_pool", "stop")


def main() -> list[Row]:
    shell, loaded_here = start_shell()
    try:
        figures = measure(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    trip, step = figures["round_trip"], figures["step"]
    trip_on, trip_off = (statistics.median(times) for times in trip)
    step_on, step_off = (statistics.median(times) / TRAIN_STEPS for times in step)
    return [
        (
            f"warm {RANKS}-rank pool round trip, XLA report on (median of {ROUND_TRIPS})",
            trip_on * 1000, trip_off * 1000, "ms",
            "baseline: the same cells with --xla-report off, alternating in one run; "
            f"median of the pairs' ratios {pair_ratio(trip):.3f}; target: at most 5% more",
        ),
        (
            f"training step in a {RANKS}-rank pool cell, XLA report on (median of {TRAIN_CELLS} cells)",
            step_on * 1000, step_off * 1000, "ms",
            f"a {TRAIN_STEPS}-step MLP cell's wall time / {TRAIN_STEPS}; baseline: --xla-report off; "
            f"median of the pairs' ratios {pair_ratio(step):.3f}; target: nothing measurable",
        ),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name:80} {ours:10.3f} {base:10.3f} {unit:>4}  on/off = {ours / base:.3f}")
        print(f"    {note}")
    sys.exit(0)
