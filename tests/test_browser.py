"""%xla_status in a real browser: a Jupyter front end on loopback, driven by headless Chromium.

A person's view, end to end: the front end renders the ipywidgets panel, the
test reads what the page shows, clicks the panel's buttons, sees a rank's
plot in the cell, and (JupyterLab only) takes the screenshots the docs use:
into docs/images/ only when asked (``--update-images``, or
XLA_MAGIC_UPDATE_IMAGES=1), else into a temporary folder, so a test run
rewrites no tracked file.

The tests share one page (a front end takes long to load) but each runs the
cells it needs first, so any one passes alone and in any order.

The front end is the one that goes with this stack's ipywidgets: JupyterLab 4
for ipywidgets 8, and for ipywidgets 7 (Colab's pins, scripts/stacks/colab.txt)
classic Notebook 6.5 with widgetsnbextension 3.6, the nearest real front end
to Colab's.

Needs Debian's chromium (scripts/install-browser installs it; .ci/run calls
that script) and the test extra's jupyterlab and playwright. Playwright
drives the system Chromium; its own browser download is never used.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import contextlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright

from helpers import PROFILED
from test_profile import gated_cell

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("XLA_MAGIC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_LIMIT = 60.0
WAIT_MS = 240_000  # the longest any one thing on the page may take (a first cell on a loaded machine: minutes)


def version(distribution: str) -> tuple[int, ...]:
    """The installed release as numbers, () when it is not installed."""
    try:
        text = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


@dataclass(frozen=True)
class FrontEnd:
    """One Jupyter front end: how to start its server and where things are on its page."""

    name: str
    command: tuple[str, ...]  # after `python -m`; {port}, {token}, {root} are filled in
    path: str  # of the notebook, after the server's URL
    cell: str  # one code cell
    prompt: str  # a cell's input prompt, inside the cell
    output: str  # a cell's output area, inside the cell
    idle: str  # shown while the kernel is idle

    def argv(self, port: int, token: str, root: Path) -> list[str]:
        return [sys.executable, "-m", *(part.format(port=port, token=token, root=root) for part in self.command)]


LAB = FrontEnd(
    name="JupyterLab 4",
    command=(
        "jupyterlab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", "--ServerApp.port={port}", "--ServerApp.port_retries=0",
        "--IdentityProvider.token={token}", "--ServerApp.root_dir={root}/notebooks",
        "--allow-root", "--ServerApp.terminals_enabled=False",  # CI runs as root
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--LabApp.user_settings_dir={root}/settings", "--LabApp.workspaces_dir={root}/workspaces",
    ),
    path="/lab/tree/status.ipynb",
    cell=".jp-Notebook .jp-Cell",
    prompt=".jp-InputPrompt",
    output=".jp-OutputArea",
    idle=".jp-Notebook-ExecutionIndicator[data-status='idle']",
)
CLASSIC = FrontEnd(
    name="classic Notebook 6.5",
    command=(
        "notebook", "--no-browser",
        "--NotebookApp.ip=127.0.0.1", "--NotebookApp.port={port}", "--NotebookApp.port_retries=0",
        "--NotebookApp.token={token}", "--NotebookApp.notebook_dir={root}/notebooks",
        "--allow-root", "--NotebookApp.terminals_enabled=False",
    ),
    path="/notebooks/status.ipynb",
    cell="#notebook-container .cell.code_cell",
    prompt=".input_prompt",
    output=".output_wrapper",
    idle="#kernel_indicator_icon.kernel_idle_icon",
)


def front_end_for_this_stack() -> tuple[FrontEnd, str | None]:
    """The front end that goes with the installed ipywidgets, and why it cannot run here (or None)."""
    if version("ipywidgets")[:1] == (7,):
        if version("notebook")[:2] != (6, 5) or version("widgetsnbextension")[:2] != (3, 6):
            return CLASSIC, ("ipywidgets 7 is rendered here by classic Notebook 6.5 with widgetsnbextension 3.6: "
                             "scripts/setup-venv --stack colab installs them")
        return CLASSIC, None
    if not version("jupyterlab"):
        return LAB, "JupyterLab is not installed: pip install -e '.[test]'"
    return LAB, None


FRONT_END, FRONT_END_MISSING = front_end_for_this_stack()
# ipykernel 7.4's subshells let the Interrupt button be heard while a cell runs.
LIVE_INTERRUPT = version("ipykernel") >= (7, 4)

pytestmark = [
    pytest.mark.skipif(
        not os.access(CHROMIUM, os.X_OK),
        reason=f"Chromium not found at {CHROMIUM}: run scripts/install-browser (Debian's chromium) to run this test",
    ),
    pytest.mark.skipif(FRONT_END_MISSING is not None, reason=FRONT_END_MISSING or ""),
]

PLOT_CELL = """%%xla_spawn --devices 2
import matplotlib.pyplot as plt
from IPython.display import HTML
print("training on rank", rank)
if rank == 0:
    plt.figure(figsize=(5, 2.5))
    plt.plot([1 / (1 + step) for step in range(30)])
    plt.title("loss on rank 0")
    plt.show()
