"""Large tensors and arrays through shared memory, once for every rank. Runs on both sides.

Runs in the kernel and in the ranks. Like protocol.py it imports nothing of
IPython, of the kernel side or of torch_xla; torch and numpy are looked up in
``sys.modules`` only when one of their values is met, so the kernel stays light.

Kernel -> ranks: while the cell's namespace is pickled, every CPU tensor or
ndarray of at least ``THRESHOLD`` bytes is written once into a file under
/dev/shm and pickled as a small reference. Each rank maps that file
copy-on-write (MAP_PRIVATE): pages stay shared until a rank writes one, and
the write stays private to that rank. Smaller values stay in the pickle.

Ranks -> kernel: large results are written the same way; the kernel maps the
file, unlinks it at once, and so owns the memory outright.

Ranks (shipping.py, launcher/shipped.py) keep what a cell read for the
next cells: the pickle names each segment through :func:`held_segment`, every
rank keeps a descriptor of it, and each cell maps a fresh copy-on-write view.

Every file is named ``xla_magic-<pid namespace>-<kernel pid>-<run token>-<tag>``.
The kernel sweeps a run's prefix when the run ends, however it ends, and
sweeps the files of kernels that died.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import math
import mmap
import os
import pickle
import re
import secrets
import sys
import tempfile
import weakref
from typing import Any, BinaryIO, NamedTuple

import cloudpickle

from xla_magic.wire import result_memory

NAME_PREFIX = "xla_magic-"
# The namespace dict carries its run's prefix under this key, so a rank knows
# where to write its results; the rank removes it before running the cell.
NAMESPACE_KEY = "__xla_magic_segments__"
_NAME = re.compile(r"^xla_magic-(\d+)-(\d+)-([0-9a-f]{8})-([a-z0-9]+)$")
_PREFIX = re.compile(r"^xla_magic-\d+-\d+-[0-9a-f]{8}$")
_WRITE_CHUNK = 1 << 28  # a single write(2) moves at most ~2 GiB on Linux
LENT = "@"  # a result written over a segment the kernel lent: "@" and the segment's number
_OPEN_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Values smaller than this stay in the pickle (docs/environment.md gives the default, checked against this).
DEFAULT_THRESHOLD = 1_048_576  # 1 MiB
THRESHOLD = int(os.environ.get("XLA_MAGIC_SHM_THRESHOLD", "") or DEFAULT_THRESHOLD)


def shm_dir() -> str:
    """Where segments live: /dev/shm (memory), else the temp directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


SHM_DIR = shm_dir()


def _pid_namespace() -> str:
    """Tells apart kernels of containers that share one /dev/shm."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def kernel_prefix(pid: int | None = None) -> str:
    """The start of the name of every segment that kernel ``pid`` owns."""
    return f"{NAME_PREFIX}{_pid_namespace()}-{os.getpid() if pid is None else pid}-"


def segment_names(prefix: str = NAME_PREFIX) -> list[str]:
    """The segments present now whose names start with ``prefix``."""
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix) and _NAME.match(name))
    except OSError:
        return []


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except (FileNotFoundError, PermissionError):
        pass


def sweep(prefix: str) -> None:
    """Remove every segment of one run (a prefix from :class:`RunSegments`)."""
    for name in segment_names(prefix + "-"):
        _unlink(name)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans() -> None:
    """Remove the segments of kernels of this pid namespace that have died."""
    namespace = _pid_namespace()
    for name in segment_names():
        match = _NAME.match(name)
        if match and match.group(1) == namespace and not process_alive(int(match.group(2))):
            _unlink(name)


# --- writing a segment ------------------------------------------------------


class SegmentWriter:
    """Creates segments under one run's prefix; each one readable by its owner only."""

    def __init__(self, prefix: str, tag: str) -> None:
        if not _PREFIX.match(prefix) or not re.fullmatch(r"[a-z][a-z0-9]*", tag):
            raise ValueError(f"not a segment prefix and tag: {prefix!r}, {tag!r}")
        self.prefix = prefix
        self.tag = tag
        self._numbers = itertools.count()
        self.lent: dict[int, int] = {}  # a rank's: segments the kernel lent for this request, number -> descriptor

    def write(self, data: memoryview) -> str | None:
        """Copy ``data`` into a lent segment or a new one: its name, or None when there is no room."""
        reused = self._write_lent(data)
        if reused is not None:
            return reused
        name = f"{self.prefix}-{self.tag}n{next(self._numbers)}"
        try:
            fd = os.open(os.path.join(SHM_DIR, name), _OPEN_NEW, 0o600)
        except OSError:
            return None  # no inode left, or no /dev/shm for us: stay in the pickle
        written = False
        try:
            # write(2), never stores through a mapping: a full tmpfs fails
            # here with ENOSPC instead of killing us with SIGBUS.
            _write_all(fd, data)
            written = True
        except OSError:
            return None  # /dev/shm is full (or small, as in Docker): stay in the pickle
        finally:
            os.close(fd)
            if not written:
                _unlink(name)
        return name


    def _write_lent(self, data: memoryview) -> str | None:
        """Over the pages of a segment the kernel lent (result_memory.py): the closest in size, cut or grown to fit."""
        if not self.lent:
            return None
        sizes = {number: os.fstat(fd).st_size for number, fd in self.lent.items()}
        number = min(sizes, key=lambda n: (sizes[n] < len(data), abs(sizes[n] - len(data))))
        fd = self.lent.pop(number)
        try:
            if sizes[number] > len(data):
                os.ftruncate(fd, len(data))  # the pages past the end go back
            _write_all(fd, data)  # a full tmpfs fails here with ENOSPC, as a new segment would
        except OSError:
            return None  # the kernel takes the segment back when the request ends
        finally:
            os.close(fd)
        return f"{LENT}{number}"

    def release(self) -> None:
        """Close every lent descriptor not written: a rank does so before it answers."""
        lent, self.lent = self.lent, {}
        for fd in lent.values():
            os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, data[offset : offset + _WRITE_CHUNK], offset)


