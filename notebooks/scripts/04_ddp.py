"""04_ddp.py: DistributedDataParallel, proven case by case (one JSON record per case)."""
import argparse
import copy
import gc
import inspect
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

SAFE_CASES = ["equivalence", "uneven_batch", "unused", "accumulation", "buckets", "join", "join_state", "join_throw",
              "eval_module", "buffer_flags"]
HANG_CASES = ["uneven_no_join", "eval_wrapper", "join_all_gather", "join_all_reduce"]  # hang or crash: one at a time


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


def wrap(model: nn.Module, device: torch.device, **kwargs) -> DDP:
    """device_ids=[local_rank] for a module on one GPU; no device_ids at all for a CPU module."""
    if device.type == "cuda":
        return DDP(model, device_ids=[device.index], output_device=device.index, **kwargs)
    return DDP(model, **kwargs)


def mlp(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))


def global_batch(step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (seeded by step); each rank then takes its own slice."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, 8, generator=g).to(device), torch.randn(size, 4, generator=g).to(device)


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank:(rank + 1) * per_rank]


def checksum(model: nn.Module) -> float:
    return sum(p.detach().double().sum().item() for p in model.parameters())


def gather(value: float, device: torch.device) -> list[float]:
    """Every rank's value, in rank order, on every rank."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.item() for t in out]


def grad_checksum(model: nn.Module) -> float:
    return sum(p.grad.double().sum().item() for p in model.parameters())


def max_diff(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(((p.grad - q.grad) if grads else (p - q)).abs().max().item() for p, q in pairs)


def case_equivalence(rank, world_size, device, args) -> dict:
    torch.manual_seed(rank)  # deliberately different initial weights on every rank
    model = mlp().to(device)
    before = gather(checksum(model), device)
    ddp = wrap(model, device)  # the constructor broadcasts rank 0's parameters and buffers
    after = gather(checksum(model), device)
    reference = copy.deepcopy(ddp.module)  # one process that sees the whole 2B batch
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    grad_diff = None
    for step in range(args.steps):
        x, y = global_batch(step, world_size * args.batch, device)
        opt.zero_grad()
        F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()  # mean over 2B = average of the ranks' means over B
        if step == 0:
            grad_diff = max_diff(ddp.module, reference, grads=True)
        opt.step()
        ref_opt.step()
    return {"checksum_before_wrap": before, "checksum_after_wrap": after, "grad_max_diff_step0": grad_diff,
            "checksum_after_steps": gather(checksum(model), device), "steps": args.steps,
            "param_max_diff_vs_single_process": max_diff(ddp.module, reference)}


def case_uneven_batch(rank, world_size, device, args) -> dict:
    """Ranks with batches of different sizes (rank 0: B, rank 1: B - 6): what DDP's average means then."""
    sizes = [args.batch - 6 * r for r in range(world_size)]
    x, y = global_batch(0, sum(sizes), device)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    torch.manual_seed(0)
    reference = mlp().to(device)
    F.mse_loss(reference(x), y).backward()  # one process: the mean over every sample of every rank
    record = {"batch_sizes": sizes}
    for name in ("mean_per_rank", "sum_over_global_count"):
        torch.manual_seed(0)
        ddp = wrap(mlp().to(device), device)
        out = ddp(x[mine])
        if name == "mean_per_rank":
            loss = F.mse_loss(out, y[mine])  # the usual line: a mean over this rank's samples only
        else:  # sum this rank's terms, divide by the global count; DDP's average over ranks then is the global mean
            count = torch.tensor([float(out.numel())], device=device)
            dist.all_reduce(count)
            loss = F.mse_loss(out, y[mine], reduction="sum") * world_size / count
        loss.backward()
        record[name] = max_diff(ddp.module, reference, grads=True)
    return record


