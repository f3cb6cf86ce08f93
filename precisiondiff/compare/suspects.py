"""Where error is introduced: rank the rows whose error grows most against their own inputs'.

A row over the end-to-end budget says where the error *is*; after the first divergence every
later row carries it. An op that *introduces* error stands out differently: its output's error
is much larger than the error of the inputs it was given, while a correct op passes its inputs'
error on (``x1``, a little more for ill-conditioned ops). For every compared output row
(``output.*`` forward, ``grad_input.*`` backward) of an event:

* ``input_error`` = the largest ``error`` among the event's floating inputs (``input.*`` and, for
  a module's backward, ``grad_output.*``), measured in the same comparison and the same way as
  rows are (relative L2 error for tensors, the largest relative statistic difference for stats).
  Both captures store an op's input as the producing op's output (an alias in the dump, see
  docs/dump-format.md), so most inputs' errors are the producers' rows, read from a cache.
* ``growth = error / max(input_error, u)`` with ``u`` the unit roundoff of A's dtype (one
  correctly rounded result from exact inputs has an error of at most ``u``, so growth <= 1).

Suspects are rows with ``growth >= SUSPECT_GROWTH``, worst growth first, at most
``MAX_SUSPECTS``; a module is left out when a suspect ran inside it (it grows with its culprit). Growth points; it does not judge (a subtraction that cancels legitimately
amplifies its inputs' error): ``precisiondiff bisect`` gives the verdict on each op's own
arithmetic, and the hint line says how to run it.
"""
from __future__ import annotations

import math
import shlex
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["SUSPECT_GROWTH", "MAX_SUSPECTS", "InputErrors", "unit_roundoff", "growth", "set_growth", "rank",
           "bisect_hint"]

SUSPECT_GROWTH = 4.0  # x4 its inputs' error: twice what two roundings of a well-conditioned op add
MAX_SUSPECTS = 5
INPUT_SLOTS = ("input.", "grad_output.")
OUTPUT_SLOTS = ("output", "grad_input")

# unit roundoff 2**-p of each floating dtype (p = significand bits including the implicit one)
_U = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
      "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4, "float8_e5m2": 2.0 ** -3,
      "float8_e5m2fnuz": 2.0 ** -3}


def unit_roundoff(dtype: Optional[str]) -> Optional[float]:
    """The unit roundoff of a dtype name (``bfloat16`` -> 2**-8), None for a non-float dtype."""
    return _U.get(str(dtype))


class InputErrors:
    """The error of the inputs of events, each stored tensor measured once.

    Args:
        da, db: the two dumps (one rank each).
        device: where element-wise comparisons run.
    """

    def __init__(self, da: Any, db: Any, device: Optional[str] = None) -> None:
        self.da, self.db, self.device = da, db, device
        self._cache: Dict[Tuple[str, str], Optional[float]] = {}

    def remember(self, rec_a: Any, rec_b: Any, error: Optional[float]) -> None:
        """Keep a compared row's error under its stored data (later inputs alias it)."""
        if rec_a.data_key and rec_b.data_key:
            self._cache[(rec_a.data_key, rec_b.data_key)] = error

    def of_event(self, ea: Any, eb: Any) -> Optional[float]:
        """The largest error among the floating inputs of a matched event pair (None: none)."""
        recs_b = {t.slot: t for t in eb.tensors}
        errors = []
        for ra in ea.tensors:
            rb = recs_b.get(ra.slot)
            if (not ra.slot.startswith(INPUT_SLOTS) or rb is None or unit_roundoff(ra.dtype) is None
                    or unit_roundoff(rb.dtype) is None or tuple(ra.shape) != tuple(rb.shape)):
                continue
            e = self._error(ra, rb)
            if e is not None:
                errors.append(e)
        return max(errors, key=lambda v: math.inf if math.isnan(v) else v) if errors else None

    def _error(self, ra: Any, rb: Any) -> Optional[float]:
        if not (ra.has_data and rb.has_data):
            from .stats import compare_stats, stats_error
            return stats_error(compare_stats(ra.stats, rb.stats))
        key = (ra.data_key, rb.data_key)
        if key not in self._cache:
            self._cache[key] = tensor_error(self.da.tensor(ra.key), self.db.tensor(rb.key), self.device)
        return self._cache[key]


