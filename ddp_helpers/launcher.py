"""``torchrun(...)``: run a script under real torchrun from a notebook cell, stream every rank, raise on failure."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ddp_helpers import _protocol as protocol
from ddp_helpers import _warm, diagnose

DEFAULT_TIMEOUT = 600.0  # wall-clock limit of a job unless the caller gives one (None: no limit)
POLL_INTERVAL = 0.05  # how often output files and processes are checked: short enough to feel live
TERM_GRACE = 3.0  # after SIGTERM, seconds torchrun and the ranks get to flush logs and exit before SIGKILL
# When one simulated node's agent fails, the other agents normally notice through the rendezvous and exit
# within a second or two; this is the most they get before being stopped (they are then reported as killed).
NODE_FAILURE_GRACE = 10.0
# A stack dump is written by faulthandler's C handler the moment the signal arrives; a rank that has not
# answered after this long (stopped, or stuck in the kernel) is reported as silent.
DUMP_WAIT = 30.0
DUMP_SETTLE = 0.3  # a rank's dump counts as complete once its stderr has had no new line for this long
REAP_WAIT = 5.0  # after SIGKILL, how long to wait for an agent process to be reaped
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        ranks = sorted(self.stdout) if rank is None else [rank]
        if rank is not None and rank not in self.stdout:
            raise KeyError(f"no rank {rank} in this job; ranks are {sorted(self.stdout)}")
        found = []
        for r in ranks:
            for line in self.stdout[r]:
                text = line.strip()
                if text.startswith("{") and text.endswith("}"):
                    try:
                        obj = json.loads(text)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        found.append(obj)
        return found


class TorchrunError(RuntimeError):
    """A torchrun job failed or timed out; the message says which rank and why, the logs stay on ``.result``."""

    def __init__(self, message: str, result: TorchrunResult, *, rank: int | None = None,
                 exitcode: int | None = None, timed_out: bool = False,
                 stuck_ranks: Sequence[int] = (), stacks: Mapping[int, str] | None = None):
        super().__init__(message)
        self.result = result
        self.rank = rank
        self.exitcode = exitcode
        self.timed_out = timed_out
        self.stuck_ranks = list(stuck_ranks)
        self.stacks = dict(stacks or {})


def torchrun(script: str | os.PathLike, *args: object, nproc_per_node: int = 1, nnodes: int = 1,
             timeout: float | None = DEFAULT_TIMEOUT, stall_timeout: float | None = None,
             env: Mapping[str, object] | None = None, cwd: str | os.PathLike | None = None,
             live: bool | Iterable[int] = True, backend: str | None = None, torchrun_args: Sequence[str] = (),
             show_agent: bool = False, grace: float = TERM_GRACE, warm: bool = True) -> TorchrunResult:
    """Run ``script`` under real torchrun, stream each rank's lines live, and raise ``TorchrunError`` on failure.

    - ``script``: path of the script, relative to ``cwd``; it runs unchanged as ``__main__`` in every rank.
    - ``*args``: the script's own arguments (converted with ``str``).
    - ``nproc_per_node``: ranks per node. ``nnodes``: K > 1 simulates K nodes on this machine
      (K torchrun agents meeting through c10d rendezvous on 127.0.0.1, as on a cluster).
    - ``timeout``: wall-clock limit in seconds from the launch (None: no limit). When it passes, every
      rank's stack is dumped, every process is killed, and the error names the rank(s) that were stuck.
    - ``stall_timeout``: treat the job the same way once **every** rank has printed at least one line and
      then no rank has printed anything for this many seconds. It counts from the ranks' own progress, not
      from the launch, so a slow start on a busy machine does not trip it: made for demonstrating hangs.
    - ``env``: extra environment variables for torchrun and the ranks (values converted with ``str``).
    - ``cwd``: the folder to run in (default: the current one).
    - ``live``: which ranks' lines to print while the job runs: True (all), False, or a list of ranks.
      All lines are kept on the result either way.
    - ``backend``: "gloo" or "nccl", handed to the script as ``DDP_BACKEND`` (checked against the GPUs
      first); None lets the script choose, except with fewer GPUs than ranks per node: then gloo (a note says so).
    - ``torchrun_args``: extra torchrun flags, e.g. ``["--max-restarts=1"]``.
    - ``show_agent``: also print torchrun's own log lines, prefixed ``[torchrun]``.
    - ``grace``: seconds between SIGTERM and SIGKILL when the job has to be stopped.
    - ``warm``: fork torchrun's agent and the ranks from a process of this kernel's that has already
      imported torch (started on first use), so a launch takes a fraction of a second instead of several;
      the flags, environment and records are torchrun's own. False runs a fresh ``torchrun`` process, as
      does any launch whose ``env=`` sets a variable torch reads when it is imported (a note says so).

    Returns a ``TorchrunResult`` (per-rank ``stdout``/``stderr`` lines, ``exitcodes``, ``records()``,
    ``duration`` and the plain ``command``). No process outlives the call: not after a timeout, an
    interrupt, or the death of the calling process.

    Example::

        result = torchrun("scripts/00_hello.py", "--steps", "3", nproc_per_node=2, timeout=120)
        assert all(r["sum"] == 3 for r in result.records())
    """
    job = _plan(script, args, nproc_per_node, nnodes, timeout, stall_timeout, env, cwd, live, backend,
                torchrun_args, show_agent, grace, warm)
    with _Launch(job) as launch:
        hang = launch.wait()
        stacks, attempts = (launch.dump_stacks(), launch.attempts()) if hang else ({}, {})  # as found, not as stopped
        launch.stop()
        result, ends = launch.collect()
        if hang:
            raise _hang_error(result, job, hang, stacks, attempts)
    if result.returncode != 0:
        raise _failure_error(result, ends)
    return result


@dataclass
class _Job:
    """Everything a launch needs, checked and computed before any process starts."""

    script: str
    script_path: str
    cwd: str
    world_size: int
    agent_argvs: list[list[str]]  # torchrun's arguments, one list per simulated node
    plain_command: str  # what to type outside the notebook
    env: dict[str, str]
    live: set[int]
    show_agent: bool
    timeout: float | None
    stall_timeout: float | None
    grace: float
    warm: bool


def _plan(script, args, nproc_per_node, nnodes, timeout, stall_timeout, env, cwd, live, backend,
          torchrun_args, show_agent, grace, warm) -> _Job:
    """Check every argument (bad input fails here, before any process starts) and build the commands."""
    nproc_per_node = _check_count("nproc_per_node", nproc_per_node)
    nnodes = _check_count("nnodes", nnodes)
    timeout = _check_seconds("timeout", timeout)
    stall_timeout = _check_seconds("stall_timeout", stall_timeout)
    grace = _check_grace(grace)
    torchrun_args = _check_flags(torchrun_args)
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env must be a dict of variables such as {{'NCCL_DEBUG': 'INFO'}}, not {env!r}")
    for name, flag in (("show_agent", show_agent), ("warm", warm)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, not {flag!r}")
    run_cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    if not os.path.isdir(run_cwd):
        raise FileNotFoundError(f"cwd {run_cwd!r} is not a folder")
    script = os.fspath(script)
    script_path = os.path.join(run_cwd, script)
    if not os.path.isfile(script_path):
        raise FileNotFoundError(
            f"script {script!r} not found (looked for {script_path}). Write it first "
            f"(e.g. with a %%writefile cell) or pass cwd= the folder it is relative to.")
    world_size = nproc_per_node * nnodes
    shown = _live_ranks(live, world_size)
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(f"{world_size} ranks on {cores} CPU core(s): ranks will share cores, which is fine "
                      f"for learning but slow, and timings will not mean much.", stacklevel=3)
    extra_env = {str(k): str(v) for k, v in (env or {}).items()}
    if backend is not None:
        _check_backend(backend, nproc_per_node)
        extra_env["DDP_BACKEND"] = backend
    elif "DDP_BACKEND" not in extra_env and not os.environ.get("DDP_BACKEND"):
        fallback = _one_gpu_fallback(nproc_per_node)
        if fallback:
            extra_env["DDP_BACKEND"] = "gloo"
            _note_once(fallback)

    run_id = uuid.uuid4().hex[:12]
    node_args = _node_args(nnodes, run_id)
    script_cmd = ["-m", "ddp_helpers._worker", script, *map(str, args)]
    agent_argvs = [[*node, f"--nproc-per-node={nproc_per_node}", *torchrun_args, *script_cmd] for node in node_args]
    # What to type on each node outside the notebook (is_host and local-addr only matter on one machine).
    plain = ["torchrun", *(a for a in node_args[0] if not a.startswith(("--rdzv-conf", "--local-addr"))),
             f"--nproc-per-node={nproc_per_node}", *torchrun_args, script, *map(str, args)]
    child_env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", protocol.RUN_ID: run_id,
                 protocol.PARENT_PID: str(os.getpid()), protocol.LIFELINE: "0"}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (child_env.get("PYTHONPATH"), _PACKAGE_PARENT) if p)
    import_time = _warm.import_time_env(extra_env)
    if warm and import_time:
        print(f"ddp_helpers: env= sets {', '.join(sorted(import_time))}, which torch reads when it is imported: "
              "this launch starts a fresh torchrun (warm=False)", flush=True)
    return _Job(script, script_path, run_cwd, world_size, agent_argvs, shlex.join(plain), child_env, shown,
                show_agent, timeout, stall_timeout, grace, warm and not import_time)


class _Launch:
    """One running job: its run folder, output streams, agents and lifeline. Leaving it cleans up everything."""

    def __init__(self, job: _Job):
        self.job = job
        self.run_dir = tempfile.mkdtemp(prefix=f"ddp_helpers_{job.env[protocol.RUN_ID]}_")
        self.streams = {(kind, r): _Stream(protocol.rank_file(self.run_dir, r, kind), f"[rank {r}] ",
                                           (sys.stdout if kind == "stdout" else sys.stderr) if r in job.live else None)
                        for r in range(job.world_size) for kind in ("stdout", "stderr")}
        tags = ["torchrun"] if len(job.agent_argvs) == 1 else [f"torchrun node {i}" for i in range(len(job.agent_argvs))]
        self.agent_streams = [_Stream(protocol.agent_file(self.run_dir, i, kind), f"[{tag}] ",
                                      (sys.stdout if kind == "stdout" else sys.stderr) if job.show_agent else None)
                              for i, tag in enumerate(tags) for kind in ("stdout", "stderr")]
        self.agents: list[subprocess.Popen] = []
        self.lifeline_r, self.lifeline_w = os.pipe()
        self.start = time.monotonic()

    def __enter__(self) -> _Launch:
        try:
            warm = self._warm_process() if self.job.warm else None
            for i, argv in enumerate(self.job.agent_argvs):
                with open(protocol.agent_file(self.run_dir, i, "stdout"), "wb") as out, \
                        open(protocol.agent_file(self.run_dir, i, "stderr"), "wb") as err:
                    env = {**self.job.env, protocol.RUN_DIR: self.run_dir, protocol.AGENT: str(i)}
                    if warm is not None:
                        agent = warm.start_agent(argv, env, self.job.cwd, (self.lifeline_r, out.fileno(), err.fileno()))
                    else:
                        agent = subprocess.Popen([sys.executable, "-m", "ddp_helpers._agent", *argv], cwd=self.job.cwd,
                                                 env=env, stdin=self.lifeline_r, stdout=out, stderr=err,
                                                 start_new_session=True)
                    self.agents.append(agent)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        finally:
            os.close(self.lifeline_r)  # only the agents hold the read end now
        return self

    def _warm_process(self) -> _warm.WarmProcess | None:
        """This kernel's warm process, or None (with a note) where it cannot start: the launch then runs cold."""
        server_env = {k: v for k, v in self.job.env.items()
                      if k not in (*protocol.LAUNCH_VARIABLES, "OMP_NUM_THREADS", "DDP_BACKEND")}
        try:
            process, note = _warm.warm_process(server_env)
        except (OSError, RuntimeError) as e:
            print(f"ddp_helpers: no warm launch ({e}); starting a fresh torchrun", flush=True)
            return None
        if note:
            print(f"ddp_helpers: {note}", flush=True)
        return process

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Runs on success, failure, timeout and KeyboardInterrupt alike: nothing outlives the call.
        try:
            self.stop()
        finally:
            os.close(self.lifeline_w)  # every agent and worker still alive now kills its own group
            for a in self.agents:
                try:
                    a.wait(timeout=REAP_WAIT)
                except subprocess.TimeoutExpired:
                    pass
            _flush()
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                print(self._interrupted(), file=sys.stderr, flush=True)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _interrupted(self) -> str:
        """One line for an interrupted cell: were all ranks and agents really stopped?"""
        end = time.monotonic() + REAP_WAIT  # killed processes may take a moment to be reaped
        while (left := [a.pid for a in self.agents if a.poll() is None]
               + [g for g in self._worker_groups() if _alive(g, group=True)]) and time.monotonic() < end:
            time.sleep(POLL_INTERVAL)
        if left:
            return f"ddp_helpers: interrupted; still stopping process group(s) {left} (they die with their lifeline)"
        return (f"ddp_helpers: interrupted; all {self.job.world_size} rank(s) and their torchrun agent(s) were "
                "stopped, nothing is left running")

    def poll(self) -> bool:
        """Read what arrived from every rank and agent; True if a rank wrote a new line."""
        ranks = any([s.poll() for s in self.streams.values()])  # a list: poll every stream, always
        agents = any([s.poll() for s in self.agent_streams])
        if ranks or agents:
            _flush()
        return ranks

    def wait(self) -> str | None:
        """Stream output until every agent has exited; "timeout" or "stall" if the job hung first, else None."""
        deadline = None if self.job.timeout is None else self.start + self.job.timeout
        first_failure = None
        last_line = time.monotonic()
        while True:
            if self.poll():
                last_line = time.monotonic()
            codes = [a.poll() for a in self.agents]
            if all(c is not None for c in codes):
                return None
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now  # one simulated node failed; give the others a moment to notice
            if first_failure is not None and now - first_failure > NODE_FAILURE_GRACE:
                return None
            if deadline is not None and now > deadline:
                return "timeout"
            if (self.job.stall_timeout is not None and now - last_line > self.job.stall_timeout
                    and all(self.streams["stdout", r].lines or self.streams["stderr", r].lines
                            for r in range(self.job.world_size))):
                return "stall"
            time.sleep(POLL_INTERVAL)

    def dump_stacks(self) -> dict[int, str]:
        """Ask every live rank for a faulthandler dump of all its threads, and collect what arrives."""
        marks = {}
        self.poll()
        for r in range(self.job.world_size):
            begin = _last_attempt(_read_status(self.run_dir, r)).start
            if begin and _alive(begin["pid"]):  # also a rank whose script ended but whose process hangs on
                marks[r] = len(self.streams["stderr", r].lines)
                try:
                    os.kill(begin["pid"], protocol.STACK_SIGNAL)
                except ProcessLookupError:
                    marks.pop(r)
        stop = time.monotonic() + DUMP_WAIT
        quiet_since = time.monotonic()
        while marks and time.monotonic() < stop:
            time.sleep(0.1)
            if self.poll():
                quiet_since = time.monotonic()
            started = all(any("most recent call first" in line for line in self.streams["stderr", r].lines[m:])
                          for r, m in marks.items())
            if started and time.monotonic() - quiet_since > DUMP_SETTLE:
                break
        return {r: "\n".join(self.streams["stderr", r].lines[m:]) for r, m in marks.items()}

    def stop(self) -> None:
        """SIGTERM every agent's and worker's process group, wait up to the grace period, then SIGKILL what is left."""
        running = [a for a in self.agents if a.poll() is None]
        workers = {g for g in self._worker_groups() if _alive(g, group=True)}  # a rank's children count too
        if not running and not workers:
            return
        groups = {a.pid for a in running} | workers
        _signal_groups(groups, signal.SIGTERM)
        end = time.monotonic() + self.job.grace
        while time.monotonic() < end:
            if all(a.poll() is not None for a in running) and not any(_alive(g, group=True) for g in workers):
                break
            time.sleep(POLL_INTERVAL)
        _signal_groups(groups | self._worker_groups(), signal.SIGKILL)
        for a in running:
            try:
                a.wait(timeout=REAP_WAIT)
            except subprocess.TimeoutExpired:
                pass

    def attempts(self) -> dict[int, _Attempt]:
        """Each rank's last attempt, as the shim recorded it."""
        return {r: _last_attempt(_read_status(self.run_dir, r)) for r in range(self.job.world_size)}

    def _worker_groups(self) -> set[int]:
        return {e["pgid"] for r in range(self.job.world_size)
                for e in _read_status(self.run_dir, r) if e["event"] == "start"}

    def collect(self) -> tuple[TorchrunResult, dict[int, RankEnd]]:
        """The job's result, and how each rank's last attempt ended."""
        for s in (*self.streams.values(), *self.agent_streams):
            s.finish()
        _flush()
        ends = _rank_ends(self.run_dir, self.job.world_size, self.agents)
        rc = next((a.returncode for a in self.agents if a.returncode not in (0, None)), 0)
        if any(a.returncode is None for a in self.agents):
            rc = rc or -signal.SIGKILL
        w = range(self.job.world_size)
        result = TorchrunResult(
            command=self.job.plain_command, returncode=rc, duration=time.monotonic() - self.start,
            stdout={r: self.streams["stdout", r].lines for r in w},
            stderr={r: self.streams["stderr", r].lines for r in w},
            exitcodes={r: ends[r].exitcode for r in w},
            agent_output=[line for s in self.agent_streams for line in s.lines])
        return result, ends


