"""11_ddp.py: DDP's own errors and warnings, and its silent pitfalls, one --case each, reported as records."""
import argparse
import gc
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


def report(rank: int, case: str, **fields: object) -> None:
    print(json.dumps({"rank": rank, "case": case, **fields}), flush=True)


def wrap(model: nn.Module, device: torch.device, **ddp_args: object) -> DDP:
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_args)


def gathered(value: float, device: torch.device) -> list[float]:
    """``value`` from every rank, in rank order."""
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64, device=device))
    return [t.item() for t in out]


def checksums(model: nn.Module, device: torch.device) -> dict[str, list[float]]:
    """Each parameter's sum, from every rank: equal lists mean equal replicas."""
    return {name: gathered(p.detach().double().sum().item(), device) for name, p in model.named_parameters()}


def batch(rank: int, step: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """This rank's own batch of the step (another on every rank), the same in every run."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)


# ---- --case same-model: replicas built differently on different ranks -------------------------------------------
def case_same_model(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    if rank == 0:  # BUG: an adapter added on one rank only (a rank-dependent branch in the model's code)
        model.append(nn.Linear(2, 2))
    try:
        wrap(model, device)
    except RuntimeError as err:
        report(rank, "same-model", variant="an adapter on rank 0 only", error=str(err))
    words = [f"word{i}" for i in range(10 + rank)]  # each rank counted its own shard's words (--case same-model-sizes)
    shared = [words]
    dist.broadcast_object_list(shared, src=0)  # the fix: one rank decides, every rank builds from its answer
    torch.manual_seed(0)
    ddp = wrap(nn.Embedding(len(shared[0]), 4), device)
    report(rank, "same-model", variant="vocabulary from rank 0", vocabulary=len(shared[0]),
           checksums=checksums(ddp.module, device))


def case_same_model_sizes(rank: int, world_size: int, device: torch.device) -> None:
    vocabulary = 10 + rank  # BUG: each rank counted its own shard's words
    wrap(nn.Embedding(vocabulary, 4), device)  # the same number of parameters, of other sizes


# ---- --case frozen: a module with nothing to train ------------------------------------------------------------
def case_frozen(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    teacher = nn.Linear(8, 4).requires_grad_(False).to(device)  # a frozen teacher, perceptual loss, EMA copy
    try:
        wrap(teacher, device)  # BUG: nothing in it gets a gradient, so DDP has nothing to average
    except RuntimeError as err:
        report(rank, "frozen", variant="DDP(teacher)", error=str(err))
    student = wrap(nn.Linear(8, 4), device)  # the fix: wrap what trains; the teacher stays a plain module
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    for step in range(3):
        x = batch(rank, step, (16, 8), device)
        loss = F.mse_loss(student(x), teacher(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    report(rank, "frozen", variant="only the student wrapped", teacher=checksums(teacher, device),
           student=checksums(student.module, device))


# ---- --case unused: the find_unused_parameters=True warning, and when it is a false positive ------------------
class Branchy(nn.Module):
    """A trunk and a head; an extra head that forward uses only on some steps (flow control)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.head, self.extra = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def case_unused(rank: int, world_size: int, device: torch.device) -> None:
    schedule = [True, True, False, False]  # the extra head in steps 0 and 1 only
    for flag in (True, False):
        torch.manual_seed(0)
        ddp = wrap(Branchy(), device, find_unused_parameters=flag)
        done = []
        try:
            for step, use_extra in enumerate(schedule):
                ddp(batch(rank, step, (8, 4), device), use_extra).pow(2).mean().backward()
                done.append(step)
        except RuntimeError as err:
            report(rank, "unused", find_unused_parameters=flag, steps_done=done, error=str(err))
            continue
        report(rank, "unused", find_unused_parameters=flag, steps_done=done, trunk_grad=gathered(
            ddp.module.trunk.weight.grad.double().sum().item(), device))


# ---- --case strides: a parameter's layout changed after the wrap -----------------------------------------------
def conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))


