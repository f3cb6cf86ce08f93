"""A Megatron-style 2-way tensor-parallel MLP with planted faults, for multi-rank bisect.

``TPMLP``: ``fc1`` column-parallel (each rank holds half of its output features), GELU, ``fc2``
row-parallel (half of its input features), the partial sums reduced across ranks in float32
(``_c10d_functional.all_reduce``, as frameworks that reduce partial sums in fp32 do), then cast
back to bf16. The backward of the column-parallel input is a c10d ``all_reduce`` of its gradient.

Planted faults (never a stock kernel's behaviour):

* ``pdtest_tp::linear``, the GEMM of ``fc1``: its bf16 path accumulates in a bf16 accumulator
  when ``SLOPPY_GEMM`` is set, which the job sets on rank 1 only (a bad core on one device);
* ``bf16_all_reduce``: the CPU kernel of ``_c10d_functional.all_reduce`` replaced by one that
  gathers the ranks' float32 inputs and sums them in bf16 (a collective library accumulating in
  bf16), installed on every rank.

Each scenario is captured (``mode="replay"``) into ``out/NAME`` (``rank0/``, ``rank1/``); ``dtensor``
is a clean MLP tensor-parallel through ``parallelize_module`` (DTensor).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import precisiondiff

SLOPPY_GEMM = False  # set on the rank whose GEMM is faulty
TP_GROUP = None  # the tensor-parallel process group (None: the whole world)


@torch.library.custom_op("pdtest_tp::linear", mutates_args=())
def tp_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b``; with ``SLOPPY_GEMM`` the bf16 path sums the products in bf16."""
    if x.dtype == torch.bfloat16 and SLOPPY_GEMM:
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        for k in range(x.shape[1]):
            acc = acc + (x[:, k:k + 1].float() * w[:, k].float()).to(torch.bfloat16)
        return (acc.float() + b.float()).to(x.dtype)
    return F.linear(x, w, b)


@tp_linear.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


def _tp_linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.t() @ x, grad.sum(0)


def _tp_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


tp_linear.register_autograd(_tp_linear_backward, setup_context=_tp_linear_setup)


def plant_bf16_all_reduce() -> torch.library.Library:
    """Replace the CPU kernel of ``_c10d_functional.all_reduce`` by one that sums in bf16 (until
    the returned library is destroyed)."""
    import torch.distributed._functional_collectives as fc

    def bf16_all_reduce(x, reduce_op, group_name):
        from torch.distributed.distributed_c10d import _resolve_process_group
        world = _resolve_process_group(group_name).size()
        parts = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world, group_name)
        parts = torch.ops._c10d_functional.wait_tensor(parts).view(world, *x.shape)
        acc = parts[0].to(torch.bfloat16)
        for r in range(1, world):
            acc = acc + parts[r].to(torch.bfloat16)
        return acc.to(x.dtype)

    assert fc is not None  # the functional collectives' kernels are registered
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_reduce", bf16_all_reduce, "CPU")
    return lib


class _ReduceForward(torch.autograd.Function):
    """All-reduce the row-parallel partial sums (float32); the gradient passes through."""

    @staticmethod
    def forward(ctx, y):
        import torch.distributed._functional_collectives as fc
        out = fc.all_reduce(y, "sum", TP_GROUP or dist.group.WORLD)
        return out.wait() if hasattr(out, "wait") else out

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReduceBackward(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (column-parallel input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=TP_GROUP)
        return grad


class ColumnLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        rows = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * rows:(rank + 1) * rows].clone())

    def forward(self, x):
        return tp_linear(_ReduceBackward.apply(x), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        cols = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, h):
        partial = F.linear(h, self.weight).float()
        return _ReduceForward.apply(partial).to(h.dtype) + self.bias


class TPMLP(nn.Module):
    def __init__(self, rank: int, world: int, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same full weights on every rank, each keeps its shard
        self.inp = nn.Linear(dim, dim)  # replicated: its gradient is all-reduced in backward
        full1, full2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.fc1 = ColumnLinear(full1, rank, world)
        self.act = nn.GELU()
        self.fc2 = RowLinear(full2, rank, world)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.inp(x))))


