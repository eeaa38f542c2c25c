"""%xla_status through a real IPython shell: the panel's model state after real runs.

The panel's widgets hold their state as HTML and button flags; the rows are
read back with a small HTML parser. The browser test (test_browser.py)
checks what a person sees.
"""

from __future__ import annotations

from html.parser import HTMLParser
from importlib import metadata

import psutil
import pytest
from IPython.utils.capture import capture_output

from conftest import kernel_is_xla_free
from helpers import wait_gone
from xla_magic.notebook import status
from xla_magic.runs.errors import RankError, RunInterrupted
from xla_magic.runs.record import RankState, RunRecord


class Rows(HTMLParser):
    """The data-* attributes and cell texts of every <tr> with a class."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: list[dict[str, object]] = []
        self._row: dict[str, object] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "class" in attrs:
            self._row = {"class": attrs["class"], "cells": [], **{k[5:]: v for k, v in attrs.items() if k.startswith("data-")}}
            self.rows.append(self._row)
        elif tag == "td" and self._row is not None:
            self._row["cells"].append("")

    def handle_data(self, data):
        if self._row is not None and self._row["cells"]:
            self._row["cells"][-1] += data

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None


def rank_rows(panel: status.StatusPanel) -> list[dict[str, object]]:
    return [row for row in Rows(panel.ranks.value).rows if row["class"] == "xla-rank"]


def history_rows(panel: status.StatusPanel) -> list[dict[str, object]]:
    return [row for row in Rows(panel.history.value).rows if row["class"] == "xla-history"]


@pytest.fixture
def panel(ip):
    return status.status_panel(ip._xla_magic_session)


def test_text_outside_a_notebook_says_how_to_get_the_widget(ip, spawn):
    spawn("--devices 2", "print('warm', rank)")
    with capture_output() as captured:
        ip.run_line_magic("xla_status", "")
    text = captured.stdout
    assert "CPU simulation, 8 devices" in text
    assert "kernel is XLA-free" in text
    assert f"torch_xla {metadata.version('torch_xla')}," in text  # what this stack's venv has
    assert "Launcher: running, pid" in text
    # ipywidgets is installed here: the hint names what is missing, a notebook front end.
    assert "The live panel shows in a notebook front end (JupyterLab" in text
    assert "this shell is not one" in text and "pip install ipywidgets" not in text
    run = ip._xla_magic_session.history[-1]
    assert f"Ranks of run {run.run_id}: 2 devices, cpu backend, done" in text
    assert "warm 1" in text
    assert kernel_is_xla_free()


def test_the_panel_hint_says_what_is_missing_where_it_runs():
    assert "%pip install ipywidgets" in status.panel_hint(notebook=True, widgets=False)
    terminal = status.panel_hint(notebook=False, widgets=True)
    assert "notebook front end" in terminal and "ipywidgets" not in terminal
    assert "with ipywidgets installed" in status.panel_hint(notebook=False, widgets=False)


def test_panel_after_a_run_that_succeeds(ip, spawn, panel):
    spawn("--devices 2", "for i in range(3):\n    print('step', i, 'of rank', rank)\nrank")
    run = ip._xla_magic_session.history[-1]
    rows = rank_rows(panel)
    assert [row["state"] for row in rows] == ["done", "done"]
    for rank, row in enumerate(rows):
        assert row["cells"][3] == "3"  # lines written
        assert row["cells"][6] == f"step 2 of rank {rank}"  # last line
        assert row["cells"][5] == "-"  # a one-shot rank keeps no processes
        # the simulated device's memory (launcher/simulate/memory.py): nothing held, a v5e's 16 GiB
        assert row["cells"][4] == "0 B of 16.0 GiB, peak 0 B (0 B in the cell)"
    assert "device memory:" not in panel.ranks.value
    assert 'data-outcome="done"' in panel.ranks.value
    assert history_rows(panel)[0]["run"] == str(run.run_id)
    assert history_rows(panel)[0]["cells"][1] == "for i in range(3):"
    assert panel.interrupt.disabled
    assert "kernel is XLA-free" in panel.facts.value
    assert f"torch_xla {metadata.version('torch_xla')}," in panel.facts.value
    assert kernel_is_xla_free()


def test_panel_after_a_run_that_fails(ip, spawn, panel):
    cell = "import time\nif rank == 1:\n    raise ValueError('bad shard')\ntime.sleep(30)"
    with pytest.raises(RankError, match="bad shard"):
        spawn("--devices 2", cell)
    states = {int(row["rank"]): row["state"] for row in rank_rows(panel)}
    assert states == {0: "killed", 1: "failed"}
    assert 'data-outcome="failed"' in panel.ranks.value
    assert history_rows(panel)[0]["outcome"] == "failed"
    assert panel.interrupt.disabled


def test_interrupt_button_stops_the_run_and_the_panel_shows_it(ip, spawn, panel):
    session = ip._xla_magic_session
    seen_running: list[str] = []

    def press_when_running(record: RunRecord) -> None:
        # Called from the running cell's own loop, after the panel redrew.
        if record.outcome == "running" and all(s.state == "running" and s.lines for s in record.ranks.values()):
            if not seen_running:
                seen_running.append(panel.ranks.value)
                assert not panel.interrupt.disabled
                panel.interrupt.click()

    session.listeners.append(press_when_running)
    try:
        with pytest.raises(RunInterrupted):
            spawn("--devices 2", "import time\nprint('working', rank, flush=True)\nwhile True:\n    time.sleep(0.05)")
    finally:
        session.listeners.remove(press_when_running)
    assert seen_running, "the panel never showed the ranks running"
    assert seen_running[0].count('data-state="running"') == 2
    assert "working 0" in seen_running[0]
    assert {row["state"] for row in rank_rows(panel)} == {"killed"}
    assert 'data-outcome="interrupted"' in panel.ranks.value
    assert history_rows(panel)[0]["outcome"] == "interrupted"
    assert panel.interrupt.disabled
    assert spawn("--devices 2", "rank").value == [0, 1]  # the next cell works


def test_without_a_kernel_subshell_the_panel_says_what_the_interrupt_button_needs(panel):
    panel.redraw()
    assert not panel.live_interrupt  # this shell has no kernel, so no subshell
    assert status.LIVE_INTERRUPT_NEEDS in panel.message.value
    assert "stop button" in panel.message.value


def test_panel_follows_new_runs_after_listeners_were_cleared(ip, spawn, panel):
    session = ip._xla_magic_session
    session.listeners.remove(panel.on_record)
    again = status.status_panel(session)
    assert again is panel and panel.on_record in session.listeners
    spawn("--devices 2", "rank")
    assert history_rows(panel)[0]["run"] == str(session.history[-1].run_id)


def test_simulated_ranks_report_their_device_memory(ip, spawn):
    """XLA:CPU reports none; the simulation answers from its own count, against a v5e's 16 GiB by default."""
    spawn("--devices 2 --out memory", "from xla_magic.launcher.rank import device_memory\ndevice_memory(device)")
    assert ip.user_ns["memory"] == [{"bytes_used": 0, "bytes_limit": 16 << 30, "peak_bytes_used": 0}] * 2


