"""Where an error message's troubleshooting entry is: ``docs/troubleshooting.md#ID``. Runs in the kernel.

Runs in the kernel (and in ranks, through kernel_strategy). A message that has
an entry ends with ``see(ID)``; each ID is an anchor the page sets on that
entry's heading (``{#ID}``), and tests/test_docs.py checks that every ID
passed here is one.
"""

from __future__ import annotations

PAGE = "docs/troubleshooting.md"


def see(entry: str) -> str:
    """The sentence that sends a reader to the entry: ``See docs/troubleshooting.md#ENTRY.``"""
    return f"See {PAGE}#{entry}."
