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

from ddp_helpers import diagnose
from ddp_helpers._worker import STACK_SIGNAL

DEFAULT_TIMEOUT = 600.0
POLL_INTERVAL = 0.05
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


class _Stream:
    """Follows one output file and turns what arrives into whole lines."""

    def __init__(self, path: str, prefix: str, out: TextIO | None):
        self.path, self.prefix, self.out = path, prefix, out
        self.lines: list[str] = []
        self._offset, self._partial, self._file = 0, b"", None

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
        return True

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


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number such as 2, not {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count(python: str) -> int:
    """How many GPUs torch sees, asked in a child process so that this process never imports torch."""
    out = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


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


def _read_status(run_dir: str, rank: int) -> list[dict]:
    try:
        with open(os.path.join(run_dir, f"rank{rank}.status"), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (FileNotFoundError, ValueError):
        return []


def _last_attempt(events: list[dict]) -> tuple[dict | None, dict | None, dict | None]:
    """A rank's last 'start' event, and the 'exit' and 'exception' events that followed it, if any."""
    start = end = raised = None
    for e in events:
        if e["event"] == "start":
            start, end, raised = e, None, None
        elif e["event"] == "exit":
            end = e
        elif e["event"] == "exception":
            raised = e
    return start, end, raised


def _alive(target: int, group: bool = False) -> bool:
    """Whether a process (or, with ``group``, any member of a process group) still exists."""
    try:
        (os.killpg if group else os.kill)(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _node_args(nnodes: int, run_id: str) -> list[list[str]]:
    """torchrun's rendezvous flags for each simulated node (one node: --standalone)."""
    if nnodes == 1:
        return [["--standalone", "--nnodes=1"]]
    port = _free_port()
    return [[f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(i == 0)}", "--local-addr=127.0.0.1"]
            for i in range(nnodes)]


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def torchrun(script: str | os.PathLike, *args: object, nproc_per_node: int = 1, nnodes: int = 1,
             timeout: float | None = DEFAULT_TIMEOUT, env: Mapping[str, object] | None = None,
             cwd: str | os.PathLike | None = None, live: bool | Iterable[int] = True,
             backend: str | None = None, torchrun_args: Sequence[str] = (),
             show_agent: bool = False, grace: float = 3.0) -> TorchrunResult:
    """Run ``script`` under real torchrun, stream each rank's lines live, and raise ``TorchrunError`` on failure.

    ``nnodes=K`` simulates K nodes on this machine (K agents, c10d rendezvous on 127.0.0.1).
    ``live`` is True (all ranks), False, or the ranks to show while running; all lines are kept.
    ``backend`` ("gloo" or "nccl") is passed to the script as ``DDP_BACKEND`` and checked first.
    ``timeout`` is a wall-clock limit in seconds (None: no limit) after which every rank's stack
    is dumped, every process is killed, and the error names the rank(s) that were stuck.
    """
    nproc_per_node = _check_count("nproc_per_node", nproc_per_node)
    nnodes = _check_count("nnodes", nnodes)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0 or math.isinf(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds (or None for no limit), not {timeout!r}")
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
    show = _live_ranks(live, world_size)
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(f"{world_size} ranks on {cores} CPU core(s): ranks will share cores, which is fine "
                      f"for learning but slow, and timings will not mean much.", stacklevel=2)
    extra_env = {str(k): str(v) for k, v in (env or {}).items()}
    if backend is not None:
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
        extra_env["DDP_BACKEND"] = backend

    run_id = uuid.uuid4().hex[:12]
    run_dir = tempfile.mkdtemp(prefix=f"ddp_helpers_{run_id}_")
    child_env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1", "DDP_HELPERS_RUN_DIR": run_dir,
                 "DDP_HELPERS_RUN_ID": run_id, "DDP_HELPERS_PARENT_PID": str(os.getpid()),
                 "DDP_HELPERS_LIFELINE": "1"}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (child_env.get("PYTHONPATH"), _PACKAGE_PARENT) if p)

    script_cmd = ["-m", "ddp_helpers._worker", script, *map(str, args)]
    node_args = _node_args(nnodes, run_id)
    # What to type on each node outside the notebook (is_host and local-addr only matter on one machine).
    plain = ["torchrun", *(a for a in node_args[0] if not a.startswith(("--rdzv-conf", "--local-addr"))),
             f"--nproc-per-node={nproc_per_node}", *torchrun_args, script, *map(str, args)]

    streams: dict[tuple[str, int], _Stream] = {}
    for r in range(world_size):
        streams["out", r] = _Stream(os.path.join(run_dir, f"rank{r}.stdout"), f"[rank {r}] ",
                                    sys.stdout if r in show else None)
        streams["err", r] = _Stream(os.path.join(run_dir, f"rank{r}.stderr"), f"[rank {r}] ",
                                    sys.stderr if r in show else None)
    agent_streams = []
    agents: list[subprocess.Popen] = []
    lifeline_r, lifeline_w = os.pipe()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    try:
        for i, node in enumerate(node_args):
            tag = "torchrun" if nnodes == 1 else f"torchrun node {i}"
            for kind, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                path = os.path.join(run_dir, f"agent{i}.{kind}")
                agent_streams.append(_Stream(path, f"[{tag}] ", out if show_agent else None))
            with open(os.path.join(run_dir, f"agent{i}.stdout"), "wb") as o, \
                    open(os.path.join(run_dir, f"agent{i}.stderr"), "wb") as e:
                cmd = [sys.executable, "-m", "ddp_helpers._agent", *node,
                       f"--nproc-per-node={nproc_per_node}", *torchrun_args, *script_cmd]
                agents.append(subprocess.Popen(cmd, cwd=run_cwd, env={**child_env, "DDP_HELPERS_AGENT": str(i)},
                                               stdin=lifeline_r, stdout=o, stderr=e, start_new_session=True))
        os.close(lifeline_r)
        lifeline_r = -1

        timed_out = _wait(agents, streams, agent_streams, deadline)
        stacks: dict[int, str] = {}
        if timed_out:
            stacks = _dump_stacks(run_dir, world_size, streams, agent_streams)
        _terminate(agents, run_dir, world_size, grace)
        for s in (*streams.values(), *agent_streams):
            s.finish()
        _flush()
        codes, how = _exitcodes(run_dir, world_size, agents)
        result = _result(plain, agents, start, streams, agent_streams, codes)
        if timed_out:
            raise _timeout_error(result, run_dir, world_size, script_path, stacks, timeout)
        if result.returncode != 0:
            raise _failure_error(result, how)
        return result
    finally:
        # Runs on success, failure, timeout and KeyboardInterrupt alike: nothing outlives the call.
        if lifeline_r >= 0:
            os.close(lifeline_r)
        _terminate(agents, run_dir, world_size, grace)
        os.close(lifeline_w)  # every agent and worker still alive now kills its own group
        for a in agents:
            try:
                a.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _flush()
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait(agents: Sequence[subprocess.Popen], streams: Mapping[object, _Stream],
          agent_streams: Sequence[_Stream], deadline: float | None) -> bool:
    """Stream output until every agent has exited; True if the deadline passed first."""
    first_failure = None
    while True:
        _poll(streams, agent_streams)
        codes = [a.poll() for a in agents]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now  # one simulated node failed; give the others a moment to notice
        if first_failure is not None and now - first_failure > 10:
            return False
        if deadline is not None and now > deadline:
            return True
        time.sleep(POLL_INTERVAL)


def _poll(streams: Mapping[object, _Stream], agent_streams: Sequence[_Stream]) -> None:
    wrote = False
    for s in (*streams.values(), *agent_streams):
        wrote |= s.poll()
    if wrote:
        _flush()


def _flush() -> None:
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except (OSError, ValueError):
            pass


def _worker_pgids(run_dir: str, world_size: int) -> set[int]:
    pgids = set()
    for r in range(world_size):
        for e in _read_status(run_dir, r):
            if e["event"] == "start":
                pgids.add(e["pgid"])
    return pgids


def _terminate(agents: Sequence[subprocess.Popen], run_dir: str, world_size: int, grace: float) -> None:
    """SIGTERM every agent's and worker's process group, wait ``grace`` seconds, then SIGKILL what is left."""
    running = [a for a in agents if a.poll() is None]
    workers = _worker_pgids(run_dir, world_size)
    live_workers = {g for g in workers if _alive(g, group=True)}  # a rank's children count too
    if not running and not live_workers:
        return
    groups = {a.pid for a in running} | live_workers
    _signal_groups(groups, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if all(a.poll() is not None for a in running) and not any(_alive(g, group=True) for g in live_workers):
            break
        time.sleep(0.05)
    _signal_groups(groups | _worker_pgids(run_dir, world_size), signal.SIGKILL)
    for a in running:
        try:
            a.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _dump_stacks(run_dir: str, world_size: int, streams: Mapping[tuple[str, int], _Stream],
                 agent_streams: Sequence[_Stream]) -> dict[int, str]:
    """Ask every live rank for a faulthandler dump of all its threads, and collect what arrives."""
    marks = {}
    for r in range(world_size):
        begin, _, _ = _last_attempt(_read_status(run_dir, r))
        if begin and _alive(begin["pid"]):  # also a rank whose script ended but whose process hangs on
            _poll(streams, agent_streams)
            marks[r] = len(streams["err", r].lines)
            try:
                os.kill(begin["pid"], STACK_SIGNAL)
            except ProcessLookupError:
                marks.pop(r)
    stop = time.monotonic() + 3.0
    quiet_since = time.monotonic()
    while marks and time.monotonic() < stop:
        time.sleep(0.1)
        if any(s.poll() for s in (*streams.values(), *agent_streams)):
            quiet_since = time.monotonic()
            _flush()
        done = all(any("most recent call first" in line for line in streams["err", r].lines[m:])
                   for r, m in marks.items())
        if done and time.monotonic() - quiet_since > 0.3:
            break
    return {r: "\n".join(streams["err", r].lines[m:]) for r, m in marks.items()}


def _exitcodes(run_dir: str, world_size: int,
               agents: Sequence[subprocess.Popen]) -> tuple[dict[int, int | None], dict[int, dict]]:
    """Each rank's exit code (torch's failure record, else the shim's) and, for failed ranks, how and when."""
    failures: dict[int, dict] = {}
    for i in range(len(agents)):
        try:
            with open(os.path.join(run_dir, f"agent{i}.failures"), encoding="utf-8") as f:
                failures.update({int(k): v for k, v in json.load(f).items()})
        except (FileNotFoundError, ValueError):
            pass
    codes: dict[int, int | None] = {}
    how: dict[int, dict] = {}
    all_ok = all(a.returncode == 0 for a in agents)
    for r in range(world_size):
        _, end, raised = _last_attempt(_read_status(run_dir, r))
        if r in failures:
            codes[r] = failures[r]["exitcode"]
        elif end is not None:
            codes[r] = end["code"]
        else:
            codes[r] = 0 if all_ok else None
        if codes[r] not in (0, None):
            # The shim's clock is exact; torch's failure timestamp is whole seconds.
            when = raised["time"] if raised else (end["time"] if end else failures.get(r, {}).get("timestamp"))
            how[r] = {"time": math.inf if when is None else when, "raised": raised}
    return codes, how


def _result(plain: list[str], agents: Sequence[subprocess.Popen], start: float,
            streams: Mapping[tuple[str, int], _Stream], agent_streams: Sequence[_Stream],
            codes: dict[int, int | None]) -> TorchrunResult:
    world_size = len(codes)
    rc = next((a.returncode for a in agents if a.returncode not in (0, None)), 0)
    if any(a.returncode is None for a in agents):
        rc = rc or -signal.SIGKILL
    return TorchrunResult(
        command=shlex.join(plain), returncode=rc, duration=time.monotonic() - start,
        stdout={r: streams["out", r].lines for r in range(world_size)},
        stderr={r: streams["err", r].lines for r in range(world_size)},
        exitcodes=codes, agent_output=[line for s in agent_streams for line in s.lines])


def _describe_exit(code: int | None) -> str:
    name = diagnose.signal_name(code)
    return f"was killed by {name} (exit code {code})" if name else f"exited with code {code}"


def _failure_error(result: TorchrunResult, how: Mapping[int, dict]) -> TorchrunError:
    codes = result.exitcodes
    failed = sorted(how)
    if not failed:
        tail = "\n".join(result.agent_output[-20:])
        return TorchrunError(f"torchrun itself failed (exit code {result.returncode}) before any rank "
                             f"reported an error. Its last lines:\n{tail}", result)
    # A rank that raised beats one that torchrun stopped with SIGTERM; then the earliest wins.
    first = min(failed, key=lambda r: (how[r]["raised"] is None and codes[r] == -signal.SIGTERM,
                                       how[r]["time"], r))
    head = f"rank {first} {_describe_failure(codes[first], how[first]['raised'])}"
    others = [r for r in failed if r != first]
    if others:
        head += f"; then {len(others)} other rank(s) stopped too: " + ", ".join(
            f"rank {r} {_describe_failure(codes[r], how[r]['raised'])}" for r in others)
    early = [r for r, c in codes.items() if c == 0]
    if early:
        names = ", ".join(f"rank {r}" for r in early)
        head += (f".\nNote: {names} exited normally (code 0) while the others were still running; a rank "
                 f"that leaves early (say, skipping a collective) makes its peers fail or hang")
    tb = diagnose.last_traceback(result.stderr[first])
    body = "\n".join(tb) if tb else "(rank wrote nothing to stderr)"
    return TorchrunError(f"{head}.\n--- rank {first} stderr (last traceback) ---\n{body}", result,
                         rank=first, exitcode=codes[first])


def _describe_failure(code: int | None, raised: dict | None) -> str:
    if raised is None:
        return _describe_exit(code)
    if code == 1:
        return f"raised {raised['type']} (exit code 1)"
    return f"raised {raised['type']}, then {_describe_exit(code)} while shutting down"


def _timeout_error(result: TorchrunResult, run_dir: str, world_size: int, script: str,
                   stacks: Mapping[int, str], timeout: float) -> TorchrunError:
    states = []
    for r in range(world_size):
        begin, end, _ = _last_attempt(_read_status(run_dir, r))
        alive = r in stacks
        code = end["code"] if end else None
        state = diagnose.rank_state(r, stacks.get(r) or None, script, alive, code)
        state.started = begin is not None
        states.append(state)
    stuck, why = diagnose.culprits(states)
    lines = [f"timed out after {timeout:g} s; stuck: " + ", ".join(f"rank {s.rank}" for s in stuck) + f" ({why})."]
    lines += [f"  {s.describe()}" for s in stuck]
    waiting = [s for s in states if s not in stuck]
    if waiting:
        lines.append("Waiting for them:")
        lines += [f"  {s.describe()}" for s in waiting]
    lines.append("Every rank was killed. Full stacks: .stacks on this error; logs: .result.")
    return TorchrunError("\n".join(lines), result, timed_out=True, stuck_ranks=[s.rank for s in stuck],
                         stacks=stacks)
