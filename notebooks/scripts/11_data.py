"""11_data.py: data pipelines under DDP beyond DistributedSampler, one --case each, reported as records."""
import argparse
import json
import math
import os
import shutil
import signal
import tarfile
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    WeightedRandomSampler,
    get_worker_info,
)
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import DatasetFolder


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


# ---- --case iterable: a stream of samples (an IterableDataset) under DDP --------------------------------------
class Stream(IterableDataset):
    """Samples 0..n-1 read in order, as from a file or a bucket; `shard` decides who reads which."""

    def __init__(self, n: int, shard: str):
        self.n, self.shard = n, shard

    def __iter__(self):
        worker = get_worker_info()  # None in the main process; inside a DataLoader worker, its id and count
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        if self.shard == "rank and worker":  # the fix: one slice per (rank, worker) pair of the whole job
            readers, me = dist.get_world_size() * workers, dist.get_rank() * workers + worker_id
        elif self.shard == "rank":
            readers, me = dist.get_world_size(), dist.get_rank()
        else:  # BUG: no sharding; every rank, and every worker of each rank, reads the whole stream
            readers, me = 1, 0
        yield from range(me, self.n, readers)


def case_iterable(rank: int, world_size: int, args: argparse.Namespace) -> None:
    for shard in ("none", "rank", "rank and worker"):
        loader = DataLoader(Stream(24, shard), batch_size=4, num_workers=args.num_workers)
        seen = sorted(i for b in loader for i in b.tolist())
        report(rank, "iterable", shard=shard, samples=seen)
    try:
        DistributedSampler(Stream(24, "none"))  # BUG: a sampler deals out indices; a stream has none, nor a len()
    except TypeError as err:
        report(rank, "iterable", call="DistributedSampler(stream)", error=str(err))
    try:
        DataLoader(Stream(24, "none"), sampler=range(24))
    except ValueError as err:
        report(rank, "iterable", call="DataLoader(stream, sampler=...)", error=str(err))


# ---- --case weighted: a weighted draw (class imbalance) under DDP --------------------------------------------
class DistributedWeightedSampler(Sampler[int]):
    """WeightedRandomSampler's draw, made with a seed every rank shares (and the epoch), then split by rank."""

    def __init__(self, weights: torch.Tensor, num_samples: int | None = None, seed: int = 0):
        self.weights = torch.as_tensor(weights, dtype=torch.double)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.num_samples = math.ceil((num_samples or len(self.weights)) / self.world_size)  # per rank
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # the same draw on every rank
        drawn = torch.multinomial(self.weights, self.num_samples * self.world_size, True, generator=generator)
        return iter(drawn[self.rank::self.world_size].tolist())  # every rank its own positions of it

    def __len__(self) -> int:
        return self.num_samples


def case_weighted(rank: int, world_size: int, args: argparse.Namespace) -> None:
    labels = torch.tensor([0] * 900 + [1] * 100)  # 9 to 1: the rare class should come up half the time
    weights = (1.0 / torch.bincount(labels).double())[labels]
    torch.manual_seed(0)  # as every script of the series seeds, on every rank
    plain = list(WeightedRandomSampler(weights, num_samples=len(weights)))  # BUG: the single-process sampler
    report(rank, "weighted", sampler="WeightedRandomSampler", length=len(plain), first=plain[:5],
           rare=labels[plain].float().mean().item())
    sampler = DistributedWeightedSampler(weights, seed=0)  # the fix
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        mine = list(sampler)
        report(rank, "weighted", sampler="DistributedWeightedSampler", epoch=epoch, length=len(mine), drawn=mine,
               rare=labels[mine].float().mean().item())


# ---- --case prepare: every rank preparing the same data set folder ----------------------------------------------
def make_archive(path: str) -> None:
    """The data set as downloaded: 4 classes of 6 samples, in a .tar file."""
    with tempfile.TemporaryDirectory() as folder:
        for k in range(4):
            os.makedirs(os.path.join(folder, f"class{k}"))
            for i in range(6):
                torch.save(torch.full((3,), float(k)), os.path.join(folder, f"class{k}", f"{i}.pt"))
        with tarfile.open(path + ".tmp", "w") as tar:
            tar.add(folder, arcname=".")
    os.replace(path + ".tmp", path)


