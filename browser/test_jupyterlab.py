"""JupyterLab in a real browser, as a learner uses it: the quickstart opened by the README's command, Run All,
rank lines arriving while the job runs, no error output but the notebook's own, and an interrupted job that
leaves nothing behind; then %%ranks cells, one of them interrupted, and %ranks stop leaving nothing."""

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
# Every wait below is for an event; what bounds them is one safety net per test, far above need (a few
# minutes here, beside CPU hogs too), of which each wait gets what is left. pytest-timeout is set above it,
# so that the wait that ran out, not pytest-timeout, is what a failure names.
BUDGET = 1080  # seconds
TEST_TIMEOUT = BUDGET + 120  # for the fixture's JupyterLab start and the clean-up


def _left(deadline: float) -> float:
    """Milliseconds left until ``deadline`` (a time.monotonic()), for Playwright's ``timeout=``."""
    return max(1000.0, (deadline - time.monotonic()) * 1000)


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
    subprocess.run(["git", "checkout-index", "--all", f"--prefix={tmp_path}/lab/"], cwd=REPO, check=True)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Render every cell, not only those in view (JupyterLab 4's default), so the page holds all outputs.
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        *_readme_open_command(),
        "--no-browser",
        "--ServerApp.port=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        # A workspace of its own: JupyterLab restores the last layout from ~/.jupyter/lab/workspaces, and a
        # notebook left open there (by a learner, or by the test before) would be the one Run All runs.
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
    ]
    server = subprocess.Popen(
        cmd,
        cwd=tmp_path / "lab",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings")},
    )
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


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=menu).first.click()
    page.locator(f".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('{item}'))").click()


def _outputs(page) -> str:
    return "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())


