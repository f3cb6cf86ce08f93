"""Two watch logs side by side: per step, the relative error of the loss and of every statistic,
and the first step, layer and tensor at which the runs part by more than rounding explains.

Errors (A is the run under test, B the reference), per step:

- a module tensor's error is the largest of ``|norm_a − norm_b| / norm_b``,
  ``|amax_a − amax_b| / amax_b`` (``amax = max(|min|, |max|)``) and
  ``|mean_a − mean_b| / abs_mean_b``; 0 when the fingerprints are equal (bitwise equal
  tensors); infinite when the NaN or Inf counts differ;
- a parameter's error per quantity (weight, grad, state): ``|a − b| / |b|``; its update/weight
  ratio's: ``|ratio_a − ratio_b|`` (already relative to ‖w‖; low-precision weights quantize an
  update to their own rounding, about eps·‖w‖);
- the loss: ``|loss_a − loss_b| / |loss_b|``.

Thresholds, without a noise run (the defaults, :data:`DEFAULTS`):

- the loss: 1% (msprobe's training-debug guide: loss "misaligned" above 1% relative error);
- a module's forward output at depth l of L watched layers: ``k·C^l·eps``; its output
  gradient: ``k·C^(L+1−l)·eps``; parameters: ``k·C^(L+1)·eps`` (Megatron/TTrace's
  depth-aware gradient bound, k = 4, C = 1.03, eps = ``finfo(dtype).eps`` of the lower
  precision of the two runs);
- a spike: a loss or gradient norm that grows more than 10x from one watched step to the next
  in one run but not in the other (Megatron's spike factor).

With a noise run C (the reference's run again with another seed or data order, or a second
correct implementation), each quantity's band at step s is the largest error of C against B at
steps up to s (rounding differences never un-happen), and the threshold is
``max(10 · band, 8·u)`` (the mlu-ops dynamic rule "10x the baseline's error"; u the unit
roundoff of the lower precision). A quantity diverges at the first step its error exceeds its
threshold; the first such step, and in it the first tensor in execution order (forward outputs,
the loss, output gradients in backward order, parameters), is the first divergence.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..comparators.ulp import float_format
from ..errors import PrecisionDiffError
from .log import FIELDS, WatchLog, read_logs
from .shards import combine_ranks

__all__ = ["DEFAULTS", "WatchComparison", "compare_logs", "tensor_error"]

DEFAULTS = {
    "loss_rel": 0.01,        # msprobe train_debug_guide: loss misaligned above 1% relative error
    "depth_k": 4.0,          # Megatron test_optimizer_grads_match.py (TTrace): k * C^(L+1-l) * eps
    "depth_c": 1.03,
    "spike_factor": 10.0,    # Megatron's spike factor: a 10x jump from one step to the next
    "noise_margin": 10.0,    # mlu-ops dynamic rule: within 10x the baseline's (noise run's) error
    "noise_floor_u": 8.0,    # with a noise run, never below 8 unit roundoffs (compare's rel-l2 default)
}
_I = {name: i for i, name in enumerate(FIELDS)}
_TINY = 1e-30


def _rel(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if isinstance(a, str) or isinstance(b, str):
        a, b = float(a), float(b)
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), _TINY)


def tensor_error(a: List[Any], b: List[Any]) -> float:
    """The relative error of one tensor's statistics ``a`` against ``b`` (lists in FIELDS order)."""
    if a[_I["fingerprint"]] == b[_I["fingerprint"]]:
        return 0.0
    if a[_I["nan"]] != b[_I["nan"]] or a[_I["inf"]] != b[_I["inf"]]:
        return math.inf
    def amax(v):
        lo, hi = v[_I["min"]], v[_I["max"]]
        return None if lo is None else max(abs(lo), abs(hi))
    errors = [_rel(a[_I["norm"]], b[_I["norm"]]), _rel(amax(a), amax(b))]
    ma, mb, scale = a[_I["mean"]], b[_I["mean"]], b[_I["abs_mean"]]
    if ma is not None and mb is not None and scale is not None:
        errors.append(0.0 if ma == mb else abs(ma - mb) / max(abs(scale), _TINY))
    errors = [e for e in errors if e is not None and not math.isnan(e)]
    return max(errors) if errors else 0.0


