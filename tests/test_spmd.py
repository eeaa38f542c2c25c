"""The SPMD placement's parts: the SPMD process (real, 8 XLA CPU devices) and the kernel side.

Each SPMD test runs a program the way the supervisor will run the placement:
a fresh interpreter imports torch and torch_xla (as the launcher does), forks,
and the child applies ``spmd.environment`` and calls ``spmd.setup`` before
anything touches the runtime, then runs a cell body with the names setup
returned. The body records facts; the assertions are here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from IPython.core.error import UsageError

from conftest import kernel_is_xla_free
from helpers import FSDP_STEPS, FSDP_WRAP, reference_training
from xla_magic.cell import sharding
from xla_magic.notebook import sharding_view

DEVICES = 8

PROGRAM = """
import json, os, sys
import torch, torch_xla  # imported before the placement's environment, as in the launcher
from xla_magic.launcher import spmd

read_end, write_end = os.pipe()
child = os.fork()
if child == 0:
    code = 1
    try:
        os.close(read_end)
        os.environ.update(spmd.environment({devices}, on_cpu=True))
        names = spmd.setup({devices}, {mesh_shape!r}, {axis_names!r})
        namespace = dict(names, facts={{}})
        exec(compile(sys.argv[1], "<cell>", "exec"), namespace)
        os.write(write_end, json.dumps(namespace["facts"]).encode())
        code = 0
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)
os.close(write_end)
with os.fdopen(read_end, "rb") as reader:
    data = reader.read()
