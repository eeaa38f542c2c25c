"""What ``--profile`` costs beside torch_xla's profiler alone: the same training cell, in one run.

Runs as a script (``python benchmarks/bench_profile.py``, prints a table) or
under benchmarks/run.py (``main()`` returns the rows). One real IPython
shell with the extension loaded, one warm pool on the CPU simulation; the
cell runs alternately (on-off-off-on) as ``%%xla_spawn --profile`` (each
rank traces it, the kernel reads every trace and draws the timeline) and as
a plain cell that calls ``xp.start_trace``/``xp.stop_trace`` around the
same steps itself (the profiler alone). A third kind, the plain cell with
no profiler, says what the profiler itself costs.

Target: ``--profile`` adds nothing measurable beyond the profiler (a ratio
of 1.00 within noise).
"""

from __future__ import annotations

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
"""
PROFILED = "steps()"
SELF_TRACED = "xp.start_trace(f'{folder}/rank{rank}')\nsteps()\nxp.stop_trace()"

Row = tuple[str, float, float, str, str]


def cell_time(shell: Any, line: str, cell: str) -> float:
    from IPython.utils.capture import capture_output

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
        for _ in range(2):  # warm: every graph compiled, the profiler loaded
            cell_time(shell, "--profile", PROFILED)
            cell_time(shell, "", SELF_TRACED)
            cell_time(shell, "", PROFILED)
        times: dict[str, list[float]] = {"profile": [], "self": [], "plain": []}
        for i in range(CELLS):
            order = [("profile", "--profile", PROFILED), ("self", "", SELF_TRACED), ("plain", "", PROFILED)]
            for kind, line, cell in (order if i % 2 == 0 else order[::-1]):
                times[kind].append(cell_time(shell, line, cell))
        return {kind: statistics.median(values) for kind, values in times.items()}
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
    return [
        (f"a 10-step training cell with --profile, {RANKS}-rank pool (median of {CELLS})",
         figures["profile"] * 1000, figures["self"] * 1000, "ms",
         "baseline: the same cell calling xp.start_trace/stop_trace itself, alternating in one run; "
         "target: nothing measurable"),
        (f"the same cell with torch_xla's profiler alone, {RANKS}-rank pool (median of {CELLS})",
         figures["self"] * 1000, figures["plain"] * 1000, "ms",
         "baseline: the cell unprofiled: what the profiler itself costs"),
    ]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name:80} {ours:10.3f} {base:10.3f} {unit:>4}  ratio = {ours / base:.3f}")
        print(f"    {note}")
    sys.exit(0)
