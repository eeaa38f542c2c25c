"""An SPMD pool for real: one process drives 8 XLA CPU devices and keeps its state between cells.

Every test here runs in the module's pool (one start for the module) and
needs nothing an earlier test left in it: each defines the names it reads,
and one that restarts the pool leaves a pool of the same mesh. The one-shot
SPMD cells, which need no pool running, are in test_spmd_cells.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from torch import nn

from conftest import BACKING
from helpers import (FSDP_STEPS, FSDP_WRAP, interrupt_once_written, pool_magic, reference_training, spawn_cell,
                     strip_ansi)
from xla_magic.wire import transport
from xla_magic.runs.errors import RankError, RunInterrupted



@pytest.fixture(scope="module")
def pool_of_the_module(ip):
    said = pool_magic(ip, "start --spmd --mesh 8,1 --axes fsdp,model")
    assert said.startswith("pool ready in ") and "one SPMD process driving 8 XLA CPU devices, mesh fsdp=8 × model=1" in said
    try:
        yield
    finally:
        pool_magic(ip, "stop")
        assert ip._xla_magic_session.pool is None


@pytest.fixture
def spmd_pool(ip, pool_of_the_module):
    """The module's SPMD pool as it is now: a test may have restarted it (a new pool, the same mesh)."""
    pool = ip._xla_magic_session.current_pool()
    assert pool is not None and pool.one_value and pool.ranks.placement.mesh == (8, 1), "the module's pool is gone"
    return pool


STEPS, LR = 4, 0.1

# torch_xla's FSDPv2 example, unchanged but for the names the cell is given.
FSDP_SETUP = """
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.debug.metrics as met
from torch import nn
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

module = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
module.load_state_dict(initial)""" + FSDP_WRAP.rstrip("\n") + ";\n"  # the cell shows nothing

FSDP_TRAIN = """
before = (met.metric_data("CompileTime") or (0,))[0]""" + FSDP_STEPS + """params = list(model.parameters())
(losses, (met.metric_data("CompileTime") or (0,))[0] - before)
"""


def test_fsdpv2_in_the_pool_trains_like_full_batch_sgd_and_a_repeated_cell_compiles_nothing(ip, spmd_pool):
    torch.manual_seed(0)
    inputs, targets = torch.randn(32, 16), torch.randn(32, 4)
    module = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    ip.user_ns.update(inputs=inputs, targets=targets, initial=module.state_dict(), LR=LR, STEPS=STEPS)
    assert spawn_cell(ip, "", FSDP_SETUP)[0] is None
    first, first_compiles = spawn_cell(ip, "", FSDP_TRAIN)[0]
    second, second_compiles = spawn_cell(ip, "--spmd", FSDP_TRAIN)[0]  # --spmd without a mesh: the pool's
    assert first_compiles > 0 and second_compiles == 0  # the model, optimiser and graphs stayed
    expected = reference_training(copy.deepcopy(module), inputs, targets, 2 * STEPS, LR)
    assert max(abs(got - want) for got, want in zip(first + second, expected)) < 1e-5
    assert second[-1] < first[0]  # it did train, on from where the first cell stopped

    pool_magic(ip, "pull params")
    reference = copy.deepcopy(module)
    reference_training(reference, inputs, targets, 2 * STEPS, LR)
    pulled = ip.user_ns["params"]
    assert all(type(p) is torch.Tensor or isinstance(p, nn.Parameter) for p in pulled)
    assert max((got - want).abs().max().item() for got, want in zip(pulled, reference.parameters())) < 1e-5


def test_pool_push_pull_and_a_large_value_through_shared_memory(ip, spmd_pool):
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: above transport's threshold
    ip.user_ns.update(big=big, factor=3)
    pool_magic(ip, "push factor")
    value = spawn_cell(ip, "", BACKING + "kept = factor * world_size\n(backing(big.data_ptr()), float(big.sum()))")[0]
    path, total = value
    assert path.startswith(os.path.join(transport.SHM_DIR, transport.kernel_prefix())) and total == float(big.sum())
    pool_magic(ip, "pull kept")
    assert ip.user_ns["kept"] == 24
    with pytest.raises(UsageError, match="an SPMD pool is one process, so its value has no --rank"):
        ip.run_line_magic("xla_pool", "pull kept --rank 1")


def test_interrupt_stops_the_cell_and_the_pool_keeps_its_state(ip, spmd_pool, marks):
    spawn_cell(ip, "", "survivor = world_size * 7")
    pressed = interrupt_once_written(marks, 1)
    with pytest.raises(RunInterrupted, match="keeps its ranks"):
        spawn_cell(ip, "", "open(f'{marks}/running', 'w').close()\nwhile True:\n    spin = 1\n")
    assert pressed.is_set()
    assert spmd_pool.state == "ready"
    assert spawn_cell(ip, "", "survivor")[0] == 56


def test_a_timeout_and_an_exception_in_the_pool_keep_it(ip, spmd_pool):
    spawn_cell(ip, "", "survivor = world_size * 7")
    with pytest.raises(RankError, match="timed out after 2 s"):
        spawn_cell(ip, "--timeout 2", "while True:\n    spin = 1\n")
    with pytest.raises(RankError) as raised:
        spawn_cell(ip, "", "1 / 0\n")
    assert "[spmd]     1 / 0" in [strip_ansi(line) for line in raised.value.render_lines()]
    assert spmd_pool.state == "ready" and spawn_cell(ip, "", "survivor")[0] == 56


@pytest.mark.parametrize(
    "line, message",
    [
        ("--devices 4", "an SPMD pool (one process, 8 devices, mesh fsdp=8 × model=1) is running, so --devices 4 "
                        "contradicts it"),
        ("--backend tpu", "on the cpu backend is running, so --backend tpu contradicts it"),
        ("--spmd --mesh 4,2", "this cell asks for the mesh data=4 × model=2"),
        ("--spmd --axes data", "this cell asks for the mesh data=8"),
    ],
)
def test_cells_that_contradict_the_spmd_pool_say_what_to_do(ip, spmd_pool, line, message):
    with pytest.raises(UsageError) as raised:
        ip.run_cell_magic("xla_spawn", line, "1")
    assert type(raised.value) is UsageError and message in str(raised.value), str(raised.value)
    assert "%xla_pool restart --spmd" in str(raised.value)


def test_status_shows_the_spmd_process(ip, spmd_pool):
    spawn_cell(ip, "", "None")
    with capture_output() as captured:
        ip.run_line_magic("xla_status", "--text")
    text = captured.stdout
    assert "SPMD:     pool: one process, 8 devices, mesh fsdp=8 × model=1; memory per device: torch_xla reports" in text
    assert "Pool:     ready: one SPMD process driving 8 XLA CPU devices" in text
    assert "already running: ready: one SPMD process" in pool_magic(ip, "start --spmd")


def test_restart_keeps_the_pool_spmd_with_its_mesh(ip, spmd_pool):
    spawn_cell(ip, "", "survivor = world_size * 7")
    said = pool_magic(ip, "restart")
    pool = ip._xla_magic_session.pool
    assert pool.one_value and (pool.ranks.placement.mesh, pool.ranks.placement.axes) == ((8, 1), ("fsdp", "model"))
    assert "pool ready in" in said
    with pytest.raises(RankError, match="NameError"):
        spawn_cell(ip, "", "survivor")  # the namespace went with the old process
    assert spawn_cell(ip, "", "(tuple(mesh.mesh_shape), mesh.axis_names)")[0] == ((8, 1), ("fsdp", "model"))
