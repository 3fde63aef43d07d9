"""Runs one torchrun agent (``python -m ddp_helpers._agent TORCHRUN_ARGS``): torch's own ``run``.

Why not ``python -m torch.distributed.run`` directly: this keeps torch's failure record
(exit code or signal of every failed rank, by global rank) as JSON for the launcher, instead
of a long log box to parse, and it ties the agent's life to the launching process. In a warm
launch (``_warm``) the same function runs in a process forked from the warm process, which
changes how it starts the workers (``_internals.patch_agent``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from ddp_helpers import _internals
from ddp_helpers import _protocol as protocol


def main(argv: list[str], warm: bool = False) -> int:
    """Run torchrun with ``argv``; 0 if every worker succeeded, 1 (with the failure record written) if not."""
    # Under srun (ddp_helpers.slurm) each node's agent is its node's index in the job.
    agent = int(os.environ.get(protocol.AGENT) or os.environ.get("SLURM_NODEID") or 0)
    if os.environ.get(protocol.RUN_DIR):
        # torch's agent makes a log folder for every launch (tempfile.mkdtemp(prefix="torchelastic_")) and
        # never removes it, nor does a forked agent remove multiprocessing's (pymp-*): put them in the run
        # folder, which goes with the launch (warm ranks reset this)
        tempfile.tempdir = os.environ[protocol.RUN_DIR]
    if warm:  # forked workers get /dev/null as stdin from multiprocessing: hand them the lifeline by number
        os.environ[protocol.LIFELINE] = str(os.dup(0))
        # The fork server the ranks are forked from, started first, while this process has one thread (why:
        # _internals): before hold_lifeline's thread and torchrun's, and so before patch_agent below. The
        # fork server, and each rank forked from it, keep torch as the warm process imported it, unpatched:
        # a rank's _wrap_and_leave finds torch's own _wrap there; patch_agent's changes stay in this agent.
        _internals.start_fork_server()
    protocol.hold_lifeline(remove=os.environ.get(protocol.RUN_DIR) if agent == 0 else None)
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if warm:
        _internals.patch_agent(torchrun_module)
    try:
        torchrun_module.run(torchrun_module.parse_args(argv))
    except ChildFailedError as e:
        failures = {
            str(rank): {
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "timestamp": f.timestamp,
                "local_rank": f.local_rank,
            }
            for rank, f in e.failures.items()
        }
        with open(
            protocol.agent_file(os.environ[protocol.RUN_DIR], agent, "failures"), "w", encoding="utf-8"
        ) as f:
            json.dump(failures, f)
        ranks = ", ".join(f"rank {r} (exit {v['exitcode']})" for r, v in sorted(failures.items()))
        print(f"torchrun: workers failed: {ranks}", file=sys.stderr)
        return 1
    finally:
        if warm:
            _internals.stop_fork_server()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
