"""The in-cell ``strategy`` object (Lightning XLAStrategy's surface). Runs in ranks.

On the tpu backend the collectives are torch_xla's; in the CPU simulation
they travel over the gloo process group that joins the rank processes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_current = threading.local()


def current() -> "RankStrategy | None":
    """The strategy of the rank running on this thread, if any."""
    return getattr(_current, "strategy", None)


def activate(strategy: "RankStrategy") -> None:
    _current.strategy = strategy


class RankStrategy:
    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        simulated: bool,
        join_group: Callable[[], None] | None = None,
    ) -> None:
        self.global_rank = rank
        self.local_rank = rank
        self.world_size = world_size
        self.root_device = device
        self.simulated = simulated
        self._join_group = join_group

    def _group_ready(self) -> None:
        """Join the simulation's gloo group on the first collective.

        Every rank reaches its first collective, so every rank joins; cells
        that use none never pay for the group.
        """
        import torch.distributed as dist

        if not dist.is_initialized() and self._join_group is not None:
            self._join_group()

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def barrier(self, name: str | None = None) -> None:
        if self.simulated:
            import torch.distributed as dist

            self._group_ready()
            dist.barrier()
        else:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(name or "xla_magic.barrier")

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if self.simulated:
            import torch.distributed as dist

            self._group_ready()
            local = tensor.detach().cpu().contiguous()
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=group)
            return torch.stack(parts).to(tensor.device)
        import torch_xla.core.xla_model as xm

        return xm.all_gather(tensor.unsqueeze(0), dim=0)

    def __repr__(self) -> str:
        return f"<strategy rank {self.global_rank} of {self.world_size} on {self.root_device}>"
