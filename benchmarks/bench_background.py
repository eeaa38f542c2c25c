"""Background runs through a real Jupyter kernel: how fast ``--bg`` returns, what the run's log costs a
streaming cell, and a trivial background cell's round trip against a blocking one's.

Runs as a script (``python benchmarks/bench_background.py``) or under benchmarks/run.py. One real kernel
(jupyter_client) with an 8-rank pool; each row's baseline runs in the same kernel, alternating with ours round
by round (bench_kernel.alternate); a figure is the median over rounds.

- ``--bg`` returns: ``%%xla_spawn --bg -o run`` of ``a = 1`` submitted to the kernel idle again (the run
  itself waited for, untimed, before the next round); baseline: a plain kernel cell ``a = 1``.
- The log's cost: a background cell in which every rank prints 50,000 lines, from submitting it to the end of
  ``run.wait()``, with the run's log written, against the same with the log's writing off (its bound set to 0
  bytes, so nothing past its first line is written); the same kernel, alternating.
- Round trip: ``run_cell_magic('xla_spawn', '--bg -o run', 'a = 1').wait()`` in one kernel cell against the
  blocking ``%%xla_spawn`` of ``a = 1``.
"""

from __future__ import annotations

import statistics
import sys

from bench_kernel import Kernel, alternate, pool_kernel, ratio_note

RANKS = 8
LINES = 50_000
ROUNDS = 15
STREAM_ROUNDS = 7
WARM_UP = 3

Row = tuple[str, float, float, str, str]

WAIT = "run.wait()"
STREAM = f"for i in range({LINES}):\n    print(rank, i)"
LOG_ON = "from xla_magic.runs import log as _log\n_log.LIMIT = 64 * 2**20"
LOG_OFF = "from xla_magic.runs import log as _log\n_log.LIMIT = 0"


def returns_row(kernel: Kernel) -> Row:
    cells = {"bg": "%%xla_spawn --bg -o run\na = 1", "plain": "a = 1"}
    alternate(kernel, cells, WARM_UP, between=WAIT)
    times = alternate(kernel, cells, ROUNDS, between=WAIT)
    bg, plain = times["bg"], times["plain"]
    return (
        f"warm {RANKS}-rank pool: %%xla_spawn --bg returns (submitted to idle, median of {ROUNDS})",
        statistics.median(bg) * 1000, statistics.median(plain) * 1000, "ms",
        f"vs a plain kernel cell a = 1 in the same kernel, alternating; target <= 20 ms; {ratio_note(bg, plain)}",
    )


def stream_row(kernel: Kernel) -> Row:
    times: dict[str, list[float]] = {"on": [], "off": []}
    for number in range(STREAM_ROUNDS + 1):
        for kind in ("on", "off") if number % 2 == 0 else ("off", "on"):
            kernel.run(LOG_ON if kind == "on" else LOG_OFF)
            seconds = kernel.run(f"%%xla_spawn --bg -o run\n{STREAM}") + kernel.run(WAIT)
            if number:  # the first round warms up
                times[kind].append(seconds)
    kernel.run(LOG_ON)
    on, off = times["on"], times["off"]
    lines = RANKS * LINES
    return (
        f"warm {RANKS}-rank pool: background streaming, {lines:,} lines, run's log on (median of {STREAM_ROUNDS})",
        lines / statistics.median(on), lines / statistics.median(off), "lines/s",
        f"submitted to run.wait() done; vs the same with the log's writing off, alternating; target <= 5% slower; "
        f"{ratio_note(on, off)} (time)",
    )


def round_trip_row(kernel: Kernel) -> Row:
    cells = {"bg": "get_ipython().run_cell_magic('xla_spawn', '--bg -o run', 'a = 1').wait()",
             "blocking": "%%xla_spawn\na = 1"}
    alternate(kernel, cells, WARM_UP)
    times = alternate(kernel, cells, ROUNDS)
    bg, blocking = times["bg"], times["blocking"]
    return (
        f"warm {RANKS}-rank pool: trivial background cell's round trip, started and waited for (median of {ROUNDS})",
        statistics.median(bg) * 1000, statistics.median(blocking) * 1000, "ms",
        f"vs the blocking %%xla_spawn of a = 1, alternating; target <= 1.2x; {ratio_note(bg, blocking)}",
    )


def main() -> list[Row]:
    with pool_kernel(RANKS) as kernel:
        return [returns_row(kernel), stream_row(kernel), round_trip_row(kernel)]


if __name__ == "__main__":
    for row in main():
        print(row)
    sys.exit(0)
