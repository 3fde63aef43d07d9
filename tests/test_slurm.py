"""ddp_helpers.sbatch() on the practice SLURM cluster of tools/slurm_cluster.sh (two nodes, a torchrun on
each): a good job, a failing rank, a timeout and an interrupt, each leaving nothing behind; its pure parts.

Notebook 05 section 7 runs the batch scripts a reader copies on the same cluster and asserts, per node, where
each rank ran; these tests do not repeat it. Without the cluster they skip in one line; with
DDP_REQUIRE_SLURM=1 (.ci/run sets it) they fail instead. They never submit to a real cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from ddp_test_support import REPO, at_line, clocks_start_when, in_native_call

NODES = ["node1", "node2"]
HELLO = REPO / "notebooks" / "scripts" / "00_hello.py"
WAIT = 300  # seconds: only bounds a failure (a hung job is cancelled and named), never part of a result
# A job's own bounds add up past the suite's 600 s (its timeout, then up to CANCEL_WAIT = 300 s for squeue to
# let it go and LEFT_WAIT = 60 s for its processes): the job's own error, not pytest-timeout, is what a
# failure shows.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster():
    from ddp_helpers.slurm import practice_cluster_missing

    reason = practice_cluster_missing()
    if reason is not None:
        if os.environ.get(
            "DDP_REQUIRE_SLURM"
        ):  # CI sets it: there, a missing cluster is a failure, not a skip
            pytest.fail(reason)
        pytest.skip(reason)


def test_both_nodes_idle(cluster):
    from ddp_helpers.slurm import _slurm, wait_until

    def busy() -> dict[str, str]:
        shown = _slurm("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return {
            node: state for node, state in (line.split() for line in shown.splitlines()) if state != "idle"
        }

    assert wait_until(busy, within=WAIT) == {}, "a node of the practice cluster is not idle"


# ---- ddp_helpers.slurm: the pure parts, without SLURM ----------------------------------------------------

SCONTROL_LINE = (
    "JobId=70 JobName=ddp-05 UserId=root(0) GroupId=root(0) MCS_label=N/A JobState=RUNNING Reason=None "
    "ExitCode=0:0 RunTime=00:00:03 TimeLimit=00:10:00 AllocNode:Sid=localhost:7984 NodeList=node[1-2] "
    "BatchHost=node1 NumNodes=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "Command=scripts/05_slurm.sbatch --nnodes=1:2 /work/x/05_elastic.py --snapshot /work/x/s.pt "
    "WorkDir=/work/x/slurm_1 StdOut=/work/x/slurm_1/slurm-70.out Power= \n"
)


def test_parse_scontrol_keeps_values_with_spaces():
    from ddp_helpers.slurm import parse_scontrol

    shown = parse_scontrol(SCONTROL_LINE)
    assert shown["JobId"] == "70" and shown["JobState"] == "RUNNING" and shown["ExitCode"] == "0:0"
    assert shown["NodeList"] == "node[1-2]" and shown["AllocNode:Sid"] == "localhost:7984"
    assert shown["CPUs/Task"] == "1" and shown["ReqB:S:C:T"] == "0:0:*:*"
    assert (
        shown["Command"]
        == "scripts/05_slurm.sbatch --nnodes=1:2 /work/x/05_elastic.py --snapshot /work/x/s.pt"
    )
    assert shown["WorkDir"] == "/work/x/slurm_1" and shown["Power"] == ""
    assert parse_scontrol("") == {}  # a job slurmctld no longer knows


def test_exit_status_from_slurm_exit_code():
    from ddp_helpers.slurm import exit_status

    assert [exit_status(c) for c in ("0:0", "1:0", "0:15", "2:9")] == [1, 1, -15, -9]
    assert exit_status(None) == exit_status("garbage") == 1  # "unknown" is a failure, never a success


def test_batch_script_to_copy_and_as_submitted():
    from ddp_helpers.slurm import batch_script

    options = dict(nodes=2, nproc_per_node=4, timeout=90, torchrun_args=["--max-restarts=1"])
    shown = batch_script("ddp-train", ["scripts/train.py", "--lr", "a b"], **options)
    lines = shown.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert {"#SBATCH --job-name=ddp-train", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1"} <= set(lines)
    assert "#SBATCH --time=3" in lines  # 90 s: 2 minutes rounded up, plus one, so SLURM's bound comes last
    assert "set -euo pipefail" in lines and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shown
    command = shown.split("srun ", 1)[1].replace("\\\n", " ")
    words = command.split()
    assert words[:2] == ["--kill-on-bad-exit=0", "torchrun"], words
    assert '--rdzv-endpoint="$head:$port"' in words and '--rdzv-id="$SLURM_JOB_ID"' in words
    assert "--nproc-per-node=4" in words and words.index("--max-restarts=1") < words.index("scripts/train.py")
    assert command.rstrip().endswith("scripts/train.py --lr 'a b'"), command  # quoted for the shell
    assert "ddp_helpers" not in shown and "--output" not in shown  # nothing of the launcher in the copy

    run_dir = "/shared/home/me/.ddp_helpers/slurm-train-1"
    submitted = batch_script("ddp-train", ["scripts/train.py", "--lr", "a b"], run_dir=run_dir, **options)
    assert f"#SBATCH --output={run_dir}/batch.out" in submitted
    assert f"export DDP_HELPERS_RUN_DIR={run_dir}" in submitted
    assert f"--output={run_dir}/agent%n.stdout --error={run_dir}/agent%n.stderr" in submitted
    assert "python3 -m ddp_helpers._agent" in submitted
    assert submitted.rstrip().endswith("-m ddp_helpers._worker scripts/train.py --lr 'a b'"), submitted
    shared = [line for line in shown.splitlines() if not line.startswith("srun") and "torchrun" not in line]
    assert all(line in submitted.splitlines() for line in shared[:-3]), (shown, submitted)  # the same job
    assert "#SBATCH --time" not in batch_script("x", ["s.py"], nodes=1, nproc_per_node=1, timeout=None)


def test_sbatch_checks_its_input_before_submitting(tmp_path: Path, monkeypatch):
    from ddp_helpers import slurm

    (tmp_path / "s.py").write_text("print('hi')\n")
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")

    def plan(script: str, args: tuple = (), **options: object):
        return slurm._plan(script, args, slurm.SbatchOptions(**options))

    job = plan("s.py", ("--n", 3), nodes=3, nproc_per_node=2, cwd=tmp_path, sbatch_args=["-p", "gpu"])
    assert job.options.world_size == 6 and job.command == "sbatch -p gpu s.sbatch", job.command
    assert job.run_dir.startswith(str(tmp_path / ".ddp_helpers" / "slurm-s-")), job.run_dir
    assert job.sbatch_argv[-1] == os.path.join(job.run_dir, "s.sbatch") and "--parsable" in job.sbatch_argv
    assert job.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)  # the kernel's torchrun
    assert "DDP_HELPERS_PARENT_PID" not in job.env  # no lifeline across nodes: scancel and --time instead
    with pytest.raises(FileNotFoundError, match="not found"):
        plan("missing.py", cwd=tmp_path)
    with pytest.raises(ValueError, match="nodes must be at least 1"):
        plan("s.py", nodes=0, cwd=tmp_path)
    with pytest.raises(TypeError, match="one string per flag"):
        plan("s.py", cwd=tmp_path, sbatch_args="-p gpu")
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="not a SLURM login node"):
        plan("s.py", cwd=tmp_path)


def test_a_hang_never_signals_a_pid_that_is_not_the_jobs_here(tmp_path: Path):
    """On a real cluster a rank's pid is another machine's: the stack dump must not signal this one's."""
    from ddp_helpers import _protocol as protocol
    from ddp_helpers._run_folder import RankFiles
    from ddp_helpers.slurm import SlurmJob, _hung_ranks

    start = {"event": "start", "pid": os.getpid(), "pgid": os.getpgid(0), "time": 0.0}  # this very process
    for rank in (0, 1):
        Path(protocol.rank_file(str(tmp_path), rank, "status")).write_text(json.dumps(start) + "\n")
    ranks = [RankFiles(str(tmp_path), rank, False) for rank in (0, 1)]
    records = _hung_ranks(ranks, SlurmJob("0"))  # no process of a job 0 here: SIGUSR1 would end pytest
    assert [(r.started, r.alive, r.stack) for r in records] == [(True, False, None)] * 2, records


