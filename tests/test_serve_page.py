"""The live page in a real headless browser (Debian's chromium, driven by Playwright).

`.ci/run` installs chromium with apt; without it this test skips and says why.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from specstack.server.app import create_app
from specstack.server.roles import default_roles

from test_serve import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOT = os.environ.get("SPECSTACK_PAGE_SCREENSHOT")  # e.g. docs/serve-page.png, to refresh the README's picture


@pytest.mark.skipif(CHROMIUM is None, reason="LOUD SKIP: no chromium on PATH; install Debian's `chromium` package (.ci/run does)")
def test_page_streams_coloured_tokens_with_acceptance(tmp_path: Path):
    from playwright.sync_api import sync_playwright

    with Server(create_app(default_roles(parallel=1))) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        page.goto(server.url + "/")
        page.wait_for_selector("#role option", state="attached")
        page.fill("#prompt", "import os\nimport sys\nimport re\n")
        page.fill("#max", "80")
        page.click("#go")
        page.wait_for_selector("body[data-done='1']", timeout=30_000)
        sources = page.eval_on_selector_all("#out span.tok", "els => els.map(e => e.dataset.source)")
        assert len(sources) == 80
        assert "target" in sources and any(s != "target" for s in sources)  # both kinds, coloured apart
        colours = page.eval_on_selector_all("#out span.draft", "els => els.map(e => getComputedStyle(e).backgroundColor)")
        assert colours and all(c not in ("", "rgba(0, 0, 0, 0)") for c in colours)
        acceptance = page.inner_text("#acc")
        assert acceptance.endswith("%") and float(acceptance.rstrip("%")) > 0
        assert float(page.inner_text("#tps")) > 0
        page.screenshot(path=SHOT or str(tmp_path / "page.png"), full_page=True)
        browser.close()
