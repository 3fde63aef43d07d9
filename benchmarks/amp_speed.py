"""bfloat16 autocast against float32: training samples per second of notebooks/scripts/08_train.py.

Runs the template on 2 ranks with ``--amp none`` and ``--amp bf16``, alternating, several rounds, and
prints the median of the per-round ratios bf16 / fp32 (first epoch of each run dropped). Whichever way
it comes out: on a CPU without native bfloat16 instructions it can well be slower. On GPUs, pass
``--amp fp16`` as the second way to measure float16 with its GradScaler.
Usage: ``python benchmarks/amp_speed.py [--rounds 5] [--amp bf16]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from ddp_helpers import make_image_folder, torchrun

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def samples_per_s(amp: str, data: str, out: str, epochs: int) -> float:
    """Median training throughput of one run over its epochs after the first (all ranks together)."""
    result = torchrun(
        "scripts/08_train.py",
        "--data",
        data,
        "--out",
        out,
        "--num-epochs",
        str(epochs),
        "--amp",
        amp,
        cwd=NOTEBOOKS,
        nproc_per_node=2,
        live=False,
        timeout=1800,
    )
    rates = [r["samples_per_s"] for r in result.records(rank=0) if r.get("event") == "epoch"]
    return statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--amp", default="bf16", help="the low-precision way to compare with float32")
    args = parser.parse_args()
    data = str(
        make_image_folder(
            NOTEBOOKS / "data" / "amp_bench",
            num_classes=4,
            images_per_class=320,
            size=32,
            seed=0,
            val_fraction=0.2,
        )
    )
    rates: dict[str, list[float]] = {"none": [], args.amp: []}
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.rounds):
            for amp in ["none", args.amp] if i % 2 == 0 else [args.amp, "none"]:
                rates[amp].append(samples_per_s(amp, data, os.path.join(out, f"{amp}{i}"), args.epochs))
    ratios = [low / full for low, full in zip(rates[args.amp], rates["none"], strict=True)]
    print(f"2 ranks, {args.rounds} rounds, {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}")
    for amp, values in rates.items():
        print(
            f"  {'float32' if amp == 'none' else amp:8s} median {statistics.median(values):8.0f} samples/s "
            f"({min(values):.0f}-{max(values):.0f})"
        )
    print(
        f"{args.amp} / float32: median of per-round ratios {statistics.median(ratios):.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
