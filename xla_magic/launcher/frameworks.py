"""Frameworks in a cell: Lightning, HF Accelerate and the HF Trainer see the ranks they run in. Runs in a rank.

Lightning's XLA accelerator and strategy assume they are in the process that
will launch the ranks: they count TPU chips on the PCI bus, spawn the ranks
with ``xmp.spawn`` and only then learn each one's rank. In a ``%%xla_spawn``
cell the ranks already exist, so ``Trainer``/``Fabric(accelerator="tpu")``
must instead see the ranks they are in, as with a cluster that creates its
processes externally (torchrun, SLURM):

- the XLA accelerator is available and counts the cell's ranks;
- a device count other than the cell's is refused, naming ``--devices``;
- the XLA strategies launch nothing: the function runs in place, and the
  strategy then takes its ranks from ``torch_xla.runtime`` as in a spawned
  process;
- ``rank_zero_only`` knows this rank from the moment Lightning is imported,
  so what Lightning prints while constructing a Trainer comes from rank 0;
- an interrupted ``fit`` ends in KeyboardInterrupt, not in Lightning's
  ``sys.exit(1)``, so the rank lives on to serve its pool.

HF Accelerate (and the HF ``Trainer``, whose ranks are Accelerate's
``PartialState``) asks torch_xla for the world size, the process index and
the device, which the ranks answer as on a TPU host. Only the local process
index it takes from torch_xla on a TPU alone (``xm.get_local_ordinal()``),
and elsewhere from ``LOCAL_RANK``, which no XLA launcher sets: -1, so
``is_local_main_process`` would be False on every rank, and the Trainer
would log on none. In ``accelerate.state`` the question "is this a TPU" is
answered yes wherever the ranks stand in for a TPU host's (the CPU
simulation, the tpu launch path's CPU threads), so it takes the TPU's
branches: the local ordinal, and the TPU's bf16 and gradient-sync settings.
Nothing else in Accelerate, transformers or torch_xla is told so.

What Lightning's ``self.log``, the HF Trainer and ``accelerator.log`` log is
drawn under the cell as ``log`` draws it (framework_metrics.py).

Nothing of Lightning or Accelerate is imported here: ``install`` patches the modules that
are already imported and hooks the import of the others, so a cell that
never imports Lightning never pays for it. ``lightning.*`` and the standalone
``pytorch_lightning`` / ``lightning_fabric`` packages are patched alike;
what a Lightning release lacks is left alone.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from xla_magic.launcher import current, framework_metrics

_FABRIC_ROOTS = ("lightning.fabric", "lightning_fabric")
_PYTORCH_ROOTS = ("lightning.pytorch", "pytorch_lightning")
_RANK_ZERO = "lightning_utilities.core.rank_zero"


@dataclass
class _Cell:
    rank: int
    world_size: int


_cell: _Cell | None = None


def install(rank: int, world_size: int) -> None:
    """Let Lightning, whenever this rank imports it, train across the cell's ranks.

    Called in every rank once it knows its rank and world size; cheap, and
    idempotent (a pool rank calls it for every request).
    """
    global _cell
    _cell = _Cell(rank, world_size)
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module named in ``_PATCHES`` right after it is first executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = _spec_from_other_finders(self, name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        # Each module gets a loader object of its own, so this changes only this import.
        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def _spec_from_other_finders(me: Any, name: str, path: Any, target: Any) -> Any:
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


# --- the patches ----------------------------------------------------------------


def _patch_rank_zero(module: ModuleType) -> None:
    """Lightning keeps ``rank_zero_only.rank`` if it is set before Lightning is imported.

    Where ranks are threads of one process, one attribute cannot hold every
    rank's value, so ``rank_zero_only`` becomes an object whose ``rank`` is
    per thread; Lightning's modules import it from here, and the functions it
    decorates look it up here when called.
    """
    decorator = getattr(module, "rank_zero_only", None)
    if _cell is None or decorator is None or isinstance(decorator, _PerThreadRankZeroOnly):
        return
    if _ranks_are_threads():
        module.rank_zero_only = _PerThreadRankZeroOnly(decorator)
    else:
        decorator.rank = _cell.rank


def _patch_accelerator(module: ModuleType) -> None:
    accelerator = getattr(module, "XLAAccelerator", None)
    if accelerator is None or getattr(accelerator, "_xla_magic", False):
        return
    accelerator.auto_device_count = staticmethod(_cell_device_count)
    accelerator.is_available = staticmethod(lambda: True)
    if hasattr(module, "_check_tpu_devices_valid"):
        module._check_tpu_devices_valid = _check_devices_match_cell
    accelerator._xla_magic = True


def _patch_strategy(module: ModuleType) -> None:
    for name in ("XLAStrategy", "XLAFSDPStrategy"):
        strategy = getattr(module, name, None)
        if strategy is None or getattr(strategy, "_xla_magic", False):
            continue
        strategy._configure_launcher = _launch_in_place
        # A rank is inside the launched region from start to end, also after
        # trainer.fit returns (Lightning's teardown would say it is not).
        strategy._launched = property(lambda self: True, lambda self, value: None)
        strategy._xla_magic = True


def _patch_trainer_call(module: ModuleType) -> None:
    original = getattr(module, "_call_and_handle_interrupt", None)
    if original is None or getattr(original, "_xla_magic", False):
        return
    module._call_and_handle_interrupt = _interrupts_stay_interrupts(original)


def _patch_accelerate_state(module: ModuleType) -> None:
    original = getattr(module, "is_torch_xla_available", None)
    if original is None or getattr(original, "_xla_magic", False):
        return
    module.is_torch_xla_available = _as_on_a_tpu_host(original)


# --- what the patches put in place -------------------------------------------------


def _cell_device_count() -> int:
    """XLAAccelerator.auto_device_count: the devices of this cell, one per rank."""
    return _cell.world_size if _cell is not None else 0


def _check_devices_match_cell(devices: object) -> None:
    """Lightning's device check, against the cell's ranks instead of the host's chips."""
    count = _cell_device_count()
    if devices == count or (count == 1 and isinstance(devices, (list, tuple)) and list(devices) == [0]):
        return
    shown = len(devices) if isinstance(devices, (list, tuple)) else devices
    raise ValueError(
        f"devices={devices!r} does not match this cell: the %%xla_spawn cell runs {count} "
        f"rank{'s' if count != 1 else ''}, one per device, and Lightning trains across all of them. "
        f"Use devices={count} or devices='auto', or run the cell with `%%xla_spawn --devices {shown}`."
    )


