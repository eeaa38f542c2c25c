"""Results mapped from shared memory, through a real Jupyter kernel: values, and the memory's life.

A rank writes a large tensor or array result once into a segment; the kernel
maps it, unlinks it, and builds the value over the mapping (wire/transport.py).
These tests drive a real kernel (jupyter_client) with a real 2-rank pool and
check what a notebook user would: the values, dtypes and shapes; a result
kept across later cells, mutated in the kernel, alive across a pool restart;
and its memory gone once the notebook drops it (the kernel's own mappings in
/proc, its RssShmem, and /dev/shm). Each check reads the kernel's state; none
is timed.
"""

from __future__ import annotations

import ast
import os

import pytest

from helpers import Kernel
from xla_magic.wire import transport

# Run on every rank (device: its XLA device) and, with device="cpu", in the kernel for the expected values.
VALUES = """
import numpy as np, torch
values = dict(
    f32=torch.arange(1 << 20, dtype=torch.float32) * (rank + 1),
    bf16=(torch.arange(1 << 20) % 251).to(torch.bfloat16).reshape(1024, 1024),
    transposed=torch.arange(1 << 20, dtype=torch.int64).reshape(1024, 1024).t(),
    every_other=torch.arange(1 << 22, dtype=torch.int32)[::2],
    c64=torch.complex(torch.ones(1 << 18), torch.arange(float(1 << 18))),
    flags=torch.arange(1 << 21) % 3 == rank,
    half=torch.arange(1 << 20).to(torch.float16),
    zero=torch.zeros(0, 1 << 20),
    scalar=torch.tensor(3.5 + rank),
    weight=torch.nn.Parameter(torch.ones(1 << 18) * rank),
    on_device=torch.arange(1 << 20, dtype=torch.float32, device=device) + rank,
    array=np.arange(1 << 20, dtype=np.float64).reshape(512, -1) + rank,
    fortran=np.asfortranarray(np.arange(1 << 20, dtype=np.int16).reshape(1024, -1)),
    strided=np.arange(1 << 21, dtype=np.float32)[::2],
    zero_array=np.zeros((0, 7)),
    small=torch.arange(5),
)
"""
LARGE = {"f32", "bf16", "transposed", "every_other", "c64", "flags", "half", "weight", "on_device",
         "array", "fortran", "strided"}

# Defined in the kernel: what the checks read there.
PROBES = """
import ast, gc, os, sys

import re

def mapped_results():  # results (tag r<rank>), not the values this kernel shipped, which the pool holds
    return [line.split(None, 5)[5].strip() for line in open('/proc/self/maps')
            if re.search(r'/xla_magic-[0-9a-f-]+-r[0-9]+n[0-9]+ ', line)]

def backing(address):
    for line in open('/proc/self/maps'):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split('-'))
        if start <= address < end:
            return ' '.join(fields[5:])
    return ''

def address(value):
    return value.data_ptr() if hasattr(value, 'data_ptr') else value.__array_interface__['data'][0]

def segment_inode(value):  # the inode of the segment a value's memory is in
    start = address(value)
    for line in open('/proc/self/maps'):
        fields = line.split()
        low, high = (int(part, 16) for part in fields[0].split('-'))
        if low <= start < high:
            return int(fields[4])

def held_segments():  # this kernel's descriptors of result segments (free ones kept for reuse included)
    links = []
    for fd in os.listdir('/proc/self/fd'):
        try:
            links.append(os.readlink(f'/proc/self/fd/{fd}'))
        except OSError:
            pass
    return sorted(link for link in links if re.search(r'/xla_magic-[0-9a-f-]+-r[0-9]+n[0-9]+ ', link))

def free_inodes():  # the inodes of the segments this kernel holds and no value maps: free for reuse
    mapped = {int(line.split()[4]) for line in open('/proc/self/maps') if '/xla_magic-' in line}
    held = set()
    for fd in os.listdir('/proc/self/fd'):
        try:
            if re.search(r'/xla_magic-[0-9a-f-]+-r[0-9]+n[0-9]+ ', os.readlink(f'/proc/self/fd/{fd}')):
                held.add(os.stat(f'/proc/self/fd/{fd}').st_ino)
        except OSError:
            pass
    return sorted(held - mapped)

def held_segments_once_released(within=120):  # waits for the kernel's thread to close free segments
    # within: less than a cell's timeout, so a failure shows what is still held rather than a timeout
    import time
    deadline = time.monotonic() + within
    while held_segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    return held_segments()

def rss_shmem():
    for line in open('/proc/self/status'):
        if line.startswith('RssShmem:'):
            return int(line.split()[1]) * 1024
"""


