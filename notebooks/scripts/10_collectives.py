"""10_collectives.py: each collective of notebook 10 once; one JSON record per rank of what it held after."""
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


# Recent torch renamed two collectives (2.14.1 warns on the old names); an older torch has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def main() -> None:
    rank, local_rank, world_size, device = setup()
    summed = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=device)
    dist.all_reduce(summed)  # SUM: every rank holds the same total
    weights = torch.full((3,), float(rank), device=device)
    dist.broadcast(weights, src=0)  # rank 0's values everywhere
    gathered = torch.zeros(2 * world_size, device=device)
    all_gather_single(gathered, torch.tensor([rank * 10.0, rank * 10.0 + 1], device=device))
    part = torch.zeros(2, device=device)
    reduce_scatter_single(part, torch.arange(2.0 * world_size, device=device) + 100 * rank)
    got = torch.zeros(1, device=device)
    ring = [dist.P2POp(dist.isend, torch.tensor([10.0 * (rank + 1)], device=device), (rank + 1) % world_size),
            dist.P2POp(dist.irecv, got, (rank - 1) % world_size)]  # a ring: to the next, from the previous
    for work in dist.batch_isend_irecv(ring):  # one batch: NCCL needs it (unbatched, it can stall); gloo too
        work.wait()
    dist.barrier()
    held = {"all_reduce": summed.tolist(), "broadcast": weights.tolist(), "all_gather": gathered.tolist(),
            "reduce_scatter": part.tolist(), "received": got.item()}
    where = {"rank": rank, "local_rank": local_rank, "world_size": world_size, "backend": dist.get_backend()}
    print(json.dumps({**where, **held}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
