"""log() in a cell: values read with no sync of their own, drawn under the cell, returned by %xla_metrics.

Through a real Jupyter kernel (jupyter_client, every iopub message seen, so
the chart's display and its in-place updates are counted) with a pool of
two simulated devices, and through the shared terminal IPython shell for the
text line. The XLA account of a training cell that logs its loss every step
is compared with that of the same cell without ``log``, run in the same pool.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

import pytest

from helpers import KERNEL_TIMEOUT, Kernel, strip_ansi

TRAIN = """%%xla_spawn
import torch, torch_xla
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).to(device)
x = torch.randn(16, 4).to(device) * (rank + 1)
y = torch.ones(16, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(200):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    {log}
    torch_xla.sync()
"""

ACCOUNT = """import json
record = get_ipython()._xla_magic_session.last_cell
print(json.dumps({rank: {key: state.xla[key] for key in ("compiles", "executions", "transfers", "scalar_reads")}
                  for rank, state in record.ranks.items()}))
"""


class Cell:
    """What one cell sent on iopub: its text, and the chart's displays (the first, then its updates)."""

    def __init__(self, kernel: Kernel, code: str) -> None:
        self.messages: list[dict] = []
        started = time.monotonic()
        reply = kernel.client.execute_interactive(code, timeout=KERNEL_TIMEOUT, stop_on_error=False,
                                                  output_hook=self.messages.append)
        self.seconds = time.monotonic() - started
        self.reply = reply["content"]

    @property
    def text(self) -> str:
        chunks = []
        for msg in self.messages:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                chunks.append(content["text"])
            elif msg["msg_type"] == "error":
                chunks.append(f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]))
            elif msg["msg_type"] == "execute_result":
                chunks.append(content["data"].get("text/plain", ""))
        return strip_ansi("".join(chunks))

    @property
    def charts(self) -> list[dict]:
        """The chart's display_data and update_display_data messages' contents, in order."""
        return [msg["content"] for msg in self.messages
                if msg["msg_type"] in ("display_data", "update_display_data")
                and 'class="xla-metrics"' in msg["content"]["data"].get("text/html", "")]

    @property
    def last_chart(self) -> str:
        return self.charts[-1]["data"]["text/html"]


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        reply, text = k.run("%load_ext xla_magic\n%xla_pool start --devices 2 --backend cpu")
        assert reply["status"] == "ok", text
        yield k
        k.run("%xla_pool stop")
    finally:
        k.close()


def panel(chart: str, name: str) -> str:
    """The part of the chart's SVG that draws ``name``: from its title to the next title."""
    titles = chart.split('font-weight="bold">')
    return next(part for part in titles[1:] if part.startswith(f"{name} = "))


def account(kernel: Kernel) -> dict:
    reply, text = kernel.run(ACCOUNT)
    assert reply["status"] == "ok", text
    return json.loads(text)


def values(kernel: Kernel) -> dict:
    reply, text = kernel.run("import json\ntable = %xla_metrics\nprint(json.dumps(table))")
    assert reply["status"] == "ok", text
    return json.loads(text)


