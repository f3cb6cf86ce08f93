"""The kernels a probe measures: one callable per op family, substitutable.

A :class:`Kernels` maps a family name (``gemm``, ``sum``, ``cast``, ``exp``...) to a callable
with the family's canonical signature (the table below). :meth:`Kernels.stock` gives PyTorch's
own ops; :meth:`Kernels.replace` swaps any of them, which is how an emulated device (planted
custom ops in the tests) or a vendor's fused kernel is probed.

Experiments never call the raw op: they call an *adaptor* that turns "sum these rows" into the
family's own call (a matmul with a column of ones, a conv with kernel size 1, an embedding
backward with every index 0...), on the target's device and dtype, and bring the result back to
the CPU in float64. Every crafted value is exactly representable in the dtype, so the only
rounding is the kernel's own.

=================  ===========================================  ==============================
family             callable                                      reduces over
=================  ===========================================  ==============================
gemm               ``fn(a[M,K], b[K,N]) -> [M,N]`` (torch.mm)      K
bmm                ``fn(a[B,M,K], b[B,K,N]) -> [B,M,N]``           K
conv               ``fn(x[N,C,L], w[O,C,k]) -> [N,O,L']`` (conv1d) C*k; backward kernels via autograd
conv_bwd_input     (the backward of ``conv``)                       output channels
conv_bwd_weight    (the backward of ``conv``)                       batch * length
sum / mean         ``fn(x[R,K]) -> [R]`` over the last dim          K
cumsum             ``fn(x[R,K]) -> [R,K]``                          K (last element read)
embedding_bwd      ``fn(grad[T,D], idx[T], num) -> [num,D]``        tokens sharing an index
index_add          ``fn(out[1,D], idx[T], src[T,D]) -> [1,D]``      rows sharing an index
softmax, layer_norm, rms_norm  ``fn(x[R,K]) -> [R,K]`` over the last dim
mul / add          ``fn(x, y) -> x*y`` / ``x+y``
cast               ``fn(x_fp32, dtype) -> x.to(dtype)``
exp log tanh erf sigmoid rsqrt gelu silu   ``fn(x) -> y``
=================  ===========================================  ==============================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from ..errors import PrecisionDiffError

__all__ = ["Kernels", "DOT_FAMILIES", "PRODUCT_FAMILIES", "ROW_FAMILIES", "ELEMENTWISE",
           "ALL_FAMILIES", "dot", "rows"]

#: Families whose kernel sums terms: accumulator, order, determinism, batch invariance.
DOT_FAMILIES = ("gemm", "bmm", "conv", "conv_bwd_input", "conv_bwd_weight", "sum", "mean",
                "cumsum", "embedding_bwd", "index_add")
#: Dot families whose terms are products of two operands (input rounding such as TF32).
PRODUCT_FAMILIES = ("gemm", "bmm", "conv")
#: Row-wise families measured by accuracy, determinism and batch invariance.
ROW_FAMILIES = ("softmax", "layer_norm", "rms_norm")
ELEMENTWISE = ("exp", "log", "tanh", "erf", "sigmoid", "rsqrt", "gelu", "silu")
ALL_FAMILIES = DOT_FAMILIES + ROW_FAMILIES + ("cast", "mul", "add") + ELEMENTWISE


def _stock() -> Dict[str, Callable]:
    return {
        "gemm": torch.mm,
        "bmm": torch.bmm,
        "conv": F.conv1d,
        "sum": lambda x: x.sum(-1),
        "mean": lambda x: x.mean(-1),
        "cumsum": lambda x: x.cumsum(-1),
        "embedding_bwd": lambda grad, idx, num: torch.ops.aten.embedding_dense_backward(
            grad, idx, num, -1, False),
        "index_add": lambda out, idx, src: out.index_add(0, idx, src),
        "softmax": lambda x: torch.softmax(x, -1),
        "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
        "rms_norm": lambda x: F.rms_norm(x, (x.shape[-1],)),
        "mul": torch.mul,
        "add": torch.add,
        "cast": lambda x, dtype: x.to(dtype),
        "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "erf": torch.erf,
        "sigmoid": torch.sigmoid, "rsqrt": torch.rsqrt, "gelu": F.gelu, "silu": F.silu,
    }


@dataclass(frozen=True)
class Kernels:
    """A device and a dtype, and the callable probed for each family.

    Attributes:
        device: torch device string (``cpu``, ``cuda:0``, ``mlu``).
        dtype: the dtype crafted inputs are given in.
        ops: family -> callable with the family's signature (module docstring).
        names: family -> a label printed on the card (``torch.mm``, ``mylib.fused_mm``).

    Example:
        >>> k = Kernels.stock("cpu", torch.bfloat16).replace(gemm=my_mm)  # doctest: +SKIP
    """

    device: str
    dtype: torch.dtype
    ops: Dict[str, Callable] = field(default_factory=_stock)
    names: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def stock(cls, device: str, dtype: torch.dtype) -> "Kernels":
        """PyTorch's own kernels on ``device``."""
        return cls(device, dtype)

    def replace(self, **ops: Callable) -> "Kernels":
        """A copy with some families' callables replaced (``gemm=fn``, ``sum=fn``...)."""
        for family in ops:
            if family.startswith("conv_bwd"):
                raise PrecisionDiffError(f"{family} is measured through conv's autograd: replace conv")
            if family not in ALL_FAMILIES:
                raise PrecisionDiffError(f"unknown op family {family!r}: use one of "
                                         f"{', '.join(ALL_FAMILIES)}")
        names = dict(self.names)
        for family, fn in ops.items():
            names[family] = _label(fn)
        return Kernels(self.device, self.dtype, {**self.ops, **ops}, names)

    def label(self, family: str) -> str:
        """What the card names as the kernel of ``family``."""
        return self.names.get("conv" if family.startswith("conv") else family, "stock")

    def put(self, x: torch.Tensor) -> torch.Tensor:
        """A float64 CPU tensor on the device in the probe's dtype (values must be exact)."""
        return x.to(self.dtype).to(self.device)


