"""07_tools.py: torch.distributed's own debugging tools, each on a job where rank 1 is late on purpose."""
import argparse
import datetime
import faulthandler
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(pg_timeout: float | None) -> tuple[int, torch.device]:
    """Join the group; a short ``pg_timeout`` turns a silent hang into an error after that many seconds."""
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=pg_timeout) if pg_timeout else None  # None: the backend's default
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), device


def save_huge_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # stands in for a slow disk: rank 1 is late for the next collective


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["late-rank", "monitored-barrier", "ddp-step"], default="ddp-step")
    parser.add_argument("--late", type=float, default=60.0, help="seconds the late rank(s) spend 'saving'")
    parser.add_argument("--pg-timeout", type=float, default=None, help="init_process_group(timeout=...)")
    parser.add_argument("--watchdog", type=float, default=None,
                        help="faulthandler dumps every thread's stack and exits after this many seconds")
    parser.add_argument("--watchdog-rank", type=int, default=None,
                        help="arm the --watchdog on this rank only (default: on every rank)")
    parser.add_argument("--wait-all-ranks", action="store_true",
                        help="monitored_barrier names every missing rank, not only the first")
    args = parser.parse_args()
    rank, device = setup(args.pg_timeout)
    nccl_error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")  # what NCCL does on a timeout (07, 2a)
    print(json.dumps({"rank": rank, "event": "ready", "backend": dist.get_backend(),
                      "nccl_error_handling": nccl_error_handling}), flush=True)
    watchdog = args.watchdog if args.watchdog_rank in (None, rank) else None  # --watchdog-rank R: rank R only
    if watchdog:
        faulthandler.dump_traceback_later(watchdog, exit=True)  # in a loop: re-arm it every step
    if args.case == "late-rank":
        if rank == 1:
            save_huge_checkpoint(args.late)
        grad = torch.ones(4, device=device)
        dist.all_reduce(grad)
    elif args.case == "monitored-barrier":
        # monitored_barrier is implemented by gloo only; a gloo side group makes it usable in NCCL jobs too.
        gloo = dist.new_group(backend="gloo")
        if rank > 0:  # every rank but rank 0, the monitor
            save_huge_checkpoint(args.late)
        dist.monitored_barrier(group=gloo, timeout=datetime.timedelta(seconds=2), wait_all_ranks=args.wait_all_ranks)
    else:
        model = DDP(torch.nn.Linear(4, 2).to(device), device_ids=[device.index] if device.type == "cuda" else None)
        model(torch.randn(8, 4, device=device)).sum().backward()
        del model
        gc.collect()  # free the DDP wrapper while its group exists (collected later, gloo can abort: see 01)
    if watchdog:
        faulthandler.cancel_dump_traceback_later()
    print(json.dumps({"rank": rank, "event": "done"}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
