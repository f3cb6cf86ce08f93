"""Reference implementations for ops the reference target cannot run itself.

A vendor fused kernel (a ``torch_mlu`` custom op, say) often has no CPU or float64
implementation. Bisect then localizes a fault to the innermost module around it; registering a
reference lets it judge the op itself::

    precisiondiff.register_reference("torch_mlu.fused_rms_norm.default",
                                      lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)

The function receives the op's arguments exactly as recorded, with floating tensors upcast to
the reference dtype on the reference device, and returns what the op returns.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from ..errors import BisectError

__all__ = ["register_reference", "unregister_reference", "reference_for", "normalize_op_name"]

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
    """The registered reference of ``op_name`` (``ns.op.overload``), or None."""
    return _REFERENCES.get(op_name)
