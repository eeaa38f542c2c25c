"""What Lightning, the HF Trainer and Accelerate log, fed to the cell's chart as ``log`` would. Runs in a rank.

frameworks.py calls these patches once the framework's module is imported
(nothing here imports a framework). Each passes on what the user's code
already logs, and the framework's own logging goes on as before:

- Lightning: ``LightningModule.log`` (and so ``log_dict``) also logs the value
  at ``trainer.global_step``, before Lightning reduces or syncs anything: the
  chart's mean is the ranks' mean.
- HF Trainer: every Trainer gets a callback whose ``on_log`` logs what the
  Trainer logs (loss, learning rate, grad norm ...) at ``state.global_step``.
- Accelerate: ``Accelerator.log(values, step)`` logs ``values`` on every rank
  (Accelerate's trackers log on the main process only).

What is not one number (a torchmetrics Metric, a string, an image) is left to
the framework: only ``log`` called by the user refuses it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

from xla_magic.launcher import metrics


def feed(step: Any, values: Any) -> None:
    """Log the numbers among ``values`` at ``step`` (None: the rank's next), where a cell's logger runs."""
    logger = metrics.current()
    if logger is None or logger.seq is None or not isinstance(values, dict):
        return
    numbers = {}
    for name, value in values.items():
        try:
            metrics.check(str(name), value)
        except (TypeError, ValueError):
            continue
        numbers[str(name)] = value
    if isinstance(step, bool) or not isinstance(step, int):
        step = None
    if numbers:
        logger.log(step, numbers)


def _patched(cls: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    original = getattr(cls, name, None) if cls is not None else None
    if original is None or getattr(original, "_xla_magic", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped._xla_magic = True
    setattr(cls, name, wrapped)


def patch_lightning_module(module: ModuleType) -> None:
    def wrap(original: Any) -> Any:
        def log(self: Any, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, name, value, *args, **kwargs)
            trainer = getattr(self, "_trainer", None)
            feed(getattr(trainer, "global_step", None), {name: value})
            return result
        return log

    _patched(getattr(module, "LightningModule", None), "log", wrap)


_hf_callback: Any = None


def patch_hf_trainer(module: ModuleType) -> None:
    def wrap(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            self.add_callback(_hf_logging())
        return __init__

    _patched(getattr(module, "Trainer", None), "__init__", wrap)


def _hf_logging() -> Any:
    """A TrainerCallback whose on_log logs what the Trainer logs (its class made once transformers is here)."""
    global _hf_callback
    if _hf_callback is None:
        from transformers.trainer_callback import TrainerCallback

        class ChartCallback(TrainerCallback):  # type: ignore[misc,valid-type]
            """xla_magic: what the Trainer logs, also drawn under the cell."""

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                feed(getattr(state, "global_step", None), logs or {})

        _hf_callback = ChartCallback
    return _hf_callback()


def patch_accelerator(module: ModuleType) -> None:
    def wrap(original: Any) -> Any:
        def log(self: Any, values: dict, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
            feed(step, values)
            return original(self, values, step, *args, **kwargs)
        return log

    _patched(getattr(module, "Accelerator", None), "log", wrap)