def _eps(*dtypes: Optional[str]) -> float:
    """finfo(dtype).eps of the lowest precision among ``dtypes`` (float32 when none is known)."""
    best = None
    for name in dtypes:
        dt = getattr(torch, name, None) if name else None
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            eps = 2 * float_format(dt).unit_roundoff
            best = eps if best is None else max(best, eps)
    return best if best is not None else 2.0 ** -23


@dataclass
class _Quantity:
    """One compared quantity: where it is in execution order and its per-step errors."""

    key: str
    scope: str
    tensor: str
    order: int
    depth: Optional[int]
    static: float
    eps: float = 0.0
    errors: Dict[int, float] = field(default_factory=dict)
    band: Dict[int, float] = field(default_factory=dict)


@dataclass
class WatchComparison:
    """The comparison of two watch logs; :meth:`to_dict` is the JSON report (docs/watch.md)."""

    a: str
    b: str
    noise: Optional[str]
    data: Dict[str, Any]

    @property
    def first_divergence(self) -> Optional[Dict[str, Any]]:
        return self.data["first_divergence"]

    @property
    def exit_code(self) -> int:
        return 1 if self.first_divergence is not None else 0

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "watch", "a": self.a, "b": self.b, "noise": self.noise, **self.data}


def _split(key: str) -> Tuple[str, str]:
    scope, _, tensor = key.rpartition(":")
    return scope, tensor


def _quantities(la: WatchLog, lb: WatchLog, steps: List[int]) -> List[_Quantity]:
    """Every quantity both logs hold, in execution order, with its static threshold."""
    a0 = la.by_step()[steps[0]]
    dtypes_a = next((r.get("dtypes") for r in la.steps if r.get("dtypes")), {}) or {}
    dtypes_b = next((r.get("dtypes") for r in lb.steps if r.get("dtypes")), {}) or {}
    keys_b = set(lb.by_step()[steps[0]]["tensors"])
    forward = [k for k in a0["tensors"] if k in keys_b and not _split(k)[1].startswith("grad_")]
    backward = [k for k in a0["tensors"] if k in keys_b and _split(k)[1].startswith("grad_")]
    depth_of: Dict[str, int] = {}
    for k in forward:
        depth_of.setdefault(_split(k)[0].split("#")[0], len(depth_of) + 1)
    layers = max(len(depth_of), 1)
    k_, c_ = DEFAULTS["depth_k"], DEFAULTS["depth_c"]
    param_dtypes = la.header.get("model", {}).get("param_dtypes", []) + lb.header.get("model", {}).get("param_dtypes", [])
    out: List[_Quantity] = []
    for k in forward:
        scope, tensor = _split(k)
        l = depth_of[scope.split("#")[0]]
        eps = _eps(dtypes_a.get(k), dtypes_b.get(k))
        out.append(_Quantity(k, scope, tensor, len(out), l, k_ * c_ ** l * eps, eps))
    out.append(_Quantity("loss", "", "loss", len(out), None, DEFAULTS["loss_rel"]))
    for k in backward:
        scope, tensor = _split(k)
        l = depth_of.get(scope.split("#")[0], 1)
        eps = _eps(dtypes_a.get(k), dtypes_b.get(k))
        out.append(_Quantity(k, scope, tensor, len(out), l, k_ * c_ ** (layers + 1 - l) * eps, eps))
    pb = lb.by_step()[steps[0]]["params"]
    for name, values in a0["params"].items():
        for what in values:
            if what in pb.get(name, {}):
                eps = _eps(*param_dtypes)
                out.append(_Quantity(f"{name}:{what}", name, what, len(out), None, k_ * c_ ** (layers + 1) * eps, eps))
    return out


