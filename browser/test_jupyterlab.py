"""JupyterLab in a real browser, as a learner uses it: notebook 00 opened by the README's command, Run All,
rank lines arriving while the job runs, no error output but the notebook's own, and an interrupted job that
leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNNING = ".jp-InputArea-prompt:text('[*]:')"  # JupyterLab marks a cell that is still executing with [*]


def _readme_open_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- open-command -->\s*```(?:bash)?\n(.*?)\n```", text, re.S)[1]
    launch = block.split("&&")[-1].split()
    assert launch[:2] == [".venv/bin/jupyter", "lab"], launch
    return launch[2:]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab started as the README's open command does, on a copy of the notebooks that git holds (the
    browser may save what it runs: never into the checkout), on a free port, with no token."""
    subprocess.run(["git", "checkout-index", "--all", f"--prefix={tmp_path}/"], cwd=REPO, check=True)
    cmd = [sys.executable, "-m", "jupyterlab", *_readme_open_command(), "--no-browser", "--ServerApp.port=0",
           "--IdentityProvider.token=", "--ServerApp.password="]
    server = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        for line in server.stderr:
            if m := re.search(r"(http://127\.0\.0\.1:\d+/\S+)", line):
                break
        else:
            pytest.fail("JupyterLab exited without printing its address")
        yield server, m[1]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _kernel_pid(server: subprocess.Popen) -> int:
    """The kernel JupyterLab started for the notebook: its child running ipykernel."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat[1]) == server.pid and b"ipykernel" in cmdline:
                return int(entry)
    raise AssertionError("no kernel process found under the JupyterLab server")


def _outputs(page) -> str:
    return "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())


def test_notebook_00_runs_live_in_jupyterlab_and_an_interrupt_leaves_nothing(chromium, lab, unit_helpers):
    server, address = lab
    page = chromium.new_page()
    page.goto(address)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=600_000)
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=600_000)

    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    # Live: both ranks' lines appear while a cell is still running, not at the end.
    live = False
    deadline = time.monotonic() + 600  # a safety net: the notebook takes well under a minute here
    while time.monotonic() < deadline:
        text = _outputs(page)
        if "[rank 0]" in text and "[rank 1]" in text:
            live = page.locator(RUNNING).count() > 0
            break
        time.sleep(0.2)
    assert live, "rank lines should stream into the running cell"
    while page.locator(RUNNING).count() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert page.locator(RUNNING).count() == 0, "Run All did not finish"
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] pre").all_inner_texts()
    tracebacks = [e for e in errors if "Traceback (most recent call last)" in e and "[rank" not in e]
    assert not tracebacks, tracebacks[:3]  # the notebook's own failures are caught and asserted on, never raised
    assert "the job took" in _outputs(page) and "same records" in _outputs(page), _outputs(page)[-2000:]

    # An interrupted job: one line says every rank was stopped, and nothing of the job is left.
    kernel = _kernel_pid(server)
    page.locator(".jp-Notebook .jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below
    page.keyboard.press("Enter")
    page.keyboard.type('torchrun("scripts/00_hang.py", nproc_per_node=2, timeout=600)')
    page.keyboard.press("Shift+Enter")
    hang = page.locator(".jp-Notebook .jp-Cell").last
    hang.get_by_text('"event": "ready"').first.wait_for(timeout=600_000)
    page.get_by_role("menuitem", name="Kernel", exact=True).click()
    page.get_by_role("menuitem", name="Interrupt Kernel", exact=True).click()
    hang.get_by_text("ddp_helpers: interrupted").wait_for(timeout=600_000)
    assert "nothing is left running" in hang.inner_text(), hang.inner_text()[-1500:]
    assert unit_helpers.wait_for_no_leftovers(kernel, within=60) == []
