"""pandas DataFrames of a comparison, a dump and a bisect result (optional extra ``pandas``).

One row per thing measured, the shape ExecuTorch's Inspector and msprobe's CSVs taught users
to expect:

- :func:`comparison_frame`: one row per compared tensor (a :class:`~precisiondiff.compare.comparison.Row`),
  its identity columns, then one column per metric (``max_abs_err``, ``max_ulp``, ...).
- :func:`dump_frame`: one row per recorded tensor of a dump: the event's identity, the tensor's
  slot, dtype, shape, and one column per statistic captured (``min``, ``max``, ``l2``, ...).
- :func:`bisect_frame`: one row per unit bisect measured and reported (the culprit, the
  candidates after it, the enclosing path, the growth table), its ``role``, then its local error
  metrics and its budget (columns prefixed ``budget.``).

pandas is imported on first use; without it these functions raise
:class:`~precisiondiff.errors.PrecisionDiffError` saying how to install it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

from ..errors import PrecisionDiffError

__all__ = ["require_pandas", "comparison_frame", "dump_frame", "bisect_frame"]

# identity columns of a comparison row, in this order; the metrics follow
_ROW_COLUMNS = ("seq", "rank", "step", "kind", "scope", "name", "direction", "call", "slot", "key",
                "dtype_a", "dtype_b", "shape", "verdict", "error", "ulp", "op_class", "match", "side",
                "mode", "bitwise", "noise", "within_noise", "key_b", "seq_b", "message")

_UNIT_COLUMNS = ("role", "rank_in_role", "kind", "scope", "name", "direction", "call")


def require_pandas() -> Any:
    """Import pandas, or raise a one-line error that says how to install it.

    Raises:
        PrecisionDiffError: pandas is not installed.
    """
    try:
        import pandas
    except ImportError as err:
        raise PrecisionDiffError("pandas is not installed: pip install 'precisiondiff[pandas]' "
                                 "(or pip install pandas)") from err
    return pandas


def _number(v: Any) -> Any:
    """The JSON spellings of non-finite floats back to floats; None stays missing."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def comparison_frame(comparison: Any) -> Any:
    """One row per compared tensor of ``comparison``, in execution order.

    Columns: ``seq, rank, step, kind, scope, name, direction, call, slot, key, dtype_a, dtype_b,
    shape, verdict, error, ulp, op_class, ...`` then one column per metric of the comparison
    (``max_abs_err``, ``mean_rel_err``, ``max_ulp``, ``cosine_similarity``, ``sqnr_db``...;
    docs/compare.md). ``error`` is the normwise relative error ``||a - b|| / ||b||``.

    Args:
        comparison: a :class:`~precisiondiff.compare.comparison.Comparison`.

    Returns:
        A ``pandas.DataFrame``.

    Raises:
        PrecisionDiffError: pandas is not installed.

    Example:
        >>> df = precisiondiff.compare("runs/dut", "runs/ref").to_pandas()  # doctest: +SKIP
        >>> df[df.verdict == "fail"].sort_values("error").tail()  # doctest: +SKIP
    """
    pd = require_pandas()
    records: List[Dict[str, Any]] = []
    metric_names: Dict[str, None] = {}
    for r in comparison.rows:
        rec = {c: getattr(r, c) for c in _ROW_COLUMNS}
        rec["shape"] = tuple(r.shape) if r.shape is not None else None
        for name, value in r.metrics.items():
            if name in rec:  # a metric never hides an identity column
                name = f"metric.{name}"
            metric_names.setdefault(name, None)
            rec[name] = _number(value)
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(_ROW_COLUMNS) + list(metric_names))


