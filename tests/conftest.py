"""Shared fixtures: one real IPython shell with the extension loaded, and a check that no test leaks.

The shell (and so its launcher) is shared by the whole session, which is
honest: that is exactly how a notebook uses it, and it keeps the suite fast.
Because it is shared, every test must leave it as it found it: the
``nothing_left`` check below fails the test that leaves a listener, a pool,
a child process, an environment variable or a temporary file behind (or
removes a listener it did not add). Helpers live in helpers.py.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from IPython.utils.capture import capture_output

from helpers import alive, stop_watching, wait_gone

# gloo and the XLA runtime open ports of their own; keep them on loopback.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# The interrupt tests press the stop button as a kernel receives it: SIGINT,
# raised as KeyboardInterrupt. A test run started in the background (nohup,
# `cmd &` in a script) inherits SIGINT ignored, and Python then keeps it so:
# those tests would wait forever for an interrupt that never comes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser) -> None:
    parser.addoption("--update-images", action="store_true",
                     help="write the browser tests' screenshots into docs/images/ (else a temporary folder)")
    parser.addoption("--order", default="file", metavar="file|reverse|SEED",
                     help="run the tests in file order, in reverse, or shuffled by this seed (a number); the files "
                          "stay whole either way, so each module's fixtures are set up once")


def pytest_report_header(config) -> str:
    return f"test order: {config.getoption('--order')} (--order)"


def pytest_collection_modifyitems(config, items) -> None:
    """Reorder the tests as --order says: proof that none needs another to have run before it."""
    import random

    order = config.getoption("--order")
    if order == "file":
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(modules.values())
    if order == "reverse":
        groups = [group[::-1] for group in groups[::-1]]
    else:
        shuffle = random.Random(int(order)).shuffle
        shuffle(groups)
        for group in groups:
            shuffle(group)
    items[:] = [item for group in groups for item in group]


# Every temporary file or folder a test makes with tempfile goes here, so the leak check sees this
# run's only (the machine's /tmp is shared with other runs). Removed when the process exits after a
# run that passed (registered before IPython's own exit handlers, so it runs after them: the test
# shell's history file is in here); kept, with pytest's tmp_path folders, after one that failed.
tempfile.tempdir = tempfile.mkdtemp(prefix="xla_magic-tests-")
_run_passed: list[bool] = []


def _remove_the_tests_temporary_folder() -> None:
    import shutil

    if _run_passed:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)


atexit.register(_remove_the_tests_temporary_folder)


def pytest_sessionfinish(session, exitstatus) -> None:
    if exitstatus == 0:
        _run_passed.append(True)
    else:
        print(f"\nthe tests' temporary files are kept in {tempfile.tempdir}")


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
        from xla_magic.notebook import profile_view

        with capture_output() as captured:
            value = ip.run_cell_magic("xla_spawn", line, cell)
            profile_view.wait_drawn()  # a pool's --profile text is printed once its ranks' digests came
        return CellRun(value, captured.stdout, captured.stderr)

    return run


@pytest.fixture
def pool(ip):
    """A 2-rank pool on the cpu backend in the shared shell, stopped afterwards (a module may have its own)."""
    with capture_output():
        ip.run_line_magic("xla_pool", "start --devices 2 --backend cpu")
    try:
        yield ip._xla_magic_session.pool
    finally:
        with capture_output():
            ip.run_line_magic("xla_pool", "stop")


@pytest.fixture
def images(request, tmp_path_factory):
    """Where a browser test's screenshots go: docs/images/ when asked (--update-images or
    XLA_MAGIC_UPDATE_IMAGES=1), else a temporary folder, so a test run rewrites no tracked file."""
    from pathlib import Path

    if request.config.getoption("--update-images") or os.environ.get("XLA_MAGIC_UPDATE_IMAGES") == "1":
        return Path(__file__).resolve().parent.parent / "docs" / "images"
    return tmp_path_factory.mktemp("images")


@pytest.fixture
def marks(ip, tmp_path):
    """A fresh folder, also ``marks`` in the shell: a cell's ranks write a file there once they are in their loop."""
    ip.user_ns["marks"] = str(tmp_path)
    yield str(tmp_path)
    ip.user_ns.pop("marks", None)


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True) if alive(child.pid)}


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:80]
    except psutil.Error:
        return "(gone)"


