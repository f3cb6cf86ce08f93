"""Bisect at scale: a Llama-style decoder from a config (random weights, nothing downloaded), one
training step at sequence length 256, bf16 DUT against float64, with a planted bf16-accumulating
GEMM in one late layer's MLP down projection (docs/performance.md, "Scale").

    python benchmarks/bench_scale.py --size 10m|100m|1.1b|1.1b-22 [--workers 1,2] [--keep DIR] [--dump DUMP]

Each phase runs in its own process, measured with ``/usr/bin/time -v`` (peak RSS):

1. capture: ``precisiondiff capture ... --mode replay`` of one step into a dump;
2. bisect: ``precisiondiff bisect DUMP --workload ... --format json`` with 1 worker, then with each
   ``--workers`` count: the verdict, the culprit, ``cost`` (steps, phase breakdown), the replay phase's
   time (``cost.search_s``) and the peak RSS of the bisect process and of its workers.

The module is also the workload: ``benchmarks/bench_scale.py:build_10m`` (``build_100m``,
``build_1_1b``, ``build_1_1b_22``); ``PD_SCALE_SEQ`` overrides the sequence length. ``--dump DIR`` bisects an existing capture.

Measured 2026-12-02 (2 shared cores, load 1-8; ``--seq 64 --direction forward``; docs/performance.md, "Scale"):

    size (params)   capture wall / RSS / dump    bisect RSS 1 w | 2 w (search / worker)   steps   replay phase 1 w -> 2 w
    10m  (9.6 M)    97 s / 0.91 / 0.13 GiB       1.42 | 1.33 / 0.71 GiB                 1.52    1.8 -> 6.8 s (worker start-up)
    100m (100 M)    31 s / 2.55 / 1.17 GiB       8.53 (reference run) | 8.05 / 1.05     1.54    112 s (1 w)
                                                 1.50 GiB with --max-replay-bytes 128M  0.54
    1.1b (853 M)    515 s / 11.2 / 11.7 GiB      5.82 | 3.97 / 3.05 GiB                 0.53    502 -> 300 s = 0.60x
                                                                                                (run 1: 347 -> 217 s = 0.62x)

Every bisect named the planted kernel; 1 and 2 workers gave identical results (all but ``cost``).

The issue's case as written (2026-12-03, AMD AVX2, 2 cores, idle; ``--size 1.1b --seq 256``, full step):

    capture 3864 s (one core shared) / 12.30 GiB / dump 14.16 GiB; bisect 1.11 steps, kernel in
    model.layers.14.mlp.down_proj; peak RSS 11.12 GiB (1 worker), 9.96 GiB (2 workers);
    replay phase 323.6 s -> 302.5 s = 0.93x with 2 workers

With the peer rule measuring large outputs a block at a time (2026-12-04, same machine, quiet):

    1.1b     capture 151.5 s / 10.33 GiB / 14.16 GiB; bisect 1.1 steps, kernel in layers.14; peak RSS
             4.69 GiB (1 worker; 11.84 GiB before), 3.76 GiB (2 workers); replay phase 212.6 -> 195.9 s = 0.92x
    1.1b-22  capture 122.3 s / 13.86 GiB / 18.81 GiB; bisect 1.11 steps, kernel in layers.20; peak RSS
             5.46-5.54 GiB (1 worker), 4.77 GiB (2 workers); replay phase 238.8 -> 242.1 s = 1.01x

With capture's host copies returned when freed and the observer check's copy freed first: capture peak RSS
1.1b 8.23 GiB (was 10.33), 1.1b-22 10.57 GiB (was 13.86-15.04).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

SIZES: Dict[str, dict] = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "10m": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=688, vocab_size=8000),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=16000),
    "1.1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000),
    # the same blocks, 22 of them (TinyLlama's depth): 1.12 B parameters
    "1.1b-22": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=5632, vocab_size=32000),
}
PLANT_LAYER_FROM_END = 2  # the plant sits in layers[L - 2]: a late layer
CHUNK = 64  # the planted kernel rounds its running sum to bf16 every CHUNK products


@torch.library.custom_op("pdscale::acc_linear", mutates_args=())
def acc_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``; its bf16 path keeps the running sum over the reduction in bf16 (a planted
    bf16 accumulator: one rounding per CHUNK products), other dtypes are exact GEMMs."""
    if x.dtype != torch.bfloat16:
        return F.linear(x, w)
    acc = None
    for k in range(0, x.shape[-1], CHUNK):
        part = F.linear(x[..., k:k + CHUNK].float(), w[:, k:k + CHUNK].float())
        acc = part.to(torch.bfloat16) if acc is None else (acc.float() + part).to(torch.bfloat16)
    return acc


@acc_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _acc_linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


def _acc_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


acc_linear.register_autograd(_acc_linear_backward, setup_context=_acc_linear_setup)


