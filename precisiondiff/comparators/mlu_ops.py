"""Cambricon mlu-ops' accuracy acceptance rule, as a named rule (``--rule mlu-ops``).

mlu-ops accepts a kernel by its error against a baseline (docs/comparators.md, "The mlu-ops rule"):

* ``diff1 = sum |a - b| / sum |b|`` (mean relative error), ``diff2 = sqrt(sum (a - b)^2 / sum b^2)``
  (relative L2), ``diff3 = max_i (|b_i| < th ? |a_i - b_i| : |a_i - b_i| / |b_i|)`` (the worst element,
  absolute below ``th``, relative above; th 1e-6 float32, 1e-4 float16), from
  ``test/mlu_op_gtest/pb_gtest/include/evaluator.h`` (``computeDiff1/2/3``);
* a static threshold per op class, from ``docs/MLU-OPS-Accuracy-Acceptance-Standard.md``: convolution
  float diff1, diff2 <= 1e-5 and half <= 3e-3; accumulation, activation, composite and atomicAdd ops
  diff1, diff2 <= 3e-3; arithmetic and pure-IO ops diff3 == 0;
* the dynamic threshold: ``diffN(DUT) <= max(10 x diffN(baseline implementation), static_N)``, the
  baseline implementation being the GPU (issue 21, /work/shared/peers/anchors-2026-12.md §1.5).

Here the errors are against the float64 golden, the baseline implementation is the real peer
(``--peer``) or, without one, the emulated peers (the most lenient); an arithmetic or pure-IO op's
``diff3`` is taken against the golden rounded to the DUT's dtype, which is what mlu-ops' same-precision
CPU baseline of an exact op is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from .metrics import compare_tensors
from .op_classes import _base_name, op_class

__all__ = ["MLU_OPS_FACTOR", "MLU_OPS_CLASSES", "MLU_OPS_SOURCES", "RULES", "mlu_ops_class", "static_thresholds",
           "mlu_ops_diffs", "judge_mlu_ops", "MluOpsVerdict"]

#: The rule names bisect and check_op accept (``--rule``).
RULES = ("peer", "mlu-ops")
#: mlu-ops' dynamic threshold: 10 x the baseline implementation's error.
MLU_OPS_FACTOR = 10.0
#: Where each part of the rule was read (Cambricon/mlu-ops, public repository).
MLU_OPS_SOURCES = {
    "formulas": "Cambricon/mlu-ops test/mlu_op_gtest/pb_gtest/include/evaluator.h (computeDiff1, computeDiff2, "
                "computeDiff3; th EPSILON_FLOAT 1e-6, EPSILON_HALF 1e-4)",
    "static": "Cambricon/mlu-ops docs/MLU-OPS-Accuracy-Acceptance-Standard.md (commit f1a1164), section 2",
    "dynamic": "max(10 x GPU baseline diff, static): issue 21 and anchors-2026-12 section 1.5 (not found in the "
               "stored mlu-ops files, whose gtest baseline strategy compares with a previous run)",
}
MLU_OPS_CLASSES = ("convolution", "accumulation", "activation", "arithmetic", "io", "composite", "atomic")

# Exact ops: a correct kernel returns the correctly rounded result (diff3 == 0 against it).
_ARITHMETIC = {
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "maximum", "minimum", "clamp", "clamp_min", "clamp_max",
    "where", "sign", "floor", "ceil", "round", "trunc", "relu", "square", "reciprocal", "fmod", "remainder",
    "hardtanh", "threshold", "threshold_backward", "le", "lt", "ge", "gt", "eq", "ne", "max", "min", "amax",
    "amin", "masked_fill", "addcmul", "lerp",
}
_IO = {
    "_to_copy", "to", "copy", "copy_", "clone", "contiguous", "cat", "stack", "split", "chunk", "index",
    "index_select", "gather", "embedding", "slice", "select", "view", "reshape", "t", "transpose", "permute",
    "expand", "unsqueeze", "squeeze", "flatten", "_unsafe_view", "alias", "detach", "fill", "zeros_like",
    "ones_like", "constant_pad_nd", "repeat", "flip", "roll", "narrow", "unfold", "scatter",
}
_ATOMIC = {"index_add", "scatter_add", "scatter_reduce", "embedding_dense_backward", "embedding_backward",
           "_embedding_bag_backward", "_embedding_bag_dense_backward", "index_put"}
_CONVOLUTION = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                "conv_transpose3d", "cudnn_convolution", "mkldnn_convolution", "convolution_backward", "mm",
                "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "dot", "vdot", "mv", "addmv", "einsum",
                "tensordot", "_scaled_mm", "_grouped_mm", "_int_mm"}
# static thresholds: (diff1, diff2) for the ops judged by them, diff3 for the exact ones
_LOOSE = 3e-3
_CONV_FLOAT = 1e-5


def mlu_ops_class(op_name: str) -> str:
    """The mlu-ops class of an ATen op or module class name (one of ``MLU_OPS_CLASSES``).

    GEMMs are convolution-class (on the MLU they run on the same matrix instructions); our
    ``normalization``, ``softmax``, attention and unknown (custom) ops are composite.
    """
    base = _base_name(op_name)
    if base.endswith("_") and not base.startswith("_"):
        base = base[:-1]
    if base in _CONVOLUTION or base[:1].isupper() and op_class(base) == "matmul" and "Attention" not in base:
        return "convolution"
    if base in _ATOMIC:
        return "atomic"
    if base in _ARITHMETIC:
        return "arithmetic"
    if base in _IO:
        return "io"
    cls = op_class(op_name)
    if cls == "reduction":
        return "accumulation"
    if cls == "elementwise":
        return "activation"
    return "composite"


def static_thresholds(cls: str, dtype: torch.dtype) -> Dict[str, float]:
    """mlu-ops' static thresholds of ``cls`` for ``dtype``: ``{"diff1": .., "diff2": ..}`` or
    ``{"diff3": 0.0}``. mlu-ops distinguishes float and half; bfloat16 and float8 take half's,
    float64 float's (our extension, as for diff3's ``th``)."""
    if cls in ("arithmetic", "io"):
        return {"diff3": 0.0}
    wide = dtype in (torch.float32, torch.float64)
    t = _CONV_FLOAT if cls == "convolution" and wide else _LOOSE
    return {"diff1": t, "diff2": t}


def mlu_ops_diffs(actual: torch.Tensor, baseline: torch.Tensor) -> Dict[str, float]:
    """diff1, diff2, diff3 of ``actual`` against ``baseline`` over the elements finite in both
    (:class:`~precisiondiff.comparators.metrics.TensorMetrics`; mlu-ops' ``+ 1e-9`` in the
    denominators is left out, so a small tensor is not flattered). 0.0 for an empty tensor."""
    if actual.numel() == 0:
        return {"diff1": 0.0, "diff2": 0.0, "diff3": 0.0}
    m = compare_tensors(actual.detach(), baseline.detach())
    nan0 = lambda v: 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)  # noqa: E731
    return {"diff1": nan0(m.diff1), "diff2": nan0(m.diff2), "diff3": nan0(m.diff3)}


@dataclass(frozen=True)
class MluOpsVerdict:
    """The mlu-ops rule's judgement of one tensor.

    Attributes:
        passed: every judged criterion holds and no NaN/Inf goes unexplained.
        op_class: the mlu-ops class (``MLU_OPS_CLASSES``).
        diffs: the DUT's diff1, diff2, diff3 against the golden (and ``diff3`` against the rounded
            golden for an exact op: ``diff3_rounded``).
        baseline: the implementation the dynamic threshold is 10x of (a real peer's name, or
            ``"emulated"``); ``baseline_diffs`` its diffs (per peer in ``peer_diffs``).
        criteria: ``{name: {"value", "static", "baseline", "threshold", "passed"}}`` of the judged diffs.
        special_mismatch: NaN/Inf positions no peer explains.
        message: one line when it fails; ``notes`` facts reported without a verdict.
    """

    passed: bool
    op_class: str
    diffs: Dict[str, float]
    baseline: str
    baseline_diffs: Dict[str, float]
    peer_diffs: Dict[str, Dict[str, float]]
    criteria: Dict[str, Dict[str, Any]]
    special_mismatch: int
    ratio: float
    message: str = ""
    notes: Tuple[str, ...] = ()
    relative_l2: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe fields; ``error``, ``peer_error``, ``peers``, ``bound``, ``factor``, ``max_error``
        and ``ratio`` carry the same meaning as the peer rule's (relative L2 and worst element)."""
        def safe(v: Any) -> Any:
            return repr(v) if isinstance(v, float) and not math.isfinite(v) else v
        d2 = self.criteria.get("diff2") or self.criteria.get("diff3") or {}
        return {"rule": "mlu-ops", "passed": self.passed, "op_class": self.op_class,
                "diffs": {k: safe(v) for k, v in self.diffs.items()}, "baseline": self.baseline,
                "baseline_diffs": {k: safe(v) for k, v in self.baseline_diffs.items()},
                "criteria": {k: {f: safe(v) for f, v in c.items()} for k, c in self.criteria.items()},
                "factor": MLU_OPS_FACTOR, "error": safe(self.diffs.get("diff2", 0.0)),
                "peer_error": safe(self.baseline_diffs.get("diff2", 0.0)),
                "peers": {n: safe(v) for n, v in self.relative_l2.items()}, "bound": safe(d2.get("threshold")),
                "floor": safe(d2.get("static")), "max_error": safe(self.diffs.get("diff3", 0.0)),
                "peer_max_error": safe(self.baseline_diffs.get("diff3", 0.0)), "ratio": safe(self.ratio),
                "special_mismatch": self.special_mismatch, "stats": {}, "notes": list(self.notes),
                "sources": dict(MLU_OPS_SOURCES)}


