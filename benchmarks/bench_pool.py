"""The persistent pool against ipyparallel: warm round trip, streaming, start.

Runs as a script (``python benchmarks/bench_pool.py``, prints a table) or
under benchmarks/run.py (``main()`` returns the rows). The process running
this is the kernel: one real IPython shell with the extension loaded and its
launcher warm before anything is timed. The baseline, ipyparallel on 8 local
engines, is measured in the same run through the same shell (``%%px --block``).

- Round trip: the median wall time of a trivial cell (``a = 1``) over
  ROUND_TRIPS cells, after a few warm-up cells, on a warm 8-rank pool.
- Streaming: 8 ranks each print 10,000 numbered lines in one cell; lines per
  second = lines received / the cell's wall time, the median of STREAM_RUNS
  cells. The pool's display shows
  1000 lines per rank and folds the rest into a log file per rank, so lines
  are counted as the kernel received them (the run's record) and their order
  is checked in the logs; ipyparallel's are counted and checked in the cell's
  captured output. Either side failing the check fails the benchmark.
- The simulated device memory's cost: the round trip with the count on (the
  default) against ``XLA_MAGIC_SIM_HBM=off``, pools alternating in one run.
- Start: ``%xla_pool start --devices 8`` with the launcher already warm (as
  after ``%load_ext``, which starts it), against starting an 8-engine
  ipyparallel cluster until every engine is registered.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from typing import Any, Callable

RANKS = 8
LINES = 10_000
ROUND_TRIPS = 50
WARM_UP = 5
STREAM_RUNS = 3  # the streaming figure is the median rate of this many cells
TRIVIAL = "a = 1"
STREAM = f"for i in range({LINES}):\n    print(rank, i)"

Row = tuple[str, float, float, str, str]


def timed(run: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def quietly(run: Callable[[], Any]) -> Callable[[], str]:
    """``run`` with its output captured; returns what it printed."""
    from IPython.utils.capture import capture_output

    def call() -> str:
        with capture_output() as captured:
            run()
        return captured.stdout

    return call


def median_round_trip(cell: Callable[[], Any]) -> float:
    for _ in range(WARM_UP):
        cell()
    return statistics.median(timed(cell) for _ in range(ROUND_TRIPS))


# --- ours -------------------------------------------------------------------------


def start_shell() -> tuple[Any, bool]:
    """The shell, with the extension loaded and its launcher ready; True if we loaded it."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    loaded_here = getattr(shell, "_xla_magic_session", None) is None
    if loaded_here:
        shell.run_line_magic("load_ext", "xla_magic")
    shell._xla_magic_session.host.ensure_launcher().wait_ready()
    return shell, loaded_here


def check_pool_stream(shell: Any, shown: str) -> int:
    """Lines the kernel received in the last cell; every rank's lines complete and in order."""
    record = shell._xla_magic_session.history[-1]
    received = sum(state.lines for state in record.ranks.values())
    logs = dict(re.findall(r"\[rank (\d+)\] \.\.\. more stdout .* every line goes to (\S+)", shown))
    for rank in range(RANKS):
        with open(logs[str(rank)]) as log:
            if log.read().splitlines() != [f"{rank} {i}" for i in range(LINES)]:
                raise AssertionError(f"rank {rank}'s lines arrived incomplete or out of order")
    return received


def measure_ours(shell: Any) -> dict[str, float]:
    pool = shell.run_line_magic
    start = timed(quietly(lambda: pool("xla_pool", f"start --devices {RANKS} --backend cpu")))
    try:
        round_trip = median_round_trip(quietly(lambda: shell.run_cell_magic("xla_spawn", "", TRIVIAL)))
        stream = quietly(lambda: shell.run_cell_magic("xla_spawn", "", STREAM))
        rates = []
        for _ in range(STREAM_RUNS):
            shown: list[str] = []
            seconds = timed(lambda: shown.append(stream()))
            rates.append(check_pool_stream(shell, shown[0]) / seconds)
    finally:
        quietly(lambda: pool("xla_pool", "stop"))()
    return {"start": start, "round_trip": round_trip, "lines_per_second": statistics.median(rates)}


MEMORY_POOLS = 2  # pools per side for the memory count's cost, alternating: on, off, off, on