def test_memory_figures_are_shown_where_the_runtime_reports_them():
    state = RankState(state="running", memory={"bytes_used": 3 << 30, "bytes_limit": 16 << 30, "peak_bytes_used": 5 << 29})
    record = RunRecord(1, "x = 1", "tpu", 1, ranks={0: state})
    html = status.ranks_html(record)
    assert "3.0 GiB of 16.0 GiB, peak 2.5 GiB" in html
    assert "device memory" not in html
    assert status.format_memory(None) == "-"


def test_pool_row_and_stop_pool_button(ip, panel):
    session = ip._xla_magic_session
    panel.redraw()
    assert panel.stop_pool.disabled
    assert "none (%xla_pool start" in panel.facts.value
    with capture_output():
        ip.run_line_magic("xla_pool", "start --devices 2 --backend cpu")
    pool = session.pool
    try:
        ranks = [psutil.Process(pid) for pid in pool.pids.values()]
        panel.redraw()
        assert not panel.stop_pool.disabled
        assert "ready: 2 ranks on the cpu backend" in panel.facts.value
        panel.stop_pool.click()
    finally:
        with capture_output():
            ip.run_line_magic("xla_pool", "stop")
    assert pool.state == "stopped" and session.pool is None
    assert "pool stopped" in panel.message.value
    assert "none (%xla_pool start" in panel.facts.value
    assert panel.stop_pool.disabled
    assert wait_gone(p.pid for p in ranks) == []


# The kernel badge turning red once the kernel holds an XLA runtime: in the notebook of
# tests/test_kernel.py's test_kernel_that_initialised_xla_is_refused_with_a_way_out, a kernel that did.
