"""What ``--profile`` costs beside torch_xla's profiler alone: the same training cell, in one run.

Runs as a script (``python benchmarks/bench_profile.py``, prints a table) or
under benchmarks/run.py (``main()`` returns the rows). One real IPython
shell with the extension loaded, one warm pool on the CPU simulation; the
cell runs alternately (on-off-off-on) as ``%%xla_spawn --profile`` (each
rank traces it, the kernel reads every trace and draws the timeline) and as
a plain cell that calls ``xp.start_trace``/``xp.stop_trace`` around the
same steps itself (the profiler alone). A third kind, the plain cell with
no profiler, says what the profiler itself costs.

The lines row of the timeline (the cell's line, sampled every few ms on
each rank's cell thread, launcher/profiling.py) is measured the same way:
``--profile`` with it against ``--profile`` without it
(``XLA_MAGIC_PROFILE_LINES=0`` in the kernel's environment, which the
ranks follow cell by cell), alternating in the same run, on the training
cell and on a cell of pure Python (the sampler's worst case: it takes the
GIL from the cell's thread at each sample).

Target: ``--profile`` adds nothing measurable beyond the profiler (a ratio
of 1.00 within noise); the lines at most a few percent.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench_pool import start_shell

RANKS = 4
CELLS = 5  # of each kind
SETUP = """
import torch, torch_xla
import torch_xla.debug.profiler as xp
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64).to(device)
y = torch.randint(0, 10, (32,)).to(device)
def steps():
    for step in range(10):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
    return loss.item()
def python_work():
    total = 0
    for i in range(400_000):
        total += i % 7
    return total
"""
PROFILED = "steps()"
PYTHON = "python_work()"
NO_LINES = "XLA_MAGIC_PROFILE_LINES"  # launcher/profiling.py's switch
SELF_TRACED = "xp.start_trace(f'{folder}/rank{rank}')\nsteps()\nxp.stop_trace()"

Row = tuple[str, float, float, str, str]


def cell_time(shell: Any, line: str, cell: str, lines: bool = True) -> float:
    from IPython.utils.capture import capture_output

    if lines:
        os.environ.pop(NO_LINES, None)
    else:
        os.environ[NO_LINES] = "0"
    with capture_output():
        started = time.perf_counter()
        shell.run_cell_magic("xla_spawn", line, cell)
        return time.perf_counter() - started


def measure(shell: Any) -> dict[str, float]:
    from IPython.utils.capture import capture_output

    shell.user_ns["folder"] = tempfile.mkdtemp(prefix="xla_magic-bench-profile-")
    with capture_output():
        shell.run_line_magic("xla_pool", f"start --devices {RANKS} --backend cpu")
    try:
        cell_time(shell, "", SETUP)
        order = [("profile", "--profile", PROFILED, True), ("self", "", SELF_TRACED, True),
                 ("plain", "", PROFILED, True), ("no lines", "--profile", PROFILED, False),
                 ("python", "--profile", PYTHON, True), ("python, no lines", "--profile", PYTHON, False)]
        for _ in range(2):  # warm: every graph compiled, the profiler loaded
            for _kind, line, cell, lines in order:
                cell_time(shell, line, cell, lines)
        times: dict[str, list[float]] = {kind: [] for kind, *_ in order}
        for i in range(CELLS):
            for kind, line, cell, lines in (order if i % 2 == 0 else order[::-1]):
                times[kind].append(cell_time(shell, line, cell, lines))
        return {kind: statistics.median(values) for kind, values in times.items()}
    finally:
        os.environ.pop(NO_LINES, None)
        with capture_output():
            shell.run_line_magic("xla_pool", "stop")


def main() -> list[Row]:
    shell, loaded_here = start_shell()
    try:
        figures = measure(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    return [
        (f"a 10-step training cell with --profile, {RANKS}-rank pool (median of {CELLS})",
         figures["profile"] * 1000, figures["self"] * 1000, "ms",
         "baseline: the same cell calling xp.start_trace/stop_trace itself, alternating in one run; "
         "target: nothing measurable"),
        (f"the same cell with torch_xla's profiler alone, {RANKS}-rank pool (median of {CELLS})",
         figures["self"] * 1000, figures["plain"] * 1000, "ms",
         "baseline: the cell unprofiled: what the profiler itself costs"),
        (f"the training cell with --profile and its sampled lines, {RANKS}-rank pool (median of {CELLS})",
         figures["profile"] * 1000, figures["no lines"] * 1000, "ms",
         f"baseline: --profile without the lines ({NO_LINES}=0), alternating in one run; target: a few percent"),
        (f"a pure-Python cell with --profile and its sampled lines, {RANKS}-rank pool (median of {CELLS})",
         figures["python"] * 1000, figures["python, no lines"] * 1000, "ms",
         f"baseline: --profile without the lines ({NO_LINES}=0), alternating in one run; the sampler's worst case"),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name:80} {ours:10.3f} {base:10.3f} {unit:>4}  ratio = {ours / base:.3f}")
        print(f"    {note}")
    sys.exit(0)