class _Stream:
    """Follows one output file and turns what arrives into whole lines."""

    def __init__(self, path: str, prefix: str, out: TextIO | None):
        self.path, self.prefix, self.out = path, prefix, out
        self.lines: list[str] = []
        self._partial, self._file = b"", None

    def poll(self) -> bool:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")
            except FileNotFoundError:
                return False
        data = self._file.read()
        if not data:
            return False
        *complete, self._partial = (self._partial + data).split(b"\n")
        self._emit(complete)
        return bool(complete)

    def finish(self) -> None:
        self.poll()
        if self._partial:
            self._emit([self._partial])
            self._partial = b""
        if self._file is not None:
            self._file.close()

    def _emit(self, raw: list[bytes]) -> None:
        new = [b.decode("utf-8", errors="replace").removesuffix("\r") for b in raw]
        self.lines.extend(new)
        if self.out is not None and new:
            self.out.write("".join(f"{self.prefix}{line}\n" for line in new))


# ---- how each rank ended, and whom to blame -------------------------------------------------------------


@dataclass
class _Attempt:
    """A rank's events from the shim's status file, for its last attempt only."""

    start: dict | None = None
    end: dict | None = None  # the "exit" event
    raised: dict | None = None  # the "exception" event


@dataclass
class RankEnd:
    """How one rank's last attempt ended, merged from torch's failure record and the shim's status file."""

    rank: int
    exitcode: int | None  # None: unknown (the job was stopped before torch or the shim recorded one)
    raised: str | None = None  # the exception type, if the script raised
    time: float = math.inf  # when it raised or exited (the shim's clock, else torch's whole-second timestamp)

    @property
    def failed(self) -> bool:
        return self.exitcode not in (0, None)

    @property
    def stopped_by_torchrun(self) -> bool:
        """Killed with SIGTERM without raising: torchrun stopping a healthy rank after another one failed."""
        return self.raised is None and self.exitcode == -signal.SIGTERM


