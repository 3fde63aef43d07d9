"""The torch (and multiprocessing) internals that warm launches rely on: all of them here, behind one guard.

A warm launch (``_warm``) forks torchrun's agent from a process that has imported torch, and changes what that
agent does in three ways (``fork_workers``), plus two things in each forked rank (``MainProcess``):

- torchrun's ``elastic_launch`` is replaced, to start the workers with ``start_method="fork"`` and run the
  worker wrapper as a function instead of as ``python -m ddp_helpers._worker``;
- the agent's ``_wrap`` around each worker function is wrapped, so that a forked worker leaves as soon as its
  script ends (torch's waits until the agent has read its return value; a script run by python does not);
- ``config_from_args`` is wrapped, so that building torchrun's config counts CUDA devices through NVML
  (``torch.cuda._device_count_nvml``) instead of asking the CUDA runtime, after which no fork can use CUDA;
- in each rank, ``multiprocessing`` is told it is the main process again, as in a fresh interpreter.

None of these is a public API, so a torch release may move one. ``missing()`` looks for every one of them; the
warm process calls it before it says it is ready, and where something is missing it says so instead, and every
launch runs cold with a one-line note: never a crash inside a forked agent. Importing this module imports
nothing of torch.
"""

from __future__ import annotations

import importlib

# "module:attribute" for every internal used below; missing() looks each one up.
INTERNALS = (
    "torch.distributed.run:elastic_launch",
    "torch.distributed.run:config_from_args",
    "torch.distributed.launcher.api:LaunchConfig.start_method",
    "torch.distributed.elastic.multiprocessing.api:_wrap",
    "torch.cuda:is_available",
    "torch.cuda:device_count",
    "torch.accelerator:is_available",
    "torch.accelerator:device_count",
    "torch.cuda:_device_count_nvml",
    "multiprocessing.process:_current_process",
    "multiprocessing.process:_parent_process",
)


def missing() -> list[str]:
    """The internals of ``INTERNALS`` this torch lacks, as dotted names; empty: warm launches can work."""
    lacking = []
    for spec in INTERNALS:
        module, _, path = spec.partition(":")
        try:
            found = importlib.import_module(module)
            for name in path.split("."):
                found = getattr(found, name)
        except (ImportError, AttributeError):
            lacking.append(f"{module}.{path}")
    return lacking


def fork_workers(torchrun_module) -> None:
    """In a warm agent: keep everything torchrun builds from its flags, but fork each worker to run the worker
    wrapper as a function. Every change patches this agent only, a process forked for this one launch."""
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
        # torch's wrapper keeps a function worker alive until the agent has read its return value; a script
        # run by python exits when it ends, closing its connections, and its peers notice: behave like that.
        wrap(*[_NoWait() if isinstance(a, synchronize.Event) else a for a in args])

    config_from_args = torchrun_module.config_from_args

    def config_without_cuda(args):
        # torchrun's config asks whether this node has as many GPUs as ranks (to bind NUMA nodes): through
        # torch.cuda in torch 2.9 to 2.13, torch.accelerator since 2.14 (earlier releases do not ask). Either
        # asks the CUDA runtime, which marks every later fork of this agent as a bad fork, so that each rank
        # fails on its first CUDA call ("Cannot re-initialize CUDA in forked subprocess", even without a GPU).
        # Answer through NVML, which gives the same count without touching CUDA, while the config is built.
        import torch

        if torch.version.cuda is None:  # a CPU-only build: nothing can initialise CUDA
            return config_from_args(args)
        count = max(cuda_devices() or 0, 0)
        modules = [torch.cuda, torch.accelerator]
        real = [(m, m.is_available, m.device_count) for m in modules]
        for module in modules:
            module.is_available, module.device_count = (lambda: count > 0), (lambda: count)
        try:
            return config_from_args(args)
        finally:
            for module, is_available, device_count in real:
                module.is_available, module.device_count = is_available, device_count

    torchrun_module.config_from_args = config_without_cuda
    torchrun_module.elastic_launch = forked_launch
    api._wrap = wrap_and_leave


def cuda_devices() -> int | None:
    """The CUDA devices torch would see (CUDA_VISIBLE_DEVICES applied), counted without initialising CUDA;
    None where NVML cannot tell (MIG devices, a failed NVML start)."""
    import torch

    if torch.version.cuda is None:
        return 0
    try:
        count = torch.cuda._device_count_nvml()
    except OSError:  # no libnvidia-ml: no NVIDIA driver, so no usable CUDA device either
        return 0
    return count if count >= 0 else None


class MainProcess:
    """The warm process's own multiprocessing identity, remembered there and restored in each forked rank, so
    that a rank reports what a fresh interpreter would ("MainProcess", no parent process)."""

    def __init__(self):
        import multiprocessing

        self.process = multiprocessing.current_process()

    def restore(self) -> None:
        import multiprocessing.process

        multiprocessing.process._current_process = self.process
        multiprocessing.process._parent_process = None
