"""Tests in a real browser (Chromium driven by Playwright). They run after the notebooks (see pyproject's
testpaths), so the site is built from the notebooks the test run just executed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DDP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

# The unit tests' helpers (leftover processes, the staged copy of a file), loaded under a name of their own.
_spec = importlib.util.spec_from_file_location("ddp_test_support", REPO / "tests" / "ddp_test_support.py")
unit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unit)


@pytest.fixture(scope="module")
def free_port() -> int:
    """A port nobody uses right now (never a fixed one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def unit_helpers():
    """tests/ddp_test_support.py's helpers: leftover_processes, wait_for_no_leftovers, committed_text."""
    return unit


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium: Debian's, since Playwright cannot download its own here (.ci/run installs it)."""
    if CHROMIUM is None:
        message = "no chromium on this machine: `apt-get install chromium` (.ci/run installs it)"
        if os.environ.get(
            "DDP_REQUIRE_BROWSER"
        ):  # CI sets it: there, a missing browser is a failure, not a skip
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
