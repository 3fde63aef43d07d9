"""A DDP script in the shape many tutorials teach, written for this suite to run on CPUs: a Trainer class,
snapshots to resume from, a progress line per rank tagged with its device index, a peek at the first batch.

Correct on one machine. It saves its snapshot on LOCAL_RANK 0, so on two nodes that share a filesystem two
processes write one file: the one thing the check should find here (every-rank-saves), and nothing else.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Pairs(Dataset):
    """Random inputs and targets, the same on every rank (one generator, one seed)."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(1)
        self.items = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, loader: DataLoader, snapshot: str, save_every: int):
        self.device_index = int(os.environ["LOCAL_RANK"])
        self.loader, self.snapshot, self.save_every = loader, snapshot, save_every
        self.first_epoch = 0
        if os.path.exists(snapshot):
            state = torch.load(snapshot, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            self.first_epoch = state["epochs_run"]
        self.model = DDP(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        F.mse_loss(self.model(inputs), targets).backward()
        self.optimizer.step()

    def epoch(self, epoch: int) -> None:
        batch = len(next(iter(self.loader))[0])  # a peek: one more pass of the sampler, for the batch size
        print(f"[device {self.device_index}] epoch {epoch} | batch {batch} | steps {len(self.loader)}")
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.step(inputs, targets)

    def save(self, epoch: int) -> None:
        torch.save({"model": self.model.module.state_dict(), "epochs_run": epoch + 1}, self.snapshot)
        print(f"epoch {epoch} | snapshot saved at {self.snapshot}")

    def train(self, epochs: int) -> None:
        for epoch in range(self.first_epoch, epochs):
            self.epoch(epoch)
            if self.device_index == 0 and epoch % self.save_every == 0:
                self.save(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--snapshot", required=True)
    args = parser.parse_args()
    init_process_group(backend="gloo")
    data = Pairs(256)
    loader = DataLoader(data, batch_size=16, shuffle=False, sampler=DistributedSampler(data))
    Trainer(torch.nn.Linear(20, 1), loader, args.snapshot, save_every=1).train(args.epochs)
    destroy_process_group()


if __name__ == "__main__":
    main()
