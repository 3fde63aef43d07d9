"""09_failures.py: a job that trains (here: sleeps) step by step; rank 1 can die on purpose, three ways."""
import argparse
import json
import os
import signal
import time

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


def die(how: str, rank: int) -> None:
    """End this rank the way real jobs end: an exception, the kernel's OOM killer, or a failed C++ check."""
    if how == "raise":
        raise ValueError(f"rank {rank} found a corrupt batch")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what Linux's OOM killer sends: no traceback, no cleanup
    if how == "abort":
        os.abort()  # SIGABRT: what a failed check in C++ code (std::abort) does


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1, help="training steps of 0.1 s each; 0: until stopped")
    parser.add_argument("--fail", choices=["raise", "sigkill", "abort"], default=None, help="how rank 1 ends")
    parser.add_argument("--tag", default="", help="a word to find this job's processes by (ps, pgrep -f)")
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    dist.barrier()  # every rank is connected: one that dies now cannot break a peer's connecting first
    pgid = os.getpgid(0) if hasattr(os, "getpgid") else None  # Unix only
    print(json.dumps({"rank": rank, "event": "ready", "pid": os.getpid(), "pgid": pgid}), flush=True)
    if rank == 1 and args.fail:
        die(args.fail, rank)
    step = 0
    while step < args.steps or args.steps == 0:
        time.sleep(0.1)  # stands in for a training step that does not communicate (loading, computing)
        step += 1
    total = torch.ones(1, device=device)
    dist.all_reduce(total)  # the job formed: every rank counts 1
    print(json.dumps({"rank": rank, "event": "done", "world_size": world_size, "sum": total.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
