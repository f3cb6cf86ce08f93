"""Watch overhead: a watched training step ÷ a plain one, measured side by side in one run.

    python benchmarks/bench_watch.py [--dim 768 --layers 12 --vocab 8192] [--batch 4 --seq 128]
                                     [--rounds 8] [--device cpu] [--control] [--json OUT.json]

Five copies of one decoder (examples/tiny_transformer.py, ~98M parameters at the defaults),
each with its own AdamW, train on the same batch: a plain one; one under ``precisiondiff.watch``
at the default level on its light steps (the layers' statistics, weight and gradient norms; its
only full step is the warm-up step); one at the default level whose every step is a full one
(``param_every=1``: optimizer state norms and update ratios too); and the same two with every
module's statistics (``level="all"``). A step is forward + loss + backward + ``optimizer.step()``
+ ``w.step()``.

The steps are interleaved: each round runs one step of every copy, in an order rotated from
round to round (no copy always follows the same one), so machine noise hits them alike. Per
round and configuration, two ratios to the plain step of the same round:

- **side by side**: the watched step's process CPU time (``time.process_time``, every thread;
  other jobs on a shared machine disturb it far less than wall time, printed too) over the plain
  step's;
- **watch's own**: the CPU time spent inside watch (every hook and ``w.step()`` timed from
  inside, nested calls once) over the plain step's: far less noisy than a ratio of two noisy
  steps, and split by where it goes (forward hooks, gradient hooks, optimizer pre-hook: gradient
  norms and the weight copy; post-hook: weight norms, update ratios, state norms; ``w.step()``:
  stacking, read-back, the log line).

``--control`` adds a second unwatched copy: its side-by-side ratio is the benchmark's own bias
(99.6-100.3% on the runs of docs/performance.md, "Watch").

Each figure is the median over the rounds (after one warm-up round) with its spread (min-max).
"amortized" weighs light and full steps 9:1, as a run at the default ``--param-every 10`` sees them.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import precisiondiff  # noqa: E402
from tiny_transformer import TinyTransformer  # noqa: E402

# where watch's own time goes: the method timed, and the part it is counted in (the outermost
# timed call wins: a gradient's statistics inside the gradient hook count as "grad hooks")
PARTS = {"_fwd_post": "forward hooks", "_add": "grad hooks", "_optimizer_pre": "optimizer pre",
         "_optimizer_post": "optimizer post", "step": "step end"}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _meter(w) -> dict:
    """Time watch's own work: its hooks and ``step`` wrapped on the instance (before it is entered,
    so the hooks it installs are the wrapped ones); nested calls are counted once, in the part of
    the outermost call."""
    spent = {part: 0.0 for part in PARTS.values()}
    depth = [0]
    for name, part in PARTS.items():
        def wrapped(*args, _fn=getattr(w, name), _part=part, **kwargs):
            if depth[0]:
                return _fn(*args, **kwargs)
            depth[0] += 1
            c0 = time.process_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_part] += time.process_time() - c0
                depth[0] -= 1
        setattr(w, name, wrapped)
    return spent


def _summary(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _load() -> str:
    try:
        return "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (after one warm-up round)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", default="default,default_full,all,all_full",
                        help="watched configurations beside the plain one")
    parser.add_argument("--control", action="store_true",
                        help="add a second unwatched copy (an A/A control: the side-by-side ratio it gets is the "
                             "benchmark's own bias)")
    parser.add_argument("--json", default=None, help="also write every per-round figure to this file")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = TinyTransformer(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers).to(device, dtype)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    known = {"default": {"param_every": 10 ** 9}, "default_full": {"param_every": 1},
             "all": {"level": "all", "param_every": 10 ** 9}, "all_full": {"level": "all", "param_every": 1}}
    configs = {"plain": None, **({"control": None} if args.control else {}),
               **{name: known[name] for name in args.configs.split(",")}}
    runs = {}
    for name in configs:
        model = copy.deepcopy(base).train()
        runs[name] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4),
                      "cpu": [], "wall": [], "own": [], "parts": []}
    n_params = sum(p.numel() for p in base.parameters())
    del base
    print(f"decoder {n_params / 1e6:.1f}M parameters ({args.layers} layers, dim {args.dim}, vocab {args.vocab}), "
          f"batch {args.batch}x{args.seq} tokens, {args.dtype} on {device}, AdamW; {torch.get_num_threads()} threads; "
          f"{os.cpu_count()} CPUs; start: {_load()}", flush=True)

    def step(run, w) -> None:
        model, opt = run["model"], run["opt"]
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), tokens.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if w is not None:
            w.step(loss=loss)
        _sync(device)

    names = list(runs)
    loads = [_load()]
    with tempfile.TemporaryDirectory() as tmp:
        watches, meters = {}, {}
        for name, run in runs.items():
            if configs[name] is not None:
                w = precisiondiff.watch(os.path.join(tmp, name), model=run["model"], optimizer=run["opt"], **configs[name])
                meters[name] = _meter(w)
                watches[name] = w.__enter__()
        try:
            for i in range(args.rounds + 1):
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    run = runs[name]
                    parts0 = dict(meters.get(name, {}))
                    t0, c0 = time.perf_counter(), time.process_time()
                    step(run, watches.get(name))
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                    if i:
                        parts = {p: meters[name][p] - parts0[p] for p in parts0}
                        run["cpu"].append(cpu)
                        run["wall"].append(wall)
                        run["parts"].append(parts)
                        run["own"].append(sum(parts.values()))
                loads.append(_load())
                print(f"  round {i}{' (warm-up)' if not i else ''}: " + ", ".join(
                    f"{n} {runs[n]['cpu'][-1]:.2f}" for n in names if i) + f" cpu-s; {loads[-1]}",
                    file=sys.stderr, flush=True)
        finally:
            for w in watches.values():
                w.close()
        sizes = {name: os.path.getsize(os.path.join(tmp, name, "watch.jsonl")) for name in watches}
    plain = runs["plain"]
    rows = {}
    if args.control:  # no watch: the ratio a watched copy would get from the benchmark alone
        c = runs["control"]
        rows["control"] = {"side_by_side": [a / b for a, b in zip(c["cpu"], plain["cpu"])],
                           "side_by_side_wall": [a / b for a, b in zip(c["wall"], plain["wall"])],
                           "own": [0.0 for _ in c["cpu"]]}
    for name in watches:
        r = runs[name]
        rows[name] = {
            "side_by_side": [c / p for c, p in zip(r["cpu"], plain["cpu"])],
            "side_by_side_wall": [c / p for c, p in zip(r["wall"], plain["wall"])],
            "own": [o / p for o, p in zip(r["own"], plain["cpu"])],
            "parts": {part: [x[part] / p for x, p in zip(r["parts"], plain["cpu"])] for part in PARTS.values()},
        }
    for amortized, light, full in (("default_amortized", "default", "default_full"), ("all_amortized", "all", "all_full")):
        if light in rows and full in rows:
            rows[amortized] = {k: [(9 * a + b) / 10 for a, b in zip(rows[light][k], rows[full][k])]
                               for k in ("side_by_side", "side_by_side_wall", "own")}
    labels = {"control": "control: a second unwatched copy", "default": "default, light step", "default_full": "default, full step (state, updates)",
              "all": "all modules, light step", "all_full": "all modules, full step (everything every step)",
              "default_amortized": "default, amortized (9 light : 1 full)",
              "all_amortized": "all modules, amortized (9 light : 1 full)"}
    print(f"plain step: cpu {_fmt_s(plain['cpu'])}, wall {_fmt_s(plain['wall'])}")
    print(f"{'configuration':<48} {'own/plain: median [min-max]':>30} {'side by side cpu':>26} {'wall':>22}")
    for name, row in rows.items():
        print(f"{labels[name]:<48} {_fmt_r(row['own']):>30} {_fmt_r(row['side_by_side']):>26} "
              f"{_fmt_r(row['side_by_side_wall']):>22}")
    print("watch's own time by part (median share of a plain step):")
    for name, row in rows.items():
        if "parts" in row:
            print(f"  {labels[name]:<46} " + ", ".join(f"{part} {100 * statistics.median(v):.2f}%"
                                                      for part, v in row["parts"].items()))
    print("log bytes per step: " + ", ".join(f"{k} {v // (args.rounds + 1)}" for k, v in sizes.items()))
    print("load: " + "; ".join(loads[::max(1, len(loads) // 4)] + [loads[-1]]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "params": n_params, "plain_cpu": plain["cpu"], "plain_wall": plain["wall"],
                       "rows": rows, "loads": loads, "log_bytes": sizes}, fh, indent=1)


def _fmt_r(values: list) -> str:
    s = _summary(values)
    return f"{100 * s['median']:.2f}% [{100 * s['min']:.2f}-{100 * s['max']:.2f}]"


def _fmt_s(values: list) -> str:
    s = _summary(values)
    return f"{s['median']:.2f} s [{s['min']:.2f}-{s['max']:.2f}]"


if __name__ == "__main__":
    main()
