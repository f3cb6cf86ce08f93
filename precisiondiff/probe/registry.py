"""Registering custom and fused ops for the probe.

A fused kernel (``torch_mlu``'s fused RMSNorm, a vendor GEMM) is probed as a member of a family
once the user says which family it belongs to and how to call it with the family's canonical
arguments (see :mod:`precisiondiff.probe.kernels`)::

    from precisiondiff.probe import register_op
    register_op("fused_rms_norm", "rms_norm", torch.ops.mylib.fused_rms_norm,
                build=lambda x: (x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 1e-6))

then ``precisiondiff probe --import mylib.probe_ops --ops fused_rms_norm``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from ..errors import PrecisionDiffError
from .kernels import ALL_FAMILIES

__all__ = ["ProbeOp", "register_op", "registered_ops", "unregister_op"]


@dataclass(frozen=True)
class ProbeOp:
    """A custom op and the family it is probed as.

    Attributes:
        name: the name used in ``--ops`` and on the card.
        family: one of the families in :mod:`precisiondiff.probe.kernels`.
        fn: the op.
        build: maps the family's canonical arguments to ``fn``'s arguments (a tuple).
        output: picks the family's result from what ``fn`` returns (e.g. ``lambda out: out[0]``).
    """

    name: str
    family: str
    fn: Callable
    build: Optional[Callable[..., tuple]] = None
    output: Optional[Callable[[Any], Any]] = None

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*(self.build(*args) if self.build else args))
        return self.output(out) if self.output else out

    @property
    def _qualified_op_name(self) -> str:
        return self.name


_REGISTRY: Dict[str, ProbeOp] = {}


def register_op(name: str, family: str, fn: Callable, *, build: Optional[Callable[..., tuple]] = None,
                output: Optional[Callable[[Any], Any]] = None) -> ProbeOp:
    """Make a custom op probeable by name as a member of ``family``.

    Args:
        name: the name for ``--ops`` and the card; must not be a family name.
        family: ``gemm``, ``sum``, ``rms_norm``, ``exp``... (see ``ALL_FAMILIES``).
        fn: the op.
        build: canonical arguments -> ``fn``'s arguments; None when they are the same.
        output: ``fn``'s return value -> the family's result; None when it is the same.

    Returns:
        The registration.

    Raises:
        PrecisionDiffError: unknown family, or the name is a family's.

    Example:
        >>> register_op("my_mm", "gemm", torch.mm)  # doctest: +SKIP
    """
    if family not in ALL_FAMILIES or family.startswith("conv_bwd"):
        raise PrecisionDiffError(f"unknown op family {family!r}: use one of {', '.join(ALL_FAMILIES)}")
    if name in ALL_FAMILIES:
        raise PrecisionDiffError(f"{name!r} is a family name: register the op under its own name")
    op = ProbeOp(name, family, fn, build, output)
    _REGISTRY[name] = op
    return op


def unregister_op(name: str) -> None:
    """Forget a registration (no error when absent)."""
    _REGISTRY.pop(name, None)


def registered_ops() -> Dict[str, ProbeOp]:
    """The registered custom ops, by name."""
    return dict(_REGISTRY)
