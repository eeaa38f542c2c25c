"""Cell latency: the first cell in a new kernel, and later cells with a warm launcher.

Runs as a script or under benchmarks/run.py (``main()`` returns the rows).
Every measurement starts a fresh interpreter, so nothing is warm that a new
notebook kernel would not have warm.

- Ours: a trivial 8-rank ``%%xla_spawn`` cell in a fresh IPython shell: the
  first one timed from process start to result (launcher start-up included),
  then later cells with the launcher warm, on the cpu backend (8 processes)
  and on the tpu launch path run as 8 CPU threads.
- Baseline: what accelerate's ``notebook_launcher`` does on TPU: a fresh
  interpreter that imports torch_xla and calls
  ``xmp.spawn(fn, start_method="fork")`` with PJRT_DEVICE=CPU (8 devices),
  first from process start, then again in the same process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

RANKS = 8
FRESH_PROCESSES = 3  # each: one first cell, then WARM_CELLS later cells
WARM_CELLS = 5

OURS = """
import json, time
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "xla_magic")

def cell(line):
    started = time.perf_counter()
    with capture_output():
        value = shell.run_cell_magic("xla_spawn", line, "rank")
    assert value == list(range({ranks})), value
    return time.perf_counter() - started

cell("--devices {ranks} --backend cpu")
print("FIRST", time.time(), flush=True)
warm = [cell("--devices {ranks} --backend cpu") for _ in range({warm})]
threads = [cell("--devices {ranks} --backend tpu") for _ in range({warm})]
print("WARM", json.dumps({{"warm": warm, "threads": threads}}), flush=True)
shell.run_line_magic("unload_ext", "xla_magic")
"""

BASELINE = """
import json, time
import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp

def fn(index):
    import torch_xla
    torch_xla.device()
    return index

xmp.spawn(fn, start_method="fork")
print("FIRST", time.time(), flush=True)
warm = []
for _ in range({warm}):
    started = time.perf_counter()
    xmp.spawn(fn, start_method="fork")
    warm.append(time.perf_counter() - started)
print("WARM", json.dumps({{"warm": warm}}), flush=True)
"""


def fresh(script: str, env: dict[str, str]) -> tuple[float, dict[str, list[float]]]:
    """Seconds from process start to the first result, and the later timings."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    first = warm = None
    for line in done.stdout.splitlines():
        if line.startswith("FIRST "):
            first = float(line.split()[1]) - started
        elif line.startswith("WARM "):
            warm = json.loads(line[5:])
    if done.returncode != 0 or first is None or warm is None:
        raise RuntimeError(f"benchmark process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return first, warm


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PJRT_DEVICE", None)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


def main() -> list[tuple[str, float, float, str, str]]:
    ours_script = OURS.format(ranks=RANKS, warm=WARM_CELLS)
    base_script = BASELINE.format(warm=WARM_CELLS)
    # PJRT_DEVICE=CPU lets our tpu launch path run as threads; the cpu
    # backend sets its own environment per rank.
    ours_env = environment(PJRT_DEVICE="CPU")
    base_env = environment(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(RANKS))
    ours_first, base_first = [], []
    ours_warm, ours_threads, base_warm = [], [], []
    for _ in range(FRESH_PROCESSES):  # interleaved, so load from elsewhere hits both alike
        first, warm = fresh(ours_script, ours_env)
        ours_first.append(first)
        ours_warm += warm["warm"]
        ours_threads += warm["threads"]
        first, warm = fresh(base_script, base_env)
        base_first.append(first)
        base_warm += warm["warm"]
    median = statistics.median
    runs = f"median of {FRESH_PROCESSES} fresh processes"
    later = f"median of {FRESH_PROCESSES * WARM_CELLS}"
    return [
        (
            "first cell in a new kernel, 8 ranks (process start to result)",
            median(ours_first),
            median(base_first),
            "s",
            f"{runs}; ours includes IPython and the launcher's start",
        ),
        (
            "later cell, 8 ranks, cpu backend (8 processes)",
            median(ours_warm),
            median(base_warm),
            "s",
            f"{later}; vs xmp.spawn again in the same process (8 threads)",
        ),
        (
            "later cell, 8 ranks, tpu launch path (xmp.spawn, 8 threads)",
            median(ours_threads),
            median(base_warm),
            "s",
            f"{later}; the same launch as the baseline, plus our output and results",
        ),
    ]


if __name__ == "__main__":
    for row in main():
        print(row)
