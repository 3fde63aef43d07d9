"""``sbatch(...)``: run a script under torchrun on a SLURM cluster from a notebook cell, like ``torchrun()``.

It writes a batch script (one ``torchrun`` per node under ``srun``, meeting through c10d rendezvous at the
first node of the job), submits it with ``sbatch``, follows the job by polling ``scontrol show job`` and
streams every rank's lines into the cell as ``[rank N] ...``. Each rank runs the worker wrapper, which writes
its own files into a run folder under ``cwd``: on a real cluster that folder must be on storage every node
and the notebook see (the home or project folder usually is). A failing rank is named with its traceback
(``diagnose.failure_error``); a job past ``timeout=`` or stalled (``diagnose.Watch``), or a cell interrupted,
is cancelled with ``scancel`` and waited for until ``squeue`` no longer lists it. ``SlurmJob`` is the part
that submits, polls and cancels any batch script, also one the reader wrote.

Why not submitit: its job watcher reads job states only through ``sacct``, which needs SLURM's accounting
database (small clusters, and the practice one, run without: "Slurm accounting storage is disabled"); it
pickles a Python function rather than running a script under torchrun; and it shows no rank's output live.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ddp_helpers import _protocol as protocol
from ddp_helpers import _strict, diagnose
from ddp_helpers._procs import live_processes
from ddp_helpers._run_folder import (
    LineFollower,
    Progress,
    RankFiles,
    dump_stacks,
    flush_output,
    follow,
    read_failure_records,
)
from ddp_helpers.launcher import PACKAGE_PARENT, LaunchOptions, check_count, check_flags
from ddp_helpers.outcome import Hang, TorchrunError, TorchrunResult

__all__ = ["SlurmJob", "SlurmResult", "job_processes", "practice_cluster_missing", "sbatch"]

JOB_RUN_TIMEOUT = 600.0  # seconds the job may run once it started (its time in the queue does not count)
WAIT_LIMIT = 600.0  # wait_until's bound unless the caller gives one: a bound for failures only
STATE_INTERVAL = 0.5  # how often scontrol is asked for the job's state while it runs
# Once a job is cancelled, SLURM signals its processes (SIGTERM, then SIGKILL KillWait seconds later, 30 by
# default) and lists it in squeue until they are gone: this only bounds a failure of SLURM itself.
CANCEL_WAIT = 300.0
LEFT_WAIT = 60.0  # once squeue no longer lists a job, how long its processes here get to be reaped
SCONTROL_TIMEOUT = 60.0  # one call of scontrol, squeue, sbatch or scancel: a bound for a dead slurmctld
# The states a job ends in (slurm.h's job_states; anything else means it is pending, running or completing).
ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
PRACTICE_MARK = "# written by ddp-notebooks tools/slurm_cluster.sh"  # the first line of the practice conf
PRACTICE_NODES = ["node1", "node2"]


def sbatch(
    script: str | os.PathLike,
    *args: object,
    nodes: int = 2,
    nproc_per_node: int = 1,
    timeout: float | None = JOB_RUN_TIMEOUT,
    stall_timeout: float | None = None,
    env: Mapping[str, object] | None = None,
    cwd: str | os.PathLike | None = None,
    live: bool | Iterable[int] = True,
    backend: str | None = None,
    torchrun_args: Sequence[str] = (),
    sbatch_args: Sequence[str] = (),
    show_script: bool = True,
    show_agent: bool = False,
) -> SlurmResult:
    """Run ``script`` under torchrun on ``nodes`` nodes of a SLURM cluster; stream each rank's lines live.

    - ``script``, ``*args``, ``nproc_per_node``, ``env``, ``live``, ``torchrun_args``, ``show_agent``: as for
      ``torchrun()``. ``backend``: handed to the script as ``DDP_BACKEND`` (None: the script chooses).
    - ``nodes``: how many nodes the job asks for; one ``torchrun`` runs on each, under ``srun``.
    - ``timeout``: seconds the job may run once SLURM started it (pending in the queue does not count; it
      is also the job's ``--time``, in minutes rounded up, plus one: SLURM ends it even if this kernel dies).
      ``stall_timeout``: as for ``torchrun()``. Either way the job is cancelled and the error names it.
    - ``cwd``: the folder the job runs in (default: the current one). The ranks write their files into a
      run folder under it, ``.ddp_helpers/``: on a real cluster it must be on a filesystem every node shares.
    - ``sbatch_args``: options for ``sbatch`` itself, e.g. ``["--partition=gpu", "--account=proj42"]``.
    - ``show_script``: print the batch script (to copy) and the ``sbatch`` command before submitting.

    Returns a ``SlurmResult``: a ``TorchrunResult`` (``records()``, per-rank ``stdout``/``stderr``,
    ``command``: the ``sbatch`` command to type) with the job's ``job_id``, ``state``, ``exit_code``,
    ``nodes`` and its ``batch_script``. Raises ``JobFailedError`` naming the failing rank with its
    traceback, or ``JobHungError``; both are ``TorchrunError``. The job is cancelled on a timeout, a stall
    or an interrupt, and the call returns only once ``squeue`` no longer lists it; its run folder is removed.
    """
    options = SbatchOptions(
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        timeout=timeout,
        stall_timeout=stall_timeout,
        env=env,
        cwd=cwd,
        live=live,
        backend=backend,
        torchrun_args=torchrun_args,
        sbatch_args=sbatch_args,
        show_script=show_script,
        show_agent=show_agent,
    )
    job = _plan(script, args, options)
    if options.show_script:
        print(
            f"ddp_helpers: the batch script, to save as {job.batch_name}:\n{job.batch_script_to_copy}",
            flush=True,
        )
        print(f"ddp_helpers: then type: {job.command}", flush=True)
    os.makedirs(job.run_dir)
    try:
        with open(os.path.join(job.run_dir, job.batch_name), "w", encoding="utf-8") as f:
            f.write(job.submitted_script)
        return _run(job)
    finally:
        shutil.rmtree(job.run_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(job.run_dir))  # .ddp_helpers/, once no other run uses it
        except OSError:
            pass


@dataclass
class SlurmResult(TorchrunResult):
    """A finished SLURM job: what ``TorchrunResult`` holds, and SLURM's word on the job."""

    job_id: str = ""
    state: str = ""  # JobState once it ended: COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: str = ""  # SLURM's ExitCode, "code:signal" of the batch script
    nodes: list[str] = field(default_factory=list)  # the job's nodes, in SLURM's order (node index)
    batch_script: str = ""  # the batch script to copy (as shown)


@dataclass(frozen=True, kw_only=True)
class SbatchOptions(LaunchOptions):
    """``sbatch()``'s options: those of ``LaunchOptions`` (``nnodes``, ``grace`` and ``warm`` are
    ``torchrun()``'s and keep their defaults here), and the job's ``nodes``, ``sbatch_args`` and
    ``show_script``. ``timeout`` counts from the moment SLURM runs the job."""

    nodes: int = 2
    timeout: float | None = JOB_RUN_TIMEOUT
    sbatch_args: Sequence[str] = ()
    show_script: bool = True

    def __post_init__(self) -> None:
        self._keep(nodes=check_count("nodes", self.nodes))
        super().__post_init__()
        self._keep(sbatch_args=tuple(check_flags(self.sbatch_args)))

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


@dataclass(frozen=True, kw_only=True)
class _SbatchPlan:
    """Everything an ``sbatch()`` launch needs, checked before anything is submitted."""

    options: SbatchOptions
    script_path: str
    run_dir: str
    batch_name: str
    batch_script_to_copy: str
    submitted_script: str
    command: str
    sbatch_argv: list[str]
    env: dict[str, str]
    gloo_pinned: bool = False  # gloo on every machine (``_strict``: what strict mode asks of a hang)


def _plan(script: str | os.PathLike, args: Sequence[object], options: SbatchOptions) -> _SbatchPlan:
    """Check the script and write the batch scripts (bad input fails here, before anything is submitted)."""
    script, script_path = options.script_path(script)
    if shutil.which("sbatch") is None:
        raise FileNotFoundError(
            "sbatch is not on PATH: this machine is not a SLURM login node. Run sbatch() where `sbatch` "
            "works (on a cluster's login node), or torchrun() to run on this machine."
        )
    stem = os.path.splitext(os.path.basename(script))[0]
    run_dir = os.path.join(options.cwd, ".ddp_helpers", f"slurm-{stem}-{uuid.uuid4().hex[:12]}")
    program = [script, *map(str, args)]
    shape = dict(
        nodes=options.nodes,
        nproc_per_node=options.nproc_per_node,
        timeout=options.timeout,
        torchrun_args=options.torchrun_args,
    )
    batch_name = f"{stem}.sbatch"
    backend = {"DDP_BACKEND": options.backend} if options.backend else {}
    return _SbatchPlan(
        options=options,
        script_path=script_path,
        run_dir=run_dir,
        batch_name=batch_name,
        batch_script_to_copy=batch_script(f"ddp-{stem}", program, **shape),
        submitted_script=batch_script(f"ddp-{stem}", program, run_dir=run_dir, **shape),
        command=shlex.join(["sbatch", *options.sbatch_args, batch_name]),
        sbatch_argv=["sbatch", "--parsable", *options.sbatch_args, os.path.join(run_dir, batch_name)],
        env=job_environment({**options.env, **backend}),
        gloo_pinned=_strict.gloo_pinned(options.backend, {**os.environ, **options.env}, script_path),
    )


def job_environment(env: Mapping[str, object] | None = None) -> dict[str, str]:
    """The environment to submit a job with (sbatch passes it on to every node, ``--export=ALL``): this
    process's, with ``env`` added, this Python's folder first on ``PATH`` (so the job's ``python3`` and
    ``torchrun`` are this kernel's), ``ddp_helpers`` importable, and unbuffered output."""
    job_env = {k: v for k, v in os.environ.items() if k not in protocol.LAUNCH_VARIABLES}
    job_env.update({str(k): str(v) for k, v in (env or {}).items()})
    python_dir = os.path.dirname(sys.executable)
    job_env["PATH"] = os.pathsep.join(p for p in (python_dir, job_env.get("PATH")) if p)
    job_env["PYTHONPATH"] = os.pathsep.join(p for p in (job_env.get("PYTHONPATH"), PACKAGE_PARENT) if p)
    job_env["PYTHONUNBUFFERED"] = "1"
    return job_env


def batch_script(
    name: str,
    program: Sequence[str],
    *,
    nodes: int,
    nproc_per_node: int,
    timeout: float | None,
    torchrun_args: Sequence[str] = (),
    run_dir: str | None = None,
) -> str:
    """The batch script: one torchrun per node under srun, c10d rendezvous at the first node, on a port free
    there. Without ``run_dir``, the one to copy (output in ``slurm-JOBID.out``); with it, the one ``sbatch()``
    submits, which differs only in where output goes and in running each rank through the worker wrapper
    (``-m ddp_helpers._worker``) and each agent as ``python -m ddp_helpers._agent`` (torch's own torchrun,
    which also writes torch's failure record)."""
    lines = [
        "#!/bin/bash",
        f"# {name}: one torchrun per node, meeting through c10d rendezvous at the first node",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if timeout is not None:
        # A minute after ours: SLURM's own bound.
        lines.append(f"#SBATCH --time={math.ceil(timeout / 60) + 1}")
    if run_dir is not None:
        lines.append(f"#SBATCH --output={os.path.join(run_dir, 'batch.out')}")
    lines += [
        "set -euo pipefail",
        "# SLURM runs this script on the first node of the job: the rendezvous' host, on a port free there.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'port=$(python3 -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
        "print(s.getsockname()[1])')",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # torch 2.14: a store per attempt (restart, late node)",
    ]
    flags = [
        f'--nnodes="$SLURM_NNODES" --nproc-per-node={nproc_per_node}',
        '--rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID"',
    ]
    if torchrun_args:
        flags.append(shlex.join(torchrun_args))
    if run_dir is None:
        srun = "srun --kill-on-bad-exit=0 torchrun"
        runs = shlex.join(program)
    else:
        logs = shlex.quote(os.path.join(run_dir, "agent%n"))
        lines.append(f"export {protocol.RUN_DIR}={shlex.quote(run_dir)}")
        outputs = f"--output={logs}.stdout --error={logs}.stderr"
        srun = f"srun --kill-on-bad-exit=0 {outputs} \\\n  python3 -m ddp_helpers._agent"
        runs = shlex.join(["-m", "ddp_helpers._worker", *program])
    lines.append(" \\\n  ".join([srun, *flags, runs]))
    return "\n".join(lines) + "\n"


def _run(job: _SbatchPlan) -> SlurmResult:
    """Submit the planned job and follow it to its end, as ``torchrun()`` follows a launch."""
    options = job.options
    ranks = [RankFiles(job.run_dir, r, r in options.live) for r in range(options.world_size)]
    with SlurmJob.submit(job.sbatch_argv, cwd=options.cwd, env=job.env) as slurm:
        print(f"ddp_helpers: submitted job {slurm.id} ({options.world_size} rank(s))", flush=True)
        clock = _JobClock(slurm, options)

        def look() -> Progress:
            new_lines = any([r.poll() for r in ranks])
            if new_lines:
                flush_output()
            return Progress(new_lines, clock.ended(time.monotonic()), all(r.printed for r in ranks))

        hang = follow(look, clock)
        hung = _hung_ranks(ranks, slurm) if hang else []
        if hang:
            slurm.cancel()
        slurm.wait_gone()
    for rank in ranks:
        rank.finish()
    result, evidence = _result(job, slurm, ranks)
    if hang:
        _strict.raise_checked(
            _cancelled(diagnose.hang_error(result, hang, hung, job.script_path), slurm.id), job.gloo_pinned
        )
    if slurm.state != "COMPLETED":
        error = diagnose.failure_error(result, evidence)
        if error.rank is None:
            error = type(error)(f"job {slurm.id} ended {slurm.state} ({slurm.exit_code}); {error}", result)
        _strict.raise_checked(error, job.gloo_pinned)
    print(f"ddp_helpers: job {slurm.id} {slurm.state}; squeue no longer lists it", flush=True)
    return result


class _JobClock:
    """The job's state, asked of scontrol every ``STATE_INTERVAL``, and ``diagnose.Watch`` from the moment
    SLURM runs the job: its time in the queue never counts toward a timeout or a stall."""

    def __init__(self, slurm: SlurmJob, options: SbatchOptions):
        self.slurm, self.options = slurm, options
        self.watch: diagnose.Watch | None = None
        self.last_asked, self.said_pending = 0.0, False

    def ended(self, now: float) -> bool:
        """Whether the job has ended; on the way, say once why it waits in the queue, and start the Watch
        once it runs."""
        if now - self.last_asked <= STATE_INTERVAL:
            return False
        self.last_asked = now
        state = self.slurm.poll()
        if state in ENDED:
            return True
        if state == "PENDING" and self.slurm.reason not in (None, "None") and not self.said_pending:
            print(f"ddp_helpers: job {self.slurm.id} waits in the queue ({self.slurm.reason})", flush=True)
            self.said_pending = True
        # It runs: count from now.
        if self.watch is None and state not in ("PENDING", "CONFIGURING", None):
            self.watch = diagnose.Watch(now, self.options.timeout, self.options.stall_timeout)
        return False

    def check(self, now: float, new_lines: bool, every_rank_printed: bool) -> Hang | None:
        """The ``Hang`` once the job, since it started to run, has passed its timeout or stalled."""
        return None if self.watch is None else self.watch.check(now, new_lines, every_rank_printed)


def _result(
    job: _SbatchPlan, slurm: SlurmJob, ranks: Sequence[RankFiles]
) -> tuple[SlurmResult, dict[int, diagnose.RankEvidence]]:
    """The ended job's result, with the agents' and the batch script's own lines, and each rank's evidence."""
    echo_to = sys.stderr if job.options.show_agent else None
    logs = [
        LineFollower(protocol.agent_file(job.run_dir, i, kind), f"[torchrun node {i}] ", echo_to)
        for i in range(len(slurm.node_list))
        for kind in ("stdout", "stderr")
    ]
    logs.append(LineFollower(os.path.join(job.run_dir, "batch.out"), "[batch] ", echo_to))
    for log in logs:
        log.finish()
    failures = read_failure_records(job.run_dir, len(slurm.node_list))
    ok = slurm.state == "COMPLETED"
    evidence = {r.rank: r.evidence(failure=failures.get(r.rank), agents_ok=ok) for r in ranks}
    result = SlurmResult(
        job.command,
        0 if ok else exit_status(slurm.exit_code),
        slurm.duration,
        {r.rank: r.stdout.lines for r in ranks},
        {r.rank: r.stderr.lines for r in ranks},
        {r: e.exitcode for r, e in evidence.items()},
        [line for log in logs for line in log.lines],
        job_id=slurm.id,
        state=slurm.state or "",
        exit_code=slurm.exit_code or "",
        nodes=slurm.node_list,
        batch_script=job.batch_script_to_copy,
    )
    return result, evidence


def _cancelled(error: TorchrunError, job_id: str) -> TorchrunError:
    error.args = (f"{error.args[0]}\nThe job {job_id} was cancelled (scancel); squeue no longer lists it.",)
    return error


def _hung_ranks(ranks: Sequence[RankFiles], slurm: SlurmJob) -> list[diagnose.RankEvidence]:
    """Every rank's evidence for a hang, with a stack dump from each rank whose process this machine sees (on
    the practice cluster, all; on a real cluster the ranks run on other machines, and none come back)."""
    for rank in ranks:
        rank.poll()
        rank.stderr.mute()
    here = set(job_processes(slurm.id))  # a pid from another machine must never be signalled here
    signalled = [r if r.pid() in here else _Elsewhere(r) for r in ranks]
    stacks = dump_stacks(signalled, lambda: any([r.poll() for r in ranks]))
    return [rank.evidence(alive=rank.rank in stacks, stack=stacks.get(rank.rank) or None) for rank in ranks]


class _Elsewhere:
    """A rank whose process runs on another machine: no pid to signal from here."""

    def __init__(self, rank: RankFiles):
        self.rank, self.stderr = rank.rank, rank.stderr

    def pid(self) -> None:
        return None


# ---- SLURM's side: a job, its state, its processes -------------------------------------------------------


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o ID``'s one line as a dict. Values hold no spaces, except a few at the end of
    the line (``Command=``, ``WorkDir=`` paths, ``Comment=``), which keep everything up to the next field."""
    fields: dict[str, str] = {}
    key = None
    for word in text.strip().split(" "):
        match = re.match(r"^([A-Za-z][A-Za-z0-9_:/]*)=(.*)$", word)
        if match:
            key = match[1]
            fields[key] = match[2]
        elif key is not None and word:
            fields[key] += " " + word  # a value with a space in it
    return fields


def exit_status(exit_code: str | None) -> int:
    """A return code from SLURM's ``ExitCode=code:signal``: the code, or minus the signal; 1 if unknown."""
    match = re.fullmatch(r"(\d+):(\d+)", exit_code or "")
    if not match:
        return 1
    code, sig = int(match[1]), int(match[2])
    return -sig if sig else (code or 1)


def _slurm(
    *argv: str, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT, env=env, cwd=cwd)


def wait_until(condition: Callable[[], object], within: float = WAIT_LIMIT) -> object:
    """Poll ``condition`` until it returns something falsy or ``within`` seconds pass (a bound for failures
    only); its last answer."""
    end = time.monotonic() + within
    while (answer := condition()) and time.monotonic() < end:
        time.sleep(0.2)
    return answer


class SlurmJob:
    """One batch job: submit it, follow its state through ``scontrol show job`` (which needs no accounting
    database), cancel it. Leaving its ``with`` block cancels it if it still runs, waits until ``squeue`` no
    longer lists it, then until none of its processes is left on this machine (a leftover is killed, and
    named in a RuntimeError)."""

    def __init__(self, job_id: str, command: Sequence[str] = ()):
        self.id = job_id
        self.command = list(command)
        self.state: str | None = None
        self.exit_code: str | None = None
        self.reason: str | None = None
        self.node_list: list[str] = []
        self.shown: dict[str, str] = {}  # scontrol's fields at the last look that found the job
        self.start = time.monotonic()
        self.duration = 0.0

    @classmethod
    def submit(
        cls, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> SlurmJob:
        """Run ``argv`` (``sbatch --parsable ...``) and follow the job it queued."""
        done = _slurm(*argv, env=env, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
        return cls(done.stdout.strip().split(";")[0], argv)

    def show(self) -> dict[str, str]:
        """``scontrol show job``'s fields; empty once slurmctld forgot the job (MinJobAge after its end)."""
        return parse_scontrol(_slurm("scontrol", "show", "job", "-o", self.id).stdout)

    def poll(self) -> str | None:
        """The job's state now (None if slurmctld does not know it); its exit code and nodes once known."""
        fields = self.show()
        if fields:
            self.shown = fields
            self.state, self.reason = fields.get("JobState"), fields.get("Reason")
            if fields.get("NodeList") not in (None, "", "(null)") and not self.node_list:
                listed = _slurm("scontrol", "show", "hostnames", fields["NodeList"]).stdout
                self.node_list = listed.split()
            if self.state in ENDED:
                self.exit_code = fields.get("ExitCode")
                self.duration = time.monotonic() - self.start
        return self.state

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for the job's end (polling scontrol: ``sbatch --wait`` looks after 2 s, 8 s, then every 32 s);
        after ``timeout`` seconds, cancel it and raise TimeoutError."""
        if wait_until(lambda: self.poll() not in ENDED, math.inf if timeout is None else timeout):
            self.cancel()
            self.wait_gone()
            raise TimeoutError(f"job {self.id} had not ended after {timeout:g} s: it was cancelled")
        return self.state

    def queued(self) -> bool:
        """Whether squeue lists the job (pending, running or completing)."""
        listed = _slurm("squeue", "-h", "-j", self.id, "-o", "%i").stdout
        return self.id in listed.split()

    def cancel(self) -> None:
        if self.queued():
            _slurm("scancel", self.id)

    def wait_gone(self) -> None:
        """Wait until squeue no longer lists the job; RuntimeError if SLURM does not let it go."""
        if wait_until(self.queued, CANCEL_WAIT):
            raise RuntimeError(
                f"job {self.id} is still in squeue {CANCEL_WAIT:g} s after it ended or was cancelled"
            )
        self.poll()

    def nodes(self) -> list[str]:
        """The job's nodes in SLURM's order (srun's ``%n``, ``SLURM_NODEID``); empty before it has them."""
        if not self.node_list:
            self.poll()
        return self.node_list

    def processes(self) -> dict[int, tuple[str, dict[str, str]]]:
        """The job's live processes on this machine (``job_processes``)."""
        return job_processes(self.id)

    def __enter__(self) -> SlurmJob:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Runs on success, failure, timeout and KeyboardInterrupt alike: the job never outlives the block.
        if self.queued():
            _slurm("scancel", self.id)
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                print(
                    f"ddp_helpers: interrupted; job {self.id} cancelled (scancel)",
                    file=sys.stderr,
                    flush=True,
                )
        self.wait_gone()
        # SLURM is done with the job: nothing of it may live on here (a login node runs none of it).
        left = wait_until(self.processes, LEFT_WAIT)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left and exc_type is None:  # else the error in flight is the one to read
            commands = [cmdline for cmdline, _ in left.values()]
            raise RuntimeError(f"processes of job {self.id} outlived it (now killed): {commands}")


def job_processes(job_id: str) -> dict[int, tuple[str, dict[str, str]]]:
    """pid: (command line, environment) of each live process of the job on this machine (its slurmstepd, the
    batch shell, srun, every torchrun agent and rank), read from /proc as ps does. On a login node: none."""
    return {
        p.pid: (p.cmdline, p.env)
        for p in live_processes()
        if p.env.get("SLURM_JOB_ID") == job_id or p.cmdline.startswith(f"slurmstepd: [{job_id}.")
    }


def practice_cluster_missing(conf: str | None = None) -> str | None:
    """None where the practice cluster of ``tools/slurm_cluster.sh`` answers (its ``slurm.conf`` starts with
    its mark, sinfo lists node1 and node2); else why not, in one line. A real cluster never passes for it."""
    conf = conf or os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if shutil.which("sbatch") is None:
        return "no SLURM here: skipped (`sudo tools/slurm_cluster.sh up` starts a practice cluster)"
    try:
        with open(conf, encoding="utf-8") as f:
            practice = f.readline().startswith(PRACTICE_MARK)
    except OSError:  # no file: a cluster configured some other way
        practice = False
    if not practice:
        return f"this SLURM is a real cluster, not the practice one ({conf}): nothing submitted"
    try:
        sinfo = _slurm("sinfo", "-h", "-N", "-o", "%N").stdout
    except subprocess.TimeoutExpired:
        sinfo = "(no answer)"
    if sorted(set(sinfo.split())) == PRACTICE_NODES:
        return None
    return f"the practice SLURM cluster does not answer (sinfo: {sinfo.strip()!r})"