def blame_order(end: RankEnd) -> tuple[bool, float, int]:
    """Sort key for failed ranks: one that failed on its own before one torchrun stopped; then the earliest."""
    return end.stopped_by_torchrun, end.time, end.rank


def _read_status(run_dir: str, rank: int) -> list[dict]:
    try:
        with open(protocol.rank_file(run_dir, rank, "status"), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (FileNotFoundError, ValueError):
        return []


def _last_attempt(events: list[dict]) -> _Attempt:
    """A rank's last 'start' event, and the 'exit' and 'exception' events that followed it, if any."""
    attempt = _Attempt()
    for e in events:
        if e["event"] == "start":
            attempt = _Attempt(start=e)
        elif e["event"] == "exit":
            attempt.end = e
        elif e["event"] == "exception":
            attempt.raised = e
    return attempt


def _rank_ends(run_dir: str, world_size: int, agents: Sequence[subprocess.Popen]) -> dict[int, RankEnd]:
    """Each rank's exit code (torch's failure record first, else the shim's) and, for failures, how and when."""
    failures: dict[int, dict] = {}
    for i in range(len(agents)):
        try:
            with open(protocol.agent_file(run_dir, i, "failures"), encoding="utf-8") as f:
                failures.update({int(k): v for k, v in json.load(f).items()})
        except (FileNotFoundError, ValueError):
            pass
    all_ok = all(a.returncode == 0 for a in agents)
    ends = {}
    for r in range(world_size):
        attempt = _last_attempt(_read_status(run_dir, r))
        if r in failures:
            code = failures[r]["exitcode"]
        elif attempt.end is not None:
            code = attempt.end["code"]
        else:
            code = 0 if all_ok else None
        when = (attempt.raised or attempt.end or {}).get("time", failures.get(r, {}).get("timestamp"))
        ends[r] = RankEnd(r, code, attempt.raised["type"] if attempt.raised else None,
                          math.inf if when is None else when)
    return ends


def _describe_exit(code: int | None) -> str:
    name = diagnose.signal_name(code)
    return f"was killed by {name} (exit code {code})" if name else f"exited with code {code}"


def _describe_failure(end: RankEnd) -> str:
    if end.raised is None:
        return _describe_exit(end.exitcode)
    if end.exitcode == 1:
        return f"raised {end.raised} (exit code 1)"
    return f"raised {end.raised}, then {_describe_exit(end.exitcode)} while shutting down"


def _failure_error(result: TorchrunResult, ends: Mapping[int, RankEnd]) -> TorchrunError:
    failed = sorted((e for e in ends.values() if e.failed), key=blame_order)
    if not failed:
        tail = "\n".join(result.agent_output[-20:])
        return TorchrunError(f"torchrun itself failed (exit code {result.returncode}) before any rank "
                             f"reported an error. Its last lines:\n{tail}", result)
    first, others = failed[0], sorted(failed[1:], key=lambda e: e.rank)
    head = f"rank {first.rank} {_describe_failure(first)}"
    if others:
        head += f"; then {len(others)} other rank(s) stopped too: " + ", ".join(
            f"rank {e.rank} {_describe_failure(e)}" for e in others)
    early = [e.rank for e in ends.values() if e.exitcode == 0]
    if early:
        names = ", ".join(f"rank {r}" for r in early)
        head += (f".\nNote: {names} exited normally (code 0) while the others were still running; a rank "
                 f"that leaves early (say, skipping a collective) makes its peers fail or hang")
    tb = diagnose.last_traceback(result.stderr[first.rank])
    body = "\n".join(tb) if tb else "(rank wrote nothing to stderr)"
    return TorchrunError(f"{head}.\n--- rank {first.rank} stderr (last traceback) ---\n{body}", result,
                         rank=first.rank, exitcode=first.exitcode)


def _hang_error(result: TorchrunResult, job: _Job, hang: str, stacks: Mapping[int, str],
                attempts: Mapping[int, _Attempt]) -> TorchrunError:
    """Name the rank(s) that caused a hang (timeout or stall), from their stack dumps."""
    states = []
    for r in range(job.world_size):
        attempt = attempts[r]
        state = diagnose.rank_state(r, stacks.get(r) or None, job.script_path, r in stacks,
                                    attempt.end["code"] if attempt.end else None)
        state.started = attempt.start is not None
        states.append(state)
    stuck, why = diagnose.culprits(states)
    when = (f"timed out after {job.timeout:g} s" if hang == "timeout" else
            f"stalled: every rank had printed, then none printed anything for {job.stall_timeout:g} s")
    lines = [f"{when}; stuck: " + ", ".join(f"rank {s.rank}" for s in stuck) + f" ({why})."]
    lines += [f"  {s.describe()}" for s in stuck]
    waiting = [s for s in states if s not in stuck]
    if waiting:
        lines.append("Waiting for them:")
        lines += [f"  {s.describe()}" for s in waiting]
    lines.append("Every rank was killed. Full stacks: .stacks on this error; logs: .result.")
    return TorchrunError("\n".join(lines), result, timed_out=True, stuck_ranks=[s.rank for s in stuck],
                         stacks=stacks)


# ---- small helpers ------------------------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number such as 2, not {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return value


def _check_seconds(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number of seconds (or None for no limit), not {value!r}")
    return float(value)


def _check_grace(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"grace must be a number of seconds, 0 or more (default {TERM_GRACE}), not {value!r}")
    return float(value)


def _check_flags(flags: object) -> list[str]:
    if isinstance(flags, (str, bytes)):
        raise TypeError(f"torchrun_args must be a list of flags, one string per flag, such as "
                        f"{shlex.split(flags) if isinstance(flags, str) else ['--max-restarts=1']!r}, "
                        f"not the single string {flags!r}")
    if not isinstance(flags, Iterable):
        raise TypeError(f"torchrun_args must be a list of flags such as ['--max-restarts=1'], not {flags!r}")
    flags = list(flags)
    bad = [f for f in flags if not isinstance(f, str)]
    if bad:
        raise TypeError(f"torchrun_args must hold strings such as '--max-restarts=1', not {bad!r}")
    return flags


def _check_backend(backend: str, nproc_per_node: int) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None (let the script choose), not {backend!r}")
    if backend == "nccl":
        gpus = _gpu_count(sys.executable)
        if gpus < nproc_per_node:
            raise RuntimeError(
                f"backend='nccl' needs one GPU per rank, but torch sees {gpus} GPU(s) for "
                f"{nproc_per_node} rank(s) per node. Use backend='gloo' (CPU), or lower "
                f"nproc_per_node to {max(gpus, 1) if gpus else 'the number of GPUs'}, or check "
                f"CUDA_VISIBLE_DEVICES and that a CUDA build of torch is installed.")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count(python: str) -> int:
    """How many GPUs torch sees, asked in a child process so that this process never imports torch."""
    key = (python, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("HIP_VISIBLE_DEVICES"))
    if key not in _GPU_COUNTS:
        out = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        _GPU_COUNTS[key] = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    return _GPU_COUNTS[key]


_GPU_COUNTS: dict[tuple, int] = {}  # asked once per kernel: the answer costs a torch import
_NOTED: set[str] = set()


def _may_have_gpus() -> bool:
    """False where no GPU driver is present at all (NVIDIA, ROCm, or WSL2's GPU bridge), so a CPU machine never pays
    for asking torch."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd",
                                           "/dev/dxg"))


def _one_gpu_fallback(nproc_per_node: int) -> str | None:
    """A note when a script left to choose would pick NCCL with fewer GPUs than ranks per node (one GPU, two
    ranks: a Colab or laptop GPU): rank 1 would ask for a GPU that does not exist, so such a launch runs on gloo."""
    gpus = _gpu_count(sys.executable) if _may_have_gpus() else 0
    if not 0 < gpus < nproc_per_node:
        return None
    return (f"{gpus} GPU(s) here: NCCL needs one GPU per rank, so a launch with more ranks per node than that "
            f"runs on gloo and the CPU (DDP_BACKEND=gloo). For NCCL, launch at most {gpus} rank(s) per node.")


def _note_once(note: str) -> None:
    if note not in _NOTED:
        _NOTED.add(note)
        print(f"ddp_helpers: {note}", flush=True)


def _live_ranks(live: bool | Iterable[int], world_size: int) -> set[int]:
    if live is True:
        return set(range(world_size))
    if live is False or live is None:
        return set()
    ranks = {int(r) for r in live}
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ValueError(f"live={sorted(ranks)} names rank(s) {bad}, but this job has ranks 0..{world_size - 1}")
    return ranks


def _node_args(nnodes: int, run_id: str) -> list[list[str]]:
    """torchrun's rendezvous flags for each simulated node (one node: --standalone)."""
    if nnodes == 1:
        return [["--standalone", "--nnodes=1"]]
    port = _free_port()
    return [[f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(i == 0)}", "--local-addr=127.0.0.1"]
            for i in range(nnodes)]


def _alive(target: int, group: bool = False) -> bool:
    """Whether a process (not a zombie) or, with ``group``, any member of a process group still exists."""
    try:
        (os.killpg if group else os.kill)(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not group:
        try:
            with open(f"/proc/{target}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # an exited, unreaped process answers no signal
        except (OSError, IndexError):
            pass
    return True


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _flush() -> None:
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (OSError, ValueError):
            pass
