"""A rank group: N ranks under real torchrun, kept alive across notebook cells, each running the cells sent.

``RankGroup`` starts its ranks as ``torchrun()`` starts a job, with the launcher's own parts
(``LaunchOptions``: every option checked; ``plan_launch``: the backend, the warm agent; ``Launch``: the run
folder, the lifeline, the agents, each rank's files), and keeps the launch open; the script is the rank REPL
(``_repl``). A cell goes to the chosen ranks over the run folder's socket (``_protocol``); while they run it
their lines are shown live, as a launch shows them (``_run_folder.follow``), and ``diagnose.Watch`` decides
when the cell hangs. A hang or a dead rank ends the group with the launcher's diagnosis; an exception in the
cell does not (``CellError``). The ``%ranks`` magics are ``magics``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import reprlib
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ddp_helpers import _protocol as protocol
from ddp_helpers import _repl, _strict, diagnose, launcher
from ddp_helpers._run_folder import POLL_INTERVAL, Progress, flush_output, follow
from ddp_helpers.outcome import CellError, Hang, JobFailedError

__all__ = ["GROUP_DEFAULT", "RankGroup"]

_REPL = os.path.abspath(_repl.__file__)
STOP_WAIT = 10.0  # after %ranks stop, how long the ranks get to leave before being killed
GROUP_DEFAULT = object()  # a cell's limit left to its group's (``RankGroup(timeout=, stall_timeout=)``)


@dataclass
class _Connection:
    """One rank's end of the cells socket, with what it said when it was ready."""

    sock: socket.socket
    reader: protocol.MessageReader
    pid: int
    device: str


class _SafeInterrupt:
    """SIGINT's handler while a cell runs: an interrupt takes effect in the wait for the ranks' next message
    (``waiting()``), never halfway through reading one, where a lost or doubled message would derail the
    group; one that comes elsewhere waits for the next wait, or for the end of the cell."""

    def __init__(self):
        self.previous = None
        self.pending: tuple[int, object] | None = None
        self.safe = False

    def __enter__(self) -> _SafeInterrupt:
        if threading.current_thread() is threading.main_thread():  # only the main thread gets signals
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # a handler that raises KeyboardInterrupt (not SIG_IGN or SIG_DFL)
                self.previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            if exc_type is None:  # one that came after the last wait: the cell has finished meanwhile
                self._deliver()

    def _handle(self, signum: int, frame: object) -> None:
        self.pending = (signum, frame)
        if self.safe:
            self._deliver()

    def _deliver(self) -> None:
        if self.pending is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)  # raises KeyboardInterrupt, as the kernel's own handler does

    @contextlib.contextmanager
    def waiting(self):
        """Around the wait for the next message: an interrupt that came before, or comes now, raises here."""
        self.safe = True
        try:
            self._deliver()
            yield
        finally:
            self.safe = False


