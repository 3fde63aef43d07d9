"""The test suite's time in launch units: wall time divided by one raw 2-rank torchrun launch, same run.

A launch unit is what one ``torchrun --standalone --nproc-per-node=2`` of a trivial script costs on this
machine (mostly three Python processes importing torch), measured before and after the suite; dividing by
it makes the figures comparable across machines. Goals: the whole suite at most 100 units, and no
notebook's Run All above 15. Usage: ``python benchmarks/suite_time.py [--durations] [pytest args, e.g.
notebooks/]`` (default: the whole suite, as the README's test command runs it, on pytest-xdist's workers: a
test's or notebook's seconds are its own, the whole run's are wall time). ``--durations`` also writes each
test's seconds to tests/durations.json, by which conftest.py starts the longest tests first.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"
TRIVIAL = "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.destroy_process_group()\n"
GOAL_SUITE, GOAL_NOTEBOOK = 100, 15


def raw_launch(script: str) -> float:
    """Seconds for one raw torchrun launch of ``script`` on 2 ranks."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def suite(args: list[str], report: str) -> float:
    """Run pytest as the README does (from the repository root) with a JUnit report; return its wall time."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
        cwd=ROOT,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(f"(pytest exited with {done.returncode}: the figures below include the failures)")
    return wall


def by_test(report: str) -> dict[str, float]:
    """Seconds per test (setup, call and teardown), by pytest's node id, from the JUnit report."""
    times: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        # "tests.test_launcher", or "notebooks.solutions.00_x.ipynb" for nbmake
        name = case.get("classname", "?")
        path = (
            name[:-6].replace(".", "/") + ".ipynb"
            if name.endswith(".ipynb")
            else name.replace(".", "/") + ".py"
        )
        times[f"{path}::{case.get('name', '?')}"] += float(case.get("time", 0))
    return times


def by_file(tests: dict[str, float]) -> dict[str, float]:
    """Seconds per test file (unit tests) or notebook."""
    times: dict[str, float] = collections.defaultdict(float)
    for nodeid, seconds in tests.items():
        times[nodeid.split("::")[0]] += seconds
    return times


def write_durations(tests: dict[str, float]) -> None:
    """Keep each test of 2 s or more in tests/durations.json, which conftest.py orders the tests by."""
    kept = {k: round(v) for k, v in sorted(tests.items(), key=lambda kv: -kv[1]) if v >= 2}
    DURATIONS.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(kept)} tests' seconds to {DURATIONS.relative_to(ROOT)}")


def main() -> None:
    args = sys.argv[1:]
    durations = "--durations" in args  # not pytest's: ours, to refresh tests/durations.json
    args = [a for a in args if a != "--durations"]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "trivial.py")
        Path(script).write_text(TRIVIAL)
        raw_launch(script)  # warm the file cache, untimed
        before = [raw_launch(script) for _ in range(3)]
        wall = suite(args, os.path.join(tmp, "report.xml"))
        after = [raw_launch(script) for _ in range(3)]
        tests = by_test(os.path.join(tmp, "report.xml"))
    times = by_file(tests)
    if durations:
        write_durations(tests)
    unit = statistics.median(before + after)
    print(
        f"\none raw 2-rank torchrun launch: {unit:.2f} s (median of 6: 3 before, 3 after the suite; "
        f"{min(before + after):.2f}-{max(before + after):.2f})"
    )
    print(f"{'part':64} {'seconds':>8} {'launch units':>13}")
    notebooks = {k: v for k, v in times.items() if k.endswith(".ipynb")}
    unit_tests = {k: v for k, v in times.items() if not k.endswith(".ipynb")}
    for name, seconds in sorted(unit_tests.items()) + sorted(notebooks.items()):
        flag = "  over the goal" if name.endswith(".ipynb") and seconds / unit > GOAL_NOTEBOOK else ""
        print(f"{name:64} {seconds:8.1f} {seconds / unit:13.1f}{flag}")
    print(
        f"{'unit tests, together':64} {sum(unit_tests.values()):8.1f} {sum(unit_tests.values()) / unit:13.1f}"
    )
    print(f"{'notebooks, together':64} {sum(notebooks.values()):8.1f} {sum(notebooks.values()) / unit:13.1f}")
    print(
        f"{'the whole pytest run (wall)':64} {wall:8.1f} {wall / unit:13.1f}  (goal <= {GOAL_SUITE}; "
        f"each notebook <= {GOAL_NOTEBOOK})"
    )


if __name__ == "__main__":
    main()
