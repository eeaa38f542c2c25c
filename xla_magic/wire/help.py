"""The sentence that ends a message with a troubleshooting entry, as both sides word it. Runs in the kernel and
in ranks.

The entries themselves are docs/troubleshooting.md's, shown by ``%xla_help ID`` (notebook/troubleshooting.py).
"""

from __future__ import annotations


def see(entry: str) -> str:
    """The sentence that ends a message with an entry: the magic that shows the entry where the error is."""
    return f"%xla_help {entry} says more."
