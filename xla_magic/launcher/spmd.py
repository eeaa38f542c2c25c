"""The SPMD placement: one process owns every device, with a mesh. Runs in a rank (that process).

torch_xla's SPMD mode (``xr.use_spmd()``) makes one process drive all the
host's devices as a single virtual device; tensors are sharded over a
``Mesh`` by annotation and the compiler partitions the program. The
supervisor forks one process for it, applies ``environment()`` before
anything touches the runtime, then calls ``setup()`` for the in-cell names
(``show_sharding`` among them).

On CPU, ``CPU_NUM_DEVICES=N`` gives that process N real XLA CPU devices, so
sharding, partitioning and the collectives the compiler inserts all really
run. ``describe_sharding`` says which device holds which block of a tensor,
as plain data the kernel renders (``xla_magic.cell.sharding``); ``whole_on_cpu``
brings a sharded tensor back as one CPU tensor.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Sequence

import torch

# The wrapper mark_sharding returns; its module is only loaded once SPMD code ran.
_SHARDED_TENSOR_MODULE = "torch_xla.distributed.spmd.xla_sharded_tensor"

# torch_xla's SPMD guide names the axes of a 2-D mesh ("data", "model"); the kernel's
# xla_magic.cell.sharding.DEFAULT_AXES says the same (tests/test_spmd.py checks).
DEFAULT_AXES = {1: ("data",), 2: ("data", "model")}


def environment(devices: int, on_cpu: bool) -> dict[str, str]:
    """The variables the SPMD process needs before the runtime starts.

    On CPU: ``devices`` XLA CPU devices in this one process. On a TPU every
    chip of the host is the default; one device is the one-chip topology
    torch_xla's own single-chip launch uses.
    """
    if on_cpu:
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    variables = {"PJRT_DEVICE": "TPU"}
    if devices == 1:
        variables.update(TPU_VISIBLE_CHIPS="0", TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_BOUNDS="1,1,1")
    return variables


def setup(
    devices: int,
    mesh_shape: tuple[int, ...] | None,
    axis_names: tuple[str, ...] | None,
) -> dict[str, Any]:
    """Turn SPMD on and build the mesh; the names a cell sees.

    Call once, in a fresh process whose environment ``environment()`` set,
    before any XLA device is used. ``mesh_shape`` defaults to 1-D over every
    device; ``axis_names`` to ``("data",)`` for a 1-D mesh and ``("data",
    "model")`` for a 2-D one. The mesh is also the global mesh
    (``xs.get_global_mesh()``), where FSDPv2 and other SPMD helpers look.
    """
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    shape = (devices,) if mesh_shape is None else tuple(mesh_shape)
    names = _axis_names(shape, axis_names)
    if int(np.prod(shape)) != devices:
        raise ValueError(f"a mesh of shape {shape} holds {int(np.prod(shape))} devices, not {devices}")
    xr.use_spmd()
    _make_use_spmd_idempotent(xr)
    found = xr.global_runtime_device_count()
    if found != devices:
        raise RuntimeError(
            f"SPMD was asked for {devices} device{'s' * (devices != 1)} but the runtime has {found}; "
            f"SPMD drives every device the process sees, so ask for {found}."
        )
    mesh = xs.Mesh(np.arange(devices), shape, names)
    xs.set_global_mesh(mesh)
    return {
        "device": torch_xla.device(), "mesh": mesh, "world_size": devices, "rank": 0,
        "show_sharding": show_sharding,
    }


def show_sharding(tensor: torch.Tensor, mesh: Any = None) -> None:
    """Draw, in the running cell, which device holds which block of ``tensor`` (HTML in a notebook, text elsewhere).

    The description (``describe_sharding``) goes to the kernel, which draws
    it after the output the cell printed so far.
    """
    from xla_magic.launcher import displays

    displays.display("sharding", describe_sharding(tensor, mesh))


def _axis_names(shape: tuple[int, ...], axis_names: Sequence[str] | None) -> tuple[str, ...]:
    if axis_names is None:
        if len(shape) not in DEFAULT_AXES:
            raise ValueError(f"a mesh of shape {shape} needs axis names")
        return DEFAULT_AXES[len(shape)]
    names = tuple(axis_names)
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} axis names {names} for a mesh of {len(shape)} axes {shape}")
    return names


def _make_use_spmd_idempotent(xr: Any) -> None:
    """Let code written for a script call ``xr.use_spmd()`` again, quietly.

    Every SPMD program from torch_xla's docs starts with ``xr.use_spmd()``;
    a second call only warns that XLA_USE_SPMD (set by the first) is
    deprecated. ``auto=True`` (auto-sharding) still goes through.
    """
    original = getattr(xr.use_spmd, "__wrapped__", xr.use_spmd)

    @functools.wraps(original)
    def use_spmd(auto: bool | None = False) -> None:
        if auto or not xr.is_spmd():
            with warnings.catch_warnings():  # the variable is ours, not the user's
                warnings.filterwarnings("ignore", message="XLA_USE_SPMD is being deprecated")
                original(auto)

    xr.use_spmd = use_spmd


def _global_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The XLA tensor under ``mark_sharding``'s XLAShardedTensor wrapper (or ``tensor``)."""
    wrapper = sys.modules.get(_SHARDED_TENSOR_MODULE)
    if wrapper is not None and isinstance(tensor, wrapper.XLAShardedTensor):
        return tensor.global_tensor
    return tensor


