"""``%xla_checkpoints [DIR]``: the checkpoints a run's ``checkpoints(DIR)`` wrote, as a table. Runs in the kernel.

Reads DIR's manifests (JSON: xla_magic/wire/checkpoint_layout.py) and nothing
else: no torch, no torch_xla. A local path is read with ``os``; a URL
(``gs://``) with fsspec where the kernel has it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from xla_magic.wire import checkpoint_layout as layout


def entries(directory: str) -> list[layout.Entry]:
    """DIR's checkpoints, oldest step first; a URL needs fsspec here (ImportError naming the install line)."""
    if "://" not in directory or directory.startswith("file://"):
        return layout.read_local(os.path.expanduser(directory.removeprefix("file://")))
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"%xla_checkpoints {directory}: reading a URL needs fsspec (and gcsfs for gs://) in "
                          f"the kernel: pip install fsspec gcsfs") from None
    fs, root = fsspec.core.url_to_fs(directory)
    found = []
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        manifest = None
        try:
            manifest = json.loads(fs.cat_file(f"{path.rstrip('/')}/{layout.MANIFEST}"))
        except (OSError, ValueError):
            pass
        if (item := layout.entry(name, manifest)) is not None:
            found.append(item)
    return sorted(found, key=lambda item: (item.step, item.complete))


def last_directory(history: list[Any]) -> str | None:
    """Where the latest run that completed a checkpoint wrote it (its DIR), or None."""
    for record in reversed(history):
        checkpoint = getattr(record, "checkpoint", None)
        if checkpoint and checkpoint.get("path"):
            return os.path.dirname(str(checkpoint["path"]).rstrip("/"))
    return None


def size_text(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def table(directory: str, found: list[layout.Entry]) -> str:
    if not found:
        return f"no checkpoint in {directory}"
    rows = [("step", "time", "size", "complete", "run")]
    for item in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item.time)) if item.time else "-"
        rows.append((str(item.step), when, size_text(item.size) if item.complete else "-",
                     "yes" if item.complete else "no (partial: never loaded)", item.run or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    complete = [item for item in found if item.complete]
    last = f"restore() takes step {complete[-1].step}" if complete else "none is complete: restore() starts at 0"
    return "\n".join([f"{directory}: {len(found)} checkpoint{'s' * (len(found) != 1)}; {last}", *lines])


def run_text(record: Any) -> str:
    """A run's last checkpoint, for %xla_runs: "step 40 (DIR/step-00000040)", or "-"."""
    checkpoint = getattr(record, "checkpoint", None) if record is not None else None
    if not checkpoint:
        return "-"
    return f"step {checkpoint.get('step')} ({checkpoint.get('path')})"
