"""What a request carries to the ranks, and what they already hold. Runs in the kernel.

Every set of ranks (ranks.py), one-shot or a pool, ships the kernel values
a cell reads through one :class:`Shipping`: plain values by identity, the
rest as one cloudpickle sent again only when it changed, and large tensors
and arrays through shared memory once (:class:`HeldValues`), kept by the
ranks while the kernel's value is the same object with the same bytes. A
one-shot set ships everything once; a pool's ships only what changed.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import types
import weakref
from typing import Any, Mapping

import cloudpickle

from xla_magic.cell import payload
from xla_magic.wire import transport

_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)


class HeldValues:
    """Large kernel tensors and arrays that the pool's ranks keep in shared memory.

    Each is written once into a segment. The kernel keeps a mapping of it (to
    compare against) and every rank keeps a descriptor of it (to map a fresh
    copy-on-write view for every cell), so the segment's name is needed only
    while the cell that first ships it runs: :meth:`settle` unlinks it then.

    The rule for "unchanged", checked at every cell that reads the value: the
    same kernel object, with the same bytes as its segment. The bytes are
    compared with memcmp at memory speed (about 0.05 s per GiB, where hashing
    takes 0.8 s), which is exact whatever wrote to the value: in-place ops,
    ``.data``, numpy views (torch's version counter misses the last two). A
    non-contiguous tensor or array is copied to contiguous for the comparison.
    A changed value gets a new segment. A segment is dropped when its kernel
    object dies, when its value changes, and when the pool stops or breaks.
    """

    def __init__(self) -> None:
        self.segments = transport.RunSegments()
        self._held: dict[int, _Held] = {}  # id of the kernel object -> its segment
        self._new: list[int] = []  # ids whose segment this request wrote

    def reduce(self, obj: Any) -> tuple | None:
        """A stand-in for ``obj`` naming its segment when it is large, else None."""
        large = transport.large_value(obj)
        if large is None:
            return None
        held = self._held.get(id(obj))
        if held is None or held.kernel_value() is not obj or not held.has_bytes_of(large):
            held = self._write(obj, large)
            if held is None:
                return None  # no room in /dev/shm: it goes in the pickle
        return transport.held_segment, (large.kind, held.name, large.args)

    def _write(self, obj: Any, large: transport.LargeValue) -> _Held | None:
        self._drop(id(obj))
        name = self.segments.writer.write(large.data)
        if name is None:
            return None
        key = id(obj)
        held = _Held(name, transport.HeldMapping(name), weakref.ref(obj, lambda ref: self._forget(key, ref)))
        self._held[key] = held
        self._new.append(key)
        return held

    def names(self) -> tuple[str, ...]:
        """The segments the ranks must keep open; they close any other."""
        return tuple(held.name for held in list(self._held.values()))  # a GC may drop one meanwhile

    def settle(self, delivered: bool) -> None:
        """After a request: unlink the new names (every rank opened them, or none ever will).

        Undelivered, the new segments are forgotten too, so the next cell writes them again.
        """
        new, self._new = self._new, []
        try:
            self.segments.sweep()
        finally:
            if not delivered:
                for key in new:
                    self._drop(key)

    def release(self) -> None:
        """Drop every segment: the pool's ranks are gone."""
        self._held.clear()
        self._new = []
        self.segments.sweep()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """The kernel object died: its segment goes (the ranks close theirs at the next cell)."""
        held = self._held.get(key)
        if held is not None and held.kernel_value is ref:
            del self._held[key]

    def _drop(self, key: int) -> None:
        self._held.pop(key, None)


class _Held:
    """One held segment, as the kernel sees it: its name, its bytes, whose they are."""

    def __init__(self, name: str, mapping: transport.HeldMapping, kernel_value: weakref.ref) -> None:
        self.name = name
        self.mapping = mapping
        self.kernel_value = kernel_value

    def has_bytes_of(self, large: transport.LargeValue) -> bool:
        return self.mapping.same_bytes(large)


class _HeldPickler(cloudpickle.Pickler):
    """cloudpickle that puts large tensors and arrays in the pool's held segments."""

    def __init__(self, file: io.BytesIO, held: HeldValues) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.held = held

    def reducer_override(self, obj: Any) -> Any:
        reduced = self.held.reduce(obj)
        return reduced if reduced is not None else super().reducer_override(obj)


class Shipping:
    """The kernel values the ranks hold, so that only changed ones travel.

    Plain values (numbers, strings, modules) are compared by identity: the
    same object cannot have changed. The others are pickled together, with
    large tensors and arrays as references to :class:`HeldValues` segments,
    and the pickle is sent only when it differs from the last one sent; the
    ranks load their copy afresh for every cell, large values included (as
    new copy-on-write views), so a cell's in-place change never reaches the
    next cell.
    """

    def __init__(self) -> None:
        self.plain: dict[str, Any] = {}
        self.held = HeldValues()
        self.objects_sent: tuple[tuple[str, ...], bytes] | None = None  # (names, digest)
        self._objects_going: tuple[tuple[str, ...], bytes] | None = None

    def fields(self, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The CELL message's shipping fields, and the plain values they send.

        Call :meth:`settle` afterwards, however the request goes.
        """
        plain_names: list[str] = []
        changed: dict[str, Any] = {}
        objects: dict[str, Any] = {}
        for name, value in values.items():
            if type(value) in _PLAIN_TYPES or isinstance(value, types.ModuleType):
                plain_names.append(name)
                if name not in self.plain or self.plain[name] is not value:
                    changed[name] = value
            else:
                objects[name] = value
        blob = None
        if objects:
            pickled = self._pickle_objects(objects)
            key = (tuple(objects), hashlib.blake2b(pickled, digest_size=16).digest())
            if key != self.objects_sent:
                blob = pickled
            self._objects_going = key
        fields = {
            "plain_names": tuple(plain_names),
            "plain": payload.pickle_namespace(changed) if changed else None,
            "object_names": tuple(objects),
            "objects": blob,
            "held": self.held.names(),
        }
        return fields, changed

    def _pickle_objects(self, objects: dict[str, Any]) -> bytes:
        buffer = io.BytesIO()
        try:
            _HeldPickler(buffer, self.held).dump(objects)
        except Exception:
            payload.pickle_namespace(objects)  # raises the UsageError that names the culprit
            raise
        return buffer.getvalue()

    def sent(self, changed: dict[str, Any], fields: dict[str, Any]) -> None:
        """Remember what every rank now holds (call once the request went out)."""
        self.plain.update(changed)
        if fields["object_names"]:
            self.objects_sent = self._objects_going

    def settle(self, delivered: bool) -> None:
        """After the request, however it went: see :meth:`HeldValues.settle`."""
        self.held.settle(delivered)
