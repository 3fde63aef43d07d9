"""Helpers the tests share (a plain module: every test folder has its own conftest.py, so importing
"conftest" by name would find whichever was loaded last)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


def main_thread_stack(pid: int) -> list[str]:
    """The frames of process ``pid``'s main thread, innermost first, native ones included, as py-spy reads
    them (``function (file:line)`` or ``function (library)``); [] once the process is gone."""
    spy = Path(sys.executable).with_name("py-spy")
    done = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
    if done.returncode != 0:
        if not os.path.exists(f"/proc/{pid}"):
            return []
        raise RuntimeError(f"py-spy could not read process {pid}'s stack (it needs ptrace): {done.stderr}")
    frames, mine = [], False
    for line in done.stdout.splitlines():
        if line.startswith("Thread "):
            mine = line.split()[1] in (str(pid), hex(pid))
        elif mine and line.startswith("    "):
            frames.append(line.strip())
    return frames


def in_native_call(pid: int, native: str, caller: str) -> bool:
    """Whether ``pid``'s main thread is inside the C/C++ function ``native`` called from the Python function
    ``caller``: past the last bytecode, where a signal can only set a flag for Python to act on later."""
    frames = main_thread_stack(pid)
    inner = next((i for i, f in enumerate(frames) if f.startswith(f"{native} (")), None)
    return inner is not None and any(f.startswith(f"{caller} (") for f in frames[inner + 1 :])


def in_python_call(pid: int, function: str, file: str) -> bool:
    """Whether ``pid``'s main thread runs the Python function ``function`` (its qualified name, such as
    ``MessageReader.next``) of a file named ``file``."""
    return any(f.startswith(f"{function} (") and f"{file}:" in f for f in main_thread_stack(pid))
