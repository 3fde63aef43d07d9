"""08_train.py: the capstone grown into a template for real projects.

Mixed precision, gradient clipping, a scaled learning rate with warm-up and cosine decay, gradient
accumulation, augmentation that is reproducible under any number of workers, and a checkpoint that
holds everything the next epoch depends on (RNG states of every rank included), so that a run
restarted by `torchrun --max-restarts` ends exactly where an uninterrupted one does: proven on CPUs with
gloo (notebook 08). On GPUs, `--deterministic` is what should make that hold too: reasoned from torch's
source, not yet run on a GPU (benchmarks/gpu_check.py checks it where one is at hand).
Runs with `python 08_train.py` or `torchrun --nproc-per-node=N 08_train.py`.
"""
import argparse
import contextlib
import gc
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch import nn
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
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds this process to its own GPU
    else:
        device = torch.device("cpu")
    if not ddp:
        return False, 0, 0, 1, device
    # device_id (NCCL): create the communicator now, bound to this GPU, instead of guessing it at the first collective
    join_process_group(backend, device_id=device if backend == "nccl" else None)  # 05: env://; below main()
    return True, dist.get_rank(), local_rank, dist.get_world_size(), device


class EpochSampler(DistributedSampler):
    """A DistributedSampler that hands out (epoch, index): set_epoch reaches the workers, even persistent ones."""

    def __iter__(self):
        return ((self.epoch, i) for i in super().__iter__())


class Augmented(Dataset):
    """Random flips and shifts drawn from (seed, epoch, index) alone: the same in every run, with any number
    of DataLoader workers, before and after a restart. Each rank sees other indices, so other draws."""

    def __init__(self, base: Dataset, seed: int):
        self.base, self.seed = base, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]):
        epoch, i = key
        x, y = self.base[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + i)
        if torch.rand(1, generator=g).item() < 0.5:
            x = x.flip(-1)
        dy, dx = torch.randint(-2, 3, (2,), generator=g).tolist()
        return x.roll((dy, dx), dims=(1, 2)), y


def build_model(num_classes: int) -> nn.Module:
    """The capstone's small CNN, plus dropout (which draws from the torch RNG on every training step)."""
    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())
    return nn.Sequential(block(3, 16), nn.MaxPool2d(2), block(16, 32), GlobalAvgPool(), nn.Flatten(),
                         nn.Dropout(0.2), nn.Linear(32, num_classes))


def checksum(model: nn.Module) -> float:
    return sum(t.double().sum().item() for t in model.state_dict().values())


def gather(obj: object, ddp: bool) -> list:
    """Every rank's ``obj``, in rank order (one process: a list of one)."""
    if not ddp:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def evaluate(model: nn.Module, val_set: Dataset, device: torch.device) -> dict:
    """Rank 0 only, through the plain module (no collective inside): loss and accuracy on every image (04)."""
    model.eval()
    # Its own generator: creating an iterator draws a seed, which would otherwise shift rank 0's training stream.
    loader = DataLoader(val_set, batch_size=64, generator=torch.Generator())
    loss = correct = 0.0
    with torch.no_grad():
        for x, y in loader:
            out = model(x.to(device)).float()
            loss += nn.functional.cross_entropy(out, y.to(device), reduction="sum").item()
            correct += (out.argmax(1) == y.to(device)).sum().item()
    model.train()
    return {"val_loss": loss / len(val_set), "val_acc": correct / len(val_set)}


def rng_states(loader_generator: torch.Generator, device: torch.device) -> dict:
    """What draws random numbers in this process: torch's CPU stream and, on GPUs, the CUDA stream (dropout draws
    from the generator of the device it runs on), Python's `random`, and the DataLoader's generator."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "loader": loader_generator.get_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(states: dict, loader_generator: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    loader_generator.set_state(states["loader"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"], device)


def checkpoint(model: nn.Module, optimizer, scheduler, scaler, epoch: int, rng: list, history: list,
               args: dict) -> dict:
    """Everything the next epoch depends on, after `epoch`; `rng` holds every rank's streams, in rank order."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "sampler_epoch": epoch + 1, "step": int(scheduler.last_epoch),
            "world_size": len(rng), "rng": rng, "history": history, "args": args}


