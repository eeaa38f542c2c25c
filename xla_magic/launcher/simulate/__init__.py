"""Run torch_xla's multiprocess calls across the cpu backend's ranks. Runs in a rank.

In the cpu backend each rank is a process with one XLA CPU device, and
torch_xla on CPU cannot run a collective across processes. ``install``
replaces the torch_xla calls that multiprocess TPU code makes, so that they
behave as on a single-host TPU slice with one chip per process (v4 and
later): values leave the device, travel between the ranks over a private
gloo group on loopback, are combined on the CPU in rank order (so every rank
gets bit-identical results) and come back as XLA tensors.

Replaced: the ordinals of ``torch_xla.runtime``; ``xm.all_reduce``,
``all_gather``, ``reduce_scatter``, ``all_to_all``, ``collective_permute``,
``send``, ``recv``, ``rendezvous`` (``collectives``); the XLA kernels of
torch's functional collectives, what dynamo turns ``dist.*`` calls into,
the store behind ``init_method="xla://"`` and the metric counters' read side
(``traced``, ``exchange``); ``xm.get_memory_info``, from a count of the
device's memory against a limit (``memory``). Everything built on these runs unchanged:
``xm.optimizer_step``, the bucketized collectives, ``mesh_reduce``,
``collective_broadcast``, ``torch_xla.core.functions``, and the "xla"
process group of ``torch.distributed`` with DDP over it.

Only the cpu backend installs this, in each rank before the cell runs; the
tpu backend replaces nothing. What a TPU refuses (shapes that differ between
ranks, replica groups that do not name every rank once, a dimension the
shard count does not divide, ranks that call different collectives) is
refused here with a message, on every rank at once, where a TPU would fail
to compile or hang.
"""

from __future__ import annotations

from typing import Any, Callable

import torch._dynamo
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr

from xla_magic.launcher.simulate import collectives, exchange, memory, traced
from xla_magic.launcher.simulate.exchange import closing_across_hosts, leave

__all__ = ["closing_across_hosts", "install", "leave"]

COLLECTIVES = (
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "send",
    "recv",
    "rendezvous",
    "xla_rendezvous",
)


def install(rank: int, world_size: int, store_dir: str, world: dict[str, Any] | None = None) -> None:
    """Route torch_xla's collectives and ordinals through the simulation.

    The ranks of a run meet through files in ``store_dir`` (the kernel's
    directory for the run). Their values travel over a gloo group of their
    own, made on the first collective (a cell that makes none never pays
    for it) and never registered with torch.distributed: the default group
    stays the user's, and ``dist.is_initialized()`` is False until user
    code makes one, as on a TPU.
    """
    exchange.activate(rank, world_size, store_dir, world)
    for module, name, replacement in _replacements():
        setattr(module, name, replacement)
    traced.install()
    memory.install()


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
    ]
    for name in COLLECTIVES:
        table.append((xm, name, _not_compiled(getattr(collectives, name))))
    # These two trace their plain case as torch's functional all_reduce, as torch_xla does.
    collectives.eager_all_reduce = _not_compiled(collectives.eager_all_reduce, "all_reduce")
    collectives.eager_all_gather = _not_compiled(collectives.eager_all_gather, "all_gather")
    table += [(xm, "all_reduce", collectives.all_reduce), (xm, "all_gather", collectives.all_gather)]
    # Older torch_xla releases still carry the XRT-era names.
    for name, replacement in (("xrt_world_size", world_size), ("get_ordinal", global_ordinal)):
        if hasattr(xm, name):
            table.append((xm, name, replacement))
    table.extend((met, name, function) for name, function in exchange.METRICS_REPLACEMENTS.items())
    return table


def _not_compiled(function: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """Under torch.compile, run ``function`` eagerly (a graph break); with
    fullgraph=True dynamo refuses, naming this reason."""
    if getattr(function, "_torchdynamo_disable", False):
        return function
    reason = (
        f"xm.{name or function.__name__} (this form of it) is simulated on CPU by xla_magic and runs outside compiled graphs; "
        f"call it outside the compiled function, drop fullgraph=True, or use torch.distributed's "
        f"collectives on the 'xla' process group, which compile"
    )
    return torch._dynamo.disable(function, reason=reason)


# --- torch_xla.runtime: the slice's shape ------------------------------------


def world_size() -> int:
    """xr.world_size: every chip of the slice takes part, one process each."""
    return exchange.sim().world_size


def global_ordinal() -> int:
    """xr.global_ordinal: this process's chip, 0 to world_size - 1."""
    return exchange.sim().rank


def local_ordinal() -> int:
    """xr.local_ordinal: the chip on its host (on a single-host slice, the global ordinal)."""
    return exchange.sim().local_rank


def local_process_count() -> int:
    """xr.local_process_count: one process per chip on the host."""
    return exchange.sim().local_size


def addressable_device_count() -> int:
    """xr.addressable_device_count: a process sees only its own chip."""
    return 1


def global_device_count() -> int:
    """xr.global_device_count: all the chips of the slice."""
    return exchange.sim().world_size


def process_index() -> int:
    """xr.process_index: one process per chip, so the chip's ordinal."""
    return exchange.sim().rank


def process_count() -> int:
    """xr.process_count: one process per chip."""
    return exchange.sim().world_size
