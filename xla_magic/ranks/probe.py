"""XLA-free device discovery and the kernel guard. Runs in the kernel.

Nothing here imports torch_xla or starts a runtime: TPUs are found by their
PCI ids under /sys (the same ids torch_xla's own TPU probe reads), and the
kernel's XLA state is read only from a torch_xla the user already imported.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from xla_magic.wire.help import see

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device id -> TPU generation, and how many XLA devices one chip gives.
TPU_PCI_DEVICES = {
    "0x0027": ("v2/v3", 2),
    "0x005e": ("v4", 1),
    "0x0063": ("v5e", 1),
    "0x0062": ("v5p", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("v7x", 2),  # one process per chip, whose two TensorCores are two devices (threads of it)
}
CPU_SIMULATION_MAX = 64


@dataclass(frozen=True)
class TpuHost:
    generation: str
    chips: int
    devices_per_chip: int

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    def describe(self) -> str:
        return f"TPU {self.generation}, {self.chips} chips, {self.devices} devices"


def find_tpu(sys_root: str = "/sys") -> TpuHost | None:
    """The TPU chips on this host's PCI bus, or None."""
    found: dict[str, int] = {}
    for vendor_path in glob.glob(os.path.join(sys_root, "bus/pci/devices/*/vendor")):
        try:
            vendor = Path(vendor_path).read_text().strip()
            if vendor != GOOGLE_PCI_VENDOR:
                continue
            device = (Path(vendor_path).parent / "device").read_text().strip()
        except OSError:
            continue
        if device in TPU_PCI_DEVICES:
            found[device] = found.get(device, 0) + 1
    if not found:
        return None
    device, chips = max(found.items(), key=lambda item: item[1])
    generation, per_chip = TPU_PCI_DEVICES[device]
    return TpuHost(generation, chips, per_chip)


def cpu_pjrt_requested() -> bool:
    """PJRT_DEVICE=CPU: the tpu launch path runs as CPU threads (for tests)."""
    return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"


def tpu_pjrt_requested() -> bool:
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


def auto_backend(sys_root: str = "/sys") -> str:
    if find_tpu(sys_root) is not None or tpu_pjrt_requested():
        return "tpu"
    return "cpu"


def kernel_xla_runtime() -> str | None:
    """Why this process cannot spawn ranks, or None while it is XLA-free.

    Only looks at a torch_xla that is already imported; never imports it.
    """
    xlac = sys.modules.get("_XLAC") or getattr(sys.modules.get("torch_xla"), "_XLAC", None)
    if xlac is None:
        return None
    try:
        initialized = bool(xlac._xla_runtime_is_initialized())
    except Exception:  # an unknown torch_xla build: assume the worst
        initialized = True
    if not initialized:
        return None
    return (
        "this kernel has initialised an XLA runtime (a cell used an XLA device "
        "outside %%xla_spawn), and only one process can own the devices, so no "
        "ranks can be started. Restart the kernel, then keep every use of "
        "torch_xla and the XLA device inside %%xla_spawn cells. " + see("kernel-initialised-xla")
    )


def kernel_imported_torch_xla() -> bool:
    return "torch_xla" in sys.modules


def libtpu_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether this process has libtpu mapped (and so may hold the TPU)."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            return any("libtpu" in line for line in maps)
    except OSError:
        return False


def kernel_holds_libtpu() -> str | None:
    """Why the kernel cannot spawn on a TPU it holds through libtpu, or None.

    A TPU build of TensorFlow (or JAX) imported in the kernel loads libtpu,
    which claims the chips just as an XLA runtime would.
    """
    if find_tpu() is None or not libtpu_loaded():
        return None
    culprits = [name for name in ("tensorflow", "jax") if name in sys.modules]
    how = f" (imported here: {', '.join(culprits)})" if culprits else ""
    return (
        f"this kernel has loaded libtpu{how}, which holds the TPU, so no rank can "
        "open it. Restart the kernel and don't import tensorflow or jax in it; "
        "import them inside %%xla_spawn cells if a rank needs them. " + see("kernel-loaded-libtpu")
    )


