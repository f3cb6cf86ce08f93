"""The one place bisect touches the comparators' API (``compare_tensors``, ``budget_for``,
``op_class``, ``Budget.check``).

Until that API is importable, a provisional stand-in with the same per-element bound
(``rounding_ulps * spacing(golden) + accum_factor * u_acc * magnitude``) keeps bisect usable;
it is deleted once ``precisiondiff.comparators`` exports the budget API.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional

import torch

try:  # the comparators' budget API
    from ..comparators import OP_CLASSES, budget_for, compare_tensors, op_class  # type: ignore[attr-defined]
    HAVE_COMPARATORS = True
except ImportError:  # pragma: no cover - provisional, see the module docstring
    HAVE_COMPARATORS = False

__all__ = ["HAVE_COMPARATORS", "budget_for_op", "check", "metrics", "as_dict", "message"]


def _as_plain(obj: Any) -> Dict[str, Any]:
    if obj is None:
        return {}
    if dataclasses.is_dataclass(obj):
        raw = dataclasses.asdict(obj)
    elif isinstance(obj, dict):
        raw = dict(obj)
    elif hasattr(obj, "to_dict"):
        raw = obj.to_dict()
    else:
        raw = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    out = {}
    for k, v in raw.items():
        if isinstance(v, torch.dtype):
            v = str(v).removeprefix("torch.")
        if isinstance(v, float) and not math.isfinite(v):
            v = repr(v)
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


# ---- provisional stand-in -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Budget:
    dtype: str
    op_class: str
    rounding_ulps: float
    accum_factor: float
    u_acc: float


@dataclasses.dataclass(frozen=True)
class _Verdict:
    passed: bool
    failed: int
    worst_excess: float


_MATMUL = {"mm", "bmm", "addmm", "matmul", "baddbmm", "addbmm", "addmv", "mv", "dot", "linear",
           "convolution", "_convolution"}
_REDUCTION = {"sum", "mean", "cumsum", "prod", "var", "std", "norm", "linalg_vector_norm"}
_NORM = {"_softmax", "_log_softmax", "native_layer_norm", "native_group_norm", "native_batch_norm",
         "_fused_rms_norm", "rms_norm", "softmax", "log_softmax"}


def _fallback_class(name: str) -> str:
    parts = name.split(".")
    base = parts[-2] if len(parts) >= 2 else name
    if base in _MATMUL:
        return "matmul"
    if base in _REDUCTION:
        return "reduction"
    if base in _NORM or "norm" in base or "softmax" in base:
        return "normalization"
    return "elementwise"


_KEYWORDS = (("softmax", "softmax"), ("norm", "normalization"), ("matmul", "matmul"),
             ("gemm", "matmul"), ("linear", "matmul"), ("attention", "matmul"), ("sum", "reduction"),
             ("reduce", "reduction"))


def classify(name: str, module_class: Optional[str] = None) -> str:
    """The op class of ``name``; for a custom op the comparators call ``unknown``, what its name
    says it computes (``fused_rms_norm`` -> normalization), else its module's class."""
    if not HAVE_COMPARATORS:
        return _fallback_class(name)
    cls = op_class(name)
    if cls != "unknown":
        return cls
    parts = name.split(".")
    base = (parts[-2] if len(parts) >= 3 else name).lower()
    for word, guess in _KEYWORDS:
        if word in base:
            return guess
    if module_class:
        return op_class(module_class)
    return cls


