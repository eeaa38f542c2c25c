"""The in-cell ``strategy`` object (Lightning XLAStrategy's surface). Runs in a rank.

Every method is written against torch_xla, as on a TPU. In the CPU
simulation the torch_xla calls it makes are routed between the rank
processes by ``simulate``, so the same code serves both backends.

Also here: the closing rendezvous that ranks leave a cell through.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import shutil
import threading
from datetime import timedelta
from typing import Any, Callable

import cloudpickle
import torch

from xla_magic.launcher import current as this_thread, frameworks

# How long a rank that finished waits at the closing rendezvous for the
# slowest one; a failing rank ends the run long before (the kernel stops it).
CLOSING_PATIENCE = timedelta(days=1)


def current() -> "RankStrategy | None":
    """The strategy of the rank running on this thread, if any."""
    return this_thread.strategy()


def activate(strategy: "RankStrategy") -> None:
    """Make ``strategy`` this thread's rank, for the in-cell names and for frameworks."""
    this_thread.set_strategy(strategy)
    frameworks.install(strategy.global_rank, strategy.world_size)


class RankStrategy:
    """One rank's view of the run, with Lightning XLAStrategy's names."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        simulated: bool,
        local_rank: int | None = None,
    ) -> None:
        self.global_rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.world_size = world_size
        self.root_device = device
        self.simulated = simulated

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank gets here."""
        import torch_xla.core.xla_model as xm

        xm.rendezvous(name or "")

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked: shape ``(world_size, *tensor.shape)``.

        Shapes must match on every rank. With ``sync_grads=True`` the result
        is differentiable: each rank's gradient flows back to its own slice,
        as ``torch_xla.core.functions.all_gather`` does.
        """
        import torch_xla.core.functions as xf
        import torch_xla.core.xla_model as xm

        _refuse_group("all_gather", group)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"strategy.all_gather gathers tensors, not {type(tensor).__name__}.")
        value = self._on_device(tensor).unsqueeze(0)
        gathered = xf.all_gather(value) if sync_grads else xm.all_gather(value)
        return gathered.to(tensor.device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` combined over all ranks; anything else comes back as is.

        ``reduce_op``: "mean"/"avg", "sum", "max", "min", "product", or the
        ``torch.distributed.ReduceOp`` of one of them. A mean is a float.
        """
        import torch_xla.core.xla_model as xm

        _refuse_group("reduce", group)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        reduce_type, average = _reduce_type(reduce_op)
        reduced = xm.all_reduce(reduce_type, self._on_device(tensor))
        if average:
            reduced = reduced / self.world_size
        return reduced.to(tensor.device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank; XLA tensors land on each rank's device."""
        import torch_xla.core.xla_model as xm

        if not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"strategy.broadcast: src must be a rank from 0 to {self.world_size - 1}, not {src!r}.")
        payload = _pack(obj) if self.global_rank == src else b""
        # Every rank meets even when src could not pickle obj, so all of them raise.
        sent = xm.rendezvous("xla_magic.broadcast", payload)[src]
        return _unpack(sent, src, obj if self.global_rank == src else None)

    def process_dataloader(self, dataloader: Any) -> Any:
        """An ``MpDeviceLoader`` that feeds batches to this rank's device."""
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        if isinstance(dataloader, MpDeviceLoader):
            return dataloader
        loader = MpDeviceLoader(dataloader, self.root_device)
        # Look like the DataLoader it wraps, as Lightning's does.
        loader.dataset = getattr(dataloader, "dataset", None)
        loader.batch_sampler = getattr(dataloader, "batch_sampler", None)
        return loader

    def save_checkpoint(self, checkpoint: Any, filepath: str | os.PathLike, storage_options: Any = None) -> None:
        """Rank 0 writes ``checkpoint`` to ``filepath``, with every tensor on the CPU.

        Call it on every rank (the others compute what rank 0 writes, as with
        ``xm.save``); ``strategy.barrier()`` afterwards before another rank
        reads the file. Modules and optimizers in a dict are saved as their
        ``state_dict()``.
        """
        import torch_xla.core.xla_model as xm

        if storage_options is not None:
            raise TypeError(
                "strategy.save_checkpoint does not take storage_options (as Lightning's XLACheckpointIO); "
                "leave it out and write to a local or mounted path."
            )
        state = _plain_tensors(_state_dicts(checkpoint))
        if self.is_global_zero:
            os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
        xm.save(state, filepath, global_master=True)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Rank 0 removes ``filepath`` (a file or a folder), if it exists."""
        if not self.is_global_zero:
            return
        if os.path.isdir(filepath):
            shutil.rmtree(filepath)
        elif os.path.lexists(filepath):
            os.remove(filepath)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device.type == "xla" else tensor.to(self.root_device)

    def __repr__(self) -> str:
        return f"<strategy rank {self.global_rank} of {self.world_size} on {self.root_device}>"


# --- arguments ----------------------------------------------------------------


def _refuse_group(method: str, group: Any) -> None:
    if group is not None:
        raise ValueError(
            f"strategy.{method} always spans every rank: XLA has no process groups to pass here "
            f"(Lightning's XLAStrategy ignores group). Leave group out."
        )


def _reduce_type(reduce_op: Any) -> tuple[str, bool]:
    """xm's reduce type for ``reduce_op``, and whether to divide by world size."""
    import torch.distributed as dist
    import torch_xla.core.xla_model as xm

    by_name = {
        "sum": (xm.REDUCE_SUM, False),
        "mean": (xm.REDUCE_SUM, True),
        "avg": (xm.REDUCE_SUM, True),
        "max": (xm.REDUCE_MAX, False),
        "min": (xm.REDUCE_MIN, False),
        "product": (xm.REDUCE_MUL, False),
    }
    if reduce_op is None:
        return by_name["sum"]
    if isinstance(reduce_op, str) and reduce_op.lower() in by_name:
        return by_name[reduce_op.lower()]
    if isinstance(reduce_op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        for name in ("sum", "avg", "max", "min", "product"):
            if reduce_op == getattr(dist.ReduceOp, name.upper()):
                return by_name[name]
    raise ValueError(
        f"strategy.reduce: reduce_op must be 'mean', 'avg', 'sum', 'max', 'min', 'product' or the "
        f"torch.distributed.ReduceOp of one of them, not {reduce_op!r}."
    )


# --- broadcast's payload ------------------------------------------------------


class _DevicePickler(cloudpickle.Pickler):
    """cloudpickle that sends XLA tensors as CPU copies bound for the receiver's device."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "xla":
            return _onto_root_device, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _onto_root_device(tensor: torch.Tensor) -> torch.Tensor:
    strategy = current()
    return tensor if strategy is None else tensor.to(strategy.root_device)


def _pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _DevicePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        return b"E" + f"{type(obj).__module__}.{type(obj).__qualname__} cannot be pickled: {exc}".encode()
    return b"P" + buffer.getvalue()


def _unpack(payload: bytes, src: int, own: Any) -> Any:
    if payload[:1] == b"E":
        raise TypeError(f"strategy.broadcast: rank {src}'s object could not be sent: {payload[1:].decode()}")
    if own is not None:
        return own
    return pickle.loads(payload[1:])


# --- checkpoints --------------------------------------------------------------


def _state_dicts(checkpoint: Any) -> Any:
    if not isinstance(checkpoint, dict):
        return checkpoint
    stateful = (torch.nn.Module, torch.optim.Optimizer)
    return {key: value.state_dict() if isinstance(value, stateful) else value for key, value in checkpoint.items()}


def _plain_tensors(data: Any) -> Any:
    """Parameters as plain tensors, so that ``xm.save`` moves them to the CPU too."""
    if isinstance(data, torch.Tensor) and type(data) is not torch.Tensor:
        return data.detach()
    if isinstance(data, dict):
        converted = copy.copy(data)  # keeps the type and a state_dict's _metadata
        for key, value in data.items():
            converted[key] = _plain_tensors(value)
        return converted
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_plain_tensors(value) for value in data)
    return data


# --- the closing rendezvous -----------------------------------------------------


def closing_on_store(path: str, run_id: int, world_size: int) -> Callable[[], None]:
    """cpu backend: ranks leave through a barrier on a FileStore of the run.

    A file, not gloo: a cell that made no collective call never pays for
    starting the gloo group just to leave.
    """

    def closing() -> None:
        if world_size == 1:
            return
        import torch.distributed as dist

        store = dist.FileStore(path, -1)
        store.set_timeout(CLOSING_PATIENCE)
        arrived, everyone_in = f"closing/{run_id}/arrived", f"closing/{run_id}/open"
        if store.add(arrived, 1) == world_size:
            store.set(everyone_in, b"1")
        store.wait([everyone_in])

    return closing


_thread_barriers: dict[int, threading.Barrier] = {}
_thread_barriers_lock = threading.Lock()


def closing_on_xla(run_id: int) -> Callable[[], None]:
    """tpu backend: ranks leave through ``xm.rendezvous``.

    On the tpu launch path run as CPU threads (PJRT_DEVICE=CPU), XLA's
    collectives across threads fail at XLA's own rendezvous, so there the
    ranks, all threads of one process, meet at a thread barrier instead.
    """

    def closing() -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        world_size = xr.world_size()
        if world_size == 1:
            return
        if xr.device_type() == "CPU":
            _thread_barrier(run_id, world_size).wait()
            # Every thread took the barrier before any was let through.
            _thread_barriers.pop(run_id, None)
        else:
            xm.rendezvous("xla_magic.closing")

    return closing


def _thread_barrier(run_id: int, parties: int) -> threading.Barrier:
    with _thread_barriers_lock:
        return _thread_barriers.setdefault(run_id, threading.Barrier(parties))
