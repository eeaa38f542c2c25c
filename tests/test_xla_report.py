"""What XLA did in a cell: real cells on the CPU simulation, each checked against torch_xla's own counters read in the rank."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

# The cell reads torch_xla's own counters around its work and returns the deltas,
# so the account the kernel got can be checked against what the rank itself saw.
OWN_COUNTS = """
import torch, torch_xla
import torch_xla.debug.metrics as met

def own():
    transfers = met.metric_data("TransferFromDeviceTime")
    return {"compiles": met.counter_value("UncachedCompile") or 0,
            "transfers": transfers[0] if transfers else 0,
            "nonzero": met.counter_value("aten::nonzero") or 0}

def since(before):
    now = own()
    return {name: now[name] - before[name] for name in now}
"""

RAGGED = OWN_COUNTS + """
before = own()
w = torch.randn(64, 16, device=device)
torch_xla.sync()
for n in (512, 512, 512, 100):  # the last batch is short
    x = torch.randn(n, 64).to(device)
    loss = (x @ w).sum()
    torch_xla.sync()
since(before)
"""
RAGGED_SYNC_LINE = RAGGED.splitlines().index("    torch_xla.sync()") + 1


def account(ip, rank: int = 0) -> dict:
    return ip._xla_magic_session.last_cell.ranks[rank].xla


def line_of(cell: str, text: str) -> int:
    return [number for number, line in enumerate(cell.splitlines(), 1) if text in line][0]


def xla_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("XLA:")]


def test_a_ragged_last_batch_is_one_recompilation_named_at_its_line(ip, spawn):
    run = spawn("--devices 2 --backend cpu", RAGGED)
    for rank, own in enumerate(run.value):
        got = account(ip, rank)
        # w's initialisation, the full batch's graph, then the short one's
        assert got["compiles"] == own["compiles"] == 3
        in_loop = [c for c in got["compilations"] if c["line"] == RAGGED_SYNC_LINE]
        assert len(in_loop) == 2 and in_loop[0]["input_bytes"] > in_loop[1]["input_bytes"]
    [summary] = xla_lines(run.stdout)
    assert summary.count("recompiled") == 1
    shapes = f"x: {hlo_type([512, 64])} → {hlo_type([100, 64])}"  # the loop's batches, as RAGGED makes them
    assert f"recompiled at line {RAGGED_SYNC_LINE} (torch_xla.sync()): shapes changed, {shapes}" in summary
    assert "ranks differ" not in summary


ITEM_EVERY_STEP = OWN_COUNTS + """
before = own()
w = torch.randn(8, 8, device=device)
torch_xla.sync()
total = 0.0
for step in range(12):
    loss = (w * step).sum()
    total += loss.item()
since(before)
"""

NONZERO = OWN_COUNTS + """
before = own()
for step in range(3):
    hits = torch.nonzero(torch.arange(6, device=device) % 2)
since(before)
"""


def test_item_every_step_is_syncs_at_their_line_and_nonzero_a_fallback(ip, pool, spawn):
    run = spawn("", ITEM_EVERY_STEP)
    item_line = line_of(ITEM_EVERY_STEP, "loss.item()")
    for rank, own in enumerate(run.value):
        got = account(ip, rank)
        assert got["transfers"] == own["transfers"] == 12
        assert [(s["line"], s["count"]) for s in got["sync_lines"]] == [(item_line, 12)]
    [summary] = xla_lines(run.stdout)
    assert f"12 device→host syncs (line {item_line}: total += loss.item() ×12)" in summary

    run = spawn("", NONZERO)
    for rank, own in enumerate(run.value):
        assert account(ip, rank)["fallbacks"] == {"aten::nonzero": own["nonzero"]} == {"aten::nonzero": 3}
    [summary] = xla_lines(run.stdout)
    assert f"CPU fallback aten::nonzero ×3 (line {line_of(NONZERO, 'torch.nonzero')})" in summary


SHAPED = OWN_COUNTS + """
before = own()
x = torch.ones(rows, 32).to(device)
y = (x * 3).sum(0)
torch_xla.sync()
since(before)
"""


def test_a_pool_cell_run_twice_compiles_nothing_the_second_time_and_new_shapes_are_named(ip, pool, spawn):
    first = spawn("", SHAPED, rows=256)
    assert [account(ip, r)["compiles"] for r in (0, 1)] == [own["compiles"] for own in first.value] == [1, 1]
    second = spawn("", SHAPED, rows=256)
    for rank, own in enumerate(second.value):
        got = account(ip, rank)
        assert got["compiles"] == own["compiles"] == 0
        assert got["cached"] >= 1 and got["executions"] >= 1
    # nothing deserves a look: the line says only the ranks' peak device memory, which they agree on
    assert [re.sub(r"[0-9.]+ (KiB|MiB)", "<size>", line) for line in xla_lines(second.stdout)] == \
        ["XLA: peak memory <size>"], second.stdout
    third = spawn("", SHAPED, rows=40)
    assert [account(ip, r)["compiles"] for r in (0, 1)] == [own["compiles"] for own in third.value] == [1, 1]
    [summary] = xla_lines(third.stdout)
    sync_line = line_of(SHAPED, "torch_xla.sync()")
    assert re.search(rf"line {sync_line} compiled again \(the same code compiled in run \d+\): "
                     + re.escape(f"this cell's shapes differ from the last (x: {hlo_type([256, 32])} → {hlo_type([40, 32])})"),
                     summary), summary


DIFFERENT_GRAPHS = OWN_COUNTS + """
before = own()
x = torch.ones(64, 8, device=device)
y = x.sum()
torch_xla.sync()
if rank == 1:
    z = (x @ x.T).relu().sum()
    torch_xla.sync()
