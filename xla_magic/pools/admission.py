"""What a pool's running ranks admit: a request's options against the pool as it runs. Runs in the kernel (and
in each host's engine).

A pool's ranks were started with a placement (devices, backend, an SPMD
mesh) and a state; a cell, a push or a start that contradicts them is
refused before anything is sent, with the way to get what it asks for
(leave the option out, ``--fresh``, ``%xla_pool restart``). Only a pool
admits: a one-shot cell's ranks are made for it.
"""

from __future__ import annotations

from IPython.core.error import UsageError

from xla_magic.cell import sharding
from xla_magic.ranks.policy import RESTART_HINT
from xla_magic.ranks.ranks import Ranks


def check_usable(ranks: Ranks) -> None:
    """A broken pool takes no request, and says what to do."""
    if ranks.state == "broken":
        raise UsageError(
            f"the pool is broken ({ranks.problem}). {RESTART_HINT}; %xla_pool stop goes back "
            f"to one-shot ranks; --fresh runs this cell in newly spawned ranks."
        )


def check_fits(ranks: Ranks, devices: int | None, backend: str, spmd: sharding.SpmdOptions | None = None) -> None:
    """A cell's --devices / --backend (and --spmd, --mesh, --axes) must agree with the running pool.

    A cell without --spmd runs in an SPMD pool too: the pool says how it runs.
    """
    if ranks.one_value:
        _check_spmd_fits(ranks, devices, backend, spmd)
        return
    if spmd is not None:
        raise UsageError(
            f"a pool of {ranks.devices} ranks (one process per device) is running, so an --spmd cell cannot "
            f"run in it. Use %xla_pool restart --spmd to make it an SPMD pool, %xla_pool stop first, or "
            f"add --fresh to run this cell in a new SPMD process."
        )
    if devices is not None and devices != ranks.devices:
        raise UsageError(
            f"a pool of {ranks.devices} ranks is running, so --devices {devices} contradicts it. "
            f"Leave --devices out to run in the pool, add --fresh to run in {devices} newly "
            f"spawned ranks, or use %xla_pool restart --devices {devices} to replace the pool."
        )
    if backend != "auto" and backend != ranks.backend:
        raise UsageError(
            f"the running pool uses the {ranks.backend} backend, so --backend {backend} contradicts "
            f"it. Leave --backend out, add --fresh, or use %xla_pool restart --backend {backend}."
        )


def _check_spmd_fits(ranks: Ranks, devices: int | None, backend: str, spmd: sharding.SpmdOptions | None) -> None:
    where = f"an SPMD pool (one process, {ranks.devices} devices, mesh {ranks.placement.describe_mesh()})"
    if devices is not None and devices != ranks.devices:
        raise UsageError(
            f"{where} is running, so --devices {devices} contradicts it. Leave --devices out to run in "
            f"the pool, add --fresh to run in newly spawned ranks, or use %xla_pool restart --spmd "
            f"--devices {devices} to replace the pool."
        )
    if backend != "auto" and backend != ranks.backend:
        raise UsageError(
            f"{where} on the {ranks.backend} backend is running, so --backend {backend} contradicts it. "
            f"Leave --backend out, add --fresh, or use %xla_pool restart --spmd --backend {backend}."
        )
    if spmd is not None and (spmd.mesh is not None or spmd.axes is not None):
        shape, names = sharding.mesh_layout(spmd.mesh, spmd.axes, ranks.devices)
        if (shape, names) != (ranks.placement.mesh, ranks.placement.axes):
            asked = " × ".join(f"{name}={size}" for name, size in zip(names, shape))
            raise UsageError(
                f"{where} is running, and this cell asks for the mesh {asked}. Leave --mesh and --axes "
                f"out to run in the pool's mesh, or use %xla_pool restart --spmd {spmd.options()} "
                f"to replace the pool."
            )


def check_fresh_allowed(ranks: Ranks) -> None:
    """On a TPU host the pool's ranks hold the chips, so fresh ranks could not open them."""
    if ranks.backend == "tpu" and not ranks.cpu_threads and ranks.state != "broken":
        raise UsageError(
            "the pool's ranks hold this host's TPU chips, so --fresh ranks could not use them. "
            "Run the cell in the pool (leave --fresh out), or %xla_pool stop first."
        )
