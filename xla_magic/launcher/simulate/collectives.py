"""torch_xla.core.xla_model's collectives across simulated ranks. Runs in a rank.

Each function has the signature, semantics, shapes, dtypes and refusals of
the torch_xla 2.9 function it replaces, and bumps the metric counter that
function's C++ side bumps on a TPU. Values travel through ``exchange`` and
are combined on the CPU in rank order.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any, Callable, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from xla_magic.launcher.simulate import exchange as ex
from xla_magic.launcher.simulate.exchange import bump, exchange_tensors, group_of, rebind, sim, to_device


def all_reduce(
    reduce_type: str,
    inputs: torch.Tensor | list[torch.Tensor],
    scale: float = 1.0,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor | list[torch.Tensor]:
    """xm.all_reduce. As in torch_xla, the plain case (one tensor, no scale,
    no groups, pinned) is torch's functional all_reduce, which torch.compile
    traces (see ``traced``); the others run eagerly."""
    if _plain(inputs) and scale == 1.0 and not groups and pin_layout:
        return torch.ops._c10d_functional.all_reduce(inputs, reduce_type, "xm.all_reduce")
    return eager_all_reduce(reduce_type, inputs, scale, groups, pin_layout)


def all_gather(
    value: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    groups: list[list[int]] | None = None,
    output: torch.Tensor | list[torch.Tensor] | None = None,
    pin_layout: bool = True,
    channel_id: int | None = None,
    use_global_device_ids: bool | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """xm.all_gather. As in torch_xla, one pinned tensor without ``output``
    is an all_reduce of zero-padded values, which torch.compile traces."""
    if _plain(value) and pin_layout and output is None and not groups:
        if value.dim() == 0:
            raise ValueError("xm.all_gather joins tensors along a dimension, and a 0-dim tensor has none; use value.unsqueeze(0).")
        dim = dim % value.dim()
        padding = [0] * (2 * value.dim())
        size, rank, world_size = value.size(dim), sim().rank, sim().world_size
        index = value.dim() - 1 - dim
        padding[2 * index], padding[2 * index + 1] = rank * size, (world_size - 1 - rank) * size
        padded = torch.nn.functional.pad(value, padding)
        return torch.ops._c10d_functional.all_reduce(padded, xm.REDUCE_SUM, "xm.all_gather")
    return eager_all_gather(value, dim, groups, output, pin_layout, channel_id, use_global_device_ids)


def _plain(value: Any) -> bool:
    """One XLA tensor, among several ranks: the case torch_xla makes traceable."""
    return isinstance(value, torch.Tensor) and value.device.type == "xla" and sim().world_size > 1


def eager_all_reduce(
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
    single = isinstance(inputs, torch.Tensor)
    if sim().world_size == 1:
        return inputs.clone() if single else inputs
    tensors = [inputs] if single else list(inputs)
    reduced = reduce_values("xm.all_reduce", reduce_type, tensors, scale, group_of("xm.all_reduce", groups))
    if not single:
        bump("xla::AllReduceInPlace")
        for target, value in zip(tensors, reduced):
            rebind(target, value)
        return inputs
    bump("xla::AllReduce")
    return _like(reduced[0], tensors[0])


def reduce_values(
    call: str, reduce_type: str, tensors: Sequence[torch.Tensor], scale: float, group: list[int]
) -> list[torch.Tensor]:
    """CPU results of reducing each tensor over ``group``, in group order."""
    combine = _reduction(call, reduce_type)
    members = exchange_tensors(call, tensors, group)
    return [_scaled(functools.reduce(combine, column), scale) for column in zip(*members)]


def eager_all_gather(
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
    torch_xla. ``output`` (a tensor, or a list for a list) is rebound to the
    result, whatever its shape was, and returned.
    """
    call = "xm.all_gather"
    single = isinstance(value, torch.Tensor)
    tensors = _tensor_list(call, value, "value")
    if not single and pin_layout:
        raise RuntimeError("For xm.all_gather with list of tensors input, pin_layout=True is not yet supported.")
    targets = _outputs(output, tensors, single)
    for tensor in tensors:
        if tensor.dim() == 0:
            raise ValueError(f"{call} joins tensors along a dimension, and a 0-dim tensor has none; use value.unsqueeze(0).")
    group = group_of(call, groups, equal_sizes=True)
    if single and pin_layout and output is None:
        # torch_xla builds this one from an all_reduce of zero-padded values.
        if sim().world_size == 1:
            return value.clone()
        bump("xla::AllReduce")
    elif single:
        bump("xla::AllGatherOut" if output is not None else "xla::AllGather")
    members = exchange_tensors(call, tensors, group)
    gathered = [torch.cat(column, dim=dim) for column in zip(*members)]
    return _deliver(gathered, tensors, targets, output, single)


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
    keeps shard i. ``output`` is rebound to the shard (its own shape does
    not matter, as in torch_xla) and returned.
    """
    call = "xm.reduce_scatter"
    single = isinstance(input, torch.Tensor)
    tensors = _tensor_list(call, input, "input")
    targets = _outputs(output, tensors, single)
    group = group_of(call, groups, equal_sizes=True)
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
    if single:
        bump("xla::ReduceScatterOut" if output is not None else "xla::ReduceScatter")
    position = group.index(sim().rank)
    shards = []
    for reduced in reduce_values(call, reduce_type, tensors, scale, group):
        width = reduced.size(scatter_dim) // shard_count
        shards.append(reduced.narrow(scatter_dim, position * width, width).clone())
    return _deliver(shards, tensors, targets, output, single)


def all_to_all(
    value: torch.Tensor,
    split_dimension: int,
    concat_dimension: int,
    split_count: int,
    groups: list[list[int]] | None = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """xm.all_to_all: XLA AllToAll within the caller's group.

    ``value`` is cut along ``split_dimension`` into ``split_count`` blocks;
    block i goes to the i-th rank of the group, and the blocks a rank
    receives are joined along ``concat_dimension`` in group order.
    """
    call = "xm.all_to_all"
    group = group_of(call, groups, equal_sizes=True)
    if split_count != len(group):
        raise ValueError(
            f"{call}: split_count is {split_count} but the group has {len(group)} ranks; "
            f"XLA sends one block to each rank of the group, so pass split_count={len(group)}."
        )
    size = value.size(split_dimension)
    if size % split_count:
        raise ValueError(
            f"{call}: dimension {split_dimension} has size {size}, which {split_count} blocks cannot "
            f"share evenly; XLA needs a multiple of split_count there."
        )
    bump("xla::AllToAll")
    return _like(all_to_all_values(call, value, split_dimension, concat_dimension, group), value)


def all_to_all_values(call: str, value: torch.Tensor, split_dim: int, concat_dim: int, group: list[int]) -> torch.Tensor:
    """The CPU result of an all-to-all over ``group``."""
    position = group.index(sim().rank)
    members = exchange_tensors(call, [value], group)
    width = value.size(split_dim) // len(group)
    return torch.cat([tensors[0].narrow(split_dim, position * width, width) for tensors in members], dim=concat_dim)


def collective_permute(value: torch.Tensor, pairs: list[list[int]]) -> torch.Tensor:
    """xm.collective_permute: each rank gets the value of the rank that sends to it.

    ``pairs`` lists (source, target) ranks; a rank no pair targets gets
    zeros. Ranks may pass different pairs (dist.send and dist.recv do), but
    a target and its source must agree on the pair.
    """
    call = "xm.collective_permute"
    state = sim()
    pairs = _checked_pairs(call, pairs, state.world_size)
    host = ex.host_copies(call, [value])[0]
    everyone = ex.exchange(call, (pairs, host))
    sources = [source for source, target in pairs if target == state.rank]
    if not sources:
        return _like(torch.zeros_like(host), value)
    source = sources[0]
    source_pairs, sent = everyone[source]
    if [source, state.rank] not in source_pairs:
        raise ValueError(
            f"{call}: rank {state.rank} expects a value from rank {source}, whose pairs {source_pairs!r} "
            f"send nothing to it; both must name the pair [{source}, {state.rank}]."
        )
    ex.require_same_shapes(call, [source, state.rank], [[sent], [host]])
    return _like(sent, value)


def send(value: torch.Tensor, channel_id: int) -> torch.Tensor:
    """xm.send: post ``value`` on ``channel_id`` for the rank that receives on it."""
    host = ex.host_copies("xm.send", [value])[0]
    ex.post(channel_id, pickle.dumps(host))
    return value


def recv(output: torch.Tensor, channel_id: int) -> torch.Tensor:
    """xm.recv: the value sent on ``channel_id``, with ``output``'s shape and dtype."""
    value = pickle.loads(ex.take(channel_id))
    ex.require_same_shapes("xm.recv", [-1, sim().rank], [[value], [output]])
    return _like(value, output)


