"""The files a rank process leaves in the temporary directory, by name: the rank writes them, and whoever kills
it (a host's engine) removes them. Runs on both sides."""

from __future__ import annotations

import os
import tempfile


def analysis_prefix(pid: int) -> str:
    """How the compilation analysis files of rank process ``pid`` begin (launcher/xla_analysis.py writes them)."""
    return f"xla_magic-analysis-{pid}-"


def remove_analysis_of(pids: list[int]) -> None:
    """Remove the analysis files of rank processes that were killed (they could not remove their own)."""
    root = tempfile.gettempdir()
    prefixes = tuple(analysis_prefix(pid) for pid in pids)
    for name in os.listdir(root):
        if name.startswith(prefixes):
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
