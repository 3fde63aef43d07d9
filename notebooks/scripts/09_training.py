"""09_training.py: the errors and surprises of a training step under DDP, one --case each, reported as records."""
import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset


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


def wrap(model: nn.Module, device: torch.device, **ddp_args: object) -> DDP:
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_args)


def gathered(value: float, device: torch.device) -> list[float]:
    """``value`` from every rank, in rank order."""
    out = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], device=device))
    return [t.item() for t in out]


def shard(rank: int, world_size: int, batch: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (the same on every rank, from one seed) and this rank's equal share of it."""
    whole = torch.randn((batch * world_size, *shape), generator=torch.Generator().manual_seed(0))
    return whole, whole[rank * batch:(rank + 1) * batch]


# ---- --case checkpoint: activation checkpointing under DDP ---------------------------------------------------
class Checkpointed(nn.Module):
    """A stem, then a block run under torch.utils.checkpoint once or twice (the same weights used twice), a head."""

    def __init__(self, reentrant: bool, twice: bool):
        super().__init__()
        self.stem = nn.Linear(8, 8)  # so that the checkpoint's input requires grad, as inside a real model
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.reentrant, self.twice = reentrant, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.stem(x), use_reentrant=self.reentrant)
        if self.twice:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def case_checkpoint(rank: int, world_size: int, device: torch.device) -> None:
    whole, mine = shard(rank, world_size, 4, (8,))
    variants = {  # name: (use_reentrant, block used twice, DDP arguments)
        "reentrant, find_unused_parameters=True": (True, False, {"find_unused_parameters": True}),
        "use_reentrant=False, find_unused_parameters=True": (False, False, {"find_unused_parameters": True}),
        "reentrant, static_graph=True": (True, False, {"static_graph": True}),
        "reentrant, block used twice": (True, True, {}),
        "use_reentrant=False, block used twice": (False, True, {}),
        "reentrant, block used twice, static_graph=True": (True, True, {"static_graph": True}),
    }
    for name, (reentrant, twice, ddp_args) in variants.items():
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference
        model = Checkpointed(reentrant, twice)
        reference = copy.deepcopy(model)  # one process on the whole batch: what DDP's gradients must equal
        reference(whole).pow(2).mean().backward()
        ddp = wrap(model, device, **ddp_args)
        try:
            ddp(mine.to(device)).pow(2).mean().backward()
        except RuntimeError as err:
            report(rank, "checkpoint", variant=name, ok=False, error=str(err))
            continue
        grads = [p.grad.cpu() for p in ddp.module.parameters()]
        matches = all(torch.allclose(g, r.grad, atol=1e-6)
                      for g, r in zip(grads, reference.parameters(), strict=True))
        checksum = sum(g.double().sum().item() for g in grads)
        report(rank, "checkpoint", variant=name, ok=True, matches_one_process=matches,
               checksums=gathered(checksum, device))


# ---- --case batchnorm: two forwards, one backward ----------------------------------------------------------
def case_batchnorm(rank: int, world_size: int, device: torch.device) -> None:
    data = torch.Generator().manual_seed(rank)  # each rank its own batches, the same in every run
    real, fake = torch.randn(8, 4, generator=data) + rank, torch.randn(8, 4, generator=data) - rank
    flag = ("forward_sync_buffers" if "forward_sync_buffers" in DDP.__init__.__code__.co_varnames
            else "broadcast_buffers")  # torch >= 2.13 : before
    variants = {"two forwards": ({}, True), f"two forwards, {flag}=False": ({flag: False}, True),
                "one forward on both halves": ({}, False)}
    for name, (ddp_args, two) in variants.items():
        torch.manual_seed(0)
        disc = wrap(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)), device, **ddp_args)
        versions = [disc.module[1].running_mean._version]
        if two:  # the GAN discriminator's pattern: D(real), D(fake), then one backward
            out_real = disc(real.to(device))
            versions.append(disc.module[1].running_mean._version)
            out_fake = disc(fake.to(device))
        else:
            out_real, out_fake = disc(torch.cat([real, fake]).to(device)).split(8)
        versions.append(disc.module[1].running_mean._version)
        try:
            (F.softplus(-out_real).mean() + F.softplus(out_fake).mean()).backward()
        except RuntimeError as err:
            report(rank, "batchnorm", variant=name, ok=False, error=str(err), versions=versions)
            continue
        checksum = sum(p.grad.double().sum().item() for p in disc.parameters())
        report(rank, "batchnorm", variant=name, ok=True, versions=versions, checksums=gathered(checksum, device))


