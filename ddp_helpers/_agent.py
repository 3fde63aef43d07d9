"""Runs one torchrun agent (``python -m ddp_helpers._agent TORCHRUN_ARGS``): torch's own ``run``.

Why not ``python -m torch.distributed.run`` directly: this keeps torch's failure record
(exit code or signal of every failed rank, by global rank) as JSON for the launcher, instead
of a long log box to parse, and it ties the agent's life to the launching process.
"""

from __future__ import annotations

import json
import os
import sys

from ddp_helpers import _protocol as protocol


def main(argv: list[str]) -> None:
    agent = int(os.environ.get(protocol.AGENT, "0"))
    protocol.hold_lifeline(remove=os.environ.get(protocol.RUN_DIR) if agent == 0 else None)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failures = {
            str(rank): {"exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else None,
                        "timestamp": f.timestamp, "local_rank": f.local_rank}
            for rank, f in e.failures.items()
        }
        with open(protocol.agent_file(os.environ[protocol.RUN_DIR], agent, "failures"), "w", encoding="utf-8") as f:
            json.dump(failures, f)
        ranks = ", ".join(f"rank {r} (exit {v['exitcode']})" for r, v in sorted(failures.items()))
        print(f"torchrun: workers failed: {ranks}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
