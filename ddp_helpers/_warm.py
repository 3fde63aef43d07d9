"""Warm launches: one process per kernel imports torch once, then forks a fresh torchrun agent per launch.

Why: a cold launch starts three Python processes that each import torch (seconds each); forking from a
process that already imported it costs milliseconds. The agent is torch's own: ``_agent.main(warm=True)``
runs ``torch.distributed.run`` with the very flags a cold launch passes, only the workers are forked (from a
single-threaded fork of the agent: the fork server, ``_internals.start_fork_server``) and run the worker
wrapper as a function instead of as ``python -m``; the torch internals this takes, and the whole story of how
a forked rank becomes a fresh one, are in ``_internals``, checked before the warm process says it is ready.

The **warm process** (``python -u -m ddp_helpers._warm SOCKET``) imports torch and torchvision, touches
neither CUDA nor threads of its own, listens on a Unix socket in a private folder, and exits when its
stdin (a pipe the kernel holds) reaches end of file, i.e. when the kernel is gone. It prints ``ready``
once it listens, or ``unsupported: ...`` (and exits) where this torch lacks an internal; a warm process that
says neither within ``TORCH_IMPORT_LIMIT`` seconds is killed, and launches run cold. Each launch
connects, sends one request (JSON: the agent's argv, environment and folder) with three file descriptors
(the launch's lifeline, the agent's stdout and stderr files), and receives ``{"pid": N}`` at once and
``{"exit": code}`` when the agent ends. The agent runs in a session of its own, like a cold one. A
request ``{"count_gpus": true}``, without descriptors, is answered ``{"gpus": N}`` (None: NVML cannot tell).

This module does not import torch on the kernel's side; only ``serve()`` does, in the warm process.
"""

from __future__ import annotations

import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import IO

from ddp_helpers import _protocol as protocol

# how the warm process starts (its socket follows)
COMMAND = [
    sys.executable,
    "-u",
    "-m",
    protocol.WARM_MODULE,
]

# How long a new warm process may take to say "ready" (or "unsupported"): its import of torch and torchvision,
# seconds here, a minute or two at worst from a network file system. Past it, the import is taken to hang.
TORCH_IMPORT_LIMIT = 300.0

# Variables torch and its libraries read when torch is imported (or when a library is loaded): a warm
# process imported torch under the values it started with, so a launch that needs other values runs cold.
IMPORT_TIME_PREFIXES = (
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "GOMP_",
    "LD_",
    "PYTHON",
)
# the same for every launch, or applied by each forked worker itself
OWN = (
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
)
# Variables with those prefixes that torch reads only at run time, inside a function that a forked agent or
# rank calls, so a warm launch honours them; each with the one torch source file that reads it (a test checks
# that every read there is inside a function, and that no other file of torch names the variable).
RUN_TIME = {
    # notebook 05's restart remedy
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "distributed/elastic/rendezvous/dynamic_rendezvous.py",
}


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that only take effect when torch is imported."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(IMPORT_TIME_PREFIXES) and k not in OWN and k not in RUN_TIME
    }


# ---- the kernel's side -----------------------------------------------------------------------------------


class WarmUnsupported(RuntimeError):
    """Warm launches cannot work in this kernel: launches run cold. This torch lacks an internal they need
    (``_internals``), or the warm process did not get through its import of torch in time."""


