"""%%xla_spawn through real Jupyter kernels: nbclient notebooks and jupyter_client.

Each test starts its own kernel process, so a kill or an interrupt here is a
real signal to a real kernel.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time

import psutil
import pytest

from helpers import Kernel, execute, notebook, shown_error, stream, text_of, wait_gone


def test_notebook_runs_cells_on_ranks_end_to_end():
    nb = execute(notebook(
        "%load_ext xla_magic",
        "def double(v):\n    return 2 * v\ntriple = lambda v: 3 * v\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x",
        "%%xla_spawn --devices 2 --out gathered\n"
        "import torch, sys\n"
        "x = torch.ones(3, device=device) * rank\n"
        "print('hello from', rank)\n"
        "print('to stderr', rank, file=sys.stderr)\n"
        "(double(rank), triple(rank), Point(rank).x, float(x.sum().cpu()))",
        "gathered",
        "%%xla_spawn --devices 2\nx = (1,\n",
        "import threading\nlock = threading.Lock()",
        "%%xla_spawn --devices 2\nprint(lock)",
        "%%xla_spawn --devices 2\nif rank == 1:\n    raise ValueError('rank one is unhappy')\nrank",
        "import sys\n('torch_xla' in sys.modules, '_XLAC' in sys.modules)",
        "%%xla_spawn --devices 2\nrank * 10",
        "pass\nx = (1,\n",  # cell 4's syntax error in a plain cell, on the same line of its cell
    ))
    cells = nb.cells
    spawned = cells[2]
    assert stream(spawned, "stdout").count("hello from") == 2
    for r in range(2):
        assert f"[rank {r}] hello from {r}" in stream(spawned, "stdout")
        assert re.search(rf"\[rank {r}\]\S* to stderr {r}", stream(spawned, "stderr"))
    assert "[(0, 0, 0, 0.0), (2, 3, 1, 3.0)]" in text_of(spawned)
    assert "[(0, 0, 0, 0.0), (2, 3, 1, 3.0)]" in text_of(cells[3])
    assert "SyntaxError" in text_of(cells[4]) and "[rank" not in text_of(cells[4])
    assert shown_error(cells[4]) == shown_error(cells[10])  # as the kernel shows a plain cell's: line, caret, message
    assert "line 2" in shown_error(cells[4]) and "Traceback" not in shown_error(cells[4])
    assert "UsageError" in text_of(cells[6]) and "'lock' (_thread.lock)" in text_of(cells[6])
    failed = text_of(cells[7])
    assert "RankError" in failed and "[rank 1]" in failed
    assert "ValueError: rank one is unhappy" in failed and "raise ValueError('rank one is unhappy')" in failed
    assert "(False, False)" in text_of(cells[8])
    assert "[0, 10]" in text_of(cells[9])


def test_kernel_that_initialised_xla_is_refused_with_a_way_out():
    """Every placement is refused once the kernel holds an XLA runtime: a one-shot cell, and an SPMD pool's
    cell and a fresh SPMD cell (the pool started before the kernel touched XLA); the status panel's kernel
    badge turns red."""
    nb = execute(
        notebook(
            "%load_ext xla_magic",
            "%xla_pool start --spmd --devices 2",
            "import torch, torch_xla\nfloat(torch.ones(2, device=torch_xla.device()).sum().cpu())",
            "%%xla_spawn\nworld_size",
            "%%xla_spawn --spmd --fresh --devices 2\nworld_size",
            "%xla_pool stop",
            "%%xla_spawn --devices 2\nrank",
            "%xla_help kernel-initialised-xla",
            "from xla_magic.notebook import status\nfact = status.kernel_fact()\nprint(fact.alarm, fact.kind)\n"
            "print(status.facts_html([fact]))",
        ),
        PJRT_DEVICE="CPU",
    )
    assert "pool ready" in stream(nb.cells[1], "stdout") and "2.0" in text_of(nb.cells[2])
    for refused in (text_of(nb.cells[3]), text_of(nb.cells[4])):
        assert "UsageError" in refused and "%%xla_spawn refused: this kernel has initialised an XLA runtime" in refused
    assert "pool stopped" in stream(nb.cells[5], "stdout")
    refused = text_of(nb.cells[6])
    assert "UsageError" in refused
    assert "initialised an XLA runtime" in refused and "Restart the kernel" in refused
    # the line the refusal ends with, run in the same notebook, shows its troubleshooting entry there
    assert refused.rstrip().endswith("%xla_help kernel-initialised-xla says more.")
    (shown,) = [output for output in nb.cells[7].outputs if output.output_type == "display_data"]
    assert shown.data["text/markdown"].startswith("**%%xla_spawn refused: this kernel has initialised an XLA runtime**")
    assert "keep every use of torch_xla inside" in " ".join(shown.data["text/markdown"].split())
    first, badge = stream(nb.cells[8], "stdout").split("\n", 1)
    assert first == "True held"
    assert "kernel holds an XLA runtime" in badge and "Restart the kernel" in badge
    assert "#c62828" in badge


@pytest.fixture
def kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.close()


def test_stop_button_interrupts_the_ranks_and_the_kernel_carries_on(kernel):
    kernel.run("%load_ext xla_magic")
    interrupted = []

    def on_output(text):
        if not interrupted and text.count("sleeping") == 2:
            interrupted.append(time.monotonic())
            kernel.manager.interrupt_kernel()

    reply, text = kernel.run(
        "%%xla_spawn --devices 2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)",
        on_output=on_output,
    )
    assert interrupted
    assert reply["status"] == "error" and reply["ename"] == "RunInterrupted"
    assert "interrupted; the ranks were stopped" in text
    reply, text = kernel.run("%%xla_spawn --devices 2\nrank + 5")
    assert reply["status"] == "ok" and "[5, 6]" in text


def test_killed_kernel_takes_launcher_and_ranks_with_it(kernel):
    kernel.run("%load_ext xla_magic")
    pids: set[int] = set()

    # Start a long cell without waiting for it, then kill the kernel under it.
    kernel.client.execute(
        "print('pid', get_ipython()._xla_magic_session.host.ensure_launcher().pid, flush=True)\n"
    )
    kernel.client.execute(
        "%%xla_spawn --devices 2\nimport os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(600)"
    )
    deadline = time.monotonic() + 120
    while len(pids) < 3 and time.monotonic() < deadline:
        try:
            msg = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:  # nothing this second; the deadline bounds the wait
            continue
        if msg["msg_type"] == "stream":
            pids.update(int(p) for p in re.findall(r"pid (\d+)", msg["content"]["text"]))
    assert len(pids) == 3, pids  # the launcher and two ranks
    descendants = {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
    assert pids <= descendants
    os.kill(kernel.pid, signal.SIGKILL)
    assert wait_gone(descendants) == []