@dataclass(frozen=True)
class Placement:
    """Where a run goes: backend, device count, and the tpu path on CPU threads.

    With a ``mesh`` it is the SPMD placement: one process drives all
    ``devices`` over that mesh (axes named ``axes``), and its value is one
    value, not a list by rank.
    """

    backend: str
    devices: int
    cpu_threads: bool = False
    mesh: tuple[int, ...] | None = None
    axes: tuple[str, ...] | None = None

    @property
    def spmd(self) -> bool:
        return self.mesh is not None

    @property
    def ranks(self) -> int:
        """How many rank processes (or threads) it runs."""
        return 1 if self.spmd else self.devices

    @property
    def on_cpu(self) -> bool:
        """Whether its devices are XLA CPU devices (the simulation, or PJRT_DEVICE=CPU)."""
        return self.backend == "cpu" or self.cpu_threads

    def describe_mesh(self) -> str:
        """``data=4 × model=2`` (empty when not SPMD)."""
        if self.mesh is None:
            return ""
        return " × ".join(f"{name}={size}" for name, size in zip(self.axes or (), self.mesh))


class PlacementError(ValueError):
    pass


def place(backend: str, devices: int | None, sys_root: str = "/sys") -> Placement:
    """Resolve ``--backend`` and ``--devices`` for this host, or say why not.

    One-shot cells and the pool both come here, so it checks ``devices``
    itself rather than trust each caller's parsing.
    """
    if backend == "auto":
        backend = auto_backend(sys_root)
    if devices is not None and devices < 1:
        raise PlacementError(f"--devices must be at least 1, not {devices}.")
    if backend == "cpu":
        count = 8 if devices is None else devices
        if count > CPU_SIMULATION_MAX:
            raise PlacementError(
                f"the CPU simulation runs 1 to {CPU_SIMULATION_MAX} ranks; --devices {count} is too many."
            )
        return Placement("cpu", count)
    tpu = find_tpu(sys_root)
    if tpu is None:
        return _place_without_chips(devices, sys_root)
    most, why = spawned_devices(tpu)
    possible = sorted({1, most})
    count = most if devices is None else devices
    if count not in possible:
        raise PlacementError(
            f"{tpu.describe()}{why}: torch_xla's spawn runs on one device or on all of them, so "
            f"--devices can be {' or '.join(map(str, possible))}, not {count}. " + see("devices-one-or-all")
        )
    if count > 1 and os.environ.get("TPU_VISIBLE_CHIPS"):
        raise PlacementError(
            f"TPU_VISIBLE_CHIPS={os.environ['TPU_VISIBLE_CHIPS']} "
            f"is set, and torch_xla's spawn gives it to each of its {count // tpu.devices_per_chip} processes as it is"
            f", so they would all open the same chips. "
            f"Unset TPU_VISIBLE_CHIPS to run on every chip, or use --devices 1 to run on the chip it names. "
            + see("tpu-visible-chips")
        )
    return Placement("tpu", count)


def spawned_devices(tpu: TpuHost) -> tuple[int, str]:
    """How many ranks torch_xla's spawn starts on this host, and what beyond the chips decided it.

    As torch_xla's ``tpu.num_local_processes()``: one process per chip, but no more than
    ``TPU_PROCESS_BOUNDS`` holds (an image's or a user's); each process drives its chip's devices.
    """
    bounds = os.environ.get("TPU_PROCESS_BOUNDS")
    if not bounds:
        return tpu.devices, ""
    try:
        size = 1
        for dim in bounds.split(","):
            size *= int(dim)
    except ValueError:
        raise PlacementError(
            f"TPU_PROCESS_BOUNDS={bounds} is set, and torch_xla cannot read it (it wants three numbers, like "
            f"2,2,1). Unset it to run on every chip. " + see("tpu-process-bounds")
        ) from None
    processes = min(tpu.chips, size)
    if processes == tpu.chips:
        return tpu.devices, ""
    return processes * tpu.devices_per_chip, (
        f" (TPU_PROCESS_BOUNDS={bounds}: torch_xla's spawn starts one process per chip on {processes} of them; "
        f"unset it to use every chip)"
    )


