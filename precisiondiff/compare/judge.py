"""How one matched tensor pair of two whole runs is judged: the end-to-end rule (:class:`Judge`),
element-wise metrics when both sides hold data, recorded statistics otherwise, dtype fill
constants and run-to-run noise (see :mod:`.dumps` and docs/compare.md)."""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional, Tuple

from .comparison import NOISE_FACTOR, Row
from .constants import constant_fill_note, rest_metrics
from .stats import compare_stats, judge_stats, stats_error
from ..errors import PrecisionDiffError

__all__ = ["Judge", "judge_row", "apply_noise", "compare_tensor_pair", "bitwise", "is_float", "num"]


class Judge:
    """The end-to-end rule for rows of two whole runs, with an optional ``rel_l2`` override."""

    def __init__(self, budgets: Any) -> None:
        from .. import comparators as C
        self._C = C
        if budgets is not None and (not isinstance(budgets, Mapping) or set(budgets) - {"rel_l2"}
                                    or not isinstance(budgets.get("rel_l2"), (int, float))):
            raise PrecisionDiffError(f"compare budgets: only {{'rel_l2': number}} is accepted, not "
                                     f"{budgets!r} (per-op kernel budgets are bisect's: --budget)")
        self._overrides = budgets
        self.run_dtype: Optional[str] = None  # the DUT run's dtype (from its target)
        self.single_ref = False  # every rank of A against B's single rank: shards are resolved
        self.layout: Any = None  # A's DTensor fields (shards.ShardLayout) when single_ref
        self.rank = 0  # the rank of A being compared
        self.shards: set = set()  # keys of that rank whose DTensor is not replicated

    def op_class(self, name: str) -> str:
        return str(self._C.op_class(name))

    def end_to_end(self, dtype: str, key: str, m: Mapping[str, Any], error: Optional[float]) -> Tuple[bool, str]:
        """Judge one tensor of two whole runs: NaN/Inf mismatches always fail; otherwise its
        relative L2 error (diff2) against ``end_to_end_bound`` of A's dtype (or ``rel_l2`` from
        the overrides). Per-element kernel budgets belong to isolated kernels (bisect): here
        every tensor carries its inputs' error too."""
        from ..store.schema import dtype_from_name
        bound = self._C.end_to_end_bound(dtype_from_name(dtype))
        if self.run_dtype:  # a float32 tensor of a bf16 run inherits bf16 error
            bound = max(bound, self._C.end_to_end_bound(dtype_from_name(self.run_dtype)))
        rule = f"{self._C.END_TO_END_FACTOR:g} unit roundoffs of the run's precision"
        if isinstance(self._overrides, Mapping) and isinstance(self._overrides.get("rel_l2"), (int, float)):
            bound, rule = float(self._overrides["rel_l2"]), "the rel_l2 override"
        nan_mm, inf_mm = int(m.get("nan_mismatch") or 0), int(m.get("inf_mismatch") or 0)
        numel = int(m.get("numel") or 0)
        if nan_mm or inf_mm:
            return False, (f"{key}: {nan_mm} NaN and {inf_mm} Inf mismatches of {numel} elements. "
                           "Hint: precisiondiff scan A finds the first event that produced them.")
        if error is None or error <= bound:
            return True, ""
        return False, (f"{key}: relative L2 error {error:.3g} > {bound:.3g} ({rule}); worst element: abs err {_fmt(m.get('max_abs_err'))}, rel err "
                       f"{_fmt(m.get('max_rel_err'))}, {_fmt(m.get('max_ulp_error'))} ULP. "
                       "Hint: precisiondiff bisect tells whether this op's own arithmetic is at fault.")



def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)

def num(m: Mapping[str, Any], *names: str) -> Optional[float]:
    """The first metric present among ``names`` as a float (``"inf"`` strings included)."""
    for n in names:
        v = m.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if v in ("inf", "-inf", "nan"):
            return float(v)
    return None


def is_float(dtype: Optional[str]) -> bool:
    return bool(dtype) and dtype.startswith(("float", "bfloat"))  # type: ignore[union-attr]


def compare_tensor_pair(dump_a: Any, dump_b: Any, rec_a: Any, rec_b: Any, device: Optional[str]
                         ) -> Any:
    """Element-wise metrics of one pair (a TensorMetrics; a dict for integer/bool tensors),
    read lazily and dropped after."""
    from ..comparators import compare_tensors
    ta, tb = dump_a.tensor(rec_a.key), dump_b.tensor(rec_b.key)
    if device:
        ta, tb = ta.to(device, non_blocking=True), tb.to(device, non_blocking=True)
    if not (is_float(rec_a.dtype) and is_float(rec_b.dtype)):
        mismatched = int((ta.to(tb.dtype) != tb).sum()) if ta.shape == tb.shape else -1
        return {"mismatched": mismatched, "numel": int(tb.numel())}
    return compare_tensors(ta, tb)


