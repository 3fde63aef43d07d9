"""12_exercise.py: a DDP script with three mistakes (notebook 12, exercise 1): fix a copy until the check is clean."""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="runs/12/checkpoint.pt")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)

    torch.manual_seed(0)
    features = torch.randn(256, 20)
    dataset = TensorDataset(features, (features.sum(1) > 0).long())
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    os.makedirs(os.path.dirname(args.checkpoint), exist_ok=True)

    for epoch in range(args.num_epochs):
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(ddp_model(inputs.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if local_rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f}")
            torch.save(ddp_model.state_dict(), args.checkpoint)
        dist.barrier()
    del ddp_model  # the wrapper freed while its group exists (01), then the group
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
