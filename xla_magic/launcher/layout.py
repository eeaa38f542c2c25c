"""How XLA:TPU lays a tensor out in device memory: its tiles and its padded bytes. Runs in a rank.

One function decides what every view and the simulation's count say a
tensor takes on a TPU (``padded_bytes``), for the device kind the ranks
stand in for (``generation``): a v2/v3 where ``XLA_MAGIC_SIM_HBM`` (or a
TPU host's ``TPU_ACCELERATOR_TYPE``) names one, else a v5e.

XLA:TPU's default layouts (v4 and later; P = 32 / bits of the element
type: 1 for 32-bit, 2 for 16-bit, 4 for 8-bit and bool, which is packed as
8-bit):

- rank 1, N elements: one tile of 128·2^k elements, the smallest that holds
  N from 128·P up, at most 1024 (``f32[4]{0:T(128)}``,
  ``s32[301]{0:T(512)}``, ``bf16[N]{0:T(256)(128)(2,1)}``);
- rank ≥ 2, R rows in the second-minor dimension: tiles of (rows, 128),
  rows P doubled until it holds R, at most 8 (``f32[3,N]{1,0:T(4,128)}``,
  ``bf16[16,N]{1,0:T(8,128)(2,1)}``), the outer dimensions untiled;
- a scalar: one tile of a vector (512 B);
- v2/v3: the smallest row count is 2P.

The sub-tiles that pack narrow types ((2,1), (4,1)) add no padding
(XLA's ``ShapeUtil::ArraySize``). Mosaic's ``getTilingFactor``
(jax-ml/jax ``jaxlib/mosaic/dialect/tpu/transforms/infer_memref_layout.cc``)
reproduces these defaults for a kernel's arguments; XLA's
``docs/tiled_layout.md`` describes the notation. The tests hold a table of
shapes against the layouts they reproduce (tests/test_layout.py).

Where XLA chooses otherwise (another dimension order or a larger tile for
a graph's own buffers, a convolution's layout), these are estimates; a
named tensor's size is never off by more than its tile. 64-bit types have
no native TPU layout: they are laid out as 32-bit ones with 8-byte
elements (an estimate).
"""

from __future__ import annotations

import math
import os

LANES = 128
MAX_ROWS = 8  # the largest second-minor tile XLA:TPU uses by default
OLD_KINDS = ("v2", "v3")  # kinds whose smallest tiles are twice as tall
DEFAULT_GENERATION = 5  # a v5e, the default simulated device


def generation(environ: dict[str, str] | None = None) -> int:
    """The TPU generation the ranks stand in for: 2 or 3 where the simulation's limit or the host names
    one (``XLA_MAGIC_SIM_HBM=v3``, ``TPU_ACCELERATOR_TYPE=v3-8``), else a v5e's 5."""
    environ = os.environ if environ is None else environ
    for name in ("XLA_MAGIC_SIM_HBM", "TPU_ACCELERATOR_TYPE"):
        kind = environ.get(name, "").strip().lower().removeprefix("tpu").strip().split("-")[0]
        if kind in OLD_KINDS:
            return int(kind[1])
        if kind.startswith("v") and kind[1:2].isdigit():
            return int(kind[1])
    return DEFAULT_GENERATION


def _packing(itemsize: int) -> int:
    """Elements packed into one 32-bit word (bool counts as 8-bit; 64-bit types as 32-bit)."""
    return max(1, 4 // max(1, itemsize))


def _rows(count: int, itemsize: int, gen: int) -> int:
    """The tile's rows for ``count`` rows (or 128-element groups): the smallest row count (P, or 2P
    on v2/v3), doubled until it holds ``count``, at most 8."""
    rows = _packing(itemsize) * (2 if gen < 4 else 1)
    while rows < min(count, MAX_ROWS):
        rows *= 2
    return rows


def tile(shape: tuple[int, ...], itemsize: int, gen: int | None = None) -> tuple[int, ...]:
    """The first (padding) tile of ``shape``'s default layout: (elements,) for rank 0 and 1, (rows, 128) above."""
    gen = generation() if gen is None else gen
    if len(shape) <= 1:
        count = shape[0] if shape else 1
        return (_rows(-(-count // LANES), itemsize, gen) * LANES,)
    return (_rows(shape[-2], itemsize, gen), LANES)


def padded_bytes(shape: tuple[int, ...], itemsize: int, gen: int | None = None) -> int:
    """The bytes XLA:TPU allocates for ``shape`` with elements of ``itemsize`` bytes, in its default layout."""
    first = tile(shape, itemsize, gen)
    if len(shape) <= 1:
        count = shape[0] if shape else 1
        return _round_up(count, first[0]) * itemsize
    outer = math.prod(shape[:-2])
    return outer * _round_up(shape[-2], first[0]) * _round_up(shape[-1], LANES) * itemsize


def estimated(itemsize: int) -> bool:
    """Whether the rules above only estimate such a tensor's TPU size (64-bit types: no native layout)."""
    return itemsize > 4


def _round_up(value: int, to: int) -> int:
    return -(-value // to) * to


# XLA's names of torch's dtypes
XLA_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "s64", "int32": "s32",
             "int16": "s16", "int8": "s8", "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
             "bool": "pred", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "complex64": "c64"}


def text(shape: tuple[int, ...], dtype: str, itemsize: int, gen: int | None = None) -> str:
    """``shape`` as XLA writes it with its TPU layout: ``f32[4]{0:T(128)}``, ``bf16[3,256]{1,0:T(4,128)(2,1)}``."""
    name = XLA_TYPES.get(dtype.removeprefix("torch."), dtype)
    first = tile(tuple(shape), itemsize, gen)
    packing = _packing(itemsize)
    tiles = f"T({','.join(map(str, first))})"
    if packing > 1 and shape:
        tiles += f"(128)({packing},1)" if len(shape) == 1 else f"({packing},1)"
    order = ",".join(str(axis) for axis in reversed(range(len(shape))))
    return f"{name}[{','.join(map(str, shape))}]{{{order}:{tiles}}}"
