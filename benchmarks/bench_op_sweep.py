"""False alarms of the op verdict on PyTorch's own op database, bf16 on the CPU.

Every op of ``torch.testing._internal.common_methods_invocations.op_db`` that supports bfloat16 on
the CPU, up to ``--samples`` of its sample inputs each (drawn in float32; ``check_op`` casts them to
bf16), judged by ``precisiondiff.testing.parity.check_op(op, *sample, target="cpu/bf16")``. A blamed
op is then measured against float32 computed from the same bf16 inputs and rounded once: the blame
is a *finding* when the stock kernel's error is at least 2x that (rel-L2) or an element 4x worse
(in ULP of the element), else a *false alarm*. Prints the counts, the rate of false alarms over
the ops judged, and one line per blamed op.

    PYTHONPATH=. python benchmarks/bench_op_sweep.py [--ops NAME,...] [--samples 5] [--shard I/N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_plants import errors  # noqa: E402  (this directory is on sys.path when run as a script)
from precisiondiff.testing.parity import check_op  # noqa: E402

#: Ops left out: their output is uninitialised memory (``empty``, ``empty_like``, ...).
SKIPPED_PREFIXES = ("empty", "new_empty")


def _cast(value, dtype):
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, value)


def _outs(value):
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor) and v.is_floating_point()]


def confirm(fn, sample) -> dict:
    """Whether the stock bf16 kernel is beyond float32 rounded once (2x rel-L2 or 4x an element)."""
    args = (sample.input, *sample.args)
    low = _cast((args, sample.kwargs), torch.bfloat16)
    with torch.no_grad():
        dut = _outs(fn(*low[0], **low[1]))
        f32 = _outs(fn(*_cast(low[0], torch.float32), **_cast(low[1], torch.float32)))
        g64 = _outs(fn(*_cast(low[0], torch.float64), **_cast(low[1], torch.float64)))
    beyond, figures = False, []
    for d, f, g in zip(dut, f32, g64):
        if d.layout != torch.strided or d.shape != g.shape:
            continue
        rd, md = errors(d, g)
        rf, mf = errors(f.to(d.dtype), g)
        figures.append((rd, rf, md, mf))
        nan = int((torch.isnan(d) & ~torch.isnan(f.to(d.dtype))).sum())
        beyond |= rd >= 2 * rf and rd > 0 or md >= 4 * max(mf, 0.5) or nan > 0
    return {"finding": beyond, "figures": figures}


def _stub_expecttest() -> None:
    """torch.testing._internal imports expecttest (a test-only package) for its TestCase base;
    the op database does not need it, so a stand-in is installed when it is missing."""
    import importlib.util
    import types
    import unittest
    if importlib.util.find_spec("expecttest") is None:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub


def ops_to_run(names, shard):
    _stub_expecttest()
    from torch.testing._internal.common_methods_invocations import op_db
    found = []
    for op in op_db:
        try:
            ok = torch.bfloat16 in op.supported_dtypes("cpu")
        except Exception:  # noqa: BLE001 -- an OpInfo without CPU dtypes
            ok = False
        if op.name.startswith(SKIPPED_PREFIXES):
            continue
        if ok and (not names or op.name in names or f"{op.name}.{op.variant_test_name}" in names):
            found.append(op)
    i, n = shard
    return found[i::n]


def run(names, samples: int, shard) -> list:
    rows = []
    for op in ops_to_run(names, shard):
        label = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        start = time.perf_counter()
        row = {"op": label, "samples": 0, "blamed": 0, "errors": 0, "finding": None, "message": ""}
        try:
            gen = op.sample_inputs("cpu", torch.float32, requires_grad=False)
            for i, sample in enumerate(gen):
                if i >= samples:
                    break
                try:
                    r = check_op(op.op, sample.input, *sample.args, kwargs=sample.kwargs, target="cpu/bf16")
                except Exception as err:  # noqa: BLE001 -- a sample check_op cannot judge: counted
                    row["errors"] += 1
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
                    continue
                row["samples"] += 1
                if not r.passed:
                    row["blamed"] += 1
                    if not row["message"]:
                        row["message"] = next(c.message for c in r.checks if not c.passed).splitlines()[0][:200]
                        try:
                            row["finding"] = confirm(op.op, sample)
                        except Exception as err:  # noqa: BLE001
                            row["finding"] = {"finding": None, "error": str(err)[:120]}
        except Exception as err:  # noqa: BLE001 -- the op's sample generator itself fails here
            row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    return rows


def summary(rows, samples: int) -> str:
    judged = [r for r in rows if r["samples"]]
    blamed = [r for r in judged if r["blamed"]]
    false = [r for r in blamed if not (r["finding"] or {}).get("finding")]
    lines = [f"{len(rows)} ops run, {len(judged)} judged (up to {samples} samples each, "
             f"{sum(r['samples'] for r in judged)} samples), {len(blamed)} blamed: "
             f"{len(blamed) - len(false)} beyond float32 rounded once, {len(false)} false alarms "
             f"({100 * len(false) / max(len(judged), 1):.2f} % of the ops judged); "
             f"{sum(1 for r in rows if r.get('error'))} ops with samples check_op could not judge"]
    for r in blamed:
        fig = (r["finding"] or {}).get("figures") or []
        shown = "; ".join(f"rel {a:.3g} vs {b:.3g}, max {c:.3g} vs {d:.3g} ULP" for a, b, c, d in fig[:2])
        kind = "finding" if (r["finding"] or {}).get("finding") else "FALSE"
        lines.append(f"  {kind:7s} {r['op']}: {r['blamed']}/{r['samples']} samples; {shown}; {r['message'][:150]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default: every op with bf16 on CPU)")
    ap.add_argument("--samples", type=int, default=5, help="sample inputs per op")
    ap.add_argument("--shard", default="0/1", help="I/N: run every N-th op from the I-th (to split the sweep)")
    ap.add_argument("--json", default="", help="write the rows to this file")
    args = ap.parse_args(argv)
    try:
        i, n = (int(v) for v in args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        print(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = {v for v in args.ops.split(",") if v}
    start = time.perf_counter()
    rows = run(names, args.samples, (i, n))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print(f"shard {i}/{n}, {time.perf_counter() - start:.0f} s")
    print(summary(rows, args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
