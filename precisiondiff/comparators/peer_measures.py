"""What the peer rule measures of one output: in one pass, or a block of elements at a time.

:func:`~precisiondiff.comparators.peers.judge_against_peers` turns these measurements into its
verdict (the rule is described there and in docs/comparators.md). Measured in one pass
(:func:`measure_whole`), the rule holds ~16 float64 temporaries of the output's size at once: the
finite masks, the element ULP and the max rule's unit, the differences, the floor's terms, the
statistics' scaled errors. For `lm_head`'s 32000 x 2048 weight gradient that is 8 GiB over the
golden, the peak of a bisect of a billion-parameter model. :func:`measure_in_blocks` makes each of
them for one block of elements at a time; its sums are
:class:`~precisiondiff.comparators.error_stats.DetSum` (the same 4096-element rows as ``det_sum``,
carried across the blocks), maxima and counts are exact, so every figure is the one pass's, bit for
bit. What needs the whole tensor takes an earlier pass:

1. the finite masks and the NaN/Inf nothing explains; ``sum g^2`` over the finite golden (its norm
   and the significance threshold's RMS) and over the elements the statistics use;
2. the size rules (norms, maxima, the floor), the statistics' means (bias, RMSE) and the peers'
   worst in the tail's unit;
3. the standard deviation of the informative errors about their mean, and the tail count beyond
   the peers' worst;
4. only when the RMSE ratio is over its minimum: the paired excess's mean, then its deviation.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch

from .error_stats import (CLIP, MIN_ELEMENTS, DetSum, ErrorStats, StatsVerdict, decide, det_norm,
                          element_ulp, judge_statistics, tail_limit)
from .ulp import float_format, ulp_spacing

__all__ = ["PeerMeasures", "measure_whole", "measure_in_blocks", "peer_dtype", "floor_allowance",
           "ACCUM_FACTOR", "SIGNIFICANCE"]

#: c of the accumulation term of the floor (Higham's gamma_K for K * u_acc <= 1/2, as the budgets).
ACCUM_FACTOR = 2.0
#: Elements smaller than this fraction of the tensor's RMS are judged by absolute error at that
#: size in the max rule (msprobe's small-value rule, torch.testing's atol, scaled to the tensor).
SIGNIFICANCE = 2.0 ** -6


def peer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the float32 peer computes in: float32, or ``dtype`` when that is wider."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def floor_allowance(g_abs: torch.Tensor, spacing: torch.Tensor, dtype: torch.dtype,
                    m_abs: Optional[torch.Tensor], k: Optional[int]) -> torch.Tensor:
    """Each element's term of :func:`~precisiondiff.comparators.peers.significance_floor` (its L2 norm is the floor)."""
    allow = torch.maximum(float_format(dtype).unit_roundoff * g_abs, 0.5 * spacing)
    if m_abs is not None and k:
        u_acc = float_format(peer_dtype(dtype)).unit_roundoff
        allow = allow + ACCUM_FACTOR * k * u_acc * m_abs
    return torch.where(torch.isfinite(allow), allow, torch.zeros_like(allow))


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _with_magnitude(scale: torch.Tensor, dtype: torch.dtype, magnitude: Optional[torch.Tensor], k: Optional[int],
                    partials: bool, m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale`` (the element's ULP) plus :func:`~precisiondiff.comparators.peers.element_scale`'s accumulation allowance; ``m`` the
    magnitude as :func:`_finite_magnitude` gives it, when already computed."""
    if magnitude is not None and k:
        u_acc = float_format(peer_dtype(dtype)).unit_roundoff
        if m is None:
            m = _finite_magnitude(magnitude, scale.device)
        scale = scale + (ACCUM_FACTOR * k * u_acc + (float_format(dtype).unit_roundoff if partials else 0.0)) * m
    return scale


def _finite_magnitude(magnitude: torch.Tensor, device: torch.device) -> torch.Tensor:
    m = magnitude.detach().to(device=device, dtype=torch.float64).abs().flatten()
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


class PeerMeasures(NamedTuple):
    """What the peer rule measures of one output, whole or a block at a time (the same values)."""

    n_special: int
    gnorm: float
    e_dut: float
    m_dut: float
    e_peers: Dict[str, float]
    m_peers: Dict[str, float]
    floor: float
    stats: StatsVerdict


def measure_whole(dut: torch.Tensor, g: torch.Tensor, peers: Mapping[str, Optional[torch.Tensor]],
                  mag: Optional[torch.Tensor], k: Optional[int], dtype: torch.dtype,
                  partial_sums: bool) -> PeerMeasures:
    """The peer rule's measurements of ``dut`` against the flat float64 golden ``g`` in one pass."""
    d = dut.detach().to(device=g.device, dtype=torch.float64).flatten()
    ps = {n: p.detach().to(device=g.device, dtype=torch.float64).flatten()
          for n, p in peers.items() if p is not None and p.numel() == d.numel()}
    rounded = g.to(dut.dtype).to(torch.float64)
    # Each mask and per-element unit is computed once and shared by the size rules and the
    # statistics (the same values as computing them where used: elementwise, exact); when every
    # element is finite the masks select everything and are skipped.
    finite_d, finite_g = torch.isfinite(d), torch.isfinite(g)
    finite = finite_d & finite_g
    all_finite = bool(finite.all())
    finite_p = {n: torch.isfinite(p) for n, p in ps.items()}
    if all_finite:
        n_special = 0
    else:
        special = ~finite & ~_same(d, rounded)
        for p in ps.values():
            special &= ~_same(d, p)
        n_special = int(special.sum())
    zero = torch.zeros_like(g)
    gf = g if all_finite else torch.where(finite, g, zero)
    gnorm = det_norm(gf)
    m_fin = _finite_magnitude(mag, g.device) if mag is not None and k else None
    g_abs = gf.abs()
    unit = element_ulp(g_abs, dtype, SIGNIFICANCE)  # element_scale's ULP term (gf is finite)
    scale = _with_magnitude(unit, dtype, mag, k, True, m_fin)
    diff = d - g
    adiff = diff.abs()
    e_dut = det_norm(diff if all_finite else torch.where(finite, diff, zero))
    m_dut = (float((adiff / scale).max() if all_finite else torch.where(finite, adiff / scale, zero).max())
             if d.numel() else 0.0)
    e_peers, m_peers = {}, {}
    for n, p in ps.items():
        ok = finite & finite_p[n]
        pd = p - g
        e_peers[n] = det_norm(torch.where(ok, pd, zero))
        m_peers[n] = float(torch.where(ok, pd.abs() / scale, zero).max()) if d.numel() else 0.0
    floor = det_norm(floor_allowance(g_abs, ulp_spacing(gf, dtype), dtype,
                                     mag.to(device=g.device, dtype=torch.float64).abs() if m_fin is not None else None,
                                     k))
    tail_scale = scale if partial_sums else _with_magnitude(unit, dtype, mag, k, False, m_fin)
    # judge_statistics' element ULP is that of the golden over the elements it uses: ``unit`` when
    # it uses every element (all finite, none flushed; it checks)
    stats = judge_statistics(d, g, rounded, ps, dtype, significance=SIGNIFICANCE, scale=tail_scale,
                             ulp_floor=not partial_sums,
                             _shared=dict(finite=finite, finite_p=finite_p, unit=unit, diff=diff, adiff=adiff))
    return PeerMeasures(n_special, gnorm, e_dut, m_dut, e_peers, m_peers, floor, stats)


F64 = torch.float64


class _ErrorSums:
    """The three sums of :func:`~precisiondiff.comparators.error_stats.error_stats`, fed a block at a time."""

    def __init__(self) -> None:
        self.zi, self.zi_sign, self.zz = DetSum(), DetSum(), DetSum()

    def add(self, z: torch.Tensor, zi: torch.Tensor, sign_i: torch.Tensor) -> None:
        self.zi.add(zi)
        self.zi_sign.add(zi * sign_i)
        self.zz.add(z * z)

    def stats(self) -> ErrorStats:
        return ErrorStats(self.zi.mean(), self.zi_sign.mean(), math.sqrt(self.zz.mean()))


def _max(values: List[float]) -> float:
    """The largest of per-block maxima as ``torch.max`` of the whole gives it (NaN propagates)."""
    return float(torch.tensor(values, dtype=F64).max())


def measure_in_blocks(dut: torch.Tensor, g: torch.Tensor, peers: Mapping[str, torch.Tensor],
                      mag: Optional[torch.Tensor], k: Optional[int], dtype: torch.dtype, partial_sums: bool,
                      block: int) -> PeerMeasures:
    """The peer rule's measurements (``judge_against_peers``' one-pass ones, the same values) of the
    flat ``dut`` (its own dtype) against the flat float64 golden ``g``, ``block`` elements at a time.

    Args:
        dut, g: the kernel's output and the golden, flat, the same number of elements.
        peers: the peers that ran, flat, in the DUT's dtype.
        mag, k: the op's magnitude (flat) and accumulation length, or None.
        dtype: the dtype the op computes in.
        partial_sums: as ``judge_against_peers``' (the tail's unit).
        block: elements per block.
    """
    n_all = g.numel()
    spans = [(lo, min(lo + block, n_all)) for lo in range(0, n_all, block)]
    tiny = float_format(dtype).smallest_normal
    with_mag = mag is not None and bool(k)

    def load(lo: int, hi: int):
        gc = g[lo:hi]
        dc = dut[lo:hi].to(device=g.device, dtype=F64)
        rc = gc.to(dut.dtype).to(F64)
        pcs = {n: p[lo:hi].to(device=g.device, dtype=F64) for n, p in peers.items()}
        fin = torch.isfinite(dc) & torch.isfinite(gc)
        fps = {n: torch.isfinite(p) for n, p in pcs.items()}
        flushed = fin & (dc == 0) & (rc != 0) & (rc.abs() < tiny)
        use = fin & ~flushed
        for n in pcs:
            use &= fps[n]
        return gc, dc, rc, pcs, fin, fps, flushed, use

    # pass 1: masks, NaN/Inf, sum g^2 over the finite golden and over the elements the statistics use
    all_finite, n_special, n_flushed, n_use = True, 0, 0, 0
    sq_g, sq_use = DetSum(), DetSum()
    for lo, hi in spans:
        gc, dc, rc, pcs, fin, fps, flushed, use = load(lo, hi)
        gf = gc
        if not bool(fin.all()):
            all_finite = False
            special = ~fin & ~_same(dc, rc)
            for p in pcs.values():
                special &= ~_same(dc, p)
            n_special += int(special.sum())
            gf = torch.where(fin, gc, 0.0)
        sq = gf * gf
        sq_g.add(sq)
        n_flushed += int(flushed.sum())
        nu = int(use.sum())
        n_use += nu
        sq_use.add(sq if nu == use.numel() else sq[use])
    gnorm = math.sqrt(sq_g.value())
    rms_all = math.sqrt(sq_g.mean()) if n_all else 0.0
    rms_use = math.sqrt(sq_use.mean()) if n_use else 0.0
    every = n_use == n_all
    stats_on = n_use >= MIN_ELEMENTS
    screen = not peers

    def elements(lo: int, hi: int) -> Dict[str, torch.Tensor]:
        """Every per-element quantity of one block (the one-pass code's, elementwise)."""
        gc, dc, rc, pcs, fin, fps, flushed, use = load(lo, hi)
        gf = gc if all_finite else torch.where(fin, gc, 0.0)
        g_abs = gf.abs()
        unit = ulp_spacing(torch.clamp(g_abs, min=SIGNIFICANCE * rms_all), dtype).to(F64)
        m_fin = _finite_magnitude(mag[lo:hi], g.device) if with_mag else None
        scale = _with_magnitude(unit, dtype, mag, k, True, m_fin)
        diff = dc - gc
        e = dict(gc=gc, dc=dc, rc=rc, pcs=pcs, fin=fin, fps=fps, use=use, gf=gf, g_abs=g_abs, unit=unit,
                 m_fin=m_fin, scale=scale, diff=diff, adiff=diff.abs())
        if stats_on:
            pick: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t) if every else (lambda t: t[use])
            gu = pick(gc)
            unit_u = unit if every else ulp_spacing(torch.clamp(gu.abs(), min=SIGNIFICANCE * rms_use),
                                                     dtype).to(F64)
            informative = pick(rc) != gu
            ipick = (lambda t: t) if bool(informative.all()) else (lambda t: t[informative])
            z_d = (diff if every else pick(dc) - gu) / unit_u
            z_ps = {n: (pick(p) - gu) / unit_u for n, p in pcs.items()} or {"rounded": (pick(rc) - gu) / unit_u}
            t_scale = scale if partial_sums else _with_magnitude(unit, dtype, mag, k, False, m_fin)
            e.update(pick=pick, gu=gu, unit_u=unit_u, n_inf=int(informative.sum()), ipick=ipick,
                     sign_i=ipick(torch.sign(gu)), z_d=z_d, zi_d=ipick(z_d).clamp(-CLIP, CLIP), z_ps=z_ps,
                     t_unit=pick(t_scale))
        return e

    # pass 2: the size rules, the floor, the statistics' means, the peers' worst
    e_dut, floor_sq = DetSum(), DetSum()
    m_dut: List[float] = []
    e_p: Dict[str, DetSum] = {n: DetSum() for n in peers}
    m_p: Dict[str, List[float]] = {n: [] for n in peers}
    sums_d = _ErrorSums()
    sums_p: Dict[str, _ErrorSums] = {}
    worst_p: Dict[str, List[float]] = {n: [] for n in peers}
    n_inf = 0
    for lo, hi in spans:
        e = elements(lo, hi)
        fin, scale, diff = e["fin"], e["scale"], e["diff"]
        x = diff if all_finite else torch.where(fin, diff, 0.0)
        e_dut.add(x * x)
        m_dut.append(float((e["adiff"] / scale).max() if all_finite
                           else torch.where(fin, e["adiff"] / scale, 0.0).max()))
        for n, p in e["pcs"].items():
            ok = fin & e["fps"][n]
            pd = p - e["gc"]
            x = torch.where(ok, pd, 0.0)
            e_p[n].add(x * x)
            m_p[n].append(float(torch.where(ok, pd.abs() / scale, 0.0).max()))
        m_abs = mag[lo:hi].to(device=g.device, dtype=F64).abs() if with_mag else None
        allow = floor_allowance(e["g_abs"], ulp_spacing(e["gf"], dtype), dtype, m_abs, k)
        floor_sq.add(allow * allow)
        if stats_on and e["gu"].numel():
            sums_d.add(e["z_d"], e["zi_d"], e["sign_i"])
            for n, z in e["z_ps"].items():
                sums_p.setdefault(n, _ErrorSums()).add(z, e["ipick"](z).clamp(-CLIP, CLIP), e["sign_i"])
            n_inf += e["n_inf"]
            for n, p in e["pcs"].items():
                worst_p[n].append(float(((e["pick"](p) - e["gu"]).abs() / e["t_unit"]).max()))
        del e  # before the next block's are made
    measures = dict(n_special=n_special, gnorm=gnorm, e_dut=math.sqrt(e_dut.value()),
                    m_dut=_max(m_dut) if n_all else 0.0,
                    e_peers={n: math.sqrt(s.value()) for n, s in e_p.items()},
                    m_peers={n: _max(v) if n_all else 0.0 for n, v in m_p.items()},
                    floor=math.sqrt(floor_sq.value()))
    notes = [f"{n_flushed} subnormal outputs flushed to zero"] if n_flushed else []
    figures = {"n": n_use, "flushed": n_flushed}
    if not stats_on:
        return PeerMeasures(**measures, stats=StatsVerdict(True, figures, [], notes))
    s_d = sums_d.stats()
    s_ps = {n: s.stats() for n, s in sums_p.items()}
    lenient = max(s_ps, key=lambda name: s_ps[name].rmse)
    worst = max(_max(v) for v in worst_p.values()) if peers else 0.0

    # pass 3: the informative errors' deviation about their mean, the tail beyond the peers' worst
    dev, tail = DetSum(), 0
    for lo, hi in spans:
        e = elements(lo, hi)
        if not e["gu"].numel():
            continue
        dev.add((e["zi_d"] - s_d.bias) ** 2)
        err = e["adiff"] if every else e["pick"](e["dc"]) - e["gu"]
        floor_unit = e["unit_u"] if not partial_sums else e["t_unit"]
        tail += int((err.abs() > tail_limit(worst, e["t_unit"], floor_unit)).sum())
        del e, err, floor_unit
    sd = math.sqrt(dev.value() / (n_inf - 1)) if n_inf > 1 else 0.0

    def paired_excess() -> Tuple[float, float]:
        # pass 4 (twice): the paired squared-error excess over the most lenient peer
        def excess(e: Dict[str, torch.Tensor]) -> torch.Tensor:
            return e["z_d"].clamp(-CLIP, CLIP) ** 2 - e["z_ps"][lenient].clamp(-CLIP, CLIP) ** 2
        total = DetSum()
        for lo, hi in spans:
            total.add(excess(elements(lo, hi)))
        mean = total.mean()
        spread = DetSum()
        for lo, hi in spans:
            spread.add((excess(elements(lo, hi)) - mean) ** 2)
        return mean, (math.sqrt(spread.value() / (total.count - 1)) if total.count > 1 else math.nan)

    def distinct() -> int:
        used = [elements(lo, hi)["gu"] for lo, hi in spans]
        return int(torch.unique(torch.cat(used)).numel())

    failures = decide(figures, n=n_use, n_inf=n_inf, s_d=s_d, s_ps=s_ps, lenient=lenient, sd_informative=sd,
                      paired_excess=paired_excess, tail=tail, worst=worst, distinct=distinct, screen=screen)
    return PeerMeasures(**measures, stats=StatsVerdict(not failures, figures, failures, notes))