@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_quickstart_runs_live_in_jupyterlab_and_an_interrupt_leaves_nothing(chromium, lab, unit_helpers):
    server, address = lab
    deadline = time.monotonic() + BUDGET  # a safety net only: each wait below is for an event
    page = chromium.new_page()
    # The page shows "Idle" before its kernel is connected, and a Run All clicked then runs nothing: wait for
    # the kernel's first reply on the page's websocket instead.
    connected = []
    page.on(
        "websocket",
        lambda ws: ws.on(
            "framereceived",
            lambda frame: connected.append(
                b"kernel_info_reply" in (frame if isinstance(frame, bytes) else frame.encode())
            ),
        ),
    )
    page.goto(address)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=_left(deadline))
    while not any(connected) and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert any(connected), "the notebook's kernel never connected"

    _menu(page, "Run", "Run All Cells")
    page.locator(".jp-OutputArea-output", has_text="[rank 1]").first.wait_for(timeout=_left(deadline))
    while page.locator(RUNNING).count() and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    assert page.locator(RUNNING).count() == 0, "Run All did not finish"
    prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
    assert all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), prompts  # every code cell ran
    text = _outputs(page)
    # An exception that reached the page is drawn by IPython as "Name   Traceback (most recent call last)" and
    # "Cell In[n], line m"; the failures the notebook provokes are caught, printed as text and asserted on.
    raised = [
        line
        for line in text.splitlines()
        if re.match(r"\s*(\w+\s{2,}Traceback \(most recent call last\)|Cell In\[\d+\])", line)
    ]
    assert not raised, raised
    assert "+++ 00_ddp.py" in text and "equal weights; resumed at epoch 2" in text, text[-2000:]

    # An interrupted job: one line says every rank was stopped, and nothing of the job is left.
    kernel = _kernel_pid(server)
    page.locator(".jp-Notebook .jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below
    page.keyboard.press("Enter")
    page.keyboard.type('torchrun("scripts/00_hang.py", nproc_per_node=2, timeout=600)')
    hang = page.locator(".jp-Notebook .jp-Cell").nth(page.locator(".jp-Notebook .jp-Cell").count() - 1)
    page.keyboard.press("Shift+Enter")  # runs the cell and adds an empty one below it
    # Live: both ranks' lines are on the page while the job still runs (the cell shows [*]).
    for rank in (0, 1):
        hang.get_by_text(f'[rank {rank}] {{"rank": {rank}, "event": "ready"}}').wait_for(
            timeout=_left(deadline)
        )
    assert hang.locator(".jp-InputArea-prompt").inner_text() == "[*]:", hang.locator(
        ".jp-InputArea-prompt"
    ).inner_text()
    _menu(page, "Kernel", "Interrupt Kernel")
    hang.get_by_text("ddp_helpers: interrupted").wait_for(timeout=_left(deadline))
    assert "nothing is left running" in hang.inner_text(), hang.inner_text()[-1500:]
    assert unit_helpers.wait_for_no_leftovers(kernel, within=60) == []


RANKS_CELLS = [
    "import os\nprint('kernel', os.getpid())\n%load_ext ddp_helpers\n%ranks start -n 2",
    "%%ranks\nprint('hello from', rank)\nrank * 10",
    # print and sleep on one line: the traceback's line is the same whether the interrupt finds a rank before
    # or inside time.sleep
    "%%ranks\nimport time\nprint('sleeping', flush=True); time.sleep(600)",
    "%%ranks\nrank * 2",
    "%ranks stop",
]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_ranks_cells_run_live_in_jupyterlab_and_an_interrupt_keeps_the_group(
    chromium, lab, tmp_path, unit_helpers
):
    """%%ranks from a real browser: a cell's per-rank lines and value, Kernel → Interrupt on a cell the ranks
    are running (they stop, the group runs on), and %ranks stop leaving nothing."""
    import nbformat

    server, address = lab
    deadline = time.monotonic() + BUDGET  # a safety net only: each wait below is for an event
    spec = {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in RANKS_CELLS], metadata=spec
    )
    nbformat.write(notebook, tmp_path / "lab" / "notebooks" / "ranks_check.ipynb")
    origin = re.match(r"http://127\.0\.0\.1:\d+", address)[0]
    page = chromium.new_page()
    connected = []  # as above: wait for the kernel's first reply before running anything
    page.on(
        "websocket",
        lambda ws: ws.on(
            "framereceived",
            lambda frame: connected.append(
                b"kernel_info_reply" in (frame if isinstance(frame, bytes) else frame.encode())
            ),
        ),
    )
    page.goto(f"{origin}/lab/tree/notebooks/ranks_check.ipynb")
    cells = page.locator(".jp-Notebook:visible .jp-Cell")  # the only notebook open (the test's own workspace)
    cells.first.wait_for(timeout=_left(deadline))
    while not any(connected) and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert any(connected), "the notebook's kernel never connected"

    _menu(page, "Run", "Run All Cells")
    # Interrupt only once both ranks run the cell: a rank not yet in it ignores the interrupt, then sleeps. A
    # rank's line shows that it is inside the cell, and that the kernel, which drew it, waits for the replies.
    for rank in (0, 1):
        cells.nth(2).get_by_text(f"[rank {rank}] sleeping").wait_for(timeout=_left(deadline))
    # still running: its lines are live
    assert cells.nth(2).locator(".jp-InputArea-prompt").inner_text() == "[*]:"
    kernel = int(re.search(r"kernel (\d+)", cells.nth(0).inner_text())[1])
    value = cells.nth(1).inner_text()
    assert "[rank 0] hello from 0" in value and "[rank 1] hello from 1" in value and "{0: 0, 1: 10}" in value
    _menu(page, "Kernel", "Interrupt Kernel")
    cells.nth(2).get_by_text("the group still runs").wait_for(timeout=_left(deadline))
    assert "rank(s) 0, 1 stopped the cell" in cells.nth(2).inner_text(), cells.nth(2).inner_text()[-1500:]

    # The cell's reply must be in first: the kernel aborts requests queued when a cell fails (Run All's rest).
    prompt = cells.nth(2).locator(".jp-InputArea-prompt")
    while prompt.inner_text() == "[*]:" and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert re.fullmatch(r"\[\d+\]:", prompt.inner_text()), prompt.inner_text()
    cells.nth(3).click()  # Run All stopped at the interrupt: run the last two cells by hand
    page.keyboard.press("Shift+Enter")
    cells.nth(3).get_by_text("{0: 0, 1: 2}").wait_for(timeout=_left(deadline))
    page.keyboard.press("Shift+Enter")
    cells.nth(4).get_by_text("stopped 2 rank(s)").wait_for(timeout=_left(deadline))
    assert unit_helpers.wait_for_no_leftovers(kernel, within=60) == []
