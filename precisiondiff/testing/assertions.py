"""Assertion helpers for tests of numerical code, in the one mismatch message format."""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from ..comparators.ulp import float_format, ulp_distance

__all__ = ["assert_ulp_close", "assert_parity", "assert_op_parity"]

_SHOW = 5


def _idx(flat: int, shape: torch.Size) -> tuple:
    if len(shape) == 0:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def assert_ulp_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_ulp: float = 1.0,
    dtype: Optional[torch.dtype] = None,
    equal_nan: bool = True,
    msg: Optional[Union[str, Callable[[str], str]]] = None,
) -> None:
    """Assert that ``actual`` is within ``max_ulp`` ULPs of ``expected``, element-wise.

    A drop-in for ``torch.testing.assert_close`` whose tolerance is a ULP count:
    ``ulp_distance(actual, expected, dtype) <= max_ulp`` with ``expected`` rounded to ``dtype``
    (default ``actual.dtype``). +0 and -0 are equal; NaN equals NaN only if ``equal_nan``.

    Args:
        actual: Tensor under test.
        expected: Reference, any real dtype, same shape.
        max_ulp: Largest allowed ULP distance.
        dtype: Format to count ULPs in.
        equal_nan: Treat NaN in both as equal.
        msg: Replaces the message, or a callable that receives it and returns the new one.

    Raises:
        AssertionError: Shapes differ or some element is too far; the message names how many
            elements and what fraction, the worst absolute/relative/ULP error with index and
            values, the worst elements, the bound, and a ``Hint:``.
        UnsupportedDtypeError: The dtype has no ULP definition (a usage error, not a failure).

    Example:
        >>> x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        >>> assert_ulp_close(x, x.double() * (1 + 2**-9), max_ulp=1)
    """
    __tracebackhide__ = True
    if not isinstance(actual, torch.Tensor):
        actual = torch.as_tensor(actual)
    if not isinstance(expected, torch.Tensor):
        expected = torch.as_tensor(expected)
    if actual.shape != expected.shape:
        text = (f"Tensor-likes are not ULP-close: shapes differ, actual {tuple(actual.shape)} "
                f"vs expected {tuple(expected.shape)}.\nHint: compare tensors of one shape; "
                "broadcast explicitly if that is intended.")
        raise AssertionError(_apply_msg(text, msg))
    dt = actual.dtype if dtype is None else dtype
    float_format(dt)
    d = ulp_distance(actual, expected, dt).reshape(-1)
    a = actual.to(torch.float64).reshape(-1)
    e = expected.to(device=actual.device, dtype=torch.float64).reshape(-1)
    both_nan = a.isnan() & e.isnan()
    score = torch.where(d.isnan(), math.inf, d)
    if not equal_nan:
        score = torch.where(both_nan, math.inf, score)
    bad = score > max_ulp
    n_bad, n = int(bad.sum()), d.numel()
    if n_bad == 0:
        return
    name = str(dt).replace("torch.", "")
    fin = torch.isfinite(a) & torch.isfinite(e)
    absd = torch.where(fin, (a - e).abs(), -1.0)
    rel = torch.where(fin, absd / e.abs().clamp(min=float_format(dt).smallest_normal), -1.0)
    lines = [
        "Tensor-likes are not ULP-close!",
        "",
        f"Mismatched elements: {n_bad} / {n} ({100 * n_bad / n:.1f}%)",
    ]
    if bool(fin.any()):
        ia, ir = int(absd.argmax()), int(rel.argmax())
        lines.append(f"Greatest absolute difference: {float(absd[ia]):.6g} at index "
                     f"{_idx(ia, actual.shape)} (actual {float(a[ia])!r}, expected {float(e[ia])!r})")
        lines.append(f"Greatest relative difference: {float(rel[ir]):.6g} at index "
                     f"{_idx(ir, actual.shape)} (actual {float(a[ir])!r}, expected {float(e[ir])!r})")
    iu = int(score.argmax())
    lines.append(f"Greatest ULP distance: {float(d[iu]):.6g} at index {_idx(iu, actual.shape)} "
                 f"(up to {max_ulp:g} ULP of {name} allowed)")
    k = min(_SHOW, n_bad)
    order = torch.argsort(torch.where(bad, score, -1.0), descending=True, stable=True)[:k]
    lines.append(f"Worst {k} elements (index: actual, expected, ULP):")
    for j in order.tolist():
        lines.append(f"  {_idx(j, actual.shape)}: {float(a[j])!r}, {float(e[j])!r}, {float(d[j]):g}")
    lines.append("Hint: if the op is approximate by design raise max_ulp; otherwise compare "
                 "against a float64 golden with precisiondiff.comparators.compare_tensors.")
    raise AssertionError(_apply_msg("\n".join(lines), msg))


def _apply_msg(text: str, msg: Optional[Union[str, Callable[[str], str]]]) -> str:
    if msg is None:
        return text
    if callable(msg):
        return msg(text)
    return str(msg)


# ---- parity assertions (the library behind the pytest ``parity`` fixture) ---------------------
def assert_parity(workload: object, inputs: object = None, **options: object) -> "object":
    """Assert that a workload runs on the DUT within budget of the reference.

    Without pytest fixtures (e.g. inside a hypothesis ``@given`` test or a notebook). Options
    are those of :func:`precisiondiff.parity.check` (``target``, ``ref``, ``loss``, ``rel_l2``,
    ``max_ulp``, ``min_cosine``, ``kernels``, ``direction``, ``bisect``, ``dump_dir``, ``seed``).

    Returns:
        The :class:`~precisiondiff.parity.ParityResult` when it passed.

    Raises:
        AssertionError: with the compact parity report (first divergence, culprit, hint).

    Example:
        >>> assert_parity("examples/tiny_transformer.py:build", target="cpu/bf16")
    """
    __tracebackhide__ = True
    from .parity import check
    result = check(workload, inputs, **options)  # type: ignore[arg-type]
    if not result.passed:
        raise AssertionError(result.report())
    return result


def assert_op_parity(fn: Callable[..., object], *inputs: object, **options: object) -> "object":
    """Assert that one op or function on the DUT is within its budget of the reference.

    Options are those of :func:`precisiondiff.parity.check_op` (``target``, ``ref``, ``name``,
    ``kwargs``, ``max_ulp``, ``rel_l2``, ``min_cosine``).

    Raises:
        AssertionError: with the report and the comparators' mismatch message.

    Example:
        >>> assert_op_parity(torch.ops.aten.gelu.default, torch.randn(8), target="cpu/bf16", max_ulp=1)
    """
    __tracebackhide__ = True
    from .parity import check_op
    result = check_op(fn, *inputs, **options)  # type: ignore[arg-type]
    if not result.passed:
        raise AssertionError(result.report())
    return result
