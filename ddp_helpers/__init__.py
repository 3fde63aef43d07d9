"""Helpers for the ddp-notebooks series: run scripts under real torchrun from a notebook cell.

Names are loaded on first use, so that the worker wrapper each rank runs stays lean, and
importing this package never imports torch (the launcher and command line do not need it).
``%load_ext ddp_helpers`` adds the ``%ranks`` magics (``ddp_helpers.magics``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
_EXPORTS = {
    "torchrun": "ddp_helpers.launcher",
    "sbatch": "ddp_helpers.slurm",
    "SlurmJob": "ddp_helpers.slurm",
    "SlurmResult": "ddp_helpers.slurm",
    "TorchrunError": "ddp_helpers.outcome",
    "JobFailedError": "ddp_helpers.outcome",
    "JobHungError": "ddp_helpers.outcome",
    "TorchrunResult": "ddp_helpers.outcome",
    "CellError": "ddp_helpers.outcome",
    "RankGroup": "ddp_helpers.ranks",
    "describe_environment": "ddp_helpers.environment",
    "choose_backend": "ddp_helpers.environment",
    "series_folder": "ddp_helpers.environment",
    "make_image_folder": "ddp_helpers.datasets",
    "check": "ddp_helpers.checker",
    "CheckReport": "ddp_helpers.checker",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads each name on first use
    from ddp_helpers.checker import CheckReport, check  # noqa: F401
    from ddp_helpers.datasets import make_image_folder  # noqa: F401
    from ddp_helpers.environment import choose_backend, describe_environment, series_folder  # noqa: F401
    from ddp_helpers.launcher import torchrun  # noqa: F401
    from ddp_helpers.outcome import (  # noqa: F401
        CellError,
        JobFailedError,
        JobHungError,
        TorchrunError,
        TorchrunResult,
    )
    from ddp_helpers.ranks import RankGroup  # noqa: F401
    from ddp_helpers.slurm import SlurmJob, SlurmResult, sbatch  # noqa: F401


def load_ipython_extension(ipython) -> None:
    """``%load_ext ddp_helpers``: the ``%ranks`` and ``%%ranks`` magics."""
    from ddp_helpers import magics

    magics.load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext ddp_helpers``: stop the ranks, if any are running."""
    from ddp_helpers import magics

    magics.unload(ipython)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ddp_helpers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
