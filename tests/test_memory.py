"""Device memory in the CPU simulation, through a real IPython shell and real ranks: the count and its limit,
xm.get_memory_info in a cell, RESOURCE_EXHAUSTED with the TPU's wording, %xla_memory's names and sizes."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from helpers import execute, notebook, pool_magic, shown_error, strip_ansi, text_of, wait_for
from xla_magic.runs.errors import RankError

GIB = 1 << 30


@pytest.fixture
def small_pool(ip, monkeypatch):
    """A 2-rank pool whose devices hold 1 MiB each."""
    monkeypatch.setenv("XLA_MAGIC_SIM_HBM", "1M")
    pool_magic(ip, "start --devices 2 --backend cpu")
    try:
        yield ip._xla_magic_session.pool
    finally:
        pool_magic(ip, "stop")


def test_get_memory_info_in_a_cell_counts_what_the_cell_holds(spawn, pool):
    """The default limit is a v5e's 16 GiB; a 256x256 f32 tensor synced is counted (it fills whole TPU tiles)."""
    before = spawn("", "import torch, torch_xla, torch_xla.core.xla_model as xm\nxm.get_memory_info(device)").value
    assert [info["bytes_limit"] for info in before] == [16 * GIB] * 2
    after = spawn("", "x = torch.ones(256, 256, device=device) * rank\n"
                      "torch_xla.sync()\ninfo = xm.get_memory_info(device)\ninfo").value
    for was, now in zip(before, after):
        assert now["bytes_used"] - was["bytes_used"] == 256 * 256 * 4
        assert now["peak_bytes_used"] >= now["bytes_used"]
    # code that branches on it takes the TPU's branch
    assert spawn("", "'room' if xm.get_memory_info(device)['bytes_limit'] - xm.get_memory_info(device)['bytes_used']"
                     " > 1 << 30 else 'full'").value == ["room", "room"]


def test_past_a_small_limit_the_sync_raises_the_tpus_words_and_the_pool_survives(ip, small_pool):
    cell = ("import torch, torch_xla\n"
            "keep, hidden = torch.ones(256, 256, device=device), (lambda t: lambda: t)(torch.ones(8, 128, device=device))\n"
            "torch_xla.sync()\n"
            "big = torch.ones(520, 384, device=device)\n"  # a graph the device holds alone, not with keep
            "torch_xla.sync()\n")
    with capture_output() as shown, pytest.raises(RankError) as failed:
        ip.run_cell_magic("xla_spawn", "", cell)
    text = strip_ansi("\n".join(failed.value.render_lines()))
    assert "RuntimeError: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 780.00K. " \
           "That was not possible. There are 768.00K free." in text, text
    assert "line 5" in text and "torch_xla.sync()" in text
    assert "keep  float32[256, 256]  (other)" in text and "big  float32[520, 384]" in text
    # a tensor no name reaches (a closure holds it) is told by its shape and where it was made
    run_id = ip._xla_magic_session.history[-1].run_id
    assert f"unnamed  float32[8, 128]  (other, made in cell {run_id}, computed at line 3: torch_xla.sync())" in text
    assert "Most of it: tensors left from earlier cells (big, keep)." in text
    assert "The rank survived it" in text
    assert "What to do:" in text and "del" in text
    # the pool kept its ranks and their names: free the memory and go on
    with capture_output():
        values = ip.run_cell_magic("xla_spawn", "", "del big\nimport gc; gc.collect(); torch_xla.sync()\n"
                                                      "xm = __import__('torch_xla.core.xla_model').core.xla_model\n"
                                                      "(tuple(keep.shape), xm.get_memory_info(device)['bytes_used'])")
    assert values == [((256, 256), 256 * 256 * 4)] * 2


MODEL = """
import torch, torch_xla
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
batch = torch.randn(16, 64, device=device)
model(batch).sum().backward()
opt.step()
torch_xla.sync()
expected = {name: (p.numel() * p.element_size(), str(p.dtype).removeprefix('torch.'), list(p.shape))
            for name, p in model.named_parameters()}
expected
"""


