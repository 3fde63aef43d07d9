"""``torchrun(...)``: run a script under real torchrun from a notebook cell, show each rank, raise on failure.

This module holds the mechanics of one launch: check every option (``LaunchOptions``) and plan the commands
(``plan_launch``), make the run folder and the lifeline, start the agents (cold, or forked by the warm
process), follow the ranks' files (``_run_folder``), catch a hang, stop and reap every process (``_procs``).
Whom to blame is ``diagnose``'s; what a launch returns or raises is ``outcome``'s; how the processes talk is
``_protocol``'s. ``RankGroup`` and ``sbatch()`` use the same parts, by their public names.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ddp_helpers import _protocol as protocol
from ddp_helpers import _strict, _warm, diagnose, environment
from ddp_helpers._procs import pgid_alive, signal_pgids
from ddp_helpers._run_folder import (
    POLL_INTERVAL,
    LineFollower,
    Progress,
    RankFiles,
    dump_stacks,
    flush_output,
    follow,
    read_failure_records,
)
from ddp_helpers.outcome import Hang, JobFailedError, JobHungError, TorchrunError, TorchrunResult

__all__ = [
    "LAUNCH_TIMEOUT",
    "JobFailedError",
    "JobHungError",
    "LaunchOptions",
    "TorchrunError",
    "TorchrunResult",
    "torchrun",
]

# A launch's wall-clock limit, from its start, unless the caller gives one (None: no limit).
LAUNCH_TIMEOUT = 600.0
DEFAULT_TIMEOUT = LAUNCH_TIMEOUT  # its former name, which notebook 10 reads
TERM_GRACE = 3.0  # after SIGTERM, seconds torchrun and the ranks get to flush logs and exit before SIGKILL
# When one simulated node's agent fails, the other agents normally notice through the rendezvous and exit
# within a second or two; this is the most they get before being stopped (they are then reported as killed).
NODE_FAILURE_GRACE = 10.0
REAP_WAIT = 5.0  # after SIGKILL, how long to wait for an agent process to be reaped
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")  # which GPUs torch sees


def torchrun(
    script: str | os.PathLike,
    *args: object,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    timeout: float | None = LAUNCH_TIMEOUT,
    stall_timeout: float | None = None,
    env: Mapping[str, object] | None = None,
    cwd: str | os.PathLike | None = None,
    live: bool | Iterable[int] = True,
    backend: str | None = None,
    torchrun_args: Sequence[str] = (),
    show_agent: bool = False,
    grace: float = TERM_GRACE,
    warm: bool = True,
) -> TorchrunResult:
    """Run ``script`` under real torchrun, stream each rank's lines live, raise ``TorchrunError`` on failure.

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
      first); None lets the script choose, except with fewer GPUs than ranks per node: then gloo (a note
      says so).
    - ``torchrun_args``: extra torchrun flags, e.g. ``["--max-restarts=1"]``.
    - ``show_agent``: also print torchrun's own log lines, prefixed ``[torchrun]``.
    - ``grace``: seconds between SIGTERM and SIGKILL when the job has to be stopped.
    - ``warm``: fork torchrun's agent and the ranks from this kernel's warm process, which has already
      imported torch (started on first use), so a launch takes a fraction of a second instead of several;
      the flags, environment and records are torchrun's own. False runs a fresh ``torchrun`` process, as
      does any launch whose ``env=`` sets a variable torch reads when it is imported (a note says so).

    Returns a ``TorchrunResult`` (per-rank ``stdout``/``stderr`` lines, ``exitcodes``, ``records()``,
    ``duration`` and the plain ``command``). Raises ``JobFailedError`` when a rank fails (``.rank`` names the
    one to blame) and ``JobHungError`` when the job hangs (``.hang``: timeout or stall; ``.stuck_ranks``,
    ``.stacks``); both are ``TorchrunError``. No process outlives the call: not after a timeout, an
    interrupt, or the death of the calling process.

    Example::

        result = torchrun("scripts/00_hello.py", "--steps", "3", nproc_per_node=2, timeout=120)
        assert all(r["sum"] == 3 for r in result.records())
    """
    options = LaunchOptions(
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        timeout=timeout,
        stall_timeout=stall_timeout,
        env=env,
        cwd=cwd,
        live=live,
        backend=backend,
        torchrun_args=torchrun_args,
        show_agent=show_agent,
        grace=grace,
        warm=warm,
    )
    return run_launch(plan_launch(script, args, options))


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to launch, as ``torchrun()`` takes it (its docstring says what each option means), checked as it is
    built: bad input fails here, in teaching language, before any process starts. ``torchrun()``,
    ``RankGroup``, ``%ranks start`` and ``python -m ddp_helpers`` each build one; ``sbatch()`` builds an
    ``SbatchOptions``. Each option is kept in one form: seconds as floats, ``torchrun_args`` as a tuple,
    ``env`` as strings (empty for None), ``cwd`` as an absolute folder, ``live`` as the set of ranks shown."""

    nproc_per_node: int = 1
    nnodes: int = 1
    timeout: float | None = LAUNCH_TIMEOUT
    stall_timeout: float | None = None
    env: Mapping[str, object] | None = None
    cwd: str | os.PathLike | None = None
    live: bool | Iterable[int] = True
    backend: str | None = None
    torchrun_args: Sequence[str] = ()
    show_agent: bool = False
    grace: float = TERM_GRACE
    warm: bool = True

    def __post_init__(self) -> None:
        self._keep(
            nproc_per_node=check_count("nproc_per_node", self.nproc_per_node),
            nnodes=check_count("nnodes", self.nnodes),
            timeout=check_seconds("timeout", self.timeout),
            stall_timeout=check_seconds("stall_timeout", self.stall_timeout),
            grace=_check_grace(self.grace),
            torchrun_args=tuple(check_flags(self.torchrun_args)),
            env=_check_env(self.env),
        )
        for name in ("show_agent", "warm"):
            _check_flag(name, getattr(self, name))
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"backend must be 'gloo', 'nccl' or None (let the script choose), not {self.backend!r}"
            )
        self._keep(cwd=_check_cwd(self.cwd))
        self._keep(live=frozenset(_live_ranks(self.live, self.world_size)))

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def script_path(self, script: str | os.PathLike) -> tuple[str, str]:
        """The script as a string and its path under ``cwd``; FileNotFoundError if it is missing."""
        script = os.fspath(script)
        path = os.path.join(self.cwd, script)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"script {script!r} not found (looked for {path}). Write it first "
                f"(e.g. with a %%writefile cell) or pass cwd= the folder it is relative to."
            )
        return script, path

    def _keep(self, **checked: object) -> None:
        """Keep each checked option in its one form (the dataclass is frozen once built)."""
        for name, value in checked.items():
            object.__setattr__(self, name, value)


