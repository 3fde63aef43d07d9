"""What this machine offers for distributed training, and which backend the scripts will pick."""

from __future__ import annotations

import os
import platform


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
