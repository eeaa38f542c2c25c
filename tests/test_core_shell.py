"""%%xla_spawn through a real IPython shell: output, results, shipping, errors."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from conftest import kernel_is_xla_free
from helpers import cell_name_aside, strip_ansi
from xla_magic.notebook.syntax_error import CellSyntaxError
from xla_magic.runs.errors import RankError

HELLO = """
import torch
x = torch.ones(3, device=device) * rank
print("hello from", rank)
float(x.sum().cpu())
"""


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_cpu_backend_tags_every_line_and_gathers_results(spawn, devices):
    run = spawn(f"--devices {devices} --backend cpu", HELLO)
    assert run.value == [3.0 * r for r in range(devices)]
    for r in range(devices):
        assert f"[rank {r}] hello from {r}" in run.lines()
    assert kernel_is_xla_free()


def test_out_stores_results_and_no_expression_shows_nothing(ip, spawn):
    run = spawn("--devices 2 --out gathered", "y = rank * 10\ny")
    assert run.value == [0, 10]
    assert ip.user_ns["gathered"] == [0, 10]
    quiet = spawn("--devices 2", "y = rank")
    assert quiet.value is None


def test_trailing_semicolon_suppresses_the_result(spawn):
    assert spawn("--devices 2", "rank;").value is None


def test_xla_tensors_come_back_on_the_cpu(spawn):
    import torch

    run = spawn("--devices 2", "import torch\ntorch.arange(3, device=device) + rank")
    assert all(t.device.type == "cpu" for t in run.value)
    assert torch.equal(run.value[1], torch.tensor([1, 2, 3]))


def test_notebook_functions_lambdas_and_classes_travel_by_value(ip, spawn):
    ip.run_cell(
        "def double(v):\n    return 2 * v\n"
        "triple = lambda v: 3 * v\n"
        "class Box:\n    def __init__(self, v):\n        self.v = v\n"
        "    def where(self):\n        return (self.v, rank)\n"
        "offset = 100\n"
    )
    run = spawn("--devices 2", "[double(rank), triple(rank) + offset, Box(rank).where()]")
    assert run.value == [[0, 100, (0, 0)], [2, 103, (1, 1)]]


def test_names_read_in_nested_scopes_are_shipped(ip, spawn):
    ip.run_cell("scale = 7")
    run = spawn("--devices 2", "def inner():\n    return [scale * rank for _ in range(1)]\ninner()")
    assert run.value == [[0], [7]]


def test_syntax_error_launches_nothing(ip, spawn):
    session = ip._xla_magic_session
    before = len(session.history)
    with pytest.raises(CellSyntaxError) as info:
        spawn("--devices 2", "x = (1,\nprint(x")
    assert isinstance(info.value.error, SyntaxError) and info.value.__cause__ is info.value.error
    assert len(session.history) == before


def test_a_syntax_error_shows_as_in_a_plain_cell(ip):
    """The cell's line, the caret and the message: none of the frames that reached the magic."""
    def shown(cell: str) -> str:
        with capture_output() as captured:
            ip.run_cell(cell)
        return cell_name_aside(strip_ansi(captured.stdout + captured.stderr))

    body = "x = 1\ny = (2 +\nz = 3"
    spawned = shown("%%xla_spawn --devices 2\n" + body)
    plain = shown("pass\n" + body)  # the same line of its cell
    assert spawned == plain
    assert "line 3" in plain and "y = (2 +" in plain and "^" in plain and "SyntaxError" in plain
    assert "Traceback" not in spawned and "magics.py" not in spawned


def test_unpicklable_variable_is_named_before_launch(ip, spawn):
    import threading

    ip.user_ns["held_lock"] = threading.Lock()
    session = ip._xla_magic_session
    before = len(session.history)
    with pytest.raises(UsageError, match=r"'held_lock' \(_thread\.lock\)"):
        spawn("--devices 2", "print(held_lock)")
    assert len(session.history) == before


def test_raising_rank_shows_its_tagged_traceback_with_cell_lines(spawn):
    cell = "a = 1\nif rank == 1:\n    raise ValueError(f'bad rank {rank}')\nrank"
    with pytest.raises(RankError) as info:
        spawn("--devices 2", cell)
    error = info.value
    assert error.ranks == [1]
    rendered = "\n".join(error._render_traceback_())
    assert "[rank 1]" in rendered
    assert "ValueError: bad rank 1" in rendered
    assert "raise ValueError(f'bad rank {rank}')" in rendered  # the cell's own line
    assert 'line 3' in rendered


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("--devices 0", "at least 1"),
        ("--devices -2", "at least 1"),
        ("--devices many", "whole number"),
        ("--devices 65 --backend cpu", "1 to 64"),
        ("--backend gpu", "invalid choice"),
        ("--out 3x", "variable name"),
        ("--timeout -1", "more than 0"),
    ],
)
def test_bad_arguments_are_usage_errors(spawn, line, pattern):
    with pytest.raises(UsageError, match=pattern) as info:
        spawn(line, "rank")
    assert type(info.value) is UsageError