def _specials(d: torch.Tensor, g: torch.Tensor, peers: Sequence[torch.Tensor]) -> int:
    """NaN/Inf positions where the DUT differs from the rounded golden and from every peer."""
    rounded = g.to(d.dtype)
    same = lambda a, b: (a == b) | (torch.isnan(a) & torch.isnan(b))  # noqa: E731
    bad = ~(torch.isfinite(d) & torch.isfinite(g)) & ~same(d, rounded)
    for p in peers:
        bad &= ~same(d, p.to(d.dtype))
    return int(bad.sum())


def judge_mlu_ops(dut: torch.Tensor, golden: torch.Tensor, peers: Mapping[str, Optional[torch.Tensor]], *,
                  op: str, real_peer: Optional[str] = None, what: str = "output") -> MluOpsVerdict:
    """Judge ``dut`` by mlu-ops' rule (module docstring).

    Args:
        dut: the kernel's output, in its own dtype.
        golden: the float64 output on the same inputs.
        peers: implementations in the DUT's dtype on the same inputs (``{name: tensor or None}``);
            empty: the static thresholds alone judge (a kernel that passes them passes any baseline).
        op: the op's name, for its mlu-ops class.
        real_peer: the name in ``peers`` of a real second implementation: then it alone is the
            baseline (mlu-ops' GPU); otherwise the emulated peers are, the most lenient counting.
        what: the tensor's name in the message.
    """
    cls = mlu_ops_class(op)
    dtype = dut.dtype
    d = dut.detach()
    g = golden.detach().to(device=d.device, dtype=torch.float64).reshape(d.shape)
    ps = {n: p.detach().to(d.device).reshape(d.shape) for n, p in peers.items()
          if p is not None and p.numel() == d.numel()}
    static = static_thresholds(cls, dtype)
    exact = "diff3" in static
    rounded = g.to(dtype) if exact else None

    def diffs_of(x: torch.Tensor) -> Dict[str, float]:
        out = mlu_ops_diffs(x, g)
        if exact:
            out["diff3_rounded"] = mlu_ops_diffs(x, rounded)["diff3"]
        return out
    dut_diffs = diffs_of(d)
    peer_diffs = {n: diffs_of(p) for n, p in ps.items()}
    if real_peer is not None and real_peer in peer_diffs:
        baseline, chosen = real_peer, {real_peer: peer_diffs[real_peer]}
    else:
        baseline, chosen = ("emulated" if peer_diffs else "none"), peer_diffs
    base = {k: max((v[k] for v in chosen.values()), default=0.0) for k in dut_diffs}
    criteria: Dict[str, Dict[str, Any]] = {}
    ratio = 0.0
    for name, s in static.items():
        key = "diff3_rounded" if exact else name
        value, b = dut_diffs[key], base[key]
        threshold = max(MLU_OPS_FACTOR * b, s)
        ok = value <= threshold
        criteria[name] = {"value": value, "static": s, "baseline": b, "threshold": threshold, "passed": ok}
        r = value / threshold if threshold > 0 else (0.0 if value == 0 else math.inf)
        ratio = max(ratio, r)
    n_special = _specials(d, g, list(ps.values()))
    passed = n_special == 0 and all(c["passed"] for c in criteria.values())
    notes = []
    if baseline == "emulated":
        notes.append("no real peer: the baseline is the emulated peers (float32 rounded once, PyTorch's "
                     "decomposition in the DUT dtype), standing in for mlu-ops' GPU")
    message = ""
    if not passed:
        parts = [f"{n} {c['value']:.3g} exceeds max({MLU_OPS_FACTOR:g} x {baseline} {c['baseline']:.3g}, "
                 f"static {c['static']:g}) = {c['threshold']:.3g}"
                 + (" (against the golden rounded to " + str(dtype).replace("torch.", "") + ")" if exact else "")
                 for n, c in criteria.items() if not c["passed"]]
        if n_special:
            parts.append(f"{n_special} NaN/Inf where the golden and every peer differ")
        message = f"{what}: mlu-ops rule ({cls} op): " + "; ".join(parts)
    return MluOpsVerdict(passed, cls, dut_diffs, baseline, base, peer_diffs, criteria, n_special, ratio, message,
                         tuple(notes), {n: v["diff2"] for n, v in peer_diffs.items()})
