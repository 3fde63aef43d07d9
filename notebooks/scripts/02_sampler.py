"""02_sampler.py: which indices each rank draws from DistributedSampler, and what that does to data and metrics."""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


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


def emit(**record: object) -> None:
    print(json.dumps(record))


def grid(rank: int, sizes: list[int], num_epochs: int) -> None:
    """Indices per rank and epoch for every combination of size, drop_last, shuffle and set_epoch."""
    for size in sizes:
        dataset = list(range(size))  # a sampler only needs len(dataset); item i is just i
        for drop_last in (False, True):
            for shuffle in (False, True):
                for use_set_epoch in (False, True):
                    # num_replicas and rank default to the process group's world size and global rank
                    sampler = DistributedSampler(dataset, shuffle=shuffle, drop_last=drop_last, seed=0)
                    for epoch in range(num_epochs):
                        if use_set_epoch:
                            sampler.set_epoch(epoch)
                        # The whole permutation this rank shuffles for this epoch (same seed + epoch on all ranks).
                        view = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=0)
                        view.set_epoch(epoch if use_set_epoch else 0)
                        emit(rank=rank, case="grid", size=size, drop_last=drop_last, shuffle=shuffle,
                             set_epoch=use_set_epoch, epoch=epoch, indices=list(sampler),
                             view=list(view), len_sampler=len(sampler))


def rank_source(rank: int, local_rank: int, world_size: int, size: int) -> None:
    """The post builds the sampler with rank=local_rank: on several nodes, nodes then draw the same shard."""
    dataset = list(range(size))
    for source, r in (("local_rank", local_rank), ("rank", rank)):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True, seed=0)
        emit(rank=rank, case="rank_source", source=source, local_rank=local_rank,
             group_rank=int(os.environ.get("GROUP_RANK", 0)), indices=list(sampler))


def image_folder(rank: int, world_size: int, device: torch.device, root: str, batch_size: int,
                 num_workers: int) -> None:
    """Snippet 3, fixed: ImageFolder with a transform, sampler from the process group, shuffle left to the sampler."""
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(root, transform=transforms.ToTensor())
    for sampler_drop_last in (False, True):
        for loader_drop_last in (False, True):
            sampler = DistributedSampler(dataset, drop_last=sampler_drop_last, seed=0)
            loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                                drop_last=loader_drop_last, pin_memory=device.type == "cuda")
            sampler.set_epoch(0)
            batch_sizes, labels = [], []
            for images, targets in loader:
                images = images.to(device, non_blocking=True)
                batch_sizes.append(len(images))
                labels += targets.tolist()
            emit(rank=rank, case="image_folder", dataset_size=len(dataset), classes=dataset.classes,
                 sampler_drop_last=sampler_drop_last, loader_drop_last=loader_drop_last,
                 indices=list(sampler), batch_sizes=batch_sizes, labels=labels,
                 image_shape=list(images.shape[1:]), targets=dataset.targets)


# A fixed "model" and dataset for the evaluation case: item i is x = i, and the model predicts 1 for x < 4.
EVAL_LABELS = [1, 1, 1, 0, 1, 0, 1, 0, 1, 0]


def predict(x: torch.Tensor) -> torch.Tensor:
    return (x < 4).long()


def evaluate(rank: int, world_size: int, device: torch.device) -> None:
    """Accuracy on 10 items when the sampler pads: naive all_reduce versus de-duplicated gather."""
    dataset = list(range(len(EVAL_LABELS)))
    sampler = DistributedSampler(dataset, shuffle=False)  # evaluation: no shuffle, but padding still happens
    indices = list(sampler)
    x = torch.tensor(indices, dtype=torch.float32, device=device)
    correct = (predict(x) == torch.tensor([EVAL_LABELS[i] for i in indices], device=device)).long()
    # Naive: sum the correct counts and the sample counts over ranks.
    totals = torch.tensor([correct.sum().item(), len(indices)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    naive = (totals[0] / totals[1]).item()
    # Correct: gather (index, correct) pairs, keep one per index.
    pairs = [None] * world_size
    dist.all_gather_object(pairs, list(zip(indices, correct.tolist(), strict=True)))
    unique = dict(p for shard in pairs for p in shard)
    deduplicated = sum(unique.values()) / len(unique)
    # Also correct: one rank evaluates everything (fine when evaluation is cheap).
    on_rank0 = None
    if rank == 0:
        x_all = torch.arange(len(EVAL_LABELS), dtype=torch.float32, device=device)
        on_rank0 = (predict(x_all) == torch.tensor(EVAL_LABELS, device=device)).double().mean().item()
    emit(rank=rank, case="evaluate", indices=indices, naive=naive, deduplicated=deduplicated,
         unique_count=len(unique), on_rank0=on_rank0)


def global_batch(rank: int, local_rank: int, device: torch.device, batch_size: int) -> None:
    """One DDP step with batch_size per rank has the gradient of one step on the combined global batch."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    dataset = list(range(64))
    indices = list(DistributedSampler(dataset, shuffle=True, seed=0))[:batch_size]
    x = torch.stack([torch.tensor([i, i % 7, 1.0]) / 10 for i in indices]).to(device)
    y = torch.tensor([[float(i % 5)] for i in indices], device=device)
    nn.functional.mse_loss(ddp(x), y).backward()  # mean over this rank's batch; DDP averages over ranks
    emit(rank=rank, case="global_batch", indices=indices, grad_weight=model.weight.grad.flatten().tolist(),
         grad_bias=model.bias.grad.tolist())
    del ddp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="grid,rank_source,evaluate,global_batch",
                        help="comma-separated; add image_folder (needs --data)")
    parser.add_argument("--sizes", default="12,10", help="dataset sizes for the grid")
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--data", default="data/shapes", help="an ImageFolder root")
    parser.add_argument("--batch-size", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes per rank")
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    cases = args.cases.split(",")
    if "grid" in cases:
        grid(rank, [int(s) for s in args.sizes.split(",")], args.num_epochs)
    if "rank_source" in cases:
        rank_source(rank, local_rank, world_size, size=12)
    if "image_folder" in cases:
        image_folder(rank, world_size, device, args.data, args.batch_size, args.num_workers)
    if "evaluate" in cases:
        evaluate(rank, world_size, device)
    if "global_batch" in cases:
        global_batch(rank, local_rank, device, args.batch_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