display(HTML(f"<b>rank {rank}</b> is done"))"""

# --profile: the timeline under the cell, one lane per rank (docs/profiling.md's picture).
PROFILE_CELL = "%%xla_spawn --devices 2 --profile" + PROFILED.rstrip("\n")
# --profile in a pool, its ranks' digests held until the test opens the gate: the timeline comes after the reply.
PROFILE_GATE = os.path.join(tempfile.gettempdir(), f"xla_magic-browser-profile-gate-{os.getpid()}")
GATED_PROFILE_CELL = "%%xla_spawn --profile\n" + gated_cell(PROFILE_GATE)

CELLS = [
    "%load_ext xla_magic",
    "%%xla_spawn --devices 8\nimport torch\nx = torch.ones(2, device=device) * rank\n"
    "print('hello from rank', rank, 'of', world_size)\nfloat(x.sum().cpu())",
    "%xla_status",
    "%%xla_spawn --devices 2\nimport time\nprint('working', rank, flush=True)\nwhile True:\n    time.sleep(0.05)",
    "%xla_pool start --devices 2 --backend cpu",
    # The panel redraws when a run changes; the pool becomes current just
    # after its start run ends, so the panel is shown again to catch up.
    "%xla_status",
    # What XLA did: the classic slow loop (a short last batch, .item() every step, a CPU fallback).
    "%%xla_spawn --devices 2\nimport torch, torch_xla\nmodel = torch.nn.Linear(64, 10).to(device)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\ndata = torch.randn(1000, 64)\nlosses = []\n"
    "for start in range(0, len(data), 64):\n    x = data[start:start + 64].to(device)\n"
    "    loss = model(x).pow(2).mean()\n    loss.backward()\n    optimizer.step()\n    optimizer.zero_grad()\n"
    "    torch_xla.sync()\n    losses.append(loss.item())\npositive = torch.nonzero(model.weight > 0)",
    "%xla_report",
    # A rank's plot and display(), as a notebook shows them.
    PLOT_CELL,
    PROFILE_CELL,
    GATED_PROFILE_CELL,
    "%xla_pool stop",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """The front end's server on 127.0.0.1 with a token, in a private directory."""

    def __init__(self, root: Path, front_end: FrontEnd) -> None:
        self.root = root
        self.front_end = front_end
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "config"
        (config / "labconfig").mkdir(parents=True)
        # No news toast over the notebook (and no attempt to fetch news).
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
        )
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(config),
            JUPYTER_RUNTIME_DIR=str(root / "runtime"),
            JUPYTER_DATA_DIR=str(root / "data"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        self.log = open(root / "server.log", "wb")
        self.process = subprocess.Popen(
            front_end.argv(self.port, self.token, root),
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )

    def api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(
            f"{self.url}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_LIMIT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                self.api("status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.25)
        raise RuntimeError(f"{self.front_end.name} did not start; see {self.root / 'server.log'}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        try:
            for kernel in self.api("kernels") or []:  # kernels, and with them their launchers
                self.api(f"kernels/{kernel['id']}", method="DELETE")
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        finally:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    (root / "notebooks").mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "notebooks" / "status.ipynb")
    running = Server(root, FRONT_END)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def page(server):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1280, "height": 1000})
            tab.set_default_timeout(WAIT_MS)
            if FRONT_END is LAB:
                # On a loaded machine JupyterLab may open the notebook before it has
                # the kernel specs and ask which kernel to use; a person picks the one offered.
                kernel_dialog = tab.locator(".jp-Dialog").filter(has_text="Select Kernel")
                tab.add_locator_handler(
                    kernel_dialog, lambda dialog: dialog.get_by_role("button", name="Select", exact=True).click()
                )
            tab.goto(f"{server.url}{FRONT_END.path}?token={server.token}")
            tab.wait_for_selector(FRONT_END.cell)
            if FRONT_END is LAB:
                # A handler fires only around Playwright's own actions, not while a wait runs: so the
                # first wait is for either the idle kernel or the dialog, and a dialog gets its click here.
                kernel_dialog.or_(tab.locator(FRONT_END.idle)).first.wait_for()
                if kernel_dialog.is_visible():
                    kernel_dialog.get_by_role("button", name="Select", exact=True).click()
            tab.wait_for_selector(FRONT_END.idle)
            yield tab
        finally:
            browser.close()