def step(out: str, rank: int, world: int) -> None:
    """One captured training step of the bf16 TP MLP: forward, loss, backward."""
    model = TPMLP(rank, world).to(torch.bfloat16)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # same on every rank
    with precisiondiff.capture(out, model=model, mode="replay") as cap:
        loss = model(x).float().square().mean()
        loss.backward()
        cap.step()


def step_dtensor(out: str, rank: int, world: int) -> None:
    """The same kind of MLP through ``parallelize_module`` (DTensor, ColwiseParallel then
    RowwiseParallel): the row-parallel ``addmm`` adds its replicated bias to a partial sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(torch.bfloat16)
    parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with precisiondiff.capture(out, model=model, mode="replay") as cap:
        model(x).float().square().mean().backward()
        cap.step()


def bisect_across(out: str, rank: int) -> None:
    """Bisect the ``kernel`` dump with the ranks shared among the job's processes (what
    ``torchrun ... bisect RUN_DIR`` does); each process writes what it got back."""
    import json

    from precisiondiff.bisect.ranks import bisect_ranks
    result = bisect_ranks(os.path.join(out, "kernel"), across_processes=True)
    with open(os.path.join(out, f"across-{rank}.json"), "w") as fh:
        json.dump(None if result is None else result.to_json(), fh)


def bisect_hosts(out: str, rank: int) -> None:
    """As on several hosts without shared storage: each process sees only its own rank's dump of
    ``collective`` (copied into ``out/hosts/host{rank}/collective/rank{rank}``) and bisects the job
    across the processes; the collectives' tensors travel over the group."""
    import json
    import shutil

    from precisiondiff.bisect.ranks import bisect_ranks
    run_dir = os.path.join(out, "hosts", f"host{rank}", "collective")
    shutil.copytree(os.path.join(out, "collective", f"rank{rank}"), os.path.join(run_dir, f"rank{rank}"))
    result = bisect_ranks(run_dir, across_processes=True)
    with open(os.path.join(out, f"hosts-{rank}.json"), "w") as fh:
        json.dump(None if result is None else result.to_json(), fh)


def bisect_live(out: str, rank: int) -> None:
    """``bisect_script`` in each process of the job (what ``torchrun ... bisect --script`` runs): the
    script plants the bf16 all-reduce and keeps the job's group; the dumps are kept in ``out/live``."""
    import json

    from precisiondiff.bisect.script import bisect_script
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tp_bisect.py")
    result = bisect_script(script, ["--plant", "bf16-all-reduce", "--keep-group"], keep=os.path.join(out, "live"))
    with open(os.path.join(out, f"live-{rank}.json"), "w") as fh:
        json.dump(result.to_json(), fh)


SCENARIOS = ("clean", "kernel", "collective", "dtensor", "across", "hosts", "live")


def run(rank: int, world: int, port: int, out: str, scenarios: "list[str]") -> None:
    """torch.multiprocessing.spawn entry: one gloo group on 127.0.0.1, each scenario captured into
    ``out/NAME``: ``clean``; ``kernel``: the GEMM faulty on rank 1 only; ``collective``: the
    all-reduce sums in bf16; ``dtensor``: the clean ``parallelize_module`` MLP; ``across``: bisect
    ``kernel`` with the ranks shared among the processes; ``hosts``: bisect ``collective`` with each
    process seeing only its own rank's dump; ``live``: capture and bisect
    train_tp_bisect.py in every process (:func:`precisiondiff.bisect.script.bisect_script`)."""
    global SLOPPY_GEMM
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    try:
        for name in scenarios:
            SLOPPY_GEMM = name == "kernel" and rank == 1
            lib = plant_bf16_all_reduce() if name == "collective" else None
            try:
                if name == "across":
                    bisect_across(out, rank)
                elif name == "hosts":
                    bisect_hosts(out, rank)
                elif name == "live":
                    bisect_live(out, rank)
                else:
                    (step_dtensor if name == "dtensor" else step)(os.path.join(out, name), rank, world)
            finally:
                SLOPPY_GEMM = False
                if lib is not None:
                    lib._destroy()
            dist.barrier()
    finally:
        dist.destroy_process_group()
