"""06_train.py: an image classifier trained with DDP, using everything the series taught.

Runs unchanged with `python 06_train.py` (one process) or `torchrun --nproc-per-node=N 06_train.py`.
"""
import argparse
import gc
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def setup() -> tuple[bool, int, int, int, torch.device]:
    """(ddp, rank, local_rank, world_size, device): torchrun sets RANK; plain `python` does not (nanoGPT's test)."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # 02: the device index on this node
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not ddp:
        return False, 0, 0, 1, device
    join_process_group(backend)  # 05: env:// from torchrun, no rank/world_size arguments; below main()
    return True, dist.get_rank(), local_rank, dist.get_world_size(), device  # 02: RANK for data and identity


class Indexed(Dataset):
    """Wraps a dataset so each item also carries its index (to drop the sampler's padding in evaluation)."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x, y, i


def build_model(num_classes: int) -> nn.Module:
    """A small CNN with BatchNorm (converted to SyncBatchNorm on GPUs, see 03)."""
    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())
    return nn.Sequential(block(3, 16), nn.MaxPool2d(2), block(16, 32), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, num_classes))


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, ddp: bool) -> dict:
    """Loss and accuracy over the whole validation set, counting each image once despite sampler padding (02)."""
    model.eval()
    idx, loss, correct = [], [], []
    with torch.no_grad():
        for x, y, i in loader:
            out = model(x.to(device))
            loss.append(nn.functional.cross_entropy(out, y.to(device), reduction="none"))
            correct.append((out.argmax(1) == y.to(device)).float())
            idx.append(i.to(device))
    mine = torch.stack([torch.cat(idx).float(), torch.cat(loss), torch.cat(correct)])
    if ddp:  # every rank holds the same number of (padded) items, so all_gather fits
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        mine = torch.cat(every, dim=1)
    first = {}
    for col in range(mine.shape[1]):  # keep the first copy of each index
        first.setdefault(int(mine[0, col]), col)
    kept = mine[:, sorted(first.values())]
    model.train()
    return {"val_loss": kept[1].mean().item(), "val_acc": kept[2].mean().item(), "val_items": kept.shape[1]}


