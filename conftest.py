"""The test run as a whole: every test guarded against an escaping KeyboardInterrupt; the tests spread over
pytest-xdist's workers, longest first, no two at once that share files or the SLURM cluster; every notebook
run in strict mode (ddp_helpers/_strict.py: a hang or gloo's abort in a launch that does not pin gloo fails
its cell); and every notebook that nbmake runs successfully kept, with its outputs, in build/executed/
(git-ignored), so that tools/build_site.py builds the readable edition from it instead of executing every
notebook a second time."""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from nbmake.nb_run import NotebookRun

from ddp_helpers._strict import STRICT_VARIABLE

# Every test: a KeyboardInterrupt that escapes it fails that test alone (tests/interrupt_guard.py).
pytest_plugins = ["tests.interrupt_guard"]

ROOT = Path(__file__).resolve().parent
EXECUTED = ROOT / "build" / "executed"
NOTEBOOKS = ROOT / "notebooks"
DURATIONS = ROOT / "tests" / "durations.json"  # seconds a test took (benchmarks/suite_time.py --durations)
SITE_TEST = "browser/test_site.py"  # the site is built from the notebooks this run executes: it goes last
_execute = NotebookRun.execute
RUNS = EXECUTED / ".runs"  # per test run: which notebooks it has finished (the site's build waits for them)
_run_folder: Path | None = None


def _execute_and_keep(self: NotebookRun):
    # nbmake offers no hook for the executed notebook, so wrap its one method that returns it.
    path = Path(self.filename).resolve()
    outcome = "error"
    try:
        result = _execute(self)
        outcome = "passed" if result.error is None else "failed"
        if result.error is None and NOTEBOOKS in path.parents:
            target = EXECUTED / path.relative_to(NOTEBOOKS)
            target.parent.mkdir(parents=True, exist_ok=True)
            # whole or not at all: the site's build may read it meanwhile, from another worker
            with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as f:
                nbformat.write(result.nb, f)
            os.replace(f.name, target)
        return result
    finally:
        if _run_folder is not None:  # this run has finished with the notebook, whatever its outcome
            done = _run_folder / f"{_record_name(path)}.done"
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(outcome)


NotebookRun.execute = _execute_and_keep


def _record_name(notebook: Path) -> str:
    """The file name of a notebook's record in this run's folder: its path, from the repository's root."""
    path = notebook.relative_to(ROOT) if ROOT in notebook.parents else notebook
    return path.as_posix().replace("/", "__")


def group(nodeid: str) -> str | None:
    """The tests that must not run at the same time, as one group for the scheduler below: a notebook with its
    solutions and its translation (they write the same scripts and folders), and the SLURM tests with notebook
    05 (one cluster); the site's tests (one build of the site)."""
    path = nodeid.split("::")[0]
    if path.startswith("notebooks/"):
        return f"notebook-{Path(path).name[:2]}"
    if path == "tests/test_slurm.py":
        return "notebook-05"
    if path == SITE_TEST:
        return "site"
    return None


def pytest_configure(config: pytest.Config) -> None:
    global _run_folder
    worker = getattr(config, "workerinput", None)  # pytest-xdist's workers share their run's id
    if worker is None and RUNS.is_dir():  # earlier runs' records, once a day old (a run may still be going)
        for folder in RUNS.iterdir():
            if time.time() - folder.stat().st_mtime > 86400:
                shutil.rmtree(folder, ignore_errors=True)
    _run_folder = RUNS / (worker["testrunuid"] if worker else uuid.uuid4().hex)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A notebook runs in strict mode: its kernel, and every launch from it, inherit DDP_STRICT_BACKEND=1, so
    a hang or gloo's abort from a launch that does not pin gloo fails the cell (on NCCL it would not happen
    so); DDP_STRICT_BACKEND=0 in the environment turns it off. The package's own tests run without it: they
    test what a learner gets."""
    if item.path.suffix != ".ipynb" or os.environ.get(STRICT_VARIABLE):
        return (yield)
    os.environ[STRICT_VARIABLE] = "1"
    try:
        return (yield)
    finally:
        os.environ.pop(STRICT_VARIABLE, None)


@pytest.fixture(scope="session")
def notebooks_run_here(request: pytest.FixtureRequest) -> list[Path]:
    """Wait until every notebook this test run executes with nbmake, on any worker, has finished; return them.
    The site's test is ordered after them all, so on its worker nothing is left to run before it."""
    notebooks = [item.path for item in request.session.items if item.path.suffix == ".ipynb"]
    names = {_record_name(p.resolve()) for p in notebooks}
    while not all((_run_folder / f"{name}.done").exists() for name in names):
        time.sleep(0.5)
    return notebooks


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scope scheduler with ``group``'s groups as scopes: each runs whole on one worker, in the
    order below. (Its own xdist_group mark renames test ids, which pytest 9.2 no longer lets it do.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid) or nodeid

    return Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests for pytest-xdist, which hands them out in this order: the notebooks' groups, then the
    site's test (built from them: it waits for the last, then builds while the other workers run on), then
    the rest; within each, the longest first (a longest-first schedule ends soonest)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    totals: collections.Counter[str] = collections.Counter()
    for item in items:
        totals[group(item.nodeid) or item.nodeid] += seconds.get(item.nodeid, 0)

    def order(item: pytest.Item) -> tuple:
        unit = group(item.nodeid) or item.nodeid
        phase = 0 if unit.startswith("notebook-") else 1 if unit == "site" else 2
        return (phase, -totals[unit], unit, -seconds.get(item.nodeid, 0))

    items.sort(key=order)