def test_logging_the_loss_every_step_adds_no_sync_and_no_compile_and_the_chart_shows_the_ranks_mean(kernel):
    Cell(kernel, TRAIN.format(log="pass"))  # compiles the step's graphs
    without = Cell(kernel, TRAIN.format(log="pass"))
    assert without.reply["status"] == "ok", without.text
    plain = account(kernel)
    logged = Cell(kernel, TRAIN.format(log="from xla_magic import log\n    log(loss=loss, lr=0.01)"))
    assert logged.reply["status"] == "ok", logged.text
    assert account(kernel) == plain  # the same compiles, executions, device->host transfers and .item()s
    # A view (of a weight the optimizer changes in place) is copied when logged: a graph output of its own,
    # compiled in the first cell that logs it, and nothing more after.
    view = TRAIN.format(log="log(loss=loss, weight=model.weight[0, 0])")
    Cell(kernel, view)
    logged_view = Cell(kernel, view)
    assert logged_view.reply["status"] == "ok", logged_view.text
    assert account(kernel) == plain
    assert "weight = " in logged_view.last_chart
    assert plain["0"]["executions"] >= 200 and plain["0"]["transfers"] == 0
    assert not without.charts  # nothing logged, nothing drawn

    table = values(kernel)
    assert sorted(table) == ["name", "rank", "run", "step", "time", "value"]
    rows = list(zip(table["rank"], table["step"], table["name"], table["value"]))
    assert len(rows) == 2 * 200 * 2  # every step, on both ranks, both names
    last = {rank: value for rank, step, name, value in rows if name == "loss" and step == 199}
    assert sorted(last) == [0, 1] and last[0] != last[1]  # the ranks' data differ
    mean = (last[0] + last[1]) / 2
    chart = logged.last_chart
    assert f"loss = {mean:.4g} at step 199, mean of 2 ranks" in chart
    assert "lr = 0.01 at step 199, mean of 2 ranks" in chart
    assert logged.charts[0]["transient"]["display_id"]
    assert all(update["transient"]["display_id"] == logged.charts[0]["transient"]["display_id"]
               for update in logged.charts[1:])  # one chart, updated in place
    assert logged.charts[-1]["data"]["text/plain"] == f"lr 0.01 (step 199) · loss {mean:.4g} (step 199)"


def test_a_nan_is_a_gap_said_once_and_every_rank_has_its_line(kernel):
    cell = Cell(kernel, "%%xla_spawn --metrics ranks\nimport torch\n"
                        "for step in range(12):\n"
                        "    bad = rank == 1 and step in (5, 6)\n"
                        "    log(loss=torch.tensor(float('nan') if bad else step + rank, device=device))\n"
                        "    if rank == 0:\n        log(step, only_zero=step * 2)\n"
                        "    __import__('torch_xla').sync()")
    assert cell.reply["status"] == "ok", cell.text
    said = re.findall(r"log: loss is nan at step (\d+) on rank (\d+)", cell.text)
    assert said == [("5", "1")]  # once, with its step and rank
    chart = cell.last_chart
    assert "loss = 11 (rank 0), 12 (rank 1) at step 11" in chart
    assert "only_zero = 22 (rank 0) at step 11" in chart  # drawn from the one rank that logs it
    loss_panel = panel(chart, "loss")
    assert loss_panel.count("<polyline") == 3  # rank 0's line, rank 1's broken by its NaNs
    assert ">rank 0<" in loss_panel and ">rank 1<" in loss_panel


def test_a_value_that_is_not_a_number_is_refused_at_the_call(kernel):
    cell = Cell(kernel, "%%xla_spawn\nlog(loss=1.0)\nif rank == 1:\n    log(loss='high')")
    assert cell.reply["status"] == "error"
    assert "[rank 1]" in cell.text and "TypeError" in cell.text
    assert "log(loss=...) takes a number, a one-element tensor or array, not str ('high')" in cell.text
    cell = Cell(kernel, "%%xla_spawn\nimport torch\nlog(w=torch.ones(3, device=device))")
    assert cell.reply["status"] == "error"
    assert "log(w=...) takes one number, but this tensor has shape (3,)" in cell.text


def test_a_value_changed_in_place_after_it_was_logged_is_dropped_and_said_once(kernel):
    cell = Cell(kernel, "%%xla_spawn\nimport torch, torch_xla\ntotal = torch.zeros((), device=device)\n"
                        "for step in range(30):\n    log(total=total)\n    torch_xla.sync()\n"
                        "    total += 1  # in place: what was logged a sync ago is not what it was\n")
    assert cell.reply["status"] == "ok", cell.text
    said = re.findall(r"\[rank (\d)\] log: total was changed in place after it was logged", cell.text)
    assert sorted(said) == ["0", "1"]  # once per rank