def run_launch(job: LaunchPlan) -> TorchrunResult:
    """Launch a planned job and follow it to its end: ``torchrun()`` once its options are built."""
    with Launch(job) as launch:
        hang = launch.watch()
        # Where every rank was, as found: before anything is stopped.
        hung = launch.hung_ranks() if hang else []
        launch.stop()
        result, evidence = launch.collect()
    if hang:
        _strict.raise_checked(diagnose.hang_error(result, hang, hung, job.script_path), job.gloo_pinned)
    if result.returncode != 0:
        _strict.raise_checked(diagnose.failure_error(result, evidence), job.gloo_pinned)
    return result


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything a launch needs, checked and computed before any process starts."""

    options: LaunchOptions
    run_id: str  # a short random id: in the run folder's name, and torchrun's --rdzv-id with nnodes > 1
    script_path: str
    agent_argvs: list[list[str]]  # torchrun's arguments, one list per simulated node
    plain_command: str  # what to type outside the notebook
    env: dict[str, str]
    warm_now: bool  # warm after the import-time check (``env=`` may turn a warm launch cold)
    gloo_pinned: bool = False  # gloo on every machine (``_strict``: what strict mode asks of a hang)


def plan_launch(script: str | os.PathLike, args: Sequence[object], options: LaunchOptions) -> LaunchPlan:
    """Check the script and build the agents' commands and environment (bad input fails here, before any
    process starts)."""
    script, script_path = options.script_path(script)
    world_size = options.world_size
    cores = os.cpu_count() or 1
    if world_size > cores:
        warnings.warn(
            f"{world_size} ranks on {cores} CPU core(s): ranks will share cores, which is fine "
            f"for learning but slow, and timings will not mean much.",
            stacklevel=3,
        )
    import_time = _warm.import_time_env(options.env)
    warm_now = options.warm and not import_time
    child_env = {
        **os.environ,
        **options.env,
        "PYTHONUNBUFFERED": "1",
        protocol.PARENT_PID: str(os.getpid()),
        protocol.LIFELINE: "0",
    }
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (child_env.get("PYTHONPATH"), PACKAGE_PARENT) if p)
    # Before a DDP_BACKEND the launch hands on.
    pinned = _strict.gloo_pinned(options.backend, child_env, script_path)
    child_env.update(_backend_env(options.backend, options.nproc_per_node, child_env, warm_now))

    run_id = uuid.uuid4().hex[:12]
    node_args = _node_args(options.nnodes, run_id)
    script_cmd = ["-m", "ddp_helpers._worker", script, *map(str, args)]
    per_node = [f"--nproc-per-node={options.nproc_per_node}", *options.torchrun_args, *script_cmd]
    # What to type on each node outside the notebook (is_host and local-addr only matter on one machine).
    plain = [
        "torchrun",
        *(a for a in node_args[0] if not a.startswith(("--rdzv-conf", "--local-addr"))),
        f"--nproc-per-node={options.nproc_per_node}",
        *options.torchrun_args,
        script,
        *map(str, args),
    ]
    if options.warm and import_time:
        print(
            f"ddp_helpers: env= sets {', '.join(sorted(import_time))}, which torch reads when it is "
            "imported: this launch starts a fresh torchrun (warm=False)",
            flush=True,
        )
    return LaunchPlan(
        options=options,
        run_id=run_id,
        script_path=script_path,
        agent_argvs=[[*node, *per_node] for node in node_args],
        plain_command=shlex.join(plain),
        env=child_env,
        warm_now=warm_now,
        gloo_pinned=pinned,
    )


def _backend_env(
    backend: str | None, nproc_per_node: int, env: Mapping[str, str], warm: bool
) -> dict[str, str]:
    """The DDP_BACKEND to hand the ranks, if any, as ``environment.launch_backend`` decides; the GPUs are
    counted only where the answer matters. ``backend="nccl"`` with too few GPUs for the ranks stops here."""
    preset = None if backend else env.get("DDP_BACKEND")
    gpus = _gpu_count(env, warm) if backend == "nccl" or not (backend or preset) else 0
    if backend == "nccl" and gpus < nproc_per_node:
        raise RuntimeError(
            f"backend='nccl' needs one GPU per rank, but torch sees {gpus} GPU(s) for "
            f"{nproc_per_node} rank(s) per node. Use backend='gloo' (CPU), or lower "
            f"nproc_per_node to {max(gpus, 1) if gpus else 'the number of GPUs'}, or check "
            f"CUDA_VISIBLE_DEVICES and that a CUDA build of torch is installed."
        )
    _, handed = environment.launch_backend(nproc_per_node, gpus, backend, preset)
    if handed and backend is None:
        _note_once(
            f"{gpus} GPU(s) here: NCCL needs one GPU per rank, so a launch with more ranks per node than "
            f"that runs on gloo and the CPU (DDP_BACKEND=gloo). For NCCL, launch at most {gpus} rank(s) "
            f"per node."
        )
    return {"DDP_BACKEND": handed} if handed else {}


def _gpu_count(env: Mapping[str, str], warm: bool) -> int:
    """How many GPUs the ranks will see. 0 where no GPU driver exists at all, without asking; else asked once
    per kernel and setting of the *_VISIBLE_DEVICES variables: of the warm process when the launch is warm (it
    has torch imported, and counts without initialising CUDA), else of a fresh Python (this process never
    imports torch)."""
    if not _may_have_gpus():
        return 0
    key = tuple(env.get(k) for k in _VISIBILITY)
    if key not in _GPU_COUNTS:
        count = None
        process = _warm_process(_warm_env(env)) if warm else None
        if process is not None:
            try:
                count = process.count_gpus()
            except (OSError, RuntimeError):
                count = None
        if count is None:
            clean = {k: v for k, v in env.items() if k not in protocol.LAUNCH_VARIABLES}
            out = subprocess.run(
                [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                capture_output=True,
                text=True,
                timeout=120,
                env=clean,
            )
            count = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
        _GPU_COUNTS[key] = count
    return _GPU_COUNTS[key]


_GPU_COUNTS: dict[tuple, int] = {}  # asked once per kernel and visibility setting
_NOTED: set[str] = set()


def _may_have_gpus() -> bool:
    """False where no GPU driver is present at all (NVIDIA, ROCm, or WSL2's GPU bridge), so a CPU machine
    never pays for asking torch."""
    return any(
        os.path.exists(p)
        for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
    )


def _warm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment the warm process starts with: the launch's, less what differs per launch."""
    return {
        k: v
        for k, v in env.items()
        if k not in (*protocol.LAUNCH_VARIABLES, "OMP_NUM_THREADS", "DDP_BACKEND")
    }


def _warm_process(env: dict[str, str]) -> _warm.WarmProcess | None:
    """This kernel's warm process, or None (with a note) where it cannot start: the launch then runs cold."""
    try:
        process, note = _warm.warm_process(env)
    except _warm.WarmUnsupported as e:
        _note_once(f"warm launches are off ({e}): every launch starts a fresh torchrun")
        return None
    except (OSError, RuntimeError) as e:
        print(f"ddp_helpers: no warm launch ({e}); starting a fresh torchrun", flush=True)
        return None
    if note:
        print(f"ddp_helpers: {note}", flush=True)
    return process


class Launch:
    """One running job: its run folder, lifeline, ranks and agents. Leaving it stops and reaps them all."""

    def __init__(self, job: LaunchPlan):
        self.job = job
        self.run_dir = tempfile.mkdtemp(prefix=f"ddp_helpers_{job.run_id}_")
        live, world_size = job.options.live, job.options.world_size
        self.ranks = [RankFiles(self.run_dir, r, r in live) for r in range(world_size)]
        self.agents = _Agents(job, self.run_dir)
        # The lifeline (see _protocol): every agent and rank dies with its write end.
        self.lifeline_r, self.lifeline_w = os.pipe()
        self.start = time.monotonic()

    def __enter__(self) -> Launch:
        try:
            self.agents.start(self.lifeline_r)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        finally:
            os.close(self.lifeline_r)  # only the agents hold the read end now
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Runs on success, failure, timeout and KeyboardInterrupt alike: nothing outlives the call.
        try:
            self.stop()
        finally:
            os.close(self.lifeline_w)  # every agent and worker still alive now kills its own group
            self.agents.reap()
            flush_output()
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                print(self._interrupted(), file=sys.stderr, flush=True)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def poll(self) -> bool:
        """Read what arrived from every rank and agent; True if a rank wrote a new line."""
        ranks = any([r.poll() for r in self.ranks])  # a list: poll every rank, always
        if self.agents.poll_logs() or ranks:
            flush_output()
        return ranks

    def watch(self) -> Hang | None:
        """Stream output until every agent has exited; the ``Hang`` if the job hung first, else None."""
        options = self.job.options
        first_failure: float | None = None

        def look() -> Progress:
            nonlocal first_failure
            new_lines = self.poll()
            codes = self.agents.poll()
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now  # one simulated node failed; give the others a moment to notice
            given_up = first_failure is not None and now - first_failure > NODE_FAILURE_GRACE
            done = all(c is not None for c in codes) or given_up
            return Progress(new_lines, done, all(r.printed for r in self.ranks))

        return follow(look, diagnose.Watch(self.start, options.timeout, options.stall_timeout))

    def agents_running(self) -> bool:
        """Whether every agent still runs (one that exited ends a rank group)."""
        return all(code is None for code in self.agents.poll())

    def wait_for_agents(self, seconds: float) -> None:
        """Show the ranks' lines while an agent still runs, for at most ``seconds`` (torchrun stopping the
        ranks after one failed, or the ranks leaving after ``%ranks stop``); then read what is left."""
        end = time.monotonic() + seconds
        while self.agents.running() and time.monotonic() < end:
            self.poll()
            time.sleep(POLL_INTERVAL)
        self.poll()

    def hung_ranks(self) -> list[diagnose.RankEvidence]:
        """Every rank's evidence for a hang, with a faulthandler dump of every thread of each live rank."""
        self.poll()
        # The dumps go to the error's .stacks, not the cell: the diagnosis comes first.
        for rank in self.ranks:
            rank.stderr.mute()
        stacks = dump_stacks(self.ranks, self.poll)
        return [
            rank.evidence(alive=rank.rank in stacks, stack=stacks.get(rank.rank) or None)
            for rank in self.ranks
        ]

    def stop(self) -> None:
        """Stop every agent and every rank's process group (SIGTERM, the grace period, then SIGKILL)."""
        self.agents.stop(self._rank_pgids, self.job.options.grace)

    def collect(self) -> tuple[TorchrunResult, dict[int, diagnose.RankEvidence]]:
        """The job's result, and each rank's evidence of how its last attempt ended."""
        for rank in self.ranks:
            rank.finish()
        agent_output = self.agents.finish()
        flush_output()
        failures = read_failure_records(self.run_dir, len(self.agents.procs))
        ok = all(a.returncode == 0 for a in self.agents.procs)
        evidence = {r.rank: r.evidence(failure=failures.get(r.rank), agents_ok=ok) for r in self.ranks}
        out, err = ({r.rank: getattr(r, kind).lines for r in self.ranks} for kind in ("stdout", "stderr"))
        codes = {r: e.exitcode for r, e in evidence.items()}
        duration = time.monotonic() - self.start
        rc = self.agents.returncode()
        return TorchrunResult(self.job.plain_command, rc, duration, out, err, codes, agent_output), evidence

    def _rank_pgids(self) -> set[int]:
        return {pgid for rank in self.ranks for pgid in rank.pgids()}

    def _interrupted(self) -> str:
        """One line for an interrupted cell: were all ranks and agents really stopped?"""
        left = self.agents.left(self._rank_pgids)
        if left:
            groups = f"process group(s) {left}"
            return f"ddp_helpers: interrupted; still stopping {groups} (they die with their lifeline)"
        ranks = f"all {self.job.options.world_size} rank(s) and their torchrun agent(s)"
        return f"ddp_helpers: interrupted; {ranks} were stopped, nothing is left running"


class _Agents:
    """A launch's torchrun agents, one per simulated node, each in a process group of its own: started cold
    (``python -m ddp_helpers._agent``) or forked by the warm process; their own logs and failure records."""

    def __init__(self, job: LaunchPlan, run_dir: str):
        self.job, self.run_dir = job, run_dir
        count = len(job.agent_argvs)
        tags = ["torchrun"] if count == 1 else [f"torchrun node {i}" for i in range(count)]
        echo_to = {"stdout": sys.stdout, "stderr": sys.stderr} if job.options.show_agent else {}
        self.logs = [
            LineFollower(protocol.agent_file(run_dir, i, kind), f"[{tag}] ", echo_to.get(kind))
            for i, tag in enumerate(tags)
            for kind in ("stdout", "stderr")
        ]
        self.procs: list[subprocess.Popen | _warm.WarmAgent] = []

    def start(self, lifeline: int) -> None:
        job, cwd = self.job, self.job.options.cwd
        warm_process = _warm_process(_warm_env(job.env)) if job.warm_now else None
        for i, argv in enumerate(job.agent_argvs):
            with (
                open(protocol.agent_file(self.run_dir, i, "stdout"), "wb") as out,
                open(protocol.agent_file(self.run_dir, i, "stderr"), "wb") as err,
            ):
                env = {**job.env, protocol.RUN_DIR: self.run_dir, protocol.AGENT: str(i)}
                if warm_process is not None:
                    agent = warm_process.start_agent(argv, env, cwd, (lifeline, out.fileno(), err.fileno()))
                else:
                    command = [sys.executable, "-m", "ddp_helpers._agent", *argv]
                    files = {"stdin": lifeline, "stdout": out, "stderr": err}
                    agent = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True, **files)
                self.procs.append(agent)

    def poll(self) -> list[int | None]:
        """Each agent's exit code; None while it runs."""
        return [a.poll() for a in self.procs]

    def poll_logs(self) -> bool:
        """Read (and show, with show_agent) the agents' new log lines; True if there were any."""
        return any([bool(log.poll()) for log in self.logs])

    def running(self) -> list:
        return [a for a in self.procs if a.poll() is None]

    def stop(self, rank_pgids: Callable[[], set[int]], grace: float) -> None:
        """SIGTERM every running agent's process group and every live rank's (``rank_pgids()``: a rank's
        children count too), wait up to ``grace`` seconds, then SIGKILL what is left."""
        running = self.running()
        ranks = {pgid for pgid in rank_pgids() if pgid_alive(pgid)}
        if not running and not ranks:
            return
        pgids = {a.pid for a in running} | ranks
        signal_pgids(pgids, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if all(a.poll() is not None for a in running) and not any(pgid_alive(g) for g in ranks):
                break
            time.sleep(POLL_INTERVAL)
        signal_pgids(pgids | rank_pgids(), signal.SIGKILL)
        self.reap(running)

    def left(self, rank_pgids: Callable[[], set[int]]) -> list[int]:
        """The agents and ranks' process groups still alive after being killed; they get a moment to be
        reaped."""
        end = time.monotonic() + REAP_WAIT
        while (
            left := [a.pid for a in self.running()] + [g for g in rank_pgids() if pgid_alive(g)]
        ) and time.monotonic() < end:
            time.sleep(POLL_INTERVAL)
        return left

    def reap(self, agents: Sequence | None = None) -> None:
        for a in self.procs if agents is None else agents:
            try:
                a.wait(timeout=REAP_WAIT)
            except subprocess.TimeoutExpired:
                pass

    def returncode(self) -> int:
        """The first failed agent's exit code; SIGKILL's for an agent that could not be reaped; else 0."""
        rc = next((a.returncode for a in self.procs if a.returncode not in (0, None)), 0)
        return rc or (-signal.SIGKILL if any(a.returncode is None for a in self.procs) else 0)

    def finish(self) -> list[str]:
        """Every agent's log lines, read to the end."""
        for log in self.logs:
            log.finish()
        return [line for log in self.logs for line in log.lines]


# ---- small helpers -------------------------------------------------------------------------------------


def _check_env(env: object) -> dict[str, str]:
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env must be a dict of variables such as {{'NCCL_DEBUG': 'INFO'}}, not {env!r}")
    return {str(k): str(v) for k, v in (env or {}).items()}


def _check_flag(name: str, flag: object) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be True or False, not {flag!r}")


def _check_cwd(cwd: str | os.PathLike | None) -> str:
    run_cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    if not os.path.isdir(run_cwd):
        raise FileNotFoundError(f"cwd {run_cwd!r} is not a folder")
    return run_cwd


def check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number such as 2, not {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return value


def check_seconds(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number of seconds (or None for no limit), not {value!r}")
    return float(value)


def _check_grace(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"grace must be a number of seconds, 0 or more (default {TERM_GRACE}), not {value!r}"
        )
    return float(value)


def check_flags(flags: object) -> list[str]:
    if isinstance(flags, (str, bytes)):
        raise TypeError(
            f"torchrun_args must be a list of flags, one string per flag, such as "
            f"{shlex.split(flags) if isinstance(flags, str) else ['--max-restarts=1']!r}, "
            f"not the single string {flags!r}"
        )
    if not isinstance(flags, Iterable):
        raise TypeError(f"torchrun_args must be a list of flags such as ['--max-restarts=1'], not {flags!r}")
    flags = list(flags)
    bad = [f for f in flags if not isinstance(f, str)]
    if bad:
        raise TypeError(f"torchrun_args must hold strings such as '--max-restarts=1', not {bad!r}")
    return flags


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        raise ValueError(
            f"live={sorted(ranks)} names rank(s) {bad}, but this job has ranks 0..{world_size - 1}"
        )
    return ranks


def _node_args(nnodes: int, run_id: str) -> list[list[str]]:
    """torchrun's rendezvous flags for each simulated node (one node: --standalone)."""
    if nnodes == 1:
        return [["--standalone", "--nnodes=1"]]
    port = _free_port()
    return [
        [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={int(i == 0)}",
            "--local-addr=127.0.0.1",
        ]
        for i in range(nnodes)
    ]
