"""The code style CI keeps: ruff's formatter and linter, configured in pyproject.toml, find nothing to change.

Run by the README's test command like every other test, so CI keeps both. To fix what they report:
``ruff format .`` and ``ruff check --fix .`` from the repository's root (notebooks/ is left out on purpose).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from ddp_test_support import REPO


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )  # a safety net only


@pytest.mark.parametrize("args", [("format", "--check", "--diff"), ("check",)], ids=["format", "check"])
def test_ruff_finds_nothing_to_change(args):
    done = ruff(*args)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
