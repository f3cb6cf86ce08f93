"""The accumulator of a summing kernel, measured from outside (Fasi, Higham, Mikaitis, Pranesh 2021).

Every experiment sums three non-zero terms placed in a row of zeros: a big ``M``, a small term
``t`` and ``-M``. When the kernel adds ``t`` to ``M`` before ``-M`` cancels it, the result
shows what its accumulator kept of ``M + t``; the result itself (``t`` or a multiple of
``ulp(M)``) is a power of two or a two-bit number, exact in any output dtype. A kernel may add
``M`` and ``-M`` first (then ``t`` comes through untouched): several placements of the three
terms are tried and the one that loses most is used — a placement can hide loss, never invent it.

- **bits kept**: ``t = M * 2**-k`` for k = 1, 2, ...; the first k whose ``t`` is lost is the
  accumulator's precision p in significand bits (24 for float32, 8 for bfloat16), whatever its
  rounding. ``short`` placements sit in the first 32 terms; ``long`` ones span K = 256, so a
  kernel that stores partial sums (split-K, blocked reductions) in fewer bits shows there.
- **rounding**: with ``u = ulp(M) = M * 2**-(p-1)``, sums ``M + {0.25, 0.5, 0.75, 1.5} u`` and
  their negatives, each repeated 32 times, decide nearest-even / nearest-away / toward zero /
  toward -inf / toward +inf, and stochastic when repeats of the same row differ.
- **extra bits** (truncating accumulators only): ``M - u * 2**-j``. A correctly truncated
  difference is the predecessor of M for every j; an accumulator that aligns the addend to
  p + e bits and drops the rest returns M once j > e. The largest j kept is e.
- **input bits** (product families): ``(1 + 2**-k) * 1`` alone in the row: the first k lost is
  the precision inputs are rounded to before the product (11 for TF32, the dtype's own if none).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comparators.ulp import float_format
from .ieee import classify
from .kernels import Kernels, dot

__all__ = ["scale", "bits_kept", "rounding", "extra_bits", "input_bits", "SHORT", "LONG"]

Placement = Tuple[int, int, int, int]  # (K, index of M, index of t, index of -M)
#: Placements of (M, t, -M) in rows of K terms: adjacent, one vector lane apart, across a block.
SHORT: Sequence[Placement] = ((4, 0, 1, 3), (4, 0, 1, 2), (16, 0, 1, 15), (32, 0, 16, 31),
                              (32, 0, 8, 31), (32, 1, 0, 31))
LONG: Sequence[Placement] = ((256, 0, 1, 255), (256, 0, 1, 128), (256, 0, 64, 255),
                             (256, 0, 128, 255), (256, 64, 65, 191))
REPEATS = 32


def scale(dtype: torch.dtype) -> Tuple[float, int]:
    """``(M, kmax)``: the big term and the deepest k with ``M * 2**-k`` normal in ``dtype``."""
    fmt = float_format(dtype)
    emax = math.frexp(fmt.max_finite)[1] - 1
    big_exp = 0 if emax > 64 else emax - 1
    kmax = min(60, big_exp - fmt.emin)
    return float(2.0 ** big_exp), int(kmax)


def _run(k: Kernels, family: str, n: int, terms: List[Dict[int, float]]) -> torch.Tensor:
    a = torch.zeros(len(terms), n, dtype=torch.float64)
    for r, row in enumerate(terms):
        for i, v in row.items():
            a[r, i] = v
    return dot(k, family, a)


def bits_kept(k: Kernels, family: str, placements: Sequence[Placement]) -> Tuple[Optional[int], Placement, str]:
    """The accumulator's precision p (None when nothing is lost up to kmax), the placement that
    lost most, and the evidence in words."""
    big, kmax = scale(k.dtype)
    worst: Tuple[Optional[int], Placement] = (None, placements[0])
    by_n: Dict[int, List[Placement]] = {}
    for p in placements:
        by_n.setdefault(p[0], []).append(p)
    for n, group in by_n.items():
        terms = [{ib: big, it: big * 2.0 ** -kk, ineg: -big}
                 for (_, ib, it, ineg) in group for kk in range(1, kmax + 1)]
        res = _run(k, family, n, terms).view(len(group), kmax)
        for g, place in enumerate(group):
            exact = big * 2.0 ** -torch.arange(1, kmax + 1, dtype=torch.float64)
            lost = (res[g] != exact).nonzero()
            p = int(lost[0]) + 1 if len(lost) else None
            if p is not None and (worst[0] is None or p < worst[0]):
                worst = (p, place)
    p, place = worst
    where = f"M={big:g} at {place[1]}, t at {place[2]}, -M at {place[3]} of K={place[0]}"
    if p is None:
        return None, place, f"M + M*2^-k kept for every k <= {kmax} ({where})"
    return p, place, f"M + M*2^-{p} lost, M*2^-{p - 1} kept ({where})"


def rounding(k: Kernels, family: str, p: int, place: Placement) -> Tuple[str, str]:
    """The accumulator's rounding mode, given its precision and a placement that loses bits."""
    big, _ = scale(k.dtype)
    u = big * 2.0 ** -(p - 1)
    fmt = float_format(k.dtype)
    if 0.25 * u < 2.0 ** fmt.emin:
        return "not measured", f"ulp(M)/4 = {0.25 * u:g} is subnormal in {k.dtype}"
    cases = {"+0.75": (big, 0.75 * u, -big), "+0.25": (big, 0.25 * u, -big),
             "+0.5": (big, 0.5 * u, -big), "+1.5": (big, 1.5 * u, -big),
             "-0.75": (-big, -0.75 * u, big), "-0.25": (-big, -0.25 * u, big)}
    n, ib, it, ineg = place
    terms = [{ib: b, it: t, ineg: m} for (b, t, m) in cases.values() for _ in range(REPEATS)]
    res = _run(k, family, n, terms).view(len(cases), REPEATS) / u
    out = {}
    for name, row in zip(cases, res):
        if bool((row != row[0]).any()):
            up = float((row.abs() > abs(float(name))).double().mean())
            return "stochastic", f"M{name}u rounded away from zero in {up:.0%} of {REPEATS} repeats"
        out[name] = float(row[0])
    seen = ", ".join(f"{'M' if name[0] == '+' else '-M'}{name}u -> {v:+g}u" for name, v in out.items())
    return classify(out), seen


