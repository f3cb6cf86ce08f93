"""Watch overhead: a watched training step ÷ a plain one, measured side by side in one run.

    python benchmarks/bench_watch.py [--dim 768 --layers 12 --vocab 8192] [--batch 4 --seq 128]
                                     [--steps 10] [--device cpu]

Five copies of one decoder (examples/tiny_transformer.py, ~98M parameters at the defaults),
each with its own AdamW, train in lockstep on the same batch: a plain one; one under
``precisiondiff.watch`` at the default level on its light steps (the layers' statistics, weight
and gradient norms; its only full step is the warm-up step); one at the default level whose
every step is a full one (``param_every=1``: optimizer state norms and update ratios too); and
the same two with every module's statistics (``level="all"``). Their steps are interleaved, so
machine noise hits all five; a step is forward + loss + backward + ``optimizer.step()`` +
``w.step()``.

Time is the process's CPU time (``time.process_time``, every thread), which other jobs on a
shared machine disturb far less than wall time (wall time is printed too). Two figures per
configuration, after one warm-up step: the side-by-side ratio (median watched step over median
plain step), and watch's own CPU time (every watch hook and ``w.step()`` timed from inside)
over the plain step, which is far less noisy than a difference of two noisy steps.
"default, amortized" weighs the light and full steps 9:1, as a run at ``--param-every 10`` sees them.
"""
from __future__ import annotations

import argparse
import copy
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


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _meter(w) -> dict:
    """Time watch's own work: its hooks and ``step`` wrapped on the instance (before it is entered,
    so the hooks it installs are the wrapped ones); nested calls are counted once."""
    spent = {"cpu": 0.0}
    depth = [0]
    for name in ("_fwd_post", "_add", "_optimizer_pre", "_optimizer_post", "step"):
        def wrapped(*args, _fn=getattr(w, name), **kwargs):
            if depth[0]:
                return _fn(*args, **kwargs)
            depth[0] += 1
            c0 = time.process_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent["cpu"] += time.process_time() - c0
                depth[0] -= 1
        setattr(w, name, wrapped)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = TinyTransformer(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers).to(device, dtype)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    configs = {"plain": None, "default": {"param_every": 10 ** 9}, "default_full": {"param_every": 1},
               "all": {"level": "all", "param_every": 10 ** 9}, "all_full": {"level": "all", "param_every": 1}}
    runs = {}
    for name in configs:
        model = copy.deepcopy(base).train()
        runs[name] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-4), "cpu": [],
                      "wall": [], "own": []}
    n_params = sum(p.numel() for p in base.parameters())
    del base
    print(f"decoder {n_params / 1e6:.1f}M parameters ({args.layers} layers, dim {args.dim}, vocab {args.vocab}), "
          f"batch {args.batch}x{args.seq} tokens, {args.dtype} on {device}, AdamW; {torch.get_num_threads()} threads")

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

    with tempfile.TemporaryDirectory() as tmp:
        watches, meters = {}, {}
        for name, run in runs.items():
            if configs[name] is not None:
                w = precisiondiff.watch(os.path.join(tmp, name), model=run["model"], optimizer=run["opt"], **configs[name])
                meters[name] = _meter(w)
                watches[name] = w.__enter__()
        try:
            for i in range(args.steps + 1):
                for name, run in runs.items():
                    own0 = meters[name]["cpu"] if name in meters else 0.0
                    t0, c0 = time.perf_counter(), time.process_time()
                    step(run, watches.get(name))
                    if i:
                        run["cpu"].append(time.process_time() - c0)
                        run["wall"].append(time.perf_counter() - t0)
                        run["own"].append((meters[name]["cpu"] if name in meters else 0.0) - own0)
                print(f"  round {i}: " + ", ".join(f"{n} {(r['cpu'] or [0])[-1]:.2f} cpu-s"
                                                  for n, r in runs.items()), file=sys.stderr, flush=True)
        finally:
            for w in watches.values():
                w.close()
        sizes = {name: os.path.getsize(os.path.join(tmp, name, "watch.jsonl")) for name in watches}
    med = {name: {k: statistics.median(r[k]) for k in ("cpu", "wall", "own")} for name, r in runs.items()}
    plain = med["plain"]
    print(f"{'configuration':<40} {'cpu s/step':>10} {'ratio':>7} {'wall s/step':>11} {'ratio':>7} "
          f"{'watch own cpu s':>15} {'own/plain':>9}")
    labels = {"plain": "plain", "default": "default, light step", "default_full": "default, full step (state, updates)",
              "all": "all modules, light step", "all_full": "all modules, full step (everything)",
              "amortized": "default, amortized (9 light : 1 full)",
              "all_amortized": "all modules, amortized (9 light : 1 full)"}
    rows = dict(med)
    rows["amortized"] = {k: (9 * med["default"][k] + med["default_full"][k]) / 10 for k in ("cpu", "wall", "own")}
    rows["all_amortized"] = {k: (9 * med["all"][k] + med["all_full"][k]) / 10 for k in ("cpu", "wall", "own")}
    for name, m in rows.items():
        print(f"{labels[name]:<40} {m['cpu']:>10.3f} {m['cpu'] / plain['cpu']:>7.3f} {m['wall']:>11.3f} "
              f"{m['wall'] / plain['wall']:>7.3f} {m['own']:>15.4f} {m['own'] / plain['cpu']:>9.4f}")
    print("log bytes per step: " + ", ".join(f"{k} {v // (args.steps + 1)}" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