since(before)
"""


def test_ranks_that_compile_different_graphs_are_named(ip, spawn):
    run = spawn("--devices 3 --backend cpu", DIFFERENT_GRAPHS)
    assert [account(ip, r)["compiles"] for r in range(3)] == [own["compiles"] for own in run.value] == [1, 2, 1]
    [summary] = xla_lines(run.stdout)
    assert "ranks differ: rank 1 compiled 2 graphs, ranks 0, 2 1 graph" in summary
    run = spawn("--devices 3 --backend cpu", "import torch, torch_xla\nx = torch.ones(4, device=device) * rank\n"
                "torch_xla.sync()\nx = torch.ones(1024 * (1 + (rank == 2))).to(device).sum()\ntorch_xla.sync()")
    [summary] = xla_lines(run.stdout)  # a constant that differs is harmless; a shape is not
    assert "ranks differ: rank 2 compiled 2 graphs with inputs of other sizes, ranks 0-1 2 graphs" in summary


def test_what_a_reply_moves_to_the_cpu_counts_in_no_later_cell(ip, pool, spawn):
    # A rank reads its counters for the next cell once a reply went out (xla_account.settle): a result that is a
    # pending XLA tensor (compiled, run and copied as the reply is made) and a pull between cells are no cell's.
    made = spawn("", "import torch, torch_xla\nt = torch.ones(3, device=device) * (rank + 2)\nt")
    assert [value.tolist() for value in made.value] == [[2.0] * 3, [3.0] * 3]
    with capture_output():
        ip.run_line_magic("xla_pool", "pull t")
    assert [value.tolist() for value in ip.user_ns.pop("t")] == [[2.0] * 3, [3.0] * 3]
    quiet = spawn("", "a = 1")
    assert [account(ip, r) for r in (0, 1)] == [None, None] and xla_lines(quiet.stdout) == []
    spawn("", "u = (t + 1).sum().item()")  # and what a cell does is still its own
    assert all(account(ip, r)["compiles"] == 1 and account(ip, r)["transfers"] == 1 for r in (0, 1))


def test_off_shows_nothing_and_collects_nothing(ip, spawn):
    run = spawn("--devices 2 --backend cpu --xla-report off", RAGGED)
    assert xla_lines(run.stdout) == [] and "What XLA did" not in run.stdout
    assert [account(ip, r) for r in (0, 1)] == [None, None]
    with capture_output() as shown:
        ip.run_line_magic("xla_report", "")
    assert "collected no account" in shown.stdout and "--xla-report off" in shown.stdout


def test_full_shows_the_table_after_the_cell_and_xla_report_shows_it_again(ip, spawn):
    run = spawn("--devices 2 --backend cpu --xla-report full", RAGGED)
    assert "What XLA did in run" in run.stdout
    with capture_output() as shown:
        ip.run_line_magic("xla_report", "")
    text = shown.stdout
    assert "compiled  compile time  cached  loaded  load time  executed" in text
    assert re.search(rf"0-1\s+line {RAGGED_SYNC_LINE}\s+torch_xla.sync\(\)\s+user torch_xla.sync", text), text
    assert "Metric:" not in text and "Counter:" not in text  # never torch_xla's raw report
    with pytest.raises(UsageError, match="takes no|unrecognized"):
        ip.run_line_magic("xla_report", "--bogus")


def test_bad_xla_report_options_are_usage_errors(ip, spawn):
    with pytest.raises(UsageError, match="invalid choice"):
        spawn("--xla-report loud", "1")
    with pytest.raises(UsageError, match="--xla-report goes with %xla_pool start"):
        ip.run_line_magic("xla_pool", "status --xla-report off")


def test_spmd_cell_gets_its_account(ip, spawn):
    run = spawn("--spmd --devices 2", RAGGED)
    got = ip._xla_magic_session.last_cell.ranks[0].xla
    assert got["compiles"] == run.value["compiles"] == 3
    assert f"recompiled at line {RAGGED_SYNC_LINE}" in xla_lines(run.stdout)[0]


def test_tpu_launch_path_threads_share_one_account(ip, spawn, monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    run = spawn("--devices 2 --backend tpu", OWN_COUNTS + "before = own()\ny = (torch.ones(4, device=device) * 5).sum()\n"
                "torch_xla.sync()\nsince(before)")
    accounts = [account(ip, r) for r in (0, 1)]
    assert accounts[0] is not None and accounts[0] is accounts[1]  # one process: its counters are the ranks'
    assert accounts[0]["ranks"] == [0, 1]
    assert accounts[0]["compiles"] >= max(own["compiles"] for own in run.value) >= 1
    with capture_output() as shown:
        ip.run_line_magic("xla_report", "")
    assert "0-1 (one process)" in shown.stdout and "share torch_xla's counters" in shown.stdout


def test_a_user_who_sets_the_debug_level_gets_torch_xla_s_own_output(ip, spawn, monkeypatch):
    monkeypatch.setenv("PT_XLA_DEBUG_LEVEL", "1")
    run = spawn("--devices 2 --backend cpu", RAGGED)
    assert "Compilation Analysis" in run.stdout + run.stderr  # torch_xla's own blocks, as without xla_magic
    got = account(ip)
    assert got["analysis"] == "user" and got["compiles"] == run.value[0]["compiles"] == 3
    assert got["compilations"] == []  # its blocks went where the user asked, not to us


def test_the_status_panel_shows_each_rank_s_account_and_the_runs_summary(ip, spawn):
    from test_widget import history_rows, rank_rows

    from xla_magic.notebook import status

    panel = status.status_panel(ip._xla_magic_session)  # shown before the run: what follows comes live
    spawn("--devices 2 --backend cpu", RAGGED)
    # No redraw: the panel follows every run through its listener (conftest.py fails any test that removes it).
    for row in rank_rows(panel):
        assert re.fullmatch(r"3 compiled \(\S+ s\)", row["cells"][7]), row
    assert f"recompiled at line {RAGGED_SYNC_LINE}" in history_rows(panel)[0]["cells"][5]
    with capture_output() as shown:
        ip.run_line_magic("xla_status", "--text")
    assert re.search(r"\n\s+0\s+done .* 3 compiled \(", shown.stdout), shown.stdout
    assert f"XLA: 3 compilations" in shown.stdout


def test_a_sync_under_torch_compile_still_compiles_as_without_xla_magic(ip, spawn):
    cell = """
