"""Comparing the statistics of stats-only dumps (no tensor values were stored).

Metrics (all float64, plain Python numbers), for A (DUT) and B (reference) statistics:

* ``rel_norm     = |norm_a - norm_b| / norm_b``          (L2 norms)
* ``rel_abs_mean = |abs_mean_a - abs_mean_b| / abs_mean_b``
* ``rel_mean     = |mean_a - mean_b| / abs_mean_b``      (mean judged against the magnitude, so a
  near-zero mean does not blow up)
* ``rel_min``, ``rel_max = |x_a - x_b| / max(|min_b|, |max_b|)`` (against B's range)
* ``nan_a, nan_b, inf_a, inf_b`` and ``nan_mismatch = |nan_a - nan_b|``, ``inf_mismatch``
* ``bitwise``: fingerprints equal (same dtype only; None when unknown)

A zero denominator gives 0 when the numerator is 0 too, else inf. Equal infinities differ by 0.

Judgement (:func:`judge_stats`): a NaN or Inf count mismatch always fails; otherwise the
largest of the relative metrics must stay within ``STATS_RTOL[dtype]``. Statistics are
sums over the whole tensor, so rounding errors average out: the bounds below are deliberately
loose, a net for gross errors; capture with ``--mode tensors`` for element-wise verdicts.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["STATS_RTOL", "compare_stats", "judge_stats", "stats_error", "run_dtype", "stat_value"]

# dtype -> largest relative difference of a statistic (16 x unit roundoff, floored for the
# wide formats where differences accumulated through a network dominate rounding):
STATS_RTOL: Dict[str, float] = {
    "bfloat16": 16 * 2.0 ** -8,         # 0.0625
    "float16": 16 * 2.0 ** -11,         # 0.0078
    "float32": 1e-5,                    # 16u = 9.5e-7 is below typical fp32-vs-fp64 drift
    "float64": 1e-12,
    "float8_e4m3fn": 16 * 2.0 ** -4,    # 1.0: statistics of fp8 tensors only catch NaN/Inf
    "float8_e4m3fnuz": 16 * 2.0 ** -4,
    "float8_e5m2": 16 * 2.0 ** -3,
    "float8_e5m2fnuz": 16 * 2.0 ** -3,
}
_REL = ("rel_norm", "rel_abs_mean", "rel_mean", "rel_min", "rel_max")


def _f(stats: Mapping[str, Any], name: str) -> Optional[float]:
    return stat_value(stats.get(name))


def stat_value(v: Any) -> Optional[float]:
    """A statistic read from a dump as a float; None when absent or not a number."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _rel(x: Optional[float], y: Optional[float], denom: Optional[float]) -> Optional[float]:
    if x is None or y is None or denom is None:
        return None
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    diff = abs(x - y)
    denom = abs(denom)
    if math.isnan(diff):
        return math.nan
    if denom == 0 or math.isinf(denom):
        return math.inf if denom == 0 else 0.0 if math.isfinite(diff) else math.inf
    return diff / denom


