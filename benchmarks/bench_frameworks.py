"""Capture on the framework jobs of examples/frameworks/ (the CI configurations): captured ÷ plain
training step per framework, layout, level and mode, and dump bytes per rank per step.

    DS_ACCELERATOR=cpu python benchmarks/bench_frameworks.py [--framework deepspeed,titan,megatron]
        [--ranks 1 2] [--steps 5] [--configs module/stats,op/replay,...] [--json OUT.json]

Frameworks (:data:`FRAMEWORKS`), each through its own engine or parallelize code, gloo on 127.0.0.1,
one process per rank (torch.multiprocessing), one thread each, every rank fed the same batch:

* ``deepspeed``: ``deepspeed.initialize`` on examples/frameworks/deepspeed_gpt2.py's GPT-2
  (2 layers, 32 wide), ZeRO-1 and ZeRO-2, bf16, DeepSpeed's AdamW; ``engine.backward`` / ``engine.step``;
* ``titan``: torchtitan's Llama 3 (examples/frameworks/torchtitan_llama.py: dim 32, 2 layers, SDPA),
  AdamW; 1 rank: one process; 2 ranks: FSDP2 x2 and TP x2 (sequence parallel) through its
  ``parallelize_llama`` (examples/frameworks/torchtitan_parallel.py);
* ``megatron``: megatron-core's ``GPTModel`` (examples/frameworks/megatron_gpt.py: 2 layers,
  hidden 32) in ``Float16Module`` (bf16), TP = the number of ranks, AdamW; on a machine without
  CUDA through the test suite's CPU shim (tests/frameworks/megatron_shim.py), as the example does.

Method (every framework the same, :func:`_measure`): the engine is built once per layout; two
warm-up steps; then for each (level, mode): one warm-up captured step in a scratch directory (the
statistics kernels' JIT and other one-time costs out of the timed steps), ``steps`` plain steps,
the same number captured with the Python API on the engine (``precisiondiff.capture(DIR,
model=engine, level=, mode=)``, ``cap.step()`` after each), ``steps`` plain steps again; the ratio
is the median captured step over the median of all plain steps of that configuration. Bytes: the
rank's dump directory over the captured steps. The table has one row per (framework, layout,
ranks, level, mode) with the worst rank's ratio. On a shared machine the plain step moves with
the load: the ratios are good to a factor of ~1.5-2 there (docs/performance.md).
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
from typing import Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "frameworks")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_distributed import _free_port  # noqa: E402

CONFIGS: List[Tuple[str, str]] = [("module", "stats"), ("op", "stats"), ("all", "stats"), ("all", "tensors"),
                                  ("all", "replay")]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _example(name: str):
    """An example module, imported once per process under its own name (its custom ops are
    defined once: a second definition would break the first's dispatcher entries)."""
    if name in sys.modules:
        return sys.modules[name]
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _measure(step: Callable[[int], None], engine, steps: int, out: str, framework: str, layout: str,
             ranks: int, rank: int, configs: List[Tuple[str, str]]) -> List[dict]:
    """Plain, captured, plain steps for every (level, mode) of ``configs`` (module docstring)."""
    import precisiondiff
    rows = []
    n = 0
    for _ in range(2):  # warm-up
        step(n)
        n += 1
    for level, mode in configs:
        tag = f"{framework}-{layout}-{level}-{mode}".replace(" ", "_")
        with precisiondiff.capture(os.path.join(out, f"warm-{tag}"), model=engine, level=level, mode=mode) as cap:
            step(n)
            cap.step()
            n += 1
        plain = []
        for _ in range(steps):
            t = time.perf_counter()
            step(n)
            plain.append(time.perf_counter() - t)
            n += 1
        where = os.path.join(out, tag)
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
        rank_dir = os.path.join(where, f"rank{rank}")  # the writer's per-rank directory when world > 1
        size = _dir_bytes(rank_dir if os.path.isdir(rank_dir) else where)
        rows.append({"framework": framework, "config": layout, "ranks": ranks, "rank": rank, "level": level,
                     "mode": mode, "plain_ms": round(p * 1e3, 2), "captured_ms": round(c * 1e3, 2),
                     "ratio": round(c / p, 2), "bytes_per_step": size // steps})
    return rows


def _environ(rank: int, ranks: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    torch.set_num_threads(1)


def _deepspeed_rank(rank: int, ranks: int, steps: int, out: str, configs) -> List[dict]:
    import deepspeed
    import torch
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
                         ranks, rank, configs)
    return rows


def _titan_rank(rank: int, ranks: int, steps: int, out: str, configs) -> List[dict]:
    import torch.distributed as dist
    tt = _example("torchtitan_llama")
    if ranks == 1:
        layouts = [("one process, SDPA", None)]
    else:
        tpar = _example("torchtitan_parallel")
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        layouts = [(f"FSDP2 x{ranks}", ["--fsdp", str(ranks)]), (f"TP x{ranks} (SP)", ["--tp", str(ranks)])]
    rows = []
    tokens, _ = tt.batch()
    for layout, argv in layouts:
        model = tt.tiny_llama() if argv is None else tpar.parallel_model(tpar.parse(argv), rank)
        opt = tt.optimizer(model.parameters())

        def step(i: int) -> None:
            tt.loss_of(model(tokens)).backward()
            opt.step()
            opt.zero_grad()

        rows += _measure(step, model, steps, out, "titan", f"Llama 3 dim 32, {layout}", ranks, rank, configs)
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def _megatron_rank(rank: int, ranks: int, steps: int, out: str, configs) -> List[dict]:
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module
    mg = _example("megatron_gpt")
    torch.manual_seed(0)
    tp = mg.init_parallel()
    model, config = mg.gpt(tp, bf16=True)
    model = Float16Module(config, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = mg.batch()

    def step(i: int) -> None:
        model(**inputs).float().mean().backward()
        opt.step()
        opt.zero_grad()

    rows = _measure(step, model, steps, out, "megatron", f"GPTModel bf16 (Float16Module), TP={tp}", ranks, rank,
                    configs)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return rows


#: framework -> its per-rank benchmark ``(rank, ranks, steps, out, configs) -> rows``
FRAMEWORKS: Dict[str, Callable[..., List[dict]]] = {
    "deepspeed": _deepspeed_rank,
    "titan": _titan_rank,
    "megatron": _megatron_rank,
}


def _rank_main(name: str, rank: int, ranks: int, port: int, steps: int, out: str, configs, queue) -> None:
    _environ(rank, ranks, port)
    try:
        queue.put(FRAMEWORKS[name](rank, ranks, steps, out, configs))
    except BaseException as err:  # the parent reports it instead of waiting for rows forever
        queue.put(f"{name} rank {rank}: {type(err).__name__}: {err}")
        raise


def run_framework(name: str, ranks: int, steps: int, out: str, configs) -> List[dict]:
    """Every rank's rows of framework ``name`` on ``ranks`` spawned gloo processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(name, r, ranks, port, steps, out, configs, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    rows: List[dict] = []
    errors = []
    for _ in procs:
        got = queue.get(timeout=3600)
        if isinstance(got, str):
            errors.append(got)
        else:
            rows += got
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return rows


def _table(rows: List[dict]) -> str:
    worst: Dict[tuple, dict] = {}
    for r in rows:
        key = (r["framework"], r["config"], r["ranks"], r["level"], r["mode"])
        if key not in worst or r["ratio"] > worst[key]["ratio"]:
            worst[key] = r
    lines = ["| framework | layout | ranks | level/mode | plain step | captured step | captured ÷ plain "
             "| dump bytes per rank per step |", "|---|---|---|---|---|---|---|---|"]
    for (fw, config, ranks, level, mode), r in worst.items():
        lines.append(f"| {fw} | {config} | {ranks} | {level}/{mode} | {r['plain_ms']:.1f} ms | "
                     f"{r['captured_ms']:.1f} ms | {r['ratio']:.2f} | {r['bytes_per_step']:,} |")
    return "\n".join(lines)


def _configs(text: str) -> List[Tuple[str, str]]:
    out = []
    for item in text.split(","):
        level, _, mode = item.strip().partition("/")
        if level not in ("module", "op", "all") or mode not in ("stats", "tensors", "replay"):
            raise argparse.ArgumentTypeError(f"{item!r}: LEVEL/MODE, LEVEL in module, op, all; "
                                             "MODE in stats, tensors, replay")
        out.append((level, mode))
    return out


def _frameworks(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown framework(s) {unknown}: choose from {', '.join(FRAMEWORKS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", "--frameworks", dest="framework", type=_frameworks,
                        default=list(FRAMEWORKS), help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default: all)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per (level, mode), plain and captured")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    parser.add_argument("--configs", type=_configs, default=CONFIGS,
                        help="comma-separated LEVEL/MODE (default: " + ",".join(f"{lv}/{m}" for lv, m in CONFIGS) + ")")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows: List[dict] = []
    for name in args.framework:
        for ranks in args.ranks:
            with tempfile.TemporaryDirectory() as out:
                started = time.perf_counter()
                rows += run_framework(name, ranks, args.steps, out, args.configs)
                print(f"# {name} x{ranks}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
