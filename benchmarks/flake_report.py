"""The flake report: chosen tests run N times, beside CPU hogs if asked, and the failures counted per test.

A test that fails once in twenty runs fails someone's CI every week; only many runs on a busy machine find
it. This starts ``--hogs`` busy-looping processes (default 1), runs pytest ``--runs`` times in a row on the
tests given (default: the README's whole suite), and prints each run's outcome, then every test that failed
or errored at least once with its count, its first message, and the runs it failed in. Each run's JUnit
report stays in ``--keep`` (default build/flake-report/) for the tracebacks. A run that ends before its
last test (a KeyboardInterrupt, a crash of pytest) counts as a failure of the run. Exit code 0 only if
every test of every run passed.

Usage: ``python benchmarks/flake_report.py [--runs 20] [--hogs 1] [pytest args, e.g. tests/test_ranks.py]``
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """One pytest run: its exit code, wall time, how many tests ran, and the failed ones with a message."""

    returncode: int
    seconds: float
    tests: int
    failed: dict[str, str] = field(default_factory=dict)


def read_report(path: Path) -> tuple[int, dict[str, str]]:
    """How many tests a JUnit report lists, and each failed or errored one with its first message line."""
    if not path.exists():
        return 0, {}
    tests, failed = 0, {}
    for case in ET.parse(path).iter("testcase"):
        tests += 1
        name = f"{case.get('classname', '?')}::{case.get('name', '?')}"
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                message = (found.get("message") or found.text or "").strip().splitlines()
                failed.setdefault(name, f"{kind}: {message[0][:160] if message else '(no message)'}")
    return tests, failed


def run_pytest(pytest_args: list[str], report: Path) -> Run:
    """pytest once, as the README runs it, from the repository root; its outcome."""
    report.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *pytest_args,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tests, failed = read_report(report)
    return Run(done.returncode, time.perf_counter() - start, tests, failed)


def start_hogs(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep a core busy each, every one in a session of its own."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]


def summary(runs: list[Run]) -> list[str]:
    """The report's lines: the tests that failed at least once, most often first."""
    counts: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    where: dict[str, list[int]] = collections.defaultdict(list)
    for number, run in enumerate(runs, 1):
        for name, message in run.failed.items():
            counts[name] += 1
            first.setdefault(name, message)
            where[name].append(number)
    most = max((run.tests for run in runs), default=0)
    short = [n for n, run in enumerate(runs, 1) if run.tests < most]
    lines = [f"{len(runs)} run(s); {sum(1 for r in runs if r.returncode == 0)} passed whole"]
    if short:
        lines.append(f"runs that ended before their last test ({most} tests): {short}")
    if not counts:
        lines.append(f"no test failed in any run ({most} tests a run)")
    for name, count in counts.most_common():
        lines.append(f"{count}/{len(runs)} {name} (runs {where[name]}): {first[name]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="how many times to run the tests (default 20)")
    parser.add_argument("--hogs", type=int, default=1, help="CPU-bound processes beside them (default 1)")
    parser.add_argument(
        "--keep", type=Path, default=ROOT / "build" / "flake-report", help="the JUnit reports"
    )
    args, pytest_args = parser.parse_known_args()
    if args.runs < 1 or args.hogs < 0:
        parser.error("--runs takes 1 or more, --hogs 0 or more")
    args.keep.mkdir(parents=True, exist_ok=True)
    hogs = start_hogs(args.hogs)
    runs: list[Run] = []
    try:
        for number in range(1, args.runs + 1):
            run = run_pytest(pytest_args, args.keep / f"run-{number:02d}.xml")
            runs.append(run)
            outcome = "passed" if run.returncode == 0 else f"FAILED (exit {run.returncode})"
            print(
                f"run {number}: {outcome}, {run.tests} tests, {len(run.failed)} failed, {run.seconds:.0f} s, "
                f"{args.hogs} hog(s)",
                flush=True,
            )
    finally:
        for hog in hogs:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()
    print("\n".join(summary(runs)))
    return 0 if runs and all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
