"""Runs one torchrun agent (``python -m ddp_helpers._agent TORCHRUN_ARGS``): torch's own ``run``.

Why not ``python -m torch.distributed.run`` directly: this keeps torch's failure record
(exit code or signal of every failed rank, by global rank) as JSON for the launcher, instead
of a long log box to parse, and it ties the agent's life to the launching process. In a warm
launch (``_warm``) the same function runs in a process forked from one that imported torch.
"""

from __future__ import annotations

import json
import os
import sys

from ddp_helpers import _protocol as protocol


def main(argv: list[str], warm: bool = False) -> int:
    """Run torchrun with ``argv``; 0 if every worker succeeded, 1 (with the failure record written) if not."""
    agent = int(os.environ.get(protocol.AGENT, "0"))
    if warm:  # forked workers get /dev/null as stdin from multiprocessing: hand them the lifeline by number
        os.environ[protocol.LIFELINE] = str(os.dup(0))
    protocol.hold_lifeline(remove=os.environ.get(protocol.RUN_DIR) if agent == 0 else None)
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if warm:
        _fork_workers(torchrun_module)
    try:
        torchrun_module.run(torchrun_module.parse_args(argv))
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
        return 1
    return 0


def _fork_workers(torchrun_module) -> None:
    """Keep everything torchrun builds from its flags, but fork each worker to run the shim as a function.

    Both changes patch this agent process only, which was forked for this one launch."""
    from multiprocessing import synchronize

    from torch.distributed.elastic.multiprocessing import api

    from ddp_helpers import _worker

    launch = torchrun_module.elastic_launch

    def forked_launch(config, entrypoint):
        config.start_method = "fork"
        return launch(config=config, entrypoint=_worker.forked)  # called with torchrun's python arguments

    class _NoWait:
        def wait(self) -> None:  # the return value is already in its pipe: leave at once
            pass

    wrap = api._wrap

    def wrap_and_leave(*args):
        # torch's wrapper keeps a function worker alive until the agent has read its return value; a script run
        # by python exits when it ends, closing its connections, and its peers notice. Behave like the script.
        wrap(*[_NoWait() if isinstance(a, synchronize.Event) else a for a in args])

    config_from_args = torchrun_module.config_from_args

    def config_without_cuda(args):
        # torchrun's config asks torch.accelerator whether to bind NUMA nodes; with CUDA that initialises the
        # driver in this agent, and a process forked after that cannot use CUDA at all. Answer through NVML,
        # which gives the same count without touching CUDA, while the config is built.
        import torch

        accelerator = torch.accelerator
        real = accelerator.is_available, accelerator.device_count
        if torch.version.cuda is not None:
            count = _cuda_devices_from_nvml()
            accelerator.is_available, accelerator.device_count = (lambda: count > 0), (lambda: count)
        try:
            return config_from_args(args)
        finally:
            accelerator.is_available, accelerator.device_count = real

    torchrun_module.config_from_args = config_without_cuda
    torchrun_module.elastic_launch = forked_launch
    api._wrap = wrap_and_leave


def _cuda_devices_from_nvml() -> int:
    """The CUDA devices torch would see (CUDA_VISIBLE_DEVICES applied), counted without initialising CUDA."""
    import torch

    try:
        return max(torch.cuda._device_count_nvml(), 0)
    except OSError:  # no libnvidia-ml: no NVIDIA driver, so no usable CUDA device either
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