def test_xla_memory_names_parameters_gradients_and_optimizer_state_with_their_sizes(ip, spawn, pool):
    from xla_magic.notebook.memory_view import human

    expected = spawn("", MODEL).value[0]
    with capture_output() as shown:
        ip.run_line_magic("xla_memory", "--rank 1")
    text = shown.stdout
    assert text.startswith("Device memory of rank 1: ")
    assert "of 16.00G, peak" in text
    lines = text.splitlines()

    def line_of(name: str, kind: str) -> str:
        found = [line for line in lines if f"  {name}  " in line and line.rstrip().endswith(kind)]
        assert len(found) == 1, (name, text)
        return found[0]

    for name, (size, dtype, shape) in expected.items():
        shape_text = f"{dtype}[{', '.join(map(str, shape))}]"
        for named, kind in ((f"model.{name}", "parameters"), (f"model.{name}.grad", "gradients"),
                            (f"opt.state[model.{name}].exp_avg", "optimizer state"),
                            (f"opt.state[model.{name}].exp_avg_sq", "optimizer state")):
            line = line_of(named, kind)
            assert line.split()[0] == human(size) and shape_text in line
    assert "  batch  float32[16, 64]  other" in text
    weights = sum(size for size, _dtype, _shape in expected.values())
    assert weights == (64 * 128 + 128 + 128 * 32 + 32) * 4
    assert "By kind (on a TPU): parameters " in text
    assert "The largest compiled graph (cell " in text and "temporaries" in text
    # a vector takes its bytes rounded to a tile on a TPU, f32[128]{0:T(128)}: 512 B, as the data (tests/test_layout.py)
    assert re.search(r" 512B +512B on a TPU  model\.0\.bias  float32\[128\]  parameters", text), text
    # a 64-bit type has no native TPU layout: its size there is said to be an estimate
    spawn("", "steps = torch.zeros(3, dtype=torch.int64, device=device)\ntorch_xla.sync()")
    with capture_output() as again:
        ip.run_line_magic("xla_memory", "--rank 1")
    assert "  steps  int64[3]  other  (on a TPU: an estimate)" in again.stdout, again.stdout
    # without --rank: rank 0 in full and every rank's totals
    with capture_output() as both:
        ip.run_line_magic("xla_memory", "")
    assert both.stdout.startswith("Device memory of rank 0: ") and "Every rank:\n  rank 0: " in both.stdout \
        and "\n  rank 1: " in both.stdout


def test_xla_memory_reads_without_a_sync_or_a_compile(ip, spawn, pool):
    """Asked between two cells, %xla_memory leaves the next cell's XLA account as it would be without it."""
    spawn("", "import torch, torch_xla\nw = torch.ones(8, 8, device=device)\ntorch_xla.sync()")
    spawn("", "pending = w * 3")  # a graph not yet run: named, with no buffer
    with capture_output() as shown:
        ip.run_line_magic("xla_memory", "--rank 0")
    assert "  pending  float32[8, 8]  other  (not computed yet: no buffer)" in shown.stdout
    run = spawn("", "w.shape")
    record = ip._xla_magic_session.history[-1]
    assert [state.xla for state in record.ranks.values()] == [None, None]  # XLA did nothing in the cell


def test_xla_memory_says_where_each_unnamed_tensor_was_made(ip, spawn, pool):
    """Tensors no name reaches (held by closures): the cell and the sync line that computed each, or the cell."""
    spawn("", "import torch, torch_xla\n"
              "def keep(rows):\n    held = [torch.ones(rows, 40, device=device)]\n    return lambda: held\n"
              "first = keep(24)\n"
              "torch_xla.sync()\n"
              "second = keep(16)\n")
    run_id = ip._xla_magic_session.history[-1].run_id
    with capture_output() as shown:
        ip.run_line_magic("xla_memory", "--rank 1")
    text = shown.stdout
    assert f"  unnamed  float32[24, 40]  other  (made in cell {run_id}, computed at line 6: torch_xla.sync())" in text
    assert f"  unnamed  float32[16, 40]  other  (not computed yet: no buffer)  (made in cell {run_id})" in text, text


