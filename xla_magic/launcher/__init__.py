"""The launcher side. Runs in the launcher, its supervisors and the ranks, never in the kernel.

This package may import torch and torch_xla; the kernel side never imports
it. Of the rest of xla_magic it uses only the modules shared by both sides,
which import nothing of IPython: ``protocol`` (events and framing),
``transport`` (shared-memory data) and ``kernel_strategy`` (the
``from xla_magic import strategy`` object, which resolves to the rank's own).
"""
