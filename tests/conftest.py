"""Shared fixtures: write small scripts, and find processes a launch left behind."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest
from ddp_test_support import wait_for_no_leftovers


@pytest.fixture
def script(tmp_path: Path):
    """Write a script from dedented source into tmp_path and return its path."""

    def write(source: str, name: str = "job.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def kernel_unchanged():
    """Fail if a test changed this process's environment or signal handlers, or left a process behind."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    handlers = {
        s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
    }
    yield
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == env, (
        "the launcher changed os.environ"
    )
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "the launcher changed signal handlers"
    assert wait_for_no_leftovers(os.getpid(), within=60) == [], "processes outlived the launch"
