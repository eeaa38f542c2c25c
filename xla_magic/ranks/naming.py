"""How a rank of a pool across hosts is named: ``hH rN``, N its global rank. Runs in the kernel and in each
host's engine, which tag the same ranks alike."""

from __future__ import annotations

from typing import Any, Mapping

# What restarts a broken pool across hosts.
RESTART = "%xla_pool restart (or %xla_pool stop, then %xla_pool start --hosts ...) starts it anew"


def tag(host: int, rank: int) -> str:
    """Global rank ``rank`` on host ``host``."""
    return f"h{host} r{rank}"


class Numbering:
    """Which global rank each host's local rank is, in the kernel: torch_xla's global ordinal as each host's
    ranks said it when they started (a TPU slice need not number a host's ranks contiguously, nor in the hosts'
    order); until a host's ranks said, ``host * devices + local`` (the simulation's, and where nothing was said).
    """

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.by_host: dict[int, dict[int, int]] = {}  # host -> {local rank: global rank}
        self._places: dict[int, tuple[int, int]] = {}  # global rank -> (host, local rank)

    def learn(self, host: int, ordinals: Mapping[Any, Any] | None) -> None:
        """What host ``host`` said of its ranks' global ordinals, by local rank."""
        if not ordinals:
            return
        self.by_host.setdefault(host, {}).update((int(local), int(rank)) for local, rank in ordinals.items())
        self._places = {rank: (index, local) for index, said in self.by_host.items() for local, rank in said.items()}

    def rank(self, host: int, local: int) -> int:
        return self.by_host.get(host, {}).get(local, host * self.devices + local)

    def place(self, rank: int) -> tuple[int, int]:
        """(host, local rank) of global ``rank``."""
        return self._places.get(rank) or divmod(rank, self.devices)

    def ranks_of(self, host: int) -> list[int]:
        return [self.rank(host, local) for local in range(self.devices)]

    def by_rank(self, calls: list[Any], timeout: float) -> dict[int, dict[str, Any]]:
        """Each host's answers by local rank (an ipyparallel AsyncResult per host, in host order), by global rank;
        a host that does not answer within ``timeout`` is said for each of its ranks."""
        found: dict[int, dict[str, Any]] = {}
        for index, call in enumerate(calls):
            try:
                answers = call.get(timeout)
            except Exception as exc:  # noqa: BLE001 - a lost engine: say so for its ranks, show the others
                answers = {local: {"unanswered": f"host h{index} did not answer ({type(exc).__name__})"}
                           for local in range(self.devices)}
            for local, answer in answers.items():
                found[self.rank(index, local)] = answer
        return found

    def label(self, rank: int) -> str:
        """The tag of global ``rank``: ``hH rN``."""
        return tag(self.place(rank)[0], rank)
