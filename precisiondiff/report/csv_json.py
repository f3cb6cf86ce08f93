"""Machine-readable outputs of a comparison: JSON (the DESIGN.md shape) and CSV (one row per pair)."""
from __future__ import annotations

import csv
import io
import json
from typing import Any, Dict, List, Optional

from ..compare.comparison import Comparison, Row

__all__ = ["to_json", "to_csv", "CSV_COLUMNS"]

CSV_COLUMNS = ("rank", "seq", "step", "direction", "kind", "scope", "name", "call", "slot", "key",
               "key_b", "dtype_a", "dtype_b", "shape", "match", "mode", "op_class", "verdict",
               "error", "ulp", "within_noise", "noise", "message")


def to_json(c: Comparison, rows: Optional[List[Row]] = None, *, indent: Optional[int] = 1) -> str:
    """The comparison as JSON text (standard JSON: NaN and infinities as strings)."""
    return c.to_json(rows, indent=indent) + "\n"


def to_csv(c: Comparison, rows: Optional[List[Row]] = None) -> str:
    """The rows as CSV: fixed columns (``CSV_COLUMNS``), then every metric name seen, sorted."""
    rows = c.rows if rows is None else rows
    dicts: List[Dict[str, Any]] = [r.to_dict() for r in rows]
    metric_names = sorted({k for d in dicts for k in d["metrics"]})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(list(CSV_COLUMNS) + [f"m.{k}" for k in metric_names])
    for d in dicts:
        base = [json.dumps(d[k]) if isinstance(d[k], list) else ("" if d[k] is None else d[k])
                for k in CSV_COLUMNS]
        writer.writerow(base + ["" if d["metrics"].get(k) is None else d["metrics"][k]
                                for k in metric_names])
    return buf.getvalue()
