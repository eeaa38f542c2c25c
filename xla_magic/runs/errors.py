"""The errors a run raises: ranks that failed, a run interrupted, and advice for known TPU problems. Runs in the
kernel and in each host's engine.

Each error renders itself as IPython shows it (``_render_traceback_``): every
failing rank's own traceback, tagged, capped when many fail the same way,
with the rank's traceback kept as the ``__cause__`` for anything outside IPython.
"""

from __future__ import annotations

import bdb
import re
from dataclasses import dataclass
from typing import Callable

from xla_magic.runs.output import RED, RESET, rank_label, tag
from xla_magic.wire.help import see

# Known TPU-notebook failures: a pattern in a rank's error, and what to do.
KNOWN_PROBLEMS = [
    (
        r"TPU is already in use|already in use by process|device or resource busy",
        "another process holds the TPU: a previous kernel, or a process it left "
        "behind. Find it with `sudo lsof -w /dev/accel* /dev/vfio/*`, end it (or "
        "restart the runtime), then run the cell again. " + see("tpu-in-use"),
    ),
    (
        r"/dev/accel\d.*(Operation not permitted|Permission denied)|Couldn't open iommu group|"
        r"failed to open (the )?TPU|libtpu.*already (loaded|in use)",
        "libtpu is already held in this process, usually by a TPU build of "
        "TensorFlow that an import pulled in (common on Kaggle and Colab). Don't "
        "import tensorflow in %%xla_spawn cells or in modules they import, or "
        "uninstall tensorflow-tpu, then restart the kernel. " + see("accel-operation-not-permitted"),
    ),
    (
        r"Runtime is already initialized",
        "an XLA runtime was started before the ranks: keep every use of the XLA "
        "device inside %%xla_spawn cells and restart the kernel if it touched one. "
        + see("runtime-already-initialized"),
    ),
    (
        r"before processes have spawned",
        "Lightning asked for its XLA device before any rank existed: create the Trainer "
        "or Fabric inside a %%xla_spawn cell, and restart the kernel if it touched the device. "
        + see("lightning-device-before-spawn"),
    ),
    (
        # HF Trainer's default optimizer (adamw_torch_fused) on XLA tensors.
        r"`?fused=True`? requires all the params to be floating point Tensors of supported devices",
        "torch's fused AdamW does not run on XLA devices, and it is the HF Trainer's default "
        "optimizer: pass optim=\"adamw_torch\" to TrainingArguments (or fused=False to "
        "torch.optim.AdamW). " + see("fused-adamw"),
    ),
    # The host's memory before the device's: our own SIGKILL hint says "ran out
    # of memory", and the device advice would contradict it.
    (
        r"SIGKILL: killed|^MemoryError\b|DefaultCPUAllocator: (can't allocate|not enough memory)",
        "the host (not a device) probably ran out of memory: every rank holds its own copy "
        "of what it loads, so 8 ranks need 8 times the host memory. Load one rank at a time "
        "(a loop over `rank` with `strategy.barrier()`), move weights to the device right "
        "away, load in a smaller dtype, or use fewer ranks (--devices). `dmesg` or "
        "`journalctl -k` says \"Out of memory: Killed process\" when this was the cause. "
        + see("sigkill-out-of-memory"),
    ),
    # A device out-of-memory error that the rank explained (launcher/memory.py): advice by what dominates.
    (
        r"Most of it: parameters, gradients and optimizer state\.",
        "load the model in bfloat16 (model.to(torch.bfloat16)), shard it across the devices with FSDPv2 "
        "(%%xla_spawn --spmd), or use a lighter optimizer (SGD, Adafactor) than Adam's two states per "
        "parameter. " + see("oom-weights"),
    ),
    (
        r"Most of it: the graph's temporaries",
        "use a smaller batch, or gradient checkpointing (torch_xla.utils.checkpoint.checkpoint) around the "
        "largest layers. " + see("oom-temporaries"),
    ),
    (
        r"Most of it: tensors left from earlier cells",
        "del the names listed above (a sync then frees them), or %xla_pool restart. " + see("oom-leftovers"),
    ),
    (
        r"RESOURCE_EXHAUSTED|Attempting to (reserve|allocate)|Ran out of memory in memory space|"
        r"Error allocating device buffer",
        "a device ran out of memory: use a smaller batch or model, or bfloat16. " + see("resource-exhausted"),
    ),
]


