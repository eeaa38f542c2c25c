"""Background runs (``%%xla_spawn --bg``) through a real Jupyter kernel: the notebook stays free, each line goes
under the cell that started the run, and the run's log on disk replays it to a client that connects later.

The runs here wait for files the test writes (never for a guessed time), so each step of a run happens when
the test says; every iopub message is kept with its parent header, to tell under which cell a line went.
"""

from __future__ import annotations

import json
import os
import queue
import re
import time

import pytest
from jupyter_client import BlockingKernelClient

from helpers import KERNEL_TIMEOUT, Kernel, kernel_with_pool, strip_ansi
from xla_magic.runs import log as run_log


class Notebook:
    """A front end on a real kernel that keeps every iopub message it read, whichever cell it belongs to."""

    def __init__(self, kernel: Kernel, client=None) -> None:
        self.kernel = kernel
        self.client = client or kernel.client
        self.messages: list[dict] = []
        self.prompts: list[str] = []

    def send(self, code: str, allow_stdin: bool = False) -> str:
        return self.client.execute(code, stop_on_error=False, allow_stdin=allow_stdin)

    def read_until(self, ready, timeout: float = KERNEL_TIMEOUT, answers: list[str] | None = None) -> None:
        """Read iopub (and answer stdin from ``answers``) until ``ready()``."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline, f"not seen in {timeout} s: {self.messages[-5:]}"
            if answers is not None:
                try:
                    request = self.client.get_stdin_msg(timeout=0.01)
                except queue.Empty:  # no prompt now: read iopub
                    pass
                else:
                    self.prompts.append(request["content"]["prompt"])
                    self.client.input(answers.pop(0))
            try:
                self.messages.append(self.client.get_iopub_msg(timeout=0.1))
            except queue.Empty:  # nothing this tenth of a second: the deadline bounds the wait
                continue

    def idle(self, msg_id: str) -> bool:
        return any(m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
                   and m["content"]["execution_state"] == "idle" for m in self.messages)

    def run(self, code: str, answers: list[str] | None = None) -> tuple[str, str]:
        """Run a cell to its end: (its msg_id, what it showed, colours removed)."""
        msg_id = self.send(code, allow_stdin=answers is not None)
        self.read_until(lambda: self.idle(msg_id), answers=answers)
        return msg_id, self.under(msg_id)

    def under(self, msg_id: str, streams_only: bool = False) -> str:
        """What the cell ``msg_id`` showed: streams, displays' text, results and errors, in order."""
        chunks = []
        for m in self.messages:
            if m["parent_header"].get("msg_id") != msg_id or streams_only and m["msg_type"] != "stream":
                continue
            content = m["content"]
            if m["msg_type"] == "stream":
                chunks.append(content["text"])
            elif m["msg_type"] in ("display_data", "execute_result"):
                chunks.append(content["data"].get("text/plain", "") + "\n")
            elif m["msg_type"] == "error":
                chunks.append(f"{content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]) + "\n")
        return strip_ansi("".join(chunks))


@pytest.fixture(scope="module")
def kernel():
    """A real kernel with a 2-rank pool for the module."""
    with kernel_with_pool() as k:
        yield k


@pytest.fixture
def nb(kernel):
    notebook = Notebook(kernel)
    yield notebook
    # no run of this test goes on into the next one
    notebook.run("for _run in get_ipython()._xla_magic_session.background.living():\n    _run.stop()")


def gated(marker: str, before: int, after: int) -> str:
    """A training-like cell: ``before`` steps, a wait for ``marker`` to exist, ``after`` more steps; rank * 10."""
    return (f"%%xla_spawn --bg -o run\n"
            f"import os, time\n"
            f"for step in range({before + after}):\n"
            f"    if step == {before}:\n"
            f"        while not os.path.exists({marker!r}):\n"
            f"            time.sleep(0.02)\n"
            f"    print('step', step, 'loss', 1 / (step + 1), flush=True)\n"
            f"rank * 10")


def steps(text: str, rank: int) -> list[int]:
    return [int(n) for n in re.findall(rf"\[rank {rank}\] step (\d+) loss", text)]


def test_a_background_cell_frees_the_notebook_and_its_lines_stay_under_it(nb, tmp_path):
    marker = str(tmp_path / "go")
    started, shown = nb.run(gated(marker, 2, 2))
    assert re.search(r"<run (\d+) \(import os, time\): running", shown), shown
    run_id = int(re.search(r"<run (\d+)", shown)[1])
    nb.read_until(lambda: steps(nb.under(started, True), 1) == [0, 1] and steps(nb.under(started, True), 0) == [0, 1])
    # the kernel runs other cells meanwhile, and their output stays theirs
    other, text = nb.run("print('plotted', sum(range(4)))")
    assert text == "plotted 6\n"
    _, status = nb.run("%xla_status --text")
    assert re.search(rf"{run_id}\b.*running", status), status
    _, text = nb.run("print(run.done(), repr(run))")
    assert text.startswith("False <run ") and "running" in text and "on 2 ranks; last: [rank" in text
    # the log on disk, read by this process while the run goes on: what came so far, and no end yet
    _, path = nb.run("print(run.path)")
    so_far = run_log.read(path.strip())
    assert steps(run_log.text(so_far), 0) == [0, 1] and not any("end" in entry for entry in so_far)
    open(marker, "w").close()
    followed = list(run_log.follow(path.strip()))  # live, until the run's end
    assert steps(run_log.text(followed), 1) == [0, 1, 2, 3] and followed[-1]["end"] == "done"
    _, text = nb.run("print(run.wait(), run.results, run.error, run.done())")
    assert text == "[0, 10] [0, 10] None True\n"
    nb.read_until(lambda: "every line it showed is kept in" in nb.under(started))
    under = nb.under(started, True)
    assert steps(under, 0) == [0, 1, 2, 3] and steps(under, 1) == [0, 1, 2, 3]
    assert "plotted" not in under and "step" not in nb.under(other)
    path = re.search(r"kept in (\S+\.jsonl)", under)[1]
    assert f"run {run_id} ended after" in under and f"%xla_run show {run_id} shows it again" in under
    # the log holds what the cell showed, in order
    entries = run_log.read(path)
    assert entries[0]["run"] == run_id and entries[0]["log"] == 1 and entries[-1]["end"] == "done"
    logged = run_log.text(entries)
    assert steps(logged, 0) == [0, 1, 2, 3] and steps(logged, 1) == [0, 1, 2, 3]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    _, listing = nb.run("%xla_runs")
    assert re.search(rf"^{run_id}\s+import os, time\s+done\s+[\d.]+ s\s+-\s+pool of 2 ranks$", listing, re.M), listing
    _, text = nb.run("print(repr(run))")
    assert "done" in text and "last: [rank" in text and "step 3" in text


def test_a_capture_cell_meanwhile_takes_none_of_the_runs_lines_from_its_log(nb, tmp_path):
    # %%capture swaps the kernel's streams for its own while it runs: the run's lines still reach the run's log (the
    # run writes to its sink, not to whatever sys.stdout is now) and its own cell, never the capture.
    marker = str(tmp_path / "go")
    started, _ = nb.run(gated(marker, 1, 3))
    nb.read_until(lambda: steps(nb.under(started, True), 0) == [0] and steps(nb.under(started, True), 1) == [0])
    capturing, text = nb.run(f"%%capture captured\nopen({marker!r}, 'w').close()\nrun.wait()")
    assert text == ""
    _, captured = nb.run("print(repr(captured.stdout))")
    assert "step" not in captured, captured
    _, path = nb.run("print(run.path)")
    logged = run_log.text(run_log.read(path.strip()))
    assert steps(logged, 0) == [0, 1, 2, 3] and steps(logged, 1) == [0, 1, 2, 3], logged
    nb.read_until(lambda: "every line it showed is kept in" in nb.under(started))
    assert steps(nb.under(started, True), 1) == [0, 1, 2, 3] and "step" not in nb.under(capturing)


def test_a_client_that_stopped_reading_loses_nothing_a_new_one_replays_every_line_once(kernel, nb, tmp_path):
    marker = str(tmp_path / "go")
    started, shown = nb.run(gated(marker, 5, 5))
    run_id = int(re.search(r"<run (\d+)", shown)[1])
    nb.read_until(lambda: 0 in steps(nb.under(started, True), 0))  # the first client sees the start, then reads no more
    # a front end of its own (its own session: one sharing the first's would take over its shell socket)
    late = Notebook(kernel, BlockingKernelClient(connection_file=kernel.manager.connection_file))
    late.client.load_connection_file()
    late.client.start_channels()
    try:
        late.client.wait_for_ready(timeout=60)
        shower = late.send(f"%xla_run show {run_id}")
        late.read_until(lambda: steps(late.under(shower, True), 0)[-1:] == [4] and steps(late.under(shower, True), 1)[-1:] == [4])
        open(marker, "w").close()  # the rest comes live
        late.read_until(lambda: late.idle(shower))
    finally:
        late.client.stop_channels()
    replayed = late.under(shower)
    for rank in (0, 1):
        assert steps(replayed, rank) == list(range(10)), replayed  # every line once, in order
    assert f"run {run_id} ended after" in replayed
    # line for line what the cell itself showed (the first client reads it all now)
    nb.read_until(lambda: f"run {run_id} ended after" in nb.under(started))
    shown_live = [line for line in nb.under(started, True).splitlines() if "step" in line]
    assert [line for line in replayed.splitlines() if "step" in line] == shown_live


def test_stop_interrupts_the_run_and_the_pool_keeps_its_ranks(nb, tmp_path):
    _, before = nb.run("%xla_pool")
    started, shown = nb.run("%%xla_spawn --bg -o run\nimport time\nprint('training', flush=True)\n"
                            "while True:\n    time.sleep(0.05)")
    nb.read_until(lambda: nb.under(started).count("training") == 2)
    _, text = nb.run("run.stop()\nprint(run.done(), type(run.error).__name__, repr(run))")
    assert "True RunInterrupted <run " in text and ": interrupted " in text
    nb.read_until(lambda: "was stopped after" in nb.under(started))
    assert "RunInterrupted" in nb.under(started)
    _, text = nb.run("%%xla_spawn\nrank + 1")
    assert "[1, 2]" in text
    pids = re.search(r"rank processes ([\d, ]+)", before)[1]
    _, after = nb.run("%xla_pool")
    assert pids in after  # the same ranks
    _, text = nb.run("run.stop()")
    assert "UsageError: run " in text and "already ended (interrupted)" in text


def test_a_pool_held_by_a_background_run_refuses_a_cell_at_once_and_after_queues_it(nb, tmp_path):
    marker = str(tmp_path / "go")
    started, shown = nb.run(gated(marker, 1, 1))
    run_id = int(re.search(r"<run (\d+)", shown)[1])
    _, refused = nb.run("%%xla_spawn\nrank")
    assert f"UsageError: %%xla_spawn refused at once: the pool is running background run {run_id} " in refused
    assert "(cell: 'import os, time'" in refused
    for choice in (f"%xla_run wait {run_id}", f"%xla_run stop {run_id}", "--fresh", "--after"):
        assert choice in refused
    _, refused = nb.run("%xla_pool push marker_name")
    assert "%xla_pool push refused at once" in refused
    queued = nb.send("%%xla_spawn --after\nrank + 100")
    nb.read_until(lambda: any(m["parent_header"].get("msg_id") == queued and m["msg_type"] == "status"
                              and m["content"]["execution_state"] == "busy" for m in nb.messages))
    open(marker, "w").close()
    nb.read_until(lambda: nb.idle(queued))
    assert "[100, 101]" in nb.under(queued)
    assert "[rank 0] step 1" in nb.under(started)
    _, text = nb.run("print(run.results)")
    assert text == "[0, 10]\n"


def test_debug_after_a_failed_background_run_opens_the_failing_ranks_frame(nb):
    started, _ = nb.run("%%xla_spawn --bg -o run\nscale = rank + 2\ntable = {'a': scale}\n"
                        "table['b' if rank == 1 else 'a']")
    nb.read_until(lambda: "failed after" in nb.under(started))
    under = nb.under(started)
    assert "RankError" in under and "KeyError: 'b'" in under
    _, text = nb.run("run.wait()")
    assert "KeyError: 'b'" in text
    _, text = nb.run("%debug", answers=["p scale", "q"])
    assert "[rank 1] 3\n" in text, text


def test_input_in_a_background_rank_is_asked_by_the_cell_that_waits(nb):
    started, _ = nb.run("%%xla_spawn --bg -o run\nanswer = input('name? ') if rank == 0 else 'none'\nanswer")
    nb.read_until(lambda: "waits for input() at line 1" in nb.under(started))
    assert "rank 0 waits for input() at line 1: run.wait(), run.show() or %xla_run show" in nb.under(started)
    _, text = nb.run("print(run.wait())", answers=["Ada"])
    assert nb.prompts == ["[rank 0] name? "] and "['Ada', 'none']" in text


def test_an_interrupted_kernel_leaves_the_background_run_unharmed(kernel, nb, tmp_path):
    marker = str(tmp_path / "go")
    started, _ = nb.run(gated(marker, 1, 2))
    nb.read_until(lambda: "[rank 1] step 0" in nb.under(started, True))
    sleeper = nb.send("import time\nprint('sleeping', flush=True)\ntime.sleep(600)")
    nb.read_until(lambda: "sleeping" in nb.under(sleeper))
    kernel.manager.interrupt_kernel()
    nb.read_until(lambda: nb.idle(sleeper))
    assert "KeyboardInterrupt" in nb.under(sleeper)
    _, text = nb.run("print(run.done())")
    assert text == "False\n"
    open(marker, "w").close()
    _, text = nb.run("print(run.wait())")
    assert text == "[0, 10]\n"
    under = nb.under(started, True)
    assert steps(under, 0) == [0, 1, 2] and steps(under, 1) == [0, 1, 2]


def test_an_interrupt_stops_the_wait_not_the_run(kernel, nb, tmp_path):
    marker = str(tmp_path / "go")
    started, _ = nb.run(gated(marker, 1, 1))
    waiter = nb.send("print('waiting')\nrun.wait()")  # unflushed: the cell is in wait() once it shows
    nb.read_until(lambda: "waiting" in nb.under(waiter))  # as the stop button is pressed: once the cell shows it runs
    kernel.manager.interrupt_kernel()
    nb.read_until(lambda: nb.idle(waiter))
    assert "WaitInterrupted: stopped waiting for run" in nb.under(waiter) and "which goes on" in nb.under(waiter)
    open(marker, "w").close()
    _, text = nb.run("print(run.wait())")
    assert text == "[0, 10]\n"


def test_bad_input_is_a_usage_error_that_says_what_to_do(nb):
    _, text = nb.run("%xla_run show 999")
    assert "UsageError: no background run 999 in this session" in text
    _, text = nb.run("%xla_run show x1")
    assert "UsageError: a run's id is its number" in text
    _, text = nb.run("%xla_run wait")
    assert "UsageError: %xla_run wait needs the run's id" in text
    _, text = nb.run("%%xla_spawn --after --fresh\nrank")
    assert "UsageError: --after waits for the pool's background run" in text
    _, before = nb.run("%xla_runs")
    _, text = nb.run("%%xla_spawn --bg\nrank +")
    assert "SyntaxError" in text  # at once, under the cell, as a blocking cell's
    _, after = nb.run("%xla_runs")
    assert len(after.splitlines()) == len(before.splitlines())  # no run began
    _, text = nb.run("%%xla_spawn --bg --timeout 60 -o run\nrank")
    _, text = nb.run("print(run.wait())")
    assert text == "[0, 1]\n"
    # --timeout with --bg: the timeout stops the run, and the pool lives on
    nb.run("%%xla_spawn --bg --timeout 1 -o run\nimport time\nwhile True:\n    time.sleep(0.05)")
    _, text = nb.run("run.wait()")
    assert "timed out after 1 s (--timeout)" in text
    _, text = nb.run("%%xla_spawn\nrank + 3")
    assert "[3, 4]" in text


def test_background_cells_in_new_ranks_one_per_device_and_spmd(nb):
    started, shown = nb.run("%%xla_spawn --bg --fresh --devices 2 -o run\nprint('fresh', rank, flush=True)\n"
                            "rank + 7")
    assert "running 0.0 s on 2 ranks>" in shown, shown
    _, text = nb.run("print(run.wait())")
    assert text == "[7, 8]\n"
    _, listing = nb.run("%xla_runs")
    assert "2 new ranks" in listing
    nb.read_until(lambda: "ended after" in nb.under(started))
    assert "[rank 0] fresh 0" in nb.under(started, True)
    started, shown = nb.run("%%xla_spawn --bg --fresh --spmd --devices 2 -o run\nprint('mesh', world_size)\n"
                            "world_size * 10")
    assert "on 1 rank>" in shown, shown
    _, text = nb.run("print(run.wait())")
    assert text == "20\n"
    nb.read_until(lambda: "ended after" in nb.under(started))
    assert "[spmd] mesh 2" in nb.under(started, True)


def test_a_background_runs_displays_and_profile_come_under_its_cell_and_into_its_log(nb):
    started, _ = nb.run("%%xla_spawn --bg --profile -o run\nfrom IPython.display import display\n"
                        "display({'text/plain': f'shown by {rank}'}, raw=True)\nrank")
    _, text = nb.run("print(run.wait())")
    assert text == "[0, 1]\n"

    def profile_under_it() -> list:
        return [m for m in nb.messages if m["parent_header"].get("msg_id") == started
                and m["msg_type"] in ("display_data", "update_display_data")
                and m["content"]["data"].get("text/plain", "").startswith("Profile of run ")]

    nb.read_until(profile_under_it)  # filled in once the ranks read their traces: under the run's own cell
    # The run's own output, without the cell's result (the handle's repr, shown as the run may already be going)
    under = "".join(m["content"]["text"] if m["msg_type"] == "stream" else m["content"]["data"].get("text/plain", "") + "\n"
                    for m in nb.messages if m["parent_header"].get("msg_id") == started
                    and m["msg_type"] in ("stream", "display_data"))
    assert "[rank 0]\nshown by 0" in under and "[rank 1]\nshown by 1" in under  # each under its rank's label
    _, path = nb.run("print(run.path)")
    logged = [entry["display"]["text/plain"] for entry in run_log.read(path.strip()) if "display" in entry]
    assert "shown by 0" in logged and "shown by 1" in logged


def test_in_a_terminal_the_lines_print_as_they_come_and_a_cleared_run_keeps_its_results(pool, ip, capsys, tmp_path):
    from IPython.core.error import UsageError

    from helpers import wait_for

    marker = str(tmp_path / "go")
    seen: list[str] = []

    def printed() -> str:
        seen.append(capsys.readouterr().out)
        return "".join(seen)

    run = ip.run_cell(gated(marker, 1, 1)).result  # as the terminal runs a cell: the run begins once it ended
    assert wait_for(lambda: "[rank 0] step 0" in printed() and "[rank 1] step 0" in printed())
    with pytest.raises(UsageError, match=rf"%xla_pool stop refused at once: the pool is running background run {run.id}"):
        ip.run_line_magic("xla_pool", "stop")
    open(marker, "w").close()
    assert run.wait() == [0, 10]
    assert wait_for(lambda: f"run {run.id} ended after" in printed())
    assert steps(printed(), 0) == [0, 1] and steps(printed(), 1) == [0, 1]
    ip.run_line_magic("xla_run", f"show {run.id}")  # the replay, in the terminal
    replayed = capsys.readouterr().out
    assert steps(replayed, 0) == [0, 1] and f"run {run.id} ended after" in replayed
    ip.run_line_magic("xla_runs", "--clear")
    assert not os.path.exists(run.path) and "ended run" in capsys.readouterr().out
    with pytest.raises(UsageError, match=f"run {run.id}'s log was removed"):
        run.show()
    with pytest.raises(UsageError, match=f"no background run {run.id} in this session"):
        ip.run_line_magic("xla_run", f"wait {run.id}")
    ip.run_line_magic("xla_pool", "stop")
    with pytest.raises(UsageError, match=rf"run {run.id} already ended \(done\); its results and output stay"):
        run.stop()
    assert run.results == [0, 10] and run.error is None and run.done()


def test_a_background_runs_xla_report_comes_under_its_cell_when_it_ends(nb):
    started, shown = nb.run("%%xla_spawn --bg --xla-report full -o run\nimport torch, torch_xla\n"
                            "t = torch.ones(4, device=device) * rank\ntorch_xla.sync()\nt.sum().item()")
    run_id = int(re.search(r"<run (\d+)", shown)[1])
    _, text = nb.run("print(run.wait())")
    assert text == "[0.0, 4.0]\n"
    nb.read_until(lambda: f"What XLA did in run {run_id}:" in nb.under(started))
    _, other = nb.run("print('elsewhere')")
    assert "What XLA did" not in other
    _, path = nb.run("print(run.path)")
    logged = [entry["display"].get("text/plain", "") for entry in run_log.read(path.strip()) if "display" in entry]
    assert any(text.startswith(f"What XLA did in run {run_id}:") for text in logged)


def test_a_background_runs_chart_is_drawn_under_its_cell_and_updated_in_place_while_other_cells_run(nb, tmp_path):
    marker = str(tmp_path / "go")
    started, shown = nb.run(
        "%%xla_spawn --bg -o run\nimport os, time\nfrom xla_magic import log\n"
        "log(loss=1.0 + rank)\n"
        "began = time.monotonic()\n"
        "while time.monotonic() - began < 0.3:  # past FLUSH_SECONDS: the next log sends both rows\n"
        "    time.sleep(0.02)\n"
        "log(loss=0.5 + rank)\n"
        f"while not os.path.exists({marker!r}):\n"
        "    time.sleep(0.02)\n"
        "for step in range(2, 6):\n"
        "    log(loss=1 / (step + 1) + rank)\n"
        "rank")
    run_id = int(re.search(r"<run (\d+)", shown)[1])

    def charts(msg_id: str) -> list[dict]:
        return [m for m in nb.messages if m["parent_header"].get("msg_id") == msg_id
                and m["msg_type"] in ("display_data", "update_display_data")
                and 'class="xla-metrics"' in m["content"]["data"].get("text/html", "")]

    # drawn under the cell that started the run, while the run waits
    nb.read_until(lambda: any("loss = 1 at step 1, mean of 2 ranks" in m["content"]["data"]["text/html"]
                              for m in charts(started)))
    _, text = nb.run("print(run.done())")
    assert text == "False\n"
    # another cell lets the run go on and waits for it: the chart's updates still go under the run's cell
    other, text = nb.run(f"open({marker!r}, 'w').close()\nprint(run.wait())")
    assert text == "[0, 1]\n"
    nb.read_until(lambda: f"run {run_id} ended after" in nb.under(started))
    drawn = charts(started)
    assert drawn[0]["msg_type"] == "display_data" and all(m["msg_type"] == "update_display_data" for m in drawn[1:])
    display_id = drawn[0]["content"]["transient"]["display_id"]
    assert all(m["content"]["transient"]["display_id"] == display_id for m in drawn)  # one chart, in place
    mean = (1 / 6 + 1 / 6 + 1) / 2
    assert f"loss = {mean:.4g} at step 5, mean of 2 ranks" in drawn[-1]["content"]["data"]["text/html"]
    assert not charts(other) and "loss" not in nb.under(other)
    # %xla_metrics RUN returns what it logged
    _, text = nb.run(f"import json\ntable = %xla_metrics {run_id}\nprint(json.dumps(table))")
    table = json.loads(text)
    rows = sorted(zip(table["rank"], table["step"], table["value"]))
    assert set(table["run"]) == {run_id} and set(table["name"]) == {"loss"}
    assert rows == [(rank, step, value + rank) for rank in (0, 1)
                    for step, value in enumerate([1.0, 0.5, 1 / 3, 1 / 4, 1 / 5, 1 / 6])]