class Notebook:
    """A real kernel with the extension loaded: cells in, what they printed out."""

    def __init__(self) -> None:
        self.kernel = Kernel()
        self.cell("%load_ext xla_magic")
        self.cell(PROBES)

    def cell(self, code: str) -> str:
        reply, text = self.kernel.run(code)
        assert reply["status"] == "ok", text
        return text

    def value(self, expression: str):
        """A Python literal the kernel prints for ``expression``."""
        return ast.literal_eval(self.cell(f"print(repr(({expression})))").strip().splitlines()[-1])

    def segments_in_shm(self) -> list[str]:
        return transport.segment_names(transport.kernel_prefix(self.kernel.pid))

    def forget_output_history(self) -> None:
        """What a user does to drop a shown result: IPython keeps it in Out[n] and in _, __ and ___.

        %reset out clears Out but leaves _, __ and ___ (and their hidden
        copies) when something has put ``_`` in builtins, as here: drop those too.
        """
        self.cell("%reset -f out\n"
                  "for space in (get_ipython().user_ns, get_ipython().user_ns_hidden):\n"
                  "    for name in ('_', '__', '___'):\n"
                  "        space.pop(name, None)")


@pytest.fixture(scope="module")
def notebook():
    book = Notebook()
    try:
        book.cell("%xla_pool start --devices 2 --backend cpu")
        yield book
    finally:
        book.kernel.close()


def test_values_dtypes_and_shapes_arrive_equal_large_ones_mapped(notebook):
    notebook.cell(f"%%xla_spawn -o got\n{VALUES}\nvalues")
    notebook.cell(f"""
import numpy as np, torch
def expected_for(rank):
    scope = {{'rank': rank, 'device': 'cpu'}}
    exec({VALUES!r}, scope)
    return scope['values']

def same(got, expected):
    if isinstance(expected, torch.Tensor):
        return torch.equal(got.detach(), expected.detach())
    return np.array_equal(got, expected)

def checks(got, expected):
    in_segment = backing(address(got))
    return (
        type(got) is type(expected) and got.dtype == expected.dtype
        and tuple(got.shape) == tuple(expected.shape) and same(got, expected),
        getattr(got, 'requires_grad', None) == getattr(expected, 'requires_grad', None),
        'xla_magic-' in in_segment and in_segment.endswith('(deleted)'),
        str(getattr(got, 'device', 'cpu')) == 'cpu',
    )
""")
    checks = notebook.value("[{name: checks(got[rank][name], value) for name, value in expected_for(rank).items()} "
                            "for rank in range(2)]")
    for rank, by_name in enumerate(checks):
        for name, (equal, grad, mapped, on_cpu) in by_name.items():
            assert equal and grad and on_cpu, (rank, name)
            assert mapped == (name in LARGE), (rank, name, mapped)
    assert notebook.value("got[1]['fortran'].flags.f_contiguous") is True
    assert notebook.value("type(got[0]['weight']).__name__") == "Parameter"
    assert notebook.value("'torch_xla' in sys.modules or '_XLAC' in sys.modules") is False
    assert notebook.segments_in_shm() == []  # adopted: unlinked as soon as mapped
    notebook.cell("del got")
    notebook.forget_output_history()
    assert notebook.value("mapped_results()") == []  # the tests after this one, in any order, start clean


def test_a_kept_result_survives_later_cells_and_mutating_it_stays_in_the_kernel(notebook):
    notebook.cell("%%xla_spawn -o kept\nimport torch, numpy as np\n"
                  "source = torch.full((1 << 20,), float(rank))\ntable = np.full((1 << 17,), rank + 0.5)\n"
                  "(source, table)")
    notebook.cell("kept[0][0].add_(5)\nkept[1][0][:10] = -1\nkept[1][1][:] = 9.0")
    # Later cells: other large results (the same results prefix, new segments), and one reading the kept values.
    for fill in (7.0, 8.0):
        notebook.cell(f"%%xla_spawn -o other\ntorch.full((1 << 20,), {fill})")
        assert notebook.value("[float(t.sum()) for t in other]") == [fill * (1 << 20)] * 2
    seen = notebook.value("get_ipython().run_cell_magic('xla_spawn', '', "
                          "'(float(kept[rank][0].sum()), float(source.sum()), float(table.sum()))')")
    n = 1 << 20
    # The ranks see the kernel's mutated values (shipped anew); their own source and table are untouched.
    assert seen == [(5.0 * n, 0.0, 0.5 * (1 << 17)), (n - 20.0, float(n), 1.5 * (1 << 17))]
    assert notebook.value("[float(kept[0][0].sum()), float(kept[1][0].sum()), float(kept[1][1].sum())]") == [
        5.0 * n, n - 20.0, 9.0 * (1 << 17)]
    notebook.cell("del kept, other")
    notebook.forget_output_history()
    assert notebook.value("mapped_results()") == []