def save_atomically(obj: dict, path: str) -> None:
    """Temp file in the same folder, flushed to disk, then renamed over `path`: never half a checkpoint (01)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # durable: the bytes are on disk before the new name can point at them
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half of either


def load_weights(model: nn.Module, path: str, device: torch.device) -> dict:
    """Load a checkpoint saved by this script (or from a DDP/compiled model, nested either way) into a plain model."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    state = ckpt["model"] if "model" in ckpt else ckpt
    # 01's rule: a wrapper's prefix comes off only while *every* key carries it, the outermost first, until none
    # does. So "_orig_mod.module." (torch.compile(DDP(m))) and "module._orig_mod." (DDP(torch.compile(m))) both go,
    # and a model's own submodule named "module" keeps its name as long as some keys lie outside it.
    stripped = True
    while stripped:
        stripped = False
        for prefix in ("module.", "_orig_mod."):  # DDP / DataParallel, torch.compile
            if state and all(key.startswith(prefix) for key in state):
                consume_prefix_in_state_dict_if_present(state, prefix)
                stripped = True
    model.load_state_dict(state)  # strict: any other mismatch still raises
    return ckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/shapes")
    parser.add_argument("--out", default="runs/06")
    parser.add_argument("--num-epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16, help="per process; global = batch_size x world_size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last.pt if it exists")
    parser.add_argument("--crash-after-epoch", type=int, default=-1,
                        help="the last rank fails after this epoch (a resumed run has passed it)")
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args()

    ddp, rank, local_rank, world_size, device = setup()
    # CPU threads are left to the launcher: torchrun sets OMP_NUM_THREADS=1 for each worker when it starts more than
    # one per node and you did not set it. For a rank's share of the CPUs, count those it may use (05), then set it.
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP would broadcast rank 0's anyway)
    os.makedirs(args.out, exist_ok=True)
    last = os.path.join(args.out, "last.pt")

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transform=tf)
    val_set = Indexed(datasets.ImageFolder(os.path.join(args.data, "val"), transform=tf))
    # 02: one sampler per process, global rank; num_replicas=1 in plain python gives the same order.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    pin = device.type == "cuda"  # pin_memory only helps host-to-GPU copies
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=pin)

    model = build_model(len(train_set.classes))
    if ddp and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # 03: before the DDP wrap; GPUs only
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_epoch, history = 0, []
    if args.resume and os.path.exists(last):
        ckpt = load_weights(model, last, device)  # every rank reads the same file, onto its own device
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, history = ckpt["sampler"]["epoch"], ckpt["history"]  # the loop calls set_epoch with it
    # 04: by default DDP broadcasts rank 0's buffers at the start of a forward through the wrapper (skipped only
    # after a no_grad or no_sync() forward through it; evaluation here uses the module): one collective per step.
    # This script hands rank 0's BatchNorm statistics to every rank once per epoch (before evaluating), so it turns
    # that off. torch >= 2.13: forward_sync_buffers=False (also no buffer syncs under Join; the sync at construction
    # stays). Before 2.13: broadcast_buffers=False, which also skips the sync at construction: harmless here, every
    # rank builds the model from the same seed and loads the same checkpoint.
    no_sync_buffers = {("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                        else "broadcast_buffers"): False}
    net = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None, **no_sync_buffers) if ddp else model

    if rank == 0:
        print(json.dumps({"event": "start", "rank": rank, "world_size": world_size, "device": str(device),
                          "backend": dist.get_backend() if ddp else None, "ddp": ddp,
                          "global_batch": args.batch_size * world_size, "start_epoch": start_epoch,
                          "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),  # 05: restarts so far
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                          "torch_threads": torch.get_num_threads(),  # the intra-op threads this rank computes with
                          "cpu_count": os.cpu_count(),  # the whole machine's CPUs, whatever this process may use
                          "train_items": len(train_set), "val_items": len(val_set)}))
    for epoch in range(start_epoch, args.num_epochs):
        train_sampler.set_epoch(epoch)  # 02: a new shuffle each epoch, the same on every rank
        total, seen, t0 = torch.zeros(2, device=device), 0, time.perf_counter()
        for step, (x, y) in enumerate(train_loader):
            loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # 04: DDP averages gradients across ranks during backward
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
            seen += len(y)
            if rank == 0 and (step + 1) % max(1, len(train_loader) // 2) == 0:  # rank-0 progress, no tqdm needed
                print(f"epoch {epoch} step {step + 1}/{len(train_loader)} loss {loss.item():.3f}", flush=True)
        seconds = time.perf_counter() - t0
        if ddp:
            dist.all_reduce(total)  # sum of losses and of counts over ranks: the global mean train loss
            # rank 0's BatchNorm running statistics are the ones saved: evaluate with them on every rank (04)
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        metrics = evaluate(model, val_loader, device, ddp)  # 04: evaluate the module, not the DDP wrapper
        history.append({"epoch": epoch, "train_loss": (total[0] / total[1]).item(), **metrics})
        if rank == 0:
            # 01: rank 0 alone saves; plain keys (.module), plus what --resume needs to continue exactly.
            save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "epoch": epoch, "sampler": {"epoch": epoch + 1, "seed": args.seed},
                             "history": history}, last)
            print(json.dumps({"event": "epoch", "rank": rank, **history[-1], "seconds": seconds,
                              "samples_per_s": seen * world_size / seconds}), flush=True)
        if ddp:
            dist.barrier()  # nobody races ahead (or crashes) before the checkpoint is on disk
        if epoch == args.crash_after_epoch and rank == world_size - 1:
            raise RuntimeError(f"simulated crash after epoch {epoch} (restart or rerun with --resume)")

    if rank == 0:
        plain = build_model(len(train_set.classes)).to(device)  # 01: a plain model for inference
        load_weights(plain, last, device)
        checksum = sum(t.double().sum().item() for t in plain.state_dict().values())
        print(json.dumps({"event": "done", "rank": rank, "final_checksum": checksum, **history[-1]}))
    if ddp:
        del net
        gc.collect()  # free the DDP wrapper while its group exists (01; freed after it, torch 2.8 hung)
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