def test_help_shows_the_options(ip):
    from IPython.core.magic_arguments import construct_parser  # noqa: F401

    doc = ip.find_cell_magic("xla_spawn").__doc__
    for option in ("--devices", "--backend", "--out", "--timeout"):
        assert option in doc


def test_stdout_stderr_logging_and_fd_writes_are_all_tagged(spawn):
    cell = (
        "import sys, os, logging\n"
        "print('py-out')\n"
        "print('py-err', file=sys.stderr)\n"
        "logging.basicConfig(format='%(message)s', force=True)\n"
        "logging.getLogger('t').warning('log-line')\n"
        "os.write(1, b'fd-out\\n')\n"
        "os.write(2, b'fd-err\\n')\n"
        "import ctypes; libc = ctypes.CDLL(None); libc.printf(b'c-printf\\n'); libc.fflush(None)\n"
    )
    run = spawn("--devices 2", cell)
    for r in range(2):
        assert f"[rank {r}] py-out" in run.stdout
        assert f"[rank {r}] fd-out" in run.stdout
        assert f"[rank {r}] c-printf" in run.stdout
        for text in ("py-err", "log-line", "fd-err"):
            assert re.search(rf"\[rank {r}\]\S* {text}", run.stderr), text


def test_order_is_kept_and_nothing_is_dropped(spawn):
    run = spawn("--devices 4", "for i in range(3000):\n    print(rank, i)")
    logs = dict(re.findall(r"\[rank (\d)\] \.\.\. more stdout .* every line goes to (\S+)", run.stdout))
    assert sorted(logs) == ["0", "1", "2", "3"]
    for r in range(4):
        shown = [line for line in run.lines() if line.startswith(f"[rank {r}] {r} ")]
        assert [int(line.split()[-1]) for line in shown] == list(range(1000))
        with open(logs[str(r)]) as log:
            assert log.read().splitlines() == [f"{r} {i}" for i in range(3000)]
        assert f"(complete log: {logs[str(r)]})" in run.stdout


def test_unfinished_line_is_flushed_and_carriage_returns_settle(spawn):
    cell = (
        "import sys\n"
        "for i in range(5):\n"
        "    sys.stdout.write(f'\\rprogress {i}'); sys.stdout.flush()\n"
        "sys.stdout.write('\\n')\n"
        "sys.stdout.write('tail without newline')\n"
    )
    run = spawn("--devices 2", cell)
    for r in range(2):
        assert f"[rank {r}] progress 4" in run.lines()
        assert f"[rank {r}] tail without newline" in run.lines()
    assert "progress 2" not in run.stdout


def test_rank_names_reach_shipped_helpers(ip, spawn):
    ip.run_cell("def whoami():\n    return (rank, world_size, str(device).startswith('xla'))")
    run = spawn("--devices 2", "whoami()")
    assert run.value == [(0, 2, True), (1, 2, True)]


def test_strategy_from_the_package_is_the_rank_strategy(spawn):
    run = spawn("--devices 2", "from xla_magic import strategy as s\n(s.global_rank, s.world_size)")
    assert run.value == [(0, 2), (1, 2)]


def test_strategy_in_the_kernel_refuses_clearly():
    from xla_magic import strategy
    from xla_magic.notebook.strategy import OutsideSpawnError

    with pytest.raises(OutsideSpawnError, match="inside a %%xla_spawn cell"):
        strategy.root_device
    assert kernel_is_xla_free()


