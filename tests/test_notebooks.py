"""The notebooks, through real Jupyter kernels on the CPU simulation.

Each committed ``.ipynb`` is what its jupytext source (``notebooks/NAME.py``)
says, as notebooks/sync.py writes it; the quickstart is run from its source.
The quickstart runs top to bottom and its outputs are checked. The Colab and
Kaggle notebooks cannot reach a TPU here: every code cell must compile, and
every cell that needs neither a TPU nor an install runs on the simulation,
with the stale TPU variables of those services set in the kernel.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import jupytext
import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.magic_arguments import parse_argstring

from helpers import strip_ansi
from xla_magic.notebook.magics import XlaMagics

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["quickstart", "colab_tpu", "kaggle_tpu"]  # notebooks/NAME.py is the source of notebooks/NAME.ipynb
TPU_NOTEBOOKS = ["colab_tpu.ipynb", "kaggle_tpu.ipynb"]
SKIPPED_OFF_TPU = {"install", "needs-tpu"}


def load_sync():
    """notebooks/sync.py, which writes each notebook from its jupytext source and runs the quickstart."""
    spec = importlib.util.spec_from_file_location("sync_notebooks", NOTEBOOKS / "sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(name: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    return notebook


def tags(cell: nbformat.NotebookNode) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def execute(notebook: nbformat.NotebookNode, **env: str) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel of this environment, in notebooks/, as notebooks/sync.py does."""
    return load_sync().execute(notebook, timeout=900, **env)  # per cell: a bound on a hang, not on speed


def cell_with(notebook: nbformat.NotebookNode, fragment: str) -> nbformat.NotebookNode:
    found = [cell for cell in notebook.cells if cell.cell_type == "code" and fragment in cell.source]
    assert len(found) == 1, f"expected one code cell containing {fragment!r}, found {len(found)}"
    return found[0]


def stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(out.text for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")


def result(cell: nbformat.NotebookNode) -> str:
    values = [out.data["text/plain"] for out in cell.outputs if out.output_type == "execute_result"]
    assert values, f"no result from cell:\n{cell.source}"
    return values[0]


def no_errors(notebook: nbformat.NotebookNode) -> None:
    for cell in notebook.cells:
        if cell.cell_type == "code" and "raises-exception" not in tags(cell):
            errors = [out for out in cell.outputs if out.output_type == "error"]
            assert not errors, f"cell failed: {cell.source[:80]!r}: {errors[0].ename}: {errors[0].evalue}"


# --- each committed notebook is what its paired source says ----------------------


def shape(notebook: nbformat.NotebookNode) -> list[tuple[str, str, list[str]]]:
    return [(cell.cell_type, cell.source, sorted(tags(cell))) for cell in notebook.cells]


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_its_paired_source(name):
    source = load_sync().from_source(name)  # jupytext's reading of notebooks/NAME.py
    committed = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
    stale = f"notebooks/{name}.ipynb differs from notebooks/{name}.py: run python notebooks/sync.py"
    assert shape(committed) == shape(source), stale
    assert [cell.id for cell in read(f"{name}.ipynb").cells] == [cell.id for cell in source.cells], stale
    for key in ("kernelspec", "accelerator"):
        assert committed.metadata.get(key) == source.metadata.get(key), f"{stale} ({key})"
    assert source.metadata["jupytext"]["formats"] == "ipynb,py:percent"  # paired, for jupytext --sync in Jupyter
    assert (name != "quickstart") == (source.metadata.get("accelerator") == "TPU")


def test_every_notebook_trains_with_the_same_cell():
    """One training example in all three notebooks: only the magic line differs."""
    def body(name: str) -> str:
        (cell,) = [c for c in load_sync().from_source(name).cells if "xm.optimizer_step(optimizer)" in c.source]
        return cell.source.split("\n", 1)[1]

    assert body("quickstart") == body("colab_tpu") == body("kaggle_tpu")


def test_the_committed_quickstart_keeps_its_outputs(quickstart):
    committed = read("quickstart.ipynb")
    ran = [bool(cell.outputs) for cell in quickstart.cells if cell.cell_type == "code"]
    kept = [bool(cell.outputs) for cell in committed.cells if cell.cell_type == "code"]
    assert len(kept) == len(ran) and all(k for k, r in zip(kept, ran) if r), (
        "notebooks/quickstart.ipynb lost outputs: run python notebooks/sync.py")
    assert "timing" not in str([cell.metadata for cell in committed.cells])  # written without execution times


# --- quickstart: runs, and shows what it promises --------------------------------


@pytest.fixture(scope="module")
def quickstart():
    return execute(load_sync().from_source("quickstart"))  # from its source: the committed outputs do not count


def test_quickstart_says_hello_from_every_rank(quickstart):
    hello = cell_with(quickstart, "hello from rank")
    for rank in range(8):
        assert f"[rank {rank}] hello from rank {rank} of 8, on xla:0" in stdout(hello)
    assert result(hello) == repr([3.0 * rank for rank in range(8)])
    assert "total: 84.0" in stdout(cell_with(quickstart, "sums by rank"))


def test_quickstart_training_converges_on_every_rank(quickstart):
    train = cell_with(quickstart, "--out weights")
    assert ".item()" not in train.source  # its loss is log()ged, with no sync of its own
    charts = [out for out in train.outputs
              if out.output_type == "display_data" and 'class="xla-metrics"' in out.data.get("text/html", "")]
    assert len(charts) == 1  # one chart, updated in place: the notebook keeps its last drawing
    shown = re.search(r"loss = ([\d.e+-]+) at step 39, mean of 4 ranks", charts[0].data["text/html"])
    assert shown is not None and float(shown.group(1)) < 0.02, charts[0].data["text/plain"]  # the noise is 0.01
    assert "[rank" not in stdout(train)  # nothing printed by the ranks
    check = stdout(cell_with(quickstart, "all with the same weights"))
    assert "4 ranks, all with the same weights: True" in check
    learned = ast.literal_eval(re.search(r"learned: (\[.*\])", check).group(1))
    assert learned == pytest.approx([2.0, -3.0, 0.5, 1.0], abs=2e-2)


def test_quickstart_shows_a_failing_rank(quickstart):
    failing = cell_with(quickstart, "found bad data")
    errors = [out for out in failing.outputs if out.output_type == "error"]
    assert [error.ename for error in errors] == ["RankError"]
    shown = "\n".join(errors[0].traceback)
    assert "[rank 1]" in shown and "ValueError: rank 1 found bad data" in shown
    assert "[rank 0]" not in shown


def test_quickstart_pool_keeps_what_ranks_built(quickstart):
    assert "pool ready" in stdout(cell_with(quickstart, "%xla_pool start --devices"))
    reused = ast.literal_eval(result(cell_with(quickstart, "steps_done += 1")))
    assert reused == [(rank, 1, "xla:0") for rank in range(4)]
    stops = [cell for cell in quickstart.cells if cell.source == "%xla_pool stop"]
    assert len(stops) == 2 and all("pool stopped" in stdout(cell) for cell in stops)  # the rank pool, the SPMD one


def test_quickstart_lightning_trains_across_the_ranks(quickstart):
    trainer = cell_with(quickstart, "L.Trainer(")
    shown = "".join(out.text for out in trainer.outputs if out.output_type == "stream")
    # Lightning's progress bar is rich's where rich is installed: its colours
    # and cursor codes around the text, which a notebook does not show.
    shown = strip_ansi(shown)
    assert "[rank 0] Epoch 14" in shown and "[rank 1]" not in shown  # progress and logs from rank 0 only
    check = stdout(cell_with(quickstart, "Lightning on"))
    assert "Lightning on 4 ranks, the same weights everywhere: True" in check
    learned = ast.literal_eval(re.search(r"learned: (\[.*\])", check).group(1))
    assert learned == pytest.approx([2.0, -3.0, 0.5, 1.0], abs=2e-2)
    fabric = stdout(cell_with(quickstart, "fabric.launch(train"))
    assert re.findall(r"^\[rank (\d)\] epoch (\d+)", fabric, re.MULTILINE) == [("0", "5"), ("0", "10"), ("0", "15")]


def test_cells_that_need_a_missing_package_are_skipped_with_a_note():
    (needs,) = [c.source for c in load_sync().from_source("quickstart").cells if "def needs(" in c.source]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "%load_ext xla_magic", needs,
        "%%needs no_such_package_here\n%%xla_spawn --devices 2\nimport no_such_package_here",
        "%%needs json\n%%xla_spawn --devices 2\nimport json\njson.dumps(rank)",
    )])
    execute(notebook)
    no_errors(notebook)
    skipped = stdout(notebook.cells[2])
    assert skipped == ("skipped: this cell needs no_such_package_here, which is not installed here "
                       "(pip install no_such_package_here)\n")
    assert "['0', '1']" in result(notebook.cells[3])


def widget_text(notebook: nbformat.NotebookNode) -> str:
    """Every text value of the widgets the notebook displayed (its saved widget state)."""
    state = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = state.get("state", {}).values()
    return "\n".join(str(model["state"].get("value", "")) for model in models)


def test_quickstart_status_is_a_live_panel(quickstart):
    status = cell_with(quickstart, "%xla_status")
    kinds = {kind for out in status.outputs if out.output_type == "display_data" for kind in out.data}
    assert "application/vnd.jupyter.widget-view+json" in kinds
    panel = widget_text(quickstart)
    assert "kernel is XLA-free" in panel
    assert "CPU simulation, 8 devices" in panel