@contextlib.contextmanager
def evidence(page, server, name: str):
    """On failure, keep a screenshot of the page and the server's log beside it."""
    try:
        yield
    except BaseException:
        path = server.root / f"{name}-failure.png"
        page.screenshot(path=str(path))
        print(f"page at failure: {path}\n{server.front_end.name} log:\n{server.log_tail()}")
        raise


def cell(page, index: int):
    return page.locator(FRONT_END.cell).nth(index)


def has_run(page, index: int) -> bool:
    """Cell ``index`` ran in this page (its prompt shows a count)."""
    return bool(page.evaluate(f"/\\[\\d+\\]:$/.test({prompt_js(index)})"))


def first_run(page, *indices: int) -> None:
    """Run those of the cells that have not run in this page yet (what a test needs before its own)."""
    for index in indices:
        if not has_run(page, index):
            run_and_wait(page, index)


def prompt_js(index: int) -> str:
    """JavaScript for the text of cell ``index``'s input prompt ("[1]:"; classic: "In [1]:")."""
    return (
        f"document.querySelectorAll({json.dumps(FRONT_END.cell)})[{index}]"
        f".querySelector({json.dumps(FRONT_END.prompt)}).textContent.trim()"
    )


def run_cell(page, index: int) -> None:
    """Select a cell and run it with Shift+Enter, as a person does.

    Right after the page loads, the front end may still move the focus and
    swallow a key; so check that the cell was queued ("[*]:" or a count)
    and press again if it was not.
    """
    for _attempt in range(3):
        cell(page, index).locator(FRONT_END.prompt).click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(f"!/\\[\\s*\\]:$/.test({prompt_js(index)})", timeout=5_000)
            return
        except PlaywrightTimeout:
            continue
    shown = cell(page, index).locator(FRONT_END.prompt).inner_text().strip()
    raise AssertionError(f"cell {index} could not be started; its prompt shows {shown!r}")


def run_and_wait(page, index: int) -> None:
    run_cell(page, index)
    page.wait_for_function(f"/\\[\\d+\\]:$/.test({prompt_js(index)})", timeout=WAIT_MS)


def first_panel(page):
    """The panel's first view (%xla_status in cell 2); each later %xla_status adds a view of the same panel."""
    return page.locator(".xla-status-panel").first


def panel_rows(page, state: str):
    return first_panel(page).locator(f"tr.xla-rank[data-state='{state}']")


def test_status_panel_shows_eight_done_ranks_and_the_xla_free_badge(page, server, images):
    with evidence(page, server, "panel"):
        check_status_panel(page, images)


