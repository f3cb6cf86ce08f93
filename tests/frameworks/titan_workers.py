"""The 2-rank gloo job of tests/frameworks/test_torchtitan_parallel.py: every scenario runs in one
pair of spawned processes (torchtitan imported once per process), each building torchtitan's
tiny Llama and parallelizing it with torchtitan's own ``parallelize_llama``
(examples/frameworks/torchtitan_parallel.py), then one training step under the Python API's
capture in replay mode (``OUT/NAME/rank{N}``), or 3 steps under watch (``OUT/watch``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples" / "frameworks")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import torchtitan_llama as tt  # noqa: E402
import torchtitan_parallel as tpar  # noqa: E402

# name -> the example's command line
CAPTURES = {
    "fsdp": ["--fsdp", "2"],
    "fsdp_plant": ["--fsdp", "2", "--plant", "1"],
    "tp": ["--tp", "2"],
    "tp_plant": ["--tp", "2", "--plant", "0"],
    "fsdp_ac_plant": ["--fsdp", "2", "--ac", "full", "--plant", "1"],
}
WATCH = ["--fsdp", "2", "--plant-optimizer", "1", "--param-dtype", "float32"]
WATCH_STEPS, REPLAY_STEP = 3, 1


def _capture(name: str, out: Path, rank: int) -> None:
    import precisiondiff
    args = tpar.parse(CAPTURES[name])
    model = tpar.parallel_model(args, rank)
    opt = tt.optimizer(model.parameters(), planted=args.plant_optimizer == rank)
    tokens, _ = tt.batch()
    with precisiondiff.capture(out / name, model=model, mode="replay"):
        tt.loss_of(model(tokens)).backward()
        opt.step()
        opt.zero_grad()


def _watch(out: Path, rank: int) -> None:
    import precisiondiff
    args = tpar.parse(WATCH)
    model = tpar.parallel_model(args, rank)
    opt = tt.optimizer(model.parameters(), planted=args.plant_optimizer == rank)
    tokens, _ = tt.batch()
    with precisiondiff.watch(out / "watch", model=model, optimizer=opt, param_every=1,
                             replay_steps=str(REPLAY_STEP)) as w:
        for _ in range(WATCH_STEPS):
            loss = tt.loss_of(model(tokens))
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)


def run(rank: int, world: int, port: int, out: str, names: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from precisiondiff.runtime.gloo_exit import guard_exit
    guard_exit()  # a plain gloo run has no precisiondiff session to guard its exit (docs/watch.md, "A gloo job's exit")
    try:
        for name in names:
            if name == "watch":
                _watch(Path(out), rank)
            else:
                _capture(name, Path(out), rank)
            dist.barrier()
    finally:
        dist.destroy_process_group()