def whole_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) XLA tensor as one plain CPU tensor.

    ``.cpu()`` of the XLAShardedTensor that ``mark_sharding`` returns is
    another XLAShardedTensor (on the CPU), which cannot be pickled; the
    global tensor it wraps gathers every shard into one.
    """
    return _global_tensor(tensor).detach().cpu()


def describe_sharding(tensor: torch.Tensor, mesh: Any = None) -> dict[str, Any]:
    """Which device holds which block of ``tensor``, as plain data.

    ``mesh`` (default: the global mesh, which ``setup`` sets) names the axes;
    with it the description also says which mesh axes shard each dimension,
    when they explain the layout exactly. A tensor whose value is still a
    pending computation is computed first (its sharding is decided when it
    compiles), as printing it would.

    The keys: ``shape``, ``dtype``, ``itemsize``, ``devices`` (how many),
    ``platform`` ("CPU", "TPU"), ``spec`` (XLA's sharding string),
    ``replicated`` (every device holds all of it), ``ranges`` (per
    dimension, the ``[start, stop]`` of each block along it; a block that a
    device holds only padding of is empty), ``grid`` (nested lists, one
    level per dimension, of the device ids holding each block),
    ``mesh_shape`` and ``axis_names`` (None without a mesh), and
    ``partition`` (per dimension, the mesh axes sharding it, major first;
    None when the mesh does not explain the layout).
    """
    import torch_xla.runtime as xr

    inner = _xla_tensor(tensor)
    spec = _sharding_spec(inner)
    devices = xr.global_runtime_device_count()
    shape = tuple(inner.shape)
    ranges, where = _layout(_regions(inner, spec, shape, devices))
    if mesh is None:
        mesh = _global_mesh()
    return {
        "shape": list(shape),
        "dtype": str(inner.dtype).removeprefix("torch."),
        "itemsize": inner.element_size(),
        "devices": devices,
        "platform": xr.device_type() or "XLA",
        "spec": spec or "{replicated}",
        "replicated": all(len(pieces) == 1 for pieces in ranges),
        "ranges": [[list(piece) for piece in pieces] for pieces in ranges],
        "grid": _grid(where, [len(pieces) for pieces in ranges]),
        "mesh_shape": None if mesh is None else [int(size) for size in mesh.mesh_shape],
        "axis_names": None if mesh is None or mesh.axis_names is None else list(mesh.axis_names),
        "partition": None if mesh is None else _partition(where, mesh, len(shape)),
    }


def _xla_tensor(tensor: Any) -> torch.Tensor:
    inner = _global_tensor(tensor)
    if not isinstance(inner, torch.Tensor) or inner.device.type != "xla":
        where = f"one on {inner.device.type}" if isinstance(inner, torch.Tensor) else f"a {type(inner).__name__}"
        raise TypeError(f"describe_sharding takes an XLA tensor, not {where}; move it with .to(device)")
    return inner


def _sharding_spec(inner: torch.Tensor) -> str:
    """XLA's sharding string for ``inner``; empty when it carries none (replicated)."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec(inner)
    if not spec:  # maybe pending: its sharding is known once it is computed
        torch_xla._XLAC._xla_sync_multi([inner], devices=[], wait=True)
        spec = torch_xla._XLAC._get_xla_sharding_spec(inner)
    return spec


Region = tuple[tuple[int, int], ...]  # (start, stop) along each dimension


def _layout(regions: list[Region]) -> tuple[list[list[tuple[int, int]]], dict[int, tuple[int, ...]]]:
    """The distinct blocks along each dimension, and the block index of each device."""
    dimensions = len(regions[0]) if regions else 0
    ranges = [sorted({region[dim] for region in regions}) for dim in range(dimensions)]
    where = {
        device: tuple(ranges[dim].index(region[dim]) for dim in range(dimensions))
        for device, region in enumerate(regions)
    }
    return ranges, where


def _regions(inner: torch.Tensor, spec: str, shape: tuple[int, ...], devices: int) -> list[Region]:
    """Per device id, the (start, stop) it holds along each dimension."""
    import torch_xla

    whole = tuple((0, size) for size in shape)
    if not spec or spec == "{replicated}":  # SPMD replicates what carries no sharding
        return [whole] * devices
    placed = torch_xla._XLAC._get_local_shard_replica_and_indices([inner])[0]
    regions = []
    for _replica, indices in placed:  # one entry per device, in device order
        if indices is Ellipsis:
            regions.append(whole)
        else:
            regions.append(tuple((piece.start, piece.stop) for piece in indices))
    return regions


def _grid(where: dict[int, tuple[int, ...]], tiles: list[int]) -> Any:
    """Nested lists over the blocks; each leaf, the sorted device ids holding that block."""
    holders: dict[tuple[int, ...], list[int]] = {}
    for device in sorted(where):
        holders.setdefault(where[device], []).append(device)

    def build(prefix: tuple[int, ...]) -> Any:
        if len(prefix) == len(tiles):
            return holders.get(prefix, [])
        return [build(prefix + (i,)) for i in range(tiles[len(prefix)])]

    return build(())


def _global_mesh() -> Any:
    import torch_xla.distributed.spmd as xs

    return xs.get_global_mesh()


def _partition(where: dict[int, tuple[int, ...]], mesh: Any, dimensions: int) -> list[list[str]] | None:
    """Per tensor dimension, the mesh axes (major first) that shard it, if they explain the layout.

    Steps once along each mesh axis from the mesh's first device and sees
    which block index that changes; then rebuilds where every device would
    be under that guess and keeps it only if that is exactly ``where``.
    """
    import numpy as np

    logical = np.asarray(mesh.get_logical_mesh())
    if sorted(int(d) for d in logical.flat) != sorted(where):
        return None
    names = list(mesh.axis_names) if mesh.axis_names is not None else [str(i) for i in range(logical.ndim)]
    origin = where[int(logical.flat[0])]
    steps: dict[int, list[tuple[int, int]]] = {dim: [] for dim in range(dimensions)}
    for axis in range(logical.ndim):
        if logical.shape[axis] < 2:
            continue
        neighbour = where[int(logical[tuple(1 if a == axis else 0 for a in range(logical.ndim))])]
        moved = [dim for dim in range(dimensions) if neighbour[dim] != origin[dim]]
        if len(moved) > 1:
            return None
        if moved:
            steps[moved[0]].append((neighbour[moved[0]] - origin[moved[0]], axis))
    partition = [[axis for _step, axis in sorted(steps[dim], reverse=True)] for dim in range(dimensions)]
    if not _explains(partition, logical, where):
        return None
    return [[names[axis] for axis in axes] for axes in partition]


def _explains(partition: list[list[int]], logical: Any, where: dict[int, tuple[int, ...]]) -> bool:
    """Whether sharding each dimension over ``partition``'s axes puts every device where it is."""
    import numpy as np

    for position in np.ndindex(*logical.shape):
        expected = []
        for axes in partition:
            block = 0
            for axis in axes:  # major axis first: a mixed-radix block number
                block = block * logical.shape[axis] + position[axis]
            expected.append(block)
        if where[int(logical[position])] != tuple(expected):
            return False
    return True
