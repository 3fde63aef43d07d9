"""What follows a run folder while its job runs: each rank's files (``RankFiles``), read line by line as they
grow (``LineFollower``), the stack dumps of a hang (``dump_stacks``), torch's failure records
(``read_failure_records``), and the one loop that follows a running job until it is done or hung (``follow``).

``torchrun()`` (``launcher``), ``RankGroup`` (``ranks``) and ``sbatch()`` (``slurm``) all follow their ranks
with these parts. The files' names and formats are ``_protocol``'s; whom to blame is ``diagnose``'s.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

from ddp_helpers import _protocol as protocol
from ddp_helpers import diagnose
from ddp_helpers._procs import is_alive
from ddp_helpers.outcome import Hang

POLL_INTERVAL = 0.05  # how often output files and processes are checked: short enough to feel live
# A stack dump is written by faulthandler's C handler the moment the signal arrives; a rank that has not
# answered after this long (stopped, or stuck in the kernel) is reported as silent.
DUMP_WAIT = 30.0
DUMP_SETTLE = 0.3  # a rank's dump counts as complete once its stderr has had no new line for this long


class LineFollower:
    """Follows one file as it grows and turns what arrives into whole lines, echoed to ``out``."""

    def __init__(self, path: str, prefix: str = "", out: TextIO | None = None):
        self.path, self.prefix, self.out = path, prefix, out
        self.lines: list[str] = []
        self._partial, self._file, self._done = b"", None, False

    def poll(self) -> list[str]:
        """The lines completed since the last call."""
        if self._file is None:
            if self._done:
                return []
            try:
                self._file = open(self.path, "rb")
            except FileNotFoundError:
                return []
        data = self._file.read()
        if not data:
            return []
        *complete, self._partial = (self._partial + data).split(b"\n")
        return self._emit(complete)

    def finish(self) -> list[str]:
        """The last lines, a final one without its newline included; the file is closed after."""
        new = self.end_line()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._done = True
        return new

    def mute(self) -> None:
        """Keep the lines that arrive from now on, without echoing them."""
        self.out = None

    def end_line(self) -> list[str]:
        """A last line that has no newline yet, as a line of its own (a cell's output ends there)."""
        new = self.poll()
        if self._partial:
            new += self._emit([self._partial])
            self._partial = b""
        return new

    def _emit(self, raw: list[bytes]) -> list[str]:
        new = [b.decode("utf-8", errors="replace").removesuffix("\r") for b in raw]
        self.lines.extend(new)
        if self.out is not None and new:
            self.out.write("".join(f"{self.prefix}{line}\n" for line in new))
        return new


class RankFiles:
    """One rank's three files in the run folder, each read once as it grows: stdout and stderr (kept whole,
    shown live as ``[rank N] ...``) and the worker wrapper's status file, parsed into events line by line."""

    def __init__(self, run_dir: str, rank: int, live: bool):
        self.rank = rank
        prefix = f"[rank {rank}] "
        self.stdout = LineFollower(protocol.rank_file(run_dir, rank, "stdout"), prefix)
        self.stderr = LineFollower(protocol.rank_file(run_dir, rank, "stderr"), prefix)
        self.show(live)
        self._status = LineFollower(protocol.rank_file(run_dir, rank, "status"))
        self.events: list[dict] = []  # the status file's events so far (_protocol: start, exception, exit)

    def show(self, live: bool) -> None:
        """Echo the lines that arrive from now on to this moment's sys.stdout and sys.stderr, or (not
        ``live``) only keep them. A rank group calls it at each cell: a cell's output may have moved."""
        self.stdout.out = sys.stdout if live else None
        self.stderr.out = sys.stderr if live else None

    def poll(self) -> bool:
        """Read what arrived; True if the rank wrote a new line of output."""
        self._parse(self._status.poll())
        out, err = self.stdout.poll(), self.stderr.poll()
        return bool(out or err)

    def finish(self) -> None:
        self._parse(self._status.finish())
        self.stdout.finish()
        self.stderr.finish()

    @property
    def printed(self) -> bool:
        return bool(self.stdout.lines or self.stderr.lines)

    def pid(self) -> int | None:
        """The process of the rank's last attempt; None if none has started."""
        starts = [e for e in self.events if e["event"] == "start"]
        return starts[-1]["pid"] if starts else None

    def pgids(self) -> set[int]:
        """The process group of every attempt so far; a rank's own children (DataLoader workers) are in it."""
        self._parse(self._status.poll())
        return {e["pgid"] for e in self.events if e["event"] == "start"}

    def evidence(self, **found: object) -> diagnose.RankEvidence:
        """What the status file says of the rank's last attempt, with what was ``found`` besides."""
        return diagnose.rank_evidence(self.rank, self.events, **found)

    def _parse(self, lines: list[str]) -> None:
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:  # a line cut short: its process was killed while writing it
                continue
            if isinstance(event, dict) and "event" in event:
                self.events.append(event)


def dump_stacks(ranks: Sequence[RankFiles], poll: Callable[[], bool]) -> dict[int, str]:
    """Signal every rank whose process is alive to dump its stacks, and collect what arrives, by rank (an
    empty text where nothing came back). ``poll`` reads the ranks' new lines, True if there were any."""
    marks = {}  # rank -> how many stderr lines it had before the signal
    for rank in ranks:
        pid = rank.pid()
        # Also a rank whose script ended but whose process hangs on.
        if pid is not None and is_alive(pid):
            marks[rank.rank] = len(rank.stderr.lines)
            try:
                os.kill(pid, protocol.STACK_SIGNAL)
            except ProcessLookupError:
                marks.pop(rank.rank)
    stop = time.monotonic() + DUMP_WAIT
    quiet_since = time.monotonic()
    while marks and time.monotonic() < stop:
        time.sleep(0.1)
        if poll():
            quiet_since = time.monotonic()
        started = all(
            any("most recent call first" in line for line in ranks[r].stderr.lines[m:])
            for r, m in marks.items()
        )
        if started and time.monotonic() - quiet_since > DUMP_SETTLE:
            break
    return {r: "\n".join(ranks[r].stderr.lines[m:]) for r, m in marks.items()}


def read_failure_records(run_dir: str, count: int) -> dict[int, dict]:
    """Torch's failure records that the first ``count`` agents wrote into the run folder, by global rank."""
    failures: dict[int, dict] = {}
    for i in range(count):
        try:
            with open(protocol.agent_file(run_dir, i, "failures"), encoding="utf-8") as f:
                failures.update({int(k): v for k, v in json.load(f).items()})
        except (FileNotFoundError, ValueError):
            pass
    return failures


def flush_output() -> None:
    """Flush this process's sys.stdout and sys.stderr: the ranks' lines reach the cell now."""
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (OSError, ValueError):
            pass


# ---- following a running job ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """What one look at a running job found."""

    new_lines: bool  # a rank wrote a line (or, for a cell, replied) since the last look
    done: bool = False  # nothing more to wait for: the job ended, or every reply is in
    every_rank_printed: bool = True  # (for a stall) every rank has printed at least one line


class HangCheck(Protocol):
    """What calls a running job hung: ``diagnose.Watch``, or anything that asks one."""

    def check(self, now: float, new_lines: bool, every_rank_printed: bool) -> Hang | None: ...


def follow(look: Callable[[], Progress], watch: HangCheck, pause: float = POLL_INTERVAL) -> Hang | None:
    """Look at a running job until ``look`` finds it done (None) or ``watch`` calls it hung (the ``Hang``),
    ``pause`` seconds apart (0 where ``look`` itself waits, in a ``select``). ``look`` may raise to end it."""
    while True:
        progress = look()
        if progress.done:
            return None
        hang = watch.check(time.monotonic(), progress.new_lines, progress.every_rank_printed)
        if hang is not None:
            return hang
        if pause:
            time.sleep(pause)
