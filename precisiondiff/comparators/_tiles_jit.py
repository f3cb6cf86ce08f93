"""The numba kernels of :mod:`precisiondiff.comparators.tiles_kernel` (imported on first use:
importing numba costs about half a second)."""
from __future__ import annotations

import numba
import numpy as np

BF16, F32 = 0, 1
_BLOCK = 4096
_EXP_MASK = 0x7FF0000000000000

# exact IEEE semantics: no fastmath (it would reassociate the tree and contract a*b+c)
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _tree(x, tmp, length):  # pragma: no cover - compiled
    """Pairwise sum of x[:length] (a power of two): x[2i] + x[2i+1], level by level
    (ping-pong between ``x`` and ``tmp`` so that each level vectorizes)."""
    src = x
    dst = tmp
    h = length // 2
    while h >= 1:
        for i in range(h):
            dst[i] = src[2 * i] + src[2 * i + 1]
        src, dst = dst, src
        h //= 2
    return src[0]


@_jit
def _keys(kind, a16, lut, a32i, e, g0, m, rf, ri, av, akey, rkey):  # pragma: no cover - compiled
    """Actual as float64 and both ordered ULP keys (``-magnitude`` for a set sign bit)."""
    for k in range(m):
        rf[k] = np.float32(e[g0 + k])  # round to nearest even (float32 target)
    if kind == BF16:
        for k in range(m):
            ab = np.int64(a16[g0 + k])
            av[k] = np.float64(lut[ab & 0xFFFF])
            sgn = ab >> 63
            akey[k] = ((ab & 0x7FFF) ^ sgn) - sgn
            x = e[g0 + k]
            u = np.int64(ri[k]) & 0xFFFFFFFF
            r32 = np.float64(rf[k])
            inexact = np.int64(r32 != x)
            away = np.int64(abs(r32) > abs(x))
            u = (u - (inexact & away)) | inexact  # float32 rounded to odd
            rb = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # then to bfloat16, nearest even
            rs = -((rb >> 15) & 1)
            rkey[k] = ((rb & 0x7FFF) ^ rs) - rs
    else:
        for k in range(m):
            ab = np.int64(a32i[g0 + k])
            sgn = ab >> 63
            akey[k] = ((ab & 0x7FFFFFFF) ^ sgn) - sgn
            rb = np.int64(ri[k])
            rs = rb >> 63
            rkey[k] = ((rb & 0x7FFFFFFF) ^ rs) - rs