_, status = os.waitpid(child, 0)
print("FACTS " + data.decode(), flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_spmd(body: str, mesh_shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None) -> dict:
    """Run ``body`` in a fresh SPMD process over 8 CPU devices; the facts it recorded."""
    env = dict(os.environ)
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_USE_SPMD"):
        env.pop(name, None)  # spmd.environment must be what provides them
    program = PROGRAM.format(devices=DEVICES, mesh_shape=mesh_shape, axis_names=axis_names)
    done = subprocess.run(
        [sys.executable, "-c", program, textwrap.dedent(body)], env=env, capture_output=True, text=True, timeout=280
    )
    facts = [line[len("FACTS ") :] for line in done.stdout.splitlines() if line.startswith("FACTS ")]
    assert done.returncode == 0 and facts and facts[0], f"the SPMD program failed:\n{done.stderr[-4000:]}"
    return json.loads(facts[0])


# --- the SPMD process -------------------------------------------------------------

MESH_4_2 = """
import warnings
import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
from xla_magic.launcher import rank as rank_module, spmd

facts["names"] = {"rank": rank, "world_size": world_size, "device": str(device)}
facts["mesh"] = {
    "shape": list(mesh.mesh_shape),
    "axes": list(mesh.axis_names),
    "ids": mesh.get_logical_mesh().tolist(),
    "is_global": xs.get_global_mesh() is mesh,
}
facts["runtime"] = {"devices": xr.global_runtime_device_count(), "spmd": xr.is_spmd()}

with warnings.catch_warnings(record=True) as caught:  # what every SPMD script from the docs starts with
    warnings.simplefilter("always")
    xr.use_spmd()
facts["use_spmd_again_warned"] = [str(w.message) for w in caught]

torch.manual_seed(0)
a, b = torch.randn(16, 8), torch.randn(8, 12)
xa, xb = a.to(device), b.to(device)
xs.mark_sharding(xa, mesh, ("data", None))
xs.mark_sharding(xb, mesh, (None, "model"))
product = xa @ xb
whole = spmd.whole_on_cpu(product)
facts["matmul"] = {
    "type": type(whole).__name__, "device": str(whole.device), "shape": list(whole.shape),
    "max_error": (whole - a @ b).abs().max().item(),
}

t = torch.arange(64.0).reshape(8, 8).to(device)
wrapped = xs.mark_sharding(t, mesh, ("data", "model"))
facts["tiled"] = spmd.describe_sharding(t)
facts["tiled_wrapper"] = spmd.describe_sharding(wrapped)
import pickle
expected = torch.arange(64.0).reshape(8, 8)
back = rank_module.dump_result({"t": spmd.whole_on_cpu(wrapped)})
facts["wrapper_back_whole"] = torch.equal(pickle.loads(back)["t"], expected)
# The tensor mark_sharding annotated in place: the result path as it is brings it back whole.
facts["annotated_back_whole"] = torch.equal(pickle.loads(rank_module.dump_result(t)), expected)

rows = torch.ones(8, 4).to(device)
xs.mark_sharding(rows, mesh, ("data", None))
facts["rows"] = spmd.describe_sharding(rows)
facts["replicated"] = spmd.describe_sharding(torch.ones(3, device=device))
facts["pending_product"] = spmd.describe_sharding(xa @ xb)

# A mesh built the way the docs build one, over the devices in reverse order.
reverse = xs.Mesh(np.arange(world_size)[::-1].copy(), (4, 2), ("x", "y"))
r = torch.zeros(8, 8).to(device)
xs.mark_sharding(r, reverse, ("x", "y"))
facts["reverse"] = spmd.describe_sharding(r, reverse)
facts["reverse_without_its_mesh"] = spmd.describe_sharding(r)

uneven = torch.zeros(6, 5).to(device)
xs.mark_sharding(uneven, mesh, (None, "data"))
facts["uneven"] = spmd.describe_sharding(uneven)
cube_mesh = xs.Mesh(np.arange(world_size), (2, 2, 2), ("a", "b", "c"))
cube = torch.zeros(4, 4, 2).to(device)
xs.mark_sharding(cube, cube_mesh, ("a", "b", "c"))
facts["cube"] = spmd.describe_sharding(cube, cube_mesh)
try:
    spmd.describe_sharding(torch.ones(2))
except TypeError as exc:
    facts["cpu_tensor_error"] = str(exc)
"""


@pytest.fixture(scope="module")
def mesh_4_2() -> dict:
    return run_spmd(MESH_4_2, (4, 2), ("data", "model"))


def test_mesh_4_2_gives_that_mesh_as_the_global_mesh(mesh_4_2):
    assert mesh_4_2["names"] == {"rank": 0, "world_size": DEVICES, "device": "xla:0"}
    assert mesh_4_2["mesh"] == {
        "shape": [4, 2],
        "axes": ["data", "model"],
        "ids": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "is_global": True,
    }
    assert mesh_4_2["runtime"] == {"devices": DEVICES, "spmd": True}


def test_a_second_use_spmd_from_script_code_is_quiet(mesh_4_2):
    assert mesh_4_2["use_spmd_again_warned"] == []


def test_a_sharded_matmul_equals_the_cpu_matmul_and_comes_back_whole(mesh_4_2):
    matmul = mesh_4_2["matmul"]
    assert matmul["type"] == "Tensor" and matmul["device"] == "cpu" and matmul["shape"] == [16, 12]
    assert matmul["max_error"] < 1e-5


def test_sharded_tensors_come_back_whole_through_the_result_pickler(mesh_4_2):
    assert mesh_4_2["annotated_back_whole"] is True
    assert mesh_4_2["wrapper_back_whole"] is True  # mark_sharding's XLAShardedTensor, through whole_on_cpu


def test_describe_a_tensor_sharded_over_data_and_model(mesh_4_2):
    tiled = mesh_4_2["tiled"]
    assert tiled["shape"] == [8, 8] and tiled["dtype"] == "float32" and tiled["itemsize"] == 4
    assert tiled["devices"] == DEVICES and tiled["platform"] == "CPU"
    assert tiled["grid"] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    assert tiled["ranges"] == [[[0, 2], [2, 4], [4, 6], [6, 8]], [[0, 4], [4, 8]]]
    assert tiled["mesh_shape"] == [4, 2] and tiled["axis_names"] == ["data", "model"]
    assert tiled["partition"] == [["data"], ["model"]]
    assert tiled["replicated"] is False
    assert tiled["spec"].startswith("{devices=[4,2]")
    assert mesh_4_2["tiled_wrapper"] == tiled


def test_describe_partial_replication_and_full_replication(mesh_4_2):
    rows = mesh_4_2["rows"]
    assert rows["grid"] == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert rows["partition"] == [["data"], []]
    assert rows["replicated"] is False
    replicated = mesh_4_2["replicated"]
    assert replicated["grid"] == [list(range(DEVICES))]
    assert replicated["replicated"] is True and replicated["partition"] == [[]]


def test_describe_a_pending_result_computes_it_first(mesh_4_2):
    pending = mesh_4_2["pending_product"]
    # (data, None) @ (None, model): the compiler shards the product over both axes.
    assert pending["grid"] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    assert pending["partition"] == [["data"], ["model"]]


def test_describe_follows_the_device_order_of_the_mesh(mesh_4_2):
    reverse = mesh_4_2["reverse"]
    assert reverse["grid"] == [[[7], [6]], [[5], [4]], [[3], [2]], [[1], [0]]]
    assert reverse["partition"] == [["x"], ["y"]]
    # Against the global (data, model) mesh the same layout is explained by no axes.
    assert mesh_4_2["reverse_without_its_mesh"]["partition"] is None
    assert mesh_4_2["reverse_without_its_mesh"]["grid"] == reverse["grid"]


def test_describe_an_uneven_split_shows_the_padding_only_blocks(mesh_4_2):
    uneven = mesh_4_2["uneven"]
    assert uneven["ranges"] == [[[0, 6]], [[0, 2], [2, 4], [4, 5], [5, 5]]]
    assert uneven["grid"] == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert uneven["partition"] == [[], ["data"]]


def test_describe_refuses_a_cpu_tensor_saying_what_to_do(mesh_4_2):
    assert "XLA tensor" in mesh_4_2["cpu_tensor_error"] and ".to(device)" in mesh_4_2["cpu_tensor_error"]


DEFAULTS = """
import torch_xla.distributed.spmd as xs
from xla_magic.launcher import spmd
facts["mesh"] = {"shape": list(mesh.mesh_shape), "axes": list(mesh.axis_names), "is_global": xs.get_global_mesh() is mesh}
facts["world_size"] = world_size
try:
    spmd.setup(4, None, None)
except RuntimeError as exc:
    facts["wrong_count"] = str(exc)
for shape, names in (((4, 4), None), ((2, 2, 2), None), ((4, 2), ("data",))):
    try:
        spmd.setup(8, shape, names)
    except ValueError as exc:
        facts.setdefault("bad_layouts", []).append(str(exc))
"""


def test_the_default_mesh_is_one_data_axis_over_every_device():
    facts = run_spmd(DEFAULTS)
    assert facts["mesh"] == {"shape": [DEVICES], "axes": ["data"], "is_global": True}
    assert facts["world_size"] == DEVICES
    assert "asked for 4 devices but the runtime has 8" in facts["wrong_count"]
    assert facts["bad_layouts"] == [
        "a mesh of shape (4, 4) holds 16 devices, not 8",
        "a mesh of shape (2, 2, 2) needs axis names",
        "1 axis names ('data',) for a mesh of 2 axes (4, 2)",
    ]


# FSDPv2 as torch_xla's docs use it: shard the input over "fsdp", wrap the
# module, step an ordinary optimizer. The reference is the same model (the
# same seed) trained on the whole batch by plain torch in the test.
STEPS, LR = 5, 0.1
FSDP_DATA = """
torch.manual_seed(0)
inputs, targets = torch.randn(32, 16), torch.randn(32, 4)
module = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
"""
FSDP = """
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
from xla_magic.launcher import spmd
""" + f"STEPS, LR = {STEPS}, {LR}\n" + FSDP_DATA + FSDP_WRAP + FSDP_STEPS + """
facts["losses"] = losses
facts["trained"] = [spmd.whole_on_cpu(p).tolist() for p in model.parameters()]
facts["first_weight"] = spmd.describe_sharding(next(model.parameters()))
facts["wrapped_without_a_mesh_uses"] = list(FSDPv2(nn.Linear(8, 8)).__dict__["_mesh"].axis_names)
"""


def test_fsdpv2_training_equals_full_batch_sgd_on_one_process():
    import torch
    from torch import nn

    facts = run_spmd(FSDP, (DEVICES, 1), ("fsdp", "model"))
    made: dict = {"torch": torch, "nn": nn}
    exec(FSDP_DATA, made)  # the program's model and data, here
    reference = made["module"]
    expected_losses = reference_training(reference, made["inputs"], made["targets"], STEPS, LR)
    assert facts["losses"][-1] < facts["losses"][0]  # it did train
    assert max(abs(got - want) for got, want in zip(facts["losses"], expected_losses, strict=True)) < 1e-5
    trained = [torch.tensor(values) for values in facts["trained"]]
    assert max((got - want).abs().max().item() for got, want in zip(trained, reference.parameters(), strict=True)) < 1e-5
    # FSDPv2 really sharded the weights: Linear(16, 64)'s weight, rows over fsdp.
    weight = facts["first_weight"]
    assert weight["grid"] == [[[device]] for device in range(DEVICES)] and weight["partition"] == [["fsdp"], []]
    assert facts["wrapped_without_a_mesh_uses"] == ["fsdp", "model"]  # the global mesh


def test_environment_for_each_placement():
    from xla_magic.launcher import spmd

    assert spmd.environment(8, on_cpu=True) == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    assert spmd.environment(8, on_cpu=False) == {"PJRT_DEVICE": "TPU"}
    assert spmd.environment(1, on_cpu=False) == {
        "PJRT_DEVICE": "TPU",
        "TPU_VISIBLE_CHIPS": "0",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
    }
    assert kernel_is_xla_free()  # the module's import and environment() touch no torch_xla


# --- the kernel side: --mesh and --axes ----------------------------------------------


def test_both_sides_default_the_same_axis_names():
    # The kernel resolves --axes; setup's own defaults (for a caller that gives none) must agree.
    from xla_magic.launcher import spmd

    assert spmd.DEFAULT_AXES == sharding.DEFAULT_AXES


@pytest.mark.parametrize(
    "mesh, axes, layout",
    [
        (None, None, ((8,), ("data",))),
        ("4,2", None, ((4, 2), ("data", "model"))),
        (" 4, 2 ", "data, model", ((4, 2), ("data", "model"))),
        ("8,1", "fsdp,model", ((8, 1), ("fsdp", "model"))),
        (None, "fsdp", ((8,), ("fsdp",))),
        ("2,2,2", "dp,fsdp,tp", ((2, 2, 2), ("dp", "fsdp", "tp"))),
    ],
)
def test_mesh_layout_accepts(mesh, axes, layout):
    assert sharding.mesh_layout(mesh, axes, 8) == layout


@pytest.mark.parametrize(
    "mesh, axes, message",
    [
        ("4,4", None, "--mesh 4,4 holds 16 devices but the cell runs on 8 devices; give sizes whose product is 8, "
                      "such as --mesh 4,2 or --mesh 2,4"),
        ("3", None, "--mesh 3 holds 3 devices but the cell runs on 8 devices; give sizes whose product is 8, "
                    "such as --mesh 8"),
        ("4,x", None, "--mesh 4,x: x is not a number of devices; give the size of each axis, separated by "
                      "commas, as in --mesh 4,2"),
        ("4,,2", None, "--mesh 4,,2: an empty size is not a number of devices"),
        ("4.0,2", None, "--mesh 4.0,2: 4.0 is not a number of devices"),
        ("-4,-2", None, "--mesh -4,-2: -4 is not a number of devices"),
        ("", None, "--mesh : an empty size is not a number of devices"),
        ("0,8", None, "--mesh 0,8: every axis needs at least 1 device, as in --mesh 4,2"),
        ("4,2", "data", "--axes data names 1 axis but --mesh 4,2 has 2 axes; give one name per axis, "
                        "as in --axes data,model."),
        ("8", "data,model", "--axes data,model names 2 axes but --mesh 8 has 1 axis; give one name per axis, "
                            "as in --axes data."),
        (None, "data,model", "--axes data,model names 2 axes but the default mesh (8 devices in a row) has "
                             "1 axis; give --mesh too, as in --mesh 4,2."),
        ("2,2,2", None, "--mesh 2,2,2 has 3 axes; name them with --axes, as in --axes axis0,axis1,axis2"),
        ("4,2", "data,data", "--axes data,data names data more than once; each axis needs a name of its own"),
        ("2,2,2", "a,b,a", "--axes a,b,a names a more than once"),
        ("4,2", "data,", "--axes data,: an empty name is not an axis name; name each axis with a word, "
                         "separated by commas, as in --axes data,model"),
        ("4,2", "da ta,model", "--axes da ta,model: 'da ta' is not an axis name"),
        ("4,2", "data,2", "--axes data,2: '2' is not an axis name"),
    ],
)
def test_mesh_layout_refuses_with_a_usage_error_that_says_what_to_do(mesh, axes, message):
    with pytest.raises(UsageError) as raised:
        sharding.mesh_layout(mesh, axes, 8)
    assert type(raised.value) is UsageError
    assert str(raised.value).startswith(message), str(raised.value)


def test_suggested_meshes_fit_the_device_count():
    # Whatever a message suggests must itself be accepted.
    for devices in (1, 4, 6, 8, 12, 16):
        for dimensions in (1, 2, 3):
            for suggestion in sharding._layouts(devices, dimensions):
                names = ",".join(f"a{i}" for i in range(dimensions))
                assert sharding.mesh_layout(suggestion, names, devices)[0] == tuple(map(int, suggestion.split(",")))


# --- the kernel side: the picture ------------------------------------------------------

@pytest.fixture(scope="module")
def described(mesh_4_2) -> dict[str, dict]:
    """What describe_sharding said of real tensors on real meshes (the SPMD run above): the pictures' input."""
    return {name: mesh_4_2[name] for name in ("tiled", "rows", "replicated", "uneven", "cube")}


def box_rows(text: str) -> list[list[str]]:
    """The labels in each row of boxes of a text picture, left to right."""
    rows, current = [], None
    for line in text.splitlines():
        if line.startswith(("┌", "├")):
            current = []
            rows.append(current)
        elif line.startswith("│") and current is not None:
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            if any(cells):
                current.append(cells)
    return [[" / ".join(part for part in column if part) for column in zip(*row)] for row in rows]


def test_text_picture_of_a_tiled_tensor(described):
    text = repr(sharding_view.ShardingView(described["tiled"]))
    assert text.splitlines()[0] == (
        "float32[8, 8] · mesh data=4 × model=2 · dim 0 over data, dim 1 over model · 32 B per device"
    )
    assert box_rows(text) == [
        ["CPU 0 / 2×4", "CPU 1 / 2×4"],
        ["CPU 2 / 2×4", "CPU 3 / 2×4"],
        ["CPU 4 / 2×4", "CPU 5 / 2×4"],
        ["CPU 6 / 2×4", "CPU 7 / 2×4"],
    ]
    widths = {len(line) for line in text.splitlines()[1:]}
    assert len(widths) == 1  # a closed grid: every line of boxes is as wide as the others


def test_text_picture_of_replication_and_padding(described):
    rows = repr(sharding_view.ShardingView(described["rows"]))
    assert "each block on 2 devices" in rows.splitlines()[0]
    assert box_rows(rows) == [["CPU 0-1 / 2×4"], ["CPU 2-3 / 2×4"], ["CPU 4-5 / 2×4"], ["CPU 6-7 / 2×4"]]
    replicated = repr(sharding_view.ShardingView(described["replicated"]))
    assert "replicated on all 8 devices · 12 B per device" in replicated.splitlines()[0]
    assert box_rows(replicated) == [["all 8 / 3"]]
    uneven = repr(sharding_view.ShardingView(described["uneven"]))
    assert box_rows(uneven) == [["CPU 0-1 / 6×2", "CPU 2-3 / 6×2", "CPU 4-5 / 6×1", "CPU 6-7 / padding"]]
    # Widths follow the block sizes: a 2-column block is wider than a 1-column one.
    top = uneven.splitlines()[1]
    widths = [len(part) for part in top.strip("┌┐").split("┬")]
    assert widths[0] == widths[1] > widths[2]


def test_text_picture_of_three_dimensions_is_one_grid_per_leading_block(described):
    text = repr(sharding_view.ShardingView(described["cube"]))
    assert "[0:2, :, :]" in text and "[2:4, :, :]" in text
    assert box_rows(text) == [
        ["CPU 0 / 2×2×1", "CPU 1 / 2×2×1"], ["CPU 2 / 2×2×1", "CPU 3 / 2×2×1"],
        ["CPU 4 / 2×2×1", "CPU 5 / 2×2×1"], ["CPU 6 / 2×2×1", "CPU 7 / 2×2×1"],
    ]
    assert "dim 0 over a, dim 1 over b, dim 2 over c" in text.splitlines()[0]


def test_html_picture_colours_each_block_by_its_device(described):
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[dict]] = []
            self.cell: dict | None = None

        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                self.rows.append([])
            elif tag == "td":
                self.cell = dict(attrs, text="")
                self.rows[-1].append(self.cell)

        def handle_endtag(self, tag):
            if tag == "td":
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell["text"] += data + " "

    view = sharding_view.ShardingView(described["tiled"])
    parser = Cells()
    parser.feed(view._repr_html_())
    labels = [[cell["text"].split()[:2] for cell in row] for row in parser.rows]
    assert labels == [[["CPU", str(2 * r)], ["CPU", str(2 * r + 1)]] for r in range(4)]
    colours = [cell["style"].split("background: ")[1].split(";")[0] for row in parser.rows for cell in row]
    assert colours == list(sharding_view.PALETTE[:8])  # one colour per device, eight different
    assert parser.rows[0][1]["title"] == "CPU 1: [0:2, 4:8]"

    shared = Cells()
    shared.feed(sharding_view.render_html(described["rows"]))
    colours = [cell["style"].split("background: ")[1].split(";")[0] for row in shared.rows for cell in row]
    assert colours == [sharding_view.PALETTE[d] for d in (0, 2, 4, 6)]  # a block takes its first device's colour


