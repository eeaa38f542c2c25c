"""Run torch_xla's data-parallel calls across the cpu backend's ranks. Runs in ranks.

In the cpu backend each rank is a process with one XLA CPU device, and
torch_xla on CPU cannot run a collective across processes. ``install``
replaces the torch_xla calls that data-parallel TPU code makes, so that they
behave as on a single-host TPU slice with one chip per process (v4 and
later): values leave the device, travel between the ranks over the gloo
group on loopback, are combined on the CPU in rank order (so every rank gets
bit-identical results) and come back as XLA tensors.

Only the cpu backend installs this, in each rank before the cell runs; the
tpu backend replaces nothing. These run unchanged on top of the replaced
calls: ``xm.optimizer_step`` and ``reduce_gradients`` (all_reduce with scale
1/world_size), ``mesh_reduce`` and ``do_on_ordinals`` (rendezvous),
``collective_broadcast`` and ``broadcast_master_param`` (all_reduce and the
ordinal), ``get_local_ordinal``, ``is_master_ordinal``, ``master_print`` and
``xm.save`` (the ordinals), and ``torch_xla.core.functions``' differentiable
all_reduce and all_gather.

What a TPU refuses (shapes that differ between ranks, replica groups that do
not name every rank once, a dimension the shard count does not divide, ranks
that call different collectives) is refused here with a message, on every
rank at once, where a TPU would fail to compile or hang.
"""

from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from xla_magic.launcher import lifetime

# As long as torch.distributed waits by default: a rank may compute for long
# between two collectives.
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass
class _Simulation:
    rank: int
    world_size: int
    store_dir: str
    group: Any = None  # the private gloo group, made on the first collective


_active: _Simulation | None = None


def install(rank: int, world_size: int, store_dir: str) -> None:
    """Route torch_xla's collectives and ordinals through this module.

    The ranks of a run meet through files in ``store_dir`` (the kernel's
    directory for the run). Their values travel over a gloo group of their
    own, made on the first collective (a cell that makes none never pays
    for it) and never registered with torch.distributed: the default group
    stays the user's, and ``dist.is_initialized()`` is False until user
    code makes one, as on a TPU.
    """
    global _active
    _active = _Simulation(rank, world_size, store_dir)
    for module, name, replacement in _replacements():
        setattr(module, name, replacement)


def _replacements() -> list[tuple[Any, str, Callable[..., Any]]]:
    table: list[tuple[Any, str, Callable[..., Any]]] = [
        (xr, "world_size", world_size),
        (xr, "global_ordinal", global_ordinal),
        (xr, "local_ordinal", local_ordinal),
        (xr, "local_process_count", local_process_count),
        (xr, "addressable_device_count", addressable_device_count),
        (xr, "global_device_count", global_device_count),
        (xr, "process_index", process_index),
        (xr, "process_count", process_count),
        (xm, "all_reduce", all_reduce),
        (xm, "all_gather", all_gather),
        (xm, "reduce_scatter", reduce_scatter),
        (xm, "rendezvous", rendezvous),
        (xm, "xla_rendezvous", xla_rendezvous),
    ]
    # Older torch_xla releases still carry the XRT-era names.
    for name, replacement in (("xrt_world_size", world_size), ("get_ordinal", global_ordinal)):
        if hasattr(xm, name):
            table.append((xm, name, replacement))
    return table


def _sim() -> _Simulation:
    if _active is None:
        raise RuntimeError("the CPU simulation is not installed in this process")
    return _active


# --- torch_xla.runtime: the slice's shape ------------------------------------


def world_size() -> int:
    """xr.world_size: every chip of the slice takes part, one process each."""
    return _sim().world_size


def global_ordinal() -> int:
    """xr.global_ordinal: this process's chip, 0 to world_size - 1."""
    return _sim().rank


def local_ordinal() -> int:
    """xr.local_ordinal: on a single-host slice it equals the global ordinal."""
    return _sim().rank


def local_process_count() -> int:
    """xr.local_process_count: one process per chip on the host."""
    return _sim().world_size


def addressable_device_count() -> int:
    """xr.addressable_device_count: a process sees only its own chip."""
    return 1


def global_device_count() -> int:
    """xr.global_device_count: all the chips of the slice."""
    return _sim().world_size


def process_index() -> int:
    """xr.process_index: one process per chip, so the chip's ordinal."""
    return _sim().rank


def process_count() -> int:
    """xr.process_count: one process per chip."""
    return _sim().world_size