import torch, torch_xla, warnings
def read(x):
    return (x * 2).sum().item()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    value = torch.compile(read, backend="openxla")(torch.ones(3, device=device))
(value, [str(w.message)[:80] for w in caught if "does not know how to trace" in str(w.message)])
"""
    run = spawn("--devices 1 --backend cpu", cell)
    assert run.value == [(6.0, [])]


SLOW_LOOP_UNTIL_INTERRUPTED = """
import torch, torch_xla
for n in range(100, 105):  # the shape changes every step
    x = torch.ones(n, 64).to(device)
    y = (x * 2).sum()
    torch_xla.sync()
open(f'{marks}/{rank}', 'w').close()
while True:
    spin = 1
"""


def test_an_interrupted_slow_loop_still_says_what_xla_did(ip, pool, spawn, marks):
    from helpers import interrupt_once_written

    from xla_magic.runs.errors import RunInterrupted

    interrupt_once_written(marks, 2)
    with capture_output() as shown, pytest.raises(RunInterrupted):
        ip.run_cell_magic("xla_spawn", "", SLOW_LOOP_UNTIL_INTERRUPTED)
    [summary] = xla_lines(shown.stdout)
    line = line_of(SLOW_LOOP_UNTIL_INTERRUPTED, "torch_xla.sync()")
    assert f"5 compilations" in summary and f"line {line} (torch_xla.sync()) compiled 5 times" in summary, summary
    assert [account(ip, r)["compiles"] for r in (0, 1)] == [5, 5]


def test_the_docs_slow_loop_shows_what_the_page_says(ip, spawn):
    from pathlib import Path

    section = (Path(__file__).resolve().parent.parent / "docs" / "what-xla-did.md").read_text(encoding="utf-8")
    code, shown = re.findall(r"```(?:python|text)\n(.*?)```", section, re.S)[:2]
    line, cell = code.split("\n", 1)
    assert line == "%%xla_spawn --devices 8"
    run = spawn("--devices 2", cell)  # the same line on fewer ranks (only the table names them)
    seconds = re.compile(r"\d+(\.\d+)? s\b")
    assert [seconds.sub("T s", text) for text in xla_lines(run.stdout)] == [seconds.sub("T s", shown.strip())]


def hlo_type(tensor_shape: list[int]) -> str:
    """How the account writes an f32 tensor's type: f32[8,16]."""
    return f"f32[{','.join(map(str, tensor_shape))}]"