@pytest.mark.parametrize("line, message", [
    ("--rank 2", r"--rank must be between 0 and 1 \(the pool has 2 ranks\)"),
    ("--rank -1", "--rank"),
])
def test_xla_memory_refuses_a_rank_the_pool_does_not_have(ip, pool, line, message):
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("xla_memory", line)


def test_xla_memory_without_a_pool_says_how_to_start_one(ip):
    with pytest.raises(UsageError, match=r"no pool is running.*%xla_pool start"):
        ip.run_line_magic("xla_memory", "")


def test_a_cell_near_its_limit_says_each_rank_s_peak_and_the_panel_shows_it(ip, small_pool):
    """950,272 bytes (225 rows padded to 232 of f32[.., 1024]) of a 1 MiB device: 90%, said under the cell."""
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "", "import torch, torch_xla\nx = torch.ones(225, 1024, device=device)\n"
                                            "torch_xla.sync()")
    said = [line for line in shown.stdout.splitlines() if line.startswith("XLA:")]
    assert said == ["XLA: peak memory 928.0 KiB (90% of rank 0's 1.0 MiB: %xla_memory names what holds it)"]
    record = ip._xla_magic_session.history[-1]
    for state in record.ranks.values():
        assert state.memory["bytes_used"] == state.memory["cell_peak_bytes"] == 232 * 1024 * 4
    with capture_output() as status:
        ip.run_line_magic("xla_status", "--text")
    assert "928.0 KiB of 1.0 MiB, peak 928.0 KiB (928.0 KiB in the cell)" in status.stdout
    # a cell that holds no more is quiet again
    with capture_output() as quiet:
        ip.run_cell_magic("xla_spawn", "", "del x\ntorch_xla.sync()")
    assert not [line for line in quiet.stdout.splitlines() if line.startswith("XLA:")]


def test_the_panel_s_memory_moves_while_the_cell_runs_and_its_end_gives_each_rank_s_peak(ip, small_pool, tmp_path):
    """The ranks' samples reach the record (what the panel draws) while the cell still runs: the cell waits until
    the kernel has seen both ranks' memory, and only the kernel's listener can let it go on. Its last sample (the
    cell's peak) rides on each rank's DONE, and the line under the cell says it."""
    from helpers import Listening

    seen = tmp_path / "seen"
    used = 232 * 1024 * 4  # f32[225, 1024] in TPU tiles

    def listener(record) -> None:
        states = list(record.ranks.values())
        if len(states) == 2 and all(state.state == "running" and (state.memory or {}).get("bytes_used") == used
                                    for state in states):
            seen.touch()

    cell = ("import os, time, torch, torch_xla\nx = torch.ones(225, 1024, device=device)\ntorch_xla.sync()\n"
            f"while not os.path.exists({str(seen)!r}):\n    time.sleep(0.01)\n")
    with Listening(ip._xla_magic_session, listener), capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "--timeout 120", cell)
    assert seen.exists()
    said = [line for line in shown.stdout.splitlines() if line.startswith("XLA:")]
    assert said == ["XLA: peak memory 928.0 KiB (90% of rank 0's 1.0 MiB: %xla_memory names what holds it)"]
    for state in ip._xla_magic_session.history[-1].ranks.values():
        assert state.memory["cell_peak_bytes"] == used, state.memory


