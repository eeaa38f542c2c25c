"""The launcher side: runs outside the kernel only.

This package may import torch and torch_xla; the kernel side never imports
it. It depends on nothing in the kernel side except ``xla_magic.protocol``.
"""
