"""00_crash.py: rank 1 raises in the middle of training; the others are stopped by torchrun."""
import os

import torch
import torch.distributed as dist


def train_step(step: int, rank: int, device: torch.device) -> None:
    if rank == 1 and step == 2:
        raise ValueError(f"rank {rank} found a corrupt batch at step {step}")
    grad = torch.ones(4, device=device)  # on this rank's device: an NCCL group takes CUDA tensors only
    dist.all_reduce(grad)


def main() -> None:
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    for step in range(5):
        train_step(step, rank, device)
        print(f"rank {rank} finished step {step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
