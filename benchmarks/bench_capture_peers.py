"""Capture overhead side by side: precisiondiff, msprobe (mindstudio-probe) and PyTorch's DebugMode.

    pip install -e ".[bench,test]"          # mindstudio-probe, transformers
    python benchmarks/bench_capture_peers.py [--repeats 5] [--models mlp,tinytf,mlp10m,llama]

A step is forward + loss + backward in float32 on the CPU, one thread. For every model, each
tool runs in its own subprocess (msprobe's debugger is a process singleton) that interleaves
plain steps with instrumented ones (median of ``--repeats`` pairs after two warm-up pairs), so
every ratio compares steps measured side by side in the same process:

- precisiondiff: ``with precisiondiff.capture(dir, model=..., level=L, mode=M): step()``, the
  session entered and closed inside the timed block (a real dump: writer thread, index, shards);
- msprobe: ``debugger.start(model); step(); debugger.stop(); debugger.step()`` with the matching
  task and level (L0 = module, L1 = API ~ op, mix = all); its default ``risk_level`` FOCUS leaves
  out low-risk APIs (views, casts, clone...), so it records fewer events than op level here;
- DebugMode: ``with DebugMode(record_nn_module=True), DebugMode.log_tensor_hashes(hash_inputs=True)``
  (every ATen op with an L1-norm hash of its inputs and outputs, and module boundaries);
- "pd mem": precisiondiff's capture into a ``MemorySink`` (no dump writer): what the writer costs;
- "pd steps": one precisiondiff session open across all the steps, ``session.step()`` after each
  captured one and the plain ones run ``session.suspended()``: the use that matches msprobe's
  (one debugger, hooks installed once); the "pd" column enters and closes a session per step.

Prints overhead = instrumented / plain - 1 per tool and the ratio of precisiondiff's overhead to
msprobe's at the matching level and mode (goal <= 0.2; "steps/ms" for the session across steps) and
to DebugMode's (goal < 1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --baseline: the worker imports precisiondiff from another checkout (before/after in one run)
sys.path.insert(0, os.environ.get("PD_BENCH_SOURCE", ROOT))
if os.environ.get("PD_BENCH_SOURCE"):
    sys.path.insert(1, ROOT)  # tests.zoo for the llama model
CLOCK = time.process_time if os.environ.get("PD_BENCH_CLOCK") == "cpu" else time.perf_counter

# (tool, level, mode): precisiondiff configurations and their msprobe counterparts
PD_CONFIGS = [("module", "stats"), ("op", "stats"), ("all", "stats"), ("op", "tensors")]
MSPROBE_LEVEL = {"module": "L0", "op": "L1", "all": "mix"}
MSPROBE_TASK = {"stats": "statistics", "tensors": "tensor"}


def build(name: str):
    """(model, step function) for a model name; float32, seeded."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    if name == "mlp":  # 43k parameters (msprobe peer study's "mlp")
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                              nn.Linear(128, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    elif name == "mlp10m":  # 9.4M parameters, batch 256 x 512
        model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(),
                              nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512),
                              nn.Linear(512, 10))
        x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
        loss = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    elif name == "tinytf":  # embedding + 2 encoder layers (64 wide, 4 heads), 8 x 32 tokens
        class TinyTF(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(100, 64)
                self.layers = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True,
                                                                       dropout=0.0) for _ in range(2))
                self.head = nn.Linear(64, 100)

            def forward(self, ids):
                h = self.emb(ids)
                for layer in self.layers:
                    h = layer(h)
                return self.head(h)
        model = TinyTF()
        ids = torch.randint(0, 100, (8, 32))
        loss = lambda: nn.functional.cross_entropy(model(ids).reshape(-1, 100), ids.reshape(-1))  # noqa: E731
    elif name == "llama":  # the zoo's Llama (tests/zoo): 2 layers, hidden 64
        from tests.zoo.models import build_llama
        workload = build_llama()
        model = workload.model
        out_loss = workload.loss
        inputs = workload.inputs
        loss = lambda: out_loss(model(**inputs))  # noqa: E731
    else:
        raise SystemExit(f"unknown model {name}")

    def step():
        loss().backward()
        model.zero_grad(set_to_none=True)
    return model, step


def _pairs(step, instrumented, repeats: int, plain_step=None):
    plain, inst = [], []
    for rep in range(repeats + 2):
        t0 = CLOCK()
        (plain_step or step)()
        t1 = CLOCK()
        instrumented(rep)
        t2 = CLOCK()
        if rep >= 2:
            plain.append(t1 - t0)
            inst.append(t2 - t1)
    return statistics.median(plain), statistics.median(inst)


