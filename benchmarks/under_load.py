"""The whole test suite on a busy machine: pytest while CPU-bound processes keep every core busy.

Learners run the notebooks on laptops doing other things; a wait that encodes a quiet machine's speed
fails there. This starts one busy-looping process per core (``--hogs``, default: the cores this process
may use), runs the README's test suite (``python -m pytest``) ``--runs`` times in a row, and prints each
run's outcome and wall time, then stops the hogs. Exit code 0 only if every run passed.
Usage: ``python benchmarks/under_load.py [--runs 3] [--hogs N] [pytest args...]``
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=len(os.sched_getaffinity(0)))
    args, pytest_args = parser.parse_known_args()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.hogs)
    ]
    outcomes = []
    try:
        for run in range(1, args.runs + 1):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
            outcomes.append(done.returncode == 0)
            outcome = "passed" if done.returncode == 0 else "FAILED"
            seconds = time.perf_counter() - start
            print(
                f"run {run}: {outcome} in {seconds:.0f} s with {args.hogs} busy process(es): {summary}",
                flush=True,
            )
            if done.returncode != 0:
                print(done.stdout[-4000:], flush=True)
    finally:
        for hog in hogs:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()
    print(f"{sum(outcomes)} of {len(outcomes)} runs passed under load")
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
