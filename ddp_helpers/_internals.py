"""The torch (and multiprocessing) internals that warm launches rely on: all of them here, behind one guard.

A warm launch (``_warm``) forks torchrun's agent from a process that has imported torch, and changes what that
agent does in four ways (``fork_workers``), plus two things in each forked rank (``MainProcess``):

- torchrun's ``elastic_launch`` is replaced, to start the workers with ``start_method="forkserver"`` (from
  the zygote, below) and run the worker wrapper as a function instead of as ``python -m ddp_helpers._worker``;
- the agent's ``_wrap`` around each worker function is replaced, so that a forked worker leaves as soon as its
  script ends (torch's waits until the agent has read its return value; a script run by python does not), and
  torch's ``start_processes`` is wrapped to hand each rank the agent's environment of that moment;
- ``config_from_args`` is wrapped, so that building torchrun's config counts CUDA devices through NVML
  (``torch.cuda._device_count_nvml``) instead of asking the CUDA runtime, after which no fork can use CUDA;
- in each rank, ``multiprocessing`` is told it is the main process again, as in a fresh interpreter.

The ranks are not forked by the agent itself: by the time torchrun starts them, the agent runs threads (the
rendezvous store's servers, its keep-alive timer, the lifeline), and a fork copies whatever lock one of those
held at that instant, with no thread left to release it. Seen here: about 1 launch of 3 ranks in 800, the
last rank hung for good in ``init_process_group``, in glibc's ``getaddrinfo("localhost")``, waiting for the
resolver's lock (``get_locked_global``, resolv/resolv_conf.c) it had been forked holding. ``start_zygote``
forks, first thing in the agent while it has one thread, a ``multiprocessing`` fork server (Python's own
``forkserver.main``, run in that fork instead of in a fresh interpreter, so that torch stays imported), and
the agent starts its workers with ``start_method="forkserver"``: each rank is a fork of a process that never
ran a thread.

None of these is a public API, so a torch release may move one. ``missing()`` looks for every one of them; the
warm process calls it before it says it is ready, and where something is missing it says so instead, and every
launch runs cold with a one-line note: never a crash inside a forked agent. Importing this module imports
nothing of torch.
"""

from __future__ import annotations

import importlib
import os