def test_a_mapped_result_lives_through_a_pool_restart(notebook):
    notebook.cell("%%xla_spawn -o kept\nimport torch\ntorch.arange(1 << 20, dtype=torch.float64) * (rank + 1)")
    assert len(notebook.value("mapped_results()")) == 2
    notebook.cell("%xla_pool restart")
    n = 1 << 20
    assert notebook.value("[float(t.sum()) for t in kept]") == [n * (n - 1) / 2, n * (n - 1)]
    notebook.cell("kept[1].mul_(0)")
    assert notebook.value("[float(t.sum()) for t in kept]") == [n * (n - 1) / 2, 0.0]
    assert notebook.segments_in_shm() == []
    assert notebook.cell("%%xla_spawn\nrank").count("[0, 1]") == 1  # the restarted pool serves
    notebook.cell("del kept")
    notebook.forget_output_history()
    assert notebook.value("mapped_results()") == []


def test_a_deleted_result_frees_its_memory(notebook):
    size = 2 * (32 << 20)
    notebook.cell("%%xla_spawn -o out\nimport torch\nbig = torch.ones(8 << 20) * (rank + 1)\nbig")
    notebook.cell("touched = float(out[0].sum() + out[1].sum())\nheld = rss_shmem()")  # every page in our RSS
    assert notebook.value("touched") == 3.0 * (8 << 20)
    assert len(notebook.value("mapped_results()")) == 2 and notebook.segments_in_shm() == []
    notebook.cell("del out")
    assert len(notebook.value("mapped_results()")) == 2  # still shown in Out[n] and _: IPython keeps it
    notebook.forget_output_history()
    assert notebook.value("mapped_results()") == []
    assert notebook.value(f"held - rss_shmem() >= 0.9 * {size}") is True
    assert notebook.segments_in_shm() == []


def test_pulled_values_are_mapped_and_freed_when_deleted(notebook):
    notebook.cell("%%xla_spawn\nimport torch, numpy as np\nw = torch.ones(4 << 20) * rank\n"
                  "a = np.full((1 << 19,), rank, dtype=np.float64)\nNone")
    notebook.cell("%xla_pool pull w\n%xla_pool pull a --rank 1")
    assert notebook.value("[float(t.sum()) for t in w], float(a.sum()), a.dtype.name") == (
        [0.0, float(4 << 20)], float(1 << 19), "float64")
    assert notebook.value("[backing(address(v)).endswith('(deleted)') for v in (*w, a)]") == [True] * 3
    notebook.cell("touched = float(w[1].sum() + a.sum())\nheld = rss_shmem()")
    notebook.cell("del w, a")  # never shown: no output history holds them, and no cycle either
    assert notebook.value("mapped_results()") == []
    assert notebook.value(f"held - rss_shmem() >= 0.9 * {(16 << 20) + (4 << 20)}") is True
    assert notebook.segments_in_shm() == []


def test_a_numpy_result_does_not_import_torch_into_the_kernel():
    book = Notebook()
    try:
        assert book.value("'torch' in sys.modules") is False
        book.cell("%%xla_spawn --devices 2 --backend cpu -o arrays\nimport numpy as np\n"
                  "(np.full((1 << 18,), rank, dtype=np.float32), np.arange(3) + rank)")
        assert book.value("[(float(big.sum()), small.tolist()) for big, small in arrays]") == [
            (0.0, [0, 1, 2]), (float(1 << 18), [1, 2, 3])]
        assert book.value("backing(address(arrays[1][0])).endswith('(deleted)')") is True
        assert book.value("'torch' in sys.modules") is False
    finally:
        book.kernel.close()


