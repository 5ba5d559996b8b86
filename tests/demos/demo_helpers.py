"""What the demo-app tests share: serving an app on a free localhost port, and a headless Chromium page (Debian's
chromium driven by Playwright) that skips without a browser, or fails when MMSPEC_REQUIRE_BROWSER is set."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from demos.common import launch
from mmspec.testing import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def serve(app) -> Iterator[str]:
    """Launch `app` on a free localhost port without blocking, yield its URL, close it (a fixture body)."""
    launch(app, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield app.local_url
    app.close()


@contextmanager
def headless_page(height: int):
    """Yield (page, expect) of a 1280 x `height` headless Chromium page."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        sync_playwright = None
    if CHROMIUM is None or sync_playwright is None:
        if os.environ.get("MMSPEC_REQUIRE_BROWSER"):
            pytest.fail("browser tests required (MMSPEC_REQUIRE_BROWSER) but chromium or playwright is missing")
        pytest.skip("needs Debian's chromium and the playwright package (.ci/run installs both)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": height}), expect
        finally:
            browser.close()