def rendezvous(tag: str, payload: bytes = b"", replicas: Sequence[int] = ()) -> list[bytes]:
    """xm.rendezvous: wait for every rank; every rank's payload, by rank.

    Payloads may differ in length, as on a TPU; the tag only names the
    meeting. Only a rendezvous of all ranks exists, as in torch_xla on PJRT.
    """
    return xla_rendezvous(payload, list(replicas) or None, tag=tag)


def xla_rendezvous(payload: bytes = b"", ordinals: list[int] | None = None, tag: str | None = None) -> list[bytes]:
    """xm.xla_rendezvous: what ``rendezvous`` does (torch_xla's alias)."""
    state = sim()
    if ordinals and len(ordinals) != state.world_size:
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, bytes):
        raise TypeError("`payload` must be bytes, not {}".format(type(payload)))
    torch_xla.sync()  # torch_xla finishes the pending graph first
    payloads = ex.exchange("xm.rendezvous", payload)
    _bump_rendezvous(state.world_size, any(payloads))
    return payloads


def _bump_rendezvous(world_size: int, any_payload: bool) -> None:
    # What torch_xla's xla_rendezvous does on a TPU: all_gather the sizes
    # (an all_reduce), read the largest (.item()); with payloads, all_gather
    # them too, read two more sizes, and copy the sizes and each payload out.
    if world_size > 1:
        bump("xla::all_reduce", 2 if any_payload else 1)
    bump("xla::_to_cpu", 3 if any_payload else 1)
    if any_payload:
        bump("xla::_to_copy", 1 + world_size)


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


