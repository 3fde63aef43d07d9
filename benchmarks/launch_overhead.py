"""Launch overhead of ddp_helpers: one 2-rank job by raw torchrun, torchrun(...) cold and warm, and the CLI.

Every round runs each way once, in a rotated order, and the ratios are taken within the round (the ways
run back to back, so slow drifts of a shared machine cancel); the medians over rounds are printed.
- cold: ``torchrun(..., warm=False)``, a fresh torchrun process, as the command line does. Goal <= 1.05.
- CLI: ``python -m ddp_helpers``. Goal <= 1.10 of raw.
- warm, first: the first launch of a kernel, which starts the warm process. Goal <= 1.0 of raw.
- warm, later: the median of 3 launches after it. Goal <= 0.15 of raw.
Usage: python benchmarks/launch_overhead.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ddp_helpers import _warm, torchrun

JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(t.item())
dist.destroy_process_group()
"""
GOALS = {
    "torchrun(..., warm=False)": 1.05,
    "CLI": 1.10,
    "warm, first launch": 1.0,
    "warm, later launches": 0.15,
}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    args = parser.parse_args()
    n = args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)

        def warm() -> None:
            torchrun(script, nproc_per_node=n, live=False, timeout=300)

        def warm_first() -> None:
            _warm.shutdown()  # the next launch starts a new warm process, as a kernel's first launch does
            warm()

        ways = {
            "raw torchrun": lambda: _timed(
                lambda: subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc-per-node={n}",
                        script,
                    ],
                    check=True,
                    capture_output=True,
                )
            ),
            "torchrun(..., warm=False)": lambda: _timed(
                lambda: torchrun(script, nproc_per_node=n, live=False, timeout=300, warm=False)
            ),
            "CLI": lambda: _timed(
                lambda: subprocess.run(
                    [sys.executable, "-m", "ddp_helpers", f"--nproc-per-node={n}", script],
                    check=True,
                    capture_output=True,
                )
            ),
            "warm, first launch": lambda: _timed(warm_first),
            "warm, later launches": lambda: statistics.median(_timed(warm) for _ in range(3)),
        }
        ways["raw torchrun"]()  # warm the file cache once, untimed
        times: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        for i in range(args.rounds):
            # rotate, so no way always runs first; "later" right after "first" (it needs a warm process)
            order = names[i % len(names) :] + names[: i % len(names)]
            if order.index("warm, later launches") < order.index("warm, first launch"):
                order.remove("warm, later launches")
                order.insert(order.index("warm, first launch") + 1, "warm, later launches")
            for name in order:
                times[name].append(ways[name]())
        _warm.shutdown()
    print(f"{n}-rank job, {args.rounds} rounds, {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}")
    for name, ts in times.items():
        print(f"  {name:26s} median {statistics.median(ts):6.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})")
    raw = times["raw torchrun"]
    for name, goal in GOALS.items():
        paired = statistics.median(t / r for t, r in zip(times[name], raw, strict=True))
        print(
            f"{name:26s} / raw torchrun: median of per-round ratios {paired:.3f} (goal <= {goal}); "
            f"ratio of medians {statistics.median(times[name]) / statistics.median(raw):.3f}"
        )


if __name__ == "__main__":
    main()
