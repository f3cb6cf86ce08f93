"""Units in the last place: distance, spacing and error, vectorized on any device.

Every function here works element-wise on tensors, on the tensors' own device, without Python
loops over elements. Supported formats (``SUPPORTED_DTYPES``): float64, float32, float16,
bfloat16, float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz. Any other dtype raises
:class:`UnsupportedDtypeError`.

Rounding rule used everywhere a value is rounded to a format: round to nearest, ties to even
(IEEE 754 ``roundTiesToEven``), done in one step even from float64 (float64 is first rounded to
float32 *to odd*, which makes the second rounding exact-equivalent to a single one). Overflow
gives the format's infinity when it has one, else NaN (float8_e4m3fn, *fnuz: the OCP
non-saturating convention; note that ``tensor.to(torch.float8_e4m3fn)`` saturates instead).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import PrecisionDiffError

__all__ = [
    "ComparatorError",
    "UnsupportedDtypeError",
    "FloatFormat",
    "SUPPORTED_DTYPES",
    "float_format",
    "round_to_dtype",
    "ulp_distance",
    "ulp_spacing",
    "ulp_error",
]


class ComparatorError(PrecisionDiffError):
    """Tensors cannot be compared as asked (shapes differ, bad option values)."""


class UnsupportedDtypeError(ComparatorError):
    """The dtype has no ULP definition here (integer, bool, complex, float4, e8m0)."""


@dataclass(frozen=True)
class FloatFormat:
    """Bit layout of a floating-point format.

    Attributes:
        dtype: The torch dtype.
        bits: Storage width in bits.
        mant_bits: Stored mantissa (fraction) bits ``p - 1``.
        emin: Exponent of the smallest normal number (``2**emin``).
        max_finite: Largest finite value.
        has_inf: Whether the format encodes infinities.
        unit_roundoff: ``u = 2**-(mant_bits + 1)``: the largest relative error of rounding.
    """

    dtype: torch.dtype
    bits: int
    mant_bits: int
    emin: int
    max_finite: float
    has_inf: bool

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mant_bits + 1)

    @property
    def smallest_normal(self) -> float:
        return 2.0**self.emin

    @property
    def overflow_threshold(self) -> float:
        """Half-way point between ``max_finite`` and the next (unrepresentable) value."""
        top = 2.0 ** (_exponent(self.max_finite) - self.mant_bits)
        return self.max_finite + top / 2


def _exponent(x: float) -> int:
    return math.frexp(x)[1] - 1


def _make(dtype: torch.dtype, bits: int, mant_bits: int, has_inf: bool) -> FloatFormat:
    # Mantissa bits are given explicitly: torch.finfo(float8_e5m2fnuz).eps reads 2**-3.
    fi = torch.finfo(dtype)
    emin = round(torch.log2(torch.tensor(fi.smallest_normal, dtype=torch.float64)).item())
    return FloatFormat(dtype, bits, mant_bits, emin, float(fi.max), has_inf)


#: name -> (storage bits, stored mantissa bits, has infinity)
_LAYOUTS = {
    "float64": (64, 52, True),
    "float32": (32, 23, True),
    "float16": (16, 10, True),
    "bfloat16": (16, 7, True),
    "float8_e4m3fn": (8, 3, False),
    "float8_e4m3fnuz": (8, 3, False),
    "float8_e5m2": (8, 2, True),
    "float8_e5m2fnuz": (8, 2, False),
}
_FORMATS: dict = {}
for _name, (_bits, _mant, _inf) in _LAYOUTS.items():
    _dt = getattr(torch, _name, None)
    if _dt is not None:
        _FORMATS[_dt] = _make(_dt, _bits, _mant, _inf)

SUPPORTED_DTYPES = tuple(_FORMATS)

_INT_VIEW = {64: torch.int64, 32: torch.int32, 16: torch.int16, 8: torch.uint8}


def float_format(dtype: torch.dtype) -> FloatFormat:
    """Return the :class:`FloatFormat` of ``dtype``.

    Raises:
        UnsupportedDtypeError: ``dtype`` is not one of ``SUPPORTED_DTYPES``.

    Example:
        >>> float_format(torch.bfloat16).mant_bits
        7
    """
    try:
        return _FORMATS[dtype]
    except KeyError:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise UnsupportedDtypeError(
            f"no ULP definition for dtype {dtype}; supported: {names}"
        ) from None


def _as_float_tensor(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.is_complex():
        raise UnsupportedDtypeError(f"{what} is complex ({x.dtype}); compare real and imaginary parts")
    return x


def _round_to_odd_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounding to odd: inexact results get an odd last mantissa bit."""
    r = x.to(torch.float32)
    back = r.to(torch.float64)
    fix = (back != x) & ~x.isnan() & ((r.view(torch.int32) & 1) == 0)
    if bool(fix.any()):
        toward = torch.where(x > back, float("inf"), float("-inf")).to(torch.float32)
        r = torch.where(fix, torch.nextafter(r, toward), r)
    return r


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` with one round-to-nearest-even step.

    Overflow gives infinity in formats that have it and NaN in the others (float8_e4m3fn and
    the fnuz types), unlike torch's saturating float8_e4m3fn cast.

    Args:
        x: Any real tensor.
        dtype: Target format, one of ``SUPPORTED_DTYPES``.

    Returns:
        A tensor of ``dtype`` on ``x.device``.

    Raises:
        UnsupportedDtypeError: ``dtype`` or ``x.dtype`` cannot be handled.

    Example:
        >>> round_to_dtype(torch.tensor([1 + 2**-8], dtype=torch.float64), torch.bfloat16)
        tensor([1.], dtype=torch.bfloat16)
    """
    fmt = float_format(dtype)
    x = _as_float_tensor(x, "input")
    if x.dtype == dtype:
        return x
    if dtype in (torch.float64, torch.float32):
        return x.to(dtype)
    if x.dtype == torch.float64 and dtype in _MIDPOINT_BITS:
        return _round_f64_to_16bit(x, dtype)
    if x.dtype == torch.float64 or not x.is_floating_point():
        x32 = _round_to_odd_f32(x.to(torch.float64))
    else:
        x32 = x.to(torch.float32)  # exact from float32 and narrower
    return _fix_overflow(x32, x32.to(dtype), fmt)


#: dtype -> (mask of the float32 bits below the format's last place, the half-way pattern,
#: float32 exponent field below which the format is subnormal, or 0 when it never is there).
_MIDPOINT_BITS = {
    torch.bfloat16: (0xFFFF, 0x8000, 0),  # same exponent range as float32: grids nest
    torch.float16: (0x1FFF, 0x1000, 113 << 23),  # 2**-14 = float32 exponent field 113
}


def _round_f64_to_16bit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> bfloat16/float16, one rounding, at the cost of torch's double-rounding cast.

    ``RN16(RN32(x)) != RN16(x)`` only when ``RN32(x)`` is exactly a half-way point of the
    16-bit format: every half-way point (the overflow threshold included) is a float32 value
    and RN32 is monotone, so otherwise ``x`` and ``RN32(x)`` lie strictly on the same side of
    every rounding boundary. Those candidates (float32 bits below the 16-bit last place equal
    to ``100..0``; for float16 also every value in its subnormal range, whose last place is
    coarser) are re-rounded with the round-to-odd path; about 2**-16 of random data.
    """
    mask, half, sub_exp = _MIDPOINT_BITS[dtype]
    x32 = x.to(torch.float32)
    bits = x32.view(torch.int32)
    cand = (bits & mask) == half
    if sub_exp:
        cand |= (bits & 0x7F800000) < sub_exp
    r = x32.to(dtype)
    if bool(cand.any()):
        idx = cand.reshape(-1).nonzero().squeeze(1)
        flat = r.reshape(-1)
        xs = _round_to_odd_f32(x.reshape(-1)[idx])
        flat[idx] = _fix_overflow(xs, xs.to(dtype), float_format(dtype))
    return r


def _fix_overflow(x32: torch.Tensor, r: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    thr = fmt.overflow_threshold
    max_is_odd = (_max_bits(fmt) & 1) == 1
    over = (x32.abs() >= thr) if max_is_odd else (x32.abs() > thr)
    if bool(over.any()):
        if fmt.has_inf:
            special = torch.where(x32 > 0, float("inf"), float("-inf"))
        else:
            special = torch.full_like(x32, float("nan"))
        r = torch.where(over, special.to(torch.float32), r.to(torch.float32)).to(fmt.dtype)
    return r


def _ordered_key(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Sign-magnitude bit pattern -> ordered integer (int32 up to 16 bits, int64 above).

    ``key = -magnitude if sign else magnitude``; +0 and -0 both map to 0. Not for float64
    (differences of keys overflow int64; :func:`ulp_distance` handles it).
    """
    s = x.contiguous().view(_SIGNED_VIEW[fmt.bits])
    s = s.to(torch.int32 if fmt.bits <= 16 else torch.int64)
    mag = s & ((1 << (fmt.bits - 1)) - 1)
    return torch.where(s < 0, -mag, mag)


_SIGNED_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.int8}


@functools.lru_cache(maxsize=None)
def _max_bits(fmt: FloatFormat) -> int:
    t = torch.tensor([fmt.max_finite], dtype=torch.float64).to(torch.float32).to(fmt.dtype)
    return int(t.view(_INT_VIEW[fmt.bits]).to(torch.int64).item())


def _ordered_magnitude(x: torch.Tensor, fmt: FloatFormat):
    """Return (negative, magnitude) of the bit pattern, as bool and int64 tensors."""
    bits = x.contiguous().view(_INT_VIEW[fmt.bits])
    if fmt.bits == 64:
        return bits < 0, bits & 0x7FFFFFFFFFFFFFFF
    b = bits.to(torch.int64)
    if fmt.bits < 64 and bits.dtype != torch.uint8:
        b = b & ((1 << fmt.bits) - 1)
    sign = (b >> (fmt.bits - 1)) & 1
    return sign.bool(), b & ((1 << (fmt.bits - 1)) - 1)


def ulp_distance(
    actual: torch.Tensor, expected: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Number of representable ``dtype`` values between ``actual`` and ``expected``.

    Both operands are rounded to ``dtype`` (round to nearest even; ``actual`` is normally
    already in it). The bit patterns are mapped to ordered integers
    ``key = -magnitude if sign else magnitude`` (sign-magnitude to two's-complement order)
    and the result is ``|key(actual) - key(expected)|``.

    Rules: +0 and -0 are 0 apart; equal infinities 0; an infinity and the largest finite value
    1 apart; both NaN: 0; exactly one NaN: NaN. An ``expected`` that overflows ``dtype``
    rounds to infinity, or to NaN in formats without infinity (float8_e4m3fn, *fnuz).

    Precision of the float64 result: exact for every format except float64, where distances
    below 2**53 are exact and larger ones (only between values of very different magnitude)
    carry a relative error of at most 2**-52.

    Args:
        actual: Tensor under test.
        expected: Reference values, any real dtype, same shape as ``actual``.
        dtype: Format whose ULPs are counted; defaults to ``actual.dtype``.

    Returns:
        float64 tensor of ``actual``'s shape, on ``actual``'s device.

    Raises:
        UnsupportedDtypeError: ``dtype`` (or ``actual.dtype`` by default) has no ULP definition.
        ComparatorError: Shapes differ.

    Example:
        >>> one = torch.tensor([1.0], dtype=torch.bfloat16)
        >>> ulp_distance(torch.nextafter(one, 2 * one), one)
        tensor([1.], dtype=torch.float64)
    """
    actual = _as_float_tensor(actual, "actual")
    expected = _as_float_tensor(expected, "expected")
    dtype = actual.dtype if dtype is None else dtype
    fmt = float_format(dtype)
    if actual.shape != expected.shape:
        raise ComparatorError(
            f"shapes differ: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    a = round_to_dtype(actual, dtype)
    e = round_to_dtype(expected.to(actual.device), dtype)
    a_nan, e_nan = a.isnan(), e.isnan()
    sa, ma = _ordered_magnitude(a, fmt)
    se, me = _ordered_magnitude(e, fmt)
    same = sa == se
    if fmt.bits < 64:
        ka = torch.where(sa, -ma, ma)
        ke = torch.where(se, -me, me)
        d = (ka - ke).abs().to(torch.float64)
    else:
        diff_same = (ma - me).abs()
        # Opposite signs: ma + me may reach 2**64; add halves so nothing overflows int64.
        h = (ma >> 1) + (me >> 1)
        lo = (ma & 1) + (me & 1)
        small = h < (1 << 61)
        exact = (h.clamp(max=(1 << 61) - 1) * 2 + lo).to(torch.float64)
        approx = h.to(torch.float64) * 2 + lo.to(torch.float64)
        d_opp = torch.where(small, exact, approx)
        d = torch.where(same, diff_same.to(torch.float64), d_opp)
    d = torch.where(a_nan | e_nan, float("nan"), d)
    d = torch.where(a_nan & e_nan, 0.0, d)
    return d.reshape(actual.shape)


def ulp_spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at ``x``: the ULP of the binade that contains ``|x|``.

    ``spacing(x) = 2**(max(floor(log2 |x|), emin) - mant_bits)``: for normal ``|x|`` the gap
    between consecutive values of the binade ``[2**e, 2**(e+1))``; below the smallest normal
    (and at 0) the constant subnormal spacing ``2**(emin - mant_bits)``. ``x`` is *not*
    rounded first, and values beyond ``max_finite`` keep the binade rule. Infinities give
    inf, NaN gives NaN.

    Args:
        x: Any real tensor (computed in float64).
        dtype: Format whose spacing is wanted.

    Returns:
        float64 tensor, same shape and device as ``x``.

    Raises:
        UnsupportedDtypeError: ``dtype`` has no ULP definition.

    Example:
        >>> ulp_spacing(torch.tensor([1.5, 0.0]), torch.bfloat16)
        tensor([7.8125e-03, 9.1835e-41], dtype=torch.float64)
    """
    fmt = float_format(dtype)
    x64 = _as_float_tensor(x, "x").to(torch.float64)
    ax = x64.abs()
    if fmt.emin - fmt.mant_bits >= -1022 and x64.device.type == "cpu":
        return _spacing_from_bits(ax, fmt)
    finite = torch.isfinite(ax)
    _, e = torch.frexp(torch.where(finite, ax, 1.0))
    e = torch.where(ax == 0, fmt.emin + 1, e.to(torch.int64))  # frexp(0) has exponent 0
    ebin = torch.clamp(e - 1, min=fmt.emin) - fmt.mant_bits
    sp = torch.ldexp(torch.ones_like(ax), ebin.to(torch.float64))
    return torch.where(finite, sp, ax)


def _spacing_from_bits(ax: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """:func:`ulp_spacing` of ``ax = |x|`` (float64) from its bits, for formats whose spacing is a
    normal float64 (all but float64): the same powers of two as the frexp/ldexp path (an exact
    function of the exponent field), at a fraction of its cost (``ldexp`` with a tensor exponent
    is a ``pow`` per element: most of the peer rule's time on CPU). A float64 subnormal or zero has
    exponent field 0, below every such format's ``emin``, so it clamps to the subnormal spacing as
    ``frexp`` does; infinities and NaN (field 2047) give ``ax``."""
    field = ax.contiguous().view(torch.int64) >> 52  # |x|: the sign bit is clear
    ebin = torch.clamp(field - 1023, min=fmt.emin) - fmt.mant_bits
    sp = ((ebin + 1023) << 52).view(torch.float64).reshape(ax.shape)
    return torch.where(field.reshape(ax.shape) == 2047, ax, sp)


def ulp_error(
    actual: torch.Tensor, golden: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Error of ``actual`` in units of the ``dtype`` spacing at the unrounded ``golden``.

    ``ulp_error = |actual - golden| / ulp_spacing(golden, dtype)``, all in float64, golden
    *not* rounded to ``dtype``. A correctly rounded result has ``ulp_error <= 0.5``.
    Special values: both NaN: 0; one NaN: NaN; ``golden`` infinite: 0 if ``actual`` equals it
    else inf; ``actual`` infinite and ``golden`` finite: inf.

    Args:
        actual: Tensor under test.
        golden: High-precision reference (e.g. float64), same shape as ``actual``.
        dtype: Format of the spacing; defaults to ``actual.dtype``.

    Returns:
        float64 tensor of ``actual``'s shape, on ``actual``'s device.

    Raises:
        UnsupportedDtypeError: ``dtype`` has no ULP definition.
        ComparatorError: Shapes differ.

    Example:
        >>> ulp_error(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.001953125]))
        tensor([0.2500], dtype=torch.float64)
    """
    actual = _as_float_tensor(actual, "actual")
    golden = _as_float_tensor(golden, "golden")
    dtype = actual.dtype if dtype is None else dtype
    float_format(dtype)
    if actual.shape != golden.shape:
        raise ComparatorError(
            f"shapes differ: actual {tuple(actual.shape)} vs golden {tuple(golden.shape)}"
        )
    a = actual.to(torch.float64)
    g = golden.to(device=actual.device, dtype=torch.float64)
    err = (a - g).abs() / ulp_spacing(g, dtype)
    g_inf = torch.isinf(g)
    err = torch.where(g_inf, torch.where(a == g, 0.0, float("inf")), err)
    both_nan = a.isnan() & g.isnan()
    err = torch.where(a.isnan() ^ g.isnan(), float("nan"), err)
    return torch.where(both_nan, 0.0, err)