def _tensor_list(call: str, value: Any, name: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise TypeError(f"`{name}` needs to be a Tensor or a list of Tensors, but given {type(value)}.")


def _outputs(output: Any, tensors: list[torch.Tensor], single: bool) -> list[torch.Tensor] | None:
    """The tensors ``output=`` names, checked as torch_xla checks them."""
    if output is None:
        return None
    if single:
        return [output]
    if not isinstance(output, list) or any(not isinstance(v, torch.Tensor) for v in output):
        raise TypeError(f"`output` needs to be a list of Tensors, but given {type(output)}.")
    if len(output) != len(tensors):
        raise ValueError(f"`output` length doesn't match `input` length: {len(output)} vs {len(tensors)}.")
    return list(output)


def _deliver(
    values: list[torch.Tensor], tensors: list[torch.Tensor], targets: list[torch.Tensor] | None, output: Any, single: bool
) -> torch.Tensor | list[torch.Tensor]:
    """Rebind ``output=`` and return it, or return new XLA tensors."""
    if targets is not None:
        for target, value in zip(targets, values):
            rebind(target, value)
        return output
    results = [_like(v, t) for v, t in zip(values, tensors)]
    return results[0] if single else results


def _like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``value`` on ``reference``'s XLA device."""
    return to_device(value, reference.device)


def _checked_pairs(call: str, pairs: Any, world_size: int) -> list[list[int]]:
    try:
        checked = [[int(source), int(target)] for source, target in pairs]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{call}: pairs={pairs!r} must be a list of [source, target] ranks.") from exc
    for name, index in (("source", 0), ("target", 1)):
        ranks = [pair[index] for pair in checked]
        if any(not 0 <= r < world_size for r in ranks):
            raise ValueError(f"{call}: pairs={pairs!r} name a rank outside 0 to {world_size - 1}.")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{call}: pairs={pairs!r} name a {name} twice; XLA allows each rank once as a {name}.")
    return checked
