"""Data paths: shipping a large tensor to 8 ranks, gathering large results.

Runs as a script or under benchmarks/run.py (``main()`` returns the rows).
The process running this is the kernel: one real IPython shell with the
extension loaded, its launcher warmed by a first cell.

- Shipping: a 1 GiB float32 tensor read by every rank of an 8-rank cell,
  against cloudpickle through a pipe to each of 8 worker processes (what
  multiprocessing-style launchers do with arguments). Peak extra host memory
  is sampled every few milliseconds over the whole process tree (anonymous
  memory, proportional share) plus the shared-memory segments, above what the
  tree held just before.
- Gathering: 8 ranks each return 64 MiB, against ``DirectView.pull`` from 8
  ipyparallel engines. Both take the difference between the large and a tiny
  value, so start-up and teardown cancel out.
"""

from __future__ import annotations

import os
import statistics
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

GIB = 1 << 30
MB = 1_000_000
RANKS = 8
SHIP_BYTES = GIB
GATHER_BYTES = 64 << 20  # per rank
SHIP_RUNS = 3
GATHER_RUNS = 5
# The baseline holds about this many copies of the value at its peak
# (each worker: the received bytes, the bytes inside the pickle, the tensor).
BASELINE_COPIES = 3 * RANKS + 2
SAMPLE_EVERY = 0.005


# --- measuring host memory ----------------------------------------------------


def _anon_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss_Anon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # the process ended between listing and reading
    return 0


def _segment_bytes() -> int:
    from xla_magic.wire import transport

    total = 0
    for name in transport.segment_names(transport.kernel_prefix()):
        try:
            total += os.stat(os.path.join(transport.SHM_DIR, name)).st_blocks * 512
        except OSError:
            pass
    return total


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (cheap: no scan of all of /proc)."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    queue.extend(int(child) for child in children.read().split())
            except OSError:
                pass
    return found


def host_bytes(root: int) -> int:
    """Anonymous memory of ``root`` and all its descendants, plus our segments."""
    return sum(_anon_bytes(pid) for pid in descendants(root)) + _segment_bytes()


@contextmanager
def peak_extra_memory(root: int) -> Iterator[list[int]]:
    """Yields a list that holds, afterwards, the peak bytes above the start."""
    result: list[int] = []
    start = host_bytes(root)
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], host_bytes(root))
            stop.wait(SAMPLE_EVERY)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], host_bytes(root))
        result.append(peak[0] - start)


# --- ours: through the real shell --------------------------------------------


def start_shell() -> Any:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "xla_magic")
    cell(shell, "rank")  # starts the launcher: later cells are warm
    return shell


def cell(shell: Any, source: str, devices: int = RANKS) -> Any:
    from IPython.utils.capture import capture_output

    with capture_output():
        return shell.run_cell_magic("xla_spawn", f"--devices {devices} --backend cpu", source)


