"""08_memory.py: bytes of parameters, gradients, optimizer state and DDP's buckets per rank, DDP against FSDP2."""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model(width: int, depth: int) -> nn.Sequential:
    layers = [nn.Linear(width, width) for _ in range(depth)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())])


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of `t`: an FSDP2 parameter is a DTensor, of which each rank holds only its shard."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: a gradient that is a view into a bucket counts once."""
    storages = {local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(model: nn.Module, width: int, device: torch.device, buckets: list) -> dict:
    """One AdamW step, then what this rank holds (`buckets`: the flat buffers DDP all-reduced, if any)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(grads), "optimizer_state": local_bytes(state),
            "buckets": local_bytes(buckets), "distinct": distinct_bytes(params + grads + state + buckets)}


def measure_ddp(args, device: torch.device, gradient_as_bucket_view: bool) -> dict:
    torch.manual_seed(0)
    model = build_model(args.width, args.depth).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=gradient_as_bucket_view)  # True: the gradients are views into the buckets
    buckets = []

    def see_bucket(state, bucket):  # DDP's default all-reduce, after noting the bucket's flat buffer
        buckets.append(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, see_bucket)
    seen = measure(ddp, args.width, device, buckets)
    del ddp, model
    gc.collect()  # free the DDP wrapper while the group exists (01)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    record = {"rank": rank, "world_size": world_size, "ddp": measure_ddp(args, device, False),
              "ddp_bucket_view": measure_ddp(args, device, True)}
    torch.manual_seed(0)
    sharded = build_model(args.width, args.depth).to(device)
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # each layer's parameters split across the ranks, gathered just in time
    fully_shard(sharded)
    record["fsdp2"] = measure(sharded, args.width, device, [])
    record["full_param_bytes"] = sum(p.numel() * p.element_size() for p in sharded.parameters())
    state = sharded.state_dict()  # what a rank-0 torch.save would write
    record["fsdp2_state_dict"] = {"dtensors": all(isinstance(v, DTensor) for v in state.values()),
                                  "bytes": local_bytes(state.values())}
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
