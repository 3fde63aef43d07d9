"""Strict mode, for the series' own tests: evidence only gloo gives must come from a launch pinned to gloo.

On a machine with one GPU per rank the scripts and the rank REPL pick NCCL (``environment.launch_backend``),
where a lone collective returns at once instead of hanging and no size check aborts a rank. So a launch
(``torchrun()``, ``sbatch()``) or a ``%%ranks`` cell that ends as a hang, or with a rank that gloo aborted
(SIGABRT), shows what it shows only on gloo. With ``DDP_STRICT_BACKEND=1`` in the environment (the root
conftest.py sets it while nbmake runs a notebook), such an ending in a launch that did not pin gloo raises
``BackendNotPinnedError`` instead of the usual ``TorchrunError``, so the cell that expected the hang fails.
Without the variable nothing changes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import NoReturn

from ddp_helpers.outcome import JobFailedError, JobHungError, TorchrunError

STRICT_VARIABLE = "DDP_STRICT_BACKEND"


class BackendNotPinnedError(Exception):
    """A hang or gloo's abort in a launch not pinned to gloo (deliberately not a ``TorchrunError``)."""


def enabled() -> bool:
    """Whether strict mode is on: ``DDP_STRICT_BACKEND=1`` in this process's environment."""
    return os.environ.get(STRICT_VARIABLE) == "1"


def gloo_pinned(backend: str | None, env: Mapping[str, str], script_path: str) -> bool:
    """Whether a launch runs on gloo on every machine: pinned, or its script never names NCCL."""
    if backend is not None:
        return backend == "gloo"
    if env.get("DDP_BACKEND"):
        return env["DDP_BACKEND"] == "gloo"
    try:
        with open(script_path, encoding="utf-8", errors="replace") as f:
            return "nccl" not in f.read().lower()  # e.g. init_process_group("gloo") written in the script
    except OSError:
        return False


def gloo_abort(error: TorchrunError) -> bool:
    """Whether the rank to blame was killed by SIGABRT with gloo named in its stderr (gloo's own check)."""
    if not isinstance(error, JobFailedError) or error.exitcode != -signal.SIGABRT or error.rank is None:
        return False
    return any("gloo" in line.lower() for line in error.result.stderr.get(error.rank, []))


def raise_checked(error: TorchrunError, pinned: bool) -> NoReturn:
    """Raise ``error``; in strict mode, for gloo-only evidence from an unpinned launch, its replacement."""
    __tracebackhide__ = True
    if pinned or not enabled():
        raise error from None
    if isinstance(error, JobHungError):
        what = "ended as a hang"
    elif gloo_abort(error):
        what = f"ended with rank {error.rank} aborted by gloo (SIGABRT)"
    else:
        raise error from None
    first = str(error).split("\n", 1)[0]
    raise BackendNotPinnedError(
        f"{STRICT_VARIABLE}=1: this launch {what}, but it does not pin its backend. On a machine with a GPU "
        f"per rank it runs on NCCL, which does not show this the same way. Pin gloo: torchrun(..., "
        f'backend="gloo"), %ranks start ... --backend gloo, or env={{"DDP_BACKEND": "gloo"}}. The error it '
        f"replaces (its __cause__): {type(error).__name__}: {first}"
    ) from error
