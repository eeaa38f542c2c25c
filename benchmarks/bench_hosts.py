"""A warm pool across 2 simulated hosts against ipyparallel's own ``%%px --block`` on the same engines.

Runs as a script (``python benchmarks/bench_hosts.py``, as root: it makes
two network namespaces) or under benchmarks/run.py (``main()`` returns the
rows; none where namespaces cannot be made). The process running this is
the kernel: one real IPython shell with the extension loaded.

- Round trip: the median wall time of a trivial cell (``a = 1``) over
  ROUND_TRIPS cells, after WARM_UP cells, on a warm pool of 2 hosts x 2
  ranks: the cell goes kernel -> controller -> each host's engine -> its
  launcher's ranks, and back. The baseline runs ``%%px --block a = 1`` on the
  very engines of that pool (kernel -> controller -> engine and back), in
  the same run. Target: ours at most 1.5x theirs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUND_TRIPS = 30
WARM_UP = 5
TRIVIAL = "a = 1"

Row = tuple[str, float, float, str, str]


def median_round_trip(cell: Callable[[], Any]) -> float:
    for _ in range(WARM_UP):
        cell()
    times = []
    for _ in range(ROUND_TRIPS):
        started = time.perf_counter()
        cell()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def quietly(run: Callable[[], Any]) -> Callable[[], None]:
    from IPython.utils.capture import capture_output

    def call() -> None:
        with capture_output():
            run()

    return call


def measure(shell: Any, hosts: Any) -> dict[str, float]:
    from tests.hosts_fixtures import start_line

    quietly(lambda: shell.run_line_magic("xla_pool", start_line(hosts)))()
    try:
        ours = median_round_trip(quietly(lambda: shell.run_cell_magic("xla_spawn", "", TRIVIAL)))
        pool = shell._xla_magic_session.pool
        pool.client[pool.engines].activate()  # %%px on this shell, on the pool's own engines
        theirs = median_round_trip(quietly(lambda: shell.run_cell_magic("px", "--block", TRIVIAL)))
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()
    return {"ours": ours, "theirs": theirs}


def main() -> list[Row]:
    from IPython.core.interactiveshell import InteractiveShell

    from tests.hosts_fixtures import namespaces_refused
    from xla_magic.hosts.simulated import SimulatedHosts

    refused = namespaces_refused()
    if refused:
        print(f"bench_hosts skipped: {refused}", file=sys.stderr)
        return []
    hosts = SimulatedHosts(name="xmb", subnet=251)
    hosts.up(2)
    try:
        shell = InteractiveShell.instance()
        if getattr(shell, "_xla_magic_session", None) is None:
            shell.run_line_magic("load_ext", "xla_magic")
        figures = measure(shell, hosts)
    finally:
        hosts.down()
    return [(
        f"warm 2-host x 2-rank pool: trivial cell round trip (median of {ROUND_TRIPS})",
        figures["ours"] * 1000,
        figures["theirs"] * 1000,
        "ms",
        "vs %%px --block on the same 2 engines (simulated hosts: network namespaces); target <= 1.5x",
    )]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name}: ours {ours:.2f} {unit}, %%px --block {base:.2f} {unit}, ratio {ours / base:.2f} ({note})")
