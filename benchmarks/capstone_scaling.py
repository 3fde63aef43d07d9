"""Scaling of the capstone's training loop (notebooks/scripts/06_train.py) on this machine.

Measures training samples per second (the script's own per-epoch figure, first epoch dropped as
warm-up), all with the same per-process batch:
  plain python           one process, no DDP
  DDP 1 rank             torchrun, world size 1
  DDP 2 ranks            torchrun, world size 2
  2 independent          two plain processes at once, throughputs added: what 2 cores give with no
                         communication at all (the ceiling for 2 ranks on this machine)
each with one thread per rank (process scaling; the goal's measure), and DDP also with the default
threads (1 rank then uses every core through torch's threads; 2 ranks get torchrun's OMP_NUM_THREADS=1,
which on 2 cores is cores // ranks). The ways rotate
order over several rounds; medians give the ratios.
Goals: 2 ranks / 1 rank >= 1.7; DDP at world size 1 / plain loop >= 0.95.
Usage: python benchmarks/capstone_scaling.py [--rounds 7] [--batch-size 32]
       (writes benchmarks/results/capstone_scaling.png)
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
ONE_THREAD, SPLIT = "1 thread", "cores/ranks"
WAYS = [
    f"plain python @{ONE_THREAD}",
    f"DDP 1 rank @{ONE_THREAD}",
    f"DDP 2 ranks @{ONE_THREAD}",
    f"2 independent @{ONE_THREAD}",
    f"DDP 1 rank @{SPLIT}",
    f"DDP 2 ranks @{SPLIT}",
]


def samples_per_s(records: list[dict]) -> float:
    """Median training throughput over the epochs after the first."""
    epochs = [r["samples_per_s"] for r in records if r.get("event") == "epoch"]
    return statistics.median(epochs[1:] or epochs)


def _plain(common: list[str], out: Path, env: dict, copies: int) -> float:
    """`copies` plain-python trainings started together; their throughputs added."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *common, "--out", str(out / str(i))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT / "notebooks",
            env={**os.environ, **env},
        )
        for i in range(copies)
    ]
    total = 0.0
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"plain run failed ({proc.returncode}):\n{stderr[-2000:]}")
        total += samples_per_s([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
    return total


def run(way: str, common: list[str]) -> float:
    """Training samples per second of one way (see the module docstring)."""
    name, threads = way.rsplit(" @", 1)
    # else the defaults split the cores: torch's own for 1 rank (all), torchrun's OMP_NUM_THREADS=1 for 2
    env = {"OMP_NUM_THREADS": "1"} if threads == ONE_THREAD else {}
    out = RESULTS / "runs" / way.replace(" ", "_").replace("@", "").replace("/", "_")
    if name in ("plain python", "2 independent"):
        return _plain(common, out, env, copies=1 if name == "plain python" else 2)
    nproc = 1 if name == "DDP 1 rank" else 2
    result = torchrun(
        SCRIPT, *common, "--out", str(out), nproc_per_node=nproc, env=env, live=False, timeout=600
    )
    return samples_per_s(result.records(rank=0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument(
        "--images-per-class", type=int, default=800, help="4 classes, 80%% of them for training"
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = make_image_folder(
        RESULTS / f"data{args.images_per_class}",
        num_classes=4,
        images_per_class=args.images_per_class,
        size=32,
        seed=0,
        val_fraction=0.2,
    )
    common = ["--data", str(data), "--num-epochs", str(args.num_epochs), "--batch-size", str(args.batch_size)]

    figures: dict[str, list[float]] = {w: [] for w in WAYS}
    for i in range(args.rounds):
        k = i % len(WAYS)
        for way in WAYS[k:] + WAYS[:k]:  # rotate the order every round
            figures[way].append(run(way, common))
            print(f"round {i}: {way:28s} {figures[way][-1]:8.0f} samples/s", flush=True)
    med = {w: statistics.median(v) for w, v in figures.items()}
    scaling = med[f"DDP 2 ranks @{ONE_THREAD}"] / med[f"DDP 1 rank @{ONE_THREAD}"]
    ceiling = med[f"2 independent @{ONE_THREAD}"] / med[f"plain python @{ONE_THREAD}"]
    overhead = med[f"DDP 1 rank @{ONE_THREAD}"] / med[f"plain python @{ONE_THREAD}"]
    split = med[f"DDP 2 ranks @{SPLIT}"] / med[f"DDP 1 rank @{SPLIT}"]
    # the same ratio round by round, to show the spread of the medians above
    per_round = [
        b / a
        for a, b in zip(
            figures[f"DDP 1 rank @{ONE_THREAD}"], figures[f"DDP 2 ranks @{ONE_THREAD}"], strict=True
        )
    ]
    train_items = sum(1 for _ in (data / "train").rglob("*.png"))
    print(
        f"\n{os.cpu_count()} CPU cores, {train_items} training images, per-process batch {args.batch_size}, "
        f"{args.rounds} rounds"
    )
    for w in WAYS:
        print(f"  {w:28s} median {med[w]:8.0f} samples/s")
    print(
        f"2 ranks / 1 rank (1 thread each)        = {scaling:.2f} (goal >= 1.7); per round "
        f"{min(per_round):.2f}..{max(per_round):.2f}, median {statistics.median(per_round):.2f}"
    )
    print(
        f"2 independent / 1 process (the ceiling) = {ceiling:.2f}; DDP reaches {scaling / ceiling:.0%} of it"
    )
    print(f"DDP 1 rank / plain loop                 = {overhead:.2f} (goal >= 0.95)")
    print(
        f"2 ranks / 1 rank (cores/ranks threads)  = {split:.2f} (1 rank may use every core through threads)"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6), constrained_layout=True)
    labels = [w.replace(" @", "\n") for w in WAYS]
    colours = ["grey", "tab:blue", "tab:orange", "lightgrey", "tab:blue", "tab:orange"]
    ax.bar(labels, [med[w] for w in WAYS], color=colours)
    for label, w in zip(labels, WAYS, strict=True):
        ax.plot([label] * len(figures[w]), figures[w], "k.", alpha=0.5)
    ax.set_ylabel("training samples / s")
    ax.set_title(
        f"capstone on {os.cpu_count()} CPU cores, batch {args.batch_size}/process: 2 ranks = {scaling:.2f}x "
        f"1 rank (ceiling {ceiling:.2f}x)"
    )
    fig.savefig(RESULTS / "capstone_scaling.png", dpi=120)
    print(f"plot: {RESULTS / 'capstone_scaling.png'}")


if __name__ == "__main__":
    main()