def restore(path: str, model: nn.Module, optimizer, scheduler, scaler, loader_generator: torch.Generator,
            rank: int, world_size: int, device: torch.device, rng: bool = True) -> tuple[int, list]:
    """Load a `checkpoint()` file into this rank's objects: (the epoch to start from, the history so far)."""
    # Onto the CPU, not this rank's device: the RNG setters take CPU ByteTensors only, and a GPU map_location
    # would move the saved states there. Nothing else needs the device: load_state_dict copies the weights into
    # the model where it is, Optimizer.load_state_dict moves its state to its parameters' device, and the
    # scheduler's and GradScaler's states are plain numbers.
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt["world_size"] != world_size:
        raise SystemExit(f"{path} was saved by {ckpt['world_size']} ranks, this run has {world_size}: its per-rank "
                         "RNG states and its learning rate and schedule (scaled for its global batch) do not fit. "
                         f"Resume with {ckpt['world_size']} ranks (an elastic --nnodes=MIN:MAX job can change size "
                         "between attempts: give --nnodes one number), or start a new run in another --out")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    if rng:
        set_rng_states(ckpt["rng"][rank], loader_generator, device)  # this rank's own streams
    return ckpt["sampler_epoch"], ckpt["history"]


def save_atomically(obj: dict, path: str) -> None:
    """Temp file in the same folder, flushed to disk, then renamed over `path`: never half a checkpoint (01)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # durable: the bytes are on disk before the new name can point at them
    os.replace(tmp, path)  # atomic on POSIX: a reader sees the old file or the new one, never half of either


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/capstone")
    parser.add_argument("--out", default="runs/08")
    parser.add_argument("--num-epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per process and micro-batch")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (no_sync between)")
    parser.add_argument("--base-lr", type=float, default=0.05, help="learning rate for a global batch of --base-batch")
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                        help="bf16: autocast to bfloat16; fp16: float16 with a GradScaler (any device, slow on CPUs)")
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels: on GPUs, what should "
                        "make reruns bit-identical (reasoned from torch's source, not yet run on a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last.pt if it exists")
    parser.add_argument("--crash-after-epoch", type=int, default=-1, help="the last rank fails (unless resumed past it)")
    parser.add_argument("--crash-at-step", type=int, default=-1, help="the last rank fails after this optimizer step, "
                        "mid-epoch, in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0): a restarted "
                        "attempt goes past it, even from no checkpoint (a step in epoch 0)")
    parser.add_argument("--init-seed-per-rank", action="store_true", help="demo: different initial weights per rank")
    parser.add_argument("--no-restore-rng", action="store_true", help="demo: resume without the RNG states")
    args = parser.parse_args()

    if args.deterministic:  # before any CUDA work: cuBLAS reads the variable when it sets up its workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # else cuBLAS matmuls raise under the next line
        torch.use_deterministic_algorithms(True)  # an op without a deterministic kernel raises instead of running
        torch.backends.cudnn.benchmark = False  # the default, said aloud: timing trials may pick other algorithms
    ddp, rank, local_rank, world_size, device = setup()
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    os.makedirs(args.out, exist_ok=True)
    last = os.path.join(args.out, "last.pt")

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    base = datasets.ImageFolder(os.path.join(args.data, "train"), transform=tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transform=tf)
    sampler = EpochSampler(base, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader_generator = torch.Generator().manual_seed(args.seed + rank)  # seeds the workers: per rank, saved
    loader = DataLoader(Augmented(base, args.seed), batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, generator=loader_generator, pin_memory=device.type == "cuda",
                        persistent_workers=args.persistent_workers and args.num_workers > 0)
    if len(loader) % args.accum:
        raise SystemExit(f"{len(loader)} micro-batches per epoch do not split into windows of --accum {args.accum}")

    # Seeding: the same initial weights everywhere (DDP would broadcast rank 0's anyway), then a different
    # stream per rank for what must differ between ranks: here, the dropout masks.
    torch.manual_seed(args.seed + (rank if args.init_seed_per_rank else 0))
    model = build_model(len(base.classes)).to(device)
    if ddp and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # 03: GPUs only, before the DDP wrap
    init_checksums = gather(checksum(model), ddp)
    torch.manual_seed(args.seed * 1_000 + rank)
    random.seed(args.seed * 1_000 + rank)
    net = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None) if ddp else model
    wrapped_checksums = gather(checksum(model), ddp)
    # What autocast gives the first (Sync)BatchNorm: recorded on the first micro-batch, then the hook goes.
    bn_dtypes = {}
    first_bn = next(m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.SyncBatchNorm)))
    bn_hook = first_bn.register_forward_hook(lambda module, inputs, output: bn_dtypes.update(
        batch_norm_input=str(inputs[0].dtype), batch_norm_output=str(output.dtype)))

    # Learning rate: scaled with the global batch (per-process batch x ranks x accumulation), warmed up, then cosine.
    global_batch = args.batch_size * world_size * args.accum
    lr = args.base_lr * global_batch / args.base_batch
    steps_per_epoch = len(loader) // args.accum
    total_steps = steps_per_epoch * args.num_epochs
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=args.warmup_steps)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - args.warmup_steps))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_steps])
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 has fp32's range: no scaling

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # torchrun's restarts so far (plain python: 0)
    start_epoch, history = 0, []
    if args.resume and os.path.exists(last):  # every rank reads the one file
        start_epoch, history = restore(last, model, optimizer, scheduler, scaler, loader_generator, rank, world_size,
                                       device, rng=not args.no_restore_rng)
    if rank == 0:
        print(json.dumps({"event": "start", "rank": rank, "world_size": world_size, "device": str(device),
                          "backend": dist.get_backend() if ddp else None, "amp": args.amp, "global_batch": global_batch,
                          "lr": lr, "steps_per_epoch": steps_per_epoch, "start_epoch": start_epoch,
                          "start_step": int(scheduler.last_epoch), "deterministic": args.deterministic,
                          "attempt": attempt,
                          "init_checksums": init_checksums, "wrapped_checksums": wrapped_checksums}), flush=True)

    for epoch in range(start_epoch, args.num_epochs):
        sampler.set_epoch(epoch)  # the sampler lives in this process, so this reaches persistent workers too
        record = {"event": "epoch", "rank": rank, "epoch": epoch, "lrs": [], "grad_norms": [], "losses": []}
        seen, t0 = 0, time.perf_counter()
        for micro, (x, y) in enumerate(loader):
            sync = (micro + 1) % args.accum == 0
            with net.no_sync() if ddp and not sync else contextlib.nullcontext():  # 04: accumulate locally
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    out = net(x.to(device, non_blocking=True))
                    loss = nn.functional.cross_entropy(out, y.to(device))  # autocast computes it in float32
                if epoch == start_epoch and micro == 0:
                    record["dtypes"] = {**bn_dtypes, "logits": str(out.dtype), "loss": str(loss.dtype),
                                        "weights": str(next(model.parameters()).dtype)}
                    bn_hook.remove()
                scaler.scale(loss / args.accum).backward()  # DDP all-reduces the gradients here when in sync
            seen += len(y)
            if not sync:
                continue
            scaler.unscale_(optimizer)  # clip the true gradients (a no-op without fp16)
            record.setdefault("grad_dtype", str(next(model.parameters()).grad.dtype))
            # After backward the gradients are averaged over ranks: every rank computes the same norm.
            norm = nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm)
            record["lrs"].append(scheduler.get_last_lr()[0])
            record["grad_norms"].append(norm.item())
            record["losses"].append(loss.item())
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()  # once per optimizer step, not per micro-batch
            # The first attempt only: a crash in epoch 0 leaves no checkpoint, so the restart begins where this one did.
            if scheduler.last_epoch == args.crash_at_step and attempt == 0 and rank == world_size - 1:
                raise RuntimeError(f"simulated crash at optimizer step {args.crash_at_step}, in epoch {epoch}")
        record["optimizer_steps"] = int(scheduler.last_epoch)
        record["samples_per_s"] = seen * world_size / (time.perf_counter() - t0)  # training only, all ranks
        if rank == 0:
            record.update(evaluate(model, val_set, device))
            history.append({k: record[k] for k in ("epoch", "val_loss", "val_acc")})
        rng = gather(rng_states(loader_generator, device), ddp)  # every rank's streams, for rank 0's one file
        if rank == 0:
            save_atomically(checkpoint(model, optimizer, scheduler, scaler, epoch, rng, history, vars(args)), last)
        print(json.dumps(record), flush=True)
        if ddp:  # nobody goes on (or crashes) before the checkpoint is on disk; on NCCL, name the GPU to sync on
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        if epoch == args.crash_after_epoch and rank == world_size - 1:
            raise RuntimeError(f"simulated crash after epoch {epoch} (restart or rerun with --resume)")

    if rank == 0:
        print(json.dumps({"event": "done", "rank": rank, "final_checksum": checksum(model), "history": history}))
    if ddp:
        del net
        gc.collect()  # free the DDP wrapper while its process group exists (01)
        dist.destroy_process_group()


# A workaround for an upstream gap (AdaptiveAvgPool2d's CUDA backward is not deterministic); why: notebook 08, §5's end.
class GlobalAvgPool(nn.Module):
    """The mean over height and width, as AdaptiveAvgPool2d(1), whose CUDA backward has no deterministic version."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3), keepdim=True)


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