def _launch_in_place(strategy: Any) -> None:
    """XLAStrategy._configure_launcher: the ranks exist already, so nothing is spawned.

    With no launcher, Trainer and Fabric run their function in this rank, and the
    strategy's ``setup_environment`` marks it launched there, as in a process
    that ``xmp.spawn`` started.
    """
    strategy._launcher = None


def _interrupts_stay_interrupts(original: Callable[..., Any]) -> Callable[..., Any]:
    """Trainer's entry points, with an interrupt ending them as KeyboardInterrupt.

    On KeyboardInterrupt Lightning shuts down gracefully (restoring the signal
    handlers it replaced) and then exits the process with ``sys.exit(1)``; a
    rank goes on serving cells, and its interrupt is reported as one. Where
    ranks are threads, Lightning's ``signal.signal`` call raises instead of
    exiting; that too becomes the interrupt.
    """

    @functools.wraps(original)
    def call(trainer: Any, trainer_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return original(trainer, trainer_fn, *args, **kwargs)
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt) and isinstance(exc.__context__, KeyboardInterrupt):
                raise exc.__context__ from None
            raise

    call._xla_magic = True  # type: ignore[attr-defined]
    return call


def _as_on_a_tpu_host(original: Callable[..., bool]) -> Callable[..., bool]:
    """Accelerate's ``is_torch_xla_available``, answering ``check_is_tpu=True`` as on a TPU host.

    Ranks here run on TPU chips or stand in for them (XLA CPU devices);
    any other XLA device (a GPU) keeps Accelerate's own answer.
    """

    @functools.wraps(original)
    def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
        if check_is_tpu and original():
            import torch_xla.runtime as xr

            return xr.device_type() in ("TPU", "CPU")
        return original(check_is_tpu=check_is_tpu, check_is_gpu=check_is_gpu)

    is_torch_xla_available._xla_magic = True  # type: ignore[attr-defined]
    return is_torch_xla_available


class _PerThreadRankZeroOnly:
    """``rank_zero_only`` with a ``rank`` for each rank thread.

    A thread that set none (one the user's code started) sees the value its
    rank's thread last set, as with Lightning's single attribute.
    """

    def __init__(self, decorator: Callable[..., Any]) -> None:
        self._decorator = decorator
        self._local = threading.local()
        self._last: int | None = None
        functools.update_wrapper(self, decorator)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._decorator(fn, *args, **kwargs)

    @property
    def rank(self) -> int | None:
        rank = getattr(self._local, "rank", None)
        if rank is None and current.strategy() is not None:
            rank = current.strategy().global_rank
        return self._last if rank is None else rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._local.rank = value
        self._last = value


def _ranks_are_threads() -> bool:
    """Whether several ranks share this process (tpu launch path: TPU v2/v3, or CPU threads)."""
    import torch_xla.runtime as xr

    return xr.addressable_device_count() > 1


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    table: dict[str, Callable[[ModuleType], None]] = {
        _RANK_ZERO: _patch_rank_zero,
        "accelerate.state": _patch_accelerate_state,
    }
    for root in _FABRIC_ROOTS:
        table[f"{root}.accelerators.xla"] = _patch_accelerator
        table[f"{root}.strategies.xla"] = _patch_strategy
        table[f"{root}.strategies.xla_fsdp"] = _patch_strategy
    for root in _PYTORCH_ROOTS:
        table[f"{root}.strategies.xla"] = _patch_strategy
        table[f"{root}.trainer.call"] = _patch_trainer_call
        table[f"{root}.core.module"] = framework_metrics.patch_lightning_module  # what they log, drawn
    table["transformers.trainer"] = framework_metrics.patch_hf_trainer
    table["accelerate.accelerator"] = framework_metrics.patch_accelerator
    return table


# Module name -> what to do once it is imported.
_PATCHES = _patches()
