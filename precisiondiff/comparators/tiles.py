"""The PyTorch compare tile: per-element error rows, the fixed pairwise block tree, counts,
maxima and the exact ULP-distance histogram (the fallback and the oracle of
:mod:`precisiondiff.comparators.tiles_kernel`).

A tile is at most 65536 elements of the flat tensors, converted to float64 into preallocated
rows ``|d|, |e|, d^2, e^2, a^2, a e, rel, ulp, ulp_err``; each fixed 4096-element block of a
row is summed by the tree ``x[2i] + x[2i+1]`` level by level, so sums do not depend on the
tiling.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .ulp import FloatFormat, _ordered_key, round_to_dtype, ulp_distance

__all__ = ["REL_ERR_RATIO_LEVELS", "P99Histogram", "finite_tile", "general_tile", "tree_sums",
           "tile_distances", "ROWS", "TILE", "BLOCK"]

BLOCK = 4096
_BLOCK = BLOCK

#: msprobe "one thousandth" and "five thousandths" levels (we store the failing fraction).
REL_ERR_RATIO_LEVELS = (1e-3, 5e-3)

# p99 of multi-chunk tensors: exact counts of distances below 2**16 (a bincount as long as
# the largest one), 4096 coarse bins per binade above, then an exact second pass in one bin.
_EXACT_BINS = 1 << 16
_SUB = 4096
_N_BIG = 49 * _SUB
TILE = 1 << 16  # elements per tile: the ~15 float64 rows of a tile stay in L2/L3
ROWS = 9  # |d|, |e|, d^2, e^2, a^2, a e, rel, ulp, ulp_err


def tree_sums(w: torch.Tensor, tmp: torch.Tensor, length: int) -> torch.Tensor:
    """Block sums of ``w[:, :length]`` (zero-padded to ``length``, a multiple of the block or
    a power of two below it) by the fixed pairwise tree ``x[2i] + x[2i+1]``, level by level,
    ping-ponging between ``w`` and ``tmp`` (each level writes where nothing it reads lives)."""
    k = w.shape[0]
    blk = min(length, _BLOCK)
    x = w[:, :length].view(k, length // blk, blk)
    bufs = (tmp, w)
    lvl = 0
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        out = bufs[lvl % 2][:, : x.shape[1] * h].view(k, x.shape[1], h)
        torch.add(x[..., 0::2], x[..., 1::2], out=out)
        x = out
        lvl += 1
    return x[..., 0].clone()


def _ulp_bins(d: torch.Tensor) -> torch.Tensor:
    """Coarse histogram bin of integer ULP distances >= 2**16 (float64): 4096 per binade."""
    m, e = torch.frexp(d)
    frac = ((m * 2 - 1) * _SUB).floor().to(torch.int64)
    return ((e.to(torch.int64) - 17) * _SUB + frac).clamp(max=_N_BIG - 1)


def _bin_edges(i: int):
    e, f = divmod(i, _SUB)
    return math.ldexp(1.0 + f / _SUB, 16 + e), math.ldexp(1.0 + (f + 1) / _SUB, 16 + e)


_SIGNED_VIEW = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
_EXP_MASK = 0x7FF0000000000000  # float64 exponent field: |x| -> 2**floor(log2 |x|) (normal x)


def _isfinite(x: torch.Tensor) -> torch.Tensor:
    if x.element_size() == 1:  # float8: compare in float32
        x = x.to(torch.float32)
    return torch.isfinite(x)


def _distance(ac: torch.Tensor, r: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """ULP distance of ``ac`` to ``r`` (same dtype): int keys for <= 32 bits (NaN not
    handled), float64 with ulp_distance's NaN rules for float64."""
    if fmt.bits == 64:
        return ulp_distance(ac, r)
    k = _ordered_key(ac, fmt)
    return k.sub_(_ordered_key(r, fmt)).abs_()


def _spacing_into(e: torch.Tensor, out: torch.Tensor, scale: float, floor: float) -> torch.Tensor:
    """``ulp_spacing(e)`` from the exponent bits: ``max(2**floor(log2|e|) 2**-m, 2**(emin-m))``;
    exact (powers of two), inf for inf/NaN ``e`` (so ``0 / spacing`` stays 0 there)."""
    torch.bitwise_and(e.view(torch.int64), _EXP_MASK, out=out.view(torch.int64))
    return out.mul_(scale).clamp_(min=floor)


