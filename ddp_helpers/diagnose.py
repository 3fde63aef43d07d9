"""Turn what the ranks left behind (stderr, faulthandler stack dumps) into a short diagnosis."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

_FRAME = re.compile(r'^\s+File "(?P<path>.+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")
_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"
_NN_PARALLEL = f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}"
_AUTOGRAD = f"{os.sep}torch{os.sep}autograd{os.sep}"
_OWN = f"{os.sep}ddp_helpers{os.sep}"
# DDP starts its gradient all-reduce from C++ inside autograd, so a rank waiting for it shows only backward().
BACKWARD = "backward (DDP's gradient all-reduce runs inside it)"


@dataclass
class Frame:
    path: str
    line: int
    func: str

    def where(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line} in {self.func}"


@dataclass
class RankState:
    """Where one rank was when the job timed out."""

    rank: int
    alive: bool
    exitcode: int | None = None
    frames: list[Frame] | None = None  # innermost first
    script_frame: Frame | None = None
    collective: str | None = None  # the torch.distributed call it waits in, if any
    started: bool = True

    def describe(self) -> str:
        if not self.started:
            return f"rank {self.rank} never started its script (still launching or importing)"
        if not self.alive:
            code = "unknown" if self.exitcode is None else self.exitcode
            return f"rank {self.rank} had already exited (exit code {code}) while its peers waited for it"
        where = self.script_frame.where() if self.script_frame else "an unknown place"
        if self.exitcode is not None:
            return (f"rank {self.rank} finished its script (exit code {self.exitcode}) but its process hangs "
                    f"while shutting down (a collective in an atexit hook, a destructor, destroy_process_group)")
        if self.frames is None:
            return f"rank {self.rank}: no stack dump arrived (it may be stuck in C code holding the GIL)"
        if self.collective:
            return f"rank {self.rank} waits in torch.distributed `{self.collective}` called at {where}"
        inner = self.frames[0].where() if self.frames else where
        return f"rank {self.rank} is busy at {where} (innermost: {inner}), not in a collective"


def parse_stack_dump(text: str) -> list[list[Frame]]:
    """Split a faulthandler dump into threads, each a list of frames, innermost first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(Frame(m["path"], int(m["line"]), m["func"]))
    return threads


def rank_state(rank: int, dump: str | None, script: str, alive: bool, exitcode: int | None) -> RankState:
    """Classify one rank from its stack dump: exited, waiting in a collective, or busy elsewhere."""
    state = RankState(rank=rank, alive=alive, exitcode=exitcode)
    if not alive or dump is None:
        return state
    script = os.path.realpath(script)
    threads = [t for t in parse_stack_dump(dump) if t and not all(_OWN in f.path for f in t)]
    main = next((t for t in threads if any(os.path.realpath(f.path) == script for f in t)), None)
    if main is None:
        main = threads[0] if threads else []
    state.frames = main
    for i, f in enumerate(main):
        if os.path.realpath(f.path) == script:
            state.script_frame = f
            inner = main[:i]
            lib = [g for g in inner if _DIST in g.path or _NN_PARALLEL in g.path]
            if lib:
                c10d = [g for g in lib if g.path.endswith("distributed_c10d.py")]
                state.collective = (c10d[0] if c10d else lib[0]).func
            elif any(_AUTOGRAD in g.path for g in inner):
                state.collective = BACKWARD
            break
    return state


def culprits(states: list[RankState]) -> tuple[list[RankState], str]:
    """Pick the ranks that caused a hang, and say why in one line."""
    exited = [s for s in states if not s.alive or s.exitcode is not None]
    busy = [s for s in states if s.alive and s.exitcode is None and s.frames is not None and not s.collective]
    silent = [s for s in states if s.alive and s.frames is None]
    if exited or busy:
        return exited + busy, "the stuck rank(s) never reached the collective their peers wait in"
    if silent:
        return silent, "no stack dump came back from these rank(s)"
    places = {(s.collective, s.script_frame.where() if s.script_frame else None) for s in states}
    if len(places) > 1:
        return states, "the ranks wait in different collectives or at different lines: a mismatch"
    return states, "every rank waits in the same collective: look for a peer outside this job or a network problem"


def signal_name(exitcode: int | None) -> str | None:
    """'SIGKILL' for -9, None for a normal exit code."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes an uncaught traceback's lines with it
_BOOTSTRAP_FRAME = re.compile(r'^\s+File "(<frozen runpy>|.*ddp_helpers[/\\]_worker\.py)"')


def last_traceback(lines: list[str], max_lines: int = 20) -> list[str]:
    """The last Python traceback in a rank's stderr, without the launcher's own frames, in about ``max_lines``."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return lines[-10:]
    block = lines[starts[-1]:]
    # Frames are indented; the first line that is not is the exception itself ("ValueError: ...").
    end = next((i + 1 for i, line in enumerate(block[1:], 1) if line and not line[0].isspace()), len(block))
    kept, skipping = [], False
    for line in block[:end]:
        if line.startswith("  File "):
            skipping = bool(_BOOTSTRAP_FRAME.match(line))
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    if len(kept) > max_lines:
        cut = len(kept) - max_lines + 1
        kept = [kept[0], f"  ... ({cut} lines cut; the whole log is on the error's .result)"] + kept[-(max_lines - 2):]
    return kept
