"""SPMD cells for real: one process drives 8 XLA CPU devices, through the shell and a real kernel.

``%%xla_spawn --spmd`` and ``%xla_pool start --spmd`` are one more placement
of the same ranks and requests, so what holds for rank cells is checked here
for the SPMD process: its value (one value, tensors whole on the CPU), its
tagged output, the sharding picture, faults, interrupts, timeouts, and every
bad input. No test here needs a pool running (those that start one stop it);
the SPMD pool's own tests, in one pool for their module, are in test_spmd_pool.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
import torch
from IPython.core.error import UsageError

from conftest import kernel_is_xla_free
from helpers import execute, interrupt_once_written, notebook, pool_magic, spawn_cell, stream, strip_ansi
from xla_magic.cell import sharding
from xla_magic.runs.errors import RankError, RunInterrupted

ROOT = Path(__file__).resolve().parent.parent


# --- one-shot SPMD cells ------------------------------------------------------------

MATMUL = """
import torch
import torch_xla.distributed.spmd as xs
xa, xb = a.to(device), b.to(device)
xs.mark_sharding(xa, mesh, ("data", None))
wrapped = xs.mark_sharding(xb, mesh, (None, "model"))
print("mesh", tuple(mesh.mesh_shape), mesh.axis_names, world_size, mesh.get_logical_mesh().tolist())
print("before the picture")
show_sharding(xa)
print("after the picture")
{"product": xa @ xb, "a": xa, "b": wrapped, "is_global": xs.get_global_mesh() is mesh}
"""


def test_a_sharded_matmul_equals_the_kernels_and_comes_back_as_one_value(ip):
    torch.manual_seed(0)
    a, b = torch.randn(16, 8), torch.randn(8, 12)
    ip.user_ns.update(a=a, b=b)
    value, out, _err, outputs = spawn_cell(ip, "--spmd --mesh 4,2", MATMUL)
    assert isinstance(value, dict)  # one value, not a list by rank
    assert value["product"].device.type == "cpu" and torch.allclose(value["product"], a @ b, atol=1e-5)
    assert torch.equal(value["a"], a)  # annotated in place, whole on the CPU
    assert type(value["b"]) is torch.Tensor and torch.equal(value["b"], b)  # mark_sharding's wrapper, whole
    assert value["is_global"] is True
    assert out.splitlines() == [
        "[spmd] mesh (4, 2) ('data', 'model') 8 [[0, 1], [2, 3], [4, 5], [6, 7]]",
        "[spmd] before the picture",
        "[spmd] after the picture",
    ]
    (picture,) = outputs
    assert picture.data["text/plain"].startswith("float32[16, 8] · mesh data=4 × model=2 · dim 0 over data")
    boxes = [" ".join(line.strip("│").split()) for line in picture.data["text/plain"].splitlines() if line.startswith("│")]
    assert [box for box in boxes if box] == ["CPU 0-1", "4×8", "CPU 2-3", "4×8", "CPU 4-5", "4×8", "CPU 6-7", "4×8"]
    assert kernel_is_xla_free()


def test_the_default_mesh_is_one_data_axis_over_the_devices_asked_for(ip):
    value, out, _err, _ = spawn_cell(ip, "--spmd --devices 4", (
        "import torch_xla.runtime as xr\n"
        "print('spmd on:', xr.is_spmd())\n"
        "(tuple(mesh.mesh_shape), mesh.axis_names, world_size, xr.global_runtime_device_count(), rank)"
    ))
    assert value == ((4,), ("data",), 4, 4, 0)
    assert out == "[spmd] spmd on: True\n"
    run = ip._xla_magic_session.history[-1]
    assert (run.devices, run.mesh, list(run.ranks)) == (4, "data=4", [0])


def test_an_exception_shows_the_cells_traceback_tagged_spmd(ip):
    with pytest.raises(RankError) as raised:
        spawn_cell(ip, "--spmd", "x = 1\nraise ValueError(f'no luck on {world_size} devices')\n")
    error = raised.value
    assert str(error).startswith("the SPMD process failed: ValueError: no luck on 8 devices")
    lines = [strip_ansi(line) for line in error.render_lines()]
    assert "[spmd]     raise ValueError(f'no luck on {world_size} devices')" in lines
    assert lines[-1] == ("%debug opens the SPMD process's frame where it failed: its process is kept for it until "
                         "the next cell, or until you leave the debugger.")
    assert all(line.startswith("[spmd]") for line in lines[1:-1])
    assert "the SPMD process failed" in lines[0]


def test_a_timeout_stops_the_spmd_process(ip):
    with pytest.raises(RankError, match=r"timed out after 3 s \(--timeout\)"):
        spawn_cell(ip, "--spmd --timeout 3", "print('spinning', flush=True)\nwhile True:\n    pass\n")
    pid = ip._xla_magic_session.history[-1].ranks[0].pid
    assert pid is not None and not psutil.pid_exists(pid)


def test_the_stop_button_stops_a_one_shot_spmd_cell(ip, marks):
    pressed = interrupt_once_written(marks, 1)
    with pytest.raises(RunInterrupted, match="the SPMD process was stopped"):
        spawn_cell(ip, "--spmd --devices 2", "open(f'{marks}/running', 'w').close()\nwhile True:\n    spin = 1\n")
    assert pressed.is_set()
    pid = ip._xla_magic_session.history[-1].ranks[0].pid
    assert pid is not None and not psutil.pid_exists(pid)


def test_a_killed_spmd_process_is_reported_by_signal(ip):
    with pytest.raises(RankError, match="the SPMD process died: SIGKILL"):
        spawn_cell(ip, "--spmd --devices 2", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")


# --- bad input: a UsageError before anything starts ---------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        ("--spmd --mesh 3", "--mesh 3 holds 3 devices but the cell runs on 8 devices"),
        ("--spmd --devices 4 --mesh 4,2", "--mesh 4,2 holds 8 devices but the cell runs on 4 devices"),
        ("--spmd --mesh 4,2 --axes data", "--axes data names 1 axis but --mesh 4,2 has 2 axes"),
        ("--spmd --axes data,model", "--axes data,model names 2 axes but the default mesh"),
        ("--mesh 4,2", "--mesh shapes the mesh of an SPMD cell: add --spmd"),
        ("--axes data", "--axes shapes the mesh of an SPMD cell: add --spmd"),
    ],
)
def test_bad_spmd_options_are_usage_errors_before_anything_starts(ip, line, message):
    session = ip._xla_magic_session
    runs = session.runs.run_count
    with pytest.raises(UsageError) as raised:
        ip.run_cell_magic("xla_spawn", line, "1")
    assert type(raised.value) is UsageError and message in str(raised.value), str(raised.value)
    assert session.runs.run_count == runs  # nothing was sent anywhere


@pytest.mark.parametrize(
    "line, message",
    [
        ("start --mesh 4,2", "--mesh shapes the mesh of an SPMD cell: add --spmd"),
        ("start --spmd --mesh 16", "--mesh 16 holds 16 devices but the cell runs on 8 devices"),
        ("push a --spmd", "--spmd, --mesh and --axes go with %xla_pool start and restart only"),
    ],
)
def test_bad_spmd_pool_options_are_usage_errors(ip, line, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_line_magic("xla_pool", line)
    assert ip._xla_magic_session.pool is None


def test_spmd_against_a_running_rank_pool_says_what_to_do(ip):
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        with pytest.raises(UsageError) as raised:
            ip.run_cell_magic("xla_spawn", "--spmd", "1")
        assert type(raised.value) is UsageError
        assert "a pool of 2 ranks (one process per device) is running, so an --spmd cell cannot run in it" in str(
            raised.value
        )
        assert "%xla_pool restart --spmd" in str(raised.value) and "--fresh" in str(raised.value)
        with pytest.raises(UsageError, match="so an --spmd cell cannot run in it"):
            ip.run_line_magic("xla_pool", "start --spmd")
        # --fresh: a new SPMD process beside the rank pool (on CPU nothing holds the devices).
        value, out, _, _ = spawn_cell(ip, "--spmd --fresh --devices 2", "print('beside the pool')\nworld_size")
        assert (value, out) == (2, "[spmd] beside the pool\n")
    finally:
        pool_magic(ip, "stop")


# --- a real kernel ----------------------------------------------------------------------------


def test_spmd_cells_and_pool_in_a_real_kernel():
    nb = execute(notebook(
        "%load_ext xla_magic",
        "%%xla_spawn --spmd --mesh 4,2\n"
        "import torch, torch_xla.distributed.spmd as xs\n"
        "t = torch.arange(64.0).reshape(8, 8).to(device)\n"
        "xs.mark_sharding(t, mesh, ('data', 'model'))\n"
        "print('before')\n"
        "show_sharding(t)\n"
        "print('after')\n"
        "t.sum()",
        "%xla_pool start --spmd --devices 4",
        "%%xla_spawn\nkept = world_size * 10",
        "%%xla_spawn\nkept + 1",
        "%xla_pool stop",
    ))
    one_shot = nb.cells[1]
    kinds = [output.output_type for output in one_shot.outputs]
    assert kinds.index("display_data") > 0 and kinds[-1] == "execute_result"
    before = "".join(o.text for o in one_shot.outputs[: kinds.index("display_data")] if o.output_type == "stream")
    assert "[spmd] before" in before and "[spmd] after" not in before  # the picture came where it was asked for
    assert "[spmd] after" in stream(one_shot, "stdout")
    picture = one_shot.outputs[kinds.index("display_data")]
    assert '<div class="xla-magic-sharding"' in picture.data["text/html"]
    assert one_shot.outputs[-1].data["text/plain"] == "tensor(2016.)"  # one value
    assert nb.cells[4].outputs[-1].data["text/plain"] == "41"
    assert "pool stopped" in stream(nb.cells[5], "stdout")


# A kernel that started XLA is refused SPMD cells (an SPMD pool's and a fresh one) as rank cells: in the same
# notebook as the one-shot cell's refusal, tests/test_kernel.py's
# test_kernel_that_initialised_xla_is_refused_with_a_way_out (one kernel that initialises XLA, not two).


def test_default_axes_stay_in_step_with_the_launcher_side():
    from xla_magic.launcher import spmd

    assert sharding.SpmdOptions().layout(8) == ((8,), spmd.DEFAULT_AXES[1])
    assert sharding.SpmdOptions("4,2", None).options() == "--mesh 4,2"


def test_the_docs_fsdpv2_example_shows_what_it_prints(ip):
    text = (ROOT / "docs" / "spmd.md").read_text()
    example = re.search(r"```python\n(%%xla_spawn --spmd[^\n]*)\n(.*?)```\n```text\n(.*?)```", text, re.DOTALL)
    assert example, "docs/spmd.md's SPMD example and its output are missing"
    line, body, shown = example.group(1), example.group(2), example.group(3).splitlines()
    value, out, err, outputs = spawn_cell(ip, line[len("%%xla_spawn"):], body)
    # stdout lines exactly; stderr's (the two warnings the page explains) but for what XLA's log prefix
    # says of when and where: XLA logs through tsl's LogMessage (xla/tsl/platform/default/logging.cc,
    # GenerateLogMessage: "<date> <time>.<us>: <severity> <file>:<line>] <text>"), and its line numbers move
    # with every XLA build. The file and the words must match.
    xla_log = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) (\S+):\d+\] ")

    def when_and_where_aside(line: str) -> str:
        return xla_log.sub(r"<time>: \1 \2:<line>] ", strip_ansi(line))

    err_lines = [when_and_where_aside(line) for line in err.splitlines()]
    warnings = [line for line in shown if " UserWarning: " in line or "GSPMD" in line]
    assert len(warnings) == 2 and all(when_and_where_aside(line) in err_lines for line in warnings), err_lines
    assert out.splitlines() == [line for line in shown if line.startswith("[spmd]") and line not in warnings]
    assert repr(value) == shown[-1]
    picture = outputs[0].data["text/plain"].splitlines()
    assert picture[0] in shown and picture[1:4] == shown[shown.index(picture[0]) + 1 : shown.index(picture[0]) + 4]
