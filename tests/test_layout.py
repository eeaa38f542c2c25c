"""The simulation lays tensors out as XLA:TPU does: a table of shapes and dtypes against their padded bytes.

Each row cites the HLO layout it reproduces, as a TPU's HLO dumps and
out-of-memory reports write it (XLA's docs/tiled_layout.md notation), on a
v5e (the default simulated device, a size alone or ``v5e``) and on a v3
(``XLA_MAGIC_SIM_HBM=v3``, whose smallest tiles are twice as tall). The
sizes are read from real ranks: what ``xm.get_memory_info`` grows by when a
tensor of the row's shape moves to the simulated device (``.to(device)``
allocates at its line, as on a TPU), and what it falls back by once the
tensor is gone.
"""

from __future__ import annotations

import pytest

from xla_magic.launcher import layout

MIB = 1 << 20

# shape, dtype, v5e layout, v5e bytes, v3 layout, v3 bytes
ROWS = [
    ((4,), "float32", "f32[4]{0:T(128)}", 512, "f32[4]{0:T(256)}", 1024),
    ((256,), "int32", "s32[256]{0:T(256)}", 1024, "s32[256]{0:T(256)}", 1024),
    ((301,), "int32", "s32[301]{0:T(512)}", 2048, "s32[301]{0:T(512)}", 2048),
    ((1024,), "float32", "f32[1024]{0:T(1024)}", 4096, "f32[1024]{0:T(1024)}", 4096),
    # jax-ml/jax#1491: jnp.ones(10000) allocates 40960 B
    ((10000,), "float32", "f32[10000]{0:T(1024)}", 40960, "f32[10000]{0:T(1024)}", 40960),
    ((4,), "bfloat16", "bf16[4]{0:T(256)(128)(2,1)}", 512, "bf16[4]{0:T(512)(128)(2,1)}", 1024),
    ((1000,), "bfloat16", "bf16[1000]{0:T(1024)(128)(2,1)}", 2048, "bf16[1000]{0:T(1024)(128)(2,1)}", 2048),
    ((4,), "int8", "s8[4]{0:T(512)(128)(4,1)}", 512, "s8[4]{0:T(1024)(128)(4,1)}", 1024),
    ((4,), "bool", "pred[4]{0:T(512)(128)(4,1)}", 512, "pred[4]{0:T(1024)(128)(4,1)}", 1024),
    ((1, 5), "float32", "f32[1,5]{1,0:T(1,128)}", 512, "f32[1,5]{1,0:T(2,128)}", 1024),
    ((2, 5), "float32", "f32[2,5]{1,0:T(2,128)}", 1024, "f32[2,5]{1,0:T(2,128)}", 1024),
    ((3, 200), "float32", "f32[3,200]{1,0:T(4,128)}", 4096, "f32[3,200]{1,0:T(4,128)}", 4096),
    ((9, 130), "float32", "f32[9,130]{1,0:T(8,128)}", 16384, "f32[9,130]{1,0:T(8,128)}", 16384),
    ((2, 3, 5), "float32", "f32[2,3,5]{2,1,0:T(4,128)}", 4096, "f32[2,3,5]{2,1,0:T(4,128)}", 4096),
    ((1, 100), "bfloat16", "bf16[1,100]{1,0:T(2,128)(2,1)}", 512, "bf16[1,100]{1,0:T(4,128)(2,1)}", 1024),
    ((3, 300), "bfloat16", "bf16[3,300]{1,0:T(4,128)(2,1)}", 3072, "bf16[3,300]{1,0:T(4,128)(2,1)}", 3072),
    ((16, 1024), "bfloat16", "bf16[16,1024]{1,0:T(8,128)(2,1)}", 32768, "bf16[16,1024]{1,0:T(8,128)(2,1)}", 32768),
    ((2, 5), "int8", "s8[2,5]{1,0:T(4,128)(4,1)}", 512, "s8[2,5]{1,0:T(8,128)(4,1)}", 1024),
    ((5, 5), "uint8", "u8[5,5]{1,0:T(8,128)(4,1)}", 1024, "u8[5,5]{1,0:T(8,128)(4,1)}", 1024),
    ((3, 7), "bool", "pred[3,7]{1,0:T(4,128)(4,1)}", 512, "pred[3,7]{1,0:T(8,128)(4,1)}", 1024),
    ((), "float32", "f32[]{:T(128)}", 512, "f32[]{:T(256)}", 1024),
    ((), "bfloat16", "bf16[]{:T(256)}", 512, "bf16[]{:T(512)}", 1024),
    ((), "int8", "s8[]{:T(512)}", 512, "s8[]{:T(1024)}", 1024),
]

ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "int8": 1, "uint8": 1, "bool": 1}
KINDS = {"v5e": ("16G", 5, 2, 3), "v3": ("v3", 3, 4, 5)}  # XLA_MAGIC_SIM_HBM, generation, layout and bytes columns

MEASURE = """
import torch, torch_xla.core.xla_model as xm
def used():
    return xm.get_memory_info(device)["bytes_used"]
sizes = []
for shape, dtype in rows:
    before = used()
    t = torch.zeros(shape, dtype=getattr(torch, dtype)).to(device)
    grown = used() - before
    del t
    sizes.append((grown, used() - before))
sizes
"""


@pytest.mark.parametrize("kind", KINDS)
def test_each_shape_takes_the_bytes_of_its_tpu_layout_on_real_ranks(spawn, monkeypatch, kind):
    limit, gen, layout_column, bytes_column = KINDS[kind]
    monkeypatch.setenv("XLA_MAGIC_SIM_HBM", limit)
    for row in ROWS:
        shape, dtype = row[0], row[1]
        assert layout.text(shape, dtype, ITEMSIZE[dtype], gen) == row[layout_column], row
        assert layout.padded_bytes(shape, ITEMSIZE[dtype], gen) == row[bytes_column], row
    measured = spawn("--devices 1 --backend cpu", MEASURE, rows=[(row[0], row[1]) for row in ROWS]).value[0]
    for row, (grown, left) in zip(ROWS, measured):
        assert grown == row[bytes_column], f"{row[layout_column]}: counted {grown} B, a TPU takes {row[bytes_column]}"
        assert left == 0, f"{row[layout_column]}: {left} B still counted once the tensor is gone"


def test_the_device_kind_follows_the_simulations_limit_or_the_tpu_host():
    assert layout.generation({"XLA_MAGIC_SIM_HBM": "v3"}) == 3
    assert layout.generation({"XLA_MAGIC_SIM_HBM": "tpu v2"}) == 2
    assert layout.generation({"XLA_MAGIC_SIM_HBM": "256MiB"}) == layout.DEFAULT_GENERATION == 5
    assert layout.generation({"XLA_MAGIC_SIM_HBM": "v6e"}) == 6
    assert layout.generation({"TPU_ACCELERATOR_TYPE": "v3-8"}) == 3
    assert layout.generation({}) == 5


VECTOR = """
import torch, torch_xla, torch_xla.core.xla_model as xm
before = xm.get_memory_info(device)["bytes_used"]
x = torch.ones(16 * 2**20).to(device)
moved = xm.get_memory_info(device)["bytes_used"] - before
y = x * 2
torch_xla.sync()
(moved, xm.get_memory_info(device)["bytes_used"] - before)
"""


def test_a_64_mib_f32_vector_grows_get_memory_info_by_64_mib(spawn):
    """At its .to(device) line, as on a TPU, and once more for the vector a sync computes from it."""
    assert spawn("--devices 1 --backend cpu", VECTOR).value == [(64 * MIB, 128 * MIB)]