class TwoHeads(nn.Module):
    """A trunk and two heads; which head reaches the loss is up to the caller."""

    def __init__(self, hidden: int = 32, depth: int = 1):
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(8 if i == 0 else hidden, hidden), nn.Tanh())
                                     for i in range(depth)])
        self.head_a = nn.Linear(hidden, 4)
        self.head_b = nn.Linear(hidden, 4)

    def forward(self, x, heads: str = "ab"):
        h = self.trunk(x)
        return tuple(self.head_a(h) if name == "a" else self.head_b(h) for name in heads)


def train_heads(ddp: DDP, rank: int, world_size: int, device: torch.device, steps: int, batch: int,
                which=lambda step: "a", heads: str = "ab") -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        x, y = global_batch(step, world_size * batch, device)
        outputs = dict(zip(heads, ddp(my_slice(x, rank, world_size), heads=heads), strict=True))
        out = outputs[which(step)]  # the other head's output, if computed, is left out of the loss
        opt.zero_grad()
        F.mse_loss(out, my_slice(y, rank, world_size)).backward()
        opt.step()


def try_train(make_ddp, *args, **kwargs) -> dict:
    """Train; report success, or the error DDP raised (raised identically on every rank)."""
    torch.manual_seed(0)
    ddp = make_ddp()
    try:
        train_heads(ddp, *args, **kwargs)
    except RuntimeError as err:
        return {"ok": False, "error": str(err)}
    module = ddp.module
    return {"ok": True, "checksum": checksum(module),
            "head_b_grad_is_none": module.head_b.weight.grad is None}


def time_steps(ddp: DDP, rank, world_size, device, steps, batch) -> float:
    train_heads(ddp, rank, world_size, device, 2, batch, heads="a")  # warm-up; every parameter is used
    dist.barrier()
    start = time.perf_counter()
    train_heads(ddp, rank, world_size, device, steps, batch, heads="a")
    dist.barrier()
    return time.perf_counter() - start


def case_unused(rank, world_size, device, args) -> dict:
    run = lambda **kw: try_train(lambda: wrap(TwoHeads().to(device), device, **kw),
                                 rank, world_size, device, 3, args.batch)
    alternate = lambda step: "a" if step % 2 == 0 else "b"  # the unused head changes every step
    run_dynamic = lambda **kw: try_train(lambda: wrap(TwoHeads().to(device), device, **kw),
                                         rank, world_size, device, 4, args.batch, which=alternate)
    run_a_only = lambda **kw: try_train(lambda: wrap(TwoHeads().to(device), device, **kw),
                                        rank, world_size, device, 3, args.batch, heads="a")
    record = {"default": run(), "find_unused": run(find_unused_parameters=True),
              "static_graph": run(static_graph=True),
              "static_graph_head_b_not_called": run_a_only(static_graph=True),
              "default_head_b_not_called": run_a_only(),
              "dynamic_find_unused": run_dynamic(find_unused_parameters=True),
              "dynamic_static_graph": run_dynamic(static_graph=True)}
    # The cost of find_unused_parameters=True on a model whose parameters are all used:
    # a deep trunk makes the extra autograd-graph traversal after every forward visible.
    timings = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = TwoHeads(hidden=16, depth=args.depth).to(device)
        model.head_b = nn.Identity()  # no parameters left unused: the flag is pure overhead here
        ddp = wrap(model, device, find_unused_parameters=flag)
        timings[flag] = time_steps(ddp, rank, world_size, device, args.timing_steps, args.batch)
    record["find_unused_time_ratio"] = timings[True] / timings[False]
    return record


def counting_hook(counter: dict):
    """A DDP communication hook: count the buckets sent, then do exactly what DDP does by default."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        counter["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)  # None: the default process group

    return hook


def logging_hook(events: list, names: dict):
    """A comm hook that logs each bucket it is handed (index, bytes, parameter names), then all-reduces it."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        events.append({"launch": bucket.index(), "bytes": buffer.numel() * buffer.element_size(),
                       "params": [names[p.data_ptr()] for p in bucket.parameters()]})
        return default_hooks.allreduce_hook(None, bucket)

    return hook