def _value_errors(q: _Quantity, ra: Dict[str, Any], rb: Dict[str, Any]) -> Optional[float]:
    if q.key == "loss":
        return _rel(ra.get("loss"), rb.get("loss"))
    if q.key in ra["tensors"] and q.key in rb["tensors"]:
        return tensor_error(ra["tensors"][q.key], rb["tensors"][q.key])
    va, vb = ra["params"].get(q.scope, {}).get(q.tensor), rb["params"].get(q.scope, {}).get(q.tensor)
    if q.tensor == "update_ratio" and va is not None and vb is not None:
        # already relative to the weight's norm, and low-precision weights quantize the update to
        # their own rounding (eps·‖w‖): an absolute difference, judged against eps
        return 0.0 if va == vb else (abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.inf)
    return _rel(va, vb)


def _scalar(q: _Quantity, r: Dict[str, Any]) -> Optional[float]:
    """The quantity's own value in one run (for spikes): the loss, a norm, a gradient norm."""
    if q.key == "loss":
        return r.get("loss")
    if q.tensor == "grad":
        return r["params"].get(q.scope, {}).get("grad")
    return None


def _spiked(prev: Optional[float], cur: Optional[float]) -> bool:
    if prev is None or cur is None or not math.isfinite(prev):
        return False
    return not math.isfinite(cur) or abs(cur) > DEFAULTS["spike_factor"] * max(abs(prev), _TINY)


def _compare_pair(la: WatchLog, lb: WatchLog, lc: Optional[WatchLog]) -> Dict[str, Any]:
    sa, sb = la.by_step(), lb.by_step()
    steps = sorted(set(sa) & set(sb))
    notes: List[str] = []
    if not steps:
        raise PrecisionDiffError(f"{la.path} and {lb.path} share no watched step: watch both runs with the same --every")
    quantities = _quantities(la, lb, steps)
    sc = lc.by_step() if lc is not None else {}
    floor = DEFAULTS["noise_floor_u"] * max((q.eps for q in quantities), default=2.0 ** -23) / 2
    first: Optional[Dict[str, Any]] = None
    per_step = []
    prev_a: Dict[str, Optional[float]] = {}
    prev_b: Dict[str, Optional[float]] = {}
    for s in steps:
        ra, rb = sa[s], sb[s]
        rc = sc.get(s)
        crossed = []
        worst, worst_key, bitwise = 0.0, None, True
        for q in quantities:
            err = _value_errors(q, ra, rb)
            if err is None:
                continue
            q.errors[s] = err
            bitwise = bitwise and err == 0.0
            if lc is not None:
                noise = _value_errors(q, rc, rb) if rc is not None else None
                previous = max(q.band.values()) if q.band else 0.0
                q.band[s] = max(previous, noise if noise is not None and not math.isnan(noise) else 0.0)
                threshold = max(DEFAULTS["noise_margin"] * q.band[s], floor)
            else:
                threshold = q.static
            reason = "error" if err > threshold else None
            va, vb = _scalar(q, ra), _scalar(q, rb)
            if reason is None and _spiked(prev_a.get(q.key), va) != _spiked(prev_b.get(q.key), vb):
                reason = "spike"
            prev_a[q.key], prev_b[q.key] = va, vb
            if err > worst or worst_key is None:
                worst, worst_key = err, q.key
            if reason is not None:
                crossed.append((q, err, threshold, reason))
        entry = {"step": s, "loss_a": ra.get("loss"), "loss_b": rb.get("loss"),
                 "loss_error": next((q.errors.get(s) for q in quantities if q.key == "loss"), None),
                 "max_error": worst, "worst": worst_key, "diverged": len(crossed), "bitwise": bitwise}
        per_step.append(entry)
        if crossed and first is None:
            q, err, threshold, reason = min(crossed, key=lambda c: c[0].order)
            first = {"step": s, "key": q.key, "scope": q.scope, "tensor": q.tensor, "error": err,
                     "threshold": threshold, "reason": reason, "depth": q.depth,
                     "crossed": [c[0].key for c in sorted(crossed, key=lambda c: c[0].order)][:20]}
    growth = []
    at = first["step"] if first is not None else (steps[-1] if steps else None)
    for q in quantities:
        if q.depth is not None and at in q.errors:
            growth.append({"key": q.key, "scope": q.scope, "tensor": q.tensor, "depth": q.depth,
                           "error": q.errors[at], "threshold": (max(DEFAULTS["noise_margin"] * q.band.get(at, 0.0), floor)
                                                                if lc is not None else q.static)})
    for name, lg in (("A", la), ("B", lb)) + ((("noise", lc),) if lc is not None else ()):
        if not lg.complete:
            notes.append(f"{name} ({lg.path}) is partial: the run stopped after {len(lg.steps)} watched steps "
                         "(no end line); compared as far as it goes")
        if lg.torn_lines:
            notes.append(f"{name} ({lg.path}): {lg.torn_lines} damaged or torn line(s) skipped")
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if only_a or only_b:
        notes.append(f"steps only in A: {len(only_a)}, only in B: {len(only_b)}; compared {len(steps)} common steps")
    if lc is not None and set(steps) - set(sc):
        notes.append(f"the noise run lacks {len(set(steps) - set(sc))} of the compared steps: "
                     "the band stays at its last value there")
    return {"rank": la.rank, "steps": len(steps), "partial": {"a": not la.complete, "b": not lb.complete},
            "first_divergence": first, "per_step": per_step, "growth": growth, "notes": notes,
            "errors": {q.key: [q.errors.get(s) for s in steps] for q in quantities if q.key != "loss"},
            "step_numbers": steps}


