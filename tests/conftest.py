"""Shared fixtures: one real IPython shell with the extension loaded.

The shell (and so its launcher) is shared by the whole session, which is
honest: that is exactly how a notebook uses it, and it keeps the suite fast.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from IPython.utils.capture import capture_output

# gloo and the XLA runtime open ports of their own; keep them on loopback.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# The interrupt tests press the stop button as a kernel receives it: SIGINT,
# raised as KeyboardInterrupt. A test run started in the background (nohup,
# `cmd &` in a script) inherits SIGINT ignored, and Python then keeps it so:
# those tests would wait forever for an interrupt that never comes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class CellRun:
    value: Any
    stdout: str
    stderr: str

    def lines(self, stream: str = "stdout") -> list[str]:
        return [line for line in getattr(self, stream).splitlines() if line]


@pytest.fixture(scope="session")
def ip():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "xla_magic")
    yield shell
    shell.run_line_magic("unload_ext", "xla_magic")


@pytest.fixture
def spawn(ip):
    """Run a %%xla_spawn cell in the shared shell and capture what it shows."""

    def run(line: str, cell: str, **user_ns: Any) -> CellRun:
        ip.user_ns.update(user_ns)
        with capture_output() as captured:
            value = ip.run_cell_magic("xla_spawn", line, cell)
        return CellRun(value, captured.stdout, captured.stderr)

    return run


def kernel_is_xla_free() -> bool:
    return "torch_xla" not in sys.modules and "_XLAC" not in sys.modules


def assert_every_rank(values: list[dict], expected_for: Any, exact: bool = True) -> None:
    """Each rank's dict of results equals ``expected_for(rank)``, key by key."""
    for rank, got in enumerate(values):
        expected = expected_for(rank)
        assert got.keys() == expected.keys()
        for name in expected:
            assert_same(got[name], expected[name], f"rank {rank} {name}", exact)


def assert_same(got: Any, expected: Any, where: str, exact: bool = True) -> None:
    """Compare nested lists/tensors/values; tensors by dtype and value.

    ``exact=False`` compares tensor values with allclose (shapes must match).
    """
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, f"{where}: {got!r}"
        same = torch.equal(got, expected) if exact else (
            got.shape == expected.shape and torch.allclose(got, expected)
        )
        assert same, f"{where}: {got} != {expected}"
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), f"{where}: {got!r}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]", exact)
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


# Defined in cells: which file (if any) backs the memory at an address, as
# /proc/self/maps says (shows whether a value came through shared memory).
BACKING = """
def backing(address):
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return " ".join(fields[5:])
    return ""
"""
