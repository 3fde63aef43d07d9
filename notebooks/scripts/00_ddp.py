"""00_ddp.py: the same loop on every GPU (or CPU process) torchrun starts: the template to copy."""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default="runs/00/checkpoint.pt")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])  # the GPU on this node. A KeyError here? Start me with torchrun
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join_process_group(backend)  # reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun

    torch.manual_seed(0)
    features = torch.randn(1024, 20)
    dataset = TensorDataset(features, (features.sum(1) > 0).long())  # a toy task: is the sum positive?
    sampler = DistributedSampler(dataset)  # each rank draws its own 1/world_size of the data
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)  # 32 per rank: the global batch grows

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start_epoch = 0
    os.makedirs(os.path.dirname(args.checkpoint), exist_ok=True)
    if os.path.exists(args.checkpoint):  # resume: every rank loads the file onto its own device
        checkpoint = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    drawn = {}  # epoch -> the first samples this rank drew, for the report below
    for epoch in range(start_epoch, args.num_epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        drawn[epoch] = list(sampler)[:3]
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(ddp_model(inputs.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients of all ranks here
            optimizer.step()
        if dist.get_rank() == 0:  # one rank logs and saves; plain keys, from the model inside the wrapper
            print(f"epoch {epoch} loss {loss.item():.3f}")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)  # atomic: a crash never leaves half a file
        dist.barrier()  # no rank goes on before the checkpoint is complete
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(json.dumps({"rank": dist.get_rank(), "start_epoch": start_epoch, "drawn": drawn, "checksum": checksum}))
    del ddp_model  # free the wrapper while its group exists: freed after it, gloo can abort or hang at exit (01)
    gc.collect()  # del is not enough: the wrapper sits in a reference cycle
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
