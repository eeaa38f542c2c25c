"""%xla_status in a real browser: JupyterLab on loopback, driven by headless Chromium.

A person's view, end to end: JupyterLab renders the ipywidgets panel, the
test reads what the page shows, clicks the panel's Interrupt button while a
cell runs, and saves the screenshots the README uses (docs/images/).

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
import time
import contextlib
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "docs" / "images"
CHROMIUM = os.environ.get("XLA_MAGIC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_LIMIT = 60.0
WAIT_MS = 90_000  # the longest any one thing on the page may take

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"Chromium not found at {CHROMIUM}: run scripts/install-browser (Debian's chromium) to run this test",
)

CELLS = [
    "%load_ext xla_magic",
    "%%xla_spawn --devices 8\nimport torch\nx = torch.ones(2, device=device) * rank\n"
    "print('hello from rank', rank, 'of', world_size)\nfloat(x.sum().cpu())",
    "%xla_status",
    "%%xla_spawn --devices 2\nimport time\nprint('working', rank, flush=True)\nwhile True:\n    time.sleep(0.05)",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, in a private directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
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
        self.log = open(root / "lab.log", "wb")
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "jupyterlab", "--no-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root / 'notebooks'}",
                "--allow-root", "--ServerApp.terminals_enabled=False",  # CI runs as root
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",
                f"--LabApp.user_settings_dir={root / 'settings'}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
            ],
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
        raise RuntimeError(f"JupyterLab did not start; see {self.root / 'lab.log'}:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.root / "lab.log").read_text(errors="replace")[-3000:]

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
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    (root / "notebooks").mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "notebooks" / "status.ipynb")
    server = Lab(root)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(lab):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1280, "height": 1000})
            tab.set_default_timeout(WAIT_MS)
            tab.goto(f"{lab.url}/lab/tree/status.ipynb?token={lab.token}")
            tab.wait_for_selector(".jp-Notebook .jp-Cell")
            tab.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
            yield tab
        finally:
            browser.close()


@contextlib.contextmanager
def evidence(page, lab, name: str):
    """On failure, keep a screenshot of the page and the server's log beside it."""
    try:
        yield
    except BaseException:
        path = lab.root / f"{name}-failure.png"
        page.screenshot(path=str(path))
        print(f"page at failure: {path}\nJupyterLab log:\n{lab.log_tail()}")
        raise


def cell(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def prompt(page, index: int) -> str:
    return cell(page, index).locator(".jp-InputPrompt").inner_text().strip()


def run_cell(page, index: int) -> None:
    """Select a cell and run it with Shift+Enter, as a person does.

    Right after the page loads, JupyterLab may still move the focus and
    swallow a key; so check that the cell was queued ("[*]:" or a count)
    and press again if it was not.
    """
    for _attempt in range(3):
        cell(page, index).locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(
                f"document.querySelectorAll('.jp-Notebook .jp-Cell')[{index}]"
                ".querySelector('.jp-InputPrompt').textContent.trim() !== '[ ]:'",
                timeout=5_000,
            )
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"cell {index} could not be started; its prompt shows {prompt(page, index)!r}")


def run_and_wait(page, index: int) -> None:
    run_cell(page, index)
    page.wait_for_function(
        f"/^\\[\\d+\\]:$/.test(document.querySelectorAll('.jp-Notebook .jp-Cell')[{index}]"
        ".querySelector('.jp-InputPrompt').textContent.trim())",
        timeout=WAIT_MS,
    )


def panel_rows(page, state: str):
    return page.locator(f".xla-status-panel tr.xla-rank[data-state='{state}']")


def test_status_panel_shows_eight_done_ranks_and_the_xla_free_badge(page, lab):
    with evidence(page, lab, "panel"):
        check_status_panel(page)


def check_status_panel(page) -> None:
    for index in range(3):
        run_and_wait(page, index)
    panel = page.locator(".xla-status-panel")
    panel.wait_for()
    page.wait_for_function(
        "document.querySelectorAll(\".xla-status-panel tr.xla-rank[data-state='done']\").length === 8",
        timeout=WAIT_MS,
    )
    assert panel_rows(page, "done").count() == 8
    badge = panel.locator(".xla-badge.xla-free")
    assert badge.inner_text().strip() == "✔ kernel is XLA-free"
    assert "CPU simulation, 8 devices" in panel.inner_text()
    assert f"torch_xla {metadata.version('torch_xla')}," in panel.inner_text()  # what this stack's venv has
    outputs = cell(page, 1).locator(".jp-OutputArea")
    for rank in range(8):
        assert f"[rank {rank}] hello from rank {rank} of 8" in outputs.inner_text()
    assert "[0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]" in outputs.inner_text()
    IMAGES.mkdir(parents=True, exist_ok=True)
    panel.screenshot(path=str(IMAGES / "status_panel.png"))
    cell(page, 1).screenshot(path=str(IMAGES / "tagged_output.png"))


def test_interrupt_button_stops_a_running_cell(page, lab):
    with evidence(page, lab, "interrupt"):
        check_interrupt_button(page)


def check_interrupt_button(page) -> None:
    panel = page.locator(".xla-status-panel")
    panel.wait_for()
    run_cell(page, 3)
    # Both ranks have printed, so the cell is inside its endless loop.
    page.wait_for_function(
        "[...document.querySelectorAll(\".xla-status-panel tr.xla-rank[data-state='running']\")]"
        ".filter(row => row.textContent.includes('working')).length === 2",
        timeout=WAIT_MS,
    )
    button = panel.get_by_role("button", name="Interrupt run")
    assert button.is_enabled()
    button.click()
    output = cell(page, 3).locator(".jp-OutputArea")
    output.get_by_text("RunInterrupted").wait_for()
    page.locator(".xla-status-panel .xla-run[data-outcome='interrupted']").wait_for()
    assert panel_rows(page, "killed").count() == 2
    assert button.is_disabled()
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']")  # the kernel is free again
