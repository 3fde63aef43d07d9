"""05_seed_snippet.py: the blog post's launch code as written (snippets 2 and 7). Do not copy it."""
import argparse
import json
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--local_rank', type=int, default=-1)  # "the process number the launcher assigns"
    parser.add_argument('--world_size', type=int, default=2)  # "the number of GPUs"
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--batchsize', type=int, default=10)
    args = parser.parse_args()
    local_rank, world_size = args.local_rank, args.world_size
    print(json.dumps({"rank": int(os.environ["RANK"]), "local_rank_argument": local_rank}), flush=True)
    backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    torch.distributed.init_process_group(backend=backend, init_method='file://shared/sharedfile',
                                         rank=local_rank, world_size=world_size)
    print(json.dumps({"rank": torch.distributed.get_rank(), "event": "joined"}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