def extra_bits(k: Kernels, family: str, p: int, place: Placement, most: int = 8) -> Tuple[object, str]:
    """For a truncating accumulator: how many bits below its last place an addend keeps."""
    big, _ = scale(k.dtype)
    u = big * 2.0 ** -(p - 1)
    fmt = float_format(k.dtype)
    most = min(most, int(torch.log2(torch.tensor(u)).item()) - fmt.emin)
    n, ib, it, ineg = place
    terms = [{ib: big, it: -u * 2.0 ** -j, ineg: -big} for j in range(1, most + 1)]
    res = _run(k, family, n, terms)
    kept = (res == -u / 2).tolist()
    e = kept.index(False) if False in kept else None
    if e is None:
        return "exact", f"M - ulp*2^-j truncated correctly to pred(M) for j = 1..{most}"
    return e, f"M - ulp*2^-{e + 1} gives M: the addend is cut {e} bits below the accumulator's last place"


def input_bits(k: Kernels, family: str) -> Tuple[int, str]:
    """Precision of the operands as the product sees them (TF32 rounding shows as 11)."""
    full = float_format(k.dtype).mant_bits + 1
    n = 16
    sides = ["a"] + (["b"] if family in ("gemm", "bmm") else [])
    worst, evidence = full, f"1 + 2^-k kept for k < {full} on operand {'/'.join(sides)}"
    for side in sides:
        a = torch.zeros(full - 1, n, dtype=torch.float64)
        b = torch.ones(full - 1, n, dtype=torch.float64)
        x = 1 + 2.0 ** -torch.arange(1, full, dtype=torch.float64)
        (a if side == "a" else b)[:, 0] = x
        if side == "b":
            a[:, 0] = 1.0
        res = dot(k, family, a, b if side == "b" else None)
        lost = (res != x).nonzero()
        if len(lost) and int(lost[0]) + 1 < worst:
            worst = int(lost[0]) + 1
            evidence = f"operand {side}: 1 + 2^-{worst} became {float(res[worst - 1]):.10g}"
    return worst, evidence