# ---- ddp_helpers.slurm.sbatch on the practice cluster --------------------------------------------------

FAILS = """\
import torch.distributed as dist
dist.init_process_group("gloo")
print("hello from", dist.get_rank(), flush=True)
if dist.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
dist.barrier()
"""

SLEEPS = """\
import time
import torch.distributed as dist
dist.init_process_group("gloo")
print("hello from", dist.get_rank(), flush=True)
if dist.get_rank() == 1:
    time.sleep(3600)
dist.barrier()
"""


def _left_behind(job_id: str) -> tuple[bool, dict]:
    from ddp_helpers.slurm import SlurmJob, job_processes

    return SlurmJob(job_id).queued(), job_processes(job_id)


def test_sbatch_runs_a_job_on_both_nodes(cluster, tmp_path: Path, capsys):
    from ddp_helpers import TorchrunResult, sbatch

    shutil.copy(HELLO, tmp_path / "hello.py")
    result = sbatch("hello.py", "--steps", "2", nodes=2, nproc_per_node=2, cwd=tmp_path, timeout=WAIT)
    shown = capsys.readouterr().out
    assert isinstance(result, TorchrunResult) and result.state == "COMPLETED" and result.returncode == 0
    assert result.command == "sbatch hello.sbatch" and result.batch_script in shown  # shown, to copy
    assert sorted(result.nodes) == NODES, result.nodes
    records = result.records()
    assert sorted({r["rank"] for r in records}) == [0, 1, 2, 3] and len(records) == 8, records
    assert all(r["sum"] == 10.0 and r["world_size"] == 4 for r in records), records  # one group of four
    for rank in range(4):  # each rank's lines, streamed with its prefix
        assert f'[rank {rank}] {{"rank": {rank}' in shown, shown
    assert _left_behind(result.job_id) == (False, {})
    assert not (tmp_path / ".ddp_helpers").exists()  # the run folder went with the job


