"""How a checkpoint directory is laid out, and what its manifests say. Runs on both sides: standard library only.

A cell's ``checkpoints(DIR)`` (xla_magic/launcher/checkpoints.py) writes,
under DIR, one directory per checkpoint:

- ``step-00000040/``: a complete checkpoint of step 40. It holds
  ``replicated.pt`` (rank 0's: the state every rank holds alike),
  ``rank-R.pt`` (each rank's random state), and ``manifest.json`` (every
  file's size and SHA-256, the world size, when, by which run), written
  last. On a local disk the directory was written as ``.partial-...`` and
  renamed once complete, so a complete name never holds a half checkpoint;
  on object storage (fsspec), where nothing renames atomically, the
  manifest is the commit: a step directory without one is partial.
- ``.partial-step-00000040-KEY/``: a checkpoint being written, or one whose
  writing was cut short (a killed machine, a full disk). Never loaded.
- ``.board/KEY/``: where the ranks of one ``checkpoints(...)`` agree on a
  step to save at (a time cadence, a SIGTERM) without a collective per step.

The kernel reads the manifests (``%xla_checkpoints``) with this module only:
JSON, no torch.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, NamedTuple

FORMAT = 1
MANIFEST = "manifest.json"
REPLICATED = "replicated.pt"
BOARD = ".board"
STEP = re.compile(r"^step-(\d{8,})$")
PARTIAL = re.compile(r"^\.partial-step-(\d{8,})-([0-9a-f]+)$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_name(step: int, key: str) -> str:
    return f".partial-{step_name(step)}-{key}"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def part_file(rank: int) -> str:
    """What rank R wrote into a checkpoint (its files, sizes, checksums): the rank's part of the manifest."""
    return f"rank-{rank}.part.json"


class Entry(NamedTuple):
    """One checkpoint in a directory, as its name and manifest say (files are checked where it is loaded)."""

    step: int
    name: str  # the directory's name under DIR
    complete: bool
    manifest: dict[str, Any] | None

    @property
    def size(self) -> int:
        return sum(int(f.get("size", 0)) for f in (self.manifest or {}).get("files", {}).values())

    @property
    def time(self) -> float | None:
        return (self.manifest or {}).get("time")

    @property
    def run(self) -> str:
        return str((self.manifest or {}).get("run", ""))


def entry(name: str, manifest: dict[str, Any] | None) -> Entry | None:
    """The checkpoint a directory named ``name`` holds (its manifest, or None where it has none); None if not one."""
    if (match := STEP.match(name)) is not None:
        complete = manifest is not None and manifest.get("format") == FORMAT
        return Entry(int(match.group(1)), name, complete, manifest)
    if (match := PARTIAL.match(name)) is not None:
        return Entry(int(match.group(1)), name, False, manifest)
    return None


def read_local(directory: str) -> list[Entry]:
    """The checkpoints under a local ``directory``, oldest step first ([] where there is none)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        manifest = None
        try:
            with open(os.path.join(directory, name, MANIFEST), encoding="utf-8") as file:
                manifest = json.load(file)
        except (OSError, ValueError):
            pass
        if (item := entry(name, manifest)) is not None:
            found.append(item)
    return sorted(found, key=lambda item: (item.step, item.complete))


def parse_duration(text: str | float | int, what: str) -> float:
    """Seconds in ``"10min"``, ``"8h50m"``, ``"90s"`` or a number of seconds; ValueError naming ``what`` else."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text > 0:
            return float(text)
    elif isinstance(text, str):
        units = {"h": 3600, "hr": 3600, "m": 60, "min": 60, "s": 1, "sec": 1}
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text.strip().lower())
        joined = "".join(f"{number}{unit}" for number, unit in parts)
        if parts and joined == re.sub(r"\s+", "", text.strip().lower()) and all(u in units for _, u in parts):
            seconds = sum(float(number) * units[unit] for number, unit in parts)
            if seconds > 0:
                return seconds
    raise ValueError(f"{what} is a time such as '10min', '8h50m' or '90s', not {text!r}")
