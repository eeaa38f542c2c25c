"""What each host of a pool across hosts holds of the kernel's values. Runs in the kernel.

As :class:`~xla_magic.cell.shipping.Shipping` does for the ranks of one host, a
value a cell reads goes to a host's engine only when it changed since that
host last had it: plain values (numbers, strings, modules) by identity, the
rest by the digest of their own cloudpickle. The engine keeps what it got
(``hosts.on_host``) and hands the cell its values; its own pool then ships
to its ranks only what changed there.
"""

from __future__ import annotations

import hashlib
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from xla_magic.cell import payload
from xla_magic.cell.shipping import _PLAIN_TYPES


@dataclass
class Sending:
    """One request's values: every name the cell reads, and the pickles of those some host lacks."""

    names: tuple[str, ...]
    keys: dict[str, Any]  # name -> what says it is unchanged (the plain value itself, or a digest)
    blobs: dict[str, bytes]  # name -> its cloudpickle, for the names some host lacks
    by_host: list[tuple[str, ...]] = field(default_factory=list)  # the names each host is sent

    def for_host(self, index: int) -> dict[str, bytes]:
        return {name: self.blobs[name] for name in self.by_host[index]}


class HostShipping:
    """By host index: the key of every value that host holds."""

    def __init__(self, hosts: int) -> None:
        self.held: list[dict[str, Any]] = [{} for _ in range(hosts)]
        self.last_sent: list[tuple[str, ...]] = [() for _ in range(hosts)]  # what the last request sent each host

    def prepare(self, values: Mapping[str, Any]) -> Sending:
        """What to send each host for ``values`` (a UsageError names a value that cannot be pickled)."""
        keys: dict[str, Any] = {}
        pickles: dict[str, bytes] = {}
        for name, value in values.items():
            if type(value) in _PLAIN_TYPES or isinstance(value, types.ModuleType):
                keys[name] = ("plain", value)
            else:
                pickles[name] = payload.pickle_namespace({name: value})
                keys[name] = ("digest", hashlib.blake2b(pickles[name], digest_size=16).digest())
        by_host = [tuple(name for name, key in keys.items() if not _same(held.get(name), key))
                   for held in self.held]
        blobs: dict[str, bytes] = {}
        for name in {name for names in by_host for name in names}:
            blobs[name] = pickles[name] if name in pickles else payload.pickle_namespace({name: values[name]})
        return Sending(tuple(values), keys, blobs, by_host)

    def delivered(self, sending: Sending, reached: list[bool]) -> None:
        """The hosts in ``reached`` now hold every value of ``sending``; the others are as they were."""
        for index, got in enumerate(reached):
            self.last_sent[index] = sending.by_host[index] if got else ()
            if got:
                self.held[index].update({name: sending.keys[name] for name in sending.by_host[index]})


def _same(held: Any, key: Any) -> bool:
    if held is None or held[0] != key[0]:
        return False
    return held[1] is key[1] if key[0] == "plain" else held[1] == key[1]
