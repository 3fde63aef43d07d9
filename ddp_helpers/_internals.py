"""The torch (and multiprocessing) internals that warm launches rely on: all of them here, behind one guard.

A warm launch (``_warm``) forks torchrun's agent from a process that has imported torch. This module is the
whole story of how a rank started that way ends up as what ``python -m ddp_helpers._worker`` would be, in the
order each process meets it:

1. The warm process: ``prepare_warm_process`` keeps its own ``multiprocessing`` identity, for every rank.
2. Each agent, first thing, while it has one thread: ``start_fork_server`` forks the **fork server** (below)
   that will fork the ranks.
3. The agent: ``patch_agent`` changes what it does in four ways:

   - torchrun's ``elastic_launch`` is replaced, to start the workers with ``start_method="forkserver"`` (from
     the fork server) and run the worker wrapper as a function (``_run_fresh_rank``) instead of as
     ``python -m ddp_helpers._worker``;
   - torch's ``_wrap`` around each worker function is replaced by ``_wrap_and_leave``, so that a forked worker
     leaves as soon as its script ends (torch's waits until the agent has read its return value; a script run
     by python does not); torch's own is kept here;
   - torch's ``start_processes`` is wrapped to hand each rank the agent's environment of that moment;
   - ``config_from_args`` is wrapped, so that building torchrun's config counts CUDA devices through NVML
     (``torch.cuda._device_count_nvml``) instead of asking the CUDA runtime, after which no fork can use CUDA.
4. Each rank, a fork of the fork server: ``_wrap_and_leave`` calls torch's ``_wrap``, which calls
   ``_run_fresh_rank``: ``become_fresh_rank`` undoes what a fork inherits and a fresh interpreter would not
   have (signal handlers, the multiprocessing identity, start method, fork server and resource tracker,
   tempfile's folder, random seeds, the thread count), then ``_worker.main`` runs the script.
5. The agent, at its end: ``stop_fork_server`` ends and reaps the fork server and the resource tracker.

The ranks are not forked by the agent itself: by the time torchrun starts them, the agent runs threads (the
rendezvous store's servers, its keep-alive timer, the lifeline), and a fork copies whatever lock one of those
held at that instant, with no thread left to release it. Seen here: about 1 launch of 3 ranks in 800, the
last rank hung for good in ``init_process_group``, in glibc's ``getaddrinfo("localhost")``, waiting for the
resolver's lock (``get_locked_global``, resolv/resolv_conf.c) it had been forked holding. So the fork server
is a ``multiprocessing`` fork server (Python's own ``forkserver.main``, run in a fork of the agent instead of
in a fresh interpreter, so that torch stays imported), forked while the agent has one thread, and the agent
starts its workers with ``start_method="forkserver"``: each rank is a fork of a process that never ran a
thread.

None of these is a public API, so a torch release may move one. ``missing()`` looks for every one of them; the
warm process calls it before it says it is ready, and where something is missing it says so instead, and every
launch runs cold with a one-line note: never a crash inside a forked agent. Importing this module imports
nothing of torch.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.process
import os
import random
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing import connection, forkserver, resource_tracker, synchronize

from ddp_helpers import _worker

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

# The warm process's multiprocessing identity and its name (prepare_warm_process), given back to each rank.
_warm_identity: tuple[multiprocessing.process.BaseProcess, str] | None = None
# torch's own worker wrapper (api._wrap), kept by patch_agent in the agent it patches.
_torch_wrap: Callable | None = None


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


# ---- 1. the warm process ---------------------------------------------------------------------------------


def prepare_warm_process() -> None:
    """In the warm process, once ``missing()`` found nothing: keep its ``multiprocessing`` identity, which
    ``become_fresh_rank`` gives back to each rank ("MainProcess", as a fresh interpreter reports)."""
    global _warm_identity
    process = multiprocessing.current_process()
    _warm_identity = (process, process.name)


# ---- 2. and 5. the agent's fork server -------------------------------------------------------------------


def start_fork_server() -> None:
    """In a warm agent, while it has one thread: fork the ``multiprocessing`` fork server its ranks will be
    forked from, and make it this process's fork server (as ``ForkServer.ensure_running`` would, minus the
    fresh interpreter). It ends with this process (its "alive" pipe reaches end of file)."""
    server = forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork server: Python's fork server loop, until the agent is gone
        code = 0
        try:
            os.close(alive_w)
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit:
            pass
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def stop_fork_server() -> None:
    """At a warm agent's end: end its fork server and ``multiprocessing``'s resource tracker and reap both, so
    that nothing of the launch outlives the agent (an orphan would stay a zombie until init reaps it)."""
    for pid in _let_go_of_fork_server_and_tracker():
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _let_go_of_fork_server_and_tracker() -> list[int]:
    """Close this process's ends of ``multiprocessing``'s fork server and resource tracker and forget both, as
    a fresh interpreter has none; the pids they had (each ends by itself once every end is closed)."""
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


# ---- 3. the agent ----------------------------------------------------------------------------------------


def patch_agent(torchrun_module) -> None:
    """In a warm agent: keep everything torchrun builds from its flags, but fork each worker to run the worker
    wrapper as a function. Every change patches this agent only, a process forked for this one launch."""
    global _torch_wrap
    from torch.distributed.elastic.multiprocessing import api

    launch = torchrun_module.elastic_launch

    def forked_launch(config, entrypoint):
        config.start_method = "forkserver"  # the fork server (start_fork_server) forks each rank
        return launch(config=config, entrypoint=_run_fresh_rank)  # called with torchrun's python arguments

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
    _torch_wrap = api._wrap
    api._wrap = _wrap_and_leave
    api.mp.start_processes = _start_processes_with_environment(api.mp.start_processes)


def _start_processes_with_environment(start_processes):
    """torch's ``start_processes``, giving each rank the agent's environment of this moment under its own
    variables: a fork server's children have the environment the fork server was forked with."""

    def start(fn, args=(), *rest, **kwargs):
        if fn is _wrap_and_leave and len(args) > 2 and isinstance(args[2], dict):
            entrypoint, fargs, envs, *more = args
            args = (entrypoint, fargs, {r: {**os.environ, **env} for r, env in envs.items()}, *more)
        return start_processes(fn, args, *rest, **kwargs)

    return start


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


