"""01_checkpoints.py: train a tiny BatchNorm model under DDP, save it (rank 0, atomically), load it on every rank."""
import argparse
import gc
import json
import os

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


def build_model() -> nn.Module:
    """Linear -> BatchNorm -> ReLU -> Linear: parameters *and* buffers (running stats) in its state_dict."""
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def save_atomically(obj: dict, path: str) -> None:
    """Temp file in the same folder, flushed to disk, then renamed over `path`: never half a checkpoint (01)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # durable: the bytes are on disk before the new name can point at them
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half of either


def checksum(model: nn.Module, what: str = "all") -> float:
    """One number per model: the float64 sum of its parameters, its buffers, or both ("all")."""
    tensors = {"params": model.parameters(), "buffers": model.buffers(), "all": model.state_dict().values()}[what]
    return sum(t.double().sum().item() for t in tensors)


def gather(value: float, device: torch.device) -> list[float]:
    """Every rank's value, on every rank (all_gather of a one-element tensor)."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/01")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    os.makedirs(args.out, exist_ok=True)
    plain_path = os.path.join(args.out, "plain.pt")
    wrapped_path = os.path.join(args.out, "ddp_wrapped.pt")
    optimizer_path = os.path.join(args.out, "optimizer.pt")

    # 1. Train a few steps. Same seed on every rank, but DDP would broadcast rank 0's weights anyway.
    torch.manual_seed(0)
    model = build_model().to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)  # momentum: a state of its own
    data = torch.Generator().manual_seed(100 + rank)  # each rank draws its own batches
    for _ in range(args.steps):
        x = torch.randn(16, 4, generator=data).to(device)
        y = torch.randint(0, 2, (16,), generator=data).to(device)
        loss = nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
    trained = checksum(ddp.module)
    print(json.dumps({"rank": rank, "case": "train", "device": str(device), "world_size": world_size,
                      "param_checksums": gather(checksum(ddp.module, "params"), device),
                      "buffer_checksums": gather(checksum(ddp.module, "buffers"), device), "loss": loss.item(),
                      "wrapped_keys": list(ddp.state_dict()), "plain_keys": list(ddp.module.state_dict())}))

    # 2. Rank 0 alone saves both flavours, atomically. Every rank holds the same weights, so one file is enough.
    if rank == 0:
        save_atomically(ddp.state_dict(), wrapped_path)  # keys start with "module."
        save_atomically(ddp.module.state_dict(), plain_path)  # plain keys: the habit to keep
        save_atomically(optimizer.state_dict(), optimizer_path)  # the momentum buffers, for case 5
    dist.barrier()  # NEEDED: no rank may open the file before rank 0 has finished writing it

    # 3. Every rank loads onto its own device (cuda:LOCAL_RANK or cpu), into a fresh, untrained model.
    torch.manual_seed(1 + rank)  # deliberately different weights on each rank before loading
    fresh = build_model().to(device)
    before = gather(checksum(fresh), device)
    state = torch.load(plain_path, map_location=device, weights_only=True)
    fresh.load_state_dict(state)
    # No barrier needed after the load: loading is local, and no rank changes plain.pt afterwards. (Not because the
    # next collective waits: on NCCL it returns once queued. Delete or replace a file the others read only after a
    # dist.barrier() that follows their loads.)
    print(json.dumps({"rank": rank, "case": "load_every_rank", "device": str(device),
                      "loaded_device": str(next(iter(state.values())).device),
                      "before": before, "after": gather(checksum(fresh), device), "trained": trained}))

    # 4. Without the barrier nothing makes a reader wait for the writer. Every other rank looks for the file at once;
    #    rank 0 saves only after each has told it so (a message standing in for a save slower than the look), so the
    #    unlucky order happens in every run, not only on a busy machine.
    late_path = os.path.join(args.out, "late.pt")
    if rank == 0 and os.path.exists(late_path):
        os.remove(late_path)
    dist.barrier()  # start from a clean folder
    looked = torch.zeros(1, device=device)
    if rank == 0:
        for reader in range(1, world_size):
            dist.recv(looked, src=reader)
            looked.item()  # an NCCL recv returns once it is queued on the GPU: .item() waits for the message
        save_atomically(ddp.module.state_dict(), late_path)
        found_without_barrier = os.path.exists(late_path)
    else:
        found_without_barrier = os.path.exists(late_path)  # no barrier before this line: it runs at once
        dist.send(looked, dst=0)  # "I have looked"
    dist.barrier()
    print(json.dumps({"rank": rank, "case": "race", "found_without_barrier": found_without_barrier,
                      "found_after_barrier": os.path.exists(late_path)}))

    # 5. Alternative: only rank 0 loads, and wrapping in DDP broadcasts rank 0's state to every rank. That state
    #    is the module's parameters and buffers only: DDP never sees the optimizer (nor a scheduler or a GradScaler),
    #    so their states must be loaded on every rank. Tried both ways, each followed by one more training step.
    x = torch.randn(16, 4, generator=data).to(device)
    y = torch.randint(0, 2, (16,), generator=data).to(device)
    for case, optimizer_on_every_rank in (("rank0_load_then_wrap", False), ("optimizer_on_every_rank", True)):
        torch.manual_seed(1 + rank)
        solo = build_model().to(device)
        solo_optimizer = torch.optim.SGD(solo.parameters(), lr=0.1, momentum=0.9)
        if rank == 0:
            solo.load_state_dict(torch.load(plain_path, map_location=device, weights_only=True))
        if rank == 0 or optimizer_on_every_rank:
            solo_optimizer.load_state_dict(torch.load(optimizer_path, map_location=device, weights_only=True))
        before = gather(checksum(solo), device)
        solo_ddp = DDP(solo, device_ids=[local_rank] if device.type == "cuda" else None)
        after = gather(checksum(solo_ddp.module), device)
        momentum = sum(s["momentum_buffer"].double().sum().item() for s in solo_optimizer.state.values())
        optimizer_states = gather(float(len(solo_optimizer.state)), device)  # parameters with a momentum buffer
        momentum_checksums = gather(momentum, device)
        loss = nn.functional.cross_entropy(solo_ddp(x), y)
        solo_optimizer.zero_grad()
        loss.backward()  # the same averaged gradient on every rank
        solo_optimizer.step()
        print(json.dumps({"rank": rank, "case": case, "before": before, "after": after, "trained": trained,
                          "optimizer_states": optimizer_states, "momentum_checksums": momentum_checksums,
                          "params_after_step": gather(checksum(solo_ddp.module, "params"), device)}))
    # Free the DDP wrappers while their process group exists. A wrapper is in a reference cycle, so `del` alone
    # leaves it to the garbage collector; collected after destroy_process_group, it made gloo abort the process
    # ("terminate called without an active exception") in 2 of 20 runs of a 3-DDP script here, 0 of 20 with this.
    del ddp, solo_ddp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
