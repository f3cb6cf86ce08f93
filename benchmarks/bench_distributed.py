"""Distributed capture and host memory, side by side in one run.

    python benchmarks/bench_distributed.py [--ranks 2 4] [--steps 5] [--zoo llama]

1. Capture overhead per rank of a DDP training job on gloo (127.0.0.1, 2 and 4 ranks): each
   rank times plain training steps, captured ones, then plain ones again (medians), for level
   all in stats and tensors modes (the optimizer step ends a capture step, as in scripts);
   reported per rank as captured step / plain step, with the dump bytes per rank and step.
2. Host-memory peak of capture (tensors mode) and of bisect on the largest zoo model, against
   the model's own footprint (parameters + gradients + one plain step's peak), each measured in
   a fresh process (ru_maxrss of a child: the peak RSS above the process's baseline after
   imports and model construction).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _rank(rank: int, world: int, port: int, out: str, steps: int, result: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import precisiondiff

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                              nn.Linear(1024, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    rows = {}
    for mode in ("stats", "tensors"):
        plain, captured = [], []

        def timed(into):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            into.append(time.perf_counter() - t0)

        for _ in range(steps):  # plain steps before and after the captured ones: noise hits both
            timed(plain)
        path = os.path.join(out, f"{world}-{mode}")
        with precisiondiff.capture(path, model=model, mode=mode, steps=f"0-{steps - 1}") as cap:
            for _ in range(steps):
                timed(captured)  # optimizer.step() ends a capture step
        for _ in range(steps):
            timed(plain)
        rank_dir = os.path.join(path, f"rank{rank}")
        size = sum(os.path.getsize(os.path.join(rank_dir, f)) for f in os.listdir(rank_dir))
        rows[mode] = {"plain_ms": 1e3 * statistics.median(plain), "captured_ms": 1e3 * statistics.median(captured),
                      "bytes": size, "events": cap.recorder.events_written}
    with open(f"{result}.{rank}", "w") as fh:
        json.dump(rows, fh)
    dist.destroy_process_group()


def distributed(ranks: list, steps: int) -> None:
    import torch.multiprocessing as mp

    print(f"DDP MLP (256-1024-1024-256, batch 32 per rank), gloo on 127.0.0.1, level all, median of {steps} steps")
    print(f"{'ranks':>5} {'mode':<8} {'rank':>4} {'plain ms':>9} {'captured ms':>12} {'ratio':>6} {'dump MB/rank':>13}")
    for world in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result")
            mp.spawn(_rank, args=(world, _free_port(), tmp, steps, result), nprocs=world)
            per_rank = [json.load(open(f"{result}.{r}")) for r in range(world)]
        for mode in ("stats", "tensors"):
            for r, rows in enumerate(per_rank):
                row = rows[mode]
                print(f"{world:>5} {mode:<8} {r:>4} {row['plain_ms']:>9.1f} {row['captured_ms']:>12.1f} "
                      f"{row['captured_ms'] / row['plain_ms']:>6.2f} {row['bytes'] / steps / 1e6:>13.2f}")


_MEMORY_CHILD = r"""
import json, resource, sys, tempfile, torch
sys.path.insert(0, ROOT)
torch.set_num_threads(1)
from tests.zoo import ZOO
import precisiondiff
from precisiondiff.runtime.workload import run_workload
from precisiondiff.runtime.targets import Target
what, name = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
workload = ZOO[name]()
target = Target.parse("cpu/float32")
model = target.prepare_model(workload.model)
inputs = target.prepare_inputs(workload.inputs)
params = sum(p.numel() * p.element_size() for p in model.parameters())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if what == "plain":
    run_workload(workload, target, model=model, inputs=inputs)
elif what == "capture":
    with tempfile.TemporaryDirectory() as tmp:
        with precisiondiff.capture(tmp + "/d", model=model, mode="tensors") as cap:
            run_workload(workload, target, model=model, inputs=inputs)
elif what == "bisect":
    precisiondiff.bisect(workload, target="cpu/bf16", ref="cpu/float64")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"params": params, "base_kb": base, "peak_kb": peak}))
""".replace("ROOT", repr(ROOT))


def memory(name: str) -> None:
    rows = {}
    for what in ("plain", "capture", "bisect"):
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, what, name], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
        rows[what] = json.loads(out.stdout.strip().splitlines()[-1])
    params = rows["plain"]["params"]
    own = (rows["plain"]["peak_kb"] - rows["plain"]["base_kb"]) * 1024
    print(f"\nhost memory on zoo model {name} ({params / 1e6:.2f} MB of float32 parameters), peak RSS above the "
          "process baseline (after imports and model construction)")
    print(f"{'run':<8} {'MB':>8} {'x the plain step':>17}")
    for what, row in rows.items():
        extra = (row["peak_kb"] - row["base_kb"]) * 1024
        print(f"{what:<8} {extra / 1e6:>8.1f} {extra / max(own, 1):>17.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zoo", default="llama", help="the zoo model for the memory figures")
    args = parser.parse_args()
    distributed(args.ranks, args.steps)
    memory(args.zoo)


if __name__ == "__main__":
    main()
