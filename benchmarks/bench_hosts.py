"""A warm pool across 2 simulated hosts against ipyparallel's own ``%%px --block`` on the same engines.

Runs as a script (``python benchmarks/bench_hosts.py``, as root: it makes
two network namespaces) or under benchmarks/run.py (``main()`` returns the
rows; none where namespaces cannot be made). The process running this is
the kernel: one real IPython shell with the extension loaded.

- Round trip: the wall time of a trivial cell (``a = 1``) on a warm pool of
  2 hosts x 2 ranks: the cell goes kernel -> controller -> each host's
  engine -> its launcher's ranks, and back. The baseline runs ``%%px --block
  a = 1`` on the very engines of that pool (kernel -> controller -> engine
  and back), in the same run. The two alternate cell by cell, PAIRS cells
  each (which goes first alternates too), so that a burst of load on the
  machine falls on both alike; each side's figure is its median. Target:
  ours at most 1.2x theirs.
- Kernel death: from SIGKILL of a kernel (tests/hosts_kernel.py, its own
  process) whose pool of 2 hosts x 2 ranks is idle, to nothing left on any
  host. Ours: the engines see their controller go (it ends with the kernel)
  and end their hosts. The baseline, in the same run: the fallback (and the
  only way before), ipyparallel's heartbeats, timed by freezing the
  controller (SIGSTOP: its connections stay open, its heartbeats stop) before
  the kernel is killed. Target: ours within 5 s.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # tests/hosts_fixtures.py and the helpers it imports

PAIRS = 200
WARM_UP = 5
TRIVIAL = "a = 1"

Row = tuple[str, float, float, str, str]


def alternate(ours: Callable[[], Any], theirs: Callable[[], Any]) -> dict[str, float]:
    """PAIRS pairs of one cell of each, which goes first alternating: each side's median time."""
    for _ in range(WARM_UP):
        ours()
        theirs()
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    sides = [("ours", ours), ("theirs", theirs)]
    for pair in range(PAIRS):
        for name, cell in sides if pair % 2 == 0 else sides[::-1]:
            started = time.perf_counter()
            cell()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(taken) for name, taken in times.items()}


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
        pool = shell._xla_magic_session.pool
        pool.client[pool.engines].activate()  # %%px on this shell, on the pool's own engines
        return alternate(quietly(lambda: shell.run_cell_magic("xla_spawn", "", TRIVIAL)),
                         quietly(lambda: shell.run_cell_magic("px", "--block", TRIVIAL)))
    finally:
        quietly(lambda: shell.run_line_magic("xla_pool", "stop"))()


def kernel_death(hosts: Any, freeze_controller: bool) -> float:
    """Seconds from SIGKILL of a kernel with an idle pool on ``hosts`` to nothing left on any host."""
    import signal

    from tests.hosts_fixtures import group_members, kernel_ready, start_kernel, wait_until_empty

    kernel = start_kernel(hosts)
    controller = None
    try:
        controller, _ = kernel_ready(kernel)
        if freeze_controller:
            os.killpg(controller, signal.SIGSTOP)  # the controller and its heart monitor
        started = time.perf_counter()
        kernel.kill()
        kernel.wait()
        left = wait_until_empty(hosts, within=120)
        elapsed = time.perf_counter() - started
        if left:
            raise RuntimeError(f"processes left on the hosts after {elapsed:.0f} s: {left}")
        return elapsed
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        if controller is not None and group_members(controller):
            os.killpg(controller, signal.SIGKILL)


def main() -> list[Row]:
    from IPython.core.interactiveshell import InteractiveShell

    from tests.hosts_fixtures import namespaces_refused
    from xla_magic.hosts.simulated import SimulatedHosts

    refused = namespaces_refused()
    if refused:
        print(f"bench_hosts skipped: {refused}", file=sys.stderr)
        return []
    # Named and addressed apart from any other run's (a second bench: 10.213.10-99.*; the tests take 100-249), since
    # making hosts first removes whatever was left under the same name.
    hosts = SimulatedHosts(name=f"xb{os.getpid() % 1000:03d}", subnet=10 + os.getpid() % 90)
    hosts.up(2)
    try:
        shell = InteractiveShell.instance()
        if getattr(shell, "_xla_magic_session", None) is None:
            shell.run_line_magic("load_ext", "xla_magic")
        figures = measure(shell, hosts)
        figures["death"] = kernel_death(hosts, freeze_controller=False)
        figures["death_heartbeats"] = kernel_death(hosts, freeze_controller=True)
    finally:
        hosts.down()
    return [(
        f"warm 2-host x 2-rank pool: trivial cell round trip (median of {PAIRS}, alternating)",
        figures["ours"] * 1000,
        figures["theirs"] * 1000,
        "ms",
        "vs %%px --block on the same 2 engines, cell by cell in turn (simulated hosts: network namespaces); "
        "target <= 1.2x",
    ), (
        "kernel SIGKILL -> nothing left on 2 hosts x 2 ranks (idle pool)",
        figures["death"],
        figures["death_heartbeats"],
        "s",
        "engines see their controller go, vs ipyparallel's heartbeats (controller frozen); target <= 5 s",
    )]


if __name__ == "__main__":
    for name, ours, base, unit, note in main():
        print(f"{name}: ours {ours:.2f} {unit}, baseline {base:.2f} {unit}, ratio {ours / base:.2f} ({note})")
