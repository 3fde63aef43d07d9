"""GPU check: run the series' scripts on a CUDA machine (NCCL, one rank per GPU) and report what was seen.

Not part of CI (CI has no GPU). Usage, from the repository root on a GPU machine:
    PYTHONPATH=$PWD python benchmarks/gpu_check.py
Every check prints one JSON line {"check": ..., "ok": ..., ...}; the exit code is the number of failed checks.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from ddp_helpers import TorchrunError, describe_environment, torchrun

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
failures = 0


def check(name: str):
    def wrap(fn):
        global failures
        try:
            detail = fn() or {}
            print(json.dumps({"check": name, "ok": True, **detail}), flush=True)
        except Exception as e:  # report and go on: one run must say as much as it can
            failures += 1
            print(json.dumps({"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)
            traceback.print_exc()
        return fn
    return wrap


def run(script: str, *args: str, nproc: int = 1, timeout: float = 300, **kw):
    return torchrun(f"scripts/{script}", *args, nproc_per_node=nproc, timeout=timeout, cwd=NOTEBOOKS, live=False, **kw)


info = describe_environment()
gpus = info["gpu_count"]
assert gpus >= 1, "this check needs a CUDA GPU"


@check("00_hello on NCCL, one rank per GPU")
def _():
    result = run("00_hello.py", "--steps", "2", nproc=gpus)
    recs = result.records()
    assert {r["backend"] for r in recs} == {"nccl"}, recs
    assert {r["device"] for r in recs} == {f"cuda:{i}" for i in range(gpus)}, recs
    assert all(r["sum"] == gpus * (gpus + 1) / 2 for r in recs), recs
    return {"records": recs[:2], "seconds": round(result.duration, 1)}


@check("backend='nccl' with more ranks than GPUs gives advice")
def _():
    try:
        run("00_hello.py", nproc=gpus + 1, backend="nccl")
    except RuntimeError as e:
        assert "needs one GPU per rank" in str(e), e
        return {"message": str(e)[:200]}
    raise AssertionError("no error")


sys.exit(failures)