def test_sbatch_names_the_failing_rank_and_its_traceback(cluster, tmp_path: Path):
    from ddp_helpers import JobFailedError, TorchrunError, sbatch

    (tmp_path / "fails.py").write_text(FAILS)
    with pytest.raises(TorchrunError) as caught:
        sbatch("fails.py", nodes=2, cwd=tmp_path, timeout=WAIT, show_script=False)
    err = caught.value
    assert isinstance(err, JobFailedError) and err.rank == 1 and err.exitcode == 1, err
    assert str(err).startswith("rank 1 raised ValueError (exit code 1)"), err
    assert 'fails.py", line 5' in str(err) and "ValueError: rank 1 fails on purpose" in str(err), err
    assert err.result.state == "FAILED" and err.result.returncode != 0, err.result
    assert _left_behind(err.result.job_id) == (False, {})


def test_sbatch_cancels_a_job_past_its_timeout(cluster, tmp_path: Path):
    from ddp_helpers import JobHungError, sbatch
    from ddp_helpers._run_folder import RankFiles
    from ddp_helpers.outcome import Hang

    (tmp_path / "sleeps.py").write_text(SLEEPS)

    def at_their_places() -> bool:
        """Rank 1 sleeps at sleeps.py:6; rank 0 is inside the barrier's C++ wait (both nodes are this machine,
        so py-spy reads every rank; each rank's pid is in its status file in the job's run folder)."""
        run_dirs = list((tmp_path / ".ddp_helpers").glob("slurm-sleeps-*"))
        if len(run_dirs) != 1:
            return False
        ranks = [RankFiles(str(run_dirs[0]), r, False) for r in (0, 1)]
        for rank in ranks:
            rank.poll()
        pid0, pid1 = (rank.pid() for rank in ranks)
        return (
            pid0 is not None
            and pid1 is not None
            and at_line(pid1, "sleeps.py", 6)
            and in_native_call(pid0, "c10d::Work::wait", "barrier", at=("sleeps.py", 7))
        )

    # sbatch()'s timeout counts from the moment SLURM runs the job, so it also covers two cold agents and two
    # cold ranks importing torch, however long this machine takes. Here it counts from the moment both ranks
    # are at their places instead: the stack dumps then find them where the assertions say. SLURM's own
    # --time (the timeout plus a minute, from the job's start) is lifted far above that, for the same reason.
    with clocks_start_when(at_their_places), pytest.raises(JobHungError) as caught:
        sbatch("sleeps.py", nodes=2, cwd=tmp_path, timeout=5, sbatch_args=["--time=15"], show_script=False)
    err = caught.value
    assert err.hang == Hang("timeout", 5), err.hang
    assert err.timed_out and err.stuck_ranks == [1], err  # the stack dumps say who never reached the barrier
    assert "rank 0 waits in torch.distributed `barrier`" in str(err), err
    assert f"The job {err.result.job_id} was cancelled (scancel)" in str(err), err
    assert err.result.state == "CANCELLED", err.result.state
    assert _left_behind(err.result.job_id) == (False, {})  # squeue no longer lists it; no process of it here


class _InterruptAt:
    """A stdout that raises KeyboardInterrupt, as a cell interrupt does, once a given line is printed."""

    def __init__(self, line: str):
        self.line, self.text = line, ""

    def write(self, text: str) -> int:
        self.text += text
        if self.line in self.text:
            self.line = "\0never again"  # once: the launcher's own clean-up may print too
            raise KeyboardInterrupt
        return len(text)

    def flush(self) -> None:
        pass


def test_sbatch_cancels_a_job_on_keyboard_interrupt(cluster, tmp_path: Path, monkeypatch):
    from ddp_helpers import sbatch

    (tmp_path / "sleeps.py").write_text(SLEEPS)
    out = _InterruptAt("[rank 1] hello from 1")  # the interrupt comes while the job runs
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(KeyboardInterrupt):
        sbatch("sleeps.py", nodes=2, cwd=tmp_path, timeout=WAIT, show_script=False)
    monkeypatch.undo()
    job_id = re.search(r"submitted job (\d+)", out.text)[1]
    assert _left_behind(job_id) == (False, {})  # cancelled, gone from squeue, no process of it here
    assert not (tmp_path / ".ddp_helpers").exists()