def known_problem(text: str) -> str | None:
    for pattern, advice in KNOWN_PROBLEMS:
        if re.search(pattern, text, re.IGNORECASE | re.MULTILINE):
            return advice
    return None



class RemoteTraceback(Exception):
    """A rank's traceback as text; the ``__cause__`` of a RankError."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class RankFailure:
    rank: int
    type: str
    message: str
    traceback: str = ""
    exit_code: int | None = None

    def headline(self) -> str:
        """The error in one line: its type and its message's first line (a TPU compiler's runs on for pages)."""
        first = next((line for line in self.message.splitlines() if line.strip()), "") if self.message else ""
        return f"{self.type}: {first}" if first else self.type


class RankError(Exception):
    """One or more ranks failed. ``results`` holds what the healthy ranks returned."""

    SHOW_SAME = 1  # how many identical failures to show in full

    def __init__(
        self,
        failures: list[RankFailure],
        results: dict[int, object],
        summary: str = "",
        label: Callable[[int], str] = rank_label,
        where: list[str] | None = None,
    ) -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.where = where or []  # where every rank was when the request was stopped (watch.py)
        self.results = results
        self.summary = summary
        self.label = label
        self.debuggable: list[int] = []  # the failed ranks that keep their cell's frames for %debug, first failure first
        self.post_mortem: object = None  # what %debug opens (post_mortem.PostMortem), once the runner kept it
        self.debug_note = ""  # the line that says so
        self.not_kept = ""  # when no rank kept them: why, and what to do instead (post_mortem.why_not)
        ranks = ", ".join(str(f.rank) for f in self.failures)
        headline = summary or f"rank(s) {ranks} failed"
        super().__init__(f"{headline}: {self.failures[0].headline()}" if self.failures else headline)
        if self.failures and self.failures[0].traceback:
            self.__cause__ = RemoteTraceback(self.failures[0].traceback)

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def render_lines(self) -> list[str]:
        lines = [f"{RED}{type(self).__name__}{RESET}: {self.summary or 'ranks failed'}"]
        groups: dict[tuple[str, str], list[RankFailure]] = {}
        for failure in self.failures:
            groups.setdefault((failure.type, failure.message), []).append(failure)
        for same in groups.values():
            for failure in same[: self.SHOW_SAME]:
                prefix = tag(failure.rank, "stderr", self.label)
                body = failure.traceback.rstrip("\n") or failure.headline()
                lines.extend(prefix + line for line in body.splitlines())
            if len(same) > self.SHOW_SAME:
                # "ranks 1, 2"; across hosts "ranks h0 r1, h1 r2"
                others = ", ".join(self.label(f.rank).removeprefix("rank ") for f in same[self.SHOW_SAME :])
                lines.append(f"... ranks {others} failed the same way ({same[0].headline()})")
        lines.extend(self.where)
        if self.debug_note:
            lines.append(self.debug_note)
        advice = self.advice()
        if advice:
            lines.append(f"What to do: {advice}")
        return lines

    def advice(self) -> str | None:
        """What to do about a known TPU-notebook failure, if this is one."""
        for failure in self.failures:
            found = known_problem(f"{failure.headline()}\n{failure.traceback}")
            if found:
                return found
        return None

    def _render_traceback_(self) -> list[str]:
        return self.render_lines()


class DebuggerQuit(RankError, bdb.BdbQuit):
    """The user quit pdb in a rank's cell (``q``): the cell ends there, as IPython ends a plain cell, with no traceback.

    IPython takes a BdbQuit from a cell silently; the line that says so is printed as it is raised.
    """


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted (stop button) and its ranks were stopped."""

    def __init__(self, message: str, results: dict[int, object] | None = None,
                 where: list[str] | None = None) -> None:
        self.where = where or []  # where every rank was when it was stopped (watch.py)
        super().__init__("\n".join([message, *self.where]))
        self.results = results or {}

    def _render_traceback_(self) -> list[str]:
        message, *where = self.args[0].split("\n")
        return [f"{RED}RunInterrupted{RESET}: {message}", *where]
