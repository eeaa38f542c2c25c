"""The launcher side. Runs in the launcher, its supervisors and the ranks, never in the kernel.

This package may import torch and torch_xla; the kernel side never imports
it. Of the rest of xla_magic it imports only what both sides speak
(``xla_magic/wire/``: the events and their framing, shared-memory data, the
help entries' sentence). A cell's ``from xla_magic import strategy`` resolves
to the rank's own strategy (notebook/strategy.py) without an import from here.
"""
