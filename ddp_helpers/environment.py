"""What this machine offers for distributed training, and which backend the scripts will pick."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def choose_backend() -> tuple[str, str]:
    """(backend, device kind) the series' scripts pick here: ("nccl", "cuda") with GPUs, else ("gloo", "cpu")."""
    import torch

    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl", "cuda"
    return "gloo", "cpu"


def describe_environment(verbose: bool = True) -> dict:
    """Print (and return) torch version, CPU count, GPUs and the backend/device the scripts will choose."""
    import torch
    import torch.distributed as dist

    backend, device = choose_backend()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "gpu_count": torch.cuda.device_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "distributed_available": dist.is_available(),
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        "backend": backend,
        "device": device,
    }
    if verbose:
        gpus = ", ".join(info["gpus"]) or "none"
        print(f"Python {info['python']}, torch {info['torch']}")
        print(f"CPU cores: {info['cpu_count']}; GPUs: {info['gpu_count']} ({gpus})")
        print(f"torch.distributed: gloo={info['gloo_available']}, nccl={info['nccl_available']}")
        print(f"The scripts will use backend={backend!r} on device={device!r}.")
    return info


def series_folder(start: str | os.PathLike | None = None) -> Path:
    """The series' ``notebooks/`` folder: ``start`` (default: the current one) or the nearest above it holding the
    series' scripts. Notebooks in ``solutions/`` or ``zh-CN/`` change to it first, so paths mean the same everywhere."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "scripts" / "00_hello.py").is_file() and (folder / "00_start_here.ipynb").is_file():
            return folder
    raise FileNotFoundError(f"no ddp-notebooks notebooks/ folder at or above {here}: open the notebook from the series")