def prepare(root: str, archive: str, halfway=None) -> None:
    """Unpack the archive into root unless root exists: what a download=True data set does on every rank."""
    if os.path.isdir(root):
        return
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for i, member in enumerate(members):
            tar.extract(member, root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            if halfway and i == len(members) // 2:
                halfway()


def prepare_atomically(root: str, archive: str) -> None:
    """The same, into a temporary folder renamed at the end: root exists only once it is complete."""
    if os.path.isdir(root):
        return
    partial = tempfile.mkdtemp(dir=os.path.dirname(root))
    prepare(os.path.join(partial, "data"), archive)
    os.replace(os.path.join(partial, "data"), root)
    os.rmdir(partial)


def load(root: str) -> DatasetFolder:
    return DatasetFolder(root, loader=lambda p: torch.load(p, weights_only=True), extensions=(".pt",))


def case_prepare(rank: int, world_size: int, args: argparse.Namespace) -> None:
    archive = os.path.join(args.out, "download.tar")
    if rank == 0:
        shutil.rmtree(args.out, ignore_errors=True)
        os.makedirs(args.out)
        make_archive(archive)
    dist.barrier()
    # BUG: every rank prepares. Two barriers stand in for bad luck: rank 1 looks while rank 0 is halfway.
    root = os.path.join(args.out, "every_rank")
    if rank == 0:
        prepare(root, archive, halfway=lambda: (dist.barrier(), dist.barrier()))
        data = load(root)
    else:
        dist.barrier()  # rank 0 is halfway now
        prepare(root, archive)  # the folder exists: nothing to do, it thinks
        data = load(root)
        dist.barrier()  # rank 0 goes on
    report(rank, "prepare", variant="every rank prepares", classes=data.classes, samples=len(data))
    dist.barrier()
    # The fix: rank 0 prepares (atomically), then a barrier every rank reaches, outside the if.
    root = os.path.join(args.out, "rank0")
    if rank == 0:
        prepare_atomically(root, archive)
    dist.barrier()
    data = load(root)
    report(rank, "prepare", variant="rank 0 prepares, then a barrier", classes=data.classes, samples=len(data))


# ---- --case shuffle: a DistributedSampler and shuffle=True -------------------------------------------------------
def case_shuffle(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dataset = list(range(8))
    sampler = DistributedSampler(dataset)  # shuffle=True is its default: the sampler shuffles
    try:
        DataLoader(dataset, sampler=sampler, shuffle=True)  # BUG: the loader asked to shuffle too
    except ValueError as err:
        report(rank, "shuffle", call="DataLoader(dataset, sampler=sampler, shuffle=True)", error=str(err))
    loader = DataLoader(dataset, sampler=sampler, batch_size=4)  # the fix: leave shuffle to the sampler
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)  # a new order each epoch
        orders.append([i for b in loader for i in b.tolist()])
    report(rank, "shuffle", orders=orders)


# ---- --case bus-error: a DataLoader worker killed by SIGBUS (what a full /dev/shm does) --------------------------
class Touchy(Dataset):
    """Its first sample sends the worker SIGBUS: a stand-in for touching shared memory /dev/shm could not back."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 0:
            os.kill(os.getpid(), signal.SIGBUS)
        return index


def as_list(batch: list) -> list:
    return batch  # no tensors: nothing of the dead worker's is left to fetch


def case_bus_error(rank: int, world_size: int, args: argparse.Namespace) -> None:
    try:
        list(DataLoader(Touchy(), num_workers=1, collate_fn=as_list))
    except RuntimeError as err:
        report(rank, "bus-error", error=str(err), cause=str(err.__cause__) if err.__cause__ else None)


CASES = {"iterable": case_iterable, "weighted": case_weighted, "prepare": case_prepare, "shuffle": case_shuffle,
         "bus-error": case_bus_error}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--num-workers", type=int, default=2, help="--case iterable: DataLoader workers per rank")
    parser.add_argument("--out", default="runs/11_prepare", help="--case prepare: the data set's folder")
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    CASES[args.case](rank, world_size, args)
    dist.barrier()  # nobody leaves while a peer may still be connecting: most cases make no collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