def accumulate(ddp: DDP, rank, world_size, device, windows: int, micro: int,
               batch: int, use_no_sync: bool) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)  # lr 0: keep the weights, so grads stay comparable
    for w in range(windows):
        opt.zero_grad()
        for m in range(micro):
            x, y = global_batch(100 * w + m, world_size * batch, device)
            step = lambda: (F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size))
                            / micro).backward()
            if use_no_sync and m < micro - 1:
                with ddp.no_sync():  # forward and backward inside: gradients accumulate locally, no communication
                    step()
            else:
                step()  # a forward outside no_sync(): its backward all-reduces the accumulated gradients
        opt.step()


def split_window(ddp: DDP, rank, world_size, device, micro: int, batch: int, forward_inside: bool) -> None:
    """One window whose last micro-step has its forward and its backward on different sides of no_sync()."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt.zero_grad()
    for m in range(micro):
        x, y = global_batch(m, world_size * batch, device)
        loss = lambda: F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)) / micro
        if m < micro - 1:
            with ddp.no_sync():
                loss().backward()
        elif forward_inside:
            with ddp.no_sync():
                last = loss()  # the forward runs inside no_sync(): DDP does not prepare its reducer ...
            last.backward()  # ... so this backward, outside, all-reduces nothing
        else:
            last = loss()  # the forward runs outside: DDP prepares its reducer ...
            with ddp.no_sync():
                last.backward()  # ... so this backward all-reduces, although it runs inside no_sync()
    opt.step()


def case_accumulation(rank, world_size, device, args) -> dict:
    micro = args.micro
    record = {"micro_steps": micro, "windows": args.windows}
    grads = {}
    for use_no_sync in (True, False):
        torch.manual_seed(0)
        model = mlp(hidden=args.hidden).to(device)
        ddp = wrap(model, device)
        hook = {"calls": 0}
        ddp.register_comm_hook(None, counting_hook(hook))
        accumulate(ddp, rank, world_size, device, 1, 1, args.batch, True)  # warm-up: buckets settle
        hook["calls"] = 0
        dist.barrier()
        start = time.perf_counter()
        accumulate(ddp, rank, world_size, device, args.windows, micro, args.batch, use_no_sync)
        dist.barrier()
        name = "no_sync" if use_no_sync else "sync_every_step"
        record[name] = {"comm_calls": hook["calls"], "seconds": time.perf_counter() - start}
        grads[name] = ddp.module
        # the single-process reference: one big batch of micro * 2B samples, last window only
        if use_no_sync:
            reference = copy.deepcopy(ddp.module)
            reference.zero_grad()
            w = args.windows - 1
            batches = [global_batch(100 * w + m, world_size * args.batch, device) for m in range(micro)]
            xs, ys = zip(*batches, strict=True)  # each batch an (x, y) pair
            F.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
            record["no_sync_grad_max_diff_vs_big_batch"] = max_diff(ddp.module, reference, grads=True)
        record[name]["buckets"] = hook["calls"] // (args.windows * (1 if use_no_sync else micro))
    record["sync_vs_no_sync_grad_max_diff"] = max_diff(grads["no_sync"], grads["sync_every_step"], grads=True)
    for forward_inside in (True, False):
        order = "forward_inside_backward_outside" if forward_inside else "forward_outside_backward_inside"
        torch.manual_seed(0)
        ddp = wrap(mlp(hidden=args.hidden).to(device), device)
        hook = {"calls": 0}
        ddp.register_comm_hook(None, counting_hook(hook))
        split_window(ddp, rank, world_size, device, micro, args.batch, forward_inside)
        record[order] = {"comm_calls": hook["calls"], "grad_checksums": gather(grad_checksum(ddp.module), device),
                         "checksums_after_step": gather(checksum(ddp.module), device)}
    record["time_ratio_sync_every_step_vs_no_sync"] = (record["sync_every_step"]["seconds"]
                                                       / record["no_sync"]["seconds"])
    return record


def case_buckets(rank, world_size, device, args) -> dict:
    record = {}
    for cap_mb in (25.0, 0.001):
        torch.manual_seed(0)
        ddp = wrap(mlp(hidden=args.hidden).to(device), device, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
        hook = {"calls": 0}
        ddp.register_comm_hook(None, counting_hook(hook))
        for _ in range(2):  # buckets are rebuilt after the first iteration; count the second
            hook["calls"] = 0
            x, y = global_batch(0, world_size * args.batch, device)
            ddp.zero_grad(set_to_none=False)
            F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in ddp.parameters()}
        record[f"cap_{cap_mb:g}mb"] = {"buckets": hook["calls"], "grad_storages": len(storages),
                                       "params": len(list(ddp.parameters()))}
    # The first bucket is smaller (dist._DEFAULT_FIRST_BUCKET_BYTES) only while bucket_cap_mb is left unset.
    for name, kwargs in (("cap_unset", {}), ("cap_25mb_explicit", {"bucket_cap_mb": 25})):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).to(device)  # 2 MiB of float32 gradients
        ddp = wrap(model, device, **kwargs)
        events = []
        ddp.register_comm_hook(None, logging_hook(events, {p.data_ptr(): n for n, p in model.named_parameters()}))
        record[name] = {}
        for iteration in ("first_iteration", "rebuilt"):  # DDP rebuilds its buckets after the first iteration
            events.clear()
            ddp(torch.randn(2, 256, device=device)).sum().backward()
            record[name][iteration] = [e["bytes"] for e in events]
    record["first_bucket_cap_bytes"] = dist._DEFAULT_FIRST_BUCKET_BYTES
    record["layer_bytes"] = sum(p.numel() * p.element_size() for p in model[0].parameters())
    # Launch order: layers used in the reverse of the order they are defined, one parameter per bucket.
    # find_unused_parameters=True keeps the first bucket order for good (the reducer rebuilds buckets only without it).
    torch.manual_seed(0)
    model = Reversed().to(device)
    events = []
    for n, p in model.named_parameters():
        p.register_hook(lambda grad, n=n: events.append({"grad": n}))  # runs as autograd computes p's gradient
    ddp = wrap(model, device, bucket_cap_mb=1e-6, find_unused_parameters=True)
    ddp.register_comm_hook(None, logging_hook(events, {p.data_ptr(): n for n, p in model.named_parameters()}))
    ddp(torch.randn(2, 8, device=device)).sum().backward()
    record["launch_order"] = events
    # gradient_as_bucket_view=True: does autograd write into the bucket view, or hand over a new tensor to copy in?
    for set_to_none in (False, True):
        torch.manual_seed(0)
        model = mlp(hidden=args.hidden).to(device)
        ddp = wrap(model, device, gradient_as_bucket_view=True)
        handed = []  # the storage of each gradient as autograd leaves it, before DDP's own hook sees it
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: handed.append(p.grad.untyped_storage().data_ptr()))
        for _ in range(3):  # the buckets are rebuilt in the second iteration: look at the third
            handed.clear()
            ddp.zero_grad(set_to_none=set_to_none)
            x, y = global_batch(0, world_size * args.batch, device)
            F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
        buckets = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        record[f"view_set_to_none={set_to_none}"] = {
            "autograd_wrote_into_bucket": all(s in buckets for s in handed) and len(handed) > 0,
            "grad_storages_after_backward": len(buckets)}
    return record


class Reversed(nn.Module):
    """Two layers used in the reverse of the order they are defined: b runs first, a last."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.tanh(self.b(x)))


