"""False blames on the model zoo: bisect every zoo model (tests/zoo, stock PyTorch kernels only)
on a bf16 target against float64 and count the verdicts that blame a kernel.

Every zoo model runs only PyTorch's own kernels, so a ``kernel`` verdict is a false blame unless
it is a documented, hand-verified stock finding (docs/bisect.md). Bisect passes over the documented
findings of its DUT by default (listed in ``accepted``); ``--blame-known`` counts them as verdicts
again. Prints one row per model:
verdict, culprit, final error (relative L2; "-" for a kernel verdict not confirmed: the verdict
does not need the reference run, ``--confirm`` runs it), forward-equivalents, steps of the
workload and wall time, then the count.

    PYTHONPATH=. python benchmarks/bench_false_blames.py [MODEL ...] [--target cpu/bf16] [--json] [--confirm]
        [--blame-known] [--evidence FILE]
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


#: Stock kernels the peer rule names that were verified by hand against a float64 replay
#: (benchmarks/stock_findings.py; docs/bisect.md, "Findings on stock kernels"): a verdict naming
#: one of these is a finding, any other kernel verdict on the zoo is a false blame. The table is
#: the one bisect annotates its culprits from (``known: ...``).
from precisiondiff.bisect.findings import KNOWN_FINDINGS  # noqa: E402


def run(names, target: str, confirm: bool = False, blame_known: bool = False, evidence: str = None):
    rows = []
    for name in names:
        start = time.perf_counter()
        r = bisect(ZOO[name], target=target, confirm=confirm, blame_known=blame_known)
        if evidence:  # the whole result, each offender's figures included: to check a blame by hand
            os.makedirs(os.path.dirname(os.path.abspath(evidence)), exist_ok=True)
            with open(evidence, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"model": name, "target": target, "result": r.to_json()}, default=str) + "\n")
        c = r.culprit
        rows.append({"model": name, "verdict": r.verdict,
                     "finding": bool(c) and c["name"] in KNOWN_FINDINGS,
                     "culprit": f"{c['name']} in {c['scope'] or '<root>'} ({c['direction']})" if c else "-",
                     "why": c.get("message") if c else None,
                     "known_passed_over": sorted({a["name"] for a in r.accepted if a.get("known")}),
                     "final_error": r.final_error, "parity_bound": r.parity_bound,
                     "forward_equivalents": r.cost["forward_equivalents"], "steps": r.cost.get("steps"),
                     "wall_s": round(time.perf_counter() - start, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=sorted(ZOO))
    parser.add_argument("--target", default="cpu/bf16")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--confirm", action="store_true",
                        help="confirm kernel verdicts (reference run: their final error; substitution)")
    parser.add_argument("--evidence", metavar="FILE", default=None,
                        help="append each model's whole bisect result to FILE (JSON lines)")
    parser.add_argument("--blame-known", action="store_true",
                        help="judge the documented stock findings as offenders (bisect --blame-known)")
    args = parser.parse_args()
    rows = run(args.models, args.target, args.confirm, args.blame_known, args.evidence)
    blames = sum(r["verdict"] == "kernel" and not r["finding"] for r in rows)
    findings = sum(r["verdict"] == "kernel" and r["finding"] for r in rows)
    if args.json:
        print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "target": args.target,
                          "false_blames": blames, "stock_findings": findings, "models": rows}, indent=1))
        return
    print(f"target {args.target}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'model':<9} {'verdict':<12} {'final err':>9} {'bound':>7} {'fwd-eq':>7} {'steps':>6} {'wall s':>7}  culprit")
    for r in rows:
        final = "-" if r["final_error"] is None else f"{r['final_error']:.4f}"  # not measured: not confirmed
        print(f"{r['model']:<9} {r['verdict']:<12} {final:>9} {r['parity_bound']:>7.4f} "
              f"{r['forward_equivalents']:>7} {r['steps'] if r['steps'] is not None else '-':>6} {r['wall_s']:>7}  {r['culprit']}"
              + ("  [documented stock finding]" if r["finding"] else "")
              + (f"  [passed over: {', '.join(r['known_passed_over'])}]" if r["known_passed_over"] else ""))
        if r["why"]:
            print(f"{'':<9} {r['why']}")
    print(f"false blames (kernel verdicts not a documented stock finding): {blames} of {len(rows)}; "
          f"documented stock findings: {findings}")


if __name__ == "__main__":
    main()