HELD_UP_READ = """%%xla_spawn
import threading, torch, torch_xla
reading, go_on, callers = threading.Event(), threading.Event(), []
transfer = torch_xla._XLAC._xla_get_cpu_tensors

def held_up(tensors):  # a read that waits, as one waits for the device's current graph to end
    callers.append(threading.get_ident())
    reading.set()
    go_on.wait(60)
    return transfer(tensors)

torch_xla._XLAC._xla_get_cpu_tensors = held_up
try:
    value, steps = torch.zeros((), device=device), 0
    while not reading.is_set() and steps < 10_000:
        value = value + 1
        log(v=value)
        torch_xla.sync()
        steps += 1
    for _ in range(5):  # the cell's thread goes on while its read waits
        value = value + 1
        log(v=value)
        torch_xla.sync()
        steps += 1
    went_on = not go_on.is_set()
    go_on.set()
finally:
    torch_xla._XLAC._xla_get_cpu_tensors = transfer
(steps, went_on, threading.get_ident() in callers)
"""


def test_a_read_that_waits_for_the_device_does_not_hold_up_the_cells_thread(kernel):
    cell = Cell(kernel, HELD_UP_READ)
    assert cell.reply["status"] == "ok", cell.text
    results = re.findall(r"\((\d+), (True|False), (True|False)\)", cell.text)
    assert len(results) == 2, cell.text
    for steps, went_on, read_on_the_cells_thread in results:
        assert read_on_the_cells_thread == "False" and went_on == "True"
    table = values(kernel)  # every value, the held-up read's too
    for rank, (steps, _, _) in enumerate(results):
        assert sorted(step for r, step in zip(table["rank"], table["step"]) if r == rank) == list(range(int(steps)))


def test_the_chart_redraws_a_few_times_a_second_however_fast_the_ranks_log(kernel):
    cell = Cell(kernel, "%%xla_spawn\nimport time\nstart = time.monotonic()\ncalls = 0\n"
                        "while time.monotonic() - start < 2.0:\n    log(calls=calls)\n    calls += 1\ncalls")
    assert cell.reply["status"] == "ok", cell.text
    calls = [int(n) for n in re.findall(r"\d+", cell.text.strip().splitlines()[-1])]
    assert len(calls) == 2 and min(calls) > 1000  # thousands of values logged by each rank
    from xla_magic.notebook import metrics_view

    # The first drawing, then at most one every REDRAW_SECONDS, and the last at the end.
    assert 2 <= len(cell.charts) <= cell.seconds / metrics_view.REDRAW_SECONDS + 2
    last = max(calls) - 1  # the last step, logged by the rank(s) that went furthest, whose mean it shows
    there = calls.count(max(calls))
    assert f"calls = {last:.4g} at step {last}, mean of {there} rank{'s' * (there > 1)}" in cell.last_chart


def test_log_outside_a_cell_says_where_it_works():
    from xla_magic import log

    with pytest.raises(RuntimeError, match="inside a %%xla_spawn cell"):
        log(loss=1.0)


def test_output_that_is_not_a_terminal_gets_the_text_line_once_at_the_end(ip, pool, spawn):
    run = spawn("", "import torch, torch_xla\nfor step in range(30):\n"
                    "    log(loss=torch.tensor(1.0 / (step + 1), device=device) * (rank + 1))\n"
                    "    torch_xla.sync()")
    mean = (1 / 30 + 2 / 30) / 2
    # Output that is not a terminal (captured here) gets the line once, at the end: never inside a rank's line.
    assert [line for line in run.stdout.splitlines() if line.startswith("loss ")] == [f"loss {mean:.4g} (step 29)"]
    assert "\r" not in run.stdout and "<svg" not in run.stdout
    table = ip.run_line_magic("xla_metrics", "")
    assert math.isclose(sum(v for v, s in zip(table["value"], table["step"]) if s == 29) / 2, mean, rel_tol=1e-6)


def test_metrics_dir_writes_tensorboard_event_files_that_tensorboard_reads(ip, pool, spawn, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spawn(f"--metrics-dir {tmp_path}", "import torch, torch_xla\nfor step in range(10):\n"
          "    log(loss=torch.tensor(float(step), device=device) + rank, lr=0.1)\n    torch_xla.sync()")
    run = ip._xla_magic_session.last_cell.run_id
    for rank in (0, 1):
        events = EventAccumulator(str(tmp_path / f"run-{run}" / f"rank-{rank}"))
        events.Reload()
        assert sorted(events.Tags()["scalars"]) == ["loss", "lr"]
        assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, float(s + rank)) for s in range(10)]
        assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.1] * 10)


