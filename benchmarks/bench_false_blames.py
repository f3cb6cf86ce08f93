"""False blames on the model zoo: bisect every zoo model (tests/zoo, stock PyTorch kernels only)
on a bf16 target against float64 and count the verdicts that blame a kernel.

Every zoo model runs only PyTorch's own kernels, so a ``kernel`` verdict is a false blame unless
it is a documented, hand-verified stock finding (docs/bisect.md). Prints one row per model:
verdict, culprit, final error (relative L2), forward-equivalents and wall time, then the count.

    PYTHONPATH=. python benchmarks/bench_false_blames.py [MODEL ...] [--target cpu/bf16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from precisiondiff.bisect import bisect  # noqa: E402
from tests.zoo import ZOO  # noqa: E402


def run(names, target: str):
    rows = []
    for name in names:
        start = time.perf_counter()
        r = bisect(ZOO[name], target=target)
        c = r.culprit
        rows.append({"model": name, "verdict": r.verdict,
                     "culprit": f"{c['name']} in {c['scope'] or '<root>'} ({c['direction']})" if c else "-",
                     "final_error": r.final_error, "parity_bound": r.parity_bound,
                     "forward_equivalents": r.cost["forward_equivalents"],
                     "wall_s": round(time.perf_counter() - start, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=sorted(ZOO))
    parser.add_argument("--target", default="cpu/bf16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.models, args.target)
    blames = sum(r["verdict"] == "kernel" for r in rows)
    if args.json:
        print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "target": args.target,
                          "false_blames": blames, "models": rows}, indent=1))
        return
    print(f"target {args.target}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'model':<9} {'verdict':<12} {'final err':>9} {'bound':>7} {'fwd-eq':>7} {'wall s':>7}  culprit")
    for r in rows:
        print(f"{r['model']:<9} {r['verdict']:<12} {r['final_error']:>9.4f} {r['parity_bound']:>7.4f} "
              f"{r['forward_equivalents']:>7} {r['wall_s']:>7}  {r['culprit']}")
    print(f"false blames (verdict kernel on stock kernels): {blames} of {len(rows)}")


if __name__ == "__main__":
    main()