# "module:attribute" for every internal used below; missing() looks each one up.
INTERNALS = (
    "torch.distributed.run:elastic_launch",
    "torch.distributed.run:config_from_args",
    "torch.distributed.launcher.api:LaunchConfig.start_method",
    "torch.distributed.elastic.multiprocessing.api:_wrap",
    "torch.distributed.elastic.multiprocessing.api:mp.start_processes",
    "torch.cuda:is_available",
    "torch.cuda:device_count",
    "torch.accelerator:is_available",
    "torch.accelerator:device_count",
    "torch.cuda:_device_count_nvml",
    "multiprocessing.process:_current_process",
    "multiprocessing.process:_parent_process",
    "multiprocessing.forkserver:main",
    "multiprocessing.forkserver:_forkserver._forkserver_pid",
    "multiprocessing.forkserver:_forkserver._forkserver_address",
    "multiprocessing.forkserver:_forkserver._forkserver_alive_fd",
    "multiprocessing.connection:arbitrary_address",
    "multiprocessing.resource_tracker:_resource_tracker._fd",
    "multiprocessing.resource_tracker:_resource_tracker._pid",
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


def start_zygote() -> None:
    """In a warm agent, while it has one thread: fork the ``multiprocessing`` fork server its ranks will be
    forked from, and make it this process's fork server (as ``ForkServer.ensure_running`` would, minus the
    fresh interpreter). It ends with this process (its "alive" pipe reaches end of file)."""
    import socket
    from multiprocessing import connection, forkserver

    server = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the zygote: Python's fork server loop, until the agent is gone
        code = 0
        try:
            os.close(alive_w)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _let_go_of_fork_server_and_tracker() -> list[int]:
    """Close this process's ends of ``multiprocessing``'s fork server and resource tracker and forget both, as
    a fresh interpreter has none; the pids they had (each ends by itself once every end is closed)."""
    from multiprocessing import forkserver, resource_tracker

    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    for fd in {server._forkserver_alive_fd, tracker._fd} - {None}:
        try:
            os.close(fd)  # end of file: the tracker unlinks what was left, then ends
        except OSError:
            pass
    pids = [pid for pid in (server._forkserver_pid, tracker._pid) if pid is not None]
    server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    tracker._fd = tracker._pid = None
    return pids


def stop_zygote() -> None:
    """At a warm agent's end: end its fork server and ``multiprocessing``'s resource tracker and reap both, so
    that nothing of the launch outlives the agent (an orphan would stay a zombie until init reaps it)."""
    for pid in _let_go_of_fork_server_and_tracker():
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _wrap_and_leave(*args):
    """torch's worker wrapper (``api._wrap``), minus its wait: torch's keeps a function worker alive until the
    agent has read its return value; a script run by python exits when it ends, closing its connections, and
    its peers notice: behave like that. Module-level, so that a fork server's child can unpickle it."""
    from multiprocessing import synchronize

    from torch.distributed.elastic.multiprocessing import api

    wrap = getattr(api, "_ddp_helpers_wrap", api._wrap)  # torch's own, here or (patched) in the agent
    local_rank, envs = args[0], args[3]
    if isinstance(envs, dict) and isinstance(envs.get(local_rank), dict):
        # the agent's whole environment as it started the workers (start_processes_with_environment), as a
        # fork of the agent would have it, not the one the fork server was forked with
        os.environ.clear()
        os.environ.update(envs[local_rank])
    wrap(*[_NoWait() if isinstance(a, synchronize.Event) else a for a in args])


def _start_processes_with_environment(start_processes):
    """torch's ``start_processes``, giving each rank the agent's environment of this moment under its own
    variables: a fork server's children have the environment the fork server was forked with."""

    def start(fn, args=(), *rest, **kwargs):
        if fn is _wrap_and_leave and len(args) > 2 and isinstance(args[2], dict):
            entrypoint, fargs, envs, *more = args
            args = (entrypoint, fargs, {r: {**os.environ, **env} for r, env in envs.items()}, *more)
        return start_processes(fn, args, *rest, **kwargs)

    return start


class _NoWait:
    def wait(self) -> None:  # the return value is already in its pipe: leave at once
        pass


def fork_workers(torchrun_module) -> None:
    """In a warm agent: keep everything torchrun builds from its flags, but fork each worker to run the worker
    wrapper as a function. Every change patches this agent only, a process forked for this one launch."""
    from torch.distributed.elastic.multiprocessing import api

    from ddp_helpers import _worker

    launch = torchrun_module.elastic_launch

    def forked_launch(config, entrypoint):
        config.start_method = "forkserver"  # the zygote (start_zygote) forks each rank
        return launch(config=config, entrypoint=_worker.forked)  # called with torchrun's python arguments

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
    api._ddp_helpers_wrap = api._wrap
    api._wrap = _wrap_and_leave
    api.mp.start_processes = _start_processes_with_environment(api.mp.start_processes)


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
    that a rank reports what a fresh interpreter would ("MainProcess", no parent process, no start method
    chosen, no fork server or resource tracker yet)."""

    def __init__(self):
        import multiprocessing

        self.process = multiprocessing.current_process()
        self.name = self.process.name

    def restore(self) -> None:
        import multiprocessing.process

        multiprocessing.process._current_process = self.process
        multiprocessing.process._parent_process = None
        # a fork server's child renames the process object it inherited and gives it its parent's key
        self.process.name = self.name
        self.process.authkey = os.urandom(32)  # a fresh interpreter's own
        # A fork server's child inherits "forkserver" as the start method, and the agent's fork server and
        # resource tracker as its own: its DataLoader workers would then start from a fork server of their
        # own, outlive a crashed rank (their watchdog watches that server, not the rank) and, holding the
        # agent's fds, keep the agent waiting for its fork server and tracker to end (seen: 08_train's restart
        # hung its warm launch). A fresh interpreter has neither: it makes its own when it needs them.
        multiprocessing.set_start_method(None, force=True)
        _let_go_of_fork_server_and_tracker()  # not ours to reap: the agent's, or none
