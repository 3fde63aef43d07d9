"""05_launch.py: what torchrun gives each worker, and init_process_group with each init method."""
import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                      "OMP_NUM_THREADS")
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID")  # under srun


def report(record: dict) -> None:
    """One JSON record, one line, one write: under torchrun print() writes a line and its newline apart (05 §7)."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def tcp_connections() -> set[tuple[int, int]] | None:
    """(local port, remote port) of each TCP connection this process holds open; Linux's /proc only, else None."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets.add(os.readlink(f"/proc/self/fd/{fd}"))  # "socket:[INODE]" for a socket
        except OSError:  # the descriptor that listed the folder, closed by now
            pass
    connections = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                for row in f.readlines()[1:]:
                    local, remote, state, inode = (row.split()[i] for i in (1, 2, 3, 9))
                    if state == "01" and f"socket:[{inode}]" in sockets:  # 01: ESTABLISHED
                        connections.add((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)))
    return connections


@contextlib.contextmanager
def own_store(url: str):
    """Let rank 0 host the store a tcp:// URL names, under torchrun too, on every torch version.

    torchrun tells its workers TORCHELASTIC_USE_AGENT_STORE=True: its agent serves a store at MASTER_ADDR:MASTER_PORT.
    Before torch 2.14, init_process_group took that for any tcp:// address, so every rank became a client of a store
    that nobody served, and all of them waited in init_process_group (a hang). Since 2.14 it takes it for that one
    address only; outside it, this hides the variable for the call, which is what 2.14 does."""
    parsed = urlparse(url)
    agents = (parsed.hostname, str(parsed.port)) == (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    hidden = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) if parsed.scheme == "tcp" and not agents else None
    try:
        yield
    finally:
        if hidden is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = hidden


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-method", action="append",
                        help="env:// (default), tcp://HOST:PORT or file:///ABSOLUTE/PATH; repeat to try each in turn")
    parser.add_argument("--batch-size", type=int, default=10, help="per process, like the post's --batchsize")
    parser.add_argument("--rank-from", choices=["RANK", "LOCAL_RANK"], default="RANK",
                        help="LOCAL_RANK reproduces the post's rank=local_rank (wrong on several nodes)")
    parser.add_argument("--world_size", type=int, default=None,
                        help="the post's flag: leave it out, torchrun's WORLD_SIZE is the truth")
    parser.add_argument("--stagger", type=float, default=0.0, help="rank r starts r * STAGGER seconds late")
    parser.add_argument("--crash", action="store_true", help="die without cleaning up after the first step")
    parser.add_argument("--pg-timeout", type=float, default=None,
                        help="seconds init_process_group may wait for the others (default: the backend's, 30 min on gloo)")
    args = parser.parse_args()

    env = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    if env["TORCHELASTIC_ERROR_FILE"]:  # in the launch's log folder, new every launch: keep the file's name
        env["TORCHELASTIC_ERROR_FILE"] = os.path.basename(env["TORCHELASTIC_ERROR_FILE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # which device on this machine
    rank = int(os.environ[args.rank_from])  # who I am in the job: RANK, not LOCAL_RANK
    world_size = args.world_size or int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.pg_timeout) if args.pg_timeout else None  # None: the backend's default
    time.sleep(args.stagger * int(os.environ["RANK"]))

    for url in args.init_method or ["env://"]:
        held_before = tcp_connections()
        # With env:// (the default) rank and world_size may be left out: torchrun's RANK and WORLD_SIZE are used.
        with own_store(url):
            dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size, timeout=timeout)
        store_file = urlparse(url).path if url.startswith("file://") else None
        record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "init_method": url,
                  "store_file": store_file, "store_file_exists": bool(store_file and os.path.exists(store_file))}
        value = torch.tensor([float(dist.get_rank() + 1)], device=device)
        dist.all_reduce(value)  # 1 + 2 = 3 on two ranks
        # The TCP connections init_process_group opened, listed before the next all_reduce, which no rank can leave
        # (and close its ends) before every rank has listed its own.
        opened = None if held_before is None else sorted(tcp_connections() - held_before)
        batch = torch.tensor([args.batch_size], device=device)
        dist.all_reduce(batch)  # the global batch: the sum of every process's batch
        record.update(sum=value.item(), batch_size=args.batch_size, global_batch=int(batch.item()), env=env,
                      tcp_opened=opened, slurm={name: os.environ.get(name) for name in SLURM_VARIABLES})
        report(record)
        if args.crash:
            os._exit(1)  # like a killed job: no destroy_process_group, nothing cleaned up
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