def test_metrics_dir_is_refused_before_anything_starts_where_the_ranks_python_has_no_tensorboard(
        ip, monkeypatch, tmp_path):
    """The ranks' Python here: a virtual environment of the kernel's Python with nothing installed in it."""
    import subprocess

    from IPython.core.error import UsageError

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = str(tmp_path / "bare" / "bin" / "python")
    session = ip._xla_magic_session
    session.stop_pool()
    session.host.drop_launcher()  # the next cell's ranks would run the bare Python's launcher
    monkeypatch.setenv("XLA_MAGIC_PYTHON", bare)
    with pytest.raises(UsageError) as refused:
        ip.run_cell_magic("xla_spawn", f"--devices 2 --backend cpu --metrics-dir {tmp_path / 'board'}", "log(loss=1.0)")
    assert f"needs the tensorboard package in the ranks' Python ({bare})" in str(refused.value)
    assert f"{bare} -m pip install tensorboard" in str(refused.value)
    assert session.host.launcher is None and not (tmp_path / "board").exists()  # nothing started, nothing written


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_each_rank_logs_in_a_one_shot_cell_and_as_a_thread_of_the_tpu_launch_path(ip, spawn, monkeypatch, backend):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # for tpu: its launch path, the ranks as CPU threads of one process
    run = spawn(f"--devices 2 --backend {backend}",
                "import torch, torch_xla\nfor step in range(6):\n"
                "    log(loss=torch.tensor(float(step), device=device) * (rank + 1))\n    torch_xla.sync()\n"
                "log(after=torch.ones(2, device=device).sum())  # after the last sync: read at the cell's end")
    record = ip._xla_magic_session.last_cell
    rows = sorted((rank, step, name, value) for rank, step, name, value, _when in record.metrics)
    assert rows == sorted([(rank, step, "loss", float(step * (rank + 1))) for rank in (0, 1) for step in range(6)]
                          + [(rank, 6, "after", 2.0) for rank in (0, 1)])
    assert "loss 7.5 (step 5) · after 2 (step 6)" in run.stdout.splitlines()


def test_a_terminal_ipython_gets_one_text_line_rewritten_in_place(tmp_path):
    """A real IPython on a pseudo-terminal: the line is rewritten (carriage return, erase) while the cell runs, and
    ends as a line of its own with the last value logged."""
    import pexpect

    gate = tmp_path / "gate"
    body = (f"import os, time\nstep = 0\nwhile not os.path.exists({str(gate)!r}):\n    log(loss=float(step))\n"
            "    step += 1\n    time.sleep(0.01)\nprint('last step', step - 1)")
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"],
                          env=env, encoding="utf-8", timeout=KERNEL_TIMEOUT, dimensions=(40, 200))
    try:
        child.expect(r"In \[1\]: ")
        child.sendline("%load_ext xla_magic")
        child.expect(r"In \[2\]: ")
        child.sendline(f"get_ipython().run_cell_magic('xla_spawn', '--devices 2', {body!r})")
        steps: set[str] = set()
        while len(steps) < 2:  # rewritten twice while the ranks still log: the cursor left at the line's start
            child.expect(r"\r\x1b\[Kloss \S+ \(step (\d+)\)\r")
            steps.add(child.match.group(1))
        gate.touch()
        child.expect(r"In \[3\]: ")
        tail = child.before
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        gate.touch()
        child.close(force=True)
    last = max(int(step) for step in re.findall(r"\[rank \d\] last step (\d+)", tail))
    # Its last state, ended as a line of its own: the last step's value (the same on both ranks, so their mean).
    assert re.findall(r"\r\x1b\[K(loss [^\r\n]*)\r\n", tail)[-1] == f"loss {float(last):.4g} (step {last})", tail
