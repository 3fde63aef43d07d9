"""Notebook 05's SLURM restart, repeated: does the job resume to the end every time?

Submits notebook 05's batch script (``notebooks/scripts/05_slurm.sbatch``) ``--runs`` times to the practice
cluster of ``tools/slurm_cluster.sh``, each time as notebook 05 section 7 does: ``--max-restarts=1`` and
``05_elastic.py`` with rank 1 crashing at the start of epoch 2. A run passes when the job COMPLETED, each
node started twice (at epochs 0 and 2), the two attempts met at two different ports, and both ranks ended
with the weights of an uninterrupted two-rank run (made first, with plain ``torchrun --standalone``). A race
that fails one run in three passes most single tries; this is the check that catches it. Prints one line
per run and the tally; exit code 0 only if every run passed, 2 where there is no practice cluster.
Usage: ``python benchmarks/slurm_restart.py [--runs 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "notebooks" / "scripts"
CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
MARK = "# written by ddp-notebooks tools/slurm_cluster.sh"  # the first line of the practice cluster's conf
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
SAFETY = 600  # seconds: only bounds a failure (the job is cancelled and named)


def practice_cluster_missing() -> str | None:
    try:
        first = CONF.read_text().splitlines()[0]
    except (OSError, IndexError):
        first = ""
    if not first.startswith(MARK):
        return f"{CONF} is not the practice cluster's: `sudo tools/slurm_cluster.sh up` starts one"
    return None


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def baseline_weights(folder: str) -> list[float]:
    """The weights of an uninterrupted run of 05_elastic.py on two ranks of this machine."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(SCRIPTS / "05_elastic.py"), "--snapshot", os.path.join(folder, "baseline.pt")],
        capture_output=True,
        text=True,
        env={**os.environ, "DDP_BACKEND": "gloo"},
        timeout=SAFETY,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the baseline run failed:\n{done.stderr[-3000:]}")
    return next(r["weights"] for r in records(done.stdout) if r["event"] == "done")


def job_state(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
    ).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def one_run(folder: str, expected: list[float]) -> str:
    """Submit the job, wait for its end, and say what was wrong with it (empty when nothing was)."""
    env = {
        **os.environ,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "DDP_BACKEND": "gloo",
    }
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={folder}", str(SCRIPTS / "05_slurm.sbatch"), "--max-restarts=1"]
        + [str(SCRIPTS / "05_elastic.py"), "--snapshot", os.path.join(folder, "snapshot.pt")]
        + ["--crash-at-epoch", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if submitted.returncode != 0:
        return f"sbatch failed: {submitted.stderr.strip()}"
    job_id = submitted.stdout.strip().split(";")[0]
    end = time.monotonic() + SAFETY
    while (state := job_state(job_id)).get("JobState") not in ENDED:
        if time.monotonic() > end:
            subprocess.run(["scancel", job_id], timeout=60)
            return f"job {job_id} had not ended after {SAFETY} s: cancelled"
        time.sleep(0.2)
    outputs = []
    for index in (0, 1):
        path = Path(folder) / f"slurm-{job_id}-node{index}.out"
        outputs.append(path.read_text() if path.exists() else "")
    per_node = [records(text) for text in outputs]
    starts = [[(r["start_epoch"], r["master_port"]) for r in rs if r["event"] == "start"] for rs in per_node]
    done = [r["weights"] for rs in per_node for r in rs if r["event"] == "done"]
    problems = []
    if (state["JobState"], state["ExitCode"]) != ("COMPLETED", "0:0"):
        problems.append(f"job {job_id} {state['JobState']} {state['ExitCode']}")
    if [[epoch for epoch, _ in s] for s in starts] != [[0, 2], [0, 2]]:
        problems.append(f"start epochs {starts}")
    else:
        ports = [{s[attempt][1] for s in starts} for attempt in (0, 1)]
        if len(ports[0]) != 1 or len(ports[1]) != 1 or ports[0] == ports[1]:
            problems.append(f"ports {starts}")  # each attempt, one store of its own
    if done != [expected, expected]:
        problems.append("weights differ from the uninterrupted run's")
    if problems:
        errors = [line for text in outputs for line in text.splitlines() if re.search(r"Error|error", line)]
        return "; ".join(problems) + "\n    " + "\n    ".join(errors[-6:])
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    missing = practice_cluster_missing()
    if missing:
        print(f"slurm_restart.py: {missing}", file=sys.stderr)
        return 2
    passed = 0
    runs = ROOT / "notebooks" / "runs"  # git ignores it; every node of the practice cluster sees it
    runs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slurm_restart_", dir=runs) as folder:
        expected = baseline_weights(folder)
        for run in range(1, args.runs + 1):
            run_folder = tempfile.mkdtemp(dir=folder)
            start = time.perf_counter()
            problem = one_run(run_folder, expected)
            passed += not problem
            outcome = "resumed to the end" if not problem else f"FAILED: {problem}"
            print(f"run {run}: {outcome} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{passed} of {args.runs} runs resumed to the end")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