def _open_segment(name: str, writable_file: bool) -> tuple[int, int]:
    if not _NAME.match(name):
        raise ValueError(f"not an xla_magic segment name: {name!r}")
    flags = (os.O_RDWR if writable_file else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.path.join(SHM_DIR, name), flags)
    return fd, os.fstat(fd).st_size


def open_segment(name: str) -> int:
    """A read-only descriptor of a shipped segment; the memory outlives the name with it."""
    return _open_segment(name, writable_file=False)[0]


def map_private_fd(fd: int) -> mmap.mmap:
    """A copy-on-write view of an open segment: a write stays in this view."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def map_private(name: str) -> mmap.mmap:
    """A rank's copy-on-write view of a shipped segment."""
    fd = open_segment(name)
    try:
        return map_private_fd(fd)
    finally:
        os.close(fd)


def adopt(name: str) -> mmap.mmap:
    """The kernel's take on a result segment: mapped, then unlinked, so only we hold it.

    The descriptor stays with result_memory, which lends the segment for
    another result once this mapping is gone; ``@N`` names a lent one.
    """
    if name.startswith(LENT):
        return result_memory.MEMORY.map(*result_memory.MEMORY.claim(int(name[len(LENT):])))
    match = _NAME.match(name)
    if not match or match.group(1) != _pid_namespace() or int(match.group(2)) != os.getpid():
        raise ValueError(f"result segment {name!r} does not belong to this kernel")
    fd, _size = _open_segment(name, writable_file=True)
    _unlink(name)
    writer = re.fullmatch(r"r(\d+)n\d+", match.group(4))
    return result_memory.MEMORY.map(fd, int(writer.group(1)) if writer else None)


_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class HeldMapping:
    """The kernel's read-only look at a segment it wrote, to tell whether a value still has its bytes.

    Compared with memcmp at memory speed (about 0.05 s per GiB, where
    hashing takes 0.8 s), which is exact whatever wrote to the value.
    """

    def __init__(self, name: str) -> None:
        mapping = map_private(name)
        self.size = len(mapping)
        self._start = ctypes.c_char.from_buffer(mapping)  # holds the mapping open as long as we do

    def same_bytes(self, large: "LargeValue") -> bool:
        return len(large.data) == self.size and _memcmp(ctypes.addressof(self._start), large.address, self.size) == 0


# --- which values travel this way ---------------------------------------------


def _large_tensor(obj: Any, threshold: int) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.has_names()
        and (obj.is_leaf or not obj.requires_grad)
        and obj.numel() * obj.element_size() >= threshold
    )


def _large_array(obj: Any, threshold: int) -> bool:
    numpy = sys.modules.get("numpy")
    return (
        numpy is not None
        and type(obj) is numpy.ndarray
        and not obj.dtype.hasobject
        and obj.nbytes >= threshold
    )


