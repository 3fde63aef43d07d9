"""08_memory.py: bytes of parameters, gradients and optimizer state per rank, DDP against FSDP2 (fully_shard)."""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model(width: int, depth: int) -> nn.Sequential:
    layers = [nn.Linear(width, width) for _ in range(depth)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())])


def local_bytes(tensors) -> int:
    """Bytes this rank holds: an FSDP2 parameter is a DTensor, of which each rank stores only its shard."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def measure(model: nn.Module, width: int, device: torch.device) -> dict:
    """One AdamW step, then what this rank holds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device)).square().mean().backward()
    optimizer.step()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer_state": local_bytes(state)}


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
    torch.manual_seed(0)
    ddp = DDP(build_model(args.width, args.depth).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    record = {"rank": rank, "world_size": world_size, "ddp": measure(ddp, args.width, device)}
    del ddp
    gc.collect()  # free the DDP wrapper while the group exists (01)
    torch.manual_seed(0)
    sharded = build_model(args.width, args.depth).to(device)
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # each layer's parameters split across the ranks, gathered just in time
    fully_shard(sharded)
    record["fsdp2"] = measure(sharded, args.width, device)
    record["full_param_bytes"] = sum(p.numel() * p.element_size() for p in sharded.parameters())
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
