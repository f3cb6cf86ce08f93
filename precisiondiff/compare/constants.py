"""Fill constants that differ between dtypes by design, and are not divergence.

Models fill masks with the extreme of their own dtype: T5 and most attention code write
``torch.finfo(dtype).min`` (``aten.full``, ``aten.scalar_tensor``, ``masked_fill``), others write
``-inf``. A bf16 run then holds ``-3.39e38`` where the float64 reference holds ``-1.80e308``;
measured in bf16 the reference overflows to ``-inf`` and the row reads as an Inf mismatch. Both
mean "minus infinity for practical purposes" and have the same effect after the softmax (zero
weight), which the downstream rows confirm on their own.

Rule (element-wise, A in dtype ``da``, B in dtype ``db``): an element is a *fill* of dtype ``d``
when it is infinite or ``|x| >= finfo(d).max / 2`` (saturated: nothing a model computes on
purpose). A pair of tensors is *fill-equivalent* when at least one element is a fill, the fills
of A and of B sit at exactly the same positions with the same signs, and A and B are not
bitwise equal there; the remaining elements are then judged as usual. A fill in one tensor
where the other holds an ordinary value (an overflow) is divergence, as before.

Stats-only dumps hold no positions: a row is fill-equivalent there when both sides' extremes
(``min`` and/or ``max``) are fills of their own dtype, the same extremes with the same signs. A
constant tensor is then fully judged; in a partly filled one the fills dominate every statistic,
so its other elements go unjudged there (the row's note says so; the rows downstream are judged).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

from .stats import stat_value

__all__ = ["fill_mask", "fill_note", "rest_metrics", "constant_fill_note"]


def _limit(dtype: Any) -> float:
    import torch
    return float(torch.finfo(dtype).max) / 2


def fill_mask(a: Any, b: Any) -> Optional[Any]:
    """The positions where A and B both hold a fill of their own dtype, or None.

    None when there is no fill, when the fills do not coincide (position or sign), or when the
    fills are equal anyway (nothing to excuse).

    Args:
        a: A's tensor (the DUT), any floating dtype.
        b: B's tensor (the reference), same shape.

    Returns:
        A bool tensor of A's shape, or None.

    Example:
        >>> import torch
        >>> a = torch.tensor([1.0, torch.finfo(torch.bfloat16).min], dtype=torch.bfloat16)
        >>> fill_mask(a, torch.tensor([1.0, torch.finfo(torch.float64).min], dtype=torch.float64))
        tensor([False,  True])
    """
    import torch
    if a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()):
        return None
    a64, b64 = a.to(torch.float64), b.to(torch.float64)  # float64 holds every value of A and B
    fa = torch.isinf(a64) | (a64.abs() >= _limit(a.dtype))
    fb = torch.isinf(b64) | (b64.abs() >= _limit(b.dtype))
    if not bool(fa.any()) or not torch.equal(fa, fb):
        return None
    if not torch.equal(torch.sign(a64[fa]), torch.sign(b64[fb])):
        return None
    if torch.equal(a64[fa], b64[fb]):
        return None
    return fa


def fill_note(a: Any, b: Any, mask: Any) -> str:
    """One line for the row: which constants, how many elements."""
    import torch
    n, total = int(mask.sum()), mask.numel()
    va, vb = float(a.to(torch.float64)[mask].flatten()[0]), float(b.to(torch.float64)[mask].flatten()[0])
    rest = "" if n == total else " (the other elements are judged)"
    return (f"dtype fill constants: {_name(va, a.dtype)} in A vs {_name(vb, b.dtype)} in B at {n} of "
            f"{total} elements; equivalent by design{rest}")


def rest_metrics(a: Any, b: Any) -> Optional[Tuple[Dict[str, Any], str]]:
    """For fill-equivalent tensors: the metrics of the other elements (``compare_tensors``, plus
    ``fill_elements``) and the row's note; None when the tensors are not fill-equivalent."""
    from ..comparators import compare_tensors
    mask = fill_mask(a, b)
    if mask is None:
        return None
    rest_a, rest_b = a[~mask], b[~mask]
    m = dict(compare_tensors(rest_a, rest_b).to_dict()) if rest_a.numel() else {"diff2": 0.0, "numel": 0}
    m["fill_elements"] = int(mask.sum())
    return m, fill_note(a, b, mask)


def _name(value: float, dtype: Any) -> str:
    import torch
    short = str(dtype).removeprefix("torch.")
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    info = torch.finfo(dtype)
    if value == float(info.min):
        return f"finfo({short}).min"
    if value == float(info.max):
        return f"finfo({short}).max"
    return f"{value:.3g} ({short})"


def constant_fill_note(stats_a: Mapping[str, Any], stats_b: Mapping[str, Any], dtype_a: str,
                       dtype_b: str) -> Optional[str]:
    """For a failing stats-only row: a note when its extremes are fills on both sides, else None.

    Both sides' ``min`` (and/or ``max``) must be fills of their own dtype, the same ones with the
    same signs, and the NaN counts equal. A constant tensor (``min == max``) is then equivalent;
    a partly filled one has statistics dominated by its fills, so the rest cannot be judged
    here (the note says so; capture ``--mode tensors`` to judge it element by element).
    """
    from ..store.schema import dtype_from_name
    try:
        da, db = dtype_from_name(dtype_a), dtype_from_name(dtype_b)
    except Exception:  # an unknown dtype name: not a float pair, nothing to excuse
        return None
    if not (da.is_floating_point and db.is_floating_point):
        return None
    sides = []
    for stats, dtype in ((stats_a, da), (stats_b, db)):
        lo, hi = stat_value(stats.get("min")), stat_value(stats.get("max"))
        if lo is None or hi is None or stat_value(stats.get("nan")) != stat_value(stats_b.get("nan")):
            return None
        fill = lambda v: math.isinf(v) or abs(v) >= _limit(dtype)  # noqa: E731
        sides.append(((fill(lo) and lo < 0), (fill(hi) and hi > 0), lo, hi))
    (lo_fill, hi_fill, lo_a, hi_a), (lo_fill_b, hi_fill_b, lo_b, hi_b) = sides
    if (lo_fill, hi_fill) != (lo_fill_b, hi_fill_b) or not (lo_fill or hi_fill):
        return None
    va, vb = (lo_a, lo_b) if lo_fill else (hi_a, hi_b)
    if lo_a == hi_a and lo_b == hi_b:
        return (f"dtype fill constants: {_name(va, da)} in A vs {_name(vb, db)} in B (constant "
                "tensors); equivalent by design")
    return (f"dtype fill constants: {_name(va, da)} in A vs {_name(vb, db)} in B dominate the "
            "statistics; the other elements are not judged in stats mode (capture --mode tensors)")