def case_join(rank, world_size, device, args, use_join: bool = True) -> dict:
    torch.manual_seed(0)
    ddp = wrap(mlp().to(device), device)
    print(json.dumps({"rank": rank, "event": "wrapped"}), flush=True)  # startup is over
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    n_batches = args.uneven_base - 2 * rank  # rank 0: 6 batches, rank 1: 4 batches
    steps = 0

    def loop():
        nonlocal steps
        for step in range(n_batches):
            x, y = global_batch(step, world_size * args.batch, device)
            opt.zero_grad()
            F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
            opt.step()
            steps += 1

    if use_join:
        with Join([ddp]):  # a rank that runs out of data shadows the others' all-reduces with zeros
            loop()
    else:
        loop()
        print(json.dumps({"rank": rank, "event": "finished my batches", "steps": steps}), flush=True)
    return {"steps": steps, "checksum_after": gather(checksum(ddp.module), device)}


def case_join_collective(rank, world_size, device, args, collective: str, throw: bool = False) -> dict:
    """Join with a collective of our own in every step: the global loss count (section 3), or a logged metric."""
    torch.manual_seed(0)
    ddp = wrap(mlp().to(device), device)
    print(json.dumps({"rank": rank, "event": "wrapped"}), flush=True)  # startup is over
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    n_batches = args.uneven_base - 2 * rank  # rank 0: 6 batches, rank 1: 4 batches
    steps, error = 0, None
    try:
        with Join([ddp], throw_on_early_termination=throw):
            for step in range(n_batches):
                x, y = global_batch(step, world_size * args.batch, device)
                out = ddp(my_slice(x, rank, world_size))
                loss = F.mse_loss(out, my_slice(y, rank, world_size))
                if collective == "all_reduce":  # the number of loss terms on all ranks, as in section 3
                    count = torch.tensor([float(out.numel())], device=device)
                    dist.all_reduce(count)
                    loss = F.mse_loss(out, my_slice(y, rank, world_size), reduction="sum") * world_size / count
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
                if collective == "all_gather":  # every rank's loss, to log
                    losses = [torch.zeros(1, device=device) for _ in range(world_size)]
                    dist.all_gather(losses, loss.detach().reshape(1))
                print(json.dumps({"rank": rank, "event": "step", "step": step}), flush=True)
    except RuntimeError as err:  # throw_on_early_termination=True: every rank raises once one has run out
        error = str(err)
    return {"steps": steps, "error": error, "checksum_after": gather(checksum(ddp.module), device)}