def test_xla_memory_answers_while_a_cell_runs_naming_the_cell_s_locals(ip, pool, tmp_path):
    """The ranks answer from their sampler thread while the cell waits; the running request hands the answers over."""
    from helpers import on_every_rank_running
    from xla_magic.notebook import memory_view

    done = tmp_path / "done"
    got: dict = {}

    def ask() -> None:
        try:
            got["lines"] = memory_view.report(pool, ip._xla_magic_session.history, 1)
        except Exception as exc:  # the test says what went wrong, not a hang
            got["error"] = exc
        finally:
            done.touch()

    def ask_once_inside() -> None:
        wait_for(lambda: all((tmp_path / f"inside-{rank}").exists() for rank in (0, 1)))
        ask()

    cell = ("import os, time, torch\nheld = torch.ones(4, 4, device=device)\n"
            "def wait():\n    inside = torch.zeros(3, 5, device=device)\n"
            f"    open(os.path.join({str(tmp_path)!r}, f'inside-{{rank}}'), 'w').close()\n"
            f"    while not os.path.exists({str(done)!r}):\n        time.sleep(0.02)\nwait()")
    with on_every_rank_running(ip._xla_magic_session, ask_once_inside), capture_output():
        ip.run_cell_magic("xla_spawn", "", cell)
    assert "error" not in got, got.get("error")
    text = "\n".join(got["lines"])
    assert text.startswith("Device memory of rank 1: ")
    assert "  held  float32[4, 4]  other" in text and "  inside  float32[3, 5]  other" in text


def test_an_oom_with_a_model_and_adam_advises_bfloat16_and_fsdp(ip, small_pool):
    """Parameters, gradients and Adam's two states dominate: the advice is for them."""
    cell = ("import torch, torch_xla\n"
            "model = torch.nn.Linear(256, 256).to(device)\n"
            "opt = torch.optim.Adam(model.parameters())\n"
            "model(torch.ones(8, 256, device=device)).sum().backward()\n"
            "opt.step()\n"
            "torch_xla.sync()\n")
    with capture_output(), pytest.raises(RankError) as failed:
        ip.run_cell_magic("xla_spawn", "", cell)
    text = strip_ansi("\n".join(failed.value.render_lines()))
    # its arguments and outputs alone are more than the device holds: refused when it compiles, as on a TPU
    assert "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm." in text, text
    assert "line 6" in text
    assert "model.weight  float32[256, 256]  (parameters)" in text
    assert "opt.state[model.weight].exp_avg_sq  float32[256, 256]  (optimizer state)" in text
    assert "Most of it: parameters, gradients and optimizer state." in text
    assert "What to do: load the model in bfloat16" in text and "FSDPv2" in text


# A TPU compiler's refusal as XLA:TPU writes it (its layout as quoted in google/trax#1343 and
# tensorflow/tensor2tensor#1382), its allocation's source_file the failing cell, as torch_xla's metadata sets it.
TPU_COMPILE_OOM = """
import sys
here = sys._getframe().f_code.co_filename
logits = 'the line whose operation the compiler names'
message = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
           "Used 20.72G of 15.48G hbm. Exceeded hbm capacity by 5.24G.\\n\\n"
           "Total hbm usage >= 20.72G:\\n    reserved        530.00M \\n    program           5.10G \\n"
           "    arguments        15.10G \\n\\nOutput size 15.10G; shares 15.10G with arguments.\\n\\n"
           "Program hbm requirement 5.10G:\\n    global           132.0K\\n"
           "    HLO temp          5.10G (100.0% utilization: Unpadded (4.91G) Padded (4.91G), 3.7% fragmentation)\\n\\n"
           "  Largest program allocations in hbm:\\n\\n"
           "  1. Size: 1.53G\\n"
           f'     Operator: op_type="aten__mm" op_name="aten__mm.3/aten__mm" source_file="{here}" source_line=4\\n'
           "     Shape: f32[8,1024,50257]{2,1,0:T(8,128)}\\n     Unpadded size: 1.53G\\n"
           "     XLA label: %fusion.12 = f32[8,1024,50257]{2,1,0:T(8,128)} fusion(...)\\n"
           "     Allocation type: HLO temp\\n     ==========================\\n\\n"
           "  2. Size: 512.00M\\n     Operator: op_name=\\"DUMMY_47\\"\\n     Shape: bf16[16,12,512,512]{3,2,1,0:T(8,128)(2,1)}\\n"
           "     Unpadded size: 512.00M\\n     Allocation type: HLO temp\\n     ==========================\\n")
raise RuntimeError(message)
"""