def check_status_panel(page, images: Path) -> None:
    for index in range(3):
        run_and_wait(page, index)
    panel = first_panel(page)
    panel.wait_for()
    page.wait_for_function(
        "document.querySelector('.xla-status-panel').querySelectorAll(\"tr.xla-rank[data-state='done']\").length === 8",
        timeout=WAIT_MS,
    )
    assert panel_rows(page, "done").count() == 8
    badge = panel.locator(".xla-badge.xla-free")
    assert badge.inner_text().strip() == "✔ kernel is XLA-free"
    assert "CPU simulation, 8 devices" in panel.inner_text()
    assert f"torch_xla {metadata.version('torch_xla')}," in panel.inner_text()  # what this stack's venv has
    outputs = cell(page, 1).locator(FRONT_END.output)
    for rank in range(8):
        assert f"[rank {rank}] hello from rank {rank} of 8" in outputs.inner_text()
    assert "[0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]" in outputs.inner_text()
    if FRONT_END is LAB:  # the docs' pictures
        panel.screenshot(path=str(images / "status_panel.png"))
        cell(page, 1).screenshot(path=str(images / "tagged_output.png"))


def test_interrupt_button_stops_a_running_cell_or_says_what_it_needs(page, server):
    with evidence(page, server, "interrupt"):
        check_interrupt_button(page)


def check_interrupt_button(page) -> None:
    first_run(page, 0, 2)  # the extension and the panel
    panel = first_panel(page)
    panel.wait_for()
    run_cell(page, 3)
    # Both ranks have printed, so the cell is inside its endless loop.
    page.wait_for_function(
        "[...document.querySelector('.xla-status-panel').querySelectorAll(\"tr.xla-rank[data-state='running']\")]"
        ".filter(row => row.textContent.includes('working')).length === 2",
        timeout=WAIT_MS,
    )
    button = panel.get_by_role("button", name="Interrupt run")
    assert button.is_enabled()
    if LIVE_INTERRUPT:
        assert "ipykernel 7.4" not in panel.inner_text()
        button.click()
    else:  # the panel says which version the button needs, and the stop button still works
        assert "ipykernel 7.4 or later" in panel.inner_text()
        assert "notebook's stop button" in panel.inner_text()
        cell(page, 3).locator(FRONT_END.prompt).click()
        page.keyboard.press("Escape")
        page.keyboard.press("i")
        page.keyboard.press("i")  # the front end's "interrupt the kernel"
    output = cell(page, 3).locator(FRONT_END.output)
    output.get_by_text("RunInterrupted").wait_for()
    panel.locator(".xla-run[data-outcome='interrupted']").wait_for()
    assert panel_rows(page, "killed").count() == 2
    assert button.is_disabled()
    page.wait_for_selector(FRONT_END.idle)  # the kernel is free again


def test_stop_pool_button_stops_the_pool(page, server):
    with evidence(page, server, "stop-pool"):
        check_stop_pool_button(page)


def check_stop_pool_button(page) -> None:
    first_run(page, 0, 2)  # the extension and the panel's first view
    first_view = first_panel(page)
    button = first_view.get_by_role("button", name="Stop pool")
    assert button.is_disabled()
    run_and_wait(page, 4)  # %xla_pool start
    run_and_wait(page, 5)  # %xla_status again: one panel, two live views
    assert page.locator(".xla-status-panel").count() == 2
    first_view.get_by_text("ready: 2 ranks on the cpu backend").wait_for()
    assert button.is_enabled()
    button.click()
    first_view.get_by_text("pool stopped").wait_for()
    first_view.get_by_text("none (%xla_pool start").wait_for()
    assert button.is_disabled()
    assert "pool stopped" in page.locator(".xla-status-panel").nth(1).inner_text()


def test_what_xla_did_shows_under_the_cell_and_as_a_table(page, server, images):
    with evidence(page, server, "xla-report"):
        check_xla_report(page, images)


