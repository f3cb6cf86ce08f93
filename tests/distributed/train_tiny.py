"""A tiny training step with no process group of its own (the overwrite tests' ranks run it):
``--fail-rank N`` makes rank N raise, as a failing capture would; ``--tag T`` is written into the
model's bias so each run's dump can be told from the previous one's."""
import argparse
import os

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--tag", type=float, default=0.0)
args = parser.parse_args()
rank = int(os.environ.get("RANK", 0))
torch.manual_seed(rank)
model = nn.Linear(4, 2)
with torch.no_grad():
    model.bias.fill_(args.tag)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(3, 4)).square().mean().backward()
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} failed on purpose")
opt.step()
