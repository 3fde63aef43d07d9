"""Shared fixtures: write small scripts, and find processes a launch left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from ddp_helpers import _protocol as protocol

REPO = Path(__file__).resolve().parent.parent


def committed_text(path: Path) -> str:
    """What git would commit for ``path``: its staged version, so that a learner's saved outputs or
    edits in the working tree never fail these checks. Outside a git checkout (or for a file git does
    not track yet) that is the file itself."""
    rel = path.resolve().relative_to(REPO).as_posix()
    shown = subprocess.run(["git", "show", f":{rel}"], cwd=REPO, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else path.read_text()


def leftover_processes(parent_pid: int) -> list[str]:
    """Live (non-zombie) processes a ddp_helpers launch from ``parent_pid`` started: cold ones carry the
    launcher's marker in their environment; warm ones are forks of its warm process (whose first environment
    they keep), other than the warm process itself, which lives as long as its kernel by design."""
    marker = f"{protocol.PARENT_PID}={parent_pid}".encode()
    owner = f"{protocol.WARM_OWNER}={parent_pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            forked = owner in env and int(fields[1]) != parent_pid  # a fork of our warm process, not itself
            if marker in env or forked:
                found.append(f"{entry}: {cmdline}")
        except OSError:
            continue
    return found


def wait_for_no_leftovers(parent_pid: int, within: float = 15.0) -> list[str]:
    end = time.monotonic() + within
    while (left := leftover_processes(parent_pid)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


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
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    yield
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == env, "the launcher changed os.environ"
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "the launcher changed signal handlers"
    assert wait_for_no_leftovers(os.getpid(), within=60) == [], "processes outlived the launch"