def tensor_error(ta: Any, tb: Any, device: Optional[str] = None) -> Optional[float]:
    """Relative L2 error of A against B, leaving out dtype fill constants (``constants.py``)."""
    from ..comparators import compare_tensors
    from .constants import fill_mask
    if device:
        ta, tb = ta.to(device), tb.to(device)
    mask = fill_mask(ta, tb)
    if mask is not None:
        ta, tb = ta[~mask], tb[~mask]
        if ta.numel() == 0:
            return 0.0
    value = compare_tensors(ta, tb).to_dict().get("diff2")
    return float(value) if isinstance(value, (int, float)) else None


def growth(error: Optional[float], input_error: Optional[float], dtype: Optional[str]) -> Optional[float]:
    """``error / max(input_error, u)``; None when the row has no error or A's dtype no ``u``."""
    u = unit_roundoff(dtype)
    if error is None or u is None or math.isnan(error):
        return None
    floor = u if input_error is None or math.isnan(input_error) else max(input_error, u)
    return error / floor


def set_growth(rows: List[Any], ea: Any, eb: Any, input_errors: InputErrors) -> None:
    """Set ``input_error`` and ``growth`` on the compared output rows of one event pair."""
    outputs = [r for r in rows if r.slot.startswith(OUTPUT_SLOTS) and r.error is not None
               and r.verdict != "unmatched" and r.mode in ("tensors", "stats")]
    if not outputs:
        return
    input_error = input_errors.of_event(ea, eb)
    for r in outputs:
        r.input_error = input_error
        r.growth = growth(r.error, input_error, r.dtype_a)


def rank(rows: List[Any], *, threshold: float = SUSPECT_GROWTH, limit: int = MAX_SUSPECTS) -> List[Dict[str, Any]]:
    """The suspects among compared rows: growth at least ``threshold``, worst growth first.

    Args:
        rows: the comparison's rows (:class:`~precisiondiff.compare.comparison.Row`), with
            ``growth`` set.
        threshold: the smallest growth called a suspect.
        limit: how many to return.

    Returns:
        Dicts with the row's identity (key, seq, rank, scope, name, kind, direction, slot),
        ``error``, ``input_error``, ``growth``, ``verdict`` and ``typical_growth`` (the median
        growth of every row with one: what the neighbours do).

    Example:
        >>> rank([])
        []
    """
    measured = [r for r in rows if r.growth is not None and math.isfinite(r.growth)
                and r.verdict != "unmatched"]
    if not measured:
        return []
    ordered = sorted(r.growth for r in measured)
    typical = ordered[len(ordered) // 2]
    over = [r for r in measured if r.growth >= threshold]
    # a module grows with the op inside it that introduced the error: name the innermost only
    over = [r for r in over if r.kind != "module" or not any(
        o is not r and o.direction == r.direction and _inside(o, r) for o in over)]
    picked = sorted(over, key=lambda r: (-r.growth, r.seq))
    return [{"key": r.key, "seq": r.seq, "rank": r.rank, "scope": r.scope, "name": r.name,
             "kind": r.kind, "direction": r.direction, "slot": r.slot, "error": r.error,
             "input_error": r.input_error, "growth": r.growth, "verdict": r.verdict,
             "typical_growth": typical} for r in picked[:limit]]


def _inside(inner: Any, module: Any) -> bool:
    """``inner`` ran inside ``module`` (an op in its scope, or a submodule)."""
    if inner.kind == "module" and inner.scope == module.scope:
        return False
    return module.scope == "" or inner.scope == module.scope or inner.scope.startswith(module.scope + ".")


def bisect_hint(meta_a: Mapping[str, Any], meta_b: Mapping[str, Any], a: str, b: str,
                suspects: List[Dict[str, Any]]) -> str:
    """One line: the bisect command that gives the verdict on the suspects.

    Live bisect when A names its workload (``precisiondiff capture W``), offline when A was
    captured in replay mode, else how to get there.
    """
    if not suspects:
        return ""
    directions = {s["direction"] for s in suspects}
    direction = f" --direction {directions.pop()}" if len(directions) == 1 else ""
    workload, target = meta_a.get("workload"), meta_a.get("target")
    ref = meta_b.get("target")
    if workload and not str(workload).startswith("--script") and target:
        command = (f"precisiondiff bisect {shlex.quote(str(workload))} --target {target}"
                   + (f" --ref {ref}" if ref else "") + direction)
    elif meta_a.get("mode") == "replay":
        command = f"precisiondiff bisect {shlex.quote(a)} {shlex.quote(b)}{direction}"
    else:
        command = "precisiondiff bisect WORKLOAD --target TARGET" + direction
    return (f"Hint: growth points, it does not judge (a cancelling subtraction amplifies error "
            f"legitimately); `{command}` names the op whose own arithmetic is wrong.")
