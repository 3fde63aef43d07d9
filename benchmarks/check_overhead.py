"""What ``python -m ddp_helpers check`` costs, on a 2-epoch script of a few hundred samples: the 08 template
on 256 generated images (4 ranks, 2 simulated nodes, 4 optimizer steps an epoch), which the check runs to its
end.

Three figures, each measured in this one run, so that they compare across machines:
- the check from the command line, in raw-launch units (one plain ``torchrun --standalone
  --nproc-per-node=2`` of a trivial script, as benchmarks/suite_time.py measures it; goal: at most 5);
- the check against the same launch without it, ``python -m ddp_helpers --nproc-per-node 2 --nnodes 2``, both
  cold, alternated (issue 33's goal: at most 1.5x);
- the training loop alone, with and without the check's hooks: the template's own samples per second, from
  warm launches of ``torchrun()`` and ``check()`` in this process.

Usage: ``python benchmarks/check_overhead.py [--runs N]`` (default 3 of each).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "notebooks" / "scripts" / "08_train.py"
GOAL_UNITS, GOAL_RATIO = 5, 1.5


def suite_time():
    """benchmarks/suite_time.py, for its raw launch (the unit) and its trivial script."""
    spec = importlib.util.spec_from_file_location("suite_time", ROOT / "benchmarks" / "suite_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(command: list[str]) -> float:
    """Seconds for one command run from the repository's root; it must succeed."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return time.perf_counter() - start


def samples_per_second(records: list[dict]) -> float:
    """The template's training speed, all ranks together, averaged over its epochs."""
    return statistics.mean(
        r["samples_per_s"] for r in records if r.get("event") == "epoch" and r["rank"] == 0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    sys.path.insert(0, str(ROOT))
    from ddp_helpers import check, make_image_folder, torchrun

    st = suite_time()
    with tempfile.TemporaryDirectory() as tmp:
        data = make_image_folder(
            Path(tmp, "data"), num_classes=4, images_per_class=80, size=32, val_fraction=0.2
        )
        args = [
            "--data",
            str(data),
            "--out",
            str(Path(tmp, "out")),
            "--num-epochs",
            "2",
            "--batch-size",
            "16",
        ]
        trivial = Path(tmp, "trivial.py")
        trivial.write_text(st.TRIVIAL)
        st.raw_launch(str(trivial))  # warm the file cache, untimed
        units = [st.raw_launch(str(trivial)) for _ in range(runs)]
        plain_cmd = [
            sys.executable,
            "-m",
            "ddp_helpers",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            str(TEMPLATE),
        ]
        check_cmd = [sys.executable, "-m", "ddp_helpers", "check", str(TEMPLATE)]
        plain, checked = [], []
        for _ in range(runs):
            plain.append(timed(plain_cmd + args))
            checked.append(timed(check_cmd + args))
        units += [st.raw_launch(str(trivial)) for _ in range(runs)]
        loop_plain, loop_checked = [], []
        for _ in range(runs):
            with warnings.catch_warnings():  # 4 ranks on few cores: known, and the same for both
                warnings.simplefilter("ignore", UserWarning)
                result = torchrun(TEMPLATE, *args, nproc_per_node=2, nnodes=2, live=False)
            loop_plain.append(samples_per_second(result.records()))
            report = check(TEMPLATE, *args)
            assert report.findings == [], str(report)
            loop_checked.append(samples_per_second(report.result.records()))
    unit, cli, bare = statistics.median(units), statistics.median(checked), statistics.median(plain)
    loop = statistics.median(loop_plain) / statistics.median(loop_checked)
    spread = f"{min(units):.2f}-{max(units):.2f}"
    print(f"one raw 2-rank torchrun launch: {unit:.2f} s (median of {len(units)}: {spread})")
    print(
        f"python -m ddp_helpers check, 08 template, 2 epochs of 256 images, 4 ranks: {cli:.2f} s (median of "
        f"{runs}) = {cli / unit:.1f} launch units (goal <= {GOAL_UNITS})"
    )
    print(
        f"the same launch without the check: {bare:.2f} s; the check's run / the run without it: "
        f"{cli / bare:.2f}x (goal <= {GOAL_RATIO})"
    )
    print(
        f"training loop alone (warm launches, samples/s of all ranks): {statistics.median(loop_plain):.0f} "
        f"without, {statistics.median(loop_checked):.0f} with the check's hooks: {loop:.2f}x the time"
    )


if __name__ == "__main__":
    main()