def _one_rank(logs: dict) -> dict:
    return {0: combine_ranks(logs)} if len(logs) > 1 else logs


def compare_logs(a: "str | os.PathLike", b: "str | os.PathLike", *,
                 noise: "str | os.PathLike | None" = None) -> WatchComparison:
    """Compare watch log A (the run under test) with B (the reference), optionally with a noise run.

    Args:
        a, b: watch log directories (``precisiondiff watch -o``).
        noise: a third log (C) whose error against B is the band a correct run stays in.

    Returns:
        A :class:`WatchComparison`: ``first_divergence`` (step, key, scope, tensor, error,
        threshold), ``per_step``, ``growth`` (error by depth at that step), ``errors``, notes.

    Raises:
        PrecisionDiffError: not watch logs, logs of different models or rank counts.

    Example:
        >>> c = compare_logs("runs/w-bf16", "runs/w-fp64", noise="runs/w-bf16-seed1")
        >>> c.first_divergence["step"], c.first_divergence["key"]
    """
    logs_a, logs_b = read_logs(a), read_logs(b)
    logs_c = read_logs(noise) if noise is not None else None
    if len(logs_a) != len(logs_b) and 1 in (len(logs_a), len(logs_b)):
        # a sharded job against one process: its ranks' shard norms combined (shards.py)
        logs_a, logs_b, logs_c = (_one_rank(x) if x is not None else None for x in (logs_a, logs_b, logs_c))
    for other, logs in (("B", logs_b), ("the noise run", logs_c)):
        if logs is None:
            continue
        if set(logs) != set(logs_a):
            raise PrecisionDiffError(f"A has ranks {sorted(logs_a)} and {other} has {sorted(logs)}: compare "
                                     "watch logs of the same rank count")
        for rank, lg in logs.items():
            if lg.signature != logs_a[rank].signature:
                raise PrecisionDiffError(f"{logs_a[rank].path} and {lg.path} are watch logs of different models "
                                         "(their parameters' names or shapes differ)")
    ranks = [_compare_pair(logs_a[r], logs_b[r], logs_c[r] if logs_c else None) for r in sorted(logs_a)]
    firsts = [r["first_divergence"] | {"rank": r["rank"]} for r in ranks if r["first_divergence"]]
    first = min(firsts, key=lambda f: (f["step"], f["rank"])) if firsts else None
    top = dict(ranks[0])
    top["first_divergence"] = first
    if len(ranks) > 1:
        top["ranks"] = [{"rank": r["rank"], "first_divergence": r["first_divergence"], "steps": r["steps"]}
                        for r in ranks]
        top["notes"] = [n for r in ranks for n in r["notes"]]
    top["notes"] = [n for lg in logs_a.values() if lg.header.get("combined_from") for n in lg.notes] + top["notes"]
    top["thresholds"] = {**DEFAULTS, "mode": "noise" if noise is not None else "default"}
    return WatchComparison(os.fspath(a), os.fspath(b), os.fspath(noise) if noise is not None else None, top)
