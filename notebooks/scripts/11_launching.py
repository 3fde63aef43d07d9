"""11_launching.py: launching wrong, one --case each; what each rank (or a lone process) saw, as records."""
import argparse
import datetime
import json
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


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


def report(rank: int, case: str, **fields: object) -> None:
    print(json.dumps({"rank": rank, "case": case, **fields}), flush=True)


def wrap(model: nn.Module, device: torch.device) -> DDP:
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ---- --case init: init_process_group() as the first line, started with plain python or with torchrun ----------
def case_init(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which torchrun sets
    report(dist.get_rank(), "init", world_size=dist.get_world_size())
    dist.barrier()  # nobody leaves while a peer may still be connecting (gloo connects inside init)


# ---- --case before-init: a torch.distributed call (here DDP's constructor) before init_process_group ----------
def case_before_init(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    try:
        wrap(model, torch.device("cpu"))  # BUG: no process group yet in this process
    except ValueError as err:
        report(int(os.environ["RANK"]), "before-init", order="DDP, then init", error=str(err))
    rank, local_rank, world_size, device = setup()  # the fix: join the group first
    ddp = wrap(model, device)
    report(rank, "before-init", order="init, then DDP", wrapped=type(ddp).__name__)


# ---- --case nccl: the backend written into the script -----------------------------------------------------------
def case_nccl(args: argparse.Namespace) -> None:
    try:
        dist.init_process_group("nccl")  # BUG: hard-coded; fine on GPUs, not on a laptop, WSL without CUDA, Colab CPU
        hard_coded = "joined"
        dist.destroy_process_group()
    except (ValueError, RuntimeError) as err:
        hard_coded = str(err)
    rank, local_rank, world_size, device = setup()  # the fix: the backend chosen at run time
    report(rank, "nccl", hard_coded=hard_coded, chosen=dist.get_backend())


# ---- --case world-size: a world size given by hand that torchrun's processes never fill -----------------------
def case_world_size(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=args.timeout)
    try:  # gloo, always: its group connects every pair of ranks inside init_process_group, so the wait is here
        dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=timeout)
    except RuntimeError as err:
        report(rank, "world-size", asked=args.world_size, started=int(os.environ["WORLD_SIZE"]),
               error=type(err).__name__ + ": " + str(err))
        return
    report(rank, "world-size", asked=args.world_size, started=int(os.environ["WORLD_SIZE"]), joined=True)


# ---- --case store: ranks started by hand (as mp.spawn tutorials do), rank 0 hosting the store ---------------
def case_store(args: argparse.Namespace) -> None:
    port = args.port
    if port == 0:  # a free port, for the lone process of a demonstration
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=timeout)
    except RuntimeError as err:
        report(args.rank, "store", world_size=args.world_size, error=type(err).__name__ + ": " + str(err))
        return
    total = torch.ones(1)
    dist.all_reduce(total)
    report(args.rank, "store", world_size=args.world_size, joined=True, sum=total.item())


# ---- --case cpu-tensor: a CPU tensor into a group that has a backend for CUDA only (as NCCL's) ---------------
def case_cpu_tensor(args: argparse.Namespace) -> None:
    dist.init_process_group("cuda:gloo")  # gloo for CUDA tensors only: the shape of an NCCL group, without a GPU
    try:
        dist.all_reduce(torch.ones(1))  # BUG: a CPU tensor (a loss, a metric not moved to the GPU)
        error = None
    except RuntimeError as err:
        error = str(err)
    devices = getattr(dist.group.WORLD, "_device_types", None)  # the device types the group has a backend for
    report(dist.get_rank(), "cpu-tensor", backend=dist.get_backend(), error=error,
           device_types=[d.type for d in devices] if devices is not None else None)


# ---- --case no-destroy: a script that ends without destroy_process_group ----------------------------------------
def case_no_destroy(args: argparse.Namespace) -> None:
    rank, local_rank, world_size, device = setup()
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    report(rank, "no-destroy", backend=dist.get_backend(), sum=total.item())


CASES = {"init": case_init, "before-init": case_before_init, "nccl": case_nccl, "world-size": case_world_size,
         "store": case_store, "cpu-tensor": case_cpu_tensor, "no-destroy": case_no_destroy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--world-size", type=int, default=2, help="--case world-size, store")
    parser.add_argument("--rank", type=int, default=0, help="--case store: this process's rank")
    parser.add_argument("--port", type=int, default=0, help="--case store: rank 0's port (0: a free one)")
    parser.add_argument("--timeout", type=float, default=3, help="--case world-size, store: seconds to wait")
    args = parser.parse_args()
    CASES[args.case](args)
    if args.case != "no-destroy" and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