class RankGroup:
    """N ranks in one initialised process group, started by torchrun and kept alive to run cells (``run``)
    until ``stop``, a hang, a dead rank or the kernel's end. Usable as a context manager."""

    def __init__(
        self,
        nproc_per_node: int = 2,
        *,
        nnodes: int = 1,
        timeout: float | None = launcher.LAUNCH_TIMEOUT,
        stall_timeout: float | None = None,
        env: Mapping[str, object] | None = None,
        cwd: str | os.PathLike | None = None,
        backend: str | None = None,
        grace: float = launcher.TERM_GRACE,
        warm: bool = True,
        restart: str = "RankGroup(...)",
    ):
        """Start the ranks and wait until each has joined the process group. The arguments are those of
        ``torchrun()``; ``timeout`` and ``stall_timeout`` are each cell's defaults too; ``restart`` says what
        starts a group again."""
        options = launcher.LaunchOptions(
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            timeout=timeout,
            stall_timeout=stall_timeout,
            env=env,
            cwd=cwd,
            backend=backend,
            grace=grace,
            warm=warm,
        )
        self._start(launcher.plan_launch(_REPL, (), options), restart)

    @classmethod
    def from_options(cls, options: launcher.LaunchOptions, restart: str = "RankGroup(...)") -> RankGroup:
        """A group started from options built already (``%ranks start``), as ``RankGroup(...)`` starts one."""
        __tracebackhide__ = True
        group = cls.__new__(cls)
        group._start(launcher.plan_launch(_REPL, (), options), restart)
        return group

    def _start(self, job: launcher.LaunchPlan, restart: str) -> None:
        __tracebackhide__ = True
        self.job = job
        self.options = job.options
        self.restart = restart
        self.cells = 0  # cells sent so far; cell n is compiled as _repl.cell_filename(n)
        # Whether the last cell sent ends with an expression (``%%ranks`` then shows the values).
        self.cell_has_value = False
        self.closed = False
        self.conns: dict[int, _Connection] = {}
        self._interrupt_point = _SafeInterrupt()  # where a cell's interrupt may land (``run``)
        self._stack = contextlib.ExitStack()  # what leaving the group undoes, last in first out
        try:
            self.launch = self._stack.enter_context(launcher.Launch(self.job))
            listener = self._stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            self._stack.callback(self._close_connections)
            listener.bind(protocol.cells_socket(self.launch.run_dir))
            listener.listen(self.world_size)
            self.backend = self._wait_ready(listener)
        except BaseException as e:
            self._close(e)
            raise
        self.devices = {r: c.device for r, c in sorted(self.conns.items())}

    @property
    def world_size(self) -> int:
        return self.options.world_size

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- starting ---------------------------------------------------------------------------------------

    def _wait_ready(self, listener: socket.socket) -> str:
        """Accept each rank's connection and its ready message, showing the ranks' lines meanwhile, and return
        the backend; a rank that fails or a start that hangs ends the launch with the launcher's diagnosis."""
        __tracebackhide__ = True
        unknown: dict[socket.socket, protocol.MessageReader] = {}  # connected, not ready yet
        backends: set[str] = set()

        def look() -> Progress:
            __tracebackhide__ = True
            readable, _, _ = select.select([listener, *unknown], [], [], POLL_INTERVAL)
            for sock in readable:
                self._greet(sock, listener, unknown, backends)
            new_lines = self.launch.poll()
            if not self.launch.agents_running():
                for sock in unknown:
                    sock.close()
                self._ended(None, note="")
            everyone = all(r.printed for r in self.launch.ranks)
            return Progress(new_lines, len(self.conns) == self.world_size, everyone)

        watch = diagnose.Watch(self.launch.start, self.options.timeout, self.options.stall_timeout)
        hang = follow(look, watch, pause=0)
        if hang is not None:
            for sock in unknown:
                sock.close()
            self._hung(hang, self.job.script_path, idle={}, note="")
        (backend,) = backends  # every rank chose as environment.choose_backend does, under one environment
        return backend

    def _greet(
        self,
        sock: socket.socket,
        listener: socket.socket,
        unknown: dict[socket.socket, protocol.MessageReader],
        backends: set[str],
    ) -> None:
        """A new connection on ``listener``, or what one that is not ready yet sent: once its ready message
        is in, the rank's connection."""
        if sock is listener:
            conn, _ = listener.accept()
            unknown[conn] = protocol.MessageReader()
            return
        try:
            unknown[sock].receive(sock)
        except (EOFError, OSError):
            del unknown[sock]
            sock.close()
            return
        if unknown[sock].messages:
            hello = unknown[sock].messages.pop(0)
            backends.add(hello["backend"])
            self.conns[hello["ready"]] = _Connection(sock, unknown.pop(sock), hello["pid"], hello["device"])

    # ---- running a cell -----------------------------------------------------------------------------------

    def run(
        self,
        code: str,
        ranks: Iterable[int] | None = None,
        *,
        timeout: float | None | object = GROUP_DEFAULT,
        stall_timeout: float | None | object = GROUP_DEFAULT,
        max_bytes: int = _repl.VALUE_LIMIT,
    ) -> dict[int, object]:
        """Run ``code`` on every rank (or on ``ranks``) and return ``{rank: value of its last expression}``.

        Each rank's lines are shown live as ``[rank N] ...``. The code raising on some ranks raises
        ``CellError`` once every chosen rank has answered (the group runs on); a cell that hangs past
        ``timeout`` or ``stall_timeout`` (default: the group's) raises ``JobHungError`` and a rank that dies
        ``JobFailedError``, both after ending the group. A KeyboardInterrupt interrupts the cell on the ranks;
        a rank that has not stopped ``grace`` seconds later (blocked in a collective) is treated as a hang."""
        __tracebackhide__ = True
        self._check_open()
        chosen = _check_ranks(ranks, self.world_size)
        timeout = launcher.check_seconds(
            "timeout", self.options.timeout if timeout is GROUP_DEFAULT else timeout
        )
        stall = self.options.stall_timeout if stall_timeout is GROUP_DEFAULT else stall_timeout
        stall = launcher.check_seconds("stall_timeout", stall)
        max_bytes = _check_limit(max_bytes)
        self.cells += 1
        filename = _repl.cell_filename(self.cells)
        # Compiled here only to check it: a SyntaxError stops here, before any rank sees the cell.
        self.cell_has_value = _repl.split_cell(code, filename).last is not None
        for rank in self.launch.ranks:
            rank.show(True)  # to where this cell's output goes
        message = {"cell": self.cells, "code": code, "filename": filename, "max_bytes": max_bytes}
        replies: dict[int, dict] = {}
        self._interrupt_point = _SafeInterrupt()
        with self._interrupt_point:
            return self._run(chosen, message, replies, filename, timeout, stall)

    def _run(
        self,
        chosen: list[int],
        message: dict,
        replies: dict[int, dict],
        filename: str,
        timeout: float | None,
        stall: float | None,
    ) -> dict[int, object]:
        __tracebackhide__ = True
        try:
            for r in chosen:
                self._send(r, message)
            watch = diagnose.Watch(time.monotonic(), timeout, stall, cell=True)
            try:
                hang = self._replies(chosen, replies, watch)
            except KeyboardInterrupt:
                if self.closed:
                    raise
                hang = self._interrupt(chosen, replies)
                if hang is None:
                    self._interrupted(chosen, replies)
                    raise
            if hang is not None:
                idle = {r: "left out" for r in range(self.world_size) if r not in chosen}
                idle.update({r: "finished" for r in replies})
                self._hung(hang, filename, idle, note=self._gone())
        except BaseException as e:
            if len(replies) < len(chosen) and not self.closed:  # a rank may still run the cell: end the group
                self._close(e)
            raise
        return self._values(chosen, replies)

    def _send(self, rank: int, message: dict) -> None:
        try:
            self.conns[rank].sock.sendall(protocol.pack_message(message))
        except OSError:  # its process is gone
            self._ended(rank)

    def _replies(self, chosen: list[int], replies: dict[int, dict], watch: diagnose.Watch) -> Hang | None:
        """Show the ranks' lines and collect each chosen rank's reply; the ``Hang`` if ``watch`` calls it hung
        first, else None once every reply is in (and every line written before it shown)."""
        __tracebackhide__ = True
        pending = {self.conns[r].sock: r for r in chosen if r not in replies}

        def look() -> Progress:
            __tracebackhide__ = True
            with self._interrupt_point.waiting():
                readable, _, _ = select.select(list(pending), [], [], POLL_INTERVAL)
            replied = False
            for sock in readable:
                rank = pending[sock]
                if self._receive(rank, replies):
                    del pending[sock]
                    replied = True
            new_lines = self.launch.poll()
            if not self.launch.agents_running():
                self._ended(None)
            return Progress(new_lines or replied, done=not pending)

        hang = follow(look, watch, pause=0) if pending else None
        if hang is not None:
            return hang
        self.launch.poll()  # a rank flushes before it replies: its last lines are in its files now
        for rank in self.launch.ranks:
            rank.stdout.end_line()
            rank.stderr.end_line()
        flush_output()
        return None

    def _receive(self, rank: int, replies: dict[int, dict]) -> bool:
        """Read what ``rank`` sent; True once its reply to this cell is in ``replies``."""
        conn = self.conns[rank]
        try:
            conn.reader.receive(conn.sock)
        except (EOFError, OSError):
            self._ended(rank)
        if not conn.reader.messages:
            return False
        reply = conn.reader.messages.pop(0)
        if reply.get("cell") != self.cells:
            raise RuntimeError(f"rank {rank} answered cell {reply.get('cell')}, not {self.cells}")
        replies[rank] = reply
        return True

    def _interrupt(self, chosen: list[int], replies: dict[int, dict]) -> Hang | None:
        """Interrupt the ranks still running the cell, and wait ``grace`` seconds for their replies (a second
        interrupt waits no longer); the ``Hang`` if some rank has not stopped by then."""
        __tracebackhide__ = True
        for r in chosen:
            if r not in replies:
                try:
                    os.kill(self.conns[r].pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        grace = self.options.grace
        try:
            if self._replies(chosen, replies, diagnose.Watch(time.monotonic(), grace, None)) is None:
                return None
        except KeyboardInterrupt:
            pass
        return Hang("interrupt", grace, cell=True)

    def _interrupted(self, chosen: list[int], replies: dict[int, dict]) -> None:
        """Show where each rank stopped, and one line saying the group still runs."""
        self._show(replies)
        stopped = ", ".join(str(r) for r in chosen if replies[r].get("interrupted"))
        finished = ", ".join(str(r) for r in chosen if not replies[r].get("interrupted"))
        also = f" (rank(s) {finished} had finished it)" if finished else ""
        print(
            f"ddp_helpers: interrupted; rank(s) {stopped} stopped the cell{also}; the group still runs",
            file=sys.stderr,
            flush=True,
        )

    def _values(self, chosen: list[int], replies: dict[int, dict]) -> dict[int, object]:
        """The ranks' values; ``CellError`` if some rank failed, after showing its traceback."""
        __tracebackhide__ = True
        values, errors, summaries = {}, {}, {}
        for r in chosen:
            reply = replies[r]
            if "error" in reply:
                errors[r], summaries[r] = reply["error"], reply["summary"]
                continue
            try:
                values[r] = _repl.unpack_value(base64.b64decode(reply["value"]))
            except Exception as e:  # pickle.loads runs the value's own code: any error can come out of it
                summaries[r] = f"sent a {reply['type']} that cannot be rebuilt in the kernel"
                errors[r] = (
                    f"its value, a {reply['type']}, came back but cannot be rebuilt in the kernel "
                    f"({type(e).__name__}: {e}): a class or function defined in a %%ranks cell exists only "
                    f"on the ranks; return plain data instead (numbers, strings, lists, dicts, tensors)\n"
                )
        if not errors:
            return values
        self._show(replies, errors)
        failed = "; ".join(f"rank {r} {summaries[r]}" for r in sorted(errors))
        finished = "; ".join(f"rank {r} returned {reprlib.repr(v)}" for r, v in values.items())
        rest = f" Meanwhile {finished} (err.values)." if values else ""
        message = f"{failed} (shown above; err.errors).{rest} The group still runs."
        raise CellError(message, errors=errors, values=values)

    def _show(self, replies: dict[int, dict], errors: Mapping[int, str] | None = None) -> None:
        """Print each rank's traceback (an error or an interrupt) as its own lines: ``[rank N] ...``."""
        texts = errors if errors is not None else {r: m["error"] for r, m in replies.items() if "error" in m}
        for r in sorted(texts):
            text = texts[r].rstrip("\n")
            if text:
                sys.stderr.write("".join(f"[rank {r}] {line}\n" for line in text.split("\n")))
        flush_output()

    # ---- the end of a group -------------------------------------------------------------------------------

    def _hung(self, hang: Hang, script: str, idle: Mapping[int, str], note: str) -> None:
        """End the group as hung: each rank's stack dumped and placed, all stopped; ``JobHungError``."""
        __tracebackhide__ = True
        try:
            evidence = [dataclasses.replace(e, idle=idle.get(e.rank)) for e in self.launch.hung_ranks()]
            self.launch.stop()
            result, _ = self.launch.collect()
        finally:
            self._close()
        _strict.raise_checked(
            diagnose.hang_error(result, hang, evidence, script, note=note), self.job.gloo_pinned
        )

    def _ended(self, rank: int | None, note: str | None = None) -> None:
        """End a group whose rank died (``rank``, if its connection said so first): torchrun stops the others,
        or they are stopped after a grace period; ``JobFailedError`` with the launcher's diagnosis."""
        __tracebackhide__ = True
        try:
            self.launch.wait_for_agents(launcher.NODE_FAILURE_GRACE)
            self.launch.stop()
            result, evidence = self.launch.collect()
        finally:
            self._close()
        note = self._gone() if note is None else note
        if any(e.failed for e in evidence.values()) or rank is None:
            _strict.raise_checked(diagnose.failure_error(result, evidence, note=note), self.job.gloo_pinned)
        exitcode = evidence[rank].exitcode
        how = diagnose.describe_exit(exitcode) if exitcode is not None else "ended"
        left = JobFailedError(
            f"rank {rank} left the group: its process {how} while the others ran on, so they were "
            f"stopped.\n{note}",
            result,
            rank=rank,
            exitcode=exitcode,
        )
        _strict.raise_checked(left, self.job.gloo_pinned)

    def _gone(self) -> str:
        return f"The group is gone: {self.restart} starts a new one."

    def stop(self) -> None:
        """End the ranks: each leaves the process group and exits; what still runs after a while is killed."""
        if self.closed:
            return
        try:
            self._close_connections()  # each rank reads end of file, leaves the process group and exits
            self.launch.wait_for_agents(STOP_WAIT)
        finally:
            self._close()

    def _close(self, error: BaseException | None = None) -> None:
        """Close the connections and leave the launch: every process stopped and reaped, the folder removed
        (and, leaving on an ``error`` that is an interrupt, one line saying so)."""
        self.closed = True
        if error is None:
            self._stack.close()
        else:
            self._stack.__exit__(type(error), error, error.__traceback__)

    def _close_connections(self) -> None:
        for conn in self.conns.values():
            conn.sock.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this group of ranks has ended: {self.restart} starts a new one")


def _check_ranks(ranks: Iterable[int] | None, world_size: int) -> list[int]:
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a list of ranks such as [0, 1], not {ranks!r}")
    chosen = sorted(set(ranks))
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if bad or not chosen:
        raise ValueError(
            f"ranks {chosen!r}: name at least one of this group's ranks, 0..{world_size - 1}"
            + (f" ({bad!r} is not one)" if bad else "")
        )
    return chosen


def _check_limit(max_bytes: object) -> int:
    if (
        isinstance(max_bytes, bool)
        or not isinstance(max_bytes, int)
        or not 0 < max_bytes <= _repl.MAX_VALUE_LIMIT
    ):
        raise ValueError(
            f"max_bytes must be a whole number of bytes from 1 to {_repl.MAX_VALUE_LIMIT:,} "
            f"(default {_repl.VALUE_LIMIT:,}), not {max_bytes!r}; save bigger values to files (torch.save)"
        )
    return max_bytes
