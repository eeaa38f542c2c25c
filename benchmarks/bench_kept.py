"""Kept pools: a kernel restart with a kept pool against one with a new pool, through a real kernel.

Runs as a script (``python benchmarks/bench_kept.py``) or under
benchmarks/run.py (``main()`` returns the rows). One real kernel
(jupyter_client), restarted with ``KernelManager.restart_kernel(now=True)``,
which kills its process group as Jupyter's restart does; kept pools live in
a temporary ``XDG_RUNTIME_DIR`` of the benchmark's, ended before it returns.
Each round, in this order:

1. ``%xla_pool start --keep`` with 8 simulated ranks, then TRAIN once (its
   graphs compile), untimed; restart the kernel; ``%load_ext xla_magic``.
2. Kept: ``%xla_pool attach`` and a cell returning ``rank`` (attach to the
   first result), then TRAIN (its graphs compiled before the restart); then
   ``%xla_pool stop NAME``.
3. New: restart the kernel, ``%load_ext xla_magic``, ``%xla_pool start`` and
   a cell returning ``rank``, then TRAIN, which builds its model and
   compiles; then ``%xla_pool stop``.

Each figure is the median over ROUNDS; the note gives the median of the
rounds' ratios. Then the warm round trip (``a = 1``) in a kept pool against
a pool that is not kept, ROUND_TRIPS cells each, alternating pools.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

from bench_kernel import Kernel, ratio_note

RANKS = 8
ROUNDS = 3
ROUND_TRIPS = 30
WARM_UP = 3
NAME = "bench"
TRAIN = """import torch
import torch_xla.core.xla_model as xm
if 'net' not in globals():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
for _ in range(3):
    opt.zero_grad()
    loss = net(torch.ones(16, 256, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    xm.mark_step()
loss.item()"""

Row = tuple[str, float, float, str, str]


def restarted(kernel: Kernel) -> None:
    kernel.manager.restart_kernel(now=True)
    kernel.client.wait_for_ready(timeout=120)
    kernel.run("%load_ext xla_magic")


def one_round(kernel: Kernel) -> dict[str, float]:
    kernel.run(f"%xla_pool start --keep {NAME} --devices {RANKS} --backend cpu")
    kernel.run("%%xla_spawn\n" + TRAIN)
    restarted(kernel)
    times = {"kept_attach": kernel.run(f"%xla_pool attach {NAME}")}
    times["kept_first"] = kernel.run("%%xla_spawn\nrank")
    times["kept_train"] = kernel.run("%%xla_spawn\n" + TRAIN)
    kernel.run(f"%xla_pool stop {NAME}")
    restarted(kernel)
    times["new_start"] = kernel.run(f"%xla_pool start --devices {RANKS} --backend cpu")
    times["new_first"] = kernel.run("%%xla_spawn\nrank")
    times["new_train"] = kernel.run("%%xla_spawn\n" + TRAIN)
    kernel.run("%xla_pool stop")
    return times


def round_trips(kernel: Kernel, keep: bool) -> list[float]:
    kernel.run(f"%xla_pool start {'--keep ' + NAME if keep else ''} --devices {RANKS} --backend cpu")
    try:
        for _ in range(WARM_UP):
            kernel.run("%%xla_spawn\na = 1")
        return [kernel.run("%%xla_spawn\na = 1") for _ in range(ROUND_TRIPS)]
    finally:
        kernel.run(f"%xla_pool stop {NAME if keep else ''}")


def main() -> list[Row]:
    runtime = tempfile.mkdtemp(prefix="kp-")
    before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = runtime  # the kernel inherits it
    kernel = Kernel()
    try:
        kernel.run("%load_ext xla_magic")
        rounds = [one_round(kernel) for _ in range(ROUNDS)]
        kept_trips: list[float] = []
        plain_trips: list[float] = []
        for number in range(2):
            for keep in ((False, True) if number % 2 == 0 else (True, False)):
                (kept_trips if keep else plain_trips).extend(round_trips(kernel, keep))
    finally:
        kernel.close()
        _end_kept()
        if before is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = before
        shutil.rmtree(runtime, ignore_errors=True)
    attach = [r["kept_attach"] + r["kept_first"] for r in rounds]
    start = [r["new_start"] + r["new_first"] for r in rounds]
    kept_first = [r["kept_attach"] + r["kept_train"] for r in rounds]
    new_first = [r["new_start"] + r["new_train"] for r in rounds]
    return [
        (f"%xla_pool attach to a kept {RANKS}-rank pool after a kernel restart, to the first result (median of "
         f"{ROUNDS})", statistics.median(attach), statistics.median(start), "s",
         f"attach, then a cell returning rank; baseline: %xla_pool start of a new pool in the restarted kernel, "
         f"then the same cell; {ratio_note(attach, start)}; target: at most 1 s"),
        (f"first training cell after a kernel restart, kept pool against a new pool ({RANKS} ranks, a 6-layer "
         f"MLP's 3 SGD steps compiled before the restart; median of {ROUNDS})", statistics.median(kept_first),
         statistics.median(new_first), "s",
         f"attach + the cell, against start + the cell (which builds the model and compiles); "
         f"{ratio_note(kept_first, new_first)}; the cell alone took {statistics.median(r['kept_train'] for r in rounds):.2f} s "
         f"kept and {statistics.median(r['new_train'] for r in rounds):.2f} s new"),
        (f"warm round trip of a kept {RANKS}-rank pool (a = 1, median of {2 * ROUND_TRIPS})",
         statistics.median(kept_trips) * 1000, statistics.median(plain_trips) * 1000, "ms",
         "baseline: the same cells in a pool that is not kept, in the same kernel, pools alternating; target: "
         "no slower"),
    ]


def _end_kept() -> None:
    """End whatever kept pool a failed run left in the benchmark's folder (XDG_RUNTIME_DIR is still its own)."""
    from xla_magic.pools import kept as kept_pools
    from xla_magic.wire import kept

    for name in kept.names():
        try:
            kept_pools.end_by_name(name)
        except Exception as exc:  # the benchmark's own tidying: say it, go on
            print(f"could not end kept pool {name}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    for row in main():
        print(row)
    sys.exit(0)