def test_a_tpu_compilers_out_of_memory_is_mapped_to_the_cells_lines(spawn):
    with pytest.raises(RankError) as failed:
        spawn("--devices 2", TPU_COMPILE_OOM)
    text = strip_ansi("\n".join(failed.value.render_lines()))
    assert "The compiler's largest allocations for the graph, at the cell's lines:" in text, text
    assert ("1.53G  line 4: logits = 'the line whose operation the compiler names'  aten__mm.3/aten__mm  "
            "f32[8,1024,50257]  (HLO temp)") in text, text
    assert "512.00M  (no source line)  DUMMY_47  bf16[16,12,512,512]  (HLO temp)" in text, text
    assert "the graph's temporaries 5.10G" in text and "Most of it: the graph's temporaries and activations." in text
    assert "What to do: use a smaller batch, or gradient checkpointing" in text, text
    # the other rank's failure, in one line
    assert "... ranks 1 failed the same way (RuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. " \
           "Ran out of memory in memory space hbm. Used 20.72G of 15.48G hbm. Exceeded hbm capacity by 5.24G.)" in text


def test_in_a_real_notebook_memory_is_named_an_oom_explained_and_the_pool_kept():
    """Through a Jupyter kernel (nbclient): get_memory_info, %xla_memory, an OOM under its cell, the next cell."""
    nb = execute(notebook(
        "%load_ext xla_magic",
        "%xla_pool start --devices 2",
        "%%xla_spawn\nimport torch, torch_xla, torch_xla.core.xla_model as xm\n"
        "weights = torch.ones(128, 128, device=device)\ntorch_xla.sync()\nxm.get_memory_info(device)['bytes_used']",
        "%xla_memory --rank 0",
        "%%xla_spawn\nhuge = torch.ones(1024, 1024, device=device) + weights.sum()\ntorch_xla.sync()",
        "%%xla_spawn\ndel huge\ntorch_xla.sync()\nxm.get_memory_info(device)['bytes_used']",
        # one graph too big for the device: its temporaries (two 640x640 products) and its argument, 4.69M of 4M
        "%%xla_spawn\nm = torch.randn(640, 640, device=device)\ntorch_xla.sync()\n"
        "s = ((m @ m).relu() @ m).sum()\ntorch_xla.sync()",
        "%xla_pool stop",
    ), XLA_MAGIC_SIM_HBM="4M")
    cells = nb.cells
    assert "[65536, 65536]" in text_of(cells[2])
    assert "Device memory of rank 0: 64.00K used of 4.00M" in text_of(cells[3])
    assert "  weights  float32[128, 128]  other" in text_of(cells[3])
    error = shown_error(cells[4])
    assert "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.00M. " \
           "That was not possible. There are 3.94M free." in error
    assert "  huge  float32[1024, 1024]  (other)" in error and "  weights  float32[128, 128]  (other)" in error, error
    assert "Most of it: tensors left from earlier cells (huge, weights)." in error, error
    assert "What to do: del the names listed above" in error and "xla_magic/launcher" not in error, error
    assert "[65536, 65536]" in text_of(cells[5])  # the pool kept its ranks and their names
    # refused at compile, in the TPU compiler's words, its largest allocations mapped to the cell's line
    error = shown_error(cells[6])
    assert "RuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space " \
           "hbm. Used 4.69M of 4.00M hbm. Exceeded hbm capacity by " in error, error
    assert "Largest program allocations in hbm:" in error and "Allocation type: HLO temp" in error
    assert 'Operator: op_name="s" source_file="<xla_spawn cell ' in error, error
    assert "The compiler's largest allocations for the graph, at the cell's lines:" in error
    assert re.search(r"\[rank 0\] +3\.13M  line 4: torch_xla\.sync\(\)  temporaries  \(HLO temp\)\n", error), error
    # a scalar takes one 512 B tile on a TPU, f32[]{:T(128)} (tests/test_layout.py)
    assert re.search(r"\[rank 0\] +512B  line 4: torch_xla\.sync\(\)  s  f32\[\]  \(output\)\n", error), error
    assert "Most of it: the graph's temporaries and activations." in error
    assert "What to do: " in error and "gradient checkpointing" in error, error


