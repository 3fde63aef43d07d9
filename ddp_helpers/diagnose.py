"""Whom to blame: turn what the ranks left behind into the error a launch raises. Pure functions only.

The launcher gathers the evidence (each rank's ``RankEvidence``: its status events, torch's failure record,
its stack dump when the job hung) and calls ``failure_error`` or ``hang_error``; ``Watch`` decides when a
running job counts as hung. Everything here is tested in milliseconds with made-up evidence
(tests/test_diagnose.py).
"""

from __future__ import annotations

import math
import os
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ddp_helpers.outcome import Hang, JobFailedError, JobHungError, TorchrunResult

_FRAME = re.compile(r'^\s+File "(?P<path>.+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")
_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"
_NN_PARALLEL = f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}"
_AUTOGRAD = f"{os.sep}torch{os.sep}autograd{os.sep}"
_OWN = f"{os.sep}ddp_helpers{os.sep}"
# Blocking point-to-point calls, each with the one it waits for.
_POINT_TO_POINT = {"send": "recv", "recv": "send"}
# DDP starts its gradient all-reduce from C++ inside autograd, so a rank waiting for it shows only backward().
BACKWARD = "backward (DDP's gradient all-reduce runs inside it)"


@dataclass
class Frame:
    path: str
    line: int
    func: str

    def where(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line} in {self.func}"


@dataclass(frozen=True)
class RankEvidence:
    """Everything known about one rank's last attempt: what the worker wrapper wrote to its status file,
    torch's failure record, and, when the job hung, whether its process still ran and its stack dump. The
    diagnosis works on this evidence only, so every message below is built without a process."""

    rank: int
    started: bool = False  # the worker wrapper recorded the start of its script
    script_exit: int | None = None  # the exit code the script itself ended with (None: it never ended)
    raised: str | None = None  # the exception type, if the script raised
    # when it raised or ended (the wrapper's clock, else torch's whole-second timestamp)
    time: float = math.inf
    exitcode: int | None = None  # how its process ended; None: unknown (stopped before anyone recorded it)
    alive: bool = False  # (a hang) its process still ran when the hang was caught
    stack: str | None = None  # (a hang) its faulthandler dump of every thread; None: none came back
    # (a %%ranks cell's hang) why the rank was not running the cell: it had "finished", or --ranks "left out"
    idle: Literal["finished", "left out"] | None = None

    @property
    def failed(self) -> bool:
        return self.exitcode not in (0, None)

    @property
    def stopped_by_torchrun(self) -> bool:
        """Killed with SIGTERM without raising: torchrun stopping a healthy rank after another one failed."""
        return self.raised is None and self.exitcode == -signal.SIGTERM


def rank_evidence(
    rank: int,
    events: Sequence[Mapping],
    failure: Mapping | None = None,
    *,
    agents_ok: bool = False,
    alive: bool = False,
    stack: str | None = None,
) -> RankEvidence:
    """One rank's evidence from its status events (``_protocol``: start, exception, exit) and torch's failure
    record for it, if any. Only the last attempt counts: a restart begins with a new ``start``. The exit code
    is torch's when it has one, else the script's own, else 0 when every agent succeeded (else unknown)."""
    start = end = raised = None
    for event in events:
        if event["event"] == "start":
            start, end, raised = event, None, None
        elif event["event"] == "exit":
            end = event
        elif event["event"] == "exception":
            raised = event
    script_exit = end["code"] if end else None
    if failure is not None:
        exitcode = failure["exitcode"]
    else:
        exitcode = script_exit if end else (0 if agents_ok else None)
    when = (raised or end or {}).get("time", (failure or {}).get("timestamp"))
    return RankEvidence(
        rank,
        started=start is not None,
        script_exit=script_exit,
        raised=raised["type"] if raised else None,
        time=math.inf if when is None else when,
        exitcode=exitcode,
        alive=alive,
        stack=stack,
    )


