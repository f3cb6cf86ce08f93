"""The result of a comparison: :class:`Row`, :class:`Comparison`, and the summaries computed
from rows (counts, first divergence, error growth, determinism, notes). :mod:`precisiondiff.compare`
builds it; the report modules render it."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["Row", "Comparison", "NOISE_FACTOR", "summarize", "first_divergence", "growth",
           "determinism", "add_notes"]

# A failing row is called noise when its error vs the reference is at most this many times
# the DUT's run-to-run error on the same tensor (error = max_abs_err for tensors, the statistics'
# largest relative difference for stats-only dumps).
NOISE_FACTOR = 2.0

@dataclass
class Row:
    """One compared tensor pair (or one tensor of an unmatched event).

    Attributes:
        key: A's tensor key (B's when the event is only in B).
        seq: execution order (A's seq; B's for an event only in B).
        verdict: ``"pass"``, ``"fail"`` or ``"unmatched"``.
        metrics: the comparison's numbers (see docs/compare.md).
        error: the scalar used for sorting and plots: the normwise relative error
            ``||a - b|| / ||b||`` (tensors) or the largest relative statistic difference.
        ulp: a ULP figure for plots (``max_ulp``), or None.
        message: why the row failed (the budget's message), or why it is unmatched.
        note: a remark on a passing row (dtype fill constants judged equivalent).
        input_error: the largest error of the event's own inputs in the same comparison
            (``input.*``, ``grad_output.*``), measured like ``error``; None when unknown.
        growth: ``error / max(input_error, u)`` (``u`` the unit roundoff of A's dtype): how much
            error this event adds to what it was given (see :mod:`precisiondiff.compare.suspects`).
    """

    key: str
    seq: int
    rank: int
    step: int
    scope: str
    name: str
    kind: str
    direction: str
    call: int
    slot: str
    dtype_a: Optional[str]
    dtype_b: Optional[str]
    shape: Optional[List[int]] = None
    key_b: Optional[str] = None
    seq_b: Optional[int] = None
    side: str = "both"
    match: str = "exact"  # exact | fused | none (unmatched)
    mode: str = "tensors"
    metrics: Dict[str, Any] = field(default_factory=dict)
    verdict: str = "pass"
    error: Optional[float] = None
    ulp: Optional[float] = None
    bitwise: Optional[bool] = None
    op_class: Optional[str] = None
    message: str = ""
    noise: Optional[float] = None
    within_noise: bool = False
    note: str = ""
    input_error: Optional[float] = None
    growth: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict: the DESIGN.md fields first, extras after."""
        return {"key": self.key, "seq": self.seq, "scope": self.scope, "name": self.name,
                "kind": self.kind, "direction": self.direction, "slot": self.slot,
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
                "metrics": _finite(self.metrics), "verdict": self.verdict,
                "rank": self.rank, "step": self.step, "call": self.call, "shape": self.shape,
                "key_b": self.key_b, "seq_b": self.seq_b, "side": self.side, "match": self.match,
                "mode": self.mode, "error": _finite(self.error), "ulp": _finite(self.ulp),
                "bitwise": self.bitwise, "op_class": self.op_class, "message": self.message,
                "noise": _finite(self.noise), "within_noise": self.within_noise, "note": self.note,
                "input_error": _finite(self.input_error), "growth": _finite(self.growth)}


def _finite(v: Any) -> Any:
    """NaN/inf become strings so the JSON stays standard (``"nan"``, ``"inf"``)."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


@dataclass
class Comparison:
    """The result of :func:`compare`.

    Attributes:
        a, b: the dump paths.
        rows: rows in execution order.
        summary: ``tensors`` (pairs compared), ``failed``, ``unmatched_a``/``unmatched_b``
            (events only in A / B), plus ``passed``, ``within_noise``, ``rows``.
        first_divergence: the first failing row's identity, or None.
        determinism: for two captures of the same target: bitwise equality and noise floor.
        growth: module outputs' error along execution order, per direction.
        ranks: per-rank summary for multi-rank dumps.
        notes: sentences for the user (noise used, dtype order, ...).
        suspects: where error is introduced: the rows whose error grows most against the
            error of their own inputs, worst first (:func:`precisiondiff.compare.suspects.rank`).
    """

    a: str
    b: str
    rows: List[Row]
    summary: Dict[str, Any]
    first_divergence: Optional[Dict[str, Any]]
    meta_a: Dict[str, Any] = field(default_factory=dict)
    meta_b: Dict[str, Any] = field(default_factory=dict)
    determinism: Optional[Dict[str, Any]] = None
    growth: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    ranks: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    noise: Optional[str] = None
    suspects: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True when at least one row failed."""
        return self.summary.get("failed", 0) > 0

    @property
    def exit_code(self) -> int:
        """0 parity, 1 divergence (a failing row)."""
        return 1 if self.failed else 0

    def top(self, n: int) -> List[Row]:
        """The ``n`` compared rows with the largest error, worst first."""
        scored = [r for r in self.rows if r.error is not None and r.verdict != "unmatched"]
        scored.sort(key=lambda r: (-_sort_value(r.error), r.seq))
        return scored[:n]

    def to_dict(self, rows: Optional[List[Row]] = None) -> Dict[str, Any]:
        """The DESIGN.md JSON shape (plus extra fields)."""
        rows = self.rows if rows is None else rows
        return {"a": self.a, "b": self.b, "summary": dict(self.summary),
                "first_divergence": self.first_divergence,
                "rows": [r.to_dict() for r in rows],
                "target_a": self.meta_a.get("target"), "target_b": self.meta_b.get("target"),
                "noise": self.noise, "determinism": _finite(self.determinism),
                "growth": _finite(self.growth), "ranks": {str(k): v for k, v in self.ranks.items()},
                "notes": list(self.notes), "suspects": [_finite(s) for s in self.suspects]}

    def to_json(self, rows: Optional[List[Row]] = None, indent: Optional[int] = None) -> str:
        """Serialize :meth:`to_dict` as standard JSON (NaN/inf spelled as strings)."""
        return json.dumps(self.to_dict(rows), indent=indent, allow_nan=False)

    def to_pandas(self) -> Any:
        """One row per compared tensor, one column per metric, as a ``pandas.DataFrame``
        (optional extra ``pandas``; see :func:`precisiondiff.report.frames.comparison_frame`)."""
        from ..report.frames import comparison_frame  # the one call-time import of report/
        return comparison_frame(self)


def _sort_value(v: Optional[float]) -> float:
    if v is None:
        return -1.0
    return math.inf if math.isnan(v) else v


def summarize(rows: List[Row]) -> Dict[str, Any]:
    compared = [r for r in rows if r.verdict != "unmatched"]
    events_a = {(r.rank, r.seq) for r in rows if r.verdict == "unmatched" and r.side == "a"}
    events_b = {(r.rank, r.seq) for r in rows if r.verdict == "unmatched" and r.side == "b"}
    return {"tensors": len(compared), "failed": sum(r.verdict == "fail" for r in rows),
            "unmatched_a": len(events_a), "unmatched_b": len(events_b),
            "passed": sum(r.verdict == "pass" for r in rows),
            "within_noise": sum(r.within_noise for r in rows), "rows": len(rows)}


def first_divergence(rows: List[Row]) -> Optional[Dict[str, Any]]:
    for r in rows:
        if r.verdict == "fail":
            return {"key": r.key, "scope": r.scope, "name": r.name, "direction": r.direction,
                    "kind": r.kind, "seq": r.seq, "rank": r.rank, "slot": r.slot,
                    "error": _finite(r.error), "message": r.message}
    return None


def growth(rows: List[Row]) -> Dict[str, List[Dict[str, Any]]]:
    """Module outputs' error along execution order (forward: output.0, backward: grad_input.0)."""
    out: Dict[str, List[Dict[str, Any]]] = {"forward": [], "backward": []}
    for r in rows:
        if r.kind != "module" or r.error is None or r.verdict == "unmatched":
            continue
        if r.slot != ("output.0" if r.direction == "forward" else "grad_input.0"):
            continue
        series = out[r.direction]
        prev = series[-1]["error"] if series else None
        ratio = (r.error / prev) if prev else None
        series.append({"scope": r.scope, "name": r.name, "seq": r.seq, "rank": r.rank, "step": r.step,
                       "error": r.error, "ulp": r.ulp, "growth": ratio})
    return out


def determinism(rows: List[Row], target: Any) -> Dict[str, Any]:
    compared = [r for r in rows if r.verdict != "unmatched"]
    known = [r for r in compared if r.bitwise is not None or r.mode == "tensors"]
    differing = [r for r in known if not (r.bitwise or (r.bitwise is None and not r.error))]
    floor = [{"key": r.key, "seq": r.seq, "error": r.error, "max_abs_err": r.metrics.get("max_abs_err"),
              "max_ulp": r.ulp} for r in differing]
    return {"target": target, "bitwise": not differing and bool(known),
            "checked": len(known), "nondeterministic": len(differing), "noise_floor": _finite(floor)}


def add_notes(c: Comparison) -> None:
    if c.noise:
        c.notes.append(f"noise: rows within {NOISE_FACTOR:g}x the run-to-run error of {c.noise} "
                       f"are not divergence ({c.summary['within_noise']} rows)")
    d = c.determinism
    if d is not None:
        if d["bitwise"]:
            c.notes.append(f"both dumps are captures of {d['target']}: bitwise deterministic "
                           f"({d['checked']} tensors identical)")
        else:
            c.notes.append(f"both dumps are captures of {d['target']}: NOT bitwise deterministic "
                           f"({d['nondeterministic']} of {d['checked']} tensors differ; see the "
                           "noise floor); pass one as --noise to a comparison against the reference")
    ta, tb = str(c.meta_a.get("target", "")), str(c.meta_b.get("target", ""))
    if ta.endswith(("float64", "fp64")) and not tb.endswith(("float64", "fp64")) and tb:
        c.notes.append(f"A ({ta}) looks like the reference and B ({tb}) like the DUT: the DUT "
                       "comes first (compare DUT REF)")