# ---- --case loss: what each rank prints, and the step's loss -----------------------------------------------
def case_loss(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    whole_x, x = shard(rank, world_size, 8, (4,))
    whole_y = whole_x.sum(dim=1, keepdim=True)  # a target the fresh model gets wrong
    y = whole_y[rank * 8:(rank + 1) * 8]
    full_batch = F.mse_loss(model(whole_x), whole_y).item()  # one process, the whole batch
    ddp = wrap(model, device)
    loss = F.mse_loss(ddp(x.to(device)), y.to(device))
    loss.backward()
    print(f"rank {rank}: loss {loss.item():.4f}", flush=True)  # what most scripts print: this rank's share only
    step_loss = loss.detach().clone()
    dist.all_reduce(step_loss)  # SUM, then divide: the mean over ranks
    step_loss /= world_size
    report(rank, "loss", rank_loss=loss.item(), step_loss=step_loss.item(), full_batch_loss=full_batch)
    if rank == 0:
        print(f"step 0: loss {step_loss.item():.4f}", flush=True)  # one number, printed once


# ---- --case logging: one progress line, from rank 0 only ----------------------------------------------------
def case_logging(rank: int, world_size: int, device: torch.device, steps: int) -> None:
    total = torch.zeros(1, device=device)
    for step in range(steps):
        dist.all_reduce(total)  # stands in for a training step, which every rank runs
        if rank == 0:  # in your project: tqdm(loader, disable=rank != 0)
            done = (step + 1) * 20 // steps
            print(f"\rtraining [{'#' * done}{'.' * (20 - done)}] {step + 1}/{steps}", end="", file=sys.stderr,
                  flush=True)
    if rank == 0:
        print(file=sys.stderr, flush=True)
        report(rank, "logging", steps=steps)


# ---- --case scaling: one process against two, on a tiny and a bigger model ----------------------------------
def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1))


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, sync: bool = True) -> float:
    """Seconds of one training step; sync=False: under DDP's no_sync(), the same step without its all-reduce."""
    start = time.perf_counter()
    optimizer.zero_grad()
    with contextlib.nullcontext() if sync else model.no_sync():
        model(x).pow(2).mean().backward()
    optimizer.step()
    return time.perf_counter() - start


def case_scaling(rank: int, world_size: int, device: torch.device) -> None:
    models = {"tiny": (tiny, (32,), 60), "conv": (conv, (3, 16, 16), 8)}  # name: (model, input shape, steps)
    for name, (build, shape, steps) in models.items():
        torch.manual_seed(0)
        x = torch.randn(32, *shape, device=device)  # 32 samples per process and step
        plain, ddp = build().to(device), wrap(build(), device)
        plain_sgd, ddp_sgd = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, ddp))
        for _ in range(2):
            one_step(ddp, ddp_sgd, x)  # warm-up: DDP builds its buckets in the first steps
        seconds = {"alone": [], "ddp": [], "no_sync": []}
        for step in range(steps):  # one step of each phase in turn, so that all three see the same load
            for phase in list(seconds) if step % 2 == 0 else list(seconds)[::-1]:
                dist.barrier()
                if phase == "ddp":  # every rank trains, DDP averages the gradients
                    seconds[phase].append(one_step(ddp, ddp_sgd, x))
                elif phase == "no_sync":  # every rank trains, without the all-reduce
                    seconds[phase].append(one_step(ddp, ddp_sgd, x, sync=False))
                elif rank == 0:  # rank 0 trains alone, as one process would; the others wait at the barrier
                    seconds[phase].append(one_step(plain, plain_sgd, x))
        report(rank, "scaling", model=name, seconds=seconds, parameters=sum(p.numel() for p in plain.parameters()),
               threads=torch.get_num_threads())


