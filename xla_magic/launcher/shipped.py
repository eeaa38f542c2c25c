"""The rank's side of shipping: the kernel's values it holds, large ones as shared-memory segments. Runs in a rank.

The kernel ships what a cell reads (xla_magic/cell/shipping.py): plain
values when they changed, the other values as one pickle when it changed,
and large tensors and arrays as segments of shared memory written once.
Here a rank keeps them between cells and loads a fresh copy for each cell.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from xla_magic.wire import transport


class ShippedValues:
    """The kernel values this rank holds, so unchanged ones need not travel again.

    Plain values (numbers, strings, modules) are kept as objects: they cannot
    have been changed in place. Other values are kept as their pickle and
    loaded afresh for every cell, as if they had been shipped again: a cell
    that mutates one does not change what the next cell sees. Large tensors
    and arrays in that pickle are segments the kernel holds for these ranks
    (``held``): the rank opens each one once, while its name exists, and
    keeps the descriptor, so every load maps a fresh copy-on-write view of
    it long after the kernel unlinked the name. A dropped segment's
    descriptor is closed after the reply (:meth:`let_go`): the last close
    frees its pages, about three memcpys of its size, off the cell's path.
    """

    def __init__(self) -> None:
        self.plain: dict[str, Any] = {}
        self.objects_blob: bytes | None = None
        self.segments: dict[str, int] = {}  # held segment -> its open descriptor
        self.unopened: dict[str, str] = {}  # held segment -> why it could not be opened
        self.dropped: list[int] = []  # descriptors of segments the kernel no longer holds, closed after the reply

    def values_for(self, fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(plain values, freshly loaded objects) that this cell reads."""
        self.hold(fields.get("held", ()))
        if fields.get("plain"):
            self.plain.update(transport.load_namespace(fields["plain"])[0])
        plain = {name: self.plain[name] for name in fields.get("plain_names", ())}
        objects: dict[str, Any] = {}
        if fields.get("object_names"):
            if fields.get("objects") is not None:
                self.objects_blob = fields["objects"]
            if self.objects_blob is not None:
                objects = _HeldLoader(self.objects_blob, self).load()
        return plain, objects

    def hold(self, names: tuple[str, ...]) -> None:
        """Keep exactly the segments ``names``: open the new ones, close the dropped ones."""
        kept = set(names)
        for name in [name for name in self.segments if name not in kept]:
            self.dropped.append(self.segments.pop(name))
        self.unopened = {name: why for name, why in self.unopened.items() if name in kept}
        for name in names:
            if name not in self.segments and name not in self.unopened:
                try:
                    self.segments[name] = transport.open_segment(name)
                except (OSError, ValueError) as exc:
                    self.unopened[name] = str(exc)

    def view(self, kind: str, name: str, args: tuple) -> Any:
        """A fresh copy-on-write view of a held segment, as the tensor or array it holds."""
        if name not in self.segments:
            why = self.unopened.get(name, "the kernel did not say to keep it")
            raise RuntimeError(
                f"a large value shipped to this rank is not in its shared memory ({why}); "
                f"%xla_pool restart starts ranks that receive every value again"
            )
        return transport.view_on(transport.map_private_fd(self.segments[name]), kind, args)

    def let_go(self) -> None:
        """Close the dropped segments' descriptors (after the reply: freeing a large one's pages takes a while)."""
        dropped, self.dropped = self.dropped, []
        for fd in dropped:
            os.close(fd)

    def close(self) -> None:
        self.hold(())
        self.let_go()


class _HeldLoader(pickle.Unpickler):
    """Loads the shipped objects, each held segment as a fresh view (see transport.held_segment)."""

    def __init__(self, data: bytes, shipped: ShippedValues) -> None:
        super().__init__(io.BytesIO(data))
        self._view = shipped.view

    def find_class(self, module: str, name: str) -> Any:
        if module == transport.__name__ and name == transport.held_segment.__name__:
            return self._view
        return super().find_class(module, name)