def compare_stats(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """Compare two tensors' recorded statistics (see the module docstring for the formulas).

    Args:
        a: the DUT tensor's stats dict.
        b: the reference tensor's stats dict.

    Returns:
        A JSON-ready dict of metrics.

    Example:
        >>> compare_stats({"norm": 2.0, "nan": 0}, {"norm": 4.0, "nan": 0})["rel_norm"]
        0.5
    """
    rng = None
    mn, mx = _f(b, "min"), _f(b, "max")
    if mn is not None and mx is not None:
        rng = max(abs(mn), abs(mx))
    out: Dict[str, Any] = {
        "rel_norm": _rel(_f(a, "norm"), _f(b, "norm"), _f(b, "norm")),
        "rel_abs_mean": _rel(_f(a, "abs_mean"), _f(b, "abs_mean"), _f(b, "abs_mean")),
        "rel_mean": _rel(_f(a, "mean"), _f(b, "mean"), _f(b, "abs_mean")),
        "rel_min": _rel(_f(a, "min"), mn, rng),
        "rel_max": _rel(_f(a, "max"), mx, rng),
    }
    for what in ("nan", "inf"):
        na, nb = int(a.get(what) or 0), int(b.get(what) or 0)
        out[f"{what}_a"], out[f"{what}_b"], out[f"{what}_mismatch"] = na, nb, abs(na - nb)
    fa, fb = a.get("fingerprint"), b.get("fingerprint")
    out["bitwise"] = (fa == fb) if fa is not None and fb is not None else None
    return {k: v for k, v in out.items() if v is not None or k == "bitwise"}


def stats_error(m: Mapping[str, Any]) -> Optional[float]:
    """The scalar error of a stats comparison: the largest relative metric (NaN if one is)."""
    vals = [m[k] for k in _REL if isinstance(m.get(k), float)]
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals)


def judge_stats(m: Mapping[str, Any], dtype: str, *, key: str = "",
                run_dtype: Optional[str] = None) -> Tuple[bool, str]:
    """Judge a stats comparison for a DUT tensor of ``dtype``.

    ``run_dtype`` is the DUT run's dtype (``bfloat16`` for target ``cpu/bf16``): a float32
    tensor of a bf16 run carries bf16-sized errors from upstream, so the looser of the two
    bounds applies.

    Returns:
        ``(passed, message)``; the message follows the one mismatch format.

    Raises:
        ValueError: ``dtype`` is a floating format without a documented bound.
    """
    what = key or "tensor"
    hint = "Hint: capture both sides with --mode tensors for element-wise metrics and ULPs."
    if m.get("nan_mismatch") or m.get("inf_mismatch"):
        return False, (f"{what}: NaN/Inf counts differ: A has {m.get('nan_a')} NaN and "
                       f"{m.get('inf_a')} Inf, B has {m.get('nan_b')} NaN and {m.get('inf_b')} "
                       f"Inf; allowed: equal counts. Hint: run `precisiondiff scan` on A to find "
                       "the first event that produced them.")
    if not dtype.startswith(("float", "bfloat")):
        if m.get("bitwise") is False or (stats_error(m) or 0.0) > 0:
            return False, f"{what}: {dtype} statistics differ (allowed: identical). {hint}"
        return True, ""
    if dtype not in STATS_RTOL:
        from ..errors import PrecisionDiffError
        raise PrecisionDiffError(f"{what}: no statistics bound for dtype {dtype}; capture with "
                                 "--mode tensors to compare it element-wise")
    bound = max(STATS_RTOL[dtype], STATS_RTOL.get(run_dtype or "", 0.0))
    worst = max(((m[k], k) for k in _REL if isinstance(m.get(k), float)), default=(0.0, ""),
                key=lambda t: math.inf if math.isnan(t[0]) else t[0])
    if math.isnan(worst[0]) or worst[0] > bound:
        return False, (f"{what}: statistic {worst[1][4:]} differs by {worst[0]:.3g} (relative) "
                       f"> {bound:.3g} allowed for {dtype}{f' in a {run_dtype} run' if run_dtype and run_dtype != dtype else ''} (stats-only dump). {hint}")
    return True, ""


def run_dtype(target: Optional[str]) -> Optional[str]:
    """The dtype name of a target string (``"cpu/bf16+autocast"`` -> ``"bfloat16"``), or None.

    Example:
        >>> run_dtype("mlu:0/fp16")
        'float16'
    """
    if not target or "/" not in str(target):
        return None
    from ..store.schema import dtype_name
    from ..runtime.targets import parse_dtype
    try:
        return dtype_name(parse_dtype(str(target).split("/", 1)[1].split("+", 1)[0]))
    except Exception:  # an unknown dtype in a foreign dump's meta: no run-level bound
        return None
