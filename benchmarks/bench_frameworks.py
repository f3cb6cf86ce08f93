"""Capture on the framework jobs of examples/frameworks/: captured ÷ plain step per level and mode,
and dump bytes per rank per step.

    DS_ACCELERATOR=cpu python benchmarks/bench_frameworks.py [--frameworks deepspeed] [--steps 5]
        [--ranks 1 2] [--json OUT.json]

One function per framework in :data:`FRAMEWORKS`, each returning rows ``{"framework", "config",
"ranks", "rank", "level", "mode", "plain_ms", "captured_ms", "ratio", "bytes_per_step"}``; the
table printed has one row per (framework, config, ranks, level, mode), the worst rank's ratio.

Method (each framework the same): in one process per rank (torch.multiprocessing, gloo on
127.0.0.1), the framework's engine is built once; a few warm-up steps; then for each level and
mode: ``steps`` plain steps, the same number captured with the Python API on the engine
(``precisiondiff.capture(DIR, model=engine, level=, mode=)``, ``cap.step()`` after each), and
``steps`` plain steps again; the ratio is the median captured step over the median of all plain
steps. Bytes: the dump directory's size over the captured steps. On this shared 2-core machine
the figures are loaded-machine figures (±1.5x).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_distributed import _free_port  # noqa: E402

CONFIGS = [("module", "stats"), ("op", "stats"), ("all", "stats"), ("all", "tensors"), ("all", "replay")]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _example(name: str):
    path = os.path.join(ROOT, "examples", "frameworks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measure(step: Callable[[int], None], engine, steps: int, out: str, framework: str, config: str,
             ranks: int, rank: int) -> List[dict]:
    """Plain, captured, plain steps for every (level, mode) of :data:`CONFIGS` (module doc)."""
    import precisiondiff
    rows = []
    n = 0
    for _ in range(2):  # warm-up
        step(n)
        n += 1
    for level, mode in CONFIGS:
        plain = []
        for _ in range(steps):
            t = time.perf_counter()
            step(n)
            plain.append(time.perf_counter() - t)
            n += 1
        where = os.path.join(out, f"{config}-{level}-{mode}-r{rank}")
        captured = []
        with precisiondiff.capture(where, model=engine, level=level, mode=mode) as cap:
            for _ in range(steps):
                t = time.perf_counter()
                step(n)
                cap.step()
                captured.append(time.perf_counter() - t)
                n += 1
        for _ in range(steps):
            t = time.perf_counter()
            step(n)
            plain.append(time.perf_counter() - t)
            n += 1
        p, c = statistics.median(plain), statistics.median(captured)
        rows.append({"framework": framework, "config": config, "ranks": ranks, "rank": rank, "level": level,
                     "mode": mode, "plain_ms": round(p * 1e3, 2), "captured_ms": round(c * 1e3, 2),
                     "ratio": round(c / p, 2), "bytes_per_step": _dir_bytes(where) // steps})
    return rows


def _deepspeed_rank(rank: int, ranks: int, port: int, steps: int, out: str, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(1)
    import deepspeed
    ex = _example("deepspeed_gpt2")
    deepspeed.init_distributed(dist_backend="gloo")
    rows = []
    for zero in (1, 2):
        torch.manual_seed(0)
        model = ex.tiny_gpt2()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ex._ds_config(zero, True))

        def step(i: int) -> None:
            ids = ex.batch(i)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()

        rows += _measure(step, engine, steps, out, "deepspeed", f"ZeRO-{zero} bf16 GPT-2 (2 layers, 32 wide)",
                         ranks, rank)
    queue.put(rows)


def bench_deepspeed(steps: int, ranks: int, out: str) -> List[dict]:
    """DeepSpeed 0.19 ``deepspeed.initialize`` on examples/frameworks/deepspeed_gpt2.py's model,
    ZeRO-1 and ZeRO-2, bf16, AdamW, on ``ranks`` gloo processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_deepspeed_rank, args=(r, ranks, port, steps, out, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows += queue.get(timeout=1800)
    for p in procs:
        p.join()
    return rows


#: framework -> its benchmark function ``(steps, ranks, out) -> rows``
FRAMEWORKS: Dict[str, Callable[[int, int, str], List[dict]]] = {
    "deepspeed": bench_deepspeed,
}


def _table(rows: List[dict]) -> str:
    worst: Dict[tuple, dict] = {}
    for r in rows:
        key = (r["framework"], r["config"], r["ranks"], r["level"], r["mode"])
        if key not in worst or r["ratio"] > worst[key]["ratio"]:
            worst[key] = r
    lines = ["| framework | config | ranks | level/mode | plain step | captured step | captured ÷ plain "
             "| dump bytes per rank per step |", "|---|---|---|---|---|---|---|---|"]
    for (fw, config, ranks, level, mode), r in worst.items():
        lines.append(f"| {fw} | {config} | {ranks} | {level}/{mode} | {r['plain_ms']:.1f} ms | "
                     f"{r['captured_ms']:.1f} ms | {r['ratio']:.2f} | {r['bytes_per_step']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1])
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows: List[dict] = []
    for name in args.frameworks:
        for ranks in args.ranks:
            with tempfile.TemporaryDirectory() as out:
                rows += FRAMEWORKS[name](args.steps, ranks, out)
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
