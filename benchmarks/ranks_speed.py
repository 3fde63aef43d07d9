"""The %ranks magics' speed: a trivial %%ranks cell on a warm 2-rank group, and starting a group.

- a cell: ``%%ranks`` with the body ``1``, run through IPython's own ``run_cell_magic`` on a started group
  (the magic's argument parsing, the cell to both ranks and back, the lines read); the median over
  ``--cells`` cells. Goal <= 0.05 s.
- a start: ``%ranks start -n 2`` until every rank is ready (once this kernel's warm process exists), against
  one warm ``torchrun()`` launch of a trivial 2-rank job (init, one all_reduce, exit), the two rotated in
  order over ``--rounds`` rounds; the median of the per-round ratios. Goal <= 1.0. Stopping the group is
  timed apart: it is not part of the start.
Usage: python benchmarks/ranks_speed.py [--rounds 9] [--cells 200]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

from IPython.core.interactiveshell import InteractiveShell

from ddp_helpers import _warm, torchrun

JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(t.item())
dist.destroy_process_group()
"""
GOALS = {"cell": 0.05, "start / warm launch": 1.0}


def _timed(fn) -> float:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the ready and stopped lines
        fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cells", type=int, default=200)
    args = parser.parse_args()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_helpers")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)

        def launch() -> None:
            torchrun(script, nproc_per_node=2, live=False, timeout=300)

        launch()  # starts the warm process, untimed
        ways = {
            "warm launch": lambda: _timed(launch),
            "start": lambda: _timed(lambda: shell.run_line_magic("ranks", "start -n 2")),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        stops, cells = [], []
        for i in range(args.rounds):
            for name in list(ways)[i % 2 :] + list(ways)[: i % 2]:
                times[name].append(ways[name]())
                if name == "start":
                    if i == 0:  # one group's cells: the first round's
                        for _ in range(args.cells):
                            cells.append(_timed(lambda: shell.run_cell_magic("ranks", "", "1")))
                    stops.append(_timed(lambda: shell.run_line_magic("ranks", "stop")))
        _warm.shutdown()
    print(f"2 ranks, {args.rounds} rounds, {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}")
    cell = statistics.median(cells)
    print(
        f"  a trivial %%ranks cell: median {cell * 1000:.1f} ms over {len(cells)} cells "
        f"(min {min(cells) * 1000:.1f}, max {max(cells) * 1000:.1f}); goal <= {GOALS['cell'] * 1000:.0f} ms"
    )
    for name, ts in times.items():
        print(f"  {name:12s} median {statistics.median(ts):6.3f} s  (min {min(ts):.3f}, max {max(ts):.3f})")
    print(f"  %ranks stop   median {statistics.median(stops):6.3f} s")
    paired = statistics.median(s / w for s, w in zip(times["start"], times["warm launch"], strict=True))
    ratio = statistics.median(times["start"]) / statistics.median(times["warm launch"])
    print(
        f"start / warm launch: median of per-round ratios {paired:.3f} "
        f"(goal <= {GOALS['start / warm launch']}); ratio of medians {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
