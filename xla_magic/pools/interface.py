"""What every pool answers, on one host or across several. Runs in the kernel (and in each host's engine).

A pool on one host (:class:`~xla_magic.pools.this_host.LocalPool`: ranks kept
between cells) and a pool across hosts
(:class:`~xla_magic.hosts.pool.HostsPool`: one engine per host, each
running a local pool) are two kinds of one thing. The session holds one
:class:`Pool` and never asks which kind it is; what a cell or a start asks
for travels as a :class:`Cell` or :class:`PoolOptions`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from IPython.core.error import UsageError

from xla_magic.cell.options import Cell, PoolOptions


class Pool(Protocol):
    """Ranks kept between cells: on one host, or on every host of a world."""

    state: str  # starting, ready, running, broken, stopped
    problem: str | None  # why it is broken

    @property
    def pids(self) -> dict[int, int]:
        """Each rank's process id, by (global) rank: what the pool knows now."""

    @property
    def world_size(self) -> int:
        """How many ranks answer each cell."""

    @property
    def one_value(self) -> bool:
        """Whether a cell's value is one value (an SPMD pool), not a list by rank."""

    @property
    def start_seconds(self) -> float:
        """How long the pool took to start."""

    def check_start(self, options: PoolOptions) -> None:
        """``%xla_pool start`` while this pool runs: nothing if this pool is what it asks for, else the UsageError."""

    def run_cell(self, cell: Cell) -> Any:
        """The cell in the pool's ranks (or, ``cell.fresh``, in new ranks where the pool runs): its value."""

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> None:
        """The kernel's values of ``names`` into every rank's namespace."""

    def pull(self, name: str, rank: int | None) -> Any:
        """Every rank's value of ``name`` (a list by rank, or one value), or rank ``rank``'s."""

    def facts(self) -> list[tuple[str, str]]:
        """(label, text) lines for %xla_status: the pool, then (across hosts) each host."""

    def cache_fact(self) -> str:
        """%xla_status's Cache line: where the pool's ranks keep torch_xla's compilation cache, how big, how to
        clear it (across hosts: each host's)."""

    def restart(self, options: PoolOptions) -> Pool:
        """Fresh ranks like these, with ``options`` changed; this pool is stopped (unless the options are bad)."""

    def stop(self) -> None:
        """End every rank, and whatever they started; nothing is left."""

    def leave(self) -> None:
        """The kernel's session closes: end the pool, unless it is kept (then only let go of it)."""

    def describe(self) -> str:
        """One line: kind, size, state."""

    def label(self, rank: int) -> str:
        """How output and errors name (global) rank ``rank``: ``rank 3``, ``spmd``, ``h1 r3``."""

    def where_now(self, everything: bool = False, with_locals: bool = False) -> dict[int, dict[str, Any]]:
        """Where every rank is now, by (global) rank, threads a cell left running included (``%xla_stacks``);
        ``with_locals``: each cell frame's names too."""


def check_rank(rank: int | None, size: int, where: str) -> None:
    """``--rank`` must name one of the pool's ``size`` ranks."""
    if rank is not None and not 0 <= rank < size:
        raise UsageError(f"--rank must be between 0 and {size - 1} ({where} has {size} ranks)")


def check_names(names: list[str], user_ns: Mapping[str, Any]) -> None:
    """UsageError unless every name to push is a notebook variable."""
    missing = [name for name in names if name not in user_ns]
    if missing:
        raise UsageError(f"no notebook variable named {', '.join(missing)} to push")