# ---- a failure: whom to blame ----------------------------------------------------------------------------


def blame_order(record: RankEvidence) -> tuple[bool, float, int]:
    """Sort key for failed ranks: one that failed by itself before one torchrun stopped; then the earliest."""
    return record.stopped_by_torchrun, record.time, record.rank


def describe_exit(code: int | None) -> str:
    name = signal_name(code)
    return f"was killed by {name} (exit code {code})" if name else f"exited with code {code}"


def describe_failure(record: RankEvidence) -> str:
    if record.raised is None:
        return describe_exit(record.exitcode)
    if record.exitcode == 1:
        return f"raised {record.raised} (exit code 1)"
    return f"raised {record.raised}, then {describe_exit(record.exitcode)} while shutting down"


def failure_error(
    result: TorchrunResult, evidence: Mapping[int, RankEvidence], note: str = ""
) -> JobFailedError:
    """The error for a job that failed: the rank to blame first, how it ended and its own last traceback;
    ``note``, if any, is its last line."""
    failed = sorted((r for r in evidence.values() if r.failed), key=blame_order)
    end = f"\n{note}" if note else ""
    if not failed:
        tail = "\n".join(result.agent_output[-20:])
        return JobFailedError(
            f"torchrun itself failed (exit code {result.returncode}) before any rank "
            f"reported an error. Its last lines:\n{tail}{end}",
            result,
        )
    first, others = failed[0], sorted(failed[1:], key=lambda r: r.rank)
    head = f"rank {first.rank} {describe_failure(first)}"
    if others:
        head += f"; then {len(others)} other rank(s) stopped too: " + ", ".join(
            f"rank {r.rank} {describe_failure(r)}" for r in others
        )
    early = [r.rank for r in evidence.values() if r.exitcode == 0]
    if early:
        names = ", ".join(f"rank {r}" for r in early)
        head += (
            f".\nNote: {names} exited normally (code 0) while the others were still running; a rank "
            f"that leaves early (say, skipping a collective) makes its peers fail or hang"
        )
    tb = last_traceback(result.stderr[first.rank])
    body = "\n".join(tb) if tb else "(rank wrote nothing to stderr)"
    return JobFailedError(
        f"{head}.\n--- rank {first.rank} stderr (last traceback) ---\n{body}{end}",
        result,
        rank=first.rank,
        exitcode=first.exitcode,
    )


# ---- a hang: when, and whom to blame ---------------------------------------------------------------------


class Watch:
    """When a running job counts as hung: its wall-clock ``timeout`` passed since ``start``, or every rank has
    printed and then no rank printed anything for ``stall_timeout`` seconds. It is told the time, so a test
    can be its clock. For a ``%%ranks`` cell (``cell``) the caller counts a rank's reply as a line, and every
    rank as having printed from the cell's start."""

    def __init__(
        self, start: float, timeout: float | None, stall_timeout: float | None, *, cell: bool = False
    ):
        self.deadline = None if timeout is None else start + timeout
        self.timeout, self.stall_timeout, self.cell = timeout, stall_timeout, cell
        self.last_line = start

    def check(self, now: float, new_lines: bool, every_rank_printed: bool) -> Hang | None:
        """Call it after each look at the output: ``new_lines`` if a rank wrote a line since the last call."""
        if new_lines:
            self.last_line = now
        if self.deadline is not None and now > self.deadline:
            return Hang("timeout", self.timeout, self.cell)
        if (
            self.stall_timeout is not None
            and every_rank_printed
            and now - self.last_line > self.stall_timeout
        ):
            return Hang("stall", self.stall_timeout, self.cell)
        return None


@dataclass(frozen=True)
class Place:
    """Where a stack dump shows a rank: its main thread's frames (innermost first), the innermost frame in the
    script, and the torch.distributed call it waits in, if any."""

    frames: list[Frame]
    script_frame: Frame | None = None
    collective: str | None = None


