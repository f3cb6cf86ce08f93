"""torchtitan rows of the framework benchmark: captured step ÷ plain step and dump bytes per rank
per step, per level and mode, on the CI configurations (tiny Llama 3 of torchtitan's own code,
dim 32, 2 layers; FSDP2 x2 and TP x2 through its parallelize_llama, gloo; one process SDPA).

    python benchmarks/bench_frameworks_titan.py [--repeats 3] [--layouts single,fsdp,tp]

Each rank times --repeats training steps (forward, backward, AdamW) per configuration after a
warm-up step and a warm-up capture, plain steps interleaved with captured ones so machine noise
hits both; the table is rank 0's (median). Meant to merge into benchmarks/bench_frameworks.py's per-framework table.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "frameworks"))

CONFIGS = [("module", "stats"), ("op", "replay"), ("all", "stats")]
LAYOUTS = {"single": [], "fsdp": ["--fsdp", "2"], "tp": ["--tp", "2"]}


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _measure(model, repeats: int, tmp: str, rank: int) -> list:
    import precisiondiff
    import torchtitan_llama as tt
    opt = tt.optimizer(model.parameters())
    tokens, _ = tt.batch()

    def step():
        tt.loss_of(model(tokens)).backward()
        opt.step()
        opt.zero_grad()

    step()
    rows = []
    for level, mode in CONFIGS:
        plain, captured, size = [], [], 0
        with precisiondiff.capture(os.path.join(tmp, f"warm-{level}-{mode}"), model=model, level=level, mode=mode):
            step()  # one-time costs (the statistics kernels' JIT) out of the timed steps
        for rep in range(repeats):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
            out = os.path.join(tmp, f"{level}-{mode}-{rep}")
            t0 = time.perf_counter()
            with precisiondiff.capture(out, model=model, level=level, mode=mode):
                step()
            captured.append(time.perf_counter() - t0)
            rank_dir = os.path.join(out, f"rank{rank}")
            size = _bytes(rank_dir if os.path.isdir(rank_dir) else out)
        rows.append((level, mode, statistics.median(plain), statistics.median(captured), size))
    return rows


def _worker(rank: int, world: int, port: int, argv: list, repeats: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist
    import torchtitan_parallel as tpar
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = _measure(tpar.parallel_model(tpar.parse(argv), rank), repeats, tmp, rank)
    if rank == 0:
        _print(" ".join(argv), rows)
    dist.destroy_process_group()


def _print(layout: str, rows: list) -> None:
    for level, mode, plain, captured, size in rows:
        print(f"{layout:<10} {level:<7} {mode:<7} {plain * 1e3:>9.1f} {captured * 1e3:>12.1f} "
              f"{captured / plain:>6.1f}x {size / 1e6:>9.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="single,fsdp,tp")
    args = parser.parse_args()
    import torch
    import torch.multiprocessing as mp
    torch.set_num_threads(1)
    print(f"{'layout':<10} {'level':<7} {'mode':<7} {'plain ms':>9} {'captured ms':>12} {'ratio':>7} {'MB/rank':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            if layout == "single":
                import torchtitan_llama as tt
                _print("single", _measure(tt.tiny_llama(), args.repeats, os.path.join(tmp, "single"), 0))
                continue
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_worker, args=(2, port, LAYOUTS[layout], args.repeats, os.path.join(tmp, layout)), nprocs=2)


if __name__ == "__main__":
    main()