class PlantedLinear(torch.nn.Module):
    """A bias-free Linear whose forward is the planted kernel (same parameter name ``weight``)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return acc_linear(x, self.weight)


def build(size: str, seq: int = 0, plant: bool = True):
    """The workload of ``size``: a LlamaForCausalLM in bf16 (built in bf16 so that no float32 copy
    is ever held), batch 1 x ``seq`` tokens, cross-entropy in float32."""
    import precisiondiff
    from transformers import LlamaConfig, LlamaForCausalLM
    seq = seq or int(os.environ.get("PD_SCALE_SEQ", "256"))
    config = LlamaConfig(max_position_embeddings=max(seq, 512), tie_word_embeddings=False, **SIZES[size])
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if plant:
        mlp = model.model.layers[config.num_hidden_layers - PLANT_LAYER_FROM_END].mlp
        mlp.down_proj = PlantedLinear(mlp.down_proj)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    labels = torch.randint(0, config.vocab_size, (1, seq))

    def loss(out):
        return F.cross_entropy(out.logits.float().reshape(-1, config.vocab_size), labels.reshape(-1))
    return precisiondiff.Workload(model, {"input_ids": ids}, loss=loss)


def build_10m():
    """The 10 M-parameter case."""
    return build("10m")


def build_100m():
    """The ~100 M-parameter case."""
    return build("100m")


def build_1_1b():
    """The "1.1 B" case of issue 22: its configuration (16 layers x 2048) has 853 M parameters."""
    return build("1.1b")


def build_1_1b_22():
    """The "1.1b" configuration with 22 layers: 1.12 B parameters."""
    return build("1.1b-22")


BUILDERS = {"10m": "build_10m", "100m": "build_100m", "1.1b": "build_1_1b", "1.1b-22": "build_1_1b_22"}


def params_of(size: str) -> int:
    """Parameters of ``size`` (meta device: nothing allocated)."""
    with torch.device("meta"):
        wl = build(size, seq=8)
    return sum(p.numel() for p in wl.model.parameters())


def _timed(cmd: List[str], env: Dict[str, str]) -> dict:
    """Run ``cmd``: wall seconds, peak RSS (bytes), CPU time, exit code, output.

    The resource figures are the kernel's for the child and the descendants it waited for (wait4,
    as ``/usr/bin/time -v`` reads them; no such binary needed): the peak is the largest single
    process's, the CPU time the sum over the process and its workers."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    # CPU time of the process and its workers: how many cores the phase kept busy on average (the
    # bound on what more workers can gain on this host), and the kernel's share of it
    return {"wall_s": round(wall, 1), "peak_rss": usage.ru_maxrss * 1024, "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, "rc": proc.returncode, "stdout": stdout, "stderr": stderr}


def _cpu(run: dict) -> str:
    if run.get("user_s") is None or run.get("system_s") is None:
        return ""
    busy = run["user_s"] + run["system_s"]
    return (f"; CPU {run['user_s']:.1f} s user + {run['system_s']:.1f} s system = "
            f"{busy / max(run['wall_s'], 1e-9):.2f} cores busy on average")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def replay_memory(size: str, dump: str, scope: str) -> dict:
    """Peak RSS of one float64 forward+backward golden replay of module ``scope`` ("" the root: what
    replaying the model whole costs; a block: what block-wise replay costs), in this process."""
    import resource
    from precisiondiff.bisect.isolate import GoldenMode, replay_module_step
    from precisiondiff.bisect.offline import events_from_dump
    from precisiondiff.store import load
    wl = build(size)
    events = events_from_dump(load(dump))
    fwd = next(e for e in events if e.kind == "module" and e.scope == scope and e.direction == "forward")
    bwd = next(e for e in events if e.kind == "module" and e.scope == scope and e.direction == "backward")
    template = wl.model.get_submodule(scope) if scope else wl.model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    replay_module_step(template, fwd, bwd, device="cpu", dtype=torch.float64, mode=GoldenMode())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"scope": scope or "<root>", "rss_before": before, "peak_rss": peak, "s": round(time.perf_counter() - start, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="10m")
    ap.add_argument("--workers", default="2",
                    help="worker counts to bisect with besides 1, e.g. 2 or 2,4; a count with an m (2m) also puts "
                         "the module phase on the workers (--modules-on-workers)")
    ap.add_argument("--keep", default=None, help="keep the dump and the results in this directory")
    ap.add_argument("--max-replay-bytes", default=None,
                    help="bisect --max-replay-bytes (default: bisect's own)")
    ap.add_argument("--modules-on-workers", action="store_true",
                    help="bisect --modules-on-workers with the worker counts above 1")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (the issue's case: 256)")
    ap.add_argument("--direction", choices=["forward", "backward"], default=None,
                    help="bisect --direction (default: both, the issue's case)")
    ap.add_argument("--dump", default=None,
                    help="bisect this existing dump of the same size and --seq (capture not rerun)")
    ap.add_argument("--replay-memory", nargs=2, metavar=("DUMP", "SCOPE"), default=None,
                    help="only measure one float64 golden replay of module SCOPE ('' the root) from DUMP")
    args = ap.parse_args(argv)
    if args.replay_memory:
        got = replay_memory(args.size, *args.replay_memory)
        print(f"{args.size}: float64 replay of {got['scope']}: RSS {_gib(got['rss_before'])} before, peak "
              f"{_gib(got['peak_rss'])} ({_gib(got['peak_rss'] - got['rss_before'])} more), {got['s']} s")
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    spec = f"{os.path.join(here, 'bench_scale.py')}:{BUILDERS[args.size]}"
    root = args.keep or tempfile.mkdtemp(prefix="pd-scale-")
    os.makedirs(root, exist_ok=True)
    dump = args.dump or os.path.join(root, "dump")
    if not args.dump:
        shutil.rmtree(dump, ignore_errors=True)
    env = dict(os.environ, PD_SCALE_SEQ=str(args.seq),
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "precisiondiff.cli"]
    n_params = params_of(args.size)
    print(f"model {args.size}: {n_params / 1e6:.1f} M parameters, {SIZES[args.size]}, sequence {args.seq}; bf16 "
          f"{_gib(2 * n_params)}, float64 {_gib(8 * n_params)}; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs")
    if args.dump:
        print(f"capture: not rerun, dump {dump} ({_gib(_dir_bytes(dump))})")
    else:
        cap = _timed(cli + ["capture", spec, "--target", "cpu/bf16", "--mode", "replay", "-o", dump], env)
        if cap["rc"] != 0:
            print(cap["stderr"][-3000:])
            return 1
        print(f"capture: {cap['wall_s']} s, peak RSS {_gib(cap['peak_rss'])}, dump {_gib(_dir_bytes(dump))}{_cpu(cap)}")
    rows = []
    try:
        counts = [(1, False)] + [(int(w.strip().rstrip("m")), w.strip().endswith("m") or args.modules_on_workers)
                                 for w in args.workers.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--workers {args.workers}: worker counts such as 2,4 or 2m")
    counts = [counts[0]] + [(n, m) for n, m in counts[1:] if n > 1]
    extra = (["--max-replay-bytes", args.max_replay_bytes] if args.max_replay_bytes else []) + \
        (["--direction", args.direction] if args.direction else [])
    for n, modules in counts:
        label = f"{n}{'m' if modules else ''}"
        out = os.path.join(root, f"bisect-w{label}.json")
        run = _timed(cli + ["bisect", dump, "--workload", spec, "--format", "json", "-o", out, *extra]
                     + (["--workers", str(n)] if n > 1 else [])
                     + (["--modules-on-workers"] if modules else []), env)
        if run["rc"] not in (0, 1) or not os.path.exists(out):
            print(run["stderr"][-3000:])
            return 1
        with open(out, encoding="utf-8") as fh:
            res = json.load(fh)
        rows.append((label, run, res))
        c, cost = res.get("culprit") or {}, res["cost"]
        print(f"bisect, {n} worker(s){' (modules too)' if modules else ''}: {res['verdict']}, culprit {c.get('kind')} {c.get('name')} in "
              f"{c.get('scope')} ({c.get('direction')}); wall {run['wall_s']} s, replay phase "
              f"{cost.get('search_s')} s, peak RSS {_gib(run['peak_rss'])}{_cpu(run)}"
              + (f" (workers' peak {_gib(cost.get('workers', {}).get('peak_rss'))}, "
                 f"{cost.get('workers', {}).get('module_units', 0)} module units on the workers; the search's "
                 f"process waited {cost.get('workers', {}).get('waited_s')} s on them, the rest is its own work)"
                 if n > 1 else ""))
        print(f"  cost: {cost['steps']} steps ({cost['forward_equivalents']} forward-equivalents): "
              + ", ".join(f"{k} {v}" for k, v in cost["breakdown"].items()))
        if cost.get("block_wise"):
            print(f"  block-wise: {cost['block_wise']}")
    if len(rows) > 1:
        base = rows[0][2]
        for n, run, res in rows[1:]:
            same = json.dumps({k: v for k, v in res.items() if k != "cost"}, sort_keys=True) == \
                json.dumps({k: v for k, v in base.items() if k != "cost"}, sort_keys=True)
            ratio = res["cost"]["search_s"] / base["cost"]["search_s"] if base["cost"].get("search_s") else None
            print(f"{n} workers vs 1: replay phase {ratio:.2f}x; results (all but cost) "
                  f"{'identical' if same else 'DIFFER'}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
