"""The docs site in a real browser: the built site served on loopback, searched in headless Chromium.

A reader's view: the site that ``make docs`` builds, served by Python's
http.server on 127.0.0.1, opened in Debian's chromium (driven by Playwright,
as tests/test_browser.py does). The reader searches for an error message
with nothing but the built files (search runs in the page, offline), follows
the hit to its troubleshooting entry, and opens the entry an error message
names (``%xla_help ID``) as the site's page. The screenshot goes into docs/images/ only when asked
(``--update-images``, or XLA_MAGIC_UPDATE_IMAGES=1), else into a temporary
folder.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from test_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK),
    reason=f"Chromium not found at {CHROMIUM}: run scripts/install-browser (Debian's chromium) to run this test",
)


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    """The site built as `make docs` builds it, served on 127.0.0.1; its URL."""
    built = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(built)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_reader_searches_for_an_error_and_lands_on_its_entry(site, images):
    requests_elsewhere: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(WAIT_MS)
            page.on("request", lambda r: None if r.url.startswith(site) else requests_elsewhere.append(r.url))
            page.goto(f"{site}/getting-started.html")
            nav = page.locator("nav.md-nav--primary")
            for title in ("Getting started", "Pools", "Troubleshooting", "Magics and options", "Changelog"):
                assert nav.get_by_text(title, exact=True).count() >= 1, f"the navigation lacks {title!r}"

            search = page.locator("input.md-search__input")
            search.click()
            # The words of the error, as typed (the search reads key presses): "libtpu" alone now also finds the
            # entries for a TPU VM without libtpu, and the search folds a page's later hits out of sight.
            search.press_sequentially("loaded libtpu", delay=50)
            hit = page.locator(".md-search-result__item a", has_text="this kernel has loaded libtpu").first
            hit.wait_for()
            page.screenshot(path=str(images / "docs_search.png"))

            hit.click()
            page.wait_for_url(re.compile(r"/troubleshooting\.html\?h=loaded\+libtpu#"))
            heading = page.locator("h2", has_text="this kernel has loaded libtpu")
            heading.wait_for()
            assert heading.is_visible()

            # The entry an error message names (%xla_help kernel-loaded-libtpu says more.), on the site.
            page.goto(f"{site}/troubleshooting.html#kernel-loaded-libtpu")
            heading.wait_for()
            assert page.evaluate(
                "() => { const r = document.getElementById('kernel-loaded-libtpu').getBoundingClientRect();"
                " return r.top >= 0 && r.top < window.innerHeight; }"
            ), "the entry's anchor is not in view"
            assert heading.is_visible()
        finally:
            browser.close()
    assert requests_elsewhere == [], f"the site fetched from elsewhere: {requests_elsewhere}"
