"""Keep what the test run executes: every notebook that nbmake runs successfully is saved, with its outputs,
in build/executed/ (git-ignored), so that tools/build_site.py can build the readable edition from it
instead of executing every notebook a second time."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbmake.nb_run import NotebookRun

# Every test: a KeyboardInterrupt that escapes it fails that test alone (tests/interrupt_guard.py).
pytest_plugins = ["tests.interrupt_guard"]

EXECUTED = Path(__file__).resolve().parent / "build" / "executed"
NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"
_execute = NotebookRun.execute


def _execute_and_keep(self: NotebookRun):
    # nbmake offers no hook for the executed notebook, so wrap its one method that returns it.
    result = _execute(self)
    path = Path(self.filename).resolve()
    if result.error is None and NOTEBOOKS in path.parents:
        target = EXECUTED / path.relative_to(NOTEBOOKS)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(result.nb, target)
    return result


NotebookRun.execute = _execute_and_keep