# Shapes made on the device: the graph's inputs (w, the RNG seed) keep their size, its outputs do not.
DEVICE_SHAPES = """
import torch, torch_xla
w = torch.randn(16, 4, device=device)
shapes = []
for n in [8, 8, 8, 8, 5]:
    x = torch.randn(n, 16, device=device)
    y = (x @ w).relu().sum()
    torch_xla.sync()
    shapes.append(list(x.shape))
shapes
"""


def test_shapes_made_on_the_device_are_named_under_the_cell(ip, spawn):
    run = spawn("--devices 2 --backend cpu", DEVICE_SHAPES)
    sync_line = line_of(DEVICE_SHAPES, "torch_xla.sync()")
    full, short = hlo_type(run.value[0][0]), hlo_type(run.value[0][-1])  # the shapes x really had
    for rank in (0, 1):
        at_sync = [c for c in account(ip, rank)["compilations"] if c["line"] == sync_line]
        assert at_sync[0]["shapes"]["x"] == full and at_sync[-1]["shapes"]["x"] == short
        assert all(c["memory"].keys() >= {"inputs", "outputs", "temporaries", "program"} for c in at_sync)
    [summary] = xla_lines(run.stdout)
    assert f"recompiled at line {sync_line} (torch_xla.sync()): shapes changed, x: {full} → {short}" in summary
    assert "ranks differ" not in summary
    with capture_output() as shown:
        ip.run_line_magic("xla_report", "")
    assert f"x {short}" in shown.stdout and "largest graph: line" in shown.stdout, shown.stdout
    assert re.search(r"in (<1 KB|\d+\.\d KB), out ", shown.stdout), shown.stdout


RANK_SHAPES = """
import torch, torch_xla
x = torch.ones(4 + 4 * rank, 8, device=device)
y = (x * 2).sum()
torch_xla.sync()
list(x.shape)
"""
RANK_CONSTANT = """
import torch, torch_xla
x = torch.ones(4, 8, device=device)
y = (x * rank).sum()
torch_xla.sync()
"""


def test_ranks_whose_graphs_differ_in_shape_are_named_and_a_constant_stays_quiet(ip, spawn):
    run = spawn("--devices 3 --backend cpu", RANK_SHAPES)
    theirs = [hlo_type(shape) for shape in run.value]
    assert [account(ip, r)["compilations"][-1]["shapes"]["x"] for r in range(3)] == theirs
    [summary] = xla_lines(run.stdout)
    assert (f"ranks differ: rank 1 compiled 1 graph with other shapes (x: {theirs[1]} against {theirs[0]}); "
            f"rank 2 compiled 1 graph with other shapes (x: {theirs[2]} against {theirs[0]}), rank 0 1 graph") in summary
    # and the peaks, which differ: as XLA:TPU tiles them, x's 4 rows take a (4, 128) tile on rank 0 and its 12 rows
    # two (8, 128) tiles on rank 2 (f32[12,8]{1,0:T(8,128)}: 16 x 128 x 4 B), beside the sum's one 512 B scalar tile
    assert summary.endswith("; peak memory 2.5 KiB–8.5 KiB (most on rank 2)"), summary
    run = spawn("--devices 3 --backend cpu", RANK_CONSTANT)
    assert len({account(ip, r)["compilations"][-1]["hash"] for r in range(3)}) == 3  # three graphs, ...
    # ... told apart only by a constant: harmless, so the line says only the peak (the same tensors on every rank)
    assert xla_lines(run.stdout) == ["XLA: peak memory 2.5 KiB"], run.stdout