def bitwise(rec_a: Any, rec_b: Any) -> Optional[bool]:
    fa, fb = rec_a.stats.get("fingerprint"), rec_b.stats.get("fingerprint")
    if rec_a.dtype != rec_b.dtype or fa is None or fb is None:
        return None
    return fa == fb

def judge_row(row: Row, da: Any, db: Any, ra: Any, rb: Any, judge: Judge,
               device: Optional[str]) -> None:
    if ra.has_data and rb.has_data:
        row.mode = "tensors"
        tm = compare_tensor_pair(da, db, ra, rb, device)
        m = tm if isinstance(tm, dict) else dict(tm.to_dict())
        row.metrics = m
        if not (is_float(ra.dtype) and is_float(rb.dtype)):
            row.error = 0.0 if m["mismatched"] == 0 else 1.0
            row.verdict = "pass" if m["mismatched"] == 0 else "fail"
            if row.verdict == "fail":
                row.message = f"{ra.key}: {m['mismatched']} of {m['numel']} elements differ"
                _index_note(row, f"{m['mismatched']} of {m['numel']} indices differ")
            return
        row.op_class = judge.op_class(row.name)
        row.error = num(m, "diff2")
        if row.error is None and (m.get("nan_mismatch") or m.get("inf_mismatch")):
            row.error = math.nan
        ok, msg = judge.end_to_end(ra.dtype, ra.key, m, row.error)
        row.ulp = num(m, "max_ulp")
        if not ok:
            ok, msg = _judge_fills(row, da, db, ra, rb, judge, device, msg)
    else:
        row.mode = "stats"
        m = compare_stats(ra.stats, rb.stats)
        row.metrics = m
        ok, msg = judge_stats(m, ra.dtype, key=ra.key, run_dtype=judge.run_dtype)
        row.error = stats_error(m)
        note = None if ok else constant_fill_note(ra.stats, rb.stats, ra.dtype, rb.dtype)
        if note:
            ok, row.note, row.error = True, note, 0.0
    row.verdict = "pass" if ok else "fail"
    row.message = "" if ok else msg
    if not ok and row.mode == "stats" and not is_float(ra.dtype):
        _index_note(row, "their statistics differ")


# Ops whose integer outputs are positions chosen by comparing floating values (argmax, the indices
# of max.dim, sort, topk, ...). Two correct implementations at different precisions pick different
# positions wherever values tie within rounding, so such an output is not a divergence of its own:
# the values it selects are judged in their own rows (and downstream, where the indices are used).
_INDEX_OP = re.compile(r"\.(arg)?(max|min)\.|\.(sort|argsort|topk|kthvalue|mode|median|nanmedian|cummax|"
                       r"cummin|_cummax_helper|_cummin_helper)\.|_with_indices")


def _index_note(row: Row, what: str) -> None:
    """Pass a failing integer row of a floating selection op, with a note saying what differs."""
    if row.kind != "op" or not _INDEX_OP.search(f".{row.name}."):
        return
    row.verdict, row.message, row.error = "pass", "", 0.0
    row.note = (f"{row.key}: {what}: positions chosen among floating values, which tie differently "
                "at different precisions; judged through the values they select")


def _judge_fills(row: Row, da: Any, db: Any, ra: Any, rb: Any, judge: Judge, device: Optional[str],
                 message: str) -> Tuple[bool, str]:
    """A failing tensor row whose only difference is dtype fill constants at the same positions
    (constants.py): judged on the other elements, with a note. Else the verdict stands."""
    ta, tb = da.tensor(ra.key), db.tensor(rb.key)
    rest = rest_metrics(ta.to(device) if device else ta, tb.to(device) if device else tb)
    if rest is None:
        return False, message
    m, row.note = rest
    row.metrics, row.error, row.ulp = m, num(m, "diff2"), num(m, "max_ulp")
    return judge.end_to_end(ra.dtype, ra.key, m, row.error)


def apply_noise(row: Row, da: Any, dn: Any, ra: Any, rn: Any, device: Optional[str]) -> None:
    if ra.has_data and rn.has_data and row.mode == "tensors":
        nm = compare_tensor_pair(da, dn, ra, rn, device)
        noise_m = nm if isinstance(nm, dict) else dict(nm.to_dict())
        err, floor = num(row.metrics, "max_abs_err"), num(noise_m, "max_abs_err")
    else:
        noise_m = compare_stats(ra.stats, rn.stats)
        err, floor = stats_error(row.metrics), stats_error(noise_m)
    row.noise = floor
    if err is not None and floor and err <= NOISE_FACTOR * floor:
        row.verdict, row.within_noise = "pass", True
        row.message = (f"within run-to-run noise: error {err:.3g} <= {NOISE_FACTOR:g} x noise "
                       f"{floor:.3g}")