def worker(model_name: str, tool: str, level: str, mode: str, repeats: int) -> dict:
    import torch
    torch.set_num_threads(1)
    model, step = build(model_name)
    tmp = tempfile.mkdtemp(prefix="pdbench-")
    plain_step, session = None, None
    if tool == "pd-steps":
        import precisiondiff
        # one session across the steps, as msprobe's debugger is used: a plain step runs with the
        # session suspended (its hooks installed, nothing recorded), as msprobe's run after stop()
        session = precisiondiff.capture(os.path.join(tmp, "pd"), model=model, level=level, mode=mode,
                                        overwrite=True).__enter__()

        def plain_step():
            with session.suspended():
                step()

        def inst(rep):
            step()
            session.step()
    elif tool in ("precisiondiff", "pd-memory"):
        import precisiondiff

        def inst(rep):
            # pd-memory: the same capture into a MemorySink, i.e. without the dump writer
            sink = precisiondiff.capture.MemorySink() if tool == "pd-memory" else None
            with precisiondiff.capture(os.path.join(tmp, "pd"), model=model, level=level, mode=mode,
                                       overwrite=True, sink=sink):
                step()
    elif tool == "debugmode":
        from torch.utils._debug_mode import DebugMode

        def inst(rep):
            with DebugMode(record_nn_module=True), DebugMode.log_tensor_hashes(hash_inputs=True):
                step()
    elif tool == "msprobe":
        from msprobe.pytorch import PrecisionDebugger
        task = MSPROBE_TASK[mode]
        config = {"task": task, "dump_path": os.path.join(tmp, "ms"), "rank": [], "step": [],
                  "level": MSPROBE_LEVEL[level],
                  task: {"scope": [], "list": [], "data_mode": ["all"]}}
        if task == "statistics":
            config[task]["summary_mode"] = "statistics"
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as fh:
            json.dump(config, fh)
        debugger = PrecisionDebugger(config_path=path)

        def inst(rep):
            debugger.start(model)
            step()
            debugger.stop()
            debugger.step()
    else:
        raise SystemExit(f"unknown tool {tool}")
    p, c = _pairs(step, inst, repeats, plain_step)
    if session is not None:
        session.__exit__(None, None, None)
    return {"model": model_name, "tool": tool, "level": level, "mode": mode, "plain_ms": p * 1e3,
            "inst_ms": c * 1e3, "overhead": c / p - 1}


def _run_worker(args, model: str, tool: str, level: str, mode: str, source: "str | None" = None) -> "dict | None":
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, tool, level, mode,
           "--repeats", str(args.repeats)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PD_BENCH_CLOCK=args.clock,
               PYTHONPATH=(source or ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if source:
        env["PD_BENCH_SOURCE"] = source
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"  {model} {tool} {level}/{mode} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="mlp,tinytf,mlp10m,llama")
    parser.add_argument("--no-msprobe", action="store_true")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--baseline", metavar="DIR", help="also run precisiondiff from this checkout "
                        "(e.g. `git worktree add /tmp/before main`): column 'pd before'")
    parser.add_argument("--configs", default=None, help="level/mode list, e.g. module/stats,op/stats")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: process CPU time, all threads (steadier when other jobs share the cores)")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "TOOL", "LEVEL", "MODE"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, repeats=args.repeats)), flush=True)
        return
    import torch
    print(f"torch {torch.__version__}, one thread, CPU float32; overhead = instrumented / plain - 1 "
          f"(median of {args.repeats} interleaved pairs); clock {args.clock}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'model':<7} {'level/mode':<14} {'plain ms':>9} {'pd':>7} {'pd mem':>7} {'pd steps':>9} {'msprobe':>8} "
          f"{'DebugMode':>10} {'pd/msprobe':>11} {'steps/ms':>9} {'pd/DebugMode':>13}"
          + (f" {'pd before':>10}" if args.baseline else ""))
    configs = PD_CONFIGS if not args.configs else [tuple(c.split("/")) for c in args.configs.split(",")]
    for model in args.models.split(","):
        dm = _run_worker(args, model, "debugmode", "op", "stats")
        for level, mode in configs:
            if model == "mlp10m" and mode == "tensors":
                continue  # ~0.5 GB of dump per step: disk-bound, not measured here
            pd = _run_worker(args, model, "precisiondiff", level, mode)
            mem = _run_worker(args, model, "pd-memory", level, mode)
            steps = _run_worker(args, model, "pd-steps", level, mode)
            ms = None if args.no_msprobe else _run_worker(args, model, "msprobe", level, mode)
            f = lambda r: f"{r['overhead']:.2f}" if r else "-"  # noqa: E731
            ratio = lambda a, b: f"{a['overhead'] / b['overhead']:.2f}" if a and b and b["overhead"] > 0 else "-"  # noqa: E731
            dmc = dm if level == "op" and mode == "stats" else None
            before = _run_worker(args, model, "precisiondiff", level, mode, args.baseline) if args.baseline else None
            print(f"{model:<7} {level + '/' + mode:<14} {pd['plain_ms'] if pd else float('nan'):9.2f} "
                  f"{f(pd):>7} {f(mem):>7} {f(steps):>9} {f(ms):>8} {f(dmc):>10} {ratio(pd, ms):>11} "
                  f"{ratio(steps, ms):>9} {ratio(pd, dmc):>13}"
                  + (f" {f(before):>10}" if args.baseline else ""), flush=True)


if __name__ == "__main__":
    main()