# ---- 4. the rank -----------------------------------------------------------------------------------------


def _wrap_and_leave(*args):
    """torch's worker wrapper (``api._wrap``), minus its wait: torch's keeps a function worker alive until the
    agent has read its return value; a script run by python exits when it ends, closing its connections, and
    its peers notice: behave like that. Module-level, so that a fork server's child can unpickle it."""
    from torch.distributed.elastic.multiprocessing import api

    # A rank is a fork of the fork server, forked before patch_agent: there torch is unpatched, so api._wrap
    # is torch's own (and _torch_wrap unset); a rank forked from the patched agent would use _torch_wrap.
    wrap = _torch_wrap or api._wrap
    local_rank, envs = args[0], args[3]
    if isinstance(envs, dict) and isinstance(envs.get(local_rank), dict):
        # the agent's whole environment as it started the workers (start_processes_with_environment), as a
        # fork of the agent would have it, not the one the fork server was forked with
        os.environ.clear()
        os.environ.update(envs[local_rank])
    wrap(*[_NoWait() if isinstance(a, synchronize.Event) else a for a in args])


class _NoWait:
    def wait(self) -> None:  # the return value is already in its pipe: leave at once
        pass


def _run_fresh_rank(*python_args: str) -> None:
    """A warm rank's entrypoint, called by torch's ``_wrap`` with what torchrun would pass to ``python``. The
    rank becomes fresh here, inside ``_wrap``, because ``_wrap``'s ``record`` enables faulthandler, which a
    fresh ``python`` has off: ``become_fresh_rank`` resets the signal handlers after it, as a cold rank has
    them."""
    become_fresh_rank()
    args = list(python_args)
    _worker.main(args[args.index(_worker.__name__) + 1 :])
    atexit._run_exitfuncs()  # what the interpreter does when a script ends; the fork then exits at once


def become_fresh_rank() -> None:
    """In a rank forked from the fork server: undo what a fork inherits and a fresh ``python`` would not have:
    the agent's signal handlers, tempfile's folder, the multiprocessing identity (from the warm process),
    random seeds, and torch's thread count from OMP_NUM_THREADS (read at import)."""
    import torch

    _default_signal_handlers()
    tempfile.tempdir = None  # the agent's choice (its run folder); a fresh interpreter reads TMPDIR
    if _warm_identity is not None:
        process, name = _warm_identity
        multiprocessing.process._current_process = process
        multiprocessing.process._parent_process = None
        # a fork server's child renames the process object it inherited and gives it its parent's key
        process.name = name
        process.authkey = os.urandom(32)  # a fresh interpreter's own
        # A fork server's child inherits "forkserver" as the start method, and the agent's fork server and
        # resource tracker as its own: its DataLoader workers would then start from a fork server of their
        # own, outlive a crashed rank (their watchdog watches that server, not the rank) and, holding the
        # agent's fds, keep the agent waiting for its fork server and tracker to end (seen: 08_train's restart
        # hung its warm launch). A fresh interpreter has neither: it makes its own when it needs them.
        multiprocessing.set_start_method(None, force=True)
        _let_go_of_fork_server_and_tracker()  # not ours to reap: the agent's, or none
    random.seed()  # a fresh interpreter seeds these from the OS, each process its own
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def _default_signal_handlers() -> None:
    """Every signal handled as in a fresh interpreter (not, e.g., by the agent's torchrun SIGTERM handler)."""
    fresh = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGPIPE: signal.SIG_IGN,
        signal.SIGXFSZ: signal.SIG_IGN,
    }
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        try:
            signal.signal(sig, fresh.get(sig, signal.SIG_DFL))
        except (OSError, ValueError):
            pass