def check_xla_report(page, images: Path) -> None:
    first_run(page, 0)
    run_and_wait(page, 6)
    summary = cell(page, 6).locator(FRONT_END.output)
    summary.get_by_text("recompiled at line 12 (torch_xla.sync()): shapes changed").wait_for()
    text = summary.inner_text()
    assert "17 device→host syncs (line 13: losses.append(loss.item()) ×16)" in text, text
    assert "CPU fallback aten::nonzero ×1 (line 14)" in text, text
    run_and_wait(page, 7)
    table = cell(page, 7).locator(f"{FRONT_END.output} .xla-report")
    table.wait_for()
    assert table.locator("tr.xla-ranks").count() == 1  # both ranks did the same: one row
    assert table.locator("tr.xla-compilation").count() == 3
    assert "Metric:" not in table.inner_text()  # never torch_xla's raw report
    if FRONT_END is LAB:  # the docs' pictures
        cell(page, 6).screenshot(path=str(images / "xla_summary.png"))
        cell(page, 7).screenshot(path=str(images / "xla_report.png"))


def test_a_ranks_plot_and_display_show_in_the_cell(page, server, images):
    with evidence(page, server, "rank-plot"):
        check_rank_plot(page, images)


def check_rank_plot(page, images: Path) -> None:
    index = CELLS.index(PLOT_CELL)
    first_run(page, 0)
    run_and_wait(page, index)
    output = cell(page, index).locator(FRONT_END.output)
    picture = output.locator("img")
    picture.wait_for()
    assert picture.count() == 1  # rank 0's figure, as image/png
    assert picture.evaluate("image => image.naturalWidth") > 100
    text = output.inner_text()
    for rank in range(2):
        assert f"[rank {rank}] training on rank {rank}" in text
        assert output.locator("b", has_text=f"rank {rank}").count() == 1  # display(HTML(...)), rendered
    if FRONT_END is LAB:  # the docs' picture
        cell(page, index).screenshot(path=str(images / "rank_plot.png"))


def test_a_profiled_cell_shows_its_timeline(page, server, images):
    with evidence(page, server, "profile"):
        check_profile(page, images)


def check_profile(page, images: Path) -> None:
    index = CELLS.index(PROFILE_CELL)
    first_run(page, 0)
    run_and_wait(page, index)
    picture = cell(page, index).locator(f"{FRONT_END.output} .xla-profile")
    picture.locator("svg.xla-timeline").wait_for()
    svg = picture.locator("svg.xla-timeline")
    assert svg.locator("text", has_text="rank 0").count() == 1 and svg.locator("text", has_text="rank 1").count() == 1
    assert svg.locator("rect.xla-compile").count() == 6  # three graphs on each rank
    assert svg.locator("rect.xla-annotation").count() == 6  # xp.Trace("forward"), three steps on each rank
    assert svg.evaluate("element => element.getBoundingClientRect().width") > 300
    if FRONT_END is LAB:  # docs/profiling.md's picture
        picture.screenshot(path=str(images / "profile_timeline.png"))


def test_a_pool_s_profiled_cell_fills_in_its_timeline_once_the_ranks_read_their_traces(page, server):
    """In a pool the cell returns at its ranks' replies, under it a placeholder that the front end replaces with
    the timeline when the kernel updates it by its display id, from a thread, after the cell's reply."""
    with evidence(page, server, "pool profile"):
        # Its own pool, stopped at its end whatever happens: the other tests, in any order, find none running.
        first_run(page, 0)
        run_and_wait(page, CELLS.index("%xla_pool start --devices 2 --backend cpu"))
        index = CELLS.index(GATED_PROFILE_CELL)
        try:
            run_and_wait(page, index)  # the cell's reply came: its prompt shows a count
            output = cell(page, index).locator(FRONT_END.output)
            output.get_by_text("reading each rank's trace").wait_for()
            assert output.locator(".xla-profile svg.xla-timeline").count() == 0
            open(PROFILE_GATE, "w").close()
            svg = output.locator(".xla-profile svg.xla-timeline")
            svg.wait_for()
        finally:
            open(PROFILE_GATE, "w").close()  # never a rank left waiting
            run_and_wait(page, CELLS.index("%xla_pool stop"))
        assert svg.locator("text", has_text="rank 0").count() == 1 and svg.locator("text", has_text="rank 1").count() == 1
        assert output.get_by_text("reading each rank's trace").count() == 0  # replaced, not added beside it
        assert output.locator(".xla-profile svg.xla-timeline").count() == 1
        os.unlink(PROFILE_GATE)