def test_a_dropped_result_s_memory_takes_the_next_result_and_the_values_are_the_new_ones(notebook):
    """Reuse (wire/result_memory.py): the next result of each rank is written over the pages of its dropped one."""
    notebook.cell("%%xla_spawn -o out\nimport torch\ntorch.full((1 << 20,), float(rank))")
    before = notebook.value("[segment_inode(t) for t in out]")
    notebook.cell("del out")
    notebook.forget_output_history()
    assert notebook.value("mapped_results()") == [] and set(before) <= set(notebook.value("free_inodes()"))
    free = notebook.value("free_inodes()")
    # Rank 0's next result is smaller than its dropped one, rank 1's larger: both still land in free ones.
    notebook.cell("%%xla_spawn -o out\ntorch.full(((1 << 19) if rank == 0 else (1 << 21),), 7.0 + rank)")
    after = notebook.value("[segment_inode(t) for t in out]")
    assert set(after) <= set(free) and len(set(after)) == 2
    assert notebook.value("[(t.numel(), float(t.min()), float(t.max())) for t in out]") == [
        (1 << 19, 7.0, 7.0), (1 << 21, 8.0, 8.0)]
    notebook.cell("del out")
    notebook.forget_output_history()


def test_a_result_the_notebook_keeps_is_never_written_over(notebook):
    notebook.cell("%%xla_spawn -o kept\nimport torch\ntorch.full((1 << 20,), 1.0 + rank)")
    notebook.cell("%%xla_spawn -o dropped\ntorch.full((1 << 20,), 2.0)")
    kept, dropped = notebook.value("[segment_inode(t) for t in kept]"), notebook.value("[segment_inode(t) for t in dropped]")
    notebook.cell("del dropped")
    notebook.forget_output_history()
    assert set(dropped) <= set(notebook.value("free_inodes()"))
    for fill in (3.0, 4.0):  # each takes free pages, if any are left, but never those of the kept result
        free = notebook.value("free_inodes()")
        notebook.cell(f"%%xla_spawn -o later_{int(fill)}\ntorch.full((1 << 20,), {fill})")
        inodes = notebook.value(f"[segment_inode(t) for t in later_{int(fill)}]")
        assert not set(inodes) & set(kept)
        if fill == 3.0:
            assert set(inodes) <= set(free)
        assert notebook.value("[float(t.sum()) for t in kept]") == [float(1 << 20), 2.0 * (1 << 20)]
        assert notebook.value(f"[float(t.sum()) for t in later_{int(fill)}]") == [fill * (1 << 20)] * 2
    notebook.cell("del kept, later_3, later_4")
    notebook.forget_output_history()


def test_pulled_values_reuse_the_memory_of_dropped_ones(notebook):
    notebook.cell("%%xla_spawn\nimport torch\nw = torch.ones(1 << 20) * rank\nNone")
    notebook.cell("%xla_pool pull w\nbefore = [segment_inode(t) for t in w]\ndel w")
    notebook.cell("%%xla_spawn\nw.add_(10)\nNone")
    free = notebook.value("free_inodes()")
    assert set(notebook.value("before")) <= set(free)
    notebook.cell("%xla_pool pull w")
    assert set(notebook.value("[segment_inode(t) for t in w]")) <= set(free)
    assert notebook.value("[float(t.sum()) for t in w]") == [10.0 * (1 << 20), 11.0 * (1 << 20)]
    notebook.cell("del w, before")


def test_free_memory_is_released_after_the_hold_and_not_kept_at_all_with_reuse_off(notebook):
    try:
        notebook.cell("%env XLA_MAGIC_RESULT_REUSE=0.5")
        notebook.cell("%%xla_spawn -o out\nimport torch\ntorch.ones(1 << 20)")
        notebook.cell("del out")
        notebook.forget_output_history()
        # The kernel's own thread closes them half a second after the drop: wait for that, however loaded.
        assert notebook.value("held_segments_once_released()") == []
        notebook.cell("%env XLA_MAGIC_RESULT_REUSE=0")
        notebook.cell("%%xla_spawn -o out\ntorch.ones(1 << 20)")
        notebook.cell("del out")
        notebook.forget_output_history()
        assert notebook.value("held_segments()") == []
    finally:
        notebook.cell("%env XLA_MAGIC_RESULT_REUSE=")


def test_a_bad_reuse_value_is_said_once_and_frees_at_once(notebook):
    try:
        notebook.cell("%env XLA_MAGIC_RESULT_REUSE=soon")
        said = notebook.cell("%%xla_spawn -o out\nimport torch\ntorch.ones(1 << 20)")
        assert "XLA_MAGIC_RESULT_REUSE='soon' is not a number of seconds" in said and "set it to 0" in said, said
        assert "is not a number" not in notebook.cell("%%xla_spawn -o out\ntorch.ones(1 << 20)")  # said once
        inode = notebook.value("segment_inode(out[0])")
        notebook.cell("del out")
        notebook.forget_output_history()
        assert inode not in notebook.value("free_inodes()")  # not kept: its memory went at once
    finally:
        notebook.cell("%env XLA_MAGIC_RESULT_REUSE=")
