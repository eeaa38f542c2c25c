"""What a checkpoint holds and how it goes back in place: state to the host, random states, mismatches. Runs in a rank.

``save(step, model=..., opt=..., epoch=3)`` takes modules, optimizers, LR
schedulers (by their ``state_dict()``), tensors, numbers and any picklable
value. :func:`to_host` copies every XLA tensor among them to the host in one
transfer (torch_xla's ``_xla_get_cpu_tensors``, as ``xm._maybe_convert_to_cpu``
does, but for all of them at once) and clones CPU tensors (an optimizer's
``step`` counter is changed in place by the next step): what the writing
thread serialises is the state at this step, whatever later steps do.

:func:`check` compares a checkpoint with the restore's targets before
anything is loaded, and names the first difference; :func:`load` then puts
each value in place (``load_state_dict``, ``copy_``).
"""

from __future__ import annotations

import random
from typing import Any

import torch

_PLAIN = (int, float, bool, str, bytes, type(None))


class Mismatch(ValueError):
    """The checkpoint does not fit a restore's target; nothing was changed."""


def has_state(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def capture(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as saved values: objects by their state_dict, tensors as they are (still on their device)."""
    return {name: value.state_dict() if has_state(value) else value for name, value in state.items()}


def to_host(tree: Any) -> Any:
    """``tree`` with every tensor on the host, XLA tensors moved in one transfer; a copy of its containers."""
    found: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "xla":
                found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(tree)
    moved: dict[int, torch.Tensor] = {}
    if found:
        moved = dict(zip(map(id, found), _cpu_tensors(found)))

    def rebuild(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return moved[id(value)] if value.device.type == "xla" else value.detach().clone()
        if isinstance(value, dict):
            return type(value)((key, rebuild(item)) for key, item in value.items()) \
                if type(value) is not dict else {key: rebuild(item) for key, item in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(rebuild(item) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(rebuild(item) for item in value)
        return value

    return rebuild(tree)


def _cpu_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch_xla
    import torch_xla.runtime as xr

    from xla_magic.launcher import spmd

    if xr.is_spmd():  # a sharded tensor's shards, gathered whole
        return [spmd.whole_on_cpu(tensor) for tensor in tensors]
    return torch_xla._XLAC._xla_get_cpu_tensors([spmd._global_tensor(tensor) for tensor in tensors])


def random_state(device: Any) -> dict[str, Any]:
    """This rank's random generators: torch's, XLA's (its running seed), NumPy's and Python's."""
    saved: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy

        saved["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if device is not None and str(device).startswith("xla"):
        import torch_xla.core.xla_model as xm

        saved["xla"] = int(xm.get_rng_state(device))
    return saved


def set_random_state(saved: dict[str, Any], device: Any) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "numpy" in saved:
        import numpy

        numpy.random.set_state(saved["numpy"])
    if "xla" in saved and device is not None and str(device).startswith("xla"):
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(saved["xla"], device)


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def check(saved: dict[str, Any], targets: dict[str, Any]) -> None:
    """Mismatch naming the first target that the checkpoint does not fit (name, saved shape, model shape)."""
    for name, target in targets.items():
        if name not in saved:
            raise Mismatch(f"restore: {name} is not in the checkpoint (it holds {', '.join(sorted(saved)) or 'nothing'})")
        value = saved[name]
        if isinstance(target, torch.nn.Module):
            _check_module(name, value, target)
        elif isinstance(target, torch.optim.Optimizer):
            _check_optimizer(name, value, target)
        elif isinstance(target, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise Mismatch(f"restore: {name} was saved as {type(value).__name__}, not a tensor")
            if tuple(value.shape) != tuple(target.shape):
                raise Mismatch(f"restore: {name} has the shape {tuple(value.shape)} in the checkpoint and "
                               f"{tuple(target.shape)} here")
        elif has_state(target):
            if not isinstance(value, dict):
                raise Mismatch(f"restore: {name} was saved as {type(value).__name__}, not a state_dict")
        else:
            raise TypeError(f"restore({name}=...) loads in place into a module, an optimizer, an LR scheduler or a "
                            f"tensor, not {type(target).__name__}: plain values come back in ckpt.values")


def _check_module(name: str, saved: Any, module: torch.nn.Module) -> None:
    if not isinstance(saved, dict):
        raise Mismatch(f"restore: {name} was saved as {type(saved).__name__}, not a module's state_dict")
    here = module.state_dict()
    for key, value in here.items():
        if key not in saved:
            raise Mismatch(f"restore: {name}.{key} is not in the checkpoint (model shape {_shape(value)})")
        if _shape(saved[key]) != _shape(value):
            raise Mismatch(f"restore: {name}.{key} has the shape {_shape(saved[key])} in the checkpoint and "
                           f"{_shape(value)} in the model")
    for key in saved:
        if key not in here:
            raise Mismatch(f"restore: {name}.{key} is in the checkpoint (shape {_shape(saved[key])}) but not in "
                           f"the model")


def _check_optimizer(name: str, saved: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise Mismatch(f"restore: {name} was saved as {type(saved).__name__}, not an optimizer's state_dict")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        raise Mismatch(f"restore: {name} has {len(saved['param_groups'])} parameter groups in the checkpoint and "
                       f"{len(groups)} here")
    params = [param for group in groups for param in group["params"]]
    for index, (old, group) in enumerate(zip(saved["param_groups"], groups)):
        if len(old["params"]) != len(group["params"]):
            raise Mismatch(f"restore: {name}'s parameter group {index} has {len(old['params'])} parameters in the "
                           f"checkpoint and {len(group['params'])} here")
    ids = [pid for group in saved["param_groups"] for pid in group["params"]]
    for pid, param in zip(ids, params):
        for key, value in saved.get("state", {}).get(pid, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                raise Mismatch(f"restore: {name}.state[{pid}].{key} has the shape {tuple(value.shape)} in the "
                               f"checkpoint and its parameter {tuple(param.shape)} here")


def load(saved: dict[str, Any], targets: dict[str, Any]) -> None:
    """Each target loaded in place from the checkpoint (check() has passed)."""
    for name, target in targets.items():
        value = saved[name]
        if isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value.to(target.device, target.dtype))
        else:
            target.load_state_dict(value)
