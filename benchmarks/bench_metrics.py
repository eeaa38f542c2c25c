"""What ``log()`` costs a training cell, and what drawing it costs the kernel: through a real kernel, in one run.

Runs as a script (``python benchmarks/bench_metrics.py``, prints a table) or
under benchmarks/run.py (``main()`` returns the rows). One real Jupyter
kernel (jupyter_client, as a notebook's is, so the chart is drawn as SVG
and updated by its display id) with the extension loaded and a warm pool on
the CPU simulation; each cell is timed from submitted to the kernel idle
again, its outputs included.

- A 100-step training cell that logs two device scalars of its step every
  step (``log(loss=loss, accuracy=accuracy)``) against the same cell without
  the ``log`` line, in rounds, the order reversed every other round; the
  figure is each kind's median and the note the median of the rounds'
  ratios. The issue's target: at most 1.02. Both cells compute the accuracy,
  as a cell that watches it does: what is measured is ``log``, not the
  user's expression (logging ``model[0].weight[0, 0]`` would also count
  indexing the weight, two traced ops a step, about 6 % of this small step
  here, and the copy a view needs: metrics.py).
- The kernel's CPU (its process, all threads: /proc) for a cell that logs
  two values every step for 10,000 steps on 8 ranks, as a share of the
  cell's wall time, beside the same cell without ``log``. The issue's
  target: under 5 %. The step is a small training step on the device, so
  the cell's wall time is a training cell's, not a loop that only logs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from bench_kernel import MODEL_SETUP, Kernel

RANKS = 4
ROUNDS = 7
LONG_RANKS = 8
LONG_STEPS = 10_000
SETUP = """
import torch, torch_xla
from xla_magic import log""" + MODEL_SETUP + """def steps(count, logged):
    for step in range(count):
        optimizer.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        accuracy = (out.argmax(1) == y).float().mean()
        loss.backward()
        optimizer.step()
        if logged:
            log(loss=loss, accuracy=accuracy)
        torch_xla.sync()
"""

Row = tuple[str, float, float, str, str]


def kernel_cpu(kernel: Kernel) -> float:
    """The kernel process's CPU seconds so far, all its threads (/proc, in clock ticks)."""
    fields = open(f"/proc/{kernel.manager.provisioner.process.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(kernel: Kernel) -> dict[str, list[float]]:
    kernel.run(f"%xla_pool start --devices {RANKS} --backend cpu")
    try:
        kernel.run(f"%%xla_spawn\n{SETUP}")
        cells = {"log": "%%xla_spawn\nsteps(100, True)", "plain": "%%xla_spawn\nsteps(100, False)"}
        for cell in cells.values():  # every graph compiled
            kernel.run(cell)
        times: dict[str, list[float]] = {kind: [] for kind in cells}
        for i in range(ROUNDS):
            for kind in (list(cells) if i % 2 == 0 else list(cells)[::-1]):
                times[kind].append(kernel.run(cells[kind]))
        return times
    finally:
        kernel.run("%xla_pool stop")


def long_cell(kernel: Kernel) -> dict[str, tuple[float, float]]:
    """(wall seconds, kernel CPU seconds) of the 10,000-step cell, with and without log."""
    kernel.run(f"%xla_pool start --devices {LONG_RANKS} --backend cpu")
    try:
        kernel.run(f"%%xla_spawn\n{SETUP}")
        kernel.run("%%xla_spawn\nsteps(10, True)\nsteps(10, False)")  # compiled
        measured = {}
        for kind, logged in (("plain", False), ("log", True)):
            cpu = kernel_cpu(kernel)
            wall = kernel.run(f"%%xla_spawn\nsteps({LONG_STEPS}, {logged})")
            measured[kind] = (wall, kernel_cpu(kernel) - cpu)
        return measured
    finally:
        kernel.run("%xla_pool stop")


def main() -> list[Row]:
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        times = overhead(kernel)
        long = long_cell(kernel)
    finally:
        kernel.close()
    ms = {kind: statistics.median(values) * 1000 for kind, values in times.items()}
    ratios = [ours / theirs for ours, theirs in zip(times["log"], times["plain"])]
    share = {kind: 100 * cpu / wall for kind, (wall, cpu) in long.items()}
    return [
        (f"a 100-step training cell logging two device scalars every step, {RANKS}-rank pool, through a real kernel "
         f"(median of {ROUNDS})",
         ms["log"], ms["plain"], "ms",
         f"baseline: the same cell without log, in the same rounds; median of the rounds' ratios "
         f"{statistics.median(ratios):.3f}; target: at most 1.02"),
        (f"the kernel's CPU for a {LONG_STEPS}-step cell logging two values a step on {LONG_RANKS} ranks, as a share "
         f"of the cell's wall time",
         share["log"], share["plain"], "%",
         f"baseline: the same cell without log; the cells took {long['log'][0]:.1f} s and {long['plain'][0]:.1f} s, "
         f"the kernel used {long['log'][1]:.2f} s and {long['plain'][1]:.2f} s of CPU; target: under 5 %"),
    ]


if __name__ == "__main__":
    started = time.monotonic()
    for name, ours, baseline, unit, note in main():
        print(f"{name}: {ours:.2f} {unit} (baseline {baseline:.2f} {unit}): {note}")
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