TENSOR, ARRAY = "tensor", "array"


class LargeValue(NamedTuple):
    """A large tensor or array as it goes into a segment."""

    kind: str  # TENSOR or ARRAY
    args: tuple  # what rebuilds it besides its bytes (see view_on)
    data: memoryview  # its bytes, contiguous
    address: int  # where ``data`` starts
    owner: Any  # keeps ``data`` alive: the value itself, or its contiguous copy


def large_value(obj: Any, threshold: int = THRESHOLD) -> LargeValue | None:
    """``obj`` as a LargeValue when it is a large CPU tensor or array, else None."""
    if _large_tensor(obj, threshold):
        plain, data = _tensor_bytes(obj)
        dtype = str(plain.dtype).removeprefix("torch.")
        parameter = type(obj) is not sys.modules["torch"].Tensor
        args = (dtype, tuple(plain.shape), obj.requires_grad, parameter)
        return LargeValue(TENSOR, args, data, plain.data_ptr(), plain)
    if _large_array(obj, threshold):
        order, flat = _array_bytes(obj)
        data = memoryview(flat.view(sys.modules["numpy"].uint8))
        return LargeValue(ARRAY, (obj.dtype, obj.shape, order), data, flat.__array_interface__["data"][0], flat)
    return None


def _tensor_bytes(tensor: Any) -> tuple[Any, memoryview]:
    """A contiguous tensor with the same values, and a view of its bytes."""
    plain = tensor.detach().resolve_conj().resolve_neg().contiguous()
    size = plain.numel() * plain.element_size()
    return plain, memoryview((ctypes.c_ubyte * size).from_address(plain.data_ptr())).cast("B")


def _array_bytes(array: Any) -> tuple[str, Any]:
    """The array's memory order and its elements in that order (copied only if strided)."""
    import numpy

    if array.flags.f_contiguous and not array.flags.c_contiguous:
        return "F", array.ravel(order="K")
    return "C", numpy.ascontiguousarray(array).reshape(-1)


# --- rebuilding (called by pickle.loads; referenced by name in the pickle) -----