# --- torch_xla.core.xla_model: collectives ---------------------------------


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """xm.all_reduce: combine each tensor over the ranks of the caller's group.

    A tensor gives a new tensor; a list is reduced in place and returned.
    ``scale`` multiplies the result in the tensor's own dtype, as XLA does.
    On one device torch_xla skips the collective (and the scale) and returns
    a copy; so does this. ``pin_layout`` means nothing off a TPU.
    """
    call = "xm.all_reduce"
    single = isinstance(inputs, torch.Tensor)
    if _sim().world_size == 1:
        return inputs.clone() if single else inputs
    tensors = [inputs] if single else list(inputs)
    combine = _reduction(call, reduce_type)
    group = _group_of(call, groups)
    members = _exchange_tensors(call, tensors, group)
    reduced = [_scaled(functools.reduce(combine, column), scale) for column in zip(*members)]
    if single:
        return reduced[0].to(tensors[0].device)
    _write_into(tensors, reduced)
    return inputs


def all_gather(
    value: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    groups: list[list[int]] | None = None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
    channel_id: int | None = None,
    use_global_device_ids: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """xm.all_gather: the values of the caller's group, joined along ``dim``.

    In group order, every rank's value of the same shape, as XLA requires. A
    list of tensors needs ``pin_layout=False`` and gathers each one, as in
    torch_xla. ``output`` receives the result in place.
    """
    call = "xm.all_gather"
    single = isinstance(value, torch.Tensor)
    if single:
        tensors = [value]
    elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        if pin_layout:
            raise RuntimeError("For xm.all_gather with list of tensors input, pin_layout=True is not yet supported.")
        tensors = list(value)
    else:
        raise TypeError(f"`value` needs to be a Tensor or a list of Tensors, but given {type(value)}.")
    for tensor in tensors:
        if tensor.dim() == 0:
            raise ValueError(f"{call} joins tensors along a dimension, and a 0-dim tensor has none; use value.unsqueeze(0).")
    group = _group_of(call, groups, equal_sizes=True)
    members = _exchange_tensors(call, tensors, group)
    gathered = [torch.cat(column, dim=dim) for column in zip(*members)]
    if output is not None:
        targets = [output] if single else list(output)
        _write_into(targets, gathered)
        return output
    results = [g.to(t.device) for g, t in zip(gathered, tensors)]
    return results[0] if single else results


def reduce_scatter(
    reduce_type: str,
    input: torch.Tensor | list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: list[list[int]] | None = None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
    channel_id: int | None = None,
    use_global_device_ids: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """xm.reduce_scatter: combine over the group, keep this rank's shard.

    The reduced tensor is cut along ``scatter_dim`` into ``shard_count``
    equal shards, one per rank of the group, and the i-th rank of the group
    keeps shard i. ``output`` receives the result in place.
    """
    call = "xm.reduce_scatter"
    single = isinstance(input, torch.Tensor)
    if single:
        tensors = [input]
    elif isinstance(input, list) and all(isinstance(v, torch.Tensor) for v in input):
        tensors = list(input)
    else:
        raise TypeError(f"`input` needs to be a Tensor or a list of Tensors, but given {type(input)}.")
    combine = _reduction(call, reduce_type)
    group = _group_of(call, groups, equal_sizes=True)
    if shard_count != len(group):
        raise ValueError(
            f"{call}: shard_count is {shard_count} but the group has {len(group)} ranks; "
            f"XLA gives one shard to each rank of the group, so pass shard_count={len(group)}."
        )
    for tensor in tensors:
        size = tensor.size(scatter_dim)
        if size % shard_count:
            raise ValueError(
                f"{call}: dimension {scatter_dim} has size {size}, which {shard_count} ranks cannot "
                f"share evenly; XLA needs a multiple of shard_count there."
            )
    members = _exchange_tensors(call, tensors, group)
    position = group.index(_sim().rank)
    shards = []
    for column in zip(*members):
        reduced = _scaled(functools.reduce(combine, column), scale)
        width = reduced.size(scatter_dim) // shard_count
        shards.append(reduced.narrow(scatter_dim, position * width, width).clone())
    if output is not None:
        targets = [output] if single else list(output)
        _write_into(targets, shards)
        return output
    results = [s.to(t.device) for s, t in zip(shards, tensors)]
    return results[0] if single else results


def rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> list[bytes]:
    """xm.rendezvous: wait for every rank; every rank's payload, by rank.

    Payloads may differ in length, as on a TPU; the tag only names the
    meeting. Only a rendezvous of all ranks exists, as in torch_xla on PJRT.
    """
    return xla_rendezvous(payload, list(replicas) or None, tag=tag)


def xla_rendezvous(payload: bytes = b"", ordinals: list[int] | None = None, tag: str | None = None) -> list[bytes]:
    """xm.xla_rendezvous: what ``rendezvous`` does (torch_xla's alias)."""
    if ordinals and len(ordinals) != _sim().world_size:
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, bytes):
        raise TypeError("`payload` must be bytes, not {}".format(type(payload)))
    torch_xla.sync()  # torch_xla finishes the pending graph first
    return _exchange("xm.rendezvous", payload)


# --- helpers -----------------------------------------------------------------

_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    xm.REDUCE_SUM: torch.add,
    xm.REDUCE_MUL: torch.mul,
    xm.REDUCE_MIN: torch.minimum,
    xm.REDUCE_MAX: torch.maximum,
    xm.REDUCE_AND: torch.bitwise_and,
    xm.REDUCE_OR: torch.bitwise_or,
}