def place(dump: str, script: str) -> Place:
    """Read a stack dump: the thread running ``script`` (else the first), where in the script, which call."""
    script = os.path.realpath(script)
    threads = [t for t in parse_stack_dump(dump) if t and not all(_OWN in f.path for f in t)]
    main = next((t for t in threads if any(os.path.realpath(f.path) == script for f in t)), None)
    if main is None:
        main = threads[0] if threads else []
    for i, f in enumerate(main):
        if os.path.realpath(f.path) == script:
            inner = main[:i]
            lib = [g for g in inner if _DIST in g.path or _NN_PARALLEL in g.path]
            if lib:
                c10d = [g for g in lib if g.path.endswith("distributed_c10d.py")]
                return Place(main, f, (c10d[0] if c10d else lib[0]).func)
            return Place(main, f, BACKWARD if any(_AUTOGRAD in g.path for g in inner) else None)
    return Place(main)


def _where(record: RankEvidence, script: str) -> Place | None:
    """The place of a rank whose process still ran and sent a dump; None for the others."""
    return place(record.stack, script) if record.alive and record.stack is not None else None


def describe_hung(record: RankEvidence, script: str) -> str:
    """One line on where a rank was when the job was caught hanging."""
    r = record.rank
    if record.idle == "finished":
        return f"rank {r} had finished the cell and waits for the next one"
    if record.idle == "left out":
        return f"rank {r} does not run this cell (--ranks left it out)"
    if not record.started:
        return f"rank {r} never started its script (still launching or importing)"
    if not record.alive:
        code = "unknown" if record.script_exit is None else record.script_exit
        return f"rank {r} had already exited (exit code {code}) while its peers waited for it"
    if record.script_exit is not None:
        return (
            f"rank {r} finished its script (exit code {record.script_exit}) but its process hangs "
            f"while shutting down (a collective in an atexit hook, a destructor, destroy_process_group)"
        )
    found = _where(record, script)
    if found is None:
        return f"rank {r}: no stack dump arrived (it may be stuck in C code holding the GIL)"
    where = found.script_frame.where() if found.script_frame else "an unknown place"
    if found.collective:
        return f"rank {r} waits in torch.distributed `{found.collective}` called at {where}"
    inner = found.frames[0].where() if found.frames else where
    return f"rank {r} is busy at {where} (innermost: {inner}), not in a collective"


def culprits(evidence: Sequence[RankEvidence], script: str) -> tuple[list[RankEvidence], str]:
    """Pick the ranks that caused a hang, and say why in one line. A rank not running a ``%%ranks`` cell
    (``idle``) is to blame only when a peer waits in a collective: it will never join it."""
    places = {r.rank: _where(r, script) for r in evidence}
    exited = [r for r in evidence if not r.alive or r.script_exit is not None]
    idle = [r for r in evidence if r.idle and r not in exited]
    rest = [r for r in evidence if r not in exited and r not in idle]
    if any(places[r.rank] is not None and places[r.rank].collective for r in rest):
        exited += idle
    busy = [r for r in rest if places[r.rank] is not None and not places[r.rank].collective]
    silent = [r for r in rest if places[r.rank] is None]
    if exited or busy:
        return exited + busy, "the stuck rank(s) never reached the collective their peers wait in"
    if silent:
        return silent, "no stack dump came back from these rank(s)"
    spots = {(p.collective, p.script_frame.where() if p.script_frame else None) for p in places.values() if p}
    if len(spots) > 1:
        return rest, "the ranks wait in different collectives or at different lines: a mismatch"
    ((call, _),) = spots
    if call in _POINT_TO_POINT:
        peer = _POINT_TO_POINT[call]
        return rest, (
            f"every rank waits in `{call}`, which returns only once its peer has called the matching "
            f"`{peer}`: ranks that all {call} first wait for each other (use isend and irecv, or let even "
            f"and odd ranks take turns)"
        )
    return rest, (
        "every rank waits in the same collective: look for a peer outside this job or a network problem"
    )


