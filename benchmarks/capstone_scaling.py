"""Scaling of the capstone's training loop (notebooks/scripts/06_train.py) on this machine.

Measures training samples per second (the script's own per-epoch figure, first epoch dropped as
warm-up) for: plain `python` (no DDP), torchrun with 1 rank (DDP, world size 1) and torchrun with
2 ranks, all with the same per-process batch; each with one thread per rank (process scaling) and
with the script's default of cores // ranks threads. The ways alternate over several rounds; the
medians give the ratios.
Goals: 2 ranks / 1 rank >= 1.7; DDP at world size 1 / plain loop >= 0.95.
Usage: python benchmarks/capstone_scaling.py [--rounds 5]   (writes benchmarks/results/capstone_scaling.png)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ddp_helpers import make_image_folder, torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "notebooks" / "scripts" / "06_train.py"
RESULTS = ROOT / "benchmarks" / "results"


def samples_per_s(records: list[dict]) -> float:
    """Median training throughput over the epochs after the first."""
    epochs = [r["samples_per_s"] for r in records if r.get("event") == "epoch"]
    return statistics.median(epochs[1:] or epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--num-epochs", type=int, default=4)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = make_image_folder(RESULTS / "data", num_classes=4, images_per_class=320, size=32, seed=0,
                             val_fraction=0.2)
    common = ["--data", str(data), "--num-epochs", str(args.num_epochs), "--batch-size", str(args.batch_size)]

    def run(way: str) -> float:
        name, threads = way.rsplit(" @", 1)
        env = {"OMP_NUM_THREADS": "1"} if threads == "1 thread" else {}  # else the script splits the cores
        out = ["--out", str(RESULTS / "runs" / way.replace(" ", "_").replace("@", ""))]
        if name == "plain python":
            done = subprocess.run([sys.executable, str(SCRIPT), *common, *out], capture_output=True, text=True,
                                  check=True, cwd=ROOT / "notebooks", env={**os.environ, **env})
            return samples_per_s([json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")])
        nproc = 1 if name == "DDP 1 rank" else 2
        result = torchrun(SCRIPT, *common, *out, nproc_per_node=nproc, env=env, live=False, timeout=600)
        return samples_per_s(result.records(rank=0))

    # "1 thread": one thread per rank, so N ranks use N cores (process scaling, the goal's measure);
    # "cores/ranks": each configuration gets the whole machine (1 rank uses every core through threads).
    ways = [f"{name} @{t}" for t in ("1 thread", "cores/ranks") for name in ("plain python", "DDP 1 rank", "DDP 2 ranks")]
    figures: dict[str, list[float]] = {w: [] for w in ways}
    for i in range(args.rounds):
        k = i % len(ways)
        for way in ways[k:] + ways[:k]:  # rotate the order every round
            figures[way].append(run(way))
            print(f"round {i}: {way:26s} {figures[way][-1]:8.0f} samples/s", flush=True)
    med = {w: statistics.median(v) for w, v in figures.items()}
    print(f"\n{os.cpu_count()} CPU cores, per-process batch {args.batch_size}, {args.rounds} rounds")
    for w in ways:
        print(f"  {w:26s} median {med[w]:8.0f} samples/s")
    for t in ("1 thread", "cores/ranks"):
        scaling = med[f"DDP 2 ranks @{t}"] / med[f"DDP 1 rank @{t}"]
        overhead = med[f"DDP 1 rank @{t}"] / med[f"plain python @{t}"]
        print(f"[{t}] 2 ranks / 1 rank = {scaling:.2f} (goal >= 1.7); "
              f"DDP 1 rank / plain loop = {overhead:.2f} (goal >= 0.95)")
    scaling = med["DDP 2 ranks @1 thread"] / med["DDP 1 rank @1 thread"]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    labels = [w.replace(" @", "\n") for w in ways]
    ax.bar(labels, [med[w] for w in ways], color=["grey", "tab:blue", "tab:orange"] * 2)
    for label, w in zip(labels, ways):
        ax.plot([label] * len(figures[w]), figures[w], "k.", alpha=0.5)
    ax.set_ylabel("training samples / s")
    ax.set_title(f"capstone on {os.cpu_count()} CPU cores: 2 ranks = {scaling:.2f}x one rank (1 thread each)")
    fig.savefig(RESULTS / "capstone_scaling.png", dpi=120)
    print(f"plot: {RESULTS / 'capstone_scaling.png'}")


if __name__ == "__main__":
    main()
