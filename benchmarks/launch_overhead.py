"""Launch overhead of ddp_helpers: the same 2-rank job via torchrun(...), the CLI, and raw torchrun.

Runs the three ways alternately, several rounds, and prints the median ratios against raw torchrun.
Goals: helper / raw <= 1.05, CLI / raw <= 1.10. Usage: python benchmarks/launch_overhead.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ddp_helpers import torchrun

JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(t.item())
dist.destroy_process_group()
"""


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    args = parser.parse_args()
    n = args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        ways = {
            "raw torchrun": lambda: subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", script],
                check=True, capture_output=True),
            "torchrun(...)": lambda: torchrun(script, nproc_per_node=n, live=False, timeout=300),
            "CLI": lambda: subprocess.run(
                [sys.executable, "-m", "ddp_helpers", f"--nproc-per-node={n}", script],
                check=True, capture_output=True),
        }
        _timed(ways["raw torchrun"])  # warm the file cache once, untimed
        times: dict[str, list[float]] = {k: [] for k in ways}
        for i in range(args.rounds):
            order = list(ways)[i % 3:] + list(ways)[:i % 3]  # rotate, so no way always runs first
            for name in order:
                times[name].append(_timed(ways[name]))
    raw = statistics.median(times["raw torchrun"])
    print(f"{n}-rank job, {args.rounds} rounds, {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}")
    for name, ts in times.items():
        print(f"  {name:14s} median {statistics.median(ts):6.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})")
    for name, goal in (("torchrun(...)", 1.05), ("CLI", 1.10)):
        ratio = statistics.median(times[name]) / raw
        # the same ratio within each round (the ways ran back to back), which cancels slow drifts of the machine
        paired = statistics.median(t / r for t, r in zip(times[name], times["raw torchrun"]))
        print(f"{name:14s} / raw = {ratio:.3f} (goal <= {goal}); median of per-round ratios {paired:.3f}")


if __name__ == "__main__":
    main()
