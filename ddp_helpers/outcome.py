"""What a launch returns or raises: ``TorchrunResult``, and ``TorchrunError`` with its two kinds.

``JobFailedError``: a rank failed (``.rank`` names the one to blame, ``.exitcode`` how it ended), or torchrun
itself did before any rank reported an error (``.rank`` is None). ``JobHungError``: the job was stopped
because it hung; ``.hang`` says how it was caught (``Hang``: a timeout, a stall, or a ``%%ranks`` cell that
some rank did not stop when interrupted, with its seconds), ``.stuck_ranks`` whom to blame and ``.stacks``
where every rank was. ``except TorchrunError`` catches both. A live rank group (``ranks``) raises them too
when it ends; ``CellError`` is what a ``%%ranks`` cell raises when its code fails on some ranks while the
group runs on. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class TorchrunResult:
    """What a torchrun job left: exit codes and every rank's output lines, by global rank."""

    command: str  # the equivalent plain torchrun command, to run outside the notebook
    returncode: int
    duration: float
    stdout: dict[int, list[str]]
    stderr: dict[int, list[str]]
    exitcodes: dict[int, int | None]
    agent_output: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.stdout)

    def records(self, rank: int | None = None) -> list[dict]:
        """The JSON objects the ranks printed, one per line; all ranks in rank order, or one rank's.

        After an elastic restart (``torchrun_args=["--max-restarts=N"]``) a rank's lines hold every
        attempt in order, so records of the first attempt come before those of the restarted one.
        """
        if rank is not None and rank not in self.stdout:
            raise KeyError(f"no rank {rank} in this job; ranks are {sorted(self.stdout)}")
        found = []
        for r in sorted(self.stdout) if rank is None else [rank]:
            for line in self.stdout[r]:
                text = line.strip()
                if not (text.startswith("{") and text.endswith("}")):
                    continue
                try:
                    obj = json.loads(text)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    found.append(obj)
        return found


@dataclass(frozen=True)
class Hang:
    """How a job was caught hanging: its wall-clock ``timeout=`` passed, or it stalled (every rank had
    printed, then none printed anything for ``stall_timeout=`` seconds); in a ``%%ranks`` cell (``cell``) a
    stall counts from the cell's start and its replies too, and ``interrupt`` means some rank had not stopped
    the cell ``seconds`` after the interrupt reached it."""

    kind: Literal["timeout", "stall", "interrupt"]
    seconds: float
    cell: bool = False

    def __str__(self) -> str:
        if self.kind == "timeout":
            return f"timed out after {self.seconds:g} s"
        if self.kind == "interrupt":
            return f"interrupted, and not every rank had stopped the cell {self.seconds:g} s later"
        if self.cell:
            return f"stalled: no rank printed a line or finished the cell for {self.seconds:g} s"
        return f"stalled: every rank had printed, then none printed anything for {self.seconds:g} s"


class TorchrunError(RuntimeError):
    """A torchrun job failed or hung; the message says which rank and why, the logs stay on ``.result``."""

    rank: int | None = None  # the rank to blame for a failure
    exitcode: int | None = None  # how that rank ended
    hang: Hang | None = None  # how a hang was caught

    def __init__(self, message: str, result: TorchrunResult):
        super().__init__(message)
        self.result = result
        self.stuck_ranks: list[int] = []
        self.stacks: dict[int, str] = {}

    @property
    def hung(self) -> bool:
        """True when the launcher stopped the job as hung, by ``timeout=`` or ``stall_timeout=``."""
        return self.hang is not None

    @property
    def timed_out(self) -> bool:
        """True when the job ran past ``timeout=``; a stall (``stall_timeout=``) is ``.hung`` but not this."""
        return self.hang is not None and self.hang.kind == "timeout"


class JobFailedError(TorchrunError):
    """A rank failed (``.rank``, ``.exitcode``), or torchrun did before any rank reported (``.rank`` None)."""

    def __init__(
        self, message: str, result: TorchrunResult, *, rank: int | None = None, exitcode: int | None = None
    ):
        super().__init__(message, result)
        self.rank, self.exitcode = rank, exitcode


class JobHungError(TorchrunError):
    """The job hung and was stopped: ``.hang`` (timeout or stall), ``.stuck_ranks``, ``.stacks`` by rank."""

    def __init__(
        self,
        message: str,
        result: TorchrunResult,
        *,
        hang: Hang,
        stuck_ranks: Sequence[int],
        stacks: Mapping[int, str],
    ):
        super().__init__(message, result)
        self.hang = hang
        self.stuck_ranks = list(stuck_ranks)
        self.stacks = dict(stacks)


class CellError(RuntimeError):
    """A ``%%ranks`` cell failed on some ranks: it raised there, or its value could not come back. The
    group still runs. ``.errors``: each such rank's traceback (or why its value could not come back), also
    shown above the error; ``.values``: what the other ranks returned; ``.rank``: the first failed rank."""

    def __init__(self, message: str, *, errors: Mapping[int, str], values: Mapping[int, object]):
        super().__init__(message)
        self.errors = dict(errors)
        self.values = dict(values)
        self.rank = min(self.errors)

    def _render_traceback_(self) -> list[str]:
        """How IPython shows it: the message only; each rank's own traceback is already in the cell."""
        return [f"{type(self).__name__}: {self}"]
