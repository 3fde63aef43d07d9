"""00_hello.py: every rank joins the process group, sums a number with all_reduce, and reports."""
import argparse
import json
import os

import torch
import torch.distributed as dist


def setup() -> tuple[int, int, int, torch.device]:
    """Join the process group; torchrun's environment (env://) supplies rank and world size."""
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its own node
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    for step in range(args.steps):
        value = torch.tensor([float(rank + 1)], device=device)  # rank r contributes r + 1
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # afterwards every rank holds the same sum
        print(json.dumps({"rank": rank, "local_rank": local_rank, "world_size": world_size,
                          "backend": dist.get_backend(), "device": str(device),
                          "step": step, "sum": value.item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
