"""log()'s chart in a real JupyterLab, driven by headless Chromium: drawn under the cell and redrawn while it runs.

A notebook's cell logs in a loop on two ranks until the test opens a gate.
The test watches the cell's output in the page: the chart's SVG appears and
is replaced by newer drawings (the kernel updates its display by id) at
least twice while the cell's prompt still shows it running; then it takes
a picture of the live chart (into the test's temporary folder: it is for
people, the test asserts on the page), opens the gate, and checks the last
drawing's title names the last step the ranks logged.

Needs what tests/test_browser.py needs: Debian's chromium and the test
extra's jupyterlab and playwright.
"""

from __future__ import annotations

import json
import os
import re

import nbformat
import pytest
from playwright.sync_api import sync_playwright

from test_browser import (CHROMIUM, CHROMIUM_ARGS, FRONT_END, FRONT_END_MISSING, LAB, WAIT_MS, Server, cell, evidence,
                          prompt_js, run_and_wait, run_cell)

pytestmark = [
    pytest.mark.skipif(
        not os.access(CHROMIUM, os.X_OK),
        reason=f"Chromium not found at {CHROMIUM}: run scripts/install-browser (Debian's chromium) to run this test",
    ),
    pytest.mark.skipif(FRONT_END_MISSING is not None or FRONT_END is not LAB,
                       reason=FRONT_END_MISSING or "the live chart's picture is taken in JupyterLab 4 (ipywidgets 8)"),
]


def logging_cell(gate: str) -> str:
    return (
        "%%xla_spawn --devices 2\n"
        "import os, time\n"
        "step = 0\n"
        f"while not os.path.exists({gate!r}):\n"
        "    log(loss=1.0 / (1 + step) + 0.1 * rank)\n"
        "    step += 1\n"
        "    time.sleep(0.01)\n"
        "print('last step', step - 1)"
    )


@pytest.fixture
def lab(tmp_path):
    gate = tmp_path / "gate"
    root = tmp_path / "lab"
    (root / "notebooks").mkdir(parents=True)
    cells = ["%load_ext xla_magic", logging_cell(str(gate))]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "notebooks" / "status.ipynb")  # the path FRONT_END opens
    # The notebook's kernel started without asking, even before JupyterLab has the kernel specs (a loaded machine).
    tracker = root / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"autoStartDefaultKernel": True}))
    server = Server(root, FRONT_END)
    try:
        server.wait_ready()
        yield server, gate
    finally:
        gate.touch()  # never a rank left logging
        server.stop()


def open_notebook(browser, server):
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.set_default_timeout(WAIT_MS)
    kernel_dialog = tab.locator(".jp-Dialog").filter(has_text="Select Kernel")
    tab.goto(f"{server.url}{FRONT_END.path}?token={server.token}")
    tab.wait_for_selector(FRONT_END.cell)
    kernel_dialog.or_(tab.locator(FRONT_END.idle)).first.wait_for()
    if kernel_dialog.is_visible():
        kernel_dialog.get_by_role("button", name="Select", exact=True).click()
    tab.wait_for_selector(FRONT_END.idle)
    return tab


def test_a_logging_cell_s_chart_is_redrawn_in_place_while_it_runs(lab, tmp_path):
    server, gate = lab
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = open_notebook(browser, server)
            with evidence(page, server, "metrics-chart"):
                run_and_wait(page, 0)
                run_cell(page, 1)
                chart_js = (f"document.querySelectorAll({json.dumps(FRONT_END.cell)})[1]"
                            ".querySelector('.jp-OutputArea svg.xla-metrics')")
                # Every distinct drawing the page shows, gathered by the page itself at each animation frame.
                page.evaluate("() => { window.xlaDrawings = new Set(); }")
                page.wait_for_function(
                    f"() => {{ const chart = {chart_js}; if (chart) window.xlaDrawings.add(chart.outerHTML);"
                    " return window.xlaDrawings.size >= 3; }", timeout=WAIT_MS)
                assert page.evaluate(f"/\\[\\*\\]:$/.test({prompt_js(1)})"), "the chart was redrawn after the cell ended"
                output = cell(page, 1).locator(FRONT_END.output)
                assert output.locator("svg.xla-metrics").count() == 1  # one chart, updated in place: never a second
                title = output.locator("svg.xla-metrics text").first.text_content()
                assert re.fullmatch(r"loss = [\d.e+-]+ at step \d+, mean of [12] ranks?", title), title
                assert output.locator("svg.xla-metrics polyline").count() == 1  # the ranks' mean, one line
                cell(page, 1).screenshot(path=str(tmp_path / "live_metrics_chart.png"))
                assert (tmp_path / "live_metrics_chart.png").stat().st_size > 0

                gate.touch()
                page.wait_for_function(f"/\\[\\d+\\]:$/.test({prompt_js(1)})", timeout=WAIT_MS)
                text = output.inner_text()
                last = max(int(step) for step in re.findall(r"\[rank \d\] last step (\d+)", text))
                title = output.locator("svg.xla-metrics text").first.text_content()
                assert f" at step {last}, " in title, (title, last)
                assert output.locator("svg.xla-metrics").count() == 1
        finally:
            browser.close()
