"""How the launcher, the agents and the worker wrapper talk to each other. Torch-free.

The launcher (``launcher.torchrun``) makes a private **run folder** and starts one agent per simulated
node, ``python -m ddp_helpers._agent TORCHRUN_ARGS -m ddp_helpers._worker SCRIPT ARGS``, in a process
group of its own, with the variables below in its environment and the read end of the **lifeline**
pipe as its stdin. Everything else travels through files in the run folder:

- ``rank{r}.stdout``, ``rank{r}.stderr``: global rank ``r``'s output; the worker wrapper points the rank's
  file descriptors 1 and 2 at them (appending, so a restarted attempt continues the same files).
- ``rank{r}.status``: one JSON object per line, appended by the worker wrapper: ``start`` (pid, pgid, local
  and group rank, restart count), then ``exception`` (type, message) if the script raised, then
  ``exit`` (code). Each has a ``time`` (``time.time()``). A restart appends a new ``start``.
- ``agent{i}.stdout``, ``agent{i}.stderr``: agent ``i``'s own log (torchrun's messages).
- ``agent{i}.failures``: written by agent ``i`` when its workers failed: torch's failure record as
  JSON, ``{global rank: {"exitcode", "signal", "timestamp", "local_rank"}}``.

The **lifeline**: the launcher holds the only write end of a pipe whose read end every agent and
worker holds (as stdin, or as the descriptor ``DDP_HELPERS_LIFELINE`` names). Each of them runs a
thread that blocks reading it; end of file means the launcher closed it or died (even by SIGKILL),
and the thread kills its own process group. Agent 0 and every worker first remove the run folder: a warm
launch's workers share their agent's process group, so whichever thread comes first kills the others.

Stack dumps: the launcher sends ``STACK_SIGNAL`` to a rank, whose ``faulthandler`` writes every
thread's stack to the rank's stderr.

Warm launches (``_warm``) talk over a Unix stream socket in **messages**: a 4-byte big-endian length, then
that many bytes of JSON (``pack_message``; ``MessageReader`` reads them back, however the stream splits them).
A launch sends one request (with three file descriptors) and receives ``{"pid": N}`` or ``{"error": ...}``,
then ``{"exit": code}`` when the agent ends; ``{"count_gpus": true}`` (no descriptors) gets ``{"gpus": N}``.

A **rank group** (``ranks.RankGroup``, behind the ``%ranks`` magics) is a launch whose script is
``ddp_helpers/_repl.py``, kept open across notebook cells. The kernel listens on ``cells.sock`` in the run
folder (``cells_socket``); each rank, once its process group is initialised, connects (retrying until the
socket is there) and sends ``{"ready": rank, "pid", "backend", "device"}``. Then, in the same messages, the
kernel sends each chosen rank ``{"cell": n, "code", "filename", "max_bytes"}`` and the rank answers, after
flushing its stdout and stderr (so the kernel has every line of the cell once it has the reply), with one of
``{"cell": n, "value": base64 pickle, "type"}``, ``{"cell": n, "error": text, "summary"}`` (its traceback, or
why its value cannot come back) or ``{"cell": n, "interrupted": true, "error": text, "summary"}``. SIGINT
interrupts the cell a rank runs, and is ignored between cells. A rank whose connection reaches end of file
(``%ranks stop``) leaves its process group and exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import struct
import threading
import time

# Environment variables the launcher sets for agents and workers.
RUN_DIR = "DDP_HELPERS_RUN_DIR"  # the run folder
PARENT_PID = "DDP_HELPERS_PARENT_PID"  # the launching process; also how tests find leftover processes
LIFELINE = "DDP_HELPERS_LIFELINE"  # the file descriptor of the lifeline pipe ("0": stdin)
AGENT = "DDP_HELPERS_AGENT"  # the agent's index, 0 .. nnodes - 1
WARM_OWNER = "DDP_HELPERS_WARM_OWNER"  # in a warm process's environment: the pid of the process it serves
LAUNCH_VARIABLES = (RUN_DIR, PARENT_PID, LIFELINE, AGENT, WARM_OWNER)
WARM_MODULE = "ddp_helpers._warm"  # the warm process runs ``python -u -m ddp_helpers._warm SOCKET``

STACK_SIGNAL = signal.SIGUSR1  # a rank dumps every thread's stack to its stderr when it receives this


def rank_file(run_dir: str, rank: int, kind: str) -> str:
    """``rank{r}.stdout``, ``.stderr`` or ``.status`` in the run folder."""
    return os.path.join(run_dir, f"rank{rank}.{kind}")


def cells_socket(run_dir: str) -> str:
    """``cells.sock`` in the run folder: where a rank group's kernel waits for its ranks."""
    return os.path.join(run_dir, "cells.sock")


def agent_file(run_dir: str, agent: int, kind: str) -> str:
    """``agent{i}.stdout``, ``.stderr`` or ``.failures`` in the run folder."""
    return os.path.join(run_dir, f"agent{agent}.{kind}")


def hold_lifeline(remove: str | None = None) -> None:
    """In an agent or worker: a daemon thread that kills this process group once the launcher is gone."""
    parent = int(os.environ.get(PARENT_PID, "0"))
    if parent:
        threading.Thread(
            target=_die_with_parent, args=(parent, remove), daemon=True, name="ddp_helpers-lifeline"
        ).start()


def _die_with_parent(parent_pid: int, remove: str | None = None) -> None:
    """Wait until the launcher is gone (even by SIGKILL), ``remove`` a folder, kill this process group."""
    fd = int(os.environ.get(LIFELINE, "-1"))
    try:
        lifeline = fd >= 0 and stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        lifeline = False
    if lifeline:
        while True:  # the launcher holds the only write end: end of file means it closed it or died
            try:
                if os.read(fd, 512) == b"":
                    break
            except InterruptedError:
                continue
            except OSError:
                break
    else:  # no pipe (started by hand): poll for the parent instead
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
    if remove:
        shutil.rmtree(remove, ignore_errors=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


_HEADER = struct.Struct("!I")
MAX_MESSAGE = 1 << 24  # a request is its argv and environment, a cell's value at most 8 MiB: below this


def pack_message(message: dict) -> bytes:
    """One message of the warm or the cells socket: its length, then its JSON."""
    payload = json.dumps(message).encode()
    return _HEADER.pack(len(payload)) + payload


class MessageReader:
    """Messages from one stream socket: a read may end inside a message or hold several; bytes wait here."""

    def __init__(self, data: bytes = b""):
        self._buffer = b""
        self.messages: list[dict] = []
        self.feed(data)

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_MESSAGE:
                raise ValueError(f"a message of {size} bytes is not one of ours")
            if len(self._buffer) < _HEADER.size + size:
                break
            self.messages.append(json.loads(self._buffer[_HEADER.size : _HEADER.size + size]))
            self._buffer = self._buffer[_HEADER.size + size :]

    def receive(self, conn: socket.socket) -> None:
        """One read from ``conn`` (call it when it is readable); EOFError once the other side closed it."""
        data = conn.recv(65536)
        if not data:
            raise EOFError("the other side closed the connection" + (" mid-message" if self._buffer else ""))
        self.feed(data)

    def next(self, conn: socket.socket) -> dict:
        """The next message, reading ``conn`` (blocking) until one is complete."""
        while not self.messages:
            self.receive(conn)
        return self.messages.pop(0)