def test_on_the_tpu_path_the_views_use_the_runtimes_figures(ip):
    """On a fake v5e host (tests/fake_tpu_host.py) the runtime's memory call is libtpu's (1 MiB used, peak 2 MiB,
    of 16 GiB): get_memory_info, the line under the cell, %xla_status and %xla_memory show those, not a count."""
    from fake_tpu_host import fake_tpu_host

    with fake_tpu_host(ip, "v5litepod-1"):
        pool_magic(ip, "start --devices 1")
        try:
            with capture_output() as shown:
                value = ip.run_cell_magic("xla_spawn", "", "import torch, torch_xla, torch_xla.core.xla_model as xm\n"
                                                            "x = torch.ones(256, 256, device=device)\ntorch_xla.sync()\n"
                                                            "xm.get_memory_info(device)")
            assert value == [{"bytes_used": 1 << 20, "bytes_limit": 16 << 30, "peak_bytes_used": 2 << 20}]
            # the simulation would have counted x: 256.0 KiB
            assert [line for line in shown.stdout.splitlines() if line.startswith("XLA:")] == \
                ["XLA: peak memory 1.0 MiB"], shown.stdout
            with capture_output() as status:
                ip.run_line_magic("xla_status", "--text")
            assert "1.0 MiB of 16.0 GiB, peak 2.0 MiB (1.0 MiB in the cell)" in status.stdout, status.stdout
            with capture_output() as held:
                ip.run_line_magic("xla_memory", "")
            assert held.stdout.startswith("Device memory of rank 0: 1.00M used of 16.00G, peak 2.00M\n"), held.stdout
            assert "  x  float32[256, 256]  other" in held.stdout
        finally:
            pool_magic(ip, "stop")


def test_two_ranks_peaks_are_32_mib_apart_for_vectors_of_32_and_64_mib(ip, pool):
    """A vector costs its bytes on a TPU (rounded to a tile of at most 1024 elements), so does the report's peak."""
    with capture_output() as shown:
        ip.run_cell_magic("xla_spawn", "", "import torch, torch_xla\n"
                                            "x = torch.ones((rank + 1) * 8 * 2**20).to(device)\ntorch_xla.sync()")
    record = ip._xla_magic_session.history[-1]
    peaks = {rank: state.memory["cell_peak_bytes"] for rank, state in record.ranks.items()}
    assert peaks == {0: 32 << 20, 1: 64 << 20}, peaks
    said = [line for line in shown.stdout.splitlines() if line.startswith("XLA:")]
    assert any("peak memory 32.0 MiB–64.0 MiB (most on rank 1)" in line for line in said), said


TRANSFER_OOM = """import torch, torch_xla
held = [torch.ones(5 * 2**20).to(device) for _ in range(2)]
torch_xla.sync()
more = torch.ones(10 * 2**20).to(device)
torch_xla.sync()
"""


def test_an_out_of_memory_from_a_transfer_is_raised_and_named_at_its_to_device_line(spawn, monkeypatch):
    """40 MiB held of 64 MiB, 40 MiB more moved to the device: a TPU fails at that .to(device), not at the sync."""
    monkeypatch.setenv("XLA_MAGIC_SIM_HBM", "64MiB")
    with pytest.raises(RankError) as failed:
        spawn("--devices 2 --backend cpu", TRANSFER_OOM)
    text = strip_ansi("\n".join(failed.value.render_lines()))
    assert "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 40.00M. " \
           "That was not possible. There are 24.00M free." in text, text
    assert re.search(r"line 4, in <module>\n.*more = torch\.ones\(10 \* 2\*\*20\)\.to\(device\)", text), text
    assert "line 5" not in text
    assert "held[0]  float32[5242880]  (other)" in text and "held[1]  float32[5242880]  (other)" in text
    assert "Most of it: tensors left from earlier cells (held[0], held[1])." in text
