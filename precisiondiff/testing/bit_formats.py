"""Bit formats of the float dtypes, and elements drawn as bit patterns of a format.

Every special value of every format is reachable exactly and shrinks well: ±0, the smallest and
largest subnormals, the smallest normal, the largest finite value, ±inf (where the format has
one) and NaN, next to moderate normal values and uniformly random encodings. The tensor, shape
and op-input strategies built on these are in :mod:`precisiondiff.testing.strategies` (public as
``precisiondiff.strategies``, which re-exports these names too).

Formats: float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2. Any other dtype raises
:class:`~precisiondiff.errors.PrecisionDiffError` (never a silent fallback).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch

from ..errors import PrecisionDiffError

try:
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - exercised only without hypothesis
    raise ImportError("precisiondiff.strategies needs hypothesis: pip install 'precisiondiff[test]' "
                      "(or pip install hypothesis)") from err

__all__ = ["BitFormat", "bit_format", "special_values", "floats_of"]

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class BitFormat:
    """Bit layout of a float format, enough to enumerate its special encodings.

    Attributes:
        dtype: the torch dtype.
        exp_bits: exponent field width ``E``.
        mant_bits: stored mantissa width ``M``; the total width is ``1 + E + M``.
        ieee: the all-ones exponent encodes inf/NaN (False for float8_e4m3fn, whose only NaN is
            ``S.1111.111`` and which has no infinity).
    """

    dtype: torch.dtype
    exp_bits: int
    mant_bits: int
    ieee: bool = True

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.mant_bits

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    def classify(self, pattern: int) -> str:
        """``nan``, ``inf``, ``zero``, ``subnormal`` or ``normal`` for an unsigned pattern."""
        mag = pattern & (self.sign_bit - 1)
        exp, mant = mag >> self.mant_bits, mag & ((1 << self.mant_bits) - 1)
        top = (1 << self.exp_bits) - 1
        if self.ieee and exp == top:
            return "nan" if mant else "inf"
        if not self.ieee and mag == (1 << (self.bits - 1)) - 1:
            return "nan"
        if exp == 0:
            return "subnormal" if mant else "zero"
        return "normal"


# One row per supported format: (exponent bits, mantissa bits, IEEE-style inf/NaN).
_FORMATS: Dict[torch.dtype, BitFormat] = {
    torch.float64: BitFormat(torch.float64, 11, 52),
    torch.float32: BitFormat(torch.float32, 8, 23),
    torch.float16: BitFormat(torch.float16, 5, 10),
    torch.bfloat16: BitFormat(torch.bfloat16, 8, 7),
}
for _name, _fmt in (("float8_e4m3fn", (4, 3, False)), ("float8_e5m2", (5, 2, True))):
    if hasattr(torch, _name):
        _FORMATS[getattr(torch, _name)] = BitFormat(getattr(torch, _name), *_fmt)

# Same-width integer type used to reinterpret bit patterns as the float format.
_INT_OF_WIDTH = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def bit_format(dtype: torch.dtype) -> BitFormat:
    """The :class:`BitFormat` of ``dtype``.

    Raises:
        PrecisionDiffError: the dtype is not one of the supported float formats.
    """
    try:
        return _FORMATS[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in _FORMATS)
        raise PrecisionDiffError(f"no tensor strategy for {dtype}: use one of {names}") from None


def special_values(dtype: torch.dtype) -> Dict[str, int]:
    """Named special bit patterns (unsigned) of ``dtype``: zeros, subnormals, extremes, inf, NaN.

    Example:
        >>> hex(special_values(torch.bfloat16)["inf"])
        '0x7f80'
    """
    f = bit_format(dtype)
    m, s = f.mant_bits, f.sign_bit
    top = (1 << f.exp_bits) - 1
    max_finite = ((top - 1) << m) | ((1 << m) - 1) if f.ieee else (top << m) | ((1 << m) - 2)
    values = {
        "zero": 0, "-zero": s,
        "min_subnormal": 1, "-min_subnormal": s | 1,
        "max_subnormal": (1 << m) - 1, "-max_subnormal": s | ((1 << m) - 1),
        "min_normal": 1 << m, "-min_normal": s | (1 << m),
        "one": f.bias << m, "-one": s | (f.bias << m),
        "max_finite": max_finite, "-max_finite": s | max_finite,
    }
    if f.ieee:
        values.update({"inf": top << m, "-inf": s | (top << m), "nan": (top << m) | (1 << (m - 1))})
    else:
        values["nan"] = (1 << (f.bits - 1)) - 1
    return values


def _patterns_to_tensor(patterns: Sequence[int], fmt: BitFormat, shape: Shape) -> torch.Tensor:
    width = fmt.bits
    if width == 8:
        ints = list(patterns)
    else:  # signed storage of the same width
        ints = [p - (1 << width) if p >= (1 << (width - 1)) else p for p in patterns]
    raw = torch.tensor(ints, dtype=_INT_OF_WIDTH[width]).reshape(shape)
    return raw.view(fmt.dtype)


def _moderate(fmt: BitFormat) -> st.SearchStrategy[int]:
    """Normal values with magnitude in [2**-4, 2**5): the bulk of real activations."""
    return st.builds(lambda sign, exp, mant: (sign << (fmt.bits - 1)) | ((fmt.bias + exp) << fmt.mant_bits) | mant,
                     st.integers(0, 1), st.integers(-4, 4), st.integers(0, (1 << fmt.mant_bits) - 1))


def floats_of(dtype: torch.dtype, *, allow_nan: bool = True, allow_inf: bool = True,
              allow_subnormal: bool = True) -> st.SearchStrategy[int]:
    """Bit patterns (unsigned ints) of ``dtype``: specials, moderate normals, any encoding.

    Args:
        dtype: a supported float dtype.
        allow_nan: include NaN encodings.
        allow_inf: include ±inf (ignored for formats without infinity).
        allow_subnormal: include subnormals.

    Returns:
        A strategy of unsigned bit patterns, one element each.
    """
    fmt = bit_format(dtype)
    specials = special_values(dtype)
    banned = set()
    if not allow_nan:
        banned.add("nan")
    if not allow_inf:
        banned.add("inf")
    if not allow_subnormal:
        banned.add("subnormal")
    pool = sorted(v for v in specials.values() if fmt.classify(v) not in banned)
    any_pattern = st.integers(0, (1 << fmt.bits) - 1)
    if banned:
        any_pattern = any_pattern.filter(lambda p: fmt.classify(p) not in banned)
    return st.one_of(st.sampled_from(pool), _moderate(fmt), any_pattern)