def test_html_picture_escapes_what_it_shows(described):
    hostile = dict(described["tiled"], dtype="<script>", axis_names=["<b>", "m"])
    text = sharding_view.render_html(hostile)
    assert "<script>" not in text and "&lt;script&gt;" in text and "&lt;b&gt;=4" in text


def test_html_widths_follow_the_block_sizes(described):
    text = sharding_view.render_html(described["uneven"])
    widths = [int(part.split("%")[0]) for part in text.split('<col style="width: ')[1:]]
    assert widths[0] == widths[1] > widths[2] >= widths[3] > 0  # a padding-only block keeps room for its label
    assert "<b>CPU 6-7</b><br><small>padding</small>" in text


def test_show_displays_html_in_a_notebook_and_text_elsewhere(described):
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(sharding_view.ShardingView(described["tiled"]))
    assert data["text/html"].startswith('<div class="xla-magic-sharding"')
    assert data["text/plain"].startswith("float32[8, 8] · mesh data=4")


def test_a_view_of_something_else_says_what_it_takes():
    with pytest.raises(TypeError, match="describe_sharding"):
        sharding_view.ShardingView({"shape": [2]})


def test_many_blocks_across_are_drawn_with_bare_device_ids(described):
    wide = dict(
        described["tiled"], shape=[64], devices=64, ranges=[[[i, i + 1] for i in range(64)]], grid=[[i] for i in range(64)],
        mesh_shape=[64], axis_names=["data"], partition=[["data"]],
    )
    assert box_rows(repr(sharding_view.ShardingView(wide))) == [[f"{i} / 1" for i in range(64)]]
    assert "width: 3072px" in sharding_view.render_html(wide)  # wider, not illegible


def test_a_description_is_recognised_among_other_values(described):
    assert sharding_view.is_description(described["tiled"]) and sharding_view.is_description(described["cube"])
    assert not sharding_view.is_description({"shape": [2]}) and not sharding_view.is_description([described["tiled"]])