def test_barrier_and_all_gather_on_the_simulation(spawn):
    cell = "import torch\nstrategy.barrier()\nstrategy.all_gather(torch.tensor([rank, rank * 2], device=device)).tolist()"
    run = spawn("--devices 4", cell)
    expected = [[r, 2 * r] for r in range(4)]
    assert run.value == [expected] * 4


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_tpu_launch_path_runs_as_cpu_threads_with_right_tags(spawn, monkeypatch, devices):
    """The exact xmp.spawn(start_method="fork") path, as threads on CPU."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    cell = (
        "import threading, torch\n"
        "print('thread rank', rank)\n"
        "x = torch.ones(2, device=device) * rank\n"
        "(rank, world_size, threading.current_thread().name != 'MainThread' or world_size == 1, float(x.sum().cpu()))"
    )
    run = spawn(f"--backend tpu --devices {devices}", cell)
    assert run.value == [(r, devices, True, 2.0 * r) for r in range(devices)]
    for r in range(devices):
        assert run.lines().count(f"[rank {r}] thread rank {r}") == 1
    assert kernel_is_xla_free()


def test_tpu_backend_without_a_tpu_says_what_to_do(spawn, monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(UsageError, match="no TPU was found.*--backend cpu"):
        spawn("--backend tpu", "rank")


def test_modules_travel_by_name(ip, spawn):
    ip.run_cell("import json as kernel_json\nimport os.path as kernel_path")
    run = spawn("--devices 2", "(kernel_json.dumps({'r': rank}), kernel_path.basename('/a/b'))")
    assert run.value == [('{"r": 0}', "b"), ('{"r": 1}', "b")]


# A launcher killed between cells is replaced on the next cell: tests/test_launcher.py's
# test_a_launcher_that_does_not_take_a_cell_is_replaced_without_leaks (its second half).


# %unload_ext ending every process (the launcher too) and a reload that works: with a pool running, in
# tests/test_pool.py's test_unload_stops_the_pool_and_every_rank (one unload and restart of the launcher, not two).


def magics_from_xla_magic(ip) -> set[tuple[str, str]]:
    """(kind, name) of every magic in the shell whose function is xla_magic's, found by its module."""
    return {(kind, name) for kind, table in ip.magics_manager.magics.items() for name, bound in table.items()
            if getattr(getattr(bound, "__func__", bound), "__module__", "").startswith("xla_magic")}


def test_unload_removes_every_magic_the_extension_registered(ip):
    registered = magics_from_xla_magic(ip)
    assert {("cell", "xla_spawn"), ("line", "xla_stacks"), ("line", "xla_pool")} <= registered
    ip.run_line_magic("unload_ext", "xla_magic")
    try:
        assert magics_from_xla_magic(ip) == set()
        with capture_output() as captured:
            ip.run_cell("%xla_stacks")
        assert "Line magic function `%xla_stacks` not found" in captured.stdout + captured.stderr
    finally:
        ip.run_line_magic("load_ext", "xla_magic")
    assert magics_from_xla_magic(ip) == registered


def test_a_cell_ending_in_print_shows_no_list_of_nones(ip, spawn):
    run = spawn("--devices 2 --out printed", "print('only output', rank)")
    assert run.value is None
    assert ip.user_ns["printed"] == [None, None]
    assert "[rank 1] only output 1" in run.lines()


def test_libtpu_in_the_kernel_is_seen_in_its_memory_map(tmp_path):
    from xla_magic.ranks import probe

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 42 /usr/lib/python3/site-packages/libtpu/libtpu.so\n")
    assert probe.libtpu_loaded(str(maps))
    maps.write_text("7f00-7f10 r-xp 0 08:01 42 /usr/lib/libc.so.6\n")
    assert not probe.libtpu_loaded(str(maps))
    assert not probe.libtpu_loaded()  # this process: torch is here, libtpu is not


def test_progress_updates_keep_only_the_live_part_of_a_line():
    import io
    from contextlib import redirect_stdout

    from xla_magic.runs.output import TaggedOutput

    output = TaggedOutput()
    shown = io.StringIO()
    with redirect_stdout(shown):
        for i in range(20_000):
            output.feed(0, "stdout", f"\rstep {i}".encode())
        partial = output._streams[(0, "stdout")].partial
        output.feed(0, "stdout", b"\rab\r")
        output.feed(0, "stdout", b"xyz\n")
    assert partial == "\rstep 19999"  # not 20,000 updates kept in memory
    assert shown.getvalue() == "[rank 0] xyz\n"


def test_a_name_the_cell_binds_before_reading_is_not_shipped(ip, spawn):
    import threading

    ip.user_ns["held"] = threading.Lock()  # unpicklable, but the cell makes its own
    ip.user_ns["steps"] = 3
    try:
        run = spawn("--devices 2", "held = {'rank': rank}\nfor _ in range(steps):\n    pass\nheld['rank'] * steps")
        assert run.value == [0, 3]
        with pytest.raises(UsageError, match="'held'"):
            spawn("--devices 2", "print(held)\nheld = 1")  # read first: the notebook's value is needed
    finally:
        del ip.user_ns["held"], ip.user_ns["steps"]


@pytest.mark.parametrize(
    "cell, shown",
    [("rank  # a comment;", True), ("rank;  # quiet", False), ("rank;", False), ("x = ';'\nx", True)],
)
def test_only_a_real_trailing_semicolon_hides_the_result(spawn, cell, shown):
    assert (spawn("--devices 1", cell).value is not None) is shown
