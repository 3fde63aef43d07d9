"""04_seed_snippet.py: seed snippet 4 exactly as the post wrote it, with a tiny model around it."""
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        return self.net(x)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # ---- seed snippet 4, verbatim ----
    torch.cuda.set_device(local_rank)
    device = torch.device('cuda:' + f'{local_rank}')
    D = Model()
    D = torch.nn.SyncBatchNorm.convert_sync_batchnorm(D).to(device)
    D = torch.nn.parallel.DistributedDataParallel(D, find_unused_parameters=True,
                                                  device_ids=[local_rank], output_device=local_rank)
    # ---- end of snippet ----
    print(json.dumps({"rank": dist.get_rank(), "wrapped": type(D).__name__, "device": str(device)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