def ship_ours(shell: Any) -> tuple[float, int]:
    """Wall time and peak extra memory of an 8-rank cell that sums a 1 GiB tensor.

    Timed runs and the run that samples memory are separate: sampling costs
    CPU that the timed runs should not lose.
    """
    import torch

    shell.user_ns["shipped"] = torch.ones(SHIP_BYTES // 4)
    expected = [float(SHIP_BYTES // 4)] * RANKS
    try:
        times = []
        for _ in range(SHIP_RUNS):
            started = time.perf_counter()
            sums = cell(shell, "float(shipped.sum())")
            times.append(time.perf_counter() - started)
            assert sums == expected, sums
        with peak_extra_memory(os.getpid()) as peak:
            assert cell(shell, "float(shipped.sum())") == expected
    finally:
        del shell.user_ns["shipped"]
    return statistics.median(times), peak[0]


# --- baseline: cloudpickle through a pipe to each rank -------------------------


def _read_exactly(fd: int, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        count = os.readv(fd, [view[got:]])
        if count == 0:
            raise EOFError(f"the other end closed after {got} of {size} bytes")
        got += count
    return buffer


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# A rank of the baseline, started fresh (as multiprocessing's spawn does) and
# waiting. Per value: read the pickle from its pipe, load it, read the tensor,
# reply, and hold the value until told, as a cell holds what it reads. It
# leaves when its pipe closes.
WORKER = """
import os, pickle, struct, sys
import torch

inbox, outbox = int(sys.argv[1]), int(sys.argv[2])

def read_exactly(size):
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = os.readv(inbox, [view[got:]])
        if count == 0:
            sys.exit(0)
        got += count
    return buffer

os.write(outbox, b"r")
while True:
    (size,) = struct.unpack("!Q", read_exactly(8))
    received = read_exactly(size)
    namespace = pickle.loads(received)
    del received
    os.write(outbox, struct.pack("!d", float(namespace["shipped"].sum())))
    read_exactly(1)
    del namespace
"""


class PipeRanks:
    """8 baseline worker processes, each behind a pipe of its own."""

    def __init__(self) -> None:
        self.workers: list[tuple[subprocess.Popen, int, int]] = []
        try:
            for _ in range(RANKS):
                self.workers.append(self._start())
            for _, _, from_worker in self.workers:
                _read_exactly(from_worker, 1)  # started and waiting
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start() -> tuple[subprocess.Popen, int, int]:
        worker_in, to_worker = os.pipe()
        from_worker, worker_out = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(worker_in), str(worker_out)], pass_fds=(worker_in, worker_out)
        )
        os.close(worker_in)
        os.close(worker_out)
        return process, to_worker, from_worker

    def ship(self, value: Any) -> tuple[float, list[float]]:
        """Pickle once, send to every worker at once; seconds until all have read it."""
        import cloudpickle

        started = time.perf_counter()
        data = cloudpickle.dumps({"shipped": value})
        frame = struct.pack("!Q", len(data))
        senders = [threading.Thread(target=_send, args=(w, frame, data)) for _, w, _ in self.workers]
        for sender in senders:
            sender.start()
        sums = [struct.unpack("!d", _read_exactly(r, 8))[0] for _, _, r in self.workers]
        elapsed = time.perf_counter() - started
        for sender in senders:
            sender.join()
        return elapsed, sums

    def release(self) -> None:
        for _, to_worker, _ in self.workers:
            _write_all(to_worker, b"x")

    def close(self) -> None:
        for process, to_worker, from_worker in self.workers:
            os.close(to_worker)
            os.close(from_worker)
            process.wait()
        self.workers = []


def _send(fd: int, *parts: bytes) -> None:
    for part in parts:
        _write_all(fd, part)


def ship_baseline(nbytes: int) -> tuple[float, int]:
    """Median wall time, then peak extra memory (a run of its own), of the baseline."""
    import torch

    value = torch.ones(nbytes // 4)
    expected = [float(nbytes // 4)] * RANKS
    ranks = PipeRanks()
    try:
        times = []
        for _ in range(SHIP_RUNS):
            elapsed, sums = ranks.ship(value)
            ranks.release()
            assert sums == expected, sums
            times.append(elapsed)
        with peak_extra_memory(os.getpid()) as peak:
            _, sums = ranks.ship(value)
        ranks.release()
        assert sums == expected, sums
    finally:
        ranks.close()
    return statistics.median(times), peak[0]


def baseline_size() -> int:
    """The largest power-of-two size up to 1 GiB whose baseline fits in 40% of free memory."""
    available = _available_memory()
    size = SHIP_BYTES
    while size > (64 << 20) and size * BASELINE_COPIES > 0.4 * available:
        size //= 2
    return size


def _available_memory() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# --- gathering ------------------------------------------------------------------

GATHER_CELL = """
import time, torch
value = torch.ones({elements}) * rank
strategy.barrier()
(time.time(), value)
"""


def gather_ours(shell: Any) -> float:
    """Seconds to bring 8 x 64 MiB from the ranks into the kernel, beyond a tiny result."""

    def timed(elements: int) -> float:
        runs = []
        for _ in range(GATHER_RUNS):
            results = cell(shell, GATHER_CELL.format(elements=elements))
            ended = time.time()
            runs.append(ended - max(sent for sent, _ in results))
            del results
        return statistics.median(runs)

    return timed(GATHER_BYTES // 4) - timed(1)


def gather_ipyparallel() -> float:
    """The same with ``DirectView.pull`` from 8 ipyparallel engines."""
    import ipyparallel

    cluster = ipyparallel.Cluster(n=RANKS, log_level=40)
    client = cluster.start_and_connect_sync(activate=False)
    try:
        client.wait_for_engines(RANKS, timeout=120)
        view = client[:]
        view.execute(f"import numpy\nvalue = numpy.ones({GATHER_BYTES // 4}, dtype='float32')\ntiny = 1.0", block=True)

        def timed(name: str) -> float:
            runs = []
            for _ in range(GATHER_RUNS):
                started = time.perf_counter()
                pulled = view.pull(name, block=True)
                runs.append(time.perf_counter() - started)
                del pulled
            return statistics.median(runs)

        return timed("value") - timed("tiny")
    finally:
        client.close()
        cluster.stop_cluster_sync()


# --- the rows ----------------------------------------------------------------------


def main() -> list[tuple[str, float, float, str, str]]:
    shell = start_shell()
    ours_time, ours_peak = ship_ours(shell)
    size = baseline_size()
    base_time, base_peak = ship_baseline(size)
    scale = SHIP_BYTES / size
    scaled = "" if scale == 1 else f"; baseline measured at {size >> 20} MiB, scaled x{scale:g} (memory here)"
    gathered = RANKS * GATHER_BYTES / MB
    ours_gather = gathered / gather_ours(shell)
    shell.run_line_magic("unload_ext", "xla_magic")
    base_gather = gathered / gather_ipyparallel()
    return [
        (
            "ship 1 GiB tensor to an 8-rank cell: wall",
            ours_time,
            base_time * scale,
            "s",
            f"vs cloudpickle through a pipe per rank; target <= 1.5 s{scaled}",
        ),
        (
            "ship 1 GiB tensor to an 8-rank cell: peak extra host memory",
            ours_peak / GIB,
            base_peak * scale / GIB,
            "GiB",
            f"whole process tree incl. 8 rank runtimes; target <= 1.3 GiB{scaled}",
        ),
        (
            "gather 8 x 64 MiB tensor results",
            ours_gather,
            base_gather,
            "MB/s",
            "vs ipyparallel DirectView.pull of numpy arrays; target >= 2000 MB/s and >= 10x",
        ),
    ]


if __name__ == "__main__":
    for row in main():
        print(row)
    sys.exit(0)
