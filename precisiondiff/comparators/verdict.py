"""Verdicts: a budget's judgement of one tensor, and the one mismatch message format."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from .tolerance import Budget

__all__ = ["Verdict", "format_mismatch", "hint"]


@dataclass(frozen=True)
class Verdict:
    """A budget's judgement of one tensor.

    Attributes:
        passed: No element over its bound and no NaN/Inf mismatch.
        what: Tensor name used in ``message``.
        numel: Elements judged.
        n_over: Elements over the bound (None when judged from metrics and unknown).
        fraction_over: ``n_over / numel``.
        worst_index: Index of the element with the largest error/bound ratio (None from
            metrics).
        worst_actual, worst_golden: Its values.
        worst_abs_err, worst_rel_err, worst_ulp_error: Its errors (from metrics: the maxima).
        worst_bound: The bound at that element (absolute; from metrics: in ULPs).
        nan_mismatch, inf_mismatch: Special-value mismatches (always failures).
        budget: The :class:`Budget` that judged.
        message: The one mismatch message (see :func:`format_mismatch`).
    """

    passed: bool
    what: str
    numel: int
    n_over: Optional[int]
    fraction_over: float
    worst_index: Optional[Tuple[int, ...]]
    worst_actual: float
    worst_golden: float
    worst_abs_err: float
    worst_rel_err: float
    worst_ulp_error: float
    worst_bound: float
    nan_mismatch: int
    inf_mismatch: int
    budget: "Budget"
    message: str


def hint(b: "Budget", with_magnitude: bool) -> str:
    """The Hint line of a mismatch message for budget ``b``."""
    if b.op_class in ("matmul", "reduction", "normalization", "softmax") and not with_magnitude:
        return ("pass magnitude= (e.g. |A|@|B|) and k= to judge against the input condition, "
                "or bisect to see whether this op's own arithmetic is at fault.")
    if with_magnitude:
        return (f"the error exceeds {b.accum_dtype} accumulation; check the kernel's accumulation "
                "dtype and order (precisiondiff bisect names the op).")
    return ("replay the op on the reference with the same inputs (precisiondiff bisect); if the "
            "kernel is approximate by design, override max_ulp for it.")


def format_mismatch(v: Verdict, *, rule: str, hint: str) -> str:
    """The one mismatch message format (STYLE.md habit 5).

    ``WHAT: N of M elements (P%) exceed the DTYPE OP_CLASS budget.`` then the worst element
    with index, values and abs/rel/ULP error, the bound allowed, NaN/Inf mismatches when any,
    and ``Hint:``. A pass is one line.
    """
    b = v.budget
    if v.passed:
        return (f"{v.what}: all {v.numel} elements within the {b.dtype} {b.op_class} budget "
                f"({rule}); worst {v.worst_ulp_error:.3g} ULP.")
    count = "?" if v.n_over is None else str(v.n_over)
    frac = "" if v.n_over is None else f" ({100 * v.fraction_over:.3g}%)"
    if v.worst_index is None:
        where = "Worst"
        vals = ""
    else:
        where = f"Worst at index {v.worst_index}"
        vals = f": actual {v.worst_actual!r}, golden {v.worst_golden!r}"
    lines = [
        f"{v.what}: {count} of {v.numel} elements{frac} exceed the {b.dtype} {b.op_class} budget.",
        f"{where}{vals}: abs err {v.worst_abs_err:.3g}, rel err {v.worst_rel_err:.3g}, "
        f"{v.worst_ulp_error:.3g} ULP; bound {v.worst_bound:.3g} ({rule}).",
    ]
    if v.nan_mismatch or v.inf_mismatch:
        lines.append(f"NaN mismatches: {v.nan_mismatch}, Inf mismatches: {v.inf_mismatch}.")
    lines.append(f"Hint: {hint}")
    return "\n".join(lines)
