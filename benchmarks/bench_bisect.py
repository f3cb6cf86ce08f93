"""Bisect cost in steps of the workload's own step, on the planted cases and the 12-block transformer.

A *step* is what the workload itself runs once: its forward (forward-only workloads) or its
forward + backward (workloads with a loss; counted as 3 forward-equivalents). Each case runs in
its own subprocess, which also reports the peak host memory (``ru_maxrss``) of the bisect
against the process after one plain step (the model's own footprint) and the wall time against
one plain step. Prints one row per case, then the geometric mean and the maximum of the steps.

    PYTHONPATH=. python benchmarks/bench_bisect.py [CASE ...] [--json]

``--case NAME`` runs one case in this process and prints its JSON (what the driver calls).
Run it with another checkout first on PYTHONPATH to measure that checkout side by side (the
steps of an older checkout are its ``forward_equivalents`` divided by 3 for a forward+backward
workload).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANTED = os.path.join(ROOT, "tests", "bisect", "planted.py")
EXAMPLE = os.path.join(ROOT, "examples", "tiny_transformer.py")

#: name -> (workload spec, bisect keyword arguments); forward-only and forward+backward cases
CASES = {
    "softmax (fwd)": (f"{PLANTED}:softmax_workload", {}),
    "amplify (fwd)": (f"{PLANTED}:amplify_workload", {}),
    "vendor (fwd)": (f"{PLANTED}:vendor_workload", {}),
    "rms_norm bug (fwd dir)": (f"{EXAMPLE}:build_with_bug", {"direction": "forward"}),
    "bad backward (f+b)": (f"{PLANTED}:bad_backward_workload", {}),
    "mlp control (f+b)": (f"{PLANTED}:mlp_workload", {}),
    "ill-conditioned (f+b)": (f"{PLANTED}:ill_conditioned_workload", {}),
    "rms_norm bug (f+b)": (f"{EXAMPLE}:build_with_bug", {}),
    "12 blocks (f+b)": (f"{EXAMPLE}:build_12_layers", {}),
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def run_case(name: str) -> dict:
    """Bisect one case here: verdict, cost, peak memory and wall time against one plain step."""
    import torch
    from precisiondiff.bisect import bisect
    from precisiondiff.runtime.targets import Target
    from precisiondiff.runtime.workload import load_workload, run_workload
    spec, kwargs = CASES[name]
    dut = Target.parse("cpu/bf16")
    wl = load_workload(spec, seed=0)
    model = dut.prepare_model(wl.model)
    model.train(wl.train)
    inputs = dut.prepare_inputs(wl.inputs)
    with torch.random.fork_rng(devices=[]):
        run_workload(wl, dut, model=model, inputs=inputs)  # warm-up
        start = time.perf_counter()
        run_workload(wl, dut, model=model, inputs=inputs)
        step_s = time.perf_counter() - start
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    del model, inputs
    base_rss = _rss_mib()
    start = time.perf_counter()
    r = bisect(spec, target="cpu/bf16", seed=0, **kwargs)
    wall = time.perf_counter() - start
    c = r.cost
    per_step = 3.0 if wl.loss is not None else 1.0
    steps = c.get("steps", round(c["forward_equivalents"] / per_step, 2))
    culprit = r.culprit
    return {"case": name, "verdict": r.verdict,
            "culprit": f"{culprit['name']} in {culprit['scope'] or '<root>'} ({culprit['direction']})" if culprit else "-",
            "backward": wl.loss is not None, "forward_equivalents": c["forward_equivalents"], "steps": steps,
            "breakdown": c.get("breakdown"), "ops_replayed": c.get("ops_replayed"), "ops_reused": c.get("ops_reused"),
            "ops_per_forward": c.get("ops_per_forward"), "dut_runs": c.get("dut_runs"), "ref_runs": c.get("ref_runs"),
            "wall_s": round(wall, 3), "step_s": round(step_s, 5), "wall_over_step": round(wall / step_s, 1),
            "model_mib": round(model_bytes / 2 ** 20, 3), "base_rss_mib": round(base_rss, 1),
            "peak_rss_mib": round(_rss_mib(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--case", help="run one case in this process (JSON out)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    rows = []
    for name in args.cases:
        env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ROOT))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", name], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"case": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    done = [r for r in rows if "steps" in r]
    gmean = math.exp(sum(math.log(r["steps"]) for r in done) / len(done)) if done else float("nan")
    worst = max((r["steps"] for r in done), default=float("nan"))
    if args.json:
        print(json.dumps({"cases": rows, "geometric_mean_steps": round(gmean, 2), "max_steps": worst}, indent=1))
        return
    print(f"{'case':<24} {'verdict':<11} {'steps':>6} {'fwd-eq':>7} {'wall/step':>9} {'peak MiB':>8} "
          f"{'+MiB':>6} {'model MiB':>9}  culprit")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<24} ERROR {r['error']}")
            continue
        print(f"{r['case']:<24} {r['verdict']:<11} {r['steps']:>6} {r['forward_equivalents']:>7} "
              f"{r['wall_over_step']:>9} {r['peak_rss_mib']:>8} {r['peak_rss_mib'] - r['base_rss_mib']:>6.1f} "
              f"{r['model_mib']:>9}  {r['culprit']}")
    print(f"geometric mean {gmean:.2f} steps, max {worst} (goal: <= 2.5, none above 3)")
    for r in done:
        if r.get("breakdown"):
            print(f"  {r['case']}: " + ", ".join(f"{k} {v}" for k, v in r["breakdown"].items() if v)
                  + (f"; {r['ops_reused']} emulated ops reused, not run" if r.get("ops_reused") else ""))


if __name__ == "__main__":
    main()
