"""Helpers the tests share (a plain module: every test folder has its own conftest.py, so importing
"conftest" by name would find whichever was loaded last)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ddp_helpers import _protocol as protocol
from ddp_helpers._procs import Process, live_processes

REPO = Path(__file__).resolve().parent.parent


def committed_text(path: Path) -> str:
    """What git would commit for ``path``: its staged version, so that a learner's saved outputs or
    edits in the working tree never fail these checks. Outside a git checkout (or for a file git does
    not track yet) that is the file itself."""
    rel = path.resolve().relative_to(REPO).as_posix()
    shown = subprocess.run(["git", "show", f":{rel}"], cwd=REPO, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else path.read_text()


def _launched(parent_pid: int) -> Iterator[Process]:
    """Each live (non-zombie) process a ddp_helpers launch from ``parent_pid`` started: cold ones carry the
    launcher's marker in their environment; warm ones are forks of its warm process (whose first environment
    they keep), other than the warm process itself, which lives as long as its kernel by design."""
    for process in live_processes():
        if process.pid == os.getpid():
            continue
        marked = process.env.get(protocol.PARENT_PID) == str(parent_pid)
        # A fork of our warm process, not the warm process itself.
        forked = process.env.get(protocol.WARM_OWNER) == str(parent_pid) and process.ppid != parent_pid
        if marked or forked:
            yield process


def leftover_processes(parent_pid: int) -> list[str]:
    """``pid: command line`` of each live process a ddp_helpers launch from ``parent_pid`` started."""
    return [f"{p.pid}: {p.cmdline}" for p in _launched(parent_pid)]


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def rank_pids(parent_pid: int, script: str) -> dict[int, int]:
    """{rank: pid} of the ranks that a launch from ``parent_pid`` runs now, found by the name the worker
    wrapper gives each rank (``rank1 job`` for job.py); a rank's own children, which inherit its name, are
    left out. A rank that has not started yet is missing."""
    stem = os.path.splitext(os.path.basename(script))[0]
    found = {}
    for process in _launched(parent_pid):
        name = _comm(process.pid)
        match = re.fullmatch(r"rank(\d+) (.*)", name or "")
        # comm keeps 15 bytes of the name
        if match and stem.startswith(match[2]) and _comm(process.ppid) != name:
            found[int(match[1])] = process.pid
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


def in_native_call(pid: int, native: str, caller: str, at: tuple[str, int] | None = None) -> bool:
    """Whether ``pid``'s main thread is inside the C/C++ function ``native`` called from the Python function
    ``caller``: past the last bytecode, where a signal can only set a flag for Python to act on later. With
    ``at`` (a file's name and a line), also whether that call is the one made at that line (one reading of
    the stack: not, say, a collective that ``init_process_group`` makes on the way)."""
    frames = main_thread_stack(pid)
    inner = next((i for i, f in enumerate(frames) if f.startswith(f"{native} (")), None)
    if inner is None or not any(f.startswith(f"{caller} (") for f in frames[inner + 1 :]):
        return False
    return at is None or _line_in(frames, *at) == at[1]


def _line_in(frames: list[str], file: str, line: int) -> int | None:
    """The line of the innermost of ``frames`` in a file named ``file``."""
    for frame in frames:
        if found := re.search(rf"[(/]{re.escape(file)}:(\d+)\)$", frame):
            return int(found[1])
    return None


def in_python_call(pid: int, function: str, file: str) -> bool:
    """Whether ``pid``'s main thread runs the Python function ``function`` (its qualified name, such as
    ``MessageReader.next``) of a file named ``file``."""
    return any(f.startswith(f"{function} (") and f"{file}:" in f for f in main_thread_stack(pid))


def at_line(pid: int, file: str, line: int) -> bool:
    """Whether ``pid``'s main thread is at line ``line`` of a file named ``file`` (its innermost frame in that
    file), in that line's own bytecode or in a call it makes (``time.sleep``)."""
    return _line_in(main_thread_stack(pid), file, line) == line


@contextlib.contextmanager
def clocks_start_when(ready: Callable[[], bool], within: float = 300.0) -> Iterator[None]:
    """Inside the block, each ``diagnose.Watch`` the launcher makes (a launch's, a ``%%ranks`` cell's, an
    ``sbatch()`` job's) starts its clock once ``ready()`` holds instead of when the job or cell starts, so a
    timeout or stall under test counts from the event it is about (every rank at its place), never from a
    start-up whose length is this machine's speed. Everything else is the launcher's own: the Watch's
    checks, the stack dumps, the error. ``ready`` is asked at most every 0.2 s (py-spy takes a while); if it
    has not held ``within`` seconds after the Watch was made (a safety net, far above need), the check raises
    AssertionError, which ends the job as any error in the launcher does."""
    from ddp_helpers import diagnose

    original = diagnose.Watch

    class FromTheEvent(original):
        def __init__(self, start: float, timeout, stall_timeout, *, cell: bool = False):
            super().__init__(start, timeout, stall_timeout, cell=cell)
            self.made, self.next_look, self.waiting = start, start, True

        def check(self, now: float, new_lines: bool, every_rank_printed: bool):
            if self.waiting:
                if now < self.next_look:
                    return None
                if not ready():
                    if now - self.made > within:
                        raise AssertionError(
                            f"the ranks were not at their places {within:g} s after the start"
                        )
                    self.next_look = time.monotonic() + 0.2
                    return None
                super().__init__(time.monotonic(), self.timeout, self.stall_timeout, cell=self.cell)
                self.waiting = False  # from now on the Watch is the launcher's own, counting from the event
                return None
            return super().check(now, new_lines, every_rank_printed)

    diagnose.Watch = FromTheEvent
    try:
        yield
    finally:
        diagnose.Watch = original