def measure_memory_count(shell: Any) -> dict[str, float]:
    """The round trip with the simulated device memory counted (the default) and off (``XLA_MAGIC_SIM_HBM=off``),
    pools alternating in this one kernel, each first settled by one discarded series: each side's median."""
    import os

    sides: dict[str, list[float]] = {"on": [], "off": []}
    for number in range(MEMORY_POOLS):
        for side in ("on", "off") if number % 2 == 0 else ("off", "on"):
            if side == "off":
                os.environ["XLA_MAGIC_SIM_HBM"] = "off"
            quietly(lambda: shell.run_line_magic("xla_pool", f"start --devices {RANKS} --backend cpu"))()
            try:
                memory = shell.run_cell_magic("xla_spawn", "", "from xla_magic.launcher import rank as r\n"
                                                                "r.device_memory(device) is not None")
                if memory[0] != (side == "on"):
                    raise AssertionError(f"the ranks report memory: {memory}, expected the count {side}")
                cell = quietly(lambda: shell.run_cell_magic("xla_spawn", "", TRIVIAL))
                median_round_trip(cell)  # a freshly started pool settles first
                sides[side].append(median_round_trip(cell))
            finally:
                quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()
                os.environ.pop("XLA_MAGIC_SIM_HBM", None)
    return {side: statistics.median(times) for side, times in sides.items()}


# --- ipyparallel ----------------------------------------------------------------------


def check_px_stream(result: Any) -> int:
    """Lines a ``%%px`` cell received; every engine's complete and in order.

    ``%%px`` streams chunks that may end mid-line, so the check reads the
    engines' whole stdout from the cell's result rather than the display.
    """
    received = 0
    for engine, text in zip(result.engine_id, result.stdout):
        lines = text.splitlines()
        received += len(lines)
        if lines != [f"{engine} {i}" for i in range(LINES)]:  # each engine's rank is its id
            raise AssertionError(f"engine {engine}'s lines arrived incomplete or out of order")
    return received


def measure_ipyparallel(shell: Any) -> dict[str, float]:
    import ipyparallel

    cluster = ipyparallel.Cluster(n=RANKS, log_level=40)
    started = time.perf_counter()
    client = cluster.start_and_connect_sync(activate=False)
    try:
        client.wait_for_engines(RANKS, timeout=300)
        start = time.perf_counter() - started
        view = client[:]
        view.activate()  # %%px on this shell
        for engine in client.ids:
            client[engine].push({"rank": engine}, block=True)
        round_trip = median_round_trip(quietly(lambda: shell.run_cell_magic("px", "--block", TRIVIAL)))
        stream = quietly(lambda: shell.run_cell_magic("px", "--block -o _bench_px_stream", STREAM))
        rates = []
        for _ in range(STREAM_RUNS):
            seconds = timed(stream)
            rates.append(check_px_stream(shell.user_ns.pop("_bench_px_stream")) / seconds)
    finally:
        client.close()
        cluster.stop_cluster_sync()
    return {"start": start, "round_trip": round_trip, "lines_per_second": statistics.median(rates)}


# --- the rows -------------------------------------------------------------------------


def main() -> list[Row]:
    shell, loaded_here = start_shell()
    try:
        ours = measure_ours(shell)
        memory = measure_memory_count(shell)
    finally:
        if loaded_here:
            shell.run_line_magic("unload_ext", "xla_magic")
    base = measure_ipyparallel(shell)
    return [
        (
            f"warm {RANKS}-rank pool: trivial cell round trip (median of {ROUND_TRIPS})",
            ours["round_trip"] * 1000,
            base["round_trip"] * 1000,
            "ms",
            f"vs %%px --block on {RANKS} ipyparallel engines; target <= 5 ms",
        ),
        (
            f"warm {RANKS}-rank pool: trivial cell round trip, simulated device memory counted (median of "
            f"{ROUND_TRIPS}, {MEMORY_POOLS} pools each way)",
            memory["on"] * 1000,
            memory["off"] * 1000,
            "ms",
            "vs the same with XLA_MAGIC_SIM_HBM=off (no count, no sampler), pools alternating in one kernel; "
            "target: no slower",
        ),
        (
            f"streaming: {RANKS} ranks x {LINES:,} printed lines (median of {STREAM_RUNS})",
            ours["lines_per_second"],
            base["lines_per_second"],
            "lines/s",
            "lines received by the kernel / cell wall time, every rank's lines checked complete and "
            "in order (ours: in the per-rank logs the display folds into); vs %%px --block; "
            "target >= 5x",
        ),
        (
            f"pool start, {RANKS} ranks (launcher warm)",
            ours["start"],
            base["start"],
            "s",
            f"vs ipyparallel.Cluster(n={RANKS}) until every engine is registered",
        ),
    ]


def better_by(ours: float, base: float, unit: str) -> float:
    """How many times better ours is (higher is better for rates, lower for times)."""
    if unit.endswith("/s"):
        return ours / base
    return base / ours


def print_table(rows: list[Row]) -> None:
    print(f"{'benchmark':58} {'ours':>12} {'ipyparallel':>12} {'unit':>8} {'x better':>9}")
    for name, ours, base, unit, note in rows:
        print(f"{name:58} {ours:12,.2f} {base:12,.2f} {unit:>8} {better_by(ours, base, unit):9.1f}")
        print(f"    {note}")


if __name__ == "__main__":
    print_table(main())
    sys.exit(0)