def sync_optimizer_state(opt: torch.optim.Optimizer, src: int, device: torch.device) -> None:
    """Broadcast every tensor of the optimizer's state from rank src (the parameter order is the same everywhere)."""
    for p in (p for group in opt.param_groups for p in group["params"]):
        for value in opt.state[p].values():
            if torch.is_tensor(value):
                on_device = value.to(device)  # NCCL needs device tensors; Adam keeps its step count on the CPU
                dist.broadcast(on_device, src)
                value.copy_(on_device)


def case_join_state(rank, world_size, device, args) -> dict:
    """What Join does to the numbers: the gradient's divisor, the joined rank's optimizer, the final sync."""
    n_batches = args.uneven_base - 2 * rank  # rank 0: 6 batches, rank 1: 4 batches
    record = {}
    for divide in (True, False):
        torch.manual_seed(0)
        ddp = wrap(mlp().to(device), device)
        opt = torch.optim.Adam(ddp.parameters(), lr=0.01)  # a stateful optimizer: a step count, two moments
        scales = []  # per step: DDP's gradient as a multiple of this rank's own gradient
        with Join([ddp], divide_by_initial_world_size=divide):
            for step in range(n_batches):
                x, y = global_batch(step, world_size * args.batch, device)
                alone = copy.deepcopy(ddp.module)  # the same weights, no DDP: this rank's own gradient
                F.mse_loss(alone(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
                opt.zero_grad()
                F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
                pairs = list(zip(ddp.module.parameters(), alone.parameters(), strict=True))
                scales.append(sum((p.grad * q.grad).sum().item() for p, q in pairs)
                              / sum((q.grad * q.grad).sum().item() for _, q in pairs))
                opt.step()
            own = checksum(ddp.module)  # this rank's weights when its data ran out
        name = "divide_by_initial_world_size" if divide else "divide_by_active_ranks"
        record[name] = {"scales": scales}
        if not divide:
            continue
        record["optimizer"] = {"own_checksum_at_end": gather(own, device),
                               "checksum_after_join": gather(checksum(ddp.module), device),
                               **adam_report(ddp, opt, args)}
        # The remedy when batch counts must differ: copy the optimizer state from the last rank to join.
        steps = gather(float(n_batches), device)
        src = max(r for r, s in enumerate(steps) if s == max(steps))  # as DDP picks it: ties go to the larger rank
        sync_optimizer_state(opt, src, device)
        record["resynced"] = {"source": src, **adam_report(ddp, opt, args)}
    return record


def adam_report(ddp: DDP, opt: torch.optim.Optimizer, args) -> dict:
    """Every rank's Adam step count and first moment, and its weights after one more step with one shared gradient."""
    device = ddp.device
    states = [opt.state[p] for p in ddp.module.parameters()]
    report = {"adam_steps": gather(states[0]["step"].item(), device),
              "exp_avg_checksums": gather(sum(s["exp_avg"].double().sum().item() for s in states), device)}
    model = copy.deepcopy(ddp.module)  # a plain copy: the next step without DDP, the same gradient on every rank
    probe = torch.optim.Adam(model.parameters(), lr=0.01)
    probe.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: load_state_dict would share the tensors
    x, y = global_batch(99, dist.get_world_size() * args.batch, device)
    F.mse_loss(model(x), y).backward()  # the whole global batch on every rank: identical gradients
    probe.step()
    return {**report, "checksum_after_next_step": gather(checksum(model), device)}


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def evaluate(model: nn.Module, device: torch.device) -> float:
    model.eval()
    with torch.no_grad():
        x, y = global_batch(999, 64, device)
        loss = F.mse_loss(model(x), y).item()
    model.train()
    return loss


def case_eval(rank, world_size, device, args, through_module: bool = True) -> dict:
    torch.manual_seed(0)
    ddp = wrap(bn_model().to(device), device)  # BatchNorm has buffers, which DDP broadcasts each forward
    print(json.dumps({"rank": rank, "event": "wrapped"}), flush=True)  # startup is over
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        x, y = global_batch(step, world_size * args.batch, device)
        opt.zero_grad()
        F.mse_loss(ddp(my_slice(x, rank, world_size)), my_slice(y, rank, world_size)).backward()
        opt.step()
    loss = None
    if rank == 0:
        loss = evaluate(ddp.module if through_module else ddp, device)
        print(json.dumps({"rank": rank, "event": "evaluated", "loss": loss}), flush=True)
    dist.barrier()  # everyone waits for rank 0's evaluation
    return {"eval_loss": loss, "through_module": through_module}


class WithOffset(nn.Module):
    """A linear layer and a buffer that its forward reads and never changes (unlike BatchNorm's statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.lin(x) + self.offset


def forward_and_read(ddp: DDP, how: str, device: torch.device) -> list[float]:
    """Give each rank its own buffer value (its rank), run one forward, return every rank's buffer after it."""
    ddp.module.offset.fill_(float(dist.get_rank()))
    x = torch.randn(2, 8, device=device)
    if how == "no_grad":
        with torch.no_grad():
            ddp(x)
    elif how == "no_sync":
        with ddp.no_sync():
            ddp(x).sum().backward()
    else:
        ddp(x).sum().backward()
    return gather(ddp.module.offset[0].item(), device)


def join_buffers(rank, device, n_batches: int, **kwargs) -> dict:
    """Buffers under Join: a rank-specific value before every step, another one after the last, and one more
    forward after the block."""
    torch.manual_seed(0)
    ddp = wrap(WithOffset().to(device), device, **kwargs)
    seen = []
    with Join([ddp]):
        for step in range(n_batches):
            ddp.module.offset.fill_(float(10 * (step + 1) + rank))
            ddp(torch.randn(2, 8, device=device)).sum().backward()
            seen.append(ddp.module.offset[0].item())  # what the forward's buffer sync (if any) left here
        ddp.module.offset.fill_(float(100 + rank))  # after the last forward: only Join's final sync can copy it
    after_join = gather(ddp.module.offset[0].item(), device)
    ddp.module.offset.fill_(float(rank))  # the block is over, but Join left the wrapper in join mode: whose buffer now?
    ddp(torch.randn(2, 8, device=device)).sum().backward()
    return {"seen": seen, "after_join": after_join, "forward_after_join": gather(ddp.module.offset[0].item(), device)}


def case_buffer_flags(rank, world_size, device, args) -> dict:
    """Each rank starts with its own BatchNorm buffers: which flags copy rank 0's at construction?"""
    flags = {"default": {}, "broadcast_buffers=False": {"broadcast_buffers": False}}
    new_flag = "forward_sync_buffers" in inspect.signature(DDP).parameters  # torch >= 2.13
    if new_flag:
        flags["forward_sync_buffers=False"] = {"forward_sync_buffers": False}
    record = {}
    for name, kwargs in flags.items():
        model = bn_model().to(device)
        model[1].running_mean.fill_(float(rank))  # rank-specific buffers, as after training on different data
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrap(model, device, **kwargs)
        record[name] = {"buffers": gather(model[1].running_mean[0].item(), device),  # every rank's, after DDP(...)
                        "future_warning": any(issubclass(w.category, FutureWarning) for w in caught)}
    # Which forwards broadcast rank 0's buffers, and what Join does with them, with the flag on and off.
    off = {"forward_sync_buffers" if new_flag else "broadcast_buffers": False}
    sequence = ["train", "no_grad", "train", "no_sync", "train", "train"]
    for name, kwargs in (("on", {}), ("off", off)):
        torch.manual_seed(0)
        ddp = wrap(WithOffset().to(device), device, **kwargs)
        record[f"forwards_{name}"] = [[how, forward_and_read(ddp, how, device)] for how in sequence]
        record[f"join_{name}"] = join_buffers(rank, device, 3 - 2 * rank, **kwargs)  # rank 0: 3 steps, rank 1: 1
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(SAFE_CASES),
                        help=f"comma-separated, from {SAFE_CASES + HANG_CASES}")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step (B)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=4, help="micro-steps per accumulation window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--timing-steps", type=int, default=20)
    parser.add_argument("--uneven-base", type=int, default=6)
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    cases = {"equivalence": case_equivalence, "uneven_batch": case_uneven_batch, "buffer_flags": case_buffer_flags,
             "unused": case_unused, "accumulation": case_accumulation,
             "buckets": case_buckets, "join": case_join, "join_state": case_join_state, "eval_module": case_eval,
             "join_throw": lambda *a: case_join_collective(*a, collective="all_reduce", throw=True),
             "uneven_no_join": lambda *a: case_join(*a, use_join=False),
             "eval_wrapper": lambda *a: case_eval(*a, through_module=False),
             "join_all_gather": lambda *a: case_join_collective(*a, collective="all_gather"),
             "join_all_reduce": lambda *a: case_join_collective(*a, collective="all_reduce")}
    for name in args.cases.split(","):
        record = cases[name](rank, world_size, device, args)
        print(json.dumps({"rank": rank, "case": name, "world_size": world_size, "device": str(device),
                          "backend": dist.get_backend(), **record}), flush=True)
    # The cases left DDP wrappers behind (reference cycles: only the garbage collector frees them). Free them
    # while their process group exists; freed after it, gloo aborted the process in 2 of 15 runs here (01).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