def budget_for_op(name: str, dtype: torch.dtype, module_class: Optional[str] = None,
                  overrides: Optional[Dict[str, Dict[str, Any]]] = None) -> Any:
    """The budget of op ``name`` with results in ``dtype``.

    ``overrides`` (as :func:`precisiondiff.comparators.parse_budget_overrides` builds) apply as
    in :func:`~precisiondiff.comparators.budget_for`: ``*``, the dtype, the op class (here the
    class bisect assigns, custom ops included), then op-name keys (exact, or a prefix before the
    overload: ``pdtest.fused_softmax`` matches ``pdtest.fused_softmax.default``).
    """
    if HAVE_COMPARATORS:
        cls = classify(name, module_class)
        if cls not in OP_CLASSES:
            cls = "unknown"
        if not overrides:
            return budget_for(dtype, cls)
        generic = {k: v for k, v in overrides.items() if "." not in k}
        b = budget_for(dtype, cls, overrides=generic)
        for key, changes in sorted(overrides.items(), key=lambda kv: len(kv[0])):
            if "." in key and (name == key or name.startswith(key + ".")):
                checked = budget_for(dtype, cls, overrides={"*": changes})  # validates the fields
                b = dataclasses.replace(b, **{f: getattr(checked, f) for f in changes})
        return b
    cls = _fallback_class(name)
    ulps = {"elementwise": 1.0, "matmul": 1.0, "reduction": 1.0, "normalization": 2.0}[cls]
    accum = {"elementwise": 0.0, "matmul": 4.0, "reduction": 4.0, "normalization": 0.0}[cls]
    return _Budget(str(dtype).removeprefix("torch."), cls, ulps, accum, 2.0 ** -24)


def check(budget: Any, dut: torch.Tensor, golden: torch.Tensor, magnitude: Optional[torch.Tensor],
          k: Optional[int] = None, what: str = "tensor") -> Any:
    if HAVE_COMPARATORS:
        if magnitude is None or k is None:
            return budget.check(dut, golden, what=what)
        return budget.check(dut, golden, magnitude=magnitude, k=k, what=what)
    from ..comparators import ulp_spacing
    g = golden.detach().to(torch.float64)
    d = dut.detach().to(device=g.device, dtype=torch.float64)
    nan_bad = torch.isnan(d) ^ torch.isnan(g)
    spacing = ulp_spacing(g, dut.dtype).to(torch.float64)
    bound = budget.rounding_ulps * spacing
    if magnitude is not None:
        bound = bound + budget.accum_factor * budget.u_acc * magnitude.to(torch.float64).abs()
    err = (d - g).abs()
    finite = torch.isfinite(g) & torch.isfinite(d)
    inf_bad = (torch.isinf(g) | torch.isinf(d)) & ~(d == g) & ~torch.isnan(d) & ~torch.isnan(g)
    over = (err > bound) & finite
    bad = over | nan_bad | inf_bad
    failed = int(bad.sum())
    excess = float((err[finite] / bound[finite].clamp_min(1e-300)).max()) if bool(finite.any()) else 0.0
    return _Verdict(failed == 0, failed, excess)


def metrics(dut: torch.Tensor, golden: torch.Tensor) -> Dict[str, Any]:
    if HAVE_COMPARATORS:
        return _as_plain(compare_tensors(dut, golden))
    from ..comparators import ulp_error
    g = golden.detach().to(torch.float64)
    d = dut.detach().to(device=g.device, dtype=torch.float64)
    finite = torch.isfinite(g) & torch.isfinite(d)
    err = (d - g).abs()[finite]
    rel = err / g.abs()[finite].clamp_min(torch.finfo(torch.float64).tiny)
    ulps = ulp_error(d, g, dut.dtype).abs()[finite] if d.numel() else err
    out = {"max_abs": float(err.max()) if err.numel() else 0.0,
           "max_rel": float(rel.max()) if rel.numel() else 0.0,
           "max_ulp": float(ulps.max()) if ulps.numel() else 0.0,
           "mean_ulp": float(ulps.mean()) if ulps.numel() else 0.0,
           "numel": int(d.numel())}
    return out


def as_dict(budget: Any) -> Dict[str, Any]:
    return _as_plain(budget)


def message(verdict: Any, slot: str) -> str:
    if verdict.passed:
        return ""
    text = getattr(verdict, "message", None)
    if isinstance(text, str) and text:
        return text
    return f"{slot}: {getattr(verdict, 'failed', '?')} elements over budget"