@_jit
def _tile(kind, a16, lut, a32, a32i, e, i, c, lc, blk, first_block, tiny, sp_scale, sp_floor,
          th3, has_tol, tol_a, tol_r, max_finite, lvl1, lvl5, rows, tmp, rf, sp, av, akey,
          rkey, ulps, bigs, nbig0, block_sums, counts, maxes, hist):  # pragma: no cover - compiled
    """One tile ``[i, i + c)``, zero-padded to ``lc``. Returns the new count of values in
    ``bigs`` (ULP distances >= 2**16), or -1 when the tile needs the general path: then
    nothing is committed but block sums, which the caller recomputes."""
    e_bits = e.view(np.int64)
    spi = sp.view(np.int64)
    ri = rf.view(np.int32)
    rows_i = rows.view(np.int64)
    mx = np.zeros(5, dtype=np.int64)  # bit patterns of non-negative float64: same order
    n_out = n_r1 = n_r5 = n_diff = n_below = n_big = 0
    bad = 0
    for b in range(lc // blk):
        s = b * blk
        g0 = i + s
        m = min(blk, c - s)
        _keys(kind, a16, lut, a32i, e, g0, m, rf, ri, av, akey, rkey)
        if kind == F32:
            for k in range(m):
                av[k] = np.float64(a32[g0 + k])
        for k in range(m):
            spi[k] = e_bits[g0 + k] & _EXP_MASK
        for k in range(m):
            a = av[k]
            x = e[g0 + k]
            d = a - x
            ad = abs(d)
            ax = abs(x)
            dist = abs(akey[k] - rkey[k])
            rel = ad / max(ax, tiny)
            ue = ad / max(sp[k] * sp_scale, sp_floor)
            rows[0, k] = ad
            rows[1, k] = ax
            rows[2, k] = d * d
            rows[3, k] = x * x
            rows[4, k] = a * a
            rows[5, k] = a * x
            rows[6, k] = rel
            rows[7, k] = np.float64(dist)
            rows[8, k] = ad if ax < th3 else rel  # diff3's value, for its maximum
            sp[k] = ue
            ulps[s + k] = dist
            bad += np.int64(not (ax <= max_finite)) + np.int64(not (abs(a) <= 1.7976931348623157e308))
            n_big += np.int64(dist >= 65536)
            n_diff += np.int64(d != 0.0)
            n_below += np.int64(d < 0.0)
            n_out += np.int64(has_tol and ad > ax * tol_r + tol_a)
            n_r1 += np.int64(rel > lvl1)
            n_r5 += np.int64(rel > lvl5)
        if bad:
            return -1
        for k in range(m):
            mx[0] = max(mx[0], rows_i[0, k])
            mx[1] = max(mx[1], rows_i[6, k])
            mx[2] = max(mx[2], rows_i[7, k])
            mx[3] = max(mx[3], spi[k])
            mx[4] = max(mx[4], rows_i[8, k])
        for k in range(m):
            rows[8, k] = sp[k]  # the ulp_err row
        for j in range(9):
            for k in range(m, blk):
                rows[j, k] = 0.0
            block_sums[j, first_block + b] = _tree(rows[j], tmp, blk)
    nbig = nbig0
    if n_big:
        if nbig + n_big > bigs.shape[0]:
            return -1
        for k in range(c):
            if ulps[k] >= 65536:
                bigs[nbig] = ulps[k]
                nbig += 1
    for k in range(c):
        if ulps[k] < 65536:
            hist[ulps[k]] += 1
    wide = mx.view(np.float64)
    for j in range(5):
        maxes[j] = max(maxes[j], wide[j])
    counts[0] += c
    counts[1] += c
    counts[4] += n_out
    counts[5] += n_r1
    counts[6] += n_r5
    counts[7] += n_diff
    counts[8] += n_below
    return nbig


@_jit
def _tiles(kind, a16, lut, a32, e, n, tile, t0, t1, length, tiny, sp_scale, sp_floor, th3,
           has_tol, tol_a, tol_r, max_finite, lvl1, lvl5, block_sums, counts, maxes, hist,
           bigs, failed, out):  # pragma: no cover - compiled
    blk = min(length, _BLOCK)
    rows = np.empty((9, blk), dtype=np.float64)
    tmp = np.empty(blk, dtype=np.float64)
    rf = np.empty(blk, dtype=np.float32)
    sp = np.empty(blk, dtype=np.float64)
    av = np.empty(blk, dtype=np.float64)
    akey = np.empty(blk, dtype=np.int64)
    rkey = np.empty(blk, dtype=np.int64)
    ulps = np.empty(tile, dtype=np.int64)
    a32i = a32.view(np.int32)
    nf = 0
    nbig = 0
    for t in range(t0, t1):
        i = t * tile
        c = min(tile, n - i)
        lc = length if n < _BLOCK else -(-c // _BLOCK) * _BLOCK
        got = _tile(kind, a16, lut, a32, a32i, e, i, c, lc, blk, i // _BLOCK, tiny, sp_scale,
                    sp_floor, th3, has_tol, tol_a, tol_r, max_finite, lvl1, lvl5, rows, tmp,
                    rf, sp, av, akey, rkey, ulps, bigs, nbig, block_sums, counts, maxes, hist)
        if got < 0:
            failed[nf] = t
            nf += 1
        else:
            nbig = got
    out[0] = nf
    out[1] = nbig
