"""libtpu's place in a fake-TPU test: the bottom of torch_xla's real TPU path. Runs in every Python
process of such a test (the kernel's launcher, its supervisors, the ranks torch_xla's spawn starts),
loaded by sitecustomize.py when XLA_MAGIC_FAKE_TPU is set.

What is real above it: torch_xla's whole TPU path in Python. ``xmp.spawn`` → ``pjrt.spawn`` →
``run_multiprocess`` counts processes with ``tpu.num_local_processes()`` (the chips on the PCI bus,
``TPU_PROCESS_BOUNDS``), starts them, and each runs ``initialize_multiprocess`` →
``tpu.configure_topology`` (reading the slice's metadata from GKE's ``TPU_*`` variables, so no
metadata server is asked), or with ``nprocs=1`` ``configure_one_chip_topology``; the ``xla://``
rendezvous; ``runtime.global_ordinal()`` and friends. The PCI ids come from files the test mounts
over ``/sys/bus/pci/devices`` in a mount namespace of its own (tests/fake_tpu_host.py).

What is fake, and why here: the only calls that need the real libtpu are the C++ runtime's, when it
makes its PJRT client (it dlopens libtpu, which opens the chips) and when it answers what that client
knows. So:

- the C environment, which only the C++ runtime reads, says ``PJRT_DEVICE=CPU`` (one device) where
  Python's ``os.environ`` says ``TPU``: torch_xla's Python sees a TPU, its runtime makes a CPU client;
- the few ``_XLAC`` functions that report the client's devices answer what libtpu would, computed
  from the variables torch_xla's topology code set in this process (``CLOUD_TPU_TASK_ID``,
  ``TPU_VISIBLE_CHIPS``, ``TPU_PROCESS_BOUNDS``): the device's global ordinal, the slice's device
  list, the process index and count. ``XLA_MAGIC_FAKE_TPU_ORDINALS`` (task ids' ordinals, comma
  separated) gives a numbering that is not the task order, which libtpu does not promise;
- like libtpu, opening a chip that is not on the bus (``TPU_VISIBLE_CHIPS``) or a topology whose
  process count does not match fails when the client is made.

- the runtime's memory call (``_xla_memory_info``, behind ``xm.get_memory_info``) answers what
  libtpu would report of the chip: its HBM (16 GiB on a v5e, 32 GiB on a v4, from the chips' PCI
  device id) and a use of its own, ``1 MiB × (task + 1)`` with a peak 1 MiB higher, so a test can tell
  the runtime's figures from the simulation's count (which counts only on the cpu backend).

Collectives between rank processes do not cross processes here (each client is alone): tests use it
for topology, numbering, environment and lifetime, not for numerics.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.machinery
import os
import sys

_libc = ctypes.CDLL(None)
_real_putenv = os.putenv
GOOGLE = "0x1ae0"


def install() -> None:
    os.putenv = _putenv  # what os.environ writes to the C environment goes through here
    if "PJRT_DEVICE" in os.environ:
        _putenv("PJRT_DEVICE", os.environ["PJRT_DEVICE"])
    sys.meta_path.insert(0, _XlacFinder())


def _putenv(key, value) -> None:
    text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
    if text(key) == "PJRT_DEVICE" and text(value).upper() == "TPU":
        _real_putenv("PJRT_DEVICE", "CPU")
        _real_putenv("CPU_NUM_DEVICES", "1")
        return
    _real_putenv(key, value)


def _on_tpu() -> bool:
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


def chips() -> int:
    """The fake chips on this host's PCI bus (as torch_xla counts them)."""
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(vendor) as file:
            if file.read().strip() == GOOGLE:
                count += 1
    return count


def _bounds(name: str, default: str = "1,1,1") -> int:
    size = 1
    for dim in os.environ.get(name, default).split(","):
        size *= int(dim)
    return size


class Topology:
    """What libtpu makes of this process's topology variables."""

    def __init__(self) -> None:
        self.processes = _bounds("TPU_PROCESS_BOUNDS")
        self.task = int(os.environ.get("CLOUD_TPU_TASK_ID", "0"))
        chip = int(os.environ.get("TPU_VISIBLE_CHIPS", "0").split(",")[0])
        if chip >= chips():
            raise RuntimeError(f"TPU initialization failed: chip {chip} (TPU_VISIBLE_CHIPS) is not on this host")
        if self.task >= self.processes:
            raise RuntimeError(f"TPU initialization failed: task {self.task} of {self.processes} (TPU_PROCESS_BOUNDS)")
        given = os.environ.get("XLA_MAGIC_FAKE_TPU_ORDINALS")
        self.ordinals = [int(o) for o in given.split(",")] if given else list(range(self.processes))

    @property
    def ordinal(self) -> int:
        return self.ordinals[self.task]


@functools.lru_cache(maxsize=None)
def _topology(pid: int) -> Topology:
    return Topology()


def topology() -> Topology:
    return _topology(os.getpid())


def _wrap(xlac) -> None:
    real = {name: getattr(xlac, name) for name in (
        "_xla_get_default_device_ordinal", "_xla_get_device_ordinal", "_xla_get_all_devices",
        "_xla_get_all_runtime_devices", "_xla_get_process_index", "_xla_get_num_processes",
    )}

    def answer(name, fake):
        def call(*args, **kwargs):
            if not _on_tpu():
                return real[name](*args, **kwargs)
            xlac._xla_get_devices()  # the real client is made as before (and any of its errors raised)
            return fake(topology(), *args, **kwargs)
        setattr(xlac, name, call)

    answer("_xla_get_default_device_ordinal", lambda t: t.ordinal)
    answer("_xla_get_device_ordinal", lambda t, device: t.ordinal)
    answer("_xla_get_all_devices", lambda t: [f"CPU:{i}" for i in range(t.processes)])
    answer("_xla_get_all_runtime_devices", lambda t: [f"CPU:{i}" for i in range(t.processes)])
    answer("_xla_get_process_index", lambda t: t.task)
    answer("_xla_get_num_processes", lambda t: t.processes)
    real["_xla_memory_info"] = xlac._xla_memory_info
    answer("_xla_memory_info", lambda t, device=None: memory_info(t))


HBM = {"0x0063": 16 << 30, "0x005e": 32 << 30}  # a chip's HBM by its PCI device id: v5e, v4
MIB = 1 << 20


def memory_info(topology: Topology) -> dict:
    """What libtpu reports of this process's chip: its HBM and a use of its own (the docstring says which)."""
    limit = 16 << 30
    for device in glob.glob("/sys/bus/pci/devices/*/device"):
        with open(device) as file:
            limit = HBM.get(file.read().strip(), limit)
    used = MIB * (topology.task + 1)
    return {"bytes_used": used, "bytes_limit": limit, "peak_bytes_used": used + MIB}


class _XlacFinder:
    """Wraps torch_xla's C++ module as it is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "_XLAC":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            _wrap(module)

        loader.exec_module = exec_module
        return spec