# ---- --case workers: DataLoader worker processes per rank ---------------------------------------------------
class Busy(Dataset):
    """Samples that cost CPU time to make, like decoding and augmenting an image."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        x = torch.randn(96, 96, generator=torch.Generator().manual_seed(index))
        for _ in range(8):
            x = torch.tanh(x @ x.T / 96)
        return x.sum(), os.getpid(), torch.get_num_threads()


def case_workers(rank: int, world_size: int, device: torch.device) -> None:
    for num_workers in (1, 4):
        dist.barrier()
        start = time.perf_counter()
        pids, threads = set(), set()
        for _, pid, n in DataLoader(Busy(), batch_size=4, num_workers=num_workers):
            pids.update(pid.tolist())
            threads.update(n.tolist())
        seconds = time.perf_counter() - start
        report(rank, "workers", num_workers=num_workers, worker_pids=sorted(pids), worker_threads=sorted(threads),
               seconds=seconds, main_pid=os.getpid(), cores=os.cpu_count())


# ---- --case flight-recorder: what each rank's last collectives were ------------------------------------------
def case_flight_recorder(rank: int, world_size: int, device: torch.device, out: str) -> None:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))  # a short timeout for the demo
    value = torch.ones(1)
    dist.barrier()  # the default group (30 minutes): both ranks begin the steps together, busy machine or not
    try:
        for step in range(3):
            if rank == 1 and step == 2:
                dist.barrier(group=group)  # BUG: rank 1 takes another path (say, an early save) at step 2
            else:
                dist.all_reduce(value, group=group)
    except RuntimeError:
        from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json  # what a timeout dumps

        with open(os.path.join(out, f"trace_rank_{rank}"), "wb") as f:  # the file NCCL's dump would write
            f.write(_dump_fr_trace())
        trace = json.loads(_dump_fr_trace_json())
        ops = [(e["collective_seq_id"], e["profiling_name"]) for e in trace["entries"]
               if e["process_group"][0] == group.group_name]  # (name, description) of the group
        report(rank, "flight-recorder", ops=ops)  # the error itself depends on which rank timed out first
        raise


# ---- GPU only -----------------------------------------------------------------------------------------------
def case_load_device(rank: int, world_size: int, device: torch.device, path: str) -> None:
    """rank 0 saves from its GPU; every rank loads it twice: without, then with map_location."""
    if rank == 0:
        torch.save({"weight": torch.ones(256, 1024, device=device)}, path + ".tmp")  # 1 MiB
        os.replace(path + ".tmp", path)
    dist.barrier()
    before = torch.cuda.memory_allocated(0)
    plain = torch.load(path, weights_only=True)  # no map_location: back where rank 0 saved it
    on_gpu0 = torch.cuda.memory_allocated(0) - before
    mapped = torch.load(path, weights_only=True, map_location=device)
    report(rank, "load-device", plain_device=str(plain["weight"].device), mapped_device=str(mapped["weight"].device),
           bytes_added_on_gpu0=on_gpu0)
    dist.barrier()


def case_same_gpu(rank: int, world_size: int, device: torch.device) -> None:
    """Every rank on cuda:0, as when set_device is missing or CUDA_VISIBLE_DEVICES shows one GPU to all."""
    torch.cuda.set_device(0)
    value = torch.ones(1, device="cuda:0")
    dist.all_reduce(value)  # NCCL makes its communicator here, and checks where each rank is
    report(rank, "same-gpu", sum=value.item())


def case_watchdog(rank: int, world_size: int, device: torch.device) -> None:
    """rank 1 is late for an all_reduce on a group with a 3-second timeout: NCCL's watchdog ends rank 0."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    value = torch.ones(1, device=device)
    dist.all_reduce(value, group=group)  # the first collective makes the communicator
    torch.cuda.synchronize()
    report(rank, "watchdog", event="ready")
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(value, group=group)
    torch.cuda.synchronize()  # rank 0 waits here; the watchdog thread times the collective meanwhile


CASES = ["checkpoint", "batchnorm", "loss", "logging", "scaling", "workers", "flight-recorder",
         "load-device", "same-gpu", "watchdog"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--steps", type=int, default=8, help="--case logging")
    parser.add_argument("--out", default="runs/09", help="folder for files (flight recorder dumps, checkpoints)")
    args = parser.parse_args()
    if args.case == "watchdog":  # the flight recorder is on by default; at the timeout it goes to a file
        os.makedirs(args.out, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = os.path.join(os.path.abspath(args.out), "trace_rank_")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", prefix)  # the file's prefix; the old name below
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)
    if args.case == "flight-recorder":  # before the first process group: torch reads it then
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the default since torch 2.11; off (0) before
    rank, local_rank, world_size, device = setup()
    if args.case == "checkpoint":
        case_checkpoint(rank, world_size, device)
    elif args.case == "batchnorm":
        case_batchnorm(rank, world_size, device)
    elif args.case == "loss":
        case_loss(rank, world_size, device)
    elif args.case == "logging":
        case_logging(rank, world_size, device, args.steps)
    elif args.case == "scaling":
        case_scaling(rank, world_size, device)
    elif args.case == "workers":
        case_workers(rank, world_size, device)
    elif args.case == "flight-recorder":
        os.makedirs(args.out, exist_ok=True)
        case_flight_recorder(rank, world_size, device, args.out)
    elif args.case == "load-device":
        os.makedirs(args.out, exist_ok=True)
        case_load_device(rank, world_size, device, os.path.join(args.out, "from_gpu0.pt"))
    elif args.case == "same-gpu":
        case_same_gpu(rank, world_size, device)
    else:
        case_watchdog(rank, world_size, device)
    # The cases' DDP wrappers sit in reference cycles: free them while their group exists (collected after
    # destroy_process_group, gloo can abort the process: "terminate called without an active exception", see 01).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
