"""A small DDP training script for tests/test_check.py: correct by default; --bugs turns on named mistakes.

Two epochs of 256 samples on a linear model with BatchNorm: sharded by a DistributedSampler, reshuffled each
epoch, saved by rank 0 atomically with plain keys, loaded with map_location, ended with destroy_process_group.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BUGS = {
    "local-rank-sampler",  # DistributedSampler(rank=LOCAL_RANK, num_replicas=LOCAL_WORLD_SIZE)
    "no-sampler",  # every rank iterates the whole dataset, in the same order
    "no-set-epoch",
    "every-rank-saves",
    "prefix",  # saves ddp.state_dict(): every key starts with module.
    "no-map-location",
    "print-every-rank",
    "find-unused",  # find_unused_parameters=True, though every parameter is used
    "unused",  # a layer the forward never uses, without find_unused_parameters
    "no-destroy",
    "unfreeze",  # the first layer frozen when wrapped, unfrozen after the first step
    "no-buffer-sync",  # broadcast_buffers=False: each rank keeps its own BatchNorm statistics
    "model-differs",  # a hidden size that depends on the rank
    "hang",  # rank 0 calls a barrier inside its save branch: the others never reach it
    "cuda",  # a device hard-coded to cuda:LOCAL_RANK
    "init-rank",  # init_process_group(rank=LOCAL_RANK, world_size=...)
}


class Net(nn.Module):
    def __init__(self, hidden: int, extra: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 2)
        self.spare = nn.Linear(hidden, 2) if extra else None  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bugs", default="", help="comma-separated names from BUGS")
    args = parser.parse_args()
    bugs = set(filter(None, args.bugs.split(",")))
    assert bugs <= BUGS, bugs - BUGS
    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if "init-rank" in bugs:
        print(f"rank {os.environ['RANK']} starting", flush=True)  # every rank prints: stall_timeout counts
    if "init-rank" in bugs:
        dist.init_process_group("gloo", rank=local_rank, world_size=world_size)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if "cuda" in bugs else torch.device("cpu")

    torch.manual_seed(0)
    features = torch.randn(256, 8)
    data = TensorDataset(features, (features.sum(1) > 0).long())
    if "local-rank-sampler" in bugs:
        sampler = DistributedSampler(data, rank=local_rank, num_replicas=int(os.environ["LOCAL_WORLD_SIZE"]))
    else:
        sampler = DistributedSampler(data)
    if "no-sampler" in bugs:
        loader = DataLoader(data, batch_size=16)
    else:
        loader = DataLoader(data, batch_size=16, sampler=sampler)

    model = Net(16 + rank if "model-differs" in bugs else 16, extra="unused" in bugs).to(device)
    if "unfreeze" in bugs:
        model.body[0].requires_grad_(False)
    ddp = DDP(
        model, find_unused_parameters="find-unused" in bugs, broadcast_buffers="no-buffer-sync" not in bugs
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = os.path.join(args.out, "checkpoint.pt")
    for epoch in range(args.epochs):
        if "no-set-epoch" not in bugs:
            sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if "unfreeze" in bugs and epoch == 0 and step == 0:
                model.body[0].requires_grad_(True)
            if "hang" in bugs:  # every rank prints as it goes: stall_timeout counts from the last line
                print(f"rank {rank} epoch {epoch} step {step}", flush=True)
        if "print-every-rank" in bugs or rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f}", flush=True)
        if "every-rank-saves" in bugs or rank == 0:
            state = ddp.state_dict() if "prefix" in bugs else model.state_dict()
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({"model": state, "epoch": epoch}, tmp)
            os.replace(tmp, path)
            if "hang" in bugs:
                dist.barrier()  # BUG: inside the rank-0 branch
        if "hang" not in bugs:
            dist.barrier()
    if "no-map-location" in bugs:
        checkpoint = torch.load(path, weights_only=True)
    else:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    if "prefix" not in bugs:
        model.load_state_dict(checkpoint["model"])
    if "no-destroy" not in bugs:
        del ddp
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