def test_quickstart_spmd_section_shards_a_matmul_and_trains_fsdpv2_in_a_pool(quickstart):
    matmul = cell_with(quickstart, "--spmd --mesh 4,2 --out product")
    assert "[spmd] one process, 8 devices, mesh {'data': 4, 'model': 2}" in stdout(matmul)
    pictures = [out for out in matmul.outputs if out.output_type == "display_data"]
    assert len(pictures) == 1 and '<div class="xla-magic-sharding"' in pictures[0].data["text/html"]
    check = stdout(cell_with(quickstart, "equals the kernel's a @ b"))
    assert "one value, whole on the CPU: Tensor (8, 4) cpu" in check and "equals the kernel's a @ b: True" in check
    train = cell_with(quickstart, 'print("losses:", losses)')
    assert "[spmd] losses: [" in stdout(train) and result(train) == "True"


def test_quickstart_runs_clean_and_leaves_the_kernel_xla_free(quickstart):
    no_errors(quickstart)
    assert "torch_xla imported in this kernel: False" in stdout(cell_with(quickstart, "torch_xla imported"))


# --- Colab and Kaggle: compile everything, run what needs no TPU -----------------


def spawn_line_and_body(source: str) -> tuple[str, str] | None:
    first, _, body = source.partition("\n")
    if not first.startswith("%%xla_spawn"):
        return None
    return first[len("%%xla_spawn") :], body


@pytest.mark.parametrize("name", TPU_NOTEBOOKS)
def test_tpu_notebook_code_compiles(name):
    transformer = TransformerManager()
    cells = [cell for cell in read(name).cells if cell.cell_type == "code"]
    assert cells
    for cell in cells:
        python = transformer.transform_cell(cell.source)
        compile(python, f"<{name}>", "exec")
        spawn = spawn_line_and_body(cell.source)
        if spawn is not None:
            line, body = spawn
            parse_argstring(XlaMagics.xla_spawn, line)  # the options are valid
            compile(transformer.transform_cell(body), f"<{name} %%xla_spawn>", "exec")


@pytest.mark.parametrize("name", TPU_NOTEBOOKS)
def test_tpu_notebook_install_cell_keeps_the_runtime(name):
    install = [cell for cell in read(name).cells if "install" in tags(cell)]
    assert len(install) == 1
    source = install[0].source
    assert "--no-deps" in source and "assert after == before" in source
    for package in ("torch", "torch_xla", "libtpu"):
        assert f'"{package}"' in source


@pytest.mark.parametrize("name", TPU_NOTEBOOKS)
def test_tpu_notebook_runs_on_the_simulation(name):
    notebook = read(name)
    skipped = [cell for cell in notebook.cells if tags(cell) & SKIPPED_OFF_TPU]
    assert len(skipped) == 2  # the install cell and the device-memory cell
    notebook.cells = [cell for cell in notebook.cells if not tags(cell) & SKIPPED_OFF_TPU]
    # What Kaggle and Colab images leave in the environment.
    execute(notebook, TPU_PROCESS_ADDRESSES="localhost:8476", CLOUD_TPU_TASK_ID="0")
    no_errors(notebook)

    runtime = stdout(cell_with(notebook, "probe.find_tpu()"))
    assert "TPU: none found" in runtime
    assert "TPU_PROCESS_ADDRESSES = 'localhost:8476'" in runtime  # the kernel keeps its own
    layout = stdout(cell_with(notebook, "len(set(layout))"))
    assert "8 ranks = 8 processes x 1 thread(s) each" in layout
    stale = ast.literal_eval(result(cell_with(notebook, "{name: os.environ.get(name)")))
    assert stale == [{"TPU_PROCESS_ADDRESSES": None, "CLOUD_TPU_TASK_ID": None}]
    assert "8 ranks, all with the same weights: True" in stdout(cell_with(notebook, "all with the same weights"))
    libtpu = stdout(cell_with(notebook, "kernel_holds_libtpu()"))
    assert "libtpu loaded in this kernel: False" in libtpu
    loaded = ast.literal_eval(result(cell_with(notebook, "--out loaded")))
    assert loaded == [256 * 256 + 256 + 256 * 10 + 10] * 8
    assert "torch_xla imported in this kernel: False" in stdout(cell_with(notebook, "torch_xla imported"))
    if name == "kaggle_tpu.ipynb":  # FSDPv2 over every device, in one SPMD process
        fsdp = cell_with(notebook, "--spmd --mesh 8,1 --axes fsdp,model")
        assert "[spmd] step 9: loss" in stdout(fsdp) and result(fsdp).startswith("(8, ")
