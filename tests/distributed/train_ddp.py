"""A plain DDP training script, as torchrun runs it (env:// rendezvous): 3 steps of SGD.

``--die-at N``: rank 1 kills itself (SIGKILL) at the start of step N, as a crashed rank would.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--die-at", type=int, default=-1)
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
from precisiondiff.runtime.gloo_exit import guard_exit  # noqa: E402
guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(3):
    if step == args.die_at and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
