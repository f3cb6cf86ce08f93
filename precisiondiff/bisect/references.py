"""Reference implementations for ops the reference target cannot run itself.

A vendor fused kernel (a ``torch_mlu`` custom op, say) often has no CPU or float64
implementation. Bisect then localizes a fault to the innermost module around it; registering a
reference lets it judge the op itself::

    precisiondiff.register_reference("torch_mlu.fused_rms_norm.default",
                                      lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)

The function receives the op's arguments exactly as recorded, with floating tensors upcast to
the reference dtype on the reference device, and returns what the op returns.

Built in (:data:`BUILTIN_REFERENCES`, a registration overrides them): the stock ops with no float64
kernel, written with the same semantics in any dtype: ``aten._grouped_mm`` (an MoE's experts in
transformers 5), ``aten._scaled_mm`` (fp8 GEMMs: the inputs times their scales, then a matmul),
``aten._int_mm`` (exact in int64), and the fused attention kernels of GPUs and MLUs with their backward
ops (:mod:`.attention_references`). Those are written as the math attention, so the same function run
in the DUT dtype is also their decomposition peer (:func:`math_semantics`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..errors import BisectError
from .attention_references import ATTENTION_REFERENCES

__all__ = ["register_reference", "unregister_reference", "reference_for", "normalize_op_name",
           "BUILTIN_REFERENCES", "grouped_mm_reference", "scaled_mm_reference", "int_mm_reference",
           "math_semantics"]

_REFERENCES: Dict[str, Callable] = {}


def normalize_op_name(name: str) -> str:
    """``ns::op`` or ``ns.op`` (overload ``default`` implied) → ``ns.op.overload``.

    Raises:
        BisectError: the name has no namespace.

    Example:
        >>> normalize_op_name("mylib::fused_softmax")
        'mylib.fused_softmax.default'
    """
    text = name.strip().replace("::", ".")
    parts = text.split(".")
    if len(parts) < 2 or not all(parts):
        raise BisectError(f"op name {name!r} must be namespace.op[.overload], e.g. "
                          "torch_mlu.fused_rms_norm.default or torch_mlu::fused_rms_norm")
    if len(parts) == 2:
        parts.append("default")
    return ".".join(parts)


def register_reference(op_name: str, fn: Callable) -> None:
    """Register ``fn`` as the golden implementation of ``op_name`` for bisect.

    Args:
        op_name: ``namespace.op.overload`` as bisect names it (``ns::op`` accepted).
        fn: called with the op's arguments (floating tensors upcast to the reference dtype).

    Raises:
        BisectError: the name is malformed or ``fn`` is not callable.

    Example:
        >>> register_reference("mylib::fused_softmax", lambda x, dim: x.softmax(dim))
    """
    if not callable(fn):
        raise BisectError(f"register_reference({op_name!r}, ...): the reference must be callable")
    _REFERENCES[normalize_op_name(op_name)] = fn


def unregister_reference(op_name: str) -> None:
    """Forget the reference registered for ``op_name`` (no error when there is none)."""
    _REFERENCES.pop(normalize_op_name(op_name), None)


def reference_for(op_name: str) -> Optional[Callable]:
    """The registered reference of ``op_name`` (``ns.op.overload``), else the built-in one, or None."""
    return _REFERENCES.get(op_name) or BUILTIN_REFERENCES.get(op_name)


def _groups(offs: torch.Tensor) -> List[Any]:
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``aten._grouped_mm`` in the dtype of its inputs; ``offs`` are the groups' cumulative ends.

    2D x 3D: ``out[s:e] = a[s:e] @ b[g]`` (rows of ``a`` per group: an MoE's tokens per expert);
    3D x 2D: ``out[:, s:e] = a[g] @ b[:, s:e]``; 2D x 2D: ``out[g] = a[:, s:e] @ b[s:e]`` (the
    weight gradient); 3D x 3D: ``bmm``. Rows or columns past the last offset are zero.
    """
    if a.dim() == 3 and b.dim() == 3:
        out = torch.bmm(a, b)
    elif a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(_groups(offs)):
            out[s:e] = a[s:e] @ b[g]
    elif a.dim() == 3 and b.dim() == 2:
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (s, e) in enumerate(_groups(offs)):
            out[:, s:e] = a[g] @ b[:, s:e]
    else:
        spans = _groups(offs)
        out = a.new_zeros(len(spans), a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(spans):
            out[g] = a[:, s:e] @ b[s:e]
    if bias is not None:
        out = out + bias
    return out


def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``aten._scaled_mm``: ``(a * scale_a) @ (b * scale_b) + bias`` in the widest floating dtype
    of its arguments (the fp8 inputs are exact in it; tensorwise or rowwise scales broadcast)."""
    wide = max((t.dtype for t in (scale_a, scale_b) if t.is_floating_point()), key=lambda d: torch.finfo(d).bits,
               default=torch.float32)
    wide = torch.float64 if wide == torch.float64 else torch.float32
    out = (a.to(wide) * scale_a.to(wide)) @ (b.to(wide) * scale_b.to(wide))
    if bias is not None:
        out = out + bias.to(wide)
    if scale_result is not None:
        out = out * scale_result.to(wide)
    return out


def int_mm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aten._int_mm``: int8 x int8 -> int32, exact (accumulated in int64)."""
    return (a.to(torch.int64) @ b.to(torch.int64)).to(torch.int32)


#: Built-in references of stock ops with no float64 kernel (module docstring).
BUILTIN_REFERENCES: Dict[str, Callable] = {
    "aten._grouped_mm.default": grouped_mm_reference,
    "aten._scaled_mm.default": scaled_mm_reference,
    "aten._int_mm.default": int_mm_reference,
    **ATTENTION_REFERENCES,
}


def math_semantics(op_name: str) -> bool:
    """Whether the op's reference is its built-in math semantics (not a user's registration): run in the
    DUT dtype it is the op's decomposition peer, as a ``torch._decomp`` entry would be."""
    return op_name in ATTENTION_REFERENCES and op_name not in _REFERENCES
