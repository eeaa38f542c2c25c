"""Large values through shared memory: equal values, isolation, nothing left behind.

Every cell runs through the real shell on real rank processes; crashes and
interrupts are real (os._exit in a rank, SIGINT to this process, SIGKILL of a
kernel). Each test also looks at /dev/shm while or before the run ends, so it
can tell a sweep that worked from a segment that never existed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from IPython.core.error import UsageError

from conftest import BACKING, kernel_is_xla_free
from helpers import WRITE_MEET_READ, interrupt_when, shown
from xla_magic.wire import transport
from xla_magic.runs.errors import RankError, RunInterrupted

BIG = 1 << 20  # elements: 4 MiB of float32, above the 1 MiB threshold



def ours() -> list[str]:
    """This kernel's segments in /dev/shm now."""
    return transport.segment_names(transport.kernel_prefix())


def backing(address: int) -> str:
    namespace: dict = {}
    exec(BACKING, namespace)
    return namespace["backing"](address)


@pytest.fixture(autouse=True)
def nothing_left_after():
    before = set(ours())
    yield
    assert sorted(set(ours()) - before) == []


def test_large_values_arrive_equal_small_ones_stay_in_the_pickle(ip, spawn):
    values = {
        "f32": torch.arange(BIG, dtype=torch.float32),
        "bf16": torch.linspace(-1, 1, BIG).to(torch.bfloat16).reshape(1024, -1),
        "strided": torch.arange(2 * BIG, dtype=torch.int64).reshape(1024, -1).t(),
        "weight": torch.nn.Parameter(torch.randn(512, 1024)),
        "fortran": np.asfortranarray(np.random.default_rng(0).random((512, 512))),
        "records": np.zeros(BIG // 4, dtype=[("a", "<i4"), ("b", "<f8")]),
        "tiny": torch.arange(10),
        "tiny_array": np.arange(10),
    }
    values["records"]["a"] = np.arange(BIG // 4)
    cell = BACKING + textwrap.dedent("""
        import numpy as np
        def address(v):
            return v.data_ptr() if hasattr(v, "data_ptr") else v.__array_interface__["data"][0]
        shipped = dict(f32=f32, bf16=bf16, strided=strided, weight=weight, fortran=fortran,
                       records=records, tiny=tiny, tiny_array=tiny_array)
        ({k: backing(address(v)) for k, v in shipped.items()},
         weight.requires_grad, type(weight).__name__, fortran.flags.f_contiguous, shipped)
    """)
    run = spawn("--devices 2", cell, **values)
    for files, requires_grad, kind, fortran_order, back in run.value:
        for name in ("f32", "bf16", "strided", "weight", "fortran", "records"):
            assert files[name].startswith(os.path.join(transport.SHM_DIR, transport.kernel_prefix())), name
        assert not any("xla_magic" in files[name] for name in ("tiny", "tiny_array"))
        assert (requires_grad, kind, fortran_order) == (True, "Parameter", True)
        for name, value in values.items():
            if isinstance(value, np.ndarray):
                assert np.array_equal(back[name], value), name
            else:
                assert torch.equal(back[name], value), name


def test_a_rank_writing_a_shipped_value_changes_nothing_else(ip, spawn):
    weights = torch.zeros(BIG)
    table = np.zeros(BIG)
    cell = textwrap.dedent("""
        weights[rank] += 1 + rank
        table[:] = rank + 10
        strategy.barrier()
        (weights[:2].tolist(), float(table.sum()) / len(table))
    """)
    run = spawn("--devices 2", cell, weights=weights, table=table)
    assert run.value == [([1.0, 0.0], 10.0), ([0.0, 2.0], 11.0)]
    assert float(weights.abs().sum()) == 0.0 and float(np.abs(table).sum()) == 0.0


def test_a_rank_writing_a_shipped_value_in_thread_ranks_changes_nothing_else(ip, spawn, monkeypatch, marks):
    """The tpu launch path runs ranks as threads of one process: still private copies, while both run."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    weights = torch.zeros(BIG)
    run = spawn("--backend tpu --devices 2", WRITE_MEET_READ, weights=weights)
    assert run.value == [[1.0, 0.0], [0.0, 2.0]]
    assert float(weights.abs().sum()) == 0.0


def test_large_results_come_back_owned_by_the_kernel(ip, spawn):
    cell = textwrap.dedent("""
        import numpy as np, torch
        on_device = torch.full((1 << 19,), float(rank), device=device)
        (torch.arange(1 << 20) * rank, np.full((512, 512), rank, dtype=np.float64), on_device, rank)
    """)
    run = spawn("--devices 2", cell)
    for rank, (tensor, array, from_device, small) in enumerate(run.value):
        assert torch.equal(tensor, torch.arange(BIG) * rank)
        assert np.array_equal(array, np.full((512, 512), rank, dtype=np.float64))
        assert from_device.device.type == "cpu" and torch.equal(from_device, torch.full((1 << 19,), float(rank)))
        assert small == rank
        for value in (tensor, from_device):
            # Adopted: the memory is a segment that no longer has a name anywhere.
            assert backing(value.data_ptr()).endswith("(deleted)")
            value.add_(1)
        array += 1
        assert float(array.min()) == rank + 1
    assert kernel_is_xla_free()


def test_error_in_a_rank_leaves_no_segment(ip, spawn):
    cell = "import torch\nx = data.sum()\nif rank == 1:\n    raise ValueError('boom')\ntorch.ones(1 << 20)"
    with pytest.raises(RankError) as info:
        spawn("--devices 2", cell, data=torch.ones(BIG))
    assert [(f.rank, f.type, f.message) for f in info.value.failures] == [(1, "ValueError", "boom")]
    if 0 in info.value.results:  # taken before the run was stopped
        assert torch.equal(info.value.results[0], torch.ones(BIG))


def test_rank_crash_after_writing_a_result_segment_leaves_nothing(ip):
    from IPython.utils.capture import capture_output

    cell = textwrap.dedent("""
        import os, torch
        class Crash:
            def __reduce__(self):
                mine = [n for n in os.listdir(SHM) if n.startswith(PREFIX) and "-r0n" in n]
                print("written", len(mine), flush=True)
                os._exit(3)
        [torch.ones(1 << 20), Crash()]
    """)
    ip.user_ns.update(SHM=transport.SHM_DIR, PREFIX=transport.kernel_prefix())
    with capture_output() as captured, pytest.raises(RankError, match="exit code 3"):
        ip.run_cell_magic("xla_spawn", "--devices 1", cell)
    assert "[rank 0] written 1" in captured.stdout


def test_interrupt_sweeps_what_was_shipped(ip, spawn):
    seen_during_run: list[list[str]] = []

    def every_rank_has_its_data() -> bool:
        if shown("summed") < 2:
            return False
        seen_during_run.append(ours())
        return True

    pressed = interrupt_when(every_rank_has_its_data)
    with pytest.raises(RunInterrupted):
        spawn("--devices 2", "import time\nx = data.sum()\nprint('summed', flush=True)\ntime.sleep(600)", data=torch.ones(BIG))
    assert pressed.is_set()
    assert len(seen_during_run[0]) == 1


def test_unpicklable_neighbour_leaves_no_segment(ip, spawn):
    with pytest.raises(UsageError, match="'held_lock'"):
        spawn("--devices 2", "(big.sum(), held_lock)", big=torch.ones(BIG), held_lock=threading.Lock())


KILLED_KERNEL = """
import os, signal, sys, torch
from xla_magic.cell.shipping import Shipping
shipping = Shipping()
shipping.fields({"big": torch.ones(1 << 20)})  # what a cell that reads it ships
print(",".join(shipping.held.segments.names()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_segments_of_a_killed_kernel_are_swept_by_the_next_one(ip, spawn):
    done = subprocess.run([sys.executable, "-c", KILLED_KERNEL], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    orphans = done.stdout.strip().split(",")
    assert len(orphans) == 1 and orphans[0] in transport.segment_names()
    assert spawn("--devices 1", "rank").value == [0]
    assert orphans[0] not in transport.segment_names()


NO_ROOM = """
import resource, signal, sys, torch
from xla_magic.wire import transport
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
segments = transport.RunSegments()
data = transport.dumps_namespace({"big": torch.arange(1 << 21)}, segments)
values, prefix = transport.load_namespace(data)
print(len(data) > (1 << 24), torch.equal(values["big"], torch.arange(1 << 21)), segments.names() == [], prefix == segments.prefix)
"""


def test_no_room_in_shared_memory_falls_back_to_the_pickle():
    """A file-size limit makes the segment write fail like a full /dev/shm would."""
    done = subprocess.run([sys.executable, "-c", NO_ROOM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"] * 4


def test_transport_imports_nothing_heavy():
    probe = "import sys, xla_magic.wire.transport; print(sorted(m for m in ('torch', 'numpy', 'IPython', 'torch_xla') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_a_result_segment_of_another_kernel_is_refused():
    foreign = transport.SegmentWriter(f"{transport.NAME_PREFIX}0-1-0123abcd", "r")
    with pytest.raises(ValueError, match="does not belong to this kernel"):
        transport.adopt(f"{foreign.prefix}-rn0")
