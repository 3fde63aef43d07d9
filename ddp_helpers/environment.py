"""What this machine offers for distributed training, and which backend the scripts and launches get.

One rule, spelled once per place that applies it: every script of the series picks
``os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")`` (``choose_backend``
here; tests/test_project.py checks the two spellings agree), and a launch hands its ranks
``DDP_BACKEND=gloo`` when there are GPUs but fewer than its ranks per node (``launch_backend``, which the
launcher, ``describe_environment`` and the doctor all use). Importing this module does not import torch.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def choose_backend() -> tuple[str, str]:
    """(backend, device kind) a series script picks by itself here: ("nccl", "cuda") with CUDA, else ("gloo",
    "cpu"), unless DDP_BACKEND names one. Launched with more ranks per node than GPUs, the launch decides
    (``launch_backend``)."""
    import torch

    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    return backend, "cuda" if backend == "nccl" else "cpu"


def launch_backend(
    nproc_per_node: int, gpus: int, requested: str | None = None, preset: str | None = None
) -> tuple[str, str | None]:
    """What the ranks of a launch with ``nproc_per_node`` ranks per node use where torch sees ``gpus`` CUDA
    GPUs: (the backend, the ``DDP_BACKEND`` the launcher hands them, or None when the scripts choose by
    themselves).

    ``requested`` (``torchrun(backend=...)``) is handed on as it is; a ``preset`` DDP_BACKEND (in ``env=`` or
    the environment) is read by the scripts themselves. Otherwise NCCL needs one GPU per rank: with some GPUs
    but fewer than the ranks per node (one GPU, two ranks), the launch runs on gloo and the CPU."""
    if requested:
        return requested, requested
    if preset:
        return preset, None
    if 0 < gpus < nproc_per_node:
        return "gloo", "gloo"
    return ("nccl" if gpus else "gloo"), None


def describe_environment(verbose: bool = True, nproc_per_node: int = 2) -> dict:
    """Print (and return) torch version, CPU count, GPUs, the backend/device the scripts pick by themselves,
    and the backend a launch of ``nproc_per_node`` ranks per node gets (the notebooks run 2)."""
    import torch
    import torch.distributed as dist

    backend, device = choose_backend()
    gpus = torch.cuda.device_count()
    launch, _ = launch_backend(nproc_per_node, gpus, preset=os.environ.get("DDP_BACKEND"))
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "gpu_count": gpus,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "distributed_available": dist.is_available(),
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        "backend": backend,
        "device": device,
        "nproc_per_node": nproc_per_node,
        "launch_backend": launch,
    }
    if verbose:
        names = ", ".join(info["gpus"]) or "none"
        print(f"Python {info['python']}, torch {info['torch']}")
        print(f"CPU cores: {info['cpu_count']}; GPUs: {gpus} ({names})")
        print(f"torch.distributed: gloo={info['gloo_available']}, nccl={info['nccl_available']}")
        if launch == backend:
            print(f"The scripts will use backend={backend!r} on device={device!r}.")
        else:
            print(
                f"The scripts pick backend={backend!r} on device={device!r} with up to {gpus} rank(s) per "
                f"node; a launch of {nproc_per_node} ranks per node runs on backend={launch!r} and the CPU "
                f"(NCCL needs one GPU per rank)."
            )
    return info


def series_folder(start: str | os.PathLike | None = None) -> Path:
    """The series' ``notebooks/`` folder: ``start`` (default: the current one) or the nearest above it holding
    the series' scripts. Notebooks in ``solutions/`` or ``zh-CN/`` change to it first: paths mean the same
    everywhere."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "scripts" / "00_hello.py").is_file() and (folder / "00_start_here.ipynb").is_file():
            return folder
    raise FileNotFoundError(
        f"no ddp-notebooks notebooks/ folder at or above {here}: open the notebook from the series"
    )