class WarmProcess:
    """The kernel's handle on its warm process: started on first use, ended with the kernel."""

    def __init__(self, env: dict[str, str], ready_limit: float = TORCH_IMPORT_LIMIT):
        self.folder = tempfile.mkdtemp(prefix="ddp_helpers_warm_")  # 0700: only this user can connect
        self.address = os.path.join(self.folder, "warm.sock")
        self.env = dict(env)
        # Forks keep this process's first environment block, so /proc shows whose launches they are.
        env = {**env, protocol.WARM_OWNER: str(os.getpid())}
        self.proc = subprocess.Popen(
            [*COMMAND, self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=self.folder,
            start_new_session=True,
        )
        # "ready": torch imported, listening
        line = _first_line(self.proc.stdout, ready_limit)
        if line is None:
            self.close(grace=0)  # a hung import never reads its stdin: kill it now
            raise WarmUnsupported(f"the warm process did not finish importing torch within {ready_limit:g} s")
        if line != "ready":
            self.close()
            if line.startswith("unsupported: "):
                raise WarmUnsupported(line.removeprefix("unsupported: "))
            raise RuntimeError("the warm process did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start_agent(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int]
    ) -> WarmAgent:
        """Fork an agent running ``torch.distributed.run`` on ``argv``; ``fds``: lifeline, stdout, stderr."""
        conn, reader, reply = self._ask({"argv": argv, "env": env, "cwd": cwd}, list(fds))
        if "error" in reply:
            conn.close()
            raise RuntimeError(reply["error"])
        return WarmAgent(reply["pid"], conn, reader)  # the reader may already hold the exit message

    def count_gpus(self) -> int | None:
        """The CUDA GPUs torch sees here, counted without initialising CUDA; None where NVML cannot tell."""
        conn, _, reply = self._ask({"count_gpus": True}, [])
        conn.close()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["gpus"]

    def _ask(self, request: dict, fds: list[int]) -> tuple[socket.socket, protocol.MessageReader, dict]:
        """Send one request (with ``fds``) and read the first reply; the connection stays open for more."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader = protocol.MessageReader()
        try:
            conn.connect(self.address)
            socket.send_fds(conn, [protocol.pack_message(request)], fds)
            return conn, reader, reader.next(conn)
        except EOFError:
            conn.close()
            raise RuntimeError("the warm process closed the connection") from None
        except BaseException:
            conn.close()
            raise

    def close(self, grace: float = 10) -> None:
        """End the warm process (end of file on its stdin; SIGKILL if it is still there after ``grace`` s)."""
        if self.proc.stdin:
            self.proc.stdin.close()  # the warm process exits at end of file
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _first_line(pipe: IO[bytes], limit: float) -> str | None:
    """The first line read from ``pipe`` (all of it, if it ends first), stripped; None if none came within
    ``limit`` seconds."""
    end = time.monotonic() + limit
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        while b"\n" not in data:
            left = end - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    return data.partition(b"\n")[0].decode(errors="replace").strip()


class WarmAgent:
    """A forked agent, with what the launcher uses of ``subprocess.Popen`` (pid, poll, wait, returncode)."""

    def __init__(self, pid: int, conn: socket.socket, reader: protocol.MessageReader):
        self.pid, self.conn, self.returncode = pid, conn, None
        self._reader = reader
        self._take_exit()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout)
            self._read(timeout=left if left is None else min(left, 0.5))
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if not ready:
            return
        try:
            self._reader.receive(self.conn)
        except EOFError:  # the warm process is gone: the agent's exit code is lost with it
            self.returncode = -signal.SIGKILL
            self.conn.close()
            return
        self._take_exit()

    def _take_exit(self) -> None:
        for message in self._reader.messages:
            if "exit" in message:
                self.returncode = message["exit"]
                self.conn.close()
        self._reader.messages.clear()


_lock = threading.Lock()
_process: WarmProcess | None = None
_unsupported: str | None = None  # what this torch lacks, once a warm process said so: no second try


def warm_process(env: dict[str, str]) -> tuple[WarmProcess, str | None]:
    """This kernel's warm process, started (or restarted) as needed; and a note if it had to be restarted.
    ``WarmUnsupported`` where this torch lacks an internal warm launches need, or where the warm process did
    not finish importing torch in time (either asked once per kernel)."""
    global _process, _unsupported
    with _lock:
        if _unsupported is not None:
            raise WarmUnsupported(_unsupported)
        note = None
        if _process is not None and import_time_env(_process.env) != import_time_env(env):
            changed = sorted(set(import_time_env(_process.env).items()) ^ set(import_time_env(env).items()))
            names = ", ".join(sorted({k for k, _ in changed}))
            note = f"restarted the warm process: {names} changed since it started"
            _process.close()
            _process = None
        if _process is not None and not _process.alive():
            _process = None
        if _process is None:
            try:
                _process = WarmProcess(env)
            except WarmUnsupported as e:
                _unsupported = str(e)
                raise
        return _process, note


def shutdown() -> None:
    """End this kernel's warm process, if any; the next warm launch starts a new one (used by benchmarks)."""
    global _process, _unsupported
    with _lock:
        _unsupported = None
        if _process is not None:
            _process.close()
            _process = None


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(protocol.pack_message(message))
    except OSError:
        pass  # the launcher stopped listening; the agent is reaped all the same


# ---- the warm process ------------------------------------------------------------------------------------


def serve(address: str) -> None:
    """Import torch once, then fork one agent per request until stdin reaches end of file."""
    import torch  # noqa: F401 -- the point of this process

    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    from ddp_helpers import _internals

    lacking = _internals.missing()  # which imports, once here, every module of torch a forked agent uses
    if lacking:
        print(f"unsupported: this torch lacks {', '.join(lacking)}", flush=True)
        return
    from ddp_helpers import _agent  # noqa: F401 -- imported once here, for every fork

    _internals.prepare_warm_process()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing more to say on stdout; the forked agents get their own
    agents: dict[int, socket.socket] = {}
    try:
        while True:
            readable, _, _ = select.select([0, listener], [], [], 0.05)
            if 0 in readable and not os.read(0, 512):
                break  # the kernel is gone (or closed us): every launch's own lifeline ends its agents
            if listener in readable:
                conn, _ = listener.accept()
                _handle(conn, listener, agents)
            _reap(agents)
    finally:  # the private folder and its socket go with this process, even when the kernel was killed
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


def _handle(conn: socket.socket, listener: socket.socket, agents: dict[int, socket.socket]) -> None:
    """Read one request: fork its agent, or count the GPUs."""
    import torch

    fds: list[int] = []
    try:
        conn.settimeout(30)  # a client that stops mid-request must not hold the warm process
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not data:
            raise EOFError("the launcher closed the connection before its request")
        reader = protocol.MessageReader(data)
        request = reader.next(conn)
        conn.settimeout(None)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
        if len(fds) != (0 if request.get("count_gpus") else 3):
            raise ValueError(f"{len(fds)} file descriptors came with the request")
    except (OSError, EOFError, ValueError) as e:  # socket.timeout is an OSError; bad JSON a ValueError
        _send(conn, {"error": f"bad request: {e}"})
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    if request.get("count_gpus"):
        from ddp_helpers import _internals

        _send(conn, {"gpus": _internals.cuda_devices()})
        conn.close()
        return
    if torch.cuda.is_initialized():  # never true unless something touched CUDA here: forking would break it
        _send(conn, {"error": "CUDA is initialised in the warm process"})
    else:
        pid = os.fork()
        if pid == 0:
            _become_agent(request, fds, [listener, conn, *agents.values()])
        agents[pid] = conn
        _send(conn, {"pid": pid})
    for fd in fds:
        os.close(fd)


def _become_agent(request: dict, fds: list[int], sockets: list[socket.socket]) -> None:
    """In the forked child: a fresh session, the launch's files and environment, then torch's agent."""
    code = 1
    try:
        os.setsid()
        for sock in sockets:
            sock.close()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from ddp_helpers import _agent

        code = _agent.main(request["argv"], warm=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _reap(agents: dict[int, socket.socket]) -> None:
    """Tell each launch its agent's exit code once the agent has ended."""
    while agents:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = agents.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
