"""What an op accumulates, read from its schema: the accumulation length K of each output, whether
its *magnitude* is the op applied to ``|inputs|``, and whether a call draws random numbers.

One helper for every judge: bisect's op isolation and the pytest plugin's op checks
(``parity.check_op``) both call :func:`accumulation_lengths` and :func:`magnitude_op`.

K is the number of products or terms summed into one output element:

* matmuls: the contracted dimension (``mm(self, mat2)``: ``mat2.shape[-2]``; ``addmm(self, mat1,
  mat2)``: ``mat1.shape[-1]``, whatever the bias ``self`` looks like);
* convolutions: ``C_in / groups x prod(kernel)``; ``convolution_backward``: per output
  (grad_input ``C_out / groups x prod(kernel)``, grad_weight and grad_bias ``N x prod(out spatial)``);
* attention: the key length and head dimension (``max(E, S)``), key length for the logsumexp;
* ``embedding_dense_backward``: the number of indices (a row may receive every one);
* norms and softmax: the normalized size; reductions: input elements per output element.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from .op_classes import op_class

__all__ = ["bind_schema", "accumulation_lengths", "magnitude_op", "is_random_call", "op_base_name",
           "rounds_partial_sums", "LastOp"]

# Ops linear in each floating input: their magnitude is the op on |inputs| (|A| @ |B|).
_MAGNITUDE_OPS = frozenset({
    "mm", "bmm", "addmm", "matmul", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "linear",
    "sum", "mean", "convolution", "_convolution", "convolution_backward", "einsum", "cumsum",
    "_scaled_mm", "embedding_dense_backward", "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool2d_backward", "index_add", "scatter_add", "_embedding_bag"})


def op_base_name(name: str) -> str:
    """``aten.addmm.default`` -> ``addmm``; ``aten.add_.Tensor`` -> ``add_``; other strings as is."""
    parts = str(name).split(".")
    return parts[-2] if len(parts) >= 3 else parts[0]


def _overload(op: Any) -> Optional[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverload):
        return op
    parts = str(op).split(".")
    if len(parts) < 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, ".".join(parts[:-2])), parts[-2]), parts[-1])
    except (AttributeError, RuntimeError):
        return None


def bind_schema(op: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The call's arguments by schema name (``{"self": ..., "mat2": ...}``); defaults filled in.

    ``op`` is an ``OpOverload`` or its name; an unknown op gives ``{}``.
    """
    overload = _overload(op)
    if overload is None:
        return {}
    kwargs = kwargs or {}
    bound: Dict[str, Any] = {}
    positional = list(args)
    for i, arg in enumerate(overload._schema.arguments):
        if i < len(positional) and not arg.kwarg_only:
            bound[arg.name] = positional[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _shape(value: Any) -> Optional[tuple]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _prod(values: Sequence[int]) -> int:
    return int(math.prod(int(v) for v in values)) if values else 1


def _conv(b: Dict[str, Any], n_out: int) -> List[Optional[int]]:
    w = _shape(b.get("weight"))
    if w is None or len(w) < 2:
        return [None] * n_out
    groups = int(b.get("groups") or 1)
    kernel = _prod(w[2:])
    transposed = bool(b.get("transposed") or False)
    return [max(1, (w[0] // groups if transposed else w[1]) * kernel)] * n_out


def _conv_backward(b: Dict[str, Any], n_out: int) -> List[Optional[int]]:
    w, g = _shape(b.get("weight")), _shape(b.get("grad_output"))
    if w is None or g is None or len(w) < 2:
        return [None] * n_out
    groups = int(b.get("groups") or 1)
    kernel = _prod(w[2:])
    transposed = bool(b.get("transposed") or False)
    k_input = (w[1] if transposed else w[0] // groups) * kernel
    k_weight = g[0] * _prod(g[2:])
    return [max(1, k) for k in (k_input, k_weight, k_weight)][:n_out] + [None] * max(0, n_out - 3)


def _attention(b: Dict[str, Any], base: str, n_out: int) -> List[Optional[int]]:
    q, k = _shape(b.get("query")), _shape(b.get("key"))
    if q is None or k is None:
        return [None] * n_out
    head, keys, queries = q[-1], k[-2], q[-2]
    if "backward" in base:  # grad_query sums over keys, grad_key/grad_value over queries
        return [max(head, keys), max(head, queries), max(head, queries)][:n_out] + [None] * max(0, n_out - 3)
    return [max(head, keys), keys][:n_out] + [keys] * max(0, n_out - 2)


def _normalized(b: Dict[str, Any], base: str) -> Optional[int]:
    if "normalized_shape" in b and b["normalized_shape"] is not None:
        return max(1, _prod(list(b["normalized_shape"])))
    x = b.get("input", b.get("self", b.get("grad_output")))
    s = _shape(x)
    if s is None:
        return None
    if "group_norm" in base and "group" in b:
        return max(1, _prod(s) // max(1, int(b.get("N") or s[0]) * int(b["group"])))
    if "batch_norm" in base and len(s) >= 2:
        return max(1, _prod(s) // s[1])
    if "dim" in b and isinstance(b["dim"], int) and s:
        return int(s[b["dim"]]) if -len(s) <= b["dim"] < len(s) else None
    return None


def accumulation_lengths(op: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
                         outputs: Sequence[Any]) -> List[Optional[int]]:
    """K of each output of one op call, from the op's schema (None where it has no meaning).

    Args:
        op: the ``OpOverload`` or its name (``"aten.addmm.default"``).
        args, kwargs: the call's arguments (tensors only need the right shapes).
        outputs: the call's outputs, flattened (tensors, for element counts).

    Example:
        >>> a, b = torch.ones(4, 3), torch.ones(3, 5)
        >>> accumulation_lengths("aten.addmm.default", [torch.ones(5), a, b], {}, [a @ b])
        [3]
    """
    name = str(op)
    base = op_base_name(name).rstrip("_")
    n_out = len(outputs)
    b = bind_schema(op, args, kwargs)
    if not b:
        return [None] * n_out
    second = {"mm": "mat2", "bmm": "mat2", "addmm": "mat2", "baddbmm": "batch2", "matmul": "other"}
    if base in second:
        s = _shape(b.get(second[base]))
        if s is not None:
            return [max(1, int(s[-2] if len(s) >= 2 else s[0]))] * n_out
    if base == "addbmm":
        s = _shape(b.get("batch1"))
        return [max(1, s[0] * s[-1]) if s else None] * n_out
    if base in ("mv", "addmv"):
        s = _shape(b.get("vec"))
        return [max(1, s[0]) if s else None] * n_out
    if base in ("dot", "vdot"):
        s = _shape(b.get("self"))
        return [max(1, _prod(s)) if s else None] * n_out
    if base == "linear":
        s = _shape(b.get("weight"))
        return [max(1, s[-1]) if s else None] * n_out
    if base in ("convolution", "_convolution", "convolution_overrideable", "mkldnn_convolution"):
        return _conv(b, n_out)
    if base == "convolution_backward":
        return _conv_backward(b, n_out)
    if "scaled_dot_product" in base:
        return _attention(b, base, n_out)
    if "pool" in base and "kernel_size" in b and b["kernel_size"] is not None:
        return [max(1, _prod(list(b["kernel_size"])))] * n_out
    if base == "embedding_dense_backward":
        s = _shape(b.get("indices"))
        return [max(1, _prod(s)) if s is not None else None] * n_out
    cls = op_class(name) if name.startswith("aten.") else "unknown"
    if cls in ("normalization", "softmax") or "norm" in base or "softmax" in base:
        k = _normalized(b, base)
        return [k] * n_out
    if cls == "reduction":
        ins = [_prod(t.shape) for t in b.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        first = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
        if ins and first is not None:
            return [max(1, max(ins) // max(1, first.numel()))] * n_out
    return [None] * n_out


# Scatter-adds: each output sums what lands on it in turn, and stock kernels may round those partial
# sums to the output dtype (CPU bf16 embedding_dense_backward): their error statistics keep one
# rounding of a partial as large as the magnitude in the tail's unit (docs/comparators.md).
_SCATTER_OPS = frozenset({
    "embedding_dense_backward", "embedding_backward", "_embedding_bag", "_embedding_bag_backward",
    "_embedding_bag_dense_backward", "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
    "index_put", "index_put_", "_index_put_impl_", "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices_backward", "avg_pool2d_backward", "avg_pool3d_backward",
    "_adaptive_avg_pool2d_backward", "convolution_backward"})


def rounds_partial_sums(op: Any) -> bool:
    """Whether the op is a scatter-add whose correct kernels may round partial sums to the output
    dtype (``embedding_dense_backward``, ``index_add``, pooling and convolution backward); other
    ops, custom ones included, are held to float32 accumulation in the error statistics' tail."""
    name = str(op)
    return name.startswith("aten.") and op_base_name(name) in _SCATTER_OPS


def magnitude_op(op: Any) -> bool:
    """Whether the op is linear in each floating input, so that its magnitude (the size of
    what it accumulates) is the op applied to ``|inputs|``: ``|A| @ |B|`` for a matmul."""
    name = str(op)
    return name.startswith("aten.") and op_base_name(name) in _MAGNITUDE_OPS


def is_random_call(op: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> bool:
    """Whether this call draws random numbers (``torch.Tag.nondeterministic_seeded``): its outputs
    are data, not arithmetic to judge. An op tagged so only for an optional dropout (attention
    with ``dropout_p=0``, ``native_dropout`` with ``train=False`` or ``p=0``) is not random."""
    overload = _overload(op)
    if overload is None or torch.Tag.nondeterministic_seeded not in overload.tags:
        return False
    b = bind_schema(overload, args, kwargs)
    if "dropout_p" in b:
        return bool(b["dropout_p"])
    if op_base_name(str(overload)) == "native_dropout":
        return bool(b.get("train", True)) and bool(b.get("p", 0.0))
    return True


class LastOp(TorchDispatchMode):
    """Records the last op with floating outputs that a callable dispatched (``F.linear`` ->
    ``aten.addmm``), so that a Python function gets its op's schema-derived K and magnitude.

    Example:
        >>> with LastOp() as rec:
        ...     _ = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
        >>> str(rec.op), rec.ks
        ('aten.mm.default', [3])
    """

    def __init__(self) -> None:
        super().__init__()
        self.op: Optional[Any] = None
        self.ks: List[Optional[int]] = []
        self.args: Any = ()
        self.kwargs: Dict[str, Any] = {}
        self.count = 0  # ops with floating outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", False):
            flat = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if any(t.is_floating_point() for t in flat):
                self.op, self.args, self.kwargs = func, args, kwargs
                self.ks = accumulation_lengths(func, args, kwargs, flat)
                self.count += 1
        return out