def _place_without_chips(devices: int | None, sys_root: str) -> Placement:
    """The tpu backend where no TPU chip shows under ``sys_root``: PJRT_DEVICE decides."""
    if cpu_pjrt_requested():
        count = 8 if devices is None else devices
        if count > CPU_SIMULATION_MAX:
            raise PlacementError(f"PJRT_DEVICE=CPU runs 1 to {CPU_SIMULATION_MAX} threads, not {count}.")
        return Placement("tpu", count, cpu_threads=True)
    if not tpu_pjrt_requested():
        raise PlacementError(
            "no TPU was found on this machine. Use --backend cpu (or auto) for the CPU "
            "simulation, or run on a TPU host. " + see("no-tpu-found")
        )
    if devices not in (None, 1):
        raise PlacementError(
            f"PJRT_DEVICE=TPU is set, but no TPU chip shows under {sys_root}/bus/pci, so how many "
            f"devices this host has is unknown and --devices {devices} cannot be checked. Use "
            f"--devices 1, or run where the chips are visible (a container needs the host's /sys). "
            + see("no-tpu-chip-shows")
        )
    return Placement("tpu", 1)


# What a TPU's runtime opens: /dev/accelN (v2-v4) or /dev/vfio/N (v5e and later).
CHIP_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str
    mine: bool  # this user's
    user: str


def tpu_holders(exclude: set[int] = frozenset(), patterns: tuple[str, ...] = CHIP_FILES) -> list[Holder]:
    """The processes that hold a TPU chip's device file open, from /proc/*/fd (the TPU itself is not touched)."""
    chips = {path for pattern in patterns for path in glob.glob(pattern)}
    if not chips:
        return []
    found = []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        pid = int(fd_dir.split("/")[2])
        if pid in exclude:
            continue
        try:
            if not any(os.readlink(os.path.join(fd_dir, fd)) in chips for fd in os.listdir(fd_dir)):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(Holder(pid, command, uid == os.getuid(), _user(uid)))
    return found


def _user(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def held_tpu(exclude: set[int] = frozenset()) -> str | None:
    """Why ranks cannot open the TPU now (another process holds it), or None."""
    holders = tpu_holders(exclude)
    if not holders:
        return None
    named = "; ".join(
        f"pid {h.pid} ({h.command or '?'}), {'yours' if h.mine else 'of user ' + h.user}" for h in holders
    )
    pids = " ".join(str(h.pid) for h in holders)
    free = (f"End it (kill {pids}; if it is another notebook's kernel or kept pool, restart that kernel or "
            f"run %xla_pool stop there), then run the cell again"
            if all(h.mine for h in holders) else
            "Ask its owner to end it (or, as root, kill it), then run the cell again")
    return (f"the TPU is held by another process, so no rank can open it: {named}. {free}. "
            + see("tpu-held"))


def no_libtpu(launcher: dict, devices: int) -> str | None:
    """Why torch_xla in the launcher cannot run on this host's TPU (its import found no libtpu), or None."""
    if launcher.get("libtpu", True):
        return None
    return (f"torch_xla found no libtpu (the TPU's runtime), so its spawn would run one CPU process instead of "
            f"{devices} rank(s) on the TPU. Install it in the Python that runs the ranks "
            f"({launcher.get('python', 'the launcher')}) with pip install torch_xla[tpu] (the [tpu] extra brings "
            f"libtpu), or set TPU_LIBRARY_PATH to a libtpu.so, then run the cell again. " + see("no-libtpu"))