def _label(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    op = getattr(fn, "_qualified_op_name", None) or getattr(fn, "name", None)
    return str(op() if callable(op) else op) if op else str(name)


def _back(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").to(torch.float64)


def dot(k: Kernels, family: str, a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum each row of ``a`` (times ``b``'s row, for product families) with ``family``'s kernel.

    Args:
        k: the kernels probed.
        family: one of :data:`DOT_FAMILIES`.
        a: float64 CPU tensor [R, K] of values exact in ``k.dtype``.
        b: optional float64 [R, K] second operand (gemm and bmm only); ones when None.

    Returns:
        float64 CPU tensor [R]: the kernel's result per row.
    """
    fn = k.ops["conv" if family.startswith("conv") else family]
    rows_, n = a.shape
    if b is not None and family not in ("gemm", "bmm"):
        raise ValueError(f"{family} takes no per-row second operand")
    if family == "gemm":
        if b is None:
            # 16 columns, not 1: a one-column product may take a matrix-vector path
            return _back(fn(k.put(a), k.put(torch.ones(n, 16, dtype=torch.float64))))[:, 0]
        out = [_back(fn(k.put(a[i:i + 64]), k.put(b[i:i + 64].T))).diagonal()
               for i in range(0, rows_, 64)]
        return torch.cat(out)
    if family == "bmm":
        bb = torch.ones_like(a) if b is None else b
        return _back(fn(k.put(a[:, None, :]), k.put(bb[:, :, None])))[:, 0, 0]
    if family == "conv":
        return _back(fn(k.put(a[:, None, :]), k.put(torch.ones(1, 1, n, dtype=torch.float64))))[:, 0, 0]
    if family == "conv_bwd_input":
        x = k.put(torch.zeros(1, 1, rows_, dtype=torch.float64)).requires_grad_(True)
        w = k.put(torch.ones(n, 1, 1, dtype=torch.float64))
        k.ops["conv"](x, w).backward(k.put(a.T[None].contiguous()))
        return _back(x.grad)[0, 0]
    if family == "conv_bwd_weight":
        x = k.put(torch.ones(1, 1, n, dtype=torch.float64))
        w = k.put(torch.zeros(rows_, 1, 1, dtype=torch.float64)).requires_grad_(True)
        k.ops["conv"](x, w).backward(k.put(a[None].contiguous()))
        return _back(w.grad)[:, 0, 0]
    if family == "sum":
        return _back(fn(k.put(a)))
    if family == "mean":
        return _back(fn(k.put(a))) * n
    if family == "cumsum":
        return _back(fn(k.put(a)))[:, -1]
    idx = torch.zeros(n, dtype=torch.long, device=k.device)
    if family == "embedding_bwd":
        return _back(fn(k.put(a.T.contiguous()), idx, 1))[0]
    if family == "index_add":
        return _back(fn(k.put(torch.zeros(1, rows_, dtype=torch.float64)), idx, k.put(a.T.contiguous())))[0]
    raise ValueError(f"{family} is not a summing family")


def rows(k: Kernels, family: str, x: torch.Tensor) -> torch.Tensor:
    """Run a row-wise or summing family on ``x`` [R, K]; float64 CPU result, one row per row."""
    if family in DOT_FAMILIES:
        return dot(k, family, x)[:, None]
    return _back(k.ops[family](k.put(x)))