def _under_one_of(pid: int, others: set[int]) -> bool:
    """``pid`` descends from one of ``others`` (a process a fixture of a wider scope started, say)."""
    try:
        return any(parent.pid in others for parent in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def _session_processes(session) -> set[int]:
    """The session's own launcher and what runs under it (kept across tests by design; the pool is checked apart)."""
    launcher = getattr(getattr(session, "host", None), "launcher", None)
    if launcher is None or not alive(launcher.pid):
        return set()
    try:
        return {launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _state(request) -> dict[str, Any]:
    shell = request.getfixturevalue("ip") if "ip" in request.fixturenames else None
    session = getattr(shell, "_xla_magic_session", None)
    return {
        "names": set(shell.user_ns) if shell is not None else None,
        "session": session,
        "listeners": list(session.listeners) if session is not None else None,
        "pool": session.pool if session is not None else None,
        "children": _children(),
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},  # pytest's own
        "temp": set(os.listdir(tempfile.gettempdir())),
    }


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After every test: nothing it added is left, and nothing it did not add was removed; else it fails, named.
    The names it added to the shared shell are removed (below), not failed: the shell is every test's notebook."""
    before = _state(request)
    yield
    stop_watching()  # a wait for an event that never came acts in no later test
    if "ip" in request.fixturenames:  # a failed one-shot cell's ranks kept for %debug go, as at the next cell
        session = getattr(request.getfixturevalue("ip"), "_xla_magic_session", None)
        if session is not None:
            session.release_post_mortem()
    after = _state(request)
    leaks = []
    if before["names"] is not None:
        # The shared shell is every test's notebook: a name a test left in it would be shipped to the next
        # test's ranks in place of their own (a pool's ``kept`` read in a later cell, say). So each test's
        # own names go with it; IPython's history names (_, _i3, ...) are no test's.
        shell = request.getfixturevalue("ip")
        for name in after["names"] - before["names"]:
            if not name.startswith("_"):
                shell.user_ns.pop(name, None)
    session = after["session"]
    if session is not None and session is before["session"]:
        from xla_magic.notebook import status

        panel = status._panels.get(session)
        ours = [panel.on_record] if panel is not None else []  # the status panel's own, once it is shown
        added = [f for f in after["listeners"] if f not in before["listeners"] and f not in ours]
        removed = [f for f in before["listeners"] if f not in after["listeners"]]
        if added:
            leaks.append(f"listeners it added: {added}")
        if removed:
            leaks.append(f"listeners it removed that it did not add (the status panel's?): {removed}")
        # A restart of a module's pool is no new pool, nor is the pool across hosts a hosts module keeps
        # (tests/hosts_fixtures.py's pool_of_the_module stops it with the module).
        kept_by_module = "pool_of_the_module" in request.fixturenames
        if before["pool"] is None and after["pool"] is not None and not kept_by_module:
            leaks.append(f"a pool it started ({after['pool'].state}); stop it in a finally")
    new = {pid for pid in after["children"] - before["children"] - _session_processes(session)
           if not _under_one_of(pid, before["children"])}  # a module's server starting its kernel, say
    if session is not None and session.current_pool() is not None:
        new = set()  # a pool across hosts (its module keeps one) owns processes of many kinds: not told apart here
    if new:
        left = wait_gone(new)  # what the test ended may take a moment to go
        if left:
            leaks.append(f"child processes: {[(pid, _command(pid)) for pid in left]}")
    changed = {k for k in before["environ"].keys() | after["environ"].keys()
               if before["environ"].get(k) != after["environ"].get(k)}
    if changed:
        leaks.append(f"environment variables it set or changed: {sorted(changed)} (use monkeypatch)")
    # Ours and the tests' (xla_magic-...), but the session's own folder; a library's cache made on first use
    # (matplotlib's, say) lives as long as the process, and is no test's doing.
    workdir = session.host.workdir._path if session is not None else None
    files = {name for name in after["temp"] - before["temp"]
             if name.startswith("xla_magic-") and os.path.join(tempfile.gettempdir(), name) != workdir
             and os.path.exists(os.path.join(tempfile.gettempdir(), name))}
    if files:
        leaks.append(f"temporary files: {sorted(files)} in {tempfile.gettempdir()} (use tmp_path)")
    if leaks:
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(leaks), pytrace=False)


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
