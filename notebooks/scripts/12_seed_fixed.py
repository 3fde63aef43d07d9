"""12_seed_fixed.py: the blog post's training script with each of the check's findings fixed (notebook 12 §3).

Made to run as 12_seed_post.py is (`# RUN:`); each fix is marked `# FIX:` with the finding's id.
"""
import argparse
import gc  # FIX: no-destroy
import os  # RUN: for the two lines below that read the environment and make a path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset  # RUN: TensorDataset, not torchvision's ImageFolder
from torch.utils.data.distributed import DistributedSampler


def Model() -> nn.Module:  # RUN: the post never shows its model; a tiny one, with a BatchNorm for SyncBatchNorm
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


parser = argparse.ArgumentParser()
parser.add_argument('--epochs', type=int)
parser.add_argument('--batchsize', type=int)
args = parser.parse_args()
local_rank, batch_size = int(os.environ['LOCAL_RANK']), args.batchsize  # FIX: torchrun sets LOCAL_RANK (errata row 2)
backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")  # FIX: cuda-hardcoded
device = torch.device('cuda:' + f'{local_rank}') if backend == "nccl" else torch.device('cpu')
if device.type == 'cuda':
    torch.cuda.set_device(device)
torch.distributed.init_process_group(backend=backend)  # FIX: init-rank-mismatch (env:// reads RANK, WORLD_SIZE)

torch.manual_seed(0)  # RUN: the same 128 random samples on every rank, in place of the images in dataPath
features = torch.randn(128, 8)
dataset = TensorDataset(features, (features.sum(1) > 0).long())               # snippet 3
data_sampler = DistributedSampler(dataset)  # FIX: same-data-on-ranks (the sampler asks the group)
dataloader = DataLoader(dataset, batch_size=batch_size, num_workers=1,
                        drop_last=True, pin_memory=backend == "nccl", sampler=data_sampler)  # FIX: pinning needs CUDA

D = Model()
if device.type == 'cuda':
    D = torch.nn.SyncBatchNorm.convert_sync_batchnorm(D)
D = torch.nn.parallel.DistributedDataParallel(D.to(device),  # FIX: unused-parameters (none is unused)
                                              device_ids=[local_rank] if device.type == 'cuda' else None)

dist.barrier()                                                                # snippet 6
D.load_state_dict(torch.load('D.pth', map_location=device))  # FIX: load-without-map-location
dist.barrier()

optimizer = torch.optim.SGD(D.parameters(), lr=0.1)  # RUN: the post writes `...  # train`; the plainest loop
for epoch in range(args.epochs):
    data_sampler.set_epoch(epoch)                                             # snippet 5
    for inputs, labels in dataloader:
        loss = nn.functional.cross_entropy(D(inputs.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

del D  # FIX: no-destroy (the wrapper freed first, then the group: 01)
gc.collect()
dist.destroy_process_group()
