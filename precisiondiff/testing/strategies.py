"""Hypothesis strategies for accelerator op testing: tensors, shapes, op inputs.

The bit formats and the element strategy (``BitFormat``, ``bit_format``, ``special_values``,
``floats_of``) live in :mod:`precisiondiff.testing.bit_formats` and are re-exported here.
Values are generated as *bit patterns* of the target format, so every special value of every
format is reachable exactly and shrinks well: ±0, the smallest and largest subnormals, the
smallest normal, the largest finite value, ±inf (where the format has one) and NaN, next to
moderate normal values and uniformly random encodings (which cover huge and tiny magnitudes).

Formats: float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2. Any other dtype raises
:class:`~precisiondiff.errors.PrecisionDiffError` (never a silent fallback).

Example:
    >>> from hypothesis import given
    >>> from precisiondiff.strategies import op_inputs, parity_settings
    >>> @parity_settings()
    ... @given(inp=op_inputs(torch.ops.aten.gelu.default, dtype=torch.bfloat16))
    ... def test_gelu(parity, inp):
    ...     parity.check_op(torch.ops.aten.gelu.default, *inp.args, max_ulp=1, **inp.kwargs)

This module needs hypothesis (``pip install 'precisiondiff[test]'``); ``import precisiondiff``
never imports it.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import torch

from ..errors import PrecisionDiffError
from .bit_formats import BitFormat, Shape, _patterns_to_tensor, bit_format, floats_of, special_values

try:
    import hypothesis
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as err:  # pragma: no cover - exercised only without hypothesis
    raise ImportError("precisiondiff.strategies needs hypothesis: pip install 'precisiondiff[test]' "
                      "(or pip install hypothesis)") from err

__all__ = [
    "BitFormat",
    "bit_format",
    "special_values",
    "floats_of",
    "shapes",
    "broadcastable_shapes",
    "tensors",
    "OpInputs",
    "op_inputs",
    "supported_ops",
    "parity_settings",
]

def shapes(*, min_dims: int = 0, max_dims: int = 4, min_side: int = 0, max_side: int = 5,
           max_numel: int = 64) -> st.SearchStrategy[Shape]:
    """Tensor shapes, including 0-d (``()``) and empty (a zero side) ones.

    Example:
        >>> shapes(max_dims=2).example()  # doctest: +SKIP
        (3, 0)
    """
    def small(shape: Shape) -> bool:
        n = 1
        for side in shape:
            n *= side
        return n <= max_numel

    nonscalar = hnp.array_shapes(min_dims=max(min_dims, 1), max_dims=max(max_dims, 1),
                                 min_side=min_side, max_side=max_side).filter(small)
    if max_dims == 0:
        return st.just(())
    if min_dims == 0:
        return st.one_of(st.just(()), nonscalar)
    return nonscalar


def broadcastable_shapes(*, num_shapes: int = 2, min_dims: int = 0, max_dims: int = 3,
                         max_side: int = 4) -> st.SearchStrategy[Tuple[Shape, ...]]:
    """Tuples of ``num_shapes`` shapes that broadcast together (sides of 1, missing dims).

    Example:
        >>> broadcastable_shapes().example()  # doctest: +SKIP
        ((3, 1), (4,))
    """
    return hnp.mutually_broadcastable_shapes(num_shapes=num_shapes, min_dims=min_dims,
                                             max_dims=max_dims, max_side=max_side).map(
        lambda b: tuple(tuple(s) for s in b.input_shapes))


Layout = str  # "contiguous" | "transposed" | "strided"
LAYOUTS = ("contiguous", "transposed", "strided")


@st.composite
def tensors(draw: Callable, *, dtype: Union[torch.dtype, st.SearchStrategy] = torch.float32,
            shape: Union[Shape, st.SearchStrategy, None] = None,
            elements: Optional[st.SearchStrategy[float]] = None, layout: Optional[str] = None,
            allow_nan: bool = True, allow_inf: bool = True, allow_subnormal: bool = True,
            device: str = "cpu") -> torch.Tensor:
    """Tensors of one float ``dtype`` whose values cover every class of the format.

    Args:
        dtype: a supported float dtype, or a strategy of them.
        shape: a fixed shape, a strategy of shapes, or None for :func:`shapes`.
        elements: a strategy of Python floats to use instead of bit patterns (rounded to dtype).
        layout: ``contiguous``, ``transposed`` (a permuted view), ``strided`` (a ``[..., ::2]``
            view), or None to draw any of them.
        allow_nan, allow_inf, allow_subnormal: which special classes may appear.
        device: where the tensor is placed.

    Returns:
        A strategy of tensors (views when the layout is not contiguous).

    Example:
        >>> tensors(dtype=torch.bfloat16, shape=(4,)).example()  # doctest: +SKIP
        tensor([-0., inf, 1.1719e+00, 9.1835e-41], dtype=torch.bfloat16)
    """
    if isinstance(dtype, st.SearchStrategy):
        dtype = draw(dtype)
    fmt = bit_format(dtype)
    if shape is None:
        shape = shapes()
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    shape = tuple(int(s) for s in shape)
    layout = layout or draw(st.sampled_from(LAYOUTS))
    if layout not in LAYOUTS:
        raise PrecisionDiffError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    # the base tensor, from which the view of the requested shape is taken
    perm = list(range(len(shape)))
    base_shape = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        identity = list(perm)
        perm = draw(st.permutations(perm).filter(lambda p: list(p) != identity))
        base_shape = [0] * len(shape)
        for i, p in enumerate(perm):
            base_shape[p] = shape[i]
    elif layout == "strided" and len(shape) >= 1:
        base_shape[-1] = 2 * shape[-1]
    numel = 1
    for side in base_shape:
        numel *= side
    if elements is not None:
        values = draw(st.lists(elements, min_size=numel, max_size=numel))
        base = torch.tensor(values, dtype=torch.float64).reshape(base_shape).to(dtype)
    else:
        patterns = draw(st.lists(floats_of(dtype, allow_nan=allow_nan, allow_inf=allow_inf,
                                           allow_subnormal=allow_subnormal),
                                 min_size=numel, max_size=numel))
        base = _patterns_to_tensor(patterns, fmt, tuple(base_shape))
    base = base.to(device)
    if layout == "transposed" and len(shape) >= 2:
        return base.permute(*perm)
    if layout == "strided" and len(shape) >= 1:
        return base[..., ::2]
    return base


# --------------------------------------------------------------------------------------------
# op_inputs: valid arguments for an ATen op, derived from its schema
# --------------------------------------------------------------------------------------------

class OpInputs(NamedTuple):
    """Positional and keyword arguments for one call: ``op(*inp.args, **inp.kwargs)``."""

    args: tuple
    kwargs: dict


# Categories the schema alone cannot tell apart: shapes must match across tensor arguments.
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "dot"}
_NORMALIZATION = {"layer_norm", "native_layer_norm", "rms_norm"}
# Reductions that reject an empty reduced dimension.
_NONEMPTY = {"amax", "amin", "max", "min", "argmax", "argmin", "logsumexp"}
# Required string/bool arguments whose valid values are known.
_CHOICES = {("gelu", "approximate"): ("none", "tanh")}

_ELEMENTWISE = ("abs neg exp exp2 expm1 log log1p log2 sqrt rsqrt sin cos tan tanh sigmoid "
                "gelu relu silu mish erf erfc reciprocal softplus hardswish elu leaky_relu "
                "add sub mul div maximum minimum pow atan2 hypot").split()
_REDUCTION = "sum mean prod amax amin var std norm logsumexp softmax _softmax log_softmax _log_softmax".split()


def supported_ops() -> List[str]:
    """Names (ATen base names) whose inputs :func:`op_inputs` can derive, by category."""
    return sorted(set(_ELEMENTWISE) | set(_REDUCTION) | _MATMUL | _NORMALIZATION)


def _resolve(op: Any) -> Any:
    if isinstance(op, str):
        ns, _, rest = op.replace("::", ".").partition(".")
        name, _, overload = rest.partition(".")
        op = getattr(getattr(torch.ops, ns), name)
        return getattr(op, overload or "default")
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    if not hasattr(op, "_schema"):
        raise PrecisionDiffError(f"op_inputs needs an ATen op overload such as "
                                 f"torch.ops.aten.gelu.default, not {op!r}")
    return op


def _dims(draw: Callable, ndim: int, *, many: bool, nonempty_shape: Optional[Shape] = None) -> Any:
    rank = max(ndim, 1)
    if not many:
        return draw(st.integers(-rank, rank - 1))
    chosen = draw(st.lists(st.integers(0, rank - 1), unique=True, min_size=1, max_size=rank))
    return [d - rank if draw(st.booleans()) else d for d in chosen]


def _matmul_args(draw: Callable, name: str, tensor: Callable[[Shape], torch.Tensor],
                 max_side: int) -> Tuple[tuple, dict]:
    side = st.integers(0, max_side)
    n, k, m, b = draw(side), draw(side), draw(side), draw(st.integers(1, 3))
    if name == "mm":
        return (tensor((n, k)), tensor((k, m))), {}
    if name == "addmm":
        bias = draw(st.sampled_from([(n, m), (m,), (1, m), ()]))
        return (tensor(bias), tensor((n, k)), tensor((k, m))), {}
    if name == "bmm":
        return (tensor((b, n, k)), tensor((b, k, m))), {}
    if name == "baddbmm":
        return (tensor((b, n, m)), tensor((b, n, k)), tensor((b, k, m))), {}
    if name == "matmul":
        left = draw(st.sampled_from([(n, k), (b, n, k), (k,)]))
        right = draw(st.sampled_from([(k, m), (k,)] + ([(b, k, m)] if len(left) == 3 else [])))
        return (tensor(left), tensor(right)), {}
    if name == "linear":
        batch = draw(shapes(max_dims=2, max_side=3))
        bias = tensor((m,)) if draw(st.booleans()) else None
        return (tensor(batch + (k,)), tensor((m, k)), bias), {}
    if name == "mv":
        return (tensor((n, k)), tensor((k,))), {}
    return (tensor((k,)), tensor((k,))), {}  # dot


def _norm_args(draw: Callable, name: str, schema: Any, tensor: Callable[[Shape], torch.Tensor]) -> Tuple[tuple, dict]:
    shape = draw(shapes(min_dims=1, max_dims=3, min_side=1))
    normalized = list(shape[len(shape) - draw(st.integers(1, len(shape))):])
    weight = tensor(tuple(normalized)) if draw(st.booleans()) else None
    if name == "rms_norm":
        return (tensor(shape), normalized, weight, 1e-6), {}
    bias = tensor(tuple(normalized)) if draw(st.booleans()) else None
    return (tensor(shape), normalized, weight, bias, 1e-5), {}


@st.composite
def op_inputs(draw: Callable, op: Any, *, dtype: torch.dtype = torch.float32,
              elements: Optional[st.SearchStrategy[float]] = None, allow_nan: bool = True,
              allow_inf: bool = True, allow_subnormal: bool = True, max_side: int = 4,
              device: str = "cpu") -> OpInputs:
    """Valid arguments for ``op``, derived from its schema (``op._schema``).

    Tensor arguments get values from :func:`tensors` (all layouts). Element-wise ops get
    broadcastable shapes for their tensor operands; reductions and softmax get valid ``dim``
    (an int, or a list of distinct dims) and ``keepdim``; matmul-like ops get matching inner
    dimensions (mm, addmm, bmm, baddbmm, matmul, linear, mv, dot); normalizations get a
    ``normalized_shape`` that is a suffix of the input's shape and matching weight and bias.
    Arguments with a default keep it, except known choices (gelu's ``approximate``).

    Args:
        op: an ATen overload (``torch.ops.aten.gelu.default``), its packet, or its name
            (``"aten.gelu.default"``).
        dtype: the dtype of floating tensor arguments.
        elements, allow_nan, allow_inf, allow_subnormal: passed to :func:`tensors`.
        max_side: the largest side of generated shapes.
        device: where tensors are placed.

    Returns:
        A strategy of :class:`OpInputs`.

    Raises:
        PrecisionDiffError: the op takes an argument this strategy cannot make valid.

    Example:
        >>> op_inputs(torch.ops.aten.addmm.default).example()  # doctest: +SKIP
        OpInputs(args=(tensor([...]), tensor([...]), tensor([...])), kwargs={})
    """
    overload = _resolve(op)
    schema = overload._schema
    name = schema.name.split("::")[-1]

    def tensor(shape: Shape) -> torch.Tensor:
        return draw(tensors(dtype=dtype, shape=shape, elements=elements, allow_nan=allow_nan,
                            allow_inf=allow_inf, allow_subnormal=allow_subnormal, device=device))

    if name in _MATMUL:
        args, kwargs = _matmul_args(draw, name, tensor, max_side)
        return OpInputs(args, kwargs)
    if name in _NORMALIZATION:
        args, kwargs = _norm_args(draw, name, schema, tensor)
        return OpInputs(args, kwargs)

    tensor_args = [a for a in schema.arguments if str(a.type) == "Tensor"]
    if not tensor_args:
        raise PrecisionDiffError(f"op_inputs({schema.name}.{schema.overload_name}): no tensor argument")
    if len(tensor_args) == 1:
        main_shape = draw(shapes(max_side=max_side))
        if name in _NONEMPTY:
            main_shape = draw(shapes(max_side=max_side, min_side=1))
        tensor_shapes = {tensor_args[0].name: main_shape}
    else:
        pair = draw(broadcastable_shapes(num_shapes=len(tensor_args), max_side=max_side))
        tensor_shapes = {a.name: s for a, s in zip(tensor_args, pair)}
        main_shape = pair[0]

    args: list = []
    kwargs: dict = {}
    for arg in schema.arguments:
        type_text = str(arg.type)
        if arg.name in tensor_shapes:
            value = tensor(tensor_shapes[arg.name])
        elif arg.name == "dim" and type_text == "int":
            value = _dims(draw, len(main_shape), many=False)
        elif arg.name == "dim" and "List[int]" in type_text:
            value = _dims(draw, len(main_shape), many=True)
        elif arg.name == "keepdim" and type_text == "bool":
            value = draw(st.booleans())
        elif arg.name == "half_to_float":
            value = False  # True is only valid for half inputs on CUDA
        elif (name, arg.name) in _CHOICES:
            value = draw(st.sampled_from(_CHOICES[(name, arg.name)]))
        elif arg.has_default_value():
            continue
        elif type_text in ("number", "float"):
            value = draw(elements if elements is not None else st.floats(-4, 4, width=32))
        else:
            raise PrecisionDiffError(f"op_inputs({schema.name}.{schema.overload_name}): cannot make a "
                                     f"valid {type_text} for argument {arg.name!r}; supported: "
                                     f"{', '.join(supported_ops())}")
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return OpInputs(tuple(args), kwargs)


def parity_settings(*, max_examples: int = 50, **kwargs: Any) -> "hypothesis.settings":
    """Hypothesis settings fit for parity property tests that use the ``parity`` fixture.

    Suppresses the function-scoped-fixture health check (the fixture holds no per-example
    state) and disables the deadline (a first kernel launch can be slow on a device).

    Example:
        >>> @parity_settings(max_examples=20)
        ... @given(x=tensors(dtype=torch.bfloat16))
        ... def test_exp(parity, x): parity.check_op(torch.exp, x)
    """
    suppress = list(kwargs.pop("suppress_health_check", ())) + [
        hypothesis.HealthCheck.function_scoped_fixture, hypothesis.HealthCheck.too_slow,
        hypothesis.HealthCheck.data_too_large]
    kwargs.setdefault("deadline", None)
    return hypothesis.settings(max_examples=max_examples, suppress_health_check=suppress, **kwargs)
