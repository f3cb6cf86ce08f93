"""IEEE corner cases: casts, subnormals, signed zeros, NaN payloads.

- **cast rounding**: ``1 + f * ulp`` for f in 0.25, 0.5, 0.75, 1.5 and the negatives, cast from
  float32 (each repeated 32 times): nearest-even, nearest-away, toward zero/-inf/+inf, or
  stochastic, decided as for accumulators.
- **cast overflow**: ``2 * max_finite`` of the target format (float32's largest for bfloat16): ``inf``, ``saturate`` (the largest
  finite value) or ``nan``.
- **subnormals**: a result that should be subnormal (``1.5 * tiny - tiny`` in a sum, ``tiny / 2``
  in a product, ``3 * smallest`` in a cast): ``kept`` or ``flushed`` (FTZ); and a subnormal
  input times one: read as zero (DAZ) or not.
- **signed zero**: ``-0 * 1``, ``-0 + -0`` and ``+0 + -0`` against IEEE 754 (``-0``, ``-0``,
  ``+0``); for sums, whether a row of ``-0`` sums to ``-0`` (IEEE, and what a sum seeded with
  its first term gives) or ``+0`` (a sum seeded with ``+0``).
- **NaN payload**: a quiet NaN with payload bits, times one: ``propagated`` (same bits),
  ``canonical`` (the default NaN) or ``changed``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..comparators.ulp import float_format
from .kernels import Kernels, dot

__all__ = ["cast_rounding", "cast_overflow", "cast_subnormals", "subnormals", "signed_zero",
           "sum_of_negative_zeros", "nan_payload", "cast_targets"]

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cast_targets(dtype: torch.dtype) -> List[torch.dtype]:
    """The formats a float32 cast is probed into for a card in ``dtype``."""
    main = [dtype] if dtype not in (torch.float32, torch.float64) else [torch.bfloat16, torch.float16]
    return main + [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                   if d is not None]


def _cast(k: Kernels, x: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    out = k.ops["cast"](x.to(torch.float32).to(k.device), dst)
    return out.detach().to("cpu").to(torch.float64)


def classify(out: dict) -> str:
    """Name a rounding mode from results in ulps for the cases +0.75, +0.25, +0.5, +1.5, -0.75, -0.25."""
    pos, neg = (out["+0.75"], out["+0.25"]), (out["-0.75"], out["-0.25"])
    if pos == (1, 0) and neg == (-1, 0):
        ties = {(0, 2): "nearest-even", (1, 2): "nearest-away", (0, 1): "nearest, ties toward zero"}
        return ties.get((out["+0.5"], out["+1.5"]), "nearest, ties unrecognised")
    modes = {((0, 0), (0, 0)): "toward-zero", ((0, 0), (-1, -1)): "toward-negative",
             ((1, 1), (0, 0)): "toward-positive"}
    return modes.get((pos, neg), "unrecognised")


def cast_rounding(k: Kernels, dst: torch.dtype, repeats: int = 32) -> Tuple[str, str]:
    """Rounding mode of the float32 -> ``dst`` cast."""
    u = 2.0 ** -float_format(dst).mant_bits
    fracs = {"+0.75": 0.75, "+0.25": 0.25, "+0.5": 0.5, "+1.5": 1.5, "-0.75": -0.75, "-0.25": -0.25}
    x = torch.tensor([(1 if f > 0 else -1) + f * u for f in fracs.values()], dtype=torch.float64)
    res = _cast(k, x.repeat_interleave(repeats), dst).view(len(fracs), repeats)
    res = (res - torch.sign(x)[:, None]) / u
    out = {}
    for name, row in zip(fracs, res):
        if bool((row != row[0]).any()):
            return "stochastic", f"1{name}ulp rounded both ways in {repeats} repeats"
        out[name] = float(row[0])
    seen = ", ".join(f"{'' if n[0] == '+' else '-'}1{n}u -> {v:+g}u" for n, v in out.items())
    return classify(out), seen


def cast_overflow(k: Kernels, dst: torch.dtype) -> Tuple[str, str]:
    """What a finite float32 value far above the largest finite ``dst`` value becomes (twice it,
    or float32's largest value for formats as wide as float32)."""
    big = float_format(dst).max_finite
    x = min(2 * big, float_format(torch.float32).max_finite)
    res = float(_cast(k, torch.tensor([x], dtype=torch.float64), dst)[0])
    name = "inf" if res == float("inf") else "nan" if res != res else "saturate" if res == big else "other"
    return name, f"{x:g} -> {res:g}"


def cast_subnormals(k: Kernels, dst: torch.dtype) -> Tuple[str, str]:
    """Whether a float32 value that is subnormal in ``dst`` survives the cast."""
    fmt = float_format(dst)
    tiny = 3 * 2.0 ** (fmt.emin - fmt.mant_bits)
    res = float(_cast(k, torch.tensor([tiny], dtype=torch.float64), dst)[0])
    return ("kept" if res == tiny else "flushed" if res == 0 else "other"), f"{tiny:g} -> {res:g}"


def _tiny(dtype: torch.dtype) -> Tuple[float, float]:
    fmt = float_format(dtype)
    return 2.0 ** fmt.emin, 2.0 ** (fmt.emin - fmt.mant_bits)


def subnormals(k: Kernels, family: str) -> Tuple[str, str]:
    """``kept``, ``flushed`` (FTZ: subnormal results become 0), ``read as zero`` (DAZ: subnormal
    inputs count as 0 even where the result is normal) or both, for ``mul``, ``add`` or a
    summing family."""
    normal, smallest = _tiny(k.dtype)
    sub = 2 * smallest
    if family == "mul":
        scale = 2.0 ** (float_format(k.dtype).mant_bits + 1)
        x = torch.tensor([normal, sub], dtype=torch.float64)
        y = torch.tensor([0.5, scale], dtype=torch.float64)
        want, if_daz = [0.5 * normal, sub * scale], 0.0
    else:
        x = torch.tensor([1.5 * normal, sub], dtype=torch.float64)
        y = torch.tensor([-normal, normal], dtype=torch.float64)
        want, if_daz = [0.5 * normal, normal + sub], normal
    if family in ("mul", "add"):
        res = k.ops[family](k.put(x), k.put(y)).to("cpu").to(torch.float64)
    else:
        a = torch.zeros(2, 8, dtype=torch.float64)
        a[:, 0], a[:, 1] = x, y
        res = dot(k, family, a)
    got = [float(res[0]), float(res[1])]
    evidence = (f"subnormal result {want[0]:g} -> {got[0]:g}; subnormal input: "
                f"{x[1].item():g} {'*' if family == 'mul' else '+'} {y[1].item():g} -> {got[1]:g}")
    if got[0] not in (0.0, want[0]) or got[1] not in (if_daz, want[1]):
        return "other", evidence
    ftz, daz = got[0] == 0.0, got[1] != want[1]
    return {(False, False): "kept", (True, False): "flushed", (False, True): "read as zero",
            (True, True): "flushed, read as zero"}[(ftz, daz)], evidence


def _signs(t: torch.Tensor) -> List[str]:
    return ["-0" if float(torch.copysign(torch.tensor(1.0), v)) < 0 else "+0" if v == 0 else f"{float(v):g}"
            for v in t]


def signed_zero(k: Kernels) -> Tuple[str, str]:
    """``IEEE`` when -0*1 = -0, -0 + -0 = -0 and +0 + -0 = +0; else what differs."""
    neg = k.put(torch.tensor([-0.0, -0.0], dtype=torch.float64))
    one = k.put(torch.tensor([1.0, 1.0], dtype=torch.float64))
    pos = k.put(torch.tensor([0.0, 0.0], dtype=torch.float64))
    got = {"-0*1": _signs(k.ops["mul"](neg, one).to("cpu"))[0],
           "-0+-0": _signs(k.ops["add"](neg, neg).to("cpu"))[0],
           "+0+-0": _signs(k.ops["add"](pos, neg).to("cpu"))[0]}
    ieee = {"-0*1": "-0", "-0+-0": "-0", "+0+-0": "+0"}
    evidence = ", ".join(f"{e} = {v}" for e, v in got.items())
    return ("IEEE" if got == ieee else "non-IEEE"), evidence


def sum_of_negative_zeros(k: Kernels, family: str) -> Tuple[str, str]:
    """The sign of a summing kernel's result over a row of -0 terms."""
    res = dot(k, family, torch.full((1, 16), -0.0, dtype=torch.float64))
    sign = _signs(res)[0]
    return sign, f"16 terms of -0 sum to {sign}"


def nan_payload(k: Kernels) -> Tuple[str, str]:
    """Whether ``x * 1`` keeps a quiet NaN's payload bits."""
    fmt = float_format(k.dtype)
    itype = _INT[fmt.bits // 8]
    quiet = (((1 << (fmt.bits - 1 - fmt.mant_bits)) - 1) << fmt.mant_bits) | (1 << (fmt.mant_bits - 1))
    pattern = quiet | 0b101
    if pattern >= 1 << (fmt.bits - 1):
        pattern -= 1 << fmt.bits
    x = torch.tensor([pattern], dtype=itype).view(k.dtype)
    out = k.ops["mul"](x.to(k.device), torch.ones(1, dtype=k.dtype, device=k.device)).to("cpu")
    bits = int(out.view(itype)[0]) & ((1 << fmt.bits) - 1)
    want = pattern & ((1 << fmt.bits) - 1)
    if not bool(out.isnan().all()):
        return "lost", f"NaN 0x{want:x} * 1 -> {float(out[0]):g}"
    verdict = "propagated" if bits == want else "canonical" if bits & ~(1 << (fmt.bits - 1)) == quiet else "changed"
    return verdict, f"NaN 0x{want:x} * 1 -> 0x{bits:x}"