def _tensor_on(buffer: mmap.mmap, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    import torch

    tensor = torch.frombuffer(buffer, dtype=getattr(torch, dtype), count=math.prod(shape)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _array_on(buffer: mmap.mmap, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    import numpy

    return numpy.ndarray(shape, dtype=dtype, buffer=buffer, order=order)


def mapped_tensor(name: str, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    return _tensor_on(map_private(name), dtype, shape, requires_grad, parameter)


def mapped_array(name: str, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    return _array_on(map_private(name), dtype, shape, order)


def adopted_tensor(name: str, dtype: str, shape: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    return _tensor_on(adopt(name), dtype, shape, requires_grad, parameter)


def adopted_array(name: str, dtype: Any, shape: tuple[int, ...], order: str) -> Any:
    return _array_on(adopt(name), dtype, shape, order)


def view_on(buffer: mmap.mmap, kind: str, args: tuple) -> Any:
    """The tensor or array that a LargeValue's ``kind`` and ``args`` describe, on ``buffer``."""
    return _tensor_on(buffer, *args) if kind == TENSOR else _array_on(buffer, *args)


def held_segment(kind: str, name: str, args: tuple) -> Any:
    """In a pickle for a pool's ranks: a large value the ranks keep open in shared memory.

    Only a rank's loader resolves it (xla_magic/launcher/shipped.py), to a
    fresh copy-on-write view for every cell; anywhere else it is an error.
    """
    raise RuntimeError(f"segment {name!r} is held by the ranks; only their loader can open it")


# --- pickling -----------------------------------------------------------------

SHIP = "ship"  # kernel -> ranks: every rank maps the segment copy-on-write
RETURN = "return"  # rank -> kernel: the kernel adopts the segment
_REBUILD = {
    SHIP: (mapped_tensor, mapped_array),
    RETURN: (adopted_tensor, adopted_array),
}


class SharedMemoryPickler(cloudpickle.Pickler):
    """cloudpickle that puts large CPU tensors and arrays in segments.

    With no writer (or when /dev/shm has no room) everything stays in the pickle.
    """

    def __init__(
        self, file: BinaryIO, writer: SegmentWriter | None, direction: str, threshold: int | None = None
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer = writer
        self.threshold = THRESHOLD if threshold is None else threshold
        self._tensor_rebuild, self._array_rebuild = _REBUILD[direction]

    def reducer_override(self, obj: Any) -> Any:
        if self.writer is not None:
            reduced = self.reduce_to_segment(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def reduce_to_segment(self, obj: Any) -> tuple | None:
        """``(rebuild, args)`` for a large tensor or array written to a segment, else None."""
        large = large_value(obj, self.threshold)
        name = None if large is None else self.writer.write(large.data)
        if name is None:
            return None
        rebuild = self._tensor_rebuild if large.kind == TENSOR else self._array_rebuild
        return rebuild, (name, *large.args)


class _Discard:
    """A file that forgets what is written to it."""

    def write(self, data: bytes) -> int:
        return len(data)


class _ProbePickler(cloudpickle.Pickler):
    """Pickles into nothing, skipping large values: only says whether it can be done."""

    def reducer_override(self, obj: Any) -> Any:
        if _large_tensor(obj, THRESHOLD) or _large_array(obj, THRESHOLD):
            return (int, ())
        return super().reducer_override(obj)


def check_picklable(value: Any) -> None:
    """Raise what pickling ``value`` would raise, without copying large data."""
    _ProbePickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)


# --- the kernel's side ----------------------------------------------------------


class RunSegments:
    """The segments of one run, owned by the kernel: made while pickling, swept at the end.

    Sweeping is explicit (when the run ends) and also happens when this object
    is collected or the kernel exits, so a payload that never ran leaves nothing.
    """

    def __init__(self) -> None:
        sweep_orphans()
        self.prefix = kernel_prefix() + secrets.token_hex(4)
        self.writer = SegmentWriter(self.prefix, "k")
        self._finalizer = weakref.finalize(self, sweep, self.prefix)

    def names(self) -> list[str]:
        return segment_names(self.prefix + "-")

    def sweep(self) -> None:
        sweep(self.prefix)


def dumps_namespace(values: dict[str, Any], segments: RunSegments | None) -> bytes:
    """Pickle the cell's names; large values go to ``segments`` (kernel side)."""
    import io

    buffer = io.BytesIO()
    if segments is None:
        cloudpickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(dict(values))
    else:
        pickler = SharedMemoryPickler(buffer, segments.writer, SHIP)
        pickler.dump({NAMESPACE_KEY: segments.prefix, **values})
    return buffer.getvalue()


def load_namespace(data: bytes) -> tuple[dict[str, Any], str | None]:
    """The shipped names, and the prefix results may be written under (rank side)."""
    values = pickle.loads(data)
    prefix = values.pop(NAMESPACE_KEY, None)
    if prefix is not None and not _PREFIX.match(str(prefix)):
        prefix = None
    return values, prefix


# What a result may not make the kernel import: torch_xla (the kernel must
# stay XLA-free) and the launcher package (it belongs to rank processes).
_KERNEL_FORBIDDEN = ("torch_xla", "_XLAC", "xla_magic.launcher")
_MODULE_IMPORTERS = {("cloudpickle.cloudpickle", "subimport"), ("cloudpickle.cloudpickle", "dynamic_subimport")}


def _forbidden_in_kernel(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _KERNEL_FORBIDDEN)


class ResultRefused(pickle.UnpicklingError):
    """A result that would import torch_xla or the launcher into the kernel."""


class _KernelUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _forbidden_in_kernel(module):
            raise ResultRefused(_refusal(f"{module}.{name}"))
        found = super().find_class(module, name)
        if (module, name) in _MODULE_IMPORTERS:
            return _guarded_import(found)
        return found


def _guarded_import(importer: Any) -> Any:
    """cloudpickle imports modules by name while loading: screen the name."""

    def load(name: str, *args: Any) -> Any:
        if _forbidden_in_kernel(name):
            raise ResultRefused(_refusal(f"the module {name}"))
        return importer(name, *args)

    return load


def _refusal(what: str) -> str:
    return (
        f"the result holds {what}, which the kernel must not import (torch_xla there "
        f"would stop every later spawn). Return plain values: tensors (XLA tensors come "
        f"back on the CPU), numbers, strings, and lists or dicts of them."
    )


def load_result(data: bytes) -> Any:
    """A rank's result; its segments become memory of this process (kernel side).

    Refuses (ResultRefused) anything that would import torch_xla or the
    launcher package into the kernel.
    """
    return _KernelUnpickler(io.BytesIO(data)).load()
