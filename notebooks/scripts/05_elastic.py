"""05_elastic.py: a training loop that survives a crash: snapshot each epoch, resume when torchrun restarts it."""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def report(record: dict) -> None:
    """One JSON record, one line, one write: under torchrun print() writes a line and its newline apart (05 §7)."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def setup(plain_init: bool) -> tuple[int, int, int, torch.device]:
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if plain_init:  # the bare call, to see what a restart does to it; the timeout turns a hang into an error (07)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=10))
    else:
        join_process_group(backend)
    return dist.get_rank(), local_rank, dist.get_world_size(), device


def batch_for(epoch: int, rank: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for (epoch, rank) in every attempt, so a resumed run repeats exactly."""
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    x = torch.randn(batch_size, 8, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).to(device)


def save_snapshot(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epochs_done: int) -> None:
    """Rank 0 only: a temporary file, flushed to disk, then renamed: a crash, even a power cut, never leaves half a
    snapshot."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_done": epochs_done}, f)
        f.flush()
        os.fsync(f.fileno())  # durable: the bytes are on disk before the new name can point at them
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half of either


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--snapshot", required=True, help="file for the snapshot; on shared storage across nodes")
    parser.add_argument("--num-epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--crash-at-epoch", type=int, default=-1, help="rank 1 crashes here, unless resumed")
    parser.add_argument("--plain-init", action="store_true", help="init_process_group(backend) alone (see notebook 05)")
    parser.add_argument("--hold-at-epoch", type=int, default=-1,
                        help="wait at the start of this epoch until --hold-file exists (notebook 05 acts meanwhile)")
    parser.add_argument("--hold-file", help="the file --hold-at-epoch waits for; an attempt that finds it goes on")
    args = parser.parse_args()
    if args.hold_at_epoch >= 0 and not args.hold_file:
        parser.error("--hold-at-epoch needs --hold-file, the file whose creation lets the ranks go on")
    rank, local_rank, world_size, device = setup(args.plain_init)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # 0, then 1 after a restart

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_epoch = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, map_location=device, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])  # momentum too: the run continues exactly
        start_epoch = snapshot["epochs_done"]
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    report({"rank": rank, "event": "start", "attempt": attempt, "start_epoch": start_epoch,
            "world_size": world_size, "master_port": int(os.environ["MASTER_PORT"])})  # where this attempt's store is

    for epoch in range(start_epoch, args.num_epochs):
        if epoch == args.crash_at_epoch and start_epoch == 0 and rank == 1:  # a resumed attempt is past it
            raise RuntimeError(f"rank {rank} crashes at epoch {epoch} on purpose")
        if epoch == args.hold_at_epoch and not os.path.exists(args.hold_file):
            report({"rank": rank, "event": "held", "attempt": attempt, "epoch": epoch})
            while not os.path.exists(args.hold_file):  # until the notebook has done what it holds the job for
                time.sleep(0.1)
        x, y = batch_for(epoch, rank, args.batch_size, device)
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients of all ranks here
        optimizer.step()
        if rank == 0:
            save_snapshot(args.snapshot, model, optimizer, epochs_done=epoch + 1)
        # Before the barrier, as the snapshot: out before any rank can go on to the next epoch (and crash there).
        report({"rank": rank, "event": "epoch", "attempt": attempt, "epoch": epoch, "loss": loss.item()})
        dist.barrier()  # nobody starts the next epoch before this epoch's snapshot exists

    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu().tolist()
    report({"rank": rank, "event": "done", "attempt": attempt, "global_batch": args.batch_size * world_size,
            "weights": weights})
    dist.destroy_process_group()


# Workaround for an upstream issue (torch 2.14, pytorch#135712): workers that torchrun starts again (--max-restarts, a
# node joining --nnodes=MIN:MAX) meet the old store: each attempt gets keys of its own, or refuses. Proof: notebook 05.
def join_process_group(backend: str, **options) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a store of this attempt's own: nothing left behind
        return dist.init_process_group(backend, **options)  # env://
    if os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"] or os.environ["TORCHELASTIC_MAX_RESTARTS"] == "0":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        attempt = dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)  # counts: per node
        first = attempt.compare_set("world_size", "", os.environ["WORLD_SIZE"]).decode()  # whoever came first set it
        if attempt.add(f"rank{os.environ['RANK']}", 1) == 1 and first == os.environ["WORLD_SIZE"]:  # a count unused
            return dist.init_process_group(backend, store=attempt, rank=int(os.environ["RANK"]),
                                           world_size=int(os.environ["WORLD_SIZE"]), **options)
    raise RuntimeError("torchrun restarts workers on one store, where TORCHELASTIC_RESTART_COUNT cannot tell the "
                       "attempts apart: with c10d rendezvous, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node. "
                       "Static rendezvous (--master-addr/--master-port) ignores that switch: launch with "
                       "--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT and the switch (see notebook 05)")


if __name__ == "__main__":
    main()