def _reduction(call: str, reduce_type: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    combine = _REDUCTIONS.get(reduce_type)
    if combine is None:
        names = ", ".join(f"xm.REDUCE_{name.upper()}" for name in _REDUCTIONS)
        raise ValueError(f"{call}: reduce_type {reduce_type!r} is not one of {names}.")
    return combine


def _scaled(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 1.0:
        return tensor
    # XLA multiplies by the scale converted to the tensor's own element type.
    return tensor * torch.tensor(scale, dtype=tensor.dtype)


def _group_of(call: str, groups: list[list[int]] | None, equal_sizes: bool = False) -> list[int]:
    """The ranks this rank combines with: its replica group, or everyone."""
    sim = _sim()
    if not groups:
        return list(range(sim.world_size))
    named = sorted(r for group in groups for r in group)
    if named != list(range(sim.world_size)):
        raise ValueError(
            f"{call}: groups={groups!r} must name every rank from 0 to {sim.world_size - 1} "
            f"exactly once, as XLA replica groups must."
        )
    if equal_sizes and len({len(group) for group in groups}) > 1:
        raise ValueError(f"{call}: groups={groups!r} must all have the same number of ranks.")
    return next(list(group) for group in groups if sim.rank in group)


def _exchange_tensors(call: str, tensors: Sequence[torch.Tensor], group: list[int]) -> list[list[torch.Tensor]]:
    """The CPU copies of ``tensors`` from each rank of ``group``, in group order."""
    everyone = _exchange(call, _host_copies(call, tensors))
    members = [everyone[r] for r in group]
    _require_same_shapes(call, group, members)
    return members


def _host_copies(call: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{call} takes tensors on the XLA device, not {type(tensor).__name__}.")
        if tensor.device.type != "xla":
            raise TypeError(
                f"{call} takes tensors on the XLA device, as on a TPU; got one on {tensor.device}. "
                f"Move it there first with .to(device)."
            )
    tensors = list(tensors)
    # As xm.save does: compute all of them in one graph, then copy them out.
    torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    return [tensor.detach().cpu() for tensor in tensors]


def _require_same_shapes(call: str, group: list[int], members: list[list[torch.Tensor]]) -> None:
    signatures = [[(tuple(t.shape), t.dtype) for t in tensors] for tensors in members]
    if all(signature == signatures[0] for signature in signatures):
        return
    listing = "; ".join(
        f"rank {rank}: " + ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in signature)
        for rank, signature in zip(group, signatures)
    )
    raise ValueError(
        f"{call} needs the same shapes and dtypes on every rank (XLA runs one compiled program on all "
        f"of them; a TPU fails or hangs here). Got {listing}."
    )


def _write_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    # torch_xla's in-place collectives happen outside autograd; so do these.
    with torch.no_grad():
        for target, value in zip(targets, values):
            target.copy_(value)


def _exchange(call: str, value: Any) -> list[Any]:
    """Every rank's ``value``, by rank, after checking all made the same call."""
    sim = _sim()
    if sim.world_size == 1:
        return [value]
    gathered = _all_gather_bytes(_group(sim), pickle.dumps((call, value)))
    gathered = [pickle.loads(blob) for blob in gathered]
    calls = [name for name, _ in gathered]
    if any(name != call for name in calls):
        listing = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(calls))
        raise RuntimeError(
            f"the ranks reached different collectives ({listing}). Every rank must make the same "
            f"collective calls in the same order; on a TPU this hangs."
        )
    return [value for _, value in gathered]


def _group(sim: _Simulation) -> Any:
    """The run's private gloo group, on loopback; made on first use."""
    if sim.group is None:
        store = dist.PrefixStore("xla_magic", dist.FileStore(os.path.join(sim.store_dir, "simulation"), sim.world_size))
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
        options._timeout = GROUP_TIMEOUT
        # gloo prints "[Gloo] Rank N is connected to M peer ranks" on fd 1
        # whatever the log level; keep it out of the cell.
        with lifetime.silenced_stdout():
            sim.group = dist.ProcessGroupGloo(store, sim.rank, sim.world_size, options)
    return sim.group


def _all_gather_bytes(group: Any, blob: bytes) -> list[bytes]:
    """Every rank's bytes, by rank: the lengths first, then the padded bytes."""
    size = torch.tensor([len(blob)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    group.allgather([sizes], [size]).wait()
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else mine[:0]
    everyone = [torch.empty_like(mine) for _ in sizes]
    group.allgather([everyone], [mine]).wait()
    return [bytes(t[: int(s)].numpy()) for t, s in zip(everyone, sizes)]