def finite_tile(w, ac, a, e, r, c, fmt, tiny, sp_scale, sp_floor, th3, has_tol, tol_a, tol_r,
                 counts, maxes, hist, scratch) -> bool:
    """One tile where ``actual`` and ``r`` (hence ``expected``) are all finite: no masks.

    Returns False, having accumulated nothing, when that does not hold: ``max |a - e|`` is
    then NaN or inf (a or e not finite), or ``max |e|`` exceeds ``max_finite`` (``r`` may
    have overflowed; conservative)."""
    ad, ae, d, e2, a2, axe, rel, ulp, ulperr = (w[j, :c] for j in range(ROWS))
    torch.sub(a, e, out=d)
    torch.abs(d, out=ad)
    torch.abs(e, out=ae)
    ad_max = ad.max()
    if not bool(torch.isfinite(ad_max) & (ae.max() <= fmt.max_finite)):
        return False
    n_diff, n_below = torch.count_nonzero(d), (d < 0).sum()
    torch.mul(d, d, out=d)
    torch.mul(e, e, out=e2)
    torch.mul(a, a, out=a2)
    torch.mul(a, e, out=axe)
    torch.div(ad, torch.clamp(ae, min=tiny, out=rel), out=rel)
    dist = _distance(ac, r, fmt)
    ulp.copy_(dist)
    hist.add(dist)
    torch.div(ad, _spacing_into(e, scratch, sp_scale, sp_floor), out=ulperr)
    d3max = torch.where(ae < th3, ad, rel, out=scratch).max()
    torch.maximum(maxes, torch.stack([ad_max, rel.max(), ulp.max(), ulperr.max(), d3max]),
                  out=maxes)
    lvl1, lvl5 = REL_ERR_RATIO_LEVELS
    zero = torch.zeros((), dtype=torch.int64, device=d.device)
    if has_tol:
        outside = (ad > torch.mul(ae, tol_r, out=scratch).add_(tol_a)).sum()
    else:
        outside = zero
    counts += torch.stack([zero, zero, zero, zero, outside, (rel > lvl1).sum(),
                           (rel > lvl5).sum(), n_diff, n_below])
    return True


def general_tile(w, ac, a, e, r, c, fmt, tiny, sp_scale, sp_floor, th3, has_tol, tol_a, tol_r,
                  counts, maxes, hist) -> None:
    """One tile with NaN or infinities: the masked formulas."""
    ad, ae, d, e2, a2, axe, rel, ulp, ulperr = (w[j, :c] for j in range(ROWS))
    r64 = r.to(torch.float64)
    a_nan, r_nan = a.isnan(), r64.isnan()
    nan_mm = a_nan ^ r_nan
    inf_mm = ~a_nan & ~r_nan & (a.isinf() | r64.isinf()) & (a != r64)
    special = nan_mm | inf_mm
    fin = torch.isfinite(a) & torch.isfinite(e)
    nfin = ~fin
    torch.sub(a, e, out=d).masked_fill_(nfin, 0.0)
    n_diff, n_below = torch.count_nonzero(d), (d < 0).sum()
    torch.abs(d, out=ad)
    torch.abs(e, out=ae).masked_fill_(nfin, 0.0)
    torch.mul(d, d, out=d)
    a_f = a.masked_fill(nfin, 0.0)
    e_f = e.masked_fill(nfin, 0.0)
    torch.mul(e_f, e_f, out=e2)
    torch.mul(a_f, a_f, out=a2)
    torch.mul(a_f, e_f, out=axe)
    torch.div(ad, torch.clamp(ae, min=tiny, out=rel), out=rel)
    dist = _distance(ac, r, fmt)
    if fmt.bits == 64:
        ulp_ok = ~dist.isnan()
    else:
        ulp_ok = ~nan_mm
    ulp.copy_(dist).masked_fill_(a_nan | r_nan, 0.0)  # both NaN: 0; one NaN: undefined
    hist.add(ulp[ulp_ok])
    torch.div(ad, _spacing_into(e, e_f, sp_scale, sp_floor), out=ulperr)
    d3max = torch.where(ae < th3, ad, rel).max()
    torch.maximum(maxes, torch.stack([ad.max(), rel.max(), ulp.max(), ulperr.max(), d3max]),
                  out=maxes)
    lvl1, lvl5 = REL_ERR_RATIO_LEVELS
    if has_tol:
        outside = ((fin & (ad > tol_a + tol_r * ae)) | special).sum()
    else:
        outside = torch.zeros((), dtype=torch.int64, device=d.device)
    counts += torch.stack([
        fin.sum(), ulp_ok.sum(), nan_mm.sum(), inf_mm.sum(), outside,
        ((fin & (rel > lvl1)) | special).sum(), ((fin & (rel > lvl5)) | special).sum(),
        n_diff, n_below])


