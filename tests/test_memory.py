"""Device memory in the CPU simulation, through a real IPython shell and real ranks: the count and its limit,
xm.get_memory_info in a cell, RESOURCE_EXHAUSTED with the TPU's wording, %xla_memory's names and sizes."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from helpers import pool_magic, strip_ansi
from xla_magic.display import RankError

GIB = 1 << 30


@pytest.fixture
def small_pool(ip, monkeypatch):
    """A 2-rank pool whose devices hold 1 MiB each."""
    monkeypatch.setenv("XLA_MAGIC_SIM_HBM", "1M")
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        yield ip._xla_magic_session.pool
    finally:
        pool_magic(ip, "stop")


def test_get_memory_info_in_a_cell_counts_what_the_cell_holds(spawn, pool):
    """The default limit is a v5e's 16 GiB; a 256x256 f32 tensor synced is counted (it fills whole TPU tiles)."""
    before = spawn("", "import torch, torch_xla, torch_xla.core.xla_model as xm\nxm.get_memory_info(device)").value
    assert [info["bytes_limit"] for info in before] == [16 * GIB] * 2
    after = spawn("", "x = torch.ones(256, 256, device=device) * rank\n"
                      "torch_xla.sync()\ninfo = xm.get_memory_info(device)\ninfo").value
    for was, now in zip(before, after):
        assert now["bytes_used"] - was["bytes_used"] == 256 * 256 * 4
        assert now["peak_bytes_used"] >= now["bytes_used"]
    # code that branches on it takes the TPU's branch
    assert spawn("", "'room' if xm.get_memory_info(device)['bytes_limit'] - xm.get_memory_info(device)['bytes_used']"
                     " > 1 << 30 else 'full'").value == ["room", "room"]


def test_past_a_small_limit_the_sync_raises_the_tpus_words_and_the_pool_survives(ip, small_pool):
    cell = ("import torch, torch_xla\n"
            "keep = torch.ones(256, 256, device=device)\n"
            "torch_xla.sync()\n"
            "big = torch.ones(512, 512, device=device) + keep.sum()\n"
            "torch_xla.sync()\n")
    with capture_output() as shown, pytest.raises(RankError) as failed:
        ip.run_cell_magic("xla_spawn", "", cell)
    text = strip_ansi("\n".join(failed.value.render_lines()))
    assert "RuntimeError: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00M. " \
           "That was not possible. There are 768.00K free." in text
    assert "line 5" in text and "torch_xla.sync()" in text
    assert "keep  float32[256, 256]  (other)" in text and "big  float32[512, 512]" in text
    assert "Most of it: tensors left from earlier cells (big, keep)." in text
    assert "The rank survived it" in text
    assert "What to do:" in text and "del" in text
    # the pool kept its ranks and their names: free the memory and go on
    with capture_output():
        values = ip.run_cell_magic("xla_spawn", "", "del big\nimport gc; gc.collect(); torch_xla.sync()\n"
                                                      "xm = __import__('torch_xla.core.xla_model').core.xla_model\n"
                                                      "(tuple(keep.shape), xm.get_memory_info(device)['bytes_used'])")
    assert values == [((256, 256), 256 * 256 * 4)] * 2
