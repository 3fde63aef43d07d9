"""07_gallery.py: four classic ways a DDP job hangs or dies. Repaired by default; --buggy shows the bug."""
import argparse
import json
import os

import torch
import torch.distributed as dist


def setup() -> tuple[int, torch.device]:
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return dist.get_rank(), device


def train(device: torch.device, steps: int) -> None:
    for _ in range(steps):
        grad = torch.ones(2, device=device)
        dist.all_reduce(grad)  # stands in for DDP's gradient all-reduce in backward()


def rank0_barrier(rank: int, device: torch.device, buggy: bool, args: argparse.Namespace) -> None:
    """Rank 0 prepares the data; the others should wait for it."""
    if rank == 0:
        pass  # download and unpack the data set here
        if buggy:
            dist.barrier()  # BUG: only rank 0 calls the barrier
    if not buggy:
        dist.barrier()  # FIX: every rank calls it, so the others wait here until rank 0 is done
    train(device, steps=2)


def shape_mismatch(rank: int, device: torch.device, buggy: bool, args: argparse.Namespace) -> None:
    """Sum a per-class metric over ranks; the bug sizes it by the classes each rank happened to see."""
    num_classes = 3 if (buggy and rank == 1) else 4  # FIX: the same, fixed size on every rank
    counts = torch.ones(num_classes, device=device)
    dist.all_reduce(counts)


def early_exit(rank: int, device: torch.device, buggy: bool, args: argparse.Namespace) -> None:
    """Each rank trains on its own shard; the bug gives rank 1 one batch fewer."""
    num_batches = 4 - rank if buggy else 4  # FIX: equal shards (DistributedSampler pads, or drop_last)
    train(device, steps=num_batches)


def save_in_branch(rank: int, device: torch.device, buggy: bool, args: argparse.Namespace) -> None:
    """Rank 0 saves a checkpoint after each epoch; everyone should wait until it is written."""
    for epoch in range(2):
        train(device, steps=1)
        if rank == 0:
            tmp = f"{args.checkpoint}.tmp"
            torch.save({"epoch": epoch}, tmp)
            os.replace(tmp, args.checkpoint)
            if buggy:
                dist.barrier()  # BUG: indented into the rank-0 branch
        if not buggy:
            dist.barrier()  # FIX: outside the branch, on every rank


CASES = {"rank0-barrier": rank0_barrier, "shape-mismatch": shape_mismatch,
         "early-exit": early_exit, "save-in-branch": save_in_branch}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--buggy", action="store_true", help="run the broken version")
    parser.add_argument("--checkpoint", default="runs/07_gallery.pt")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    rank, device = setup()
    print(json.dumps({"rank": rank, "event": "ready"}), flush=True)  # in the group: what comes next is the case
    for name in CASES if args.case == "all" else [args.case]:
        CASES[name](rank, device, args.buggy, args)
        print(json.dumps({"rank": rank, "case": name, "buggy": args.buggy, "event": "passed"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
