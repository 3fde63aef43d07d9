"""The worker wrapper: runs a script as one torchrun worker (``python -m ddp_helpers._worker SCRIPT ARGS``).

Torchrun has no way to give each *global* rank its own pair of log files, a stack dump on
demand, or a link to the notebook kernel's lifetime, so this wrapper adds exactly those three
things (and a process name, ``rank0 train``, that ``ps``, ``top`` and ``pgrep`` show), then runs
the script unchanged as ``__main__``. It must not import torch. A warm rank runs ``main`` as a function,
once ``_internals.become_fresh_rank`` has made the fork what a fresh ``python`` would be.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import time
import types

from ddp_helpers import _protocol as protocol

COMM_LENGTH = 15  # Linux keeps a process name of at most 15 bytes (TASK_COMM_LEN, with its NUL)


def _write_status(path: str, **fields: object) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(fields) + "\n")


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m ddp_helpers._worker SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    run_dir = os.environ[protocol.RUN_DIR]
    rank = int(os.environ["RANK"])

    # Each global rank writes to its own files, so lines of two ranks can never interleave.
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        target = os.open(protocol.rank_file(run_dir, rank, kind), flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.register(protocol.STACK_SIGNAL, file=sys.stderr, all_threads=True)
    name_process(f"rank{rank} {os.path.splitext(os.path.basename(script))[0]}")

    status = protocol.rank_file(run_dir, rank, "status")
    _write_status(
        status,
        event="start",
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        group_rank=int(os.environ.get("GROUP_RANK", 0)),
        pid=os.getpid(),
        pgid=os.getpgid(0),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        time=time.time(),
    )
    # The rank removes the run folder too: a warm rank shares its agent's process group, either may go first.
    protocol.hold_lifeline(remove=run_dir)

    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except Exception as e:
        # Report as Python would (through sys.excepthook, which torch may have wrapped), minus our own frames.
        code = 1
        _write_status(
            status, event="exception", type=type(e).__name__, message=str(e)[:500], time=time.time()
        )
        e = e.with_traceback(_user_frames(e.__traceback__))
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
    except BaseException:
        code = 1
        raise
    finally:
        _write_status(status, event="exit", code=code, time=time.time())


def name_process(name: str) -> None:
    """Name this process as ``ps -o comm``, ``top``, ``pgrep`` and ``/proc/PID/comm`` show it (Linux;
    elsewhere nothing changes). A warm rank is a fork of the warm process and would otherwise look like it."""
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(name.encode()[:COMM_LENGTH])
    except OSError:
        pass


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Skip the leading traceback entries that belong to this wrapper and runpy."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main(sys.argv[1:])
