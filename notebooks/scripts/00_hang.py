"""00_hang.py: rank 1 skips a collective, so rank 0 waits for it forever."""
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")  # CPU tensors only here, so gloo on every machine
    rank = dist.get_rank()
    print(json.dumps({"rank": rank, "event": "ready"}))
    if rank == 1:
        time.sleep(3600)  # "busy" elsewhere: never joins the all_reduce below
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
