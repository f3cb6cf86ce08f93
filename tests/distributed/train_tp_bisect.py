"""A 2-way tensor-parallel training script, as torchrun runs it (env:// rendezvous), for live
multi-rank bisect (``torchrun ... -m precisiondiff.cli bisect --script``): ``--steps`` (1) SGD
steps of the Megatron-style bf16 MLP of workers_tp_bisect.py, with a planted fault (``--steps 0``:
one forward and backward, no optimizer: the script runs to its end).

``--plant gemm``: ``fc1``'s GEMM (a custom op) accumulates in bf16 on rank ``--bad-rank`` (1) only;
``--plant bf16-all-reduce``: the all-reduce of ``fc2``'s float32 partial sums adds them in bf16.
``--tp N``: tensor-parallel groups of N consecutive ranks (default: all of them); with 4 ranks and
``--tp 2``, TP 2 x DP 2 (the two TP pairs are replicas fed the same input).
``--keep-group``: leave the process group initialized at the end (most scripts destroy it).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

try:  # inside the test job the worker module is already imported (its custom op registered once)
    from tests.distributed import workers_tp_bisect as tp
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import workers_tp_bisect as tp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--plant", choices=["none", "gemm", "bf16-all-reduce"], default="none")
parser.add_argument("--bad-rank", type=int, default=1)
parser.add_argument("--tp", type=int, default=0)
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--keep-group", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)
if not dist.is_initialized():  # the test job runs it inside its own group
    dist.init_process_group("gloo")
from precisiondiff.runtime.gloo_exit import guard_exit  # noqa: E402
guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
rank, world = dist.get_rank(), dist.get_world_size()
size = args.tp or world
if size != world:  # every rank creates every group, in the same order
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    tp.TP_GROUP = groups[rank // size]
tp.SLOPPY_GEMM = args.plant == "gemm" and rank == args.bad_rank
planted = tp.plant_bf16_all_reduce() if args.plant == "bf16-all-reduce" else None
model = tp.TPMLP(rank % size, size).to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # same on every rank
for _ in range(max(args.steps, 1)):
    loss = model(x).float().square().mean()
    loss.backward()
    if args.steps:
        opt.step()
        opt.zero_grad()
if planted is not None:
    planted._destroy()
tp.SLOPPY_GEMM, tp.TP_GROUP = False, None
if not args.keep_group:
    dist.destroy_process_group()