def hang_error(
    result: TorchrunResult, hang: Hang, evidence: Sequence[RankEvidence], script: str, note: str = ""
) -> JobHungError:
    """The error for a hung job: the rank(s) that caused it, from the stack dumps, and where the rest wait;
    ``note``, if any, is its last line."""
    stuck, why = culprits(evidence, script)
    lines = [f"{hang}; stuck: " + ", ".join(f"rank {r.rank}" for r in stuck) + f" ({why})."]
    lines += [f"  {describe_hung(r, script)}" for r in stuck]
    waiting = [r for r in evidence if r not in stuck]
    if waiting:
        lines.append("Waiting for them:")
        lines += [f"  {describe_hung(r, script)}" for r in waiting]
    # A culprit's dump first, but one running the script (or cell): an idle rank's shows only the rank REPL.
    dumped = sorted((r for r in stuck + waiting if r.alive and r.stack), key=lambda r: r.idle is not None)
    dumped = [r.rank for r in dumped]
    show = f": print(err.stacks[{dumped[0]}])" if dumped else ""
    lines.append(f"Every rank was killed. The stack dumps are on the error{show}; the logs on err.result.")
    if note:
        lines.append(note)
    stacks = {r.rank: r.stack or "" for r in evidence if r.alive}
    return JobHungError(
        "\n".join(lines), result, hang=hang, stuck_ranks=[r.rank for r in stuck], stacks=stacks
    )


# ---- reading what the ranks wrote ------------------------------------------------------------------------


def parse_stack_dump(text: str) -> list[list[Frame]]:
    """Split a faulthandler dump into threads, each a list of frames, innermost first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(Frame(m["path"], int(m["line"]), m["func"]))
    return threads


def signal_name(exitcode: int | None) -> str | None:
    """'SIGKILL' for -9, None for a normal exit code."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes an uncaught traceback's lines with it
_WRAPPER_FRAME = re.compile(r'^\s+File "(<frozen runpy>|.*ddp_helpers[/\\]_worker\.py)"')
_LIBRARY_FRAME = re.compile(r'^\s+File ".*[/\\](torch|torchvision)[/\\]')  # inside torch or torchvision


def last_traceback(lines: list[str], max_lines: int = 20) -> list[str]:
    """The last traceback in a rank's stderr, trimmed to the script's frames, in about ``max_lines``.

    The launcher's own frames go; a run of frames inside torch becomes one line, except the innermost frame,
    which says where the error was raised."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return lines[-10:]
    block = lines[starts[-1] :]
    # Frames are indented; the first line that is not is the exception itself ("ValueError: ...").
    end = next((i + 1 for i, line in enumerate(block[1:], 1) if line and not line[0].isspace()), len(block))
    frames: list[list[str]] = []  # each: its 'File ...' line, then its source and caret lines
    for line in block[1 : end - 1]:
        if line.startswith("  File ") or not frames:
            frames.append([line])
        else:
            frames[-1].append(line)
    frames = [f for f in frames if not _WRAPPER_FRAME.match(f[0])]
    kept, hidden = [block[0]], 0
    for i, frame in enumerate(frames):
        if _LIBRARY_FRAME.match(frame[0]) and i < len(frames) - 1:
            hidden += 1
            continue
        if hidden:
            kept.append(f"  ... ({hidden} frame{'s' if hidden > 1 else ''} inside torch)")
            hidden = 0
        kept += frame
    kept += block[end - 1 : end] if end > 1 else []
    if len(kept) > max_lines:
        cut = len(kept) - max_lines + 1
        kept = [kept[0], f"  ... ({cut} lines cut; the whole log is on the error's .result)"] + kept[
            -(max_lines - 2) :
        ]
    return kept
