"""What each rank of the test jobs runs (importable, so torch.multiprocessing.spawn can start it).

One job runs every scenario in turn, so the process groups start once: collectives (c10d, async
and functional), DDP, FSDP2 and 2-way tensor parallel, each captured into its own dump under
``out/NAME``, plus uninstrumented reference values under ``out/plain-*.pt`` written with
torch.save (the test reads them with ``weights_only=True``).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

import precisiondiff


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, as in data parallel
    return torch.randn(4, 8, generator=g)


def collectives(out: str, rank: int) -> None:
    """c10d all_reduce (sync and async), a functional all_reduce and an all_gather."""
    m = _model()
    with precisiondiff.capture(os.path.join(out, "coll"), model=m, mode="tensors") as cap:
        y = m(_inputs(rank))
        s = torch.full((3,), float(rank + 1))
        dist.all_reduce(s)  # 1 + 2 = 3 on every rank
        a = torch.full((3,), float(rank + 1))
        work = dist.all_reduce(a, async_op=True)
        work.wait()
        a = a * 2  # 6
        import torch.distributed._functional_collectives as fc
        f = fc.all_reduce(y, "sum", dist.group.WORLD)
        g = f + 1
        parts = [torch.empty(2) for _ in range(2)]
        dist.all_gather(parts, torch.full((2,), float(rank)))
        cap.step()
    torch.save({"g": g, "a": a, "s": s}, os.path.join(out, f"plain-coll-{rank}.pt"))


def ddp(out: str, rank: int) -> None:
    """DDP training step (SGD) captured; the same step run uninstrumented for the observer check."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for captured in (False, True):
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = _inputs(rank)
        if captured:
            with precisiondiff.capture(os.path.join(out, "ddp"), model=model, mode="stats") as cap:
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                cap.step()
        else:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
        results[captured] = (loss.detach().clone(), [p.detach().clone() for p in model.parameters()])
    torch.save({"loss": [results[False][0], results[True][0]],
                "params": [results[False][1], results[True][1]]},
               os.path.join(out, f"plain-ddp-{rank}.pt"))


def fsdp2(out: str, rank: int) -> None:
    """fully_shard on each Linear and the root; forward, backward, optimizer step."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with precisiondiff.capture(os.path.join(out, "fsdp"), model=model, mode="tensors") as cap:
        loss = model(_inputs(rank)).square().mean()
        loss.backward()
        opt.step()
        cap.step()


def tensor_parallel(out: str, rank: int) -> None:
    """Colwise then Rowwise Linear over a 2-rank mesh: DTensor parameters, replicated output."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = _inputs(0)  # tensor parallel: every rank sees the same batch
    with precisiondiff.capture(os.path.join(out, "tp"), model=model, mode="tensors") as cap:
        y = model(x)
        y.sum().backward()
        cap.step()
    torch.save({"y": torch.as_tensor(y.detach().clone()) if not hasattr(y, "wait") else y.wait().clone()},
               os.path.join(out, f"plain-tp-{rank}.pt"))


def tensor_parallel_stats(out: str, rank: int) -> None:
    """The same tensor-parallel step in stats mode, parameter gradients gathered in full."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with precisiondiff.capture(os.path.join(out, "tp-stats"), model=model, mode="stats",
                               gather_full="param_grad") as cap:
        model(_inputs(0)).sum().backward()
        cap.step()
    # rank 1 records nothing: it must still take part in agreeing what to gather (or rank 0 hangs)
    with precisiondiff.capture(os.path.join(out, "tp-rank0"), model=model, mode="stats", ranks="0",
                               gather_full=True) as cap:
        model(_inputs(0)).sum().backward()
        cap.step()


def async_orders(out: str, rank: int) -> None:
    """Async all-reduces issued on two groups in opposite orders on the two ranks, waited later:
    a capture that waited where each is issued would hang (then time out after 10 s)."""
    short = datetime.timedelta(seconds=10)
    g1, g2, g3 = (dist.new_group([0, 1], timeout=short) for _ in range(3))
    a, b = torch.full((3,), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))
    with precisiondiff.capture(os.path.join(out, "async"), model=_model(), mode="tensors") as cap:
        if rank == 0:
            wa, wb = dist.all_reduce(a, group=g1, async_op=True), dist.all_reduce(b, group=g2, async_op=True)
        else:
            wb, wa = dist.all_reduce(b, group=g2, async_op=True), dist.all_reduce(a, group=g1, async_op=True)
        wa.wait()
        wb.wait()
        a.mul_(2)  # reads the reduced a (3), writes 6; b is read by no op before the step's end (30)
        late = torch.full((2,), 5.0)
        if rank == 0:  # rank 1 issues this one only after rank 0's capture has ended
            w_late = dist.all_reduce(late, group=g3, async_op=True)
        cap.step()
    if rank == 0:
        dist.send(torch.zeros(1), dst=1)
        w_late.wait()
    else:
        dist.recv(torch.zeros(1), src=0)
        dist.all_reduce(late, group=g3)
    torch.save({"a": a, "b": b, "late": late}, os.path.join(out, f"plain-async-{rank}.pt"))


def pipeline(out: str, rank: int) -> None:
    """torch.distributed.pipelining, 2 stages (Linear+ReLU | Linear), GPipe, 2 microbatches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    full = _model()
    stage_module = nn.Sequential(full[0], full[1]) if rank == 0 else nn.Sequential(full[2])
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda y, t: (y - t).square().mean())
    with precisiondiff.capture(os.path.join(out, "pipeline"), model=stage_module, mode="stats") as cap:
        if rank == 0:
            schedule.step(_inputs(0))
        else:
            schedule.step(target=torch.zeros(4, 8), losses=[])
        cap.step()


SCENARIOS = {"collectives": collectives, "ddp": ddp, "fsdp2": fsdp2, "tp": tensor_parallel,
             "tp_stats": tensor_parallel_stats, "async": async_orders,
             "pipeline": pipeline}


def run(rank: int, world: int, port: int, out: str, names: "list[str]") -> None:
    """torch.multiprocessing.spawn entry: one gloo group on 127.0.0.1, the named scenarios."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # a hang (collectives issued in different orders) fails the test instead of blocking CI
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    try:
        for name in names:
            SCENARIOS[name](out, rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()