def dump_frame(dump: Any, *, kind: Optional[str] = None, direction: Optional[str] = None,
               step: Optional[int] = None) -> Any:
    """One row per recorded tensor of ``dump``, in execution order.

    Columns: ``seq, step, rank, kind, scope, name, direction, call, device, slot, key, dtype,
    shape, numel, has_data`` then one column per captured statistic (``min``, ``max``,
    ``mean``, ``abs_mean``, ``l2``, ``nan``, ``inf``..., as recorded at capture).

    Args:
        dump: a :class:`~precisiondiff.store.Dump` (``precisiondiff.load(path)``).
        kind, direction, step: keep only these events (as :meth:`Dump.events`).

    Returns:
        A ``pandas.DataFrame``.

    Raises:
        PrecisionDiffError: pandas is not installed, or the dump cannot be read.

    Example:
        >>> precisiondiff.load("runs/dut").to_pandas().groupby("scope")["l2"].max()  # doctest: +SKIP
    """
    pd = require_pandas()
    base = ["seq", "step", "rank", "kind", "scope", "name", "direction", "call", "device",
            "slot", "key", "dtype", "shape", "numel", "has_data"]
    records: List[Dict[str, Any]] = []
    stat_names: Dict[str, None] = {}
    for ev in dump.events(kind=kind, direction=direction, step=step):
        for t in ev.tensors:
            shape = tuple(int(s) for s in t.shape)
            rec: Dict[str, Any] = {"seq": ev.seq, "step": ev.step, "rank": ev.rank, "kind": ev.kind,
                                   "scope": ev.scope, "name": ev.name, "direction": ev.direction,
                                   "call": ev.call, "device": ev.device, "slot": t.slot, "key": t.key,
                                   "dtype": t.dtype, "shape": shape, "numel": math.prod(shape),
                                   "has_data": t.has_data}
            for name, value in (t.stats or {}).items():
                if name in rec:
                    name = f"stat.{name}"
                stat_names.setdefault(name, None)
                rec[name] = _number(value)
            records.append(rec)
    return pd.DataFrame.from_records(records, columns=base + list(stat_names))


def _units(result: Mapping[str, Any]) -> List[Dict[str, Any]]:
    units: List[Dict[str, Any]] = []
    if result.get("culprit"):
        units.append(("culprit", 0, result["culprit"]))
    units += [("candidate", i, u) for i, u in enumerate(result.get("candidates") or [])]
    units += [("path", i, u) for i, u in enumerate(result.get("path") or [])]
    units += [("growth", i, u) for i, u in enumerate(result.get("growth") or [])]
    return units


def bisect_frame(result: Any) -> Any:
    """One row per unit a bisect reported: the culprit, then candidates, path and growth.

    Columns: ``role`` (``culprit``, ``candidate``, ``path`` — the modules enclosing the
    culprit, outermost first —, ``growth`` — for an ``accumulated`` verdict, the modules with the
    largest local error), ``rank_in_role``, ``kind, scope, name, direction, call``, then the
    unit's local error metrics (``max_ulp``, ``rel_l2``...; docs/bisect.md) and its budget as
    ``budget.<field>`` columns.

    Args:
        result: a :class:`~precisiondiff.bisect.BisectResult` or its JSON dict
            (``precisiondiff bisect ... --format json``).

    Returns:
        A ``pandas.DataFrame``; empty (with the identity columns) for a ``parity`` verdict.

    Raises:
        PrecisionDiffError: pandas is not installed.

    Example:
        >>> precisiondiff.bisect("examples/tiny_transformer.py:build_with_bug").to_pandas()  # doctest: +SKIP
    """
    pd = require_pandas()
    obj = result.to_json() if hasattr(result, "to_json") else dict(result)
    records: List[Dict[str, Any]] = []
    extra: Dict[str, None] = {}
    for role, i, unit in _units(obj):
        rec: Dict[str, Any] = {"role": role, "rank_in_role": i}
        for c in _UNIT_COLUMNS[2:]:
            rec[c] = unit.get(c)
        for name, value in (unit.get("local") or {}).items():
            if name in rec:
                name = f"local.{name}"
            extra.setdefault(name, None)
            rec[name] = _number(value)
        for name, value in (unit.get("budget") or {}).items():
            extra.setdefault(f"budget.{name}", None)
            rec[f"budget.{name}"] = _number(value)
        # growth rows carry their figures at top level ("error", "growth"...)
        for name, value in unit.items():
            if name not in rec and name not in ("local", "budget", "message") and not isinstance(value, (dict, list)):
                extra.setdefault(name, None)
                rec[name] = _number(value)
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(_UNIT_COLUMNS) + list(extra))
