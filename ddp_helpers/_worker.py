"""Bootstrap that runs a user's script as one torchrun worker (``python -m ddp_helpers._worker SCRIPT ARGS``).

Torchrun has no way to give each *global* rank its own pair of log files, a stack dump on
demand, or a link to the notebook kernel's lifetime, so this shim adds exactly those three
things and then runs the script unchanged as ``__main__``. It must not import torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import shutil
import signal
import stat
import sys
import threading
import time
import types

STACK_SIGNAL = signal.SIGUSR1


def _status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.status")


def _write_status(path: str, **fields: object) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(fields) + "\n")


def _die_with_parent(parent_pid: int, remove: str | None = None) -> None:
    """Kill this process's group once the launching process is gone (even after SIGKILL); ``remove`` a folder first."""
    try:
        lifeline = stat.S_ISFIFO(os.fstat(0).st_mode) and os.environ.get("DDP_HELPERS_LIFELINE") == "1"
    except OSError:
        lifeline = False
    if lifeline:
        while True:  # the launcher holds the only write end: EOF means it closed it or died
            try:
                if os.read(0, 512) == b"":
                    break
            except InterruptedError:
                continue
            except OSError:
                break
    else:
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


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m ddp_helpers._worker SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    run_dir = os.environ["DDP_HELPERS_RUN_DIR"]
    rank = int(os.environ["RANK"])

    # Each global rank writes to its own files, so lines of two ranks can never interleave.
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(run_dir, f"rank{rank}.{name}"), flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)

    status = _status_path(run_dir, rank)
    _write_status(
        status, event="start", rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        group_rank=int(os.environ.get("GROUP_RANK", 0)), pid=os.getpid(), pgid=os.getpgid(0),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), time=time.time(),
    )
    parent = int(os.environ.get("DDP_HELPERS_PARENT_PID", "0"))
    if parent:
        threading.Thread(target=_die_with_parent, args=(parent,), daemon=True,
                         name="ddp_helpers-lifeline").start()

    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except Exception as e:
        # Report as Python would (through sys.excepthook, which torch may have wrapped), minus this shim's frames.
        code = 1
        _write_status(status, event="exception", type=type(e).__name__, message=str(e)[:500], time=time.time())
        e = e.with_traceback(_user_frames(e.__traceback__))
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
    except BaseException:
        code = 1
        raise
    finally:
        _write_status(status, event="exit", code=code, time=time.time())


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Skip the leading traceback entries that belong to this shim and runpy."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main(sys.argv[1:])
