"""Runs one torchrun agent (``python -m ddp_helpers._agent TORCHRUN_ARGS``): torch's own ``run``.

Why not ``python -m torch.distributed.run`` directly: this keeps torch's failure record
(exit code or signal of every failed rank, by global rank) as JSON for the launcher, instead
of a long log box to parse, and it ties the agent's life to the launching process.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from ddp_helpers._worker import _die_with_parent


def main(argv: list[str]) -> None:
    parent = int(os.environ.get("DDP_HELPERS_PARENT_PID", "0"))
    if parent:
        run_dir = os.environ["DDP_HELPERS_RUN_DIR"] if os.environ.get("DDP_HELPERS_AGENT") == "0" else None
        threading.Thread(target=_die_with_parent, args=(parent, run_dir), daemon=True,
                         name="ddp_helpers-lifeline").start()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        out = os.path.join(os.environ["DDP_HELPERS_RUN_DIR"], f"agent{os.environ['DDP_HELPERS_AGENT']}.failures")
        failures = {
            str(rank): {"exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else None,
                        "timestamp": f.timestamp, "local_rank": f.local_rank}
            for rank, f in e.failures.items()
        }
        with open(out, "w", encoding="utf-8") as f:
            json.dump(failures, f)
        ranks = ", ".join(f"rank {r} (exit {v['exitcode']})" for r, v in sorted(failures.items()))
        print(f"torchrun: workers failed: {ranks}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
