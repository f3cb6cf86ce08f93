"""Budgets: how much error an op of a given class and dtype may have (the defaults table).

Metrics measure (metrics.py); a :class:`Budget` judges either tensors (:meth:`Budget.check`,
element-wise, condition-aware) or saved metrics (:meth:`Budget.judge_metrics`). Every default
lives in ``_DEFAULTS`` below; docs/comparators.md explains each number. Overrides are parsed
in overrides.py, verdicts and their message in verdict.py, whole-tensor bounds in bounds.py
(all re-exported here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from .bounds import END_TO_END_FACTOR, end_to_end_bound, peer_ratio_check
from .metrics import TensorMetrics
from .op_classes import OP_CLASSES, op_class
from .overrides import apply_override, dtype_of, parse_budget_overrides
from .verdict import Verdict, format_mismatch
from .verdict import hint as _hint
from .ulp import (
    ComparatorError,
    float_format,
    round_to_dtype,
    ulp_error,
    ulp_spacing,
)

#: elements per block of :meth:`Budget.check` (its float64 temporaries: ~8 x 16 MiB per block)
CHECK_BLOCK_ELEMENTS = 1 << 21


def _first_larger(value: float, best: float) -> bool:
    """Whether a later block's largest ratio replaces the worst so far, as ``argmax`` over the
    whole tensor would choose: a larger value, or the first NaN (argmax takes NaN as largest)."""
    if math.isnan(best):
        return False
    return math.isnan(value) or value > best


__all__ = [
    "OP_CLASSES",
    "Budget",
    "Verdict",
    "op_class",
    "budget_for",
    "condition_bound",
    "parse_budget_overrides",
    "peer_ratio_check",
    "END_TO_END_FACTOR",
    "end_to_end_bound",
    "format_mismatch",
]

# ---------------------------------------------------------------------------------------
# The one table of defaults. Per (dtype, op class):
#   max_ulp        ULP-only bound, in ulp_error units (|a - g| / spacing(g)); used when no
#                  magnitude is given and by judge_metrics. 0.5 = correctly rounded.
#   rounding_ulps  final-rounding term of the condition-aware bound.
#   accum_factor   c in  c * K * u_acc * magnitude  (K = accumulation length).
# u_acc is the unit roundoff of the accumulation dtype: float32 (2**-24) for every format up
# to float32 (the accelerator contract: accumulate in fp32, round once), float64 (2**-53) for
# float64.
# Reasoning, matmul bf16: a correct kernel returns round(C + E), |E| <= gamma_K u32 (|A||B|)
# (Higham, recursive summation in any order: gamma_K = K u / (1 - K u)), so
# |result - C| <= 0.5 spacing(C + E) + |E| <= 1 * spacing(C) + 2 K u32 (|A||B|) (the spacing
# may double when C + E crosses a binade, hence 1 ULP, not 0.5; c = 2 covers gamma_K for
# K u32 <= 1/2). A kernel that accumulates in bf16 makes errors ~ sqrt(K)..K u_bf16 (|A||B|)
# = 2**16 sqrt(K)..K times u32: above the bound for every K < 2**30, so it fails.
# Elementwise 16-bit/fp8 ops are computed in fp32 and rounded once: <= 0.5 ULP plus fp32
# libm error, so 1 ULP. fp32/fp64 elementwise: libm-grade functions (CUDA expf/erff/tanhf are
# <= 2 ULP, MLU/NPU similar) -> 4 ULP.
# ULP-only (no magnitude) bounds for sums are a coarse screen: cancellation makes correct
# results miss them; pass magnitude= and k= for a real verdict.
# ---------------------------------------------------------------------------------------
#               op class:        (max_ulp, rounding_ulps, accum_factor)
_DEFAULTS: Dict[str, Dict[str, Tuple[float, float, float]]] = {
    "low": {  # float16, bfloat16, float8_* (rounded once from an fp32 result)
        "elementwise":   (1.0, 1.0, 0.0),
        "reduction":     (2.0, 1.0, 2.0),
        "matmul":        (2.0, 1.0, 2.0),
        "normalization": (2.0, 1.0, 2.0),
        "softmax":       (1.0, 1.0, 2.0),
        "unknown":       (4.0, 4.0, 2.0),
    },
    "float32": {  # and float64: libm-grade functions, accumulation in the format itself
        "elementwise":   (4.0, 4.0, 0.0),
        "reduction":     (16.0, 1.0, 2.0),
        "matmul":        (64.0, 1.0, 2.0),
        "normalization": (16.0, 4.0, 2.0),
        "softmax":       (8.0, 8.0, 2.0),
        "unknown":       (64.0, 64.0, 2.0),
    },
}
_DEFAULTS["float64"] = _DEFAULTS["float32"]  # the same ULP counts (of float64's own spacing)

def _group(dt: torch.dtype) -> str:
    return "float64" if dt == torch.float64 else "float32" if dt == torch.float32 else "low"


@dataclass(frozen=True)
class Budget:
    """The error an op of ``op_class`` returning ``dtype`` may make.

    Per-element bound with a magnitude (condition-aware)::

        bound = rounding_ulps * spacing(golden) + accum_factor * k * u_acc * magnitude

    and without one: ``bound = max_ulp * spacing(golden)``; ``spacing`` is
    :func:`ulp_spacing` in ``dtype``, ``u_acc = 2**-(p+1)`` of ``accum_dtype``.

    Attributes:
        dtype: Result dtype name (``"bfloat16"``).
        op_class: One of ``OP_CLASSES``.
        max_ulp: ULP-only bound (ulp_error units).
        rounding_ulps: Final rounding term of the condition-aware bound, in ULPs.
        accum_factor: Constant ``c`` of the accumulation term.
        accum_dtype: Dtype the accumulation is assumed to run in.
    """

    dtype: str
    op_class: str
    max_ulp: float
    rounding_ulps: float
    accum_factor: float
    accum_dtype: str

    @property
    def u_acc(self) -> float:
        """Unit roundoff of ``accum_dtype``."""
        return float_format(dtype_of(self.accum_dtype)).unit_roundoff

    def describe(self, *, k: Optional[int] = None, with_magnitude: bool = False) -> str:
        """The bound as text, e.g. ``1 ULP + 2*K*u(float32)*magnitude, K=256``."""
        if not with_magnitude:
            return f"{self.max_ulp:g} ULP of {self.dtype}"
        return (f"{self.rounding_ulps:g} ULP + {self.accum_factor:g}*K*u({self.accum_dtype})"
                f"*magnitude, K={k}")

    def check(
        self,
        actual: torch.Tensor,
        golden: torch.Tensor,
        *,
        magnitude: Optional[torch.Tensor] = None,
        k: Optional[int] = None,
        what: str = "tensor",
    ) -> "Verdict":
        """Judge ``actual`` against ``golden`` element-wise.

        Args:
            actual: Result under test (its dtype should be ``self.dtype``).
            golden: High-precision reference (float64), same shape.
            magnitude: Optional per-element magnitude of what was accumulated, same shape as
                the output, e.g. ``|A| @ |B|`` for ``A @ B`` or ``sum |x|`` for a sum.
            k: Accumulation length (the contracted dimension); required with ``magnitude``.
            what: Name of the tensor in the message.

        Returns:
            A :class:`Verdict`. NaN where ``golden`` (rounded) is not NaN, or a wrong
            infinity, always fails.

        Raises:
            ComparatorError: Shapes differ, or ``magnitude`` without ``k`` (or the reverse).

        Example:
            >>> g = torch.randn(8, dtype=torch.float64)
            >>> budget_for("bfloat16", "elementwise").check(g.to(torch.bfloat16), g).passed
            True
        """
        if actual.shape != golden.shape:
            raise ComparatorError(
                f"{what}: shapes differ: actual {tuple(actual.shape)} vs golden "
                f"{tuple(golden.shape)}")
        if (magnitude is None) != (k is None):
            raise ComparatorError(
                f"{what}: give magnitude= and k= together (the bound is "
                "accum_factor * k * u_acc * magnitude)")
        dt = dtype_of(self.dtype)
        if magnitude is not None:
            if magnitude.shape != actual.shape:
                raise ComparatorError(
                    f"{what}: magnitude shape {tuple(magnitude.shape)} differs from "
                    f"{tuple(actual.shape)}")
            if not (isinstance(k, int) and k >= 1):
                raise ComparatorError(f"{what}: k must be a positive int, got {k!r}")
        rule = self.describe(k=k, with_magnitude=magnitude is not None)
        n = actual.numel()
        if n == 0:
            return Verdict(True, what, 0, 0, 0.0, None, math.nan, math.nan, math.nan,
                           math.nan, math.nan, math.nan, 0, 0, self,
                           f"{what}: empty tensor, nothing to judge ({rule}).")
        # In blocks of rows: the float64 temporaries (about eight per element) of a vocab-sized
        # output would otherwise take ~6x its float64 size at once (3 GiB for 32000 x 2048). Each
        # element's ratio depends on that element alone, so the counts and the worst element
        # (the first largest ratio, as argmax picks it) are those of one pass.
        rows = actual.shape[0] if actual.dim() else 1
        step = max(1, CHECK_BLOCK_ELEMENTS // max(1, n // rows)) if actual.dim() else 1
        n_over = n_nan = n_inf = 0
        worst: Optional[Tuple[float, int, float, float, float]] = None  # ratio, flat index, a, g, bound
        for start in range(0, rows, step):
            block = [t if t is None or not actual.dim() else t[start:start + step] for t in (actual, golden, magnitude)]
            ratio, a, g, bound, counts = self._ratios(*block, k, dt)
            n_over, n_nan, n_inf = n_over + counts[0], n_nan + counts[1], n_inf + counts[2]
            local = int(torch.argmax(ratio.reshape(-1)))
            value = float(ratio.reshape(-1)[local])
            if worst is None or _first_larger(value, worst[0]):
                worst = (value, start * (n // rows) + local, float(a.reshape(-1)[local]),
                         float(g.reshape(-1)[local]), float(bound.reshape(-1)[local]))
            del ratio, a, g, bound
        _, flat, wa, wg, w_bound = worst
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
        w_abs = abs(wa - wg) if not (math.isnan(wa) or math.isnan(wg)) else math.nan
        w_rel = w_abs / max(abs(wg), float_format(dt).smallest_normal)
        w_ulp = float(ulp_error(actual[idx].reshape(1), golden[idx].reshape(1), dt))
        v = Verdict(
            passed=n_over == 0, what=what, numel=n, n_over=n_over, fraction_over=n_over / n,
            worst_index=idx, worst_actual=wa, worst_golden=wg, worst_abs_err=w_abs,
            worst_rel_err=w_rel, worst_ulp_error=w_ulp, worst_bound=w_bound,
            nan_mismatch=n_nan, inf_mismatch=n_inf, budget=self,
            message="")
        hint = _hint(self, magnitude is not None)
        return replace(v, message=format_mismatch(v, rule=rule, hint=hint))

    def _ratios(self, actual: torch.Tensor, golden: torch.Tensor, magnitude: Optional[torch.Tensor],
                k: Optional[int], dt: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    Tuple[int, int, int]]:
        """:meth:`check`'s element-wise part for one block: each element's error over its bound
        (inf for a NaN or Inf mismatch), the block in float64, the bound, and the counts
        ``(over, NaN mismatches, Inf mismatches)``."""
        a = actual.to(torch.float64)
        g = golden.to(device=actual.device, dtype=torch.float64)
        sp = ulp_spacing(g, dt)
        if magnitude is not None:
            m = magnitude.to(device=actual.device, dtype=torch.float64).abs()
            bound = self.rounding_ulps * sp + self.accum_factor * k * self.u_acc * m
        else:
            bound = self.max_ulp * sp
        fin = torch.isfinite(a) & torch.isfinite(g)
        if bool(fin.all()) and float(g.abs().max()) <= float_format(actual.dtype).max_finite:
            # every element finite and the rounded golden too (no |g| beyond the format's largest
            # value): no NaN or Inf mismatch, the masks below select everything (the same values)
            ratio = (a - g).abs() / bound
            return ratio, a, g, bound, (int((ratio > 1).sum()), 0, 0)
        r = round_to_dtype(golden.to(actual.device), actual.dtype).to(torch.float64)
        a_nan, r_nan = a.isnan(), r.isnan()
        nan_mm = a_nan ^ r_nan
        inf_mm = ~a_nan & ~r_nan & (a.isinf() | r.isinf()) & (a != r)
        err = torch.where(fin, (a - g).abs(), 0.0)
        ratio = torch.where(fin, err / bound, 0.0)
        ratio = torch.where(nan_mm | inf_mm, math.inf, ratio)
        over = (ratio > 1) | nan_mm | inf_mm
        return ratio, a, g, bound, (int(over.sum()), int(nan_mm.sum()), int(inf_mm.sum()))

    def judge_metrics(self, metrics: TensorMetrics, *, what: str = "tensor") -> "Verdict":
        """Re-judge saved metrics: pass iff ``max_ulp_error <= max_ulp`` and no NaN/Inf mismatch.

        Saved metrics have no magnitude, so this is the ULP-only bound.

        Example:
            >>> g = torch.randn(8, dtype=torch.float64)
            >>> from precisiondiff.comparators import compare_tensors
        >>> m = compare_tensors(g.to(torch.bfloat16), g)
            >>> budget_for("bfloat16", "matmul").judge_metrics(m).passed
            True
        """
        worst = metrics.max_ulp_error
        bad_special = metrics.nan_mismatch + metrics.inf_mismatch
        ok_ulp = math.isnan(worst) or worst <= self.max_ulp
        passed = ok_ulp and bad_special == 0
        n = metrics.numel
        n_over = bad_special if ok_ulp else None
        v = Verdict(
            passed=passed, what=what, numel=n, n_over=n_over,
            fraction_over=(n_over / n if n and n_over is not None else (0.0 if passed else math.nan)),
            worst_index=None, worst_actual=math.nan, worst_golden=math.nan,
            worst_abs_err=metrics.max_abs_err, worst_rel_err=metrics.max_rel_err,
            worst_ulp_error=worst, worst_bound=self.max_ulp, nan_mismatch=metrics.nan_mismatch,
            inf_mismatch=metrics.inf_mismatch, budget=self, message="")
        return replace(v, message=format_mismatch(
            v, rule=self.describe(), hint=_hint(self, False)))


def budget_for(
    dtype: Union[str, torch.dtype],
    op: str,
    *,
    overrides: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Budget:
    """The budget for results of ``dtype`` from ``op`` (an op class or an op / module name).

    Overrides are applied from general to specific: ``"*"``, then the dtype name
    (``"bfloat16"``), then the op class (``"matmul"``), then an op name key, which matches
    the name exactly or as a prefix before an overload (``"aten.gelu"`` matches
    ``"aten.gelu.default"``).

    Args:
        dtype: Result dtype.
        op: An entry of ``OP_CLASSES`` or a name accepted by :func:`op_class`.
        overrides: ``{key: {field: value}}`` as built by :func:`parse_budget_overrides`.

    Returns:
        A frozen :class:`Budget`.

    Raises:
        UnsupportedDtypeError: ``dtype`` has no ULP definition.
        ComparatorError: An override names an unknown field or a bad value.

    Example:
        >>> budget_for(torch.bfloat16, "aten.gelu.default",
        ...            overrides={"aten.gelu.default": {"max_ulp": 4}}).max_ulp
        4.0
    """
    dt = dtype_of(dtype)
    cls = op if op in OP_CLASSES else op_class(op)
    max_ulp, rounding, accum = _DEFAULTS[_group(dt)][cls]
    name = str(dt).replace("torch.", "")
    b = Budget(name, cls, max_ulp, rounding, accum,
               "float64" if dt == torch.float64 else "float32")
    if not overrides:
        return b
    ordered = ["*", name, cls]
    for key in ordered:
        if key in overrides:
            b = apply_override(b, key, overrides[key])
    if op not in OP_CLASSES:
        for key, changes in sorted(overrides.items(), key=lambda kv: len(kv[0])):
            if key in ordered or key in OP_CLASSES:
                continue
            if op == key or op.startswith(key + "."):
                b = apply_override(b, key, changes)
    return b


def condition_bound(
    op_class: str, dtype: Union[str, torch.dtype], k: int, magnitude: torch.Tensor
) -> torch.Tensor:
    """Accumulation term of the bound: ``accum_factor * k * u_acc * magnitude`` (float64).

    Linear in ``k`` (the rigorous worst case of recursive summation, ``gamma_k``), not
    ``sqrt(k)`` (the typical case): a correct fp32-accumulating kernel always passes, and a
    bf16-accumulating kernel still fails because ``u_bf16 / u_fp32 = 2**16 >> sqrt(k)``.

    Example:
        >>> condition_bound("matmul", "bfloat16", 256, torch.tensor([1.0])).item() == 2 * 256 * 2**-24
        True
    """
    b = budget_for(dtype, op_class)
    return b.accum_factor * k * b.u_acc * magnitude.to(torch.float64).abs()


