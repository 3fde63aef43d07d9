"""Processes as the operating system shows them: whether one is alive, signalling process groups (pgids), and
every live process with its command line and environment, read from ``/proc`` as ``ps`` does (Linux).

The launcher stops and reaps with these, ``slurm.job_processes`` finds a job's processes, and the tests'
leftover check (``tests/ddp_test_support.py``) finds what a launch left behind. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Process:
    """One live process, as ``/proc`` shows it."""

    pid: int
    ppid: int
    cmdline: str  # its arguments, joined by spaces
    env: dict[str, str]  # the environment it started with


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: one not reaped yet (a zombie) answers no signal."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)
    return fields is None or not _zombie(fields)


def pgid_alive(pgid: int) -> bool:
    """Whether any member of process group ``pgid`` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_pgids(pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group; one that is gone, or not ours, is skipped."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def live_processes() -> Iterator[Process]:
    """Every live process whose files this user may read; zombies, which have ended already, are skipped."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(entry)
        if fields is None or _zombie(fields):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/environ", "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
        env = dict(v.split("=", 1) for v in text.split("\0") if "=" in v)
        yield Process(int(entry), int(fields[1]), cmdline, env)


def _stat(pid: int | str) -> list[bytes] | None:
    """``/proc/PID/stat``'s fields after the command name (state, parent pid, ...); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name, in parentheses, may hold spaces and parentheses of its own.
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 1 else None


def _zombie(fields: list[bytes]) -> bool:
    """Whether the process has exited but is not reaped yet (state "Z")."""
    return fields[0] == b"Z"
