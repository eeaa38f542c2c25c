"""A %%xla_spawn cell is a notebook cell, through real Jupyter kernels (nbclient).

The habits of notebook users, unchanged under %%xla_spawn: %cd and
sys.path.append in the kernel, the user's own module, %time, !ls, a
matplotlib plot from rank 0 (an image/png display_data message), display()
and display handles; in one-shot cells, a pool, the SPMD process and the tpu
launch path. tests/test_notebook_cell.py covers the same through the shell.
"""

from __future__ import annotations

import base64

from helpers import execute, notebook, stream, text_of

SET_UP = """
import os, sys, tempfile
home = tempfile.mkdtemp()
os.makedirs(os.path.join(home, "notebook"))
os.makedirs(os.path.join(home, "my-code"))
with open(os.path.join(home, "notebook", "data.csv"), "w") as f:
    f.write("step,loss\\n")
with open(os.path.join(home, "my-code", "mymodel.py"), "w") as f:
    f.write("def loss(step):\\n    return 1.0 / (1 + step)\\n")
%cd {home}/notebook
sys.path.append(os.path.join(home, "my-code"))
import mymodel
def losses(n):
    return [mymodel.loss(step) for step in range(n)]
"""

HABITS = """%%xla_spawn --devices 2
import mymodel
%time curve = losses(5)
files = !ls
print(open("data.csv").readline().strip(), files)
!echo shell on $rank
import matplotlib.pyplot as plt
if rank == 0:
    plt.plot(curve)
    plt.title("loss")
    plt.show()
from IPython.display import HTML, display
display(HTML(f"<b>rank {rank} done</b>"))
round(curve[-1], 3)
"""


def outputs_of(cell, kind: str) -> list:
    return [output for output in cell.outputs
            if output.output_type == "display_data" and kind in output.data]


def is_png(data: str) -> bool:
    return base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")


def test_a_notebook_cell_works_unchanged_under_xla_spawn():
    nb = execute(notebook(
        "%load_ext xla_magic",
        SET_UP,
        HABITS,
        "%xla_pool start --devices 2",
        "%%xla_spawn\nimport matplotlib.pyplot as plt\nplt.plot([0, rank])\nprint('plotted')",
        "%%xla_spawn\nfrom IPython.display import display\nh = display('step 0', display_id=True)\n"
        "h.update(f'rank {rank}: step 9')",
        "%xla_pool stop",
        "%%xla_spawn --devices 2 --spmd\nimport os, mymodel\nfrom IPython.display import HTML\ndisplay(HTML('<i>spmd</i>'))\n"
        "(os.path.basename(os.getcwd()), mymodel.loss(1))",
        "%%xla_spawn --devices 2 --backend tpu\nimport os, mymodel\nfrom IPython.display import HTML\nx = !echo thread $rank\n"
        "display(HTML(f'<i>thread {rank}</i>'))\n(x, os.path.basename(os.getcwd()), mymodel.loss(3))",
        "%%xla_spawn --devices 2\n%pip install requests",
    ), PJRT_DEVICE="CPU")
    cells = nb.cells
    habits = cells[2]
    out = stream(habits, "stdout")
    assert "[rank 0] CPU times:" in out and "[rank 1] Wall time:" in out
    assert "[rank 1] step,loss ['data.csv']" in out
    assert "[rank 0] shell on 0" in out
    plots = outputs_of(habits, "image/png")
    assert len(plots) == 1 and is_png(plots[0].data["image/png"])  # rank 0's plot, as image/png display data
    assert sorted(o.data["text/html"] for o in outputs_of(habits, "text/html")) == [
        "<b>rank 0 done</b>", "<b>rank 1 done</b>"]
    # The label comes right before the picture it names, after the lines printed before it.
    kinds = [(o.output_type, o.get("text", "")) for o in habits.outputs]
    picture = next(i for i, o in enumerate(habits.outputs) if "image/png" in o.get("data", {}))
    assert kinds[picture - 1][1].endswith("[rank 0]\n")
    assert "[0.2, 0.2]" in text_of(habits)

    pool = cells[4]
    assert len(outputs_of(pool, "image/png")) == 2  # each rank's figure, shown at the end of the cell
    assert "[rank 1] plotted" in stream(pool, "stdout")
    handles = sorted(o.data["text/plain"] for o in outputs_of(cells[5], "text/plain"))
    assert handles == ["'rank 0: step 9'", "'rank 1: step 9'"]  # updated in place, one per rank

    spmd = cells[7]
    assert "[spmd]" in stream(spmd, "stdout")
    assert [o.data["text/html"] for o in outputs_of(spmd, "text/html")] == ["<i>spmd</i>"]
    assert "('notebook', 0.5)" in text_of(spmd)

    threads = cells[8]
    assert sorted(o.data["text/html"] for o in outputs_of(threads, "text/html")) == [
        "<i>thread 0</i>", "<i>thread 1</i>"]
    assert "[(['thread 0'], 'notebook', 0.25), (['thread 1'], 'notebook', 0.25)]" in text_of(threads)

    refused = text_of(cells[9])
    assert "UsageError" in refused and "%pip cannot run inside %%xla_spawn" in refused
