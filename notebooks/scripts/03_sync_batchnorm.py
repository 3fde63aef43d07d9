"""03_sync_batchnorm.py: per-rank vs global batch statistics, and what SyncBatchNorm computes, checked."""
import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
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


# ---------------------------------------------------------------------------------------------
# REFERENCE ONLY, not for training. nn.SyncBatchNorm refuses CPU tensors whenever it would synchronise
# (training mode, process group initialised), so on a CPU machine this small re-implementation (all_reduce
# of sum, sum of squares and count) is how we can see what it computes. On CUDA the script uses the real
# nn.SyncBatchNorm and runs the very same checks.
# ---------------------------------------------------------------------------------------------
class SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        dims = [0] + list(range(2, x.dim()))  # every axis except the channel axis
        channels = x.shape[1]
        count = torch.full((1,), x.numel() // channels, dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        dist.all_reduce(stats)  # one collective: global sum, global sum of squares, global count
        total = stats[-1]
        mean = stats[:channels] / total
        var = stats[channels:2 * channels] / total - mean * mean  # biased: used to normalise
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.dims, ctx.shape, ctx.total = dims, shape, total
        unbiased_var = var * total / (total - 1)  # what running_var tracks
        ctx.mark_non_differentiable(mean, unbiased_var)
        return xhat * weight.view(shape) + bias.view(shape), mean, unbiased_var

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        xhat, weight, invstd = ctx.saved_tensors
        sum_g = grad_out.sum(ctx.dims)
        sum_g_xhat = (grad_out * xhat).sum(ctx.dims)
        grad_weight, grad_bias = sum_g_xhat.clone(), sum_g.clone()  # local: DDP averages these later
        both = torch.cat([sum_g, sum_g_xhat])
        dist.all_reduce(both)  # the input gradient needs the global sums too
        channels = weight.shape[0]
        mean_g = (both[:channels] / ctx.total).view(ctx.shape)
        mean_g_xhat = (both[channels:] / ctx.total).view(ctx.shape)
        grad_x = (weight * invstd).view(ctx.shape) * (grad_out - mean_g - xhat * mean_g_xhat)
        return grad_x, grad_weight, grad_bias, None


class ReferenceSyncBatchNorm(nn.BatchNorm2d):
    """REFERENCE ONLY: BatchNorm2d whose training statistics come from every rank (SyncBNFunction)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)  # eval: running statistics, no communication
        y, mean, unbiased_var = SyncBNFunction.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)  # (1 - momentum) * old + momentum * new
            self.running_var.lerp_(unbiased_var, self.momentum)
        return y


def make_bn(kind: str, channels: int, device: torch.device) -> nn.Module:
    if kind == "torch":
        return nn.SyncBatchNorm(channels).to(device)  # the real one (CUDA only)
    if kind == "reference":
        return ReferenceSyncBatchNorm(channels).to(device)
    return nn.BatchNorm2d(channels).to(device)  # "local": plain BatchNorm, this rank's batch only


def global_batch(step: int, size: int, channels: int, device: torch.device) -> torch.Tensor:
    """The same global batch on every rank (seeded by step). Images differ in brightness per channel,
    so a small batch's mean is a noisy estimate of the data's mean."""
    g = torch.Generator().manual_seed(2000 + step)
    per_image = 1.0 + torch.randn(size, channels, 1, 1, generator=g)
    return (per_image + 0.5 * torch.randn(size, channels, 8, 8, generator=g)).to(device)


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank:(rank + 1) * per_rank]


def gather(t: torch.Tensor) -> list[list[float]]:
    """Every rank's tensor, in rank order, on every rank."""
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return [o.flatten().tolist() for o in out]


def case_stats(rank, world_size, device, args) -> dict:
    """This rank's batch mean/variance per channel, and the global ones over all ranks' batches."""
    x = my_slice(global_batch(0, world_size * args.batch, args.channels, device), rank, world_size)
    dims = [0, 2, 3]
    sums = torch.cat([x.sum(dims), (x * x).sum(dims), torch.tensor([x.numel() / x.shape[1]], device=device)])
    dist.all_reduce(sums)
    c = args.channels
    global_mean = sums[:c] / sums[-1]
    global_var = sums[c:2 * c] / sums[-1] - global_mean ** 2
    return {"batch": args.batch, "rank_mean": gather(x.mean(dims)), "rank_var": gather(x.var(dims, unbiased=False)),
            "global_mean": global_mean.tolist(), "global_var": global_var.tolist()}


def _finite(t: torch.Tensor) -> float:
    """A difference as a float, with NaN as infinity: max() would silently skip a NaN."""
    value = t.item()
    return float("inf") if value != value else value


def case_reference(rank, world_size, device, args) -> dict:
    """Sync BN on world_size ranks x batch B against plain BatchNorm on the concatenated batch."""
    torch.manual_seed(0)  # same affine parameters on every rank and in the single-process model
    sync_bn = make_bn(args.impl, args.channels, device)
    with torch.no_grad():
        sync_bn.weight.uniform_(0.5, 1.5)
        sync_bn.bias.uniform_(-0.5, 0.5)
    full_bn = nn.BatchNorm2d(args.channels).to(device)
    full_bn.load_state_dict(sync_bn.state_dict())
    worst = {"output": 0.0, "input_grad": 0.0, "weight_grad": 0.0, "bias_grad": 0.0}
    for step in range(args.steps):
        big = global_batch(step, world_size * args.batch, args.channels, device)
        g = torch.Generator().manual_seed(3000 + step)
        upstream = torch.randn(big.shape, generator=g).to(device)  # loss = sum(y * upstream)
        x = my_slice(big, rank, world_size).clone().requires_grad_(True)
        sync_bn.zero_grad()
        y = sync_bn(x)
        (y * my_slice(upstream, rank, world_size)).sum().backward()
        x_full = big.clone().requires_grad_(True)
        full_bn.zero_grad()
        y_full = full_bn(x_full)
        (y_full * upstream).sum().backward()
        summed = torch.cat([sync_bn.weight.grad, sync_bn.bias.grad])
        dist.all_reduce(summed)  # per-rank parameter grads add up to the big batch's
        c = args.channels
        diffs = {"output": (y - my_slice(y_full, rank, world_size)).abs().max(),
                 "input_grad": (x.grad - my_slice(x_full.grad, rank, world_size)).abs().max(),
                 "weight_grad": (summed[:c] - full_bn.weight.grad).abs().max(),
                 "bias_grad": (summed[c:] - full_bn.bias.grad).abs().max()}
        worst = {k: max(worst[k], _finite(v)) for k, v in diffs.items()}
    worst["running_mean"] = _finite((sync_bn.running_mean - full_bn.running_mean).abs().max())
    worst["running_var"] = _finite((sync_bn.running_var - full_bn.running_var).abs().max())
    return {"impl": args.impl, "batch": args.batch, "steps": args.steps, "max_abs_diff": worst,
            "num_batches_tracked": int(sync_bn.num_batches_tracked)}


def case_drift(rank, world_size, device, args) -> dict:
    """Running statistics after many small steps: plain BatchNorm per rank vs synchronised BN."""
    record = {}
    for kind in ("local", args.impl):
        for batch in (args.batch, args.big_batch):
            bn = make_bn(kind, args.channels, device)
            trace = []
            for step in range(args.drift_steps):
                bn(my_slice(global_batch(step, world_size * batch, args.channels, device), rank, world_size))
                trace.append(bn.running_mean[0].item())
            record[f"{'local' if kind == 'local' else 'sync'}_b{batch}"] = {
                "running_mean": gather(bn.running_mean), "running_var": gather(bn.running_var),
                "trace_channel0": gather(torch.tensor(trace, device=device))}
    # Plain BatchNorm inside DDP: DDP sends rank 0's buffers to every rank at construction and, with
    # forward_sync_buffers=True (the default), before each forward, here every one (not after a no_grad or
    # no_sync forward: notebook 04). Running statistics depend on the inputs only, not on the weights.
    bn = make_bn("local", args.channels, device)
    ddp = DDP(bn, device_ids=[device.index]) if device.type == "cuda" else DDP(bn)
    for step in range(args.drift_steps):
        x = my_slice(global_batch(step, world_size * args.batch, args.channels, device), rank, world_size)
        ddp(x).square().mean().backward()
    record[f"ddp_local_b{args.batch}"] = {"running_mean": gather(bn.running_mean)}
    return {"impl": args.impl, "small_batch": args.batch, "big_batch": args.big_batch,
            "drift_steps": args.drift_steps, **record}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="stats,reference,drift")
    parser.add_argument("--impl", choices=["auto", "torch", "reference"], default="auto",
                        help="auto: the real nn.SyncBatchNorm on CUDA, the labelled reference on CPU")
    parser.add_argument("--device", choices=["auto", "cuda"], default="auto",
                        help="auto: the backend's device; cuda with DDP_BACKEND=gloo puts several ranks on "
                             "one GPU (gloo moves CUDA tensors too), to test the real SyncBN on a 1-GPU machine")
    parser.add_argument("--batch", type=int, default=2, help="images per rank (B)")
    parser.add_argument("--big-batch", type=int, default=32)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--drift-steps", type=int, default=40)
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup()
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    if args.impl == "auto":
        args.impl = "torch" if device.type == "cuda" else "reference"
    cases = {"stats": case_stats, "reference": case_reference, "drift": case_drift}
    for name in args.cases.split(","):
        record = cases[name](rank, world_size, device, args)
        print(json.dumps({"rank": rank, "case": name, "world_size": world_size, "device": str(device),
                          "backend": dist.get_backend(), **record}), flush=True)
    gc.collect()  # free the cases' DDP wrappers while their group exists (freed after it, gloo can abort: see 01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