class P99Histogram:
    """Exact nearest-rank quantile of non-negative integer ULP distances, streamed.

    Distances below 2**16 are counted exactly (a bincount as long as the largest). Larger
    ones (float32/float64 only) are kept as values while they number at most ``cap`` and
    otherwise counted in 4096 coarse bins per binade; if the quantile lands there, a second
    pass over the data collects the values of that one bin and selects exactly among them.
    """

    def __init__(self, device: torch.device, cap: int) -> None:
        self.device, self.cap = device, cap
        self.small: Optional[torch.Tensor] = None
        self.zeros = 0
        self.big_bins: Optional[torch.Tensor] = None
        self.big_vals: Optional[list] = []
        self.n_kept = 0

    def add_zeros(self, count: int) -> None:
        self.zeros += count

    def _add_small(self, ints: torch.Tensor) -> None:
        if ints.numel() == 0:
            return
        self.add_counts(torch.bincount(ints))

    def add_counts(self, b: torch.Tensor) -> None:
        """Add ``b[d]`` distances equal to ``d`` for every ``d < len(b) <= 2**16`` (an int64
        count vector, e.g. a bincount computed elsewhere)."""
        if self.small is None:
            self.small = b
        elif b.numel() <= self.small.numel():
            _serial(self.small)[: b.numel()] += _serial(b)
        else:
            _serial(b)[: self.small.numel()] += _serial(self.small)
            self.small = b

    def add(self, dist: torch.Tensor) -> None:
        if dist.numel() == 0:
            return
        if dist.dtype == torch.int32:  # <= 16-bit formats: always below 2**16
            self._add_small(dist)
            return
        small = dist < _EXACT_BINS
        if bool(small.all()):
            self._add_small(dist.to(torch.int64))
            return
        self._add_small(dist[small].to(torch.int64))
        big = dist[~small].to(torch.float64)
        if self.big_vals is not None:
            self.n_kept += big.numel()
            if self.n_kept <= self.cap:
                self.big_vals.append(big)  # binned only if they outgrow the cap
                return
            pending, self.big_vals = self.big_vals + [big], None
        else:
            pending = [big]
        if self.big_bins is None:
            self.big_bins = torch.zeros(_N_BIG, dtype=torch.int64, device=self.device)
        for b in pending:
            self.big_bins += torch.bincount(_ulp_bins(b), minlength=_N_BIG)

    def quantile(self, k: int, second_pass) -> float:
        """The k-th smallest distance (1-based); ``second_pass()`` yields every tile's
        defined distances again, called only when needed."""
        n_small = self.zeros
        if self.small is not None and self.small.device.type == "cpu":
            cum = np.cumsum(self.small.numpy())  # exact: int64 counts
            n_small = int(cum[-1]) + self.zeros
            if k <= n_small:
                return float(np.searchsorted(cum, k - self.zeros))  # the first cum >= k
        elif self.small is not None:
            cum = torch.cumsum(self.small, 0)
            cum[:] += self.zeros
            n_small = int(cum[-1])
            if k <= n_small:
                return float(torch.searchsorted(cum, k).item())
        elif k <= self.zeros:
            return 0.0
        k -= n_small
        if self.big_vals is not None:
            return float(torch.kthvalue(torch.cat(self.big_vals), k).values)
        cumb = torch.cumsum(self.big_bins, 0)
        j = int(torch.searchsorted(cumb, k).item())
        below = int(cumb[j - 1]) if j else 0
        lo, hi = _bin_edges(j)
        vals = torch.cat([d[(d >= lo) & (d < hi)] for d in second_pass()])
        return float(torch.kthvalue(vals, k - below).values)


def _serial(t: torch.Tensor):
    """A CPU tensor as a NumPy view (others as they are): NumPy's few-microsecond operations
    on the 65536 histogram bins instead of PyTorch's, which split anything above 32768
    elements over its threads: a fork and join of its OpenMP pool that cost 2-7 ms of wall
    and CPU time per call when the other core was busy (a 2-vCPU machine at load 7)."""
    return t.numpy() if t.device.type == "cpu" else t


def tile_distances(a_flat, e_flat, dtype, device, tile):
    for i in range(0, a_flat.numel(), tile):
        d = ulp_distance(a_flat[i : i + tile].to(device),
                         round_to_dtype(e_flat[i : i + tile].to(device), dtype))
        yield d[~d.isnan()]