def case_strides(rank: int, world_size: int, device: torch.device) -> None:
    torch.set_warn_always(True)  # each variant's warning: torch gives some warnings once per process by default
    for variant in ("channels_last after DDP", "a transposed weight after DDP", "channels_last before DDP"):
        model, shape = (nn.Linear(4, 8), (2, 4)) if "transposed" in variant else (conv(), (2, 3, 8, 8))
        if variant == "channels_last before DDP":  # the fix: the layout first, then the wrap
            model = model.to(memory_format=torch.channels_last)
        ddp = wrap(model, device)
        if variant == "channels_last after DDP":  # BUG: the bucket views were laid out at the wrap
            ddp.to(memory_format=torch.channels_last)
        if variant == "a transposed weight after DDP":  # BUG: swapped for a transposed copy of itself
            model.weight.data = model.weight.data.t().contiguous().t()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp(batch(rank, 0, shape, device)).sum().backward()
        said = [str(w.message) for w in caught if "strides" in str(w.message)]
        report(rank, "strides", variant=variant, warnings=said, grad=gathered(
            sum(p.grad.double().sum().item() for p in model.parameters()), device))


# ---- --case unfreeze: layers made trainable after the wrap --------------------------------------------------
def case_unfreeze(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(device)
    model[0].requires_grad_(False)  # fine-tuning: the backbone frozen at first
    ddp = wrap(model, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # every parameter: unfrozen ones are updated too

    def train(steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            ddp(batch(rank, step, (8, 4), device)).pow(2).mean().backward()
            optimizer.step()

    train(range(2))
    report(rank, "unfreeze", when="frozen, 2 steps", checksums=checksums(model, device))
    model[0].requires_grad_(True)  # BUG: unfrozen after the wrap; DDP's reducer never learns of it
    train(range(2, 4))
    report(rank, "unfreeze", when="unfrozen after the wrap, 2 steps", checksums=checksums(model, device))
    del ddp
    gc.collect()  # the old wrapper's hooks go with it
    ddp = wrap(model, device)  # the fix: wrap again (it broadcasts rank 0's parameters), then train
    report(rank, "unfreeze", when="wrapped again", checksums=checksums(model, device))
    train(range(4, 6))
    report(rank, "unfreeze", when="wrapped again, 2 steps", checksums=checksums(model, device))


# ---- --case attribute: the model's own methods and attributes, behind the wrapper -----------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.num_classes = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def case_attribute(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    ddp = wrap(Encoder(), device)
    x = batch(rank, 0, (8, 4), device)
    try:
        ddp.embed(x)  # BUG: a method of the model, asked of the wrapper
    except AttributeError as err:
        report(rank, "attribute", call="ddp.embed(x)", error=str(err))
    ddp.module.embed(x).pow(2).mean().backward()  # runs, but DDP did not see it: no averaging
    local = gathered(ddp.module.fc.weight.grad.double().sum().item(), device)
    ddp.zero_grad()
    ddp(x).pow(2).mean().backward()  # through the wrapper's forward: averaged
    averaged = gathered(ddp.module.fc.weight.grad.double().sum().item(), device)
    report(rank, "attribute", num_classes=ddp.module.num_classes, grad_via_module=local, grad_via_ddp=averaged)


# ---- --case dataparallel: from nn.DataParallel to DDP --------------------------------------------------------
def case_dataparallel(rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device)
    try:
        DDP(model, device_ids=[0, 1])  # BUG: DataParallel's list of GPUs, kept in the migration
    except ValueError as err:
        report(rank, "dataparallel", call="DDP(model, device_ids=[0, 1])", error=str(err))
    whole = torch.cat([batch(r, 0, (8, 4), torch.device("cpu")) for r in range(world_size)])  # the global batch
    dp = nn.DataParallel(nn.Linear(4, 1))  # one process, the whole batch (split over its GPUs; here the CPU)
    dp.module.load_state_dict(model.state_dict())
    dp(whole).pow(2).mean().backward()
    ddp = wrap(model, device)  # one process per GPU, each its share of the batch
    ddp(whole[rank * 8:(rank + 1) * 8].to(device)).pow(2).mean().backward()
    same = torch.allclose(ddp.module.weight.grad.cpu(), dp.module.weight.grad, atol=1e-6)
    report(rank, "dataparallel", dp_device_ids=dp.device_ids, keys=[next(iter(dp.state_dict())),
           next(iter(ddp.state_dict()))], same_gradient=same)


CASES = {"same-model": case_same_model, "same-model-sizes": case_same_model_sizes, "frozen": case_frozen,
         "unused": case_unused, "strides": case_strides, "unfreeze": case_unfreeze, "attribute": case_attribute,
         "dataparallel": case_dataparallel}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, required=True)
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    CASES[args.case](rank, world_size, device)
    gc.collect()  # the cases' DDP wrappers sit in reference cycles: freed while their group exists (see 09)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
