"""tests/watch/train.py's decoder trained data-parallel (DDP, gloo) under torchrun: each of the
ranks takes its equal share of the batch, so the job computes what one process does on the whole
batch. ``--broken-from K`` turns the planted ``pdwatch::fused_gelu`` on from step K."""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--broken-from", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _, tokens = train.build(dtype=getattr(torch, args.dtype), gelu_op=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    share = tokens.shape[0] // world
    for step in range(args.steps):
        train.BROKEN["on"] = args.broken_from is not None and step >= args.broken_from
        train.train_step(ddp, opt, tokens[rank * share:(rank + 1) * share])
    # No dist.barrier() first: a watched job must also end when the script does not wait for its
    # last all-reduces (docs/watch.md, "A gloo DDP job's exit").
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
