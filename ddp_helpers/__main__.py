"""Command line: ``python -m ddp_helpers [--nproc-per-node N] [--nnodes K] [--timeout S] SCRIPT [ARGS]``."""

from __future__ import annotations

import argparse
import sys

from ddp_helpers import checker, launcher
from ddp_helpers.launcher import LAUNCH_TIMEOUT, LaunchOptions, TorchrunError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:  # python -m ddp_helpers check [OPTIONS] SCRIPT [ARGS]: checker.main
        return checker.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m ddp_helpers",
        description="Run SCRIPT under torchrun with each rank's output prefixed [rank N]; "
        "on failure or timeout, name the rank to blame and exit non-zero.",
    )
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks per node (default 1)"
    )
    parser.add_argument("--nnodes", type=int, default=1, help="simulated nodes on this machine (default 1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=LAUNCH_TIMEOUT,
        help=f"wall-clock limit in seconds (default {LAUNCH_TIMEOUT:g})",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="treat the job as hung once every rank has printed and none prints for this long, s",
    )
    parser.add_argument(
        "--live-ranks",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        help="comma-separated ranks to show live (default: all)",
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    try:
        options = LaunchOptions(
            nproc_per_node=ns.nproc_per_node,
            nnodes=ns.nnodes,
            timeout=ns.timeout,
            stall_timeout=ns.stall_timeout,
            warm=False,  # one launch: nothing to reuse
            live=True if ns.live_ranks is None else ns.live_ranks,
        )
        launcher.run_launch(launcher.plan_launch(ns.script, ns.args, options))
    except TorchrunError as e:
        print(f"ddp_helpers: {e}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"ddp_helpers: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
