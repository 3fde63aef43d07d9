"""12_seed_post.py: the blog post's training script, assembled from its seven snippets. Do not copy it.

Made to run with as few changes as possible, each marked `# RUN:` (notebook 12 §1 says why).
"""
import argparse
import os  # RUN: for the two lines below that read the environment and make a path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset  # RUN: TensorDataset, not torchvision's ImageFolder
from torch.utils.data.distributed import DistributedSampler


def Model() -> nn.Module:  # RUN: the post never shows its model; a tiny one, with a BatchNorm for SyncBatchNorm
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


parser = argparse.ArgumentParser()
parser.add_argument('--local_rank', type=int, default=int(os.environ['LOCAL_RANK']))  # snippet 2. RUN: the default
parser.add_argument('--world_size', type=int)
parser.add_argument('--epochs', type=int)
parser.add_argument('--batchsize', type=int)
args = parser.parse_args()
local_rank, world_size, batch_size = args.local_rank, args.world_size, args.batchsize
torch.distributed.init_process_group(backend="nccl", init_method='file://' + os.path.abspath('shared/sharedfile'),
                                     rank=local_rank, world_size=world_size)  # RUN: the path made absolute

torch.manual_seed(0)  # RUN: the same 128 random samples on every rank, in place of the images in dataPath
features = torch.randn(128, 8)
dataset = TensorDataset(features, (features.sum(1) > 0).long())               # snippet 3
data_sampler = DistributedSampler(dataset, rank=local_rank, num_replicas=world_size)
dataloader = DataLoader(dataset, batch_size=batch_size, num_workers=1,
                        drop_last=True, pin_memory=True, sampler=data_sampler)

torch.cuda.set_device(local_rank)                                             # snippet 4
device = torch.device('cuda:' + f'{local_rank}')
D = Model()
D = torch.nn.SyncBatchNorm.convert_sync_batchnorm(D).to(device)
D = torch.nn.parallel.DistributedDataParallel(D, find_unused_parameters=True,
                                              device_ids=[local_rank], output_device=local_rank)

dist.barrier()                                                                # snippet 6
D.load_state_dict(torch.load('D.pth'))  # RUN: map_location=torch.device('cpu') removed: a TypeError here
dist.barrier()

optimizer = torch.optim.SGD(D.parameters(), lr=0.1)  # RUN: the post writes `...  # train`; the plainest loop
for epoch in range(args.epochs):
    data_sampler.set_epoch(epoch)                                             # snippet 5
    for inputs, labels in dataloader:
        loss = nn.functional.cross_entropy(D(inputs.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

# RUN: snippet 1 belongs to the post's inference script: it loads a file this script never saves
# from collections import OrderedDict
# state_dict = torch.load(args.model_path)                                    # snippet 1
# new_state_dict = OrderedDict()
# for k, v in state_dict.items():
#     name = k[7:]  # remove `module.`
#     new_state_dict[name] = v
# model.load_state_dict(new_state_dict)

# snippet 7, the launch:
# CUDA_VISIBLE_DEVICES=1,3 python -m torch.distributed.launch --nproc_per_node=2 train.py \
#     --epochs 15000 --batchsize 10 --world_size 2
