"""The numba kernels of :mod:`precisiondiff.comparators.tiles_kernel` (imported on first use:
importing numba costs about half a second).

Layout. A 4096-element block is staged, 256 elements (a chunk) at a time, into a permuted
order in which every level of its pairwise tree ``x[2i] + x[2i+1]`` is a vertical (SIMD)
addition of two contiguous halves, with no shuffles: element ``k = 1024 l + 64 c + t`` (lane
``l < 4``, chunk ``c < 16``, ``t < 64``) goes to position ``rev6(t) * 4 + l`` of chunk ``c``
(``rev6`` reverses 6 bits), so the tree's pairs ``t, t ^ 1`` are 128 apart, then 64, 32, 16,
8 and 4 for its next levels. Four lanes, AVX2's float64 width: the staging reads 4 streams
(with 8 lanes, 8 streams 4 KiB apart met in the same L1 sets: the staging took ~20% longer).
The staging (4 x 4 transposes) and the halving levels are written as LLVM vector code
(:func:`_stage_vec`, :func:`_halve_vec`: numba's loops did them with scalar instructions);
the element pass (loops that LLVM vectorises) takes the two elements of each first-level pair
and writes the rows' first level; the halving reduces each row to its four lane values; the
chunk and lane levels (6 of the 12) are scalar. The tree, hence every sum, is the one of the
PyTorch tile. The ULP-distance row is summed as integers: a float64 tree over 4096 integers
below 2**33 adds exactly, so it equals their integer sum. The vectorised loops ask for 512-bit
vectors (:func:`_wide`; AVX2 machines get 256-bit ones); the vector code is plain LLVM IR,
compiled for whatever the host has.

Every element value is computed with the same IEEE float64 operations as the PyTorch tile
(no fast-math, no contraction). Integer bit tricks replace only operations they reproduce
exactly: the rounding of ``expected`` to the format (round to nearest even on the bits, a
scaled ``rint``, as an addition of 2**52, below the smallest normal), the conversion of
bfloat16/float32 to float64, ``|d| / spacing`` as ``|d| * (1 / spacing)`` (spacing is a power
of two whose reciprocal is a normal float64: the same correctly rounded value), and
comparisons of non-negative float64 values as comparisons of their bit patterns (they order
alike; NaN patterns lie above every finite one), which is how counts and maxima are taken.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .._numba_wide import wide as _wide

BF16, F32 = 0, 1
_BLOCK = 4096
_CHUNK = 256
_EXP_MASK = 0x7FF0000000000000
_ABS = 0x7FFFFFFFFFFFFFFF
_REBIAS = 896 << 52  # float64 exponent bias - float32 (and bfloat16) exponent bias
_TWO52 = 2.0 ** 52
_TWO52_BITS = 0x4330000000000000
_HALF = _CHUNK // 2
_SMALL = 512  # ULP distances below this are counted in 8 interleaved histograms (no store chains)
# past the histogram's 2**16 bins (tiles_kernel.HIST_SIZE): a spare bin for distances >= 2**16,
# then the 8 interleaved copies of the small bins; both emptied by _tiles before it returns
_BIG_AT = 1 << 16
_EDGE = 64  # the small bins' edge where the scan branches on it (_histogram)
_SMALL_AT = _BIG_AT + 1

# exact IEEE semantics: no fastmath (it would reassociate the tree and contract a*b+c)
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")


_LANES = 4  # AVX2's float64 vector width: the staging writes a lane run with one vector store
# the staging asks for the same chunk two blocks ahead into L2 (prefetcht1): with the hardware
# prefetchers alone the staging waited for memory (~0.4 of ~2.6 ns an element, one thread)
_AHEAD = 2 * _BLOCK
# the intrinsic is overloaded on its pointer type from LLVM 15 (numba >= 0.61); before, one name
# (a failed compile would only send every tile to the PyTorch path: tiles_kernel._compiles)
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (15,) else "llvm.prefetch"
_REV6 = np.array([int(f"{t:06b}"[::-1], 2) for t in range(64)], dtype=np.int64)


@_inline
def _rows(ab, x, mb, tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5, tol):  # pragma: no cover
    """One element's row values: actual bits ``ab`` (sign-extended int), expected ``x``.
    Returns the rows, the bit patterns of the maxima's values and the element's counts
    (0 or 1: ``d != 0``, ``d < 0``, outside the tolerance (only with ``tol``, a constant),
    ``rel > lvl1``, ``rel > lvl5``)."""
    # actual -> float32 bits (bfloat16: the upper half) -> float64, exact
    a = np.float64(np.int32(ab << np.int32(23 - mb)).view(np.float32))
    eb = np.float64(x).view(np.int64)
    d = a - x
    ad = abs(d)
    ax = abs(x)
    rel = ad / max(ax, tiny)
    # 1 / spacing: bits 0x7FE0... - max((eb & _EXP_MASK) - (mb << 52), floor_bits), written so
    # that LLVM merges the two constants (one instruction fewer; the same integers)
    mb52 = mb << 52
    rsb = (0x7FE0000000000000 - max(eb & _EXP_MASK, floor_bits + mb52)) + mb52
    ue = ad * np.int64(rsb).view(np.float64)
    v3 = ad if ax < th3 else rel
    # counts and maxima on bit patterns where they are integers already (non-negative floats
    # order like their bits; ``min(adb, 1)`` is ``d != 0`` in one instruction fewer than a
    # comparison); a NaN ``d`` or ``rel`` only occurs in a tile that fails anyway
    adb = np.float64(ad).view(np.int64)
    relb = np.float64(rel).view(np.int64)
    out = np.int64(ad > ax * tol_r + tol_a) if tol else 0
    return (ad, ax, d * d, x * x, a * a, a * x, rel, ue, adb, relb,
            np.float64(ue).view(np.int64), np.float64(v3).view(np.int64),
            min(adb, 1), np.int64(d < 0.0), out, np.int64(relb > lvl1),
            np.int64(relb > lvl5))


@_inline
def _dist(ab, x, mb, sh, mask, r_sub, r_cap, f32):  # pragma: no cover
    """One element's ULP distance, and the bits of ``|expected|`` (the chunk's maximum of them
    tells whether it holds an expected value the fused path cannot take). ``f32`` (a constant): the
    format is float32."""
    sgn = ab >> 63
    mag = ab & mask
    akey = (mag ^ sgn) - sgn
    # expected rounded to the format, to nearest even, as an ordered key
    eb = np.float64(x).view(np.int64)
    esg = eb >> 63
    emag = eb & _ABS  # the bits of |x|
    if f32:
        # the IEEE conversion rounds to nearest even, subnormals included (one instruction
        # for the integer rounding below; bfloat16 has no such conversion from float64)
        rmag = np.int64(np.float32(x).view(np.int32)) & 0x7FFFFFFF
    else:
        mm = emag - _REBIAS
        rn = (mm + ((np.int64(1) << (sh - 1)) - 1) + ((mm >> sh) & 1)) >> sh
        # below the smallest normal: rint(|x| / spacing) through the float64 addition of
        # 2**52 (xs <= 2**23: the sum is in [2**52, 2**53), where it rounds to an integer, to
        # even)
        xs = min(np.int64(emag).view(np.float64), r_cap) * r_sub
        rs = np.float64(xs + _TWO52).view(np.int64) - _TWO52_BITS
        rmag = rs if emag < (np.int64(897) << 52) else rn
    rkey = (rmag ^ esg) - esg
    return abs(akey - rkey), emag


def _data(context, builder, ty, value):
    """The data pointer of a numba array value."""
    return context.make_array(ty)(context, builder, value).data


def _vec_at(builder, ptr, index, width):
    """``ptr + index`` as a pointer to a ``<width x T>`` vector."""
    vector = ir.VectorType(ptr.type.pointee, width)
    return builder.bitcast(builder.gep(ptr, [index]), vector.as_pointer())


def _flat(*arrays):
    """Whether every type is a C-contiguous 1-d array (the intrinsics index raw pointers)."""
    return all(isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" for t in arrays)


def _prefetch(builder, ptr, index):
    """A hint to fetch the cache line of ``ptr[index]`` into L2 (never faults, even past the
    end of the array)."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH)
    builder.call(fn, [builder.bitcast(builder.gep(ptr, [index]), i8p), ir.Constant(i32, 0),
                      ir.Constant(i32, 2), ir.Constant(i32, 1)])


def _mask(*lanes):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), list(lanes))


def _transpose4(builder, rows):
    """The 4 columns of four 4-lane rows."""
    r0, r1, r2, r3 = rows
    lo01 = builder.shuffle_vector(r0, r1, _mask(0, 4, 1, 5))
    hi01 = builder.shuffle_vector(r0, r1, _mask(2, 6, 3, 7))
    lo23 = builder.shuffle_vector(r2, r3, _mask(0, 4, 1, 5))
    hi23 = builder.shuffle_vector(r2, r3, _mask(2, 6, 3, 7))
    return (builder.shuffle_vector(lo01, lo23, _mask(0, 1, 4, 5)),
            builder.shuffle_vector(lo01, lo23, _mask(2, 3, 6, 7)),
            builder.shuffle_vector(hi01, hi23, _mask(0, 1, 4, 5)),
            builder.shuffle_vector(hi01, hi23, _mask(2, 3, 6, 7)))


@intrinsic
def _stage_vec(typingctx, a_src, e_src, s0, A, E):  # pragma: no cover - compiled
    """The chunk starting at ``s0`` of a full block (element ``t`` of lane ``l`` at
    ``s0 + 1024 l + t``) into its permuted order: ``A[4 rev6(t) + l]`` (the actual bits as
    int32, sign-extended) and ``E[4 rev6(t) + l]``. Four ``t`` at a time: four 4-element
    vector loads (one per lane), a 4 x 4 transpose in registers, four vector stores (numba's
    loops cannot express this: its SLP vectoriser is off, and the scalar copies cost ~1.1 ns an
    element against ~0.2). It also prefetches the same chunk ``_AHEAD`` elements on."""
    if not (_flat(a_src, e_src, A, E) and isinstance(a_src.dtype, types.Integer)
            and a_src.dtype.bitwidth in (16, 32) and A.dtype == types.int32
            and e_src.dtype == E.dtype == types.float64 and isinstance(s0, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        pa = _data(context, builder, sig.args[0], args[0])
        pe = _data(context, builder, sig.args[1], args[1])
        pA = _data(context, builder, sig.args[3], args[3])
        pE = _data(context, builder, sig.args[4], args[4])
        s = args[2]
        i64, i32 = ir.IntType(64), ir.IntType(32)
        v4i32 = ir.VectorType(i32, 4)
        asz = sig.args[0].dtype.bitwidth // 8
        for l in range(_LANES):  # this chunk's lines, _AHEAD elements on
            for off in range(0, 64, 8):
                _prefetch(builder, pe, builder.add(s, ir.Constant(i64, _AHEAD + 1024 * l + off)))
            for off in range(0, 64, 64 // asz):
                _prefetch(builder, pa, builder.add(s, ir.Constant(i64, _AHEAD + 1024 * l + off)))
        for t0 in range(0, 64, 4):
            er, ar = [], []
            for l in range(_LANES):
                k = builder.add(s, ir.Constant(i64, 1024 * l + t0))
                er.append(builder.load(_vec_at(builder, pe, k, 4), align=8))
                av = builder.load(_vec_at(builder, pa, k, 4), align=asz)
                ar.append(builder.sext(av, v4i32) if asz < 4 else av)
            columns = zip(range(t0, t0 + 4), _transpose4(builder, er), _transpose4(builder, ar))
            for t, ec, ac in columns:
                o = ir.Constant(i64, int(_REV6[t]) * _LANES)
                builder.store(ec, _vec_at(builder, pE, o, 4), align=8)
                builder.store(ac, _vec_at(builder, pA, o, 4), align=4)
        return context.get_dummy_value()
    return types.none(a_src, e_src, s0, A, E), codegen


@intrinsic
def _halve_vec(typingctx, R, C, col):  # pragma: no cover - compiled
    """Tree levels 2-6 of every float row of a chunk (level 1 is in :func:`_chunk`): pairs 64,
    32, 16, 8 and 4 apart in ``R[128 j:128 j + 128]``, the row's four lane values into
    ``C[j, col:col + 4]`` (``C`` is ``(9, 64)``). In vector registers, the same additions of
    the same operands as a loop per level over ``R``, without storing the levels between (the
    loops that did, LLVM left partly scalar: ~0.6 ns an element against ~0.2)."""
    if not (_flat(R) and R.dtype == types.float64 and isinstance(C, types.Array) and C.ndim == 2
            and C.layout == "C" and C.dtype == types.float64 and isinstance(col, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        pR = _data(context, builder, sig.args[0], args[0])
        pC = _data(context, builder, sig.args[1], args[1])
        i64 = ir.IntType(64)
        ncol = 16 * _LANES
        for j in range(9):
            if j == 7:  # the ULP row: summed as integers
                continue
            v = [builder.load(_vec_at(builder, pR, ir.Constant(i64, j * _HALF + 8 * k), 8), align=8)
                 for k in range(16)]
            while len(v) > 1:  # pairs 64, 32, 16 then 8 apart: the lower half plus the upper
                h = len(v) // 2
                v = [builder.fadd(v[k], v[k + h]) for k in range(h)]
            lanes = builder.fadd(builder.shuffle_vector(v[0], v[0], _mask(0, 1, 2, 3)),
                                 builder.shuffle_vector(v[0], v[0], _mask(4, 5, 6, 7)))
            o = builder.add(args[2], ir.Constant(i64, j * ncol))
            builder.store(lanes, _vec_at(builder, pC, o, 4), align=8)
        return context.get_dummy_value()
    return types.none(R, C, col), codegen


@_jit
def _stage_part(a_src, e_src, g0, m, c, rev, A, E):  # pragma: no cover - compiled
    """Chunk ``c`` of a partial block at ``g0`` (``m`` valid elements); zeros past ``m``."""
    for l in range(_LANES):
        k0 = 1024 * l + 64 * c
        valid = min(64, max(0, m - k0))
        for t in range(valid):
            A[rev[t] * _LANES + l] = np.int32(a_src[g0 + k0 + t])
            E[rev[t] * _LANES + l] = e_src[g0 + k0 + t]
        for t in range(valid, 64):
            A[rev[t] * _LANES + l] = 0
            E[rev[t] * _LANES + l] = 0.0


@_inline
def _chunk(A, E, R, DI, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5,
           max_finite, acc, tol, f32):  # pragma: no cover - compiled
    """The element pass of one staged chunk, as two loops (one would keep more values than
    AVX2's 16 vector registers hold: spills). The rows with the tree's first level: positions
    ``q`` and ``q + 128`` (the pair ``t, t ^ 1``) in one iteration, ``R[128 j + q]`` their sum
    in row ``j``; then the ULP distances, ``DI[p]`` at ``p``. Counts and maxima into ``acc``.
    ``tol`` and ``f32`` (constants: :func:`_chunk_kernel`): whether to count elements outside
    the tolerance, whether the format is float32."""
    # the format's mantissa bits, mask and shift as compile-time constants: shifts by
    # immediates, no vector registers (nor spills) holding them
    mb, mask = (23, 0x7FFFFFFF) if f32 else (7, 0x7FFF)
    sh = 52 - mb
    n_nz = n_neg = n_out = n_r1 = n_r5 = 0
    m0 = m1 = m3 = m4 = 0
    for q in range(_HALF):
        (ad, ax, d2, x2, a2, ax_, rel, ue, adb, relb, ueb, v3b, nz, neg, out, r1, r5) = _rows(
            A[q], E[q], mb, tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5, tol)
        (bd, bx, e2, y2, b2, bx_, rel2, ue2, bdb, relb2, ueb2, v3b2, nz2, neg2, out2, r12,
         r52) = _rows(A[_HALF + q], E[_HALF + q], mb, tiny, floor_bits, th3, tol_a, tol_r,
                      lvl1, lvl5, tol)
        R[q] = ad + bd
        R[_HALF + q] = ax + bx
        R[2 * _HALF + q] = d2 + e2
        R[3 * _HALF + q] = x2 + y2
        R[4 * _HALF + q] = a2 + b2
        R[5 * _HALF + q] = ax_ + bx_
        R[6 * _HALF + q] = rel + rel2
        R[8 * _HALF + q] = ue + ue2
        n_nz += nz + nz2
        n_neg += neg + neg2
        n_out += out + out2
        n_r1 += r1 + r12
        n_r5 += r5 + r52
        m0 = max(m0, max(adb, bdb))
        m1 = max(m1, max(relb, relb2))
        m3 = max(m3, max(ueb, ueb2))
        m4 = max(m4, max(v3b, v3b2))
    dsum = m2 = s1 = s2 = emax = 0
    for p in range(_CHUNK):
        dist, emag = _dist(np.int64(A[p]), E[p], mb, sh, mask, r_sub, r_cap, f32)
        DI[p] = np.uint32(dist)
        s1 += min(dist, 1)  # distances 1 and above
        s2 += min(dist, 2)  # and once more those above 1
        dsum += dist
        m2 = max(m2, dist)
        emax = max(emax, emag)
    # a value the fused path cannot take: |expected| above the format's largest value, or an
    # actual that is not finite; with the former ruled out, the latter is a |d| that is not
    # finite (a finite actual minus an expected within the format's range is finite), read off
    # the maximum of |d| at hand
    acc[0] += (m0 >= _EXP_MASK) | (emax > max_finite)
    acc[14] += dsum  # the ULP row: integers, so every float64 tree of them is exact
    acc[1] += n_nz
    acc[2] += n_neg
    acc[3] += n_out
    acc[4] += n_r1
    acc[5] += n_r5
    acc[13] += _CHUNK - s1  # distances 0
    acc[12] += _CHUNK - (s2 - s1)  # distances 0 and 1
    acc[7] = max(acc[7], m0)
    acc[8] = max(acc[8], m1)
    acc[9] = max(acc[9], m2)
    acc[10] = max(acc[10], m3)
    acc[11] = max(acc[11], m4)


def _chunk_kernel(tol: bool, f32: bool):
    """:func:`_chunk` compiled for one case (``tol``: count the elements outside the tolerance;
    ``f32``: float32, else bfloat16), both constants of the closure: the code of the other cases
    is not compiled in."""
    @_jit
    def chunk(A, E, R, DI, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5, max_finite,
              acc):  # pragma: no cover - compiled
        _wide()
        _chunk(A, E, R, DI, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5, max_finite, acc,
               tol, f32)
    return chunk


_chunk_tol_f32 = _chunk_kernel(True, True)
_chunk_tol_bf16 = _chunk_kernel(True, False)
_chunk_all_f32 = _chunk_kernel(False, True)
_chunk_all_bf16 = _chunk_kernel(False, False)


@_jit
def _tile(a_src, e_src, i, c, rev, A, E, R, C, DI, r_sub, r_cap,
          tiny, floor_bits, th3, tol_a, tol_r, lvl1, lvl5, max_finite, acc, block_sums,
          first_block, tol):  # pragma: no cover - compiled
    """Tile ``[i, i + c)`` in 4096-element blocks (the last one zero-padded): block sums into
    ``block_sums``, counts and maxima into ``acc`` (zeroed here), distances into ``DI``.
    Returns the number of blocks."""
    for k in range(acc.shape[0]):
        acc[k] = 0
    f32 = a_src.itemsize == 4  # float32 bits (else bfloat16's)
    nb = -(-c // _BLOCK)
    for b in range(nb):
        g0 = i + b * _BLOCK
        m = min(_BLOCK, c - b * _BLOCK)
        acc[14] = 0
        for ch in range(_BLOCK // _CHUNK):
            if m == _BLOCK:
                _stage_vec(a_src, e_src, g0 + 64 * ch, A, E)
            else:
                _stage_part(a_src, e_src, g0, m, ch, rev, A, E)
            di = DI[b * _BLOCK + ch * _CHUNK:]
            if tol and f32:
                _chunk_tol_f32(A, E, R, di, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r,
                               lvl1, lvl5, max_finite, acc)
            elif tol:
                _chunk_tol_bf16(A, E, R, di, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r,
                                lvl1, lvl5, max_finite, acc)
            elif f32:
                _chunk_all_f32(A, E, R, di, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r,
                               lvl1, lvl5, max_finite, acc)
            else:
                _chunk_all_bf16(A, E, R, di, r_sub, r_cap, tiny, floor_bits, th3, tol_a, tol_r,
                                lvl1, lvl5, max_finite, acc)
            _halve_vec(R, C, ch * _LANES)
        for j in range(9):
            w0 = _lane(C, j, 0)
            w1 = _lane(C, j, 1)
            w2 = _lane(C, j, 2)
            w3 = _lane(C, j, 3)
            block_sums[j, first_block + b] = (w0 + w1) + (w2 + w3)
        # integers below 2**33, 4096 of them: each partial sum of the tree is exact
        block_sums[7, first_block + b] = np.float64(acc[14])
    return nb


@_inline
def _lane(C, j, l):  # pragma: no cover - compiled
    """Lane ``l``'s 1024-element subtree from its 16 chunk sums."""
    return ((((C[j, l] + C[j, 4 + l]) + (C[j, 8 + l] + C[j, 12 + l]))
             + ((C[j, 16 + l] + C[j, 20 + l]) + (C[j, 24 + l] + C[j, 28 + l])))
            + (((C[j, 32 + l] + C[j, 36 + l]) + (C[j, 40 + l] + C[j, 44 + l]))
               + ((C[j, 48 + l] + C[j, 52 + l]) + (C[j, 56 + l] + C[j, 60 + l]))))


@_jit
def _count_big(DI, n):  # pragma: no cover - compiled
    big = 0
    for k in range(n):
        big += DI[k] >= 65536
    return big


@_jit
def _histogram(DI, n, hist, shift, bigs, nbig, top):  # pragma: no cover - compiled
    """Distances of a tile counted into ``hist``: a small one (below ``_SMALL``) in one of 8
    interleaved copies of the first bins past the end of the histogram (no chain of stores to one
    counter), a larger one in its bin, one of 2**16 or more appended to ``bigs`` from ``nbig``
    (the caller checked there is room); returns the new count. Distances 0 and 1 land in the
    copies too: the caller counts them from the element pass and drops these. ``top``: the
    tile's largest distance.

    On real data the distances straddle the small bins' edge at random, and a branch on it took
    2-3 ns an element. So, from a sample of the tile's first 256 distances: where nearly every
    one lies above ``_EDGE``, a branch (it predicts; float32 at a relative error of 1e-3 has
    0.4 % of its distances below 64, 3.5 % below 512); else the slot is
    ``min(u, _BIG_AT) + shift[k & 7, min(u, _SMALL)]`` (:func:`_shifts`), without a branch
    (LLVM turns a select back into one), the spare bin ``_BIG_AT`` taking what a second pass
    appends to ``bigs``; where all are small, no test at all."""
    small, big_at = np.uint32(_SMALL), np.uint32(_BIG_AT)
    small_at = np.uint32(_SMALL_AT)
    if top < _SMALL:
        for k in range(n):
            hist[small_at + np.uint32(k & 7) * small + DI[k]] += 1
    else:
        edge = np.uint32(_EDGE)
        sample = min(n, 256)
        below = 0
        for k in range(sample):
            below += DI[k] < edge
        if below * 32 <= sample:
            two = np.uint32(2)
            for k in range(n):
                u = DI[k]
                if u < edge:
                    # (without this test, which drops nothing counted, the loop ran ~25 % slower:
                    # LLVM's layout of the rare branch)
                    if u >= two:
                        hist[small_at + np.uint32(k & 7) * small + u] += 1
                elif u < big_at:
                    hist[u] += 1
                else:
                    bigs[nbig] = np.int64(u)
                    nbig += 1
            return nbig
        for k in range(n):
            u = DI[k]
            hist[min(u, big_at) + shift[k & 7, min(u, small)]] += 1
        if top >= 65536:
            for k in range(n):
                u = DI[k]
                if u >= 65536:
                    bigs[nbig] = np.int64(u)
                    nbig += 1
    return nbig


def _shifts() -> np.ndarray:
    """:func:`_histogram`'s slot shifts: row ``r`` (the element's index mod 8), column ``v < _SMALL``
    moves distance ``v`` to its bin in copy ``r``; column ``_SMALL`` (every larger distance) 0."""
    shift = np.zeros((8, _SMALL + 1), dtype=np.uint32)
    shift[:, :_SMALL] = (_SMALL_AT + _SMALL * np.arange(8, dtype=np.uint32))[:, None]
    return shift


_SHIFT = _shifts()


@_jit
def _tiles(kind, a_src, e, n, tile, t0, t1, tiny, sp_scale, sp_floor, th3, has_tol, tol_a,
           tol_r, max_finite, lvl1, lvl5, block_sums, counts, maxes, hist, bigs, failed,
           out):  # pragma: no cover - compiled
    """Tiles ``t0 .. t1 - 1``: ``a_src`` holds the actual bit patterns (int16 for bfloat16,
    int32 for float32). Tiles that need the general path are listed in ``failed``;
    ``out`` = (their count, the count of ``bigs``)."""
    r_sub = 1.0 / sp_floor
    r_cap = 2.0 ** -126
    floor_bits = np.float64(sp_floor).view(np.int64)
    rev = _REV6
    shift = _SHIFT
    lvl1b = np.float64(lvl1).view(np.int64)
    lvl5b = np.float64(lvl5).view(np.int64)
    mfb = np.float64(max_finite).view(np.int64)
    A = np.empty(_CHUNK, dtype=np.int32)  # sign-extended bits: 32-bit lanes for the rows' floats
    E = np.empty(_CHUNK, dtype=np.float64)
    R = np.empty(9 * _HALF, dtype=np.float64)
    C = np.empty((9, 16 * _LANES), dtype=np.float64)
    # distances of a tile that passes are below 2**32 (keys of finite values), half the
    # bytes of int64 (a failing tile's are not read)
    DI = np.empty(-(-tile // _BLOCK) * _BLOCK, dtype=np.uint32)
    zeros = 0  # distances 0 and 1, counted by the element pass
    ones = 0
    acc = np.zeros(15, dtype=np.int64)
    mx = np.zeros(5, dtype=np.int64)
    nf = 0
    nbig = 0
    for t in range(t0, t1):
        i = t * tile
        c = min(tile, n - i)
        nb = _tile(a_src, e, i, c, rev, A, E, R, C, DI, r_sub, r_cap,
                   tiny, floor_bits, th3, tol_a, tol_r, lvl1b, lvl5b, mfb, acc, block_sums,
                   i // _BLOCK, has_tol)
        if acc[0] == 0 and acc[9] >= 65536 and nbig + c > bigs.shape[0]:
            # distances >= 2**16 (at most c) and maybe no room for them: how many?
            acc[6] = _count_big(DI, nb * _BLOCK)
        if acc[0] != 0 or nbig + acc[6] > bigs.shape[0]:
            # nothing committed but block sums: the caller recomputes the tile
            failed[nf] = t
            nf += 1
            continue
        if acc[12] < nb * _BLOCK:  # some distances above 1 (else no scan)
            nbig = _histogram(DI, nb * _BLOCK, hist, shift, bigs, nbig, acc[9])
        zeros += acc[13] - (nb * _BLOCK - c)  # the padding's zeros are not distances
        ones += acc[12] - acc[13]
        counts[0] += c
        counts[1] += c
        counts[4] += acc[3]
        counts[5] += acc[4]
        counts[6] += acc[5]
        counts[7] += acc[1]
        counts[8] += acc[2]
        for j in range(5):
            mx[j] = max(mx[j], acc[7 + j])
    hist[0] += zeros
    hist[1] += ones
    for k in range(8 * _SMALL):  # the scan's copies of the small bins, 0 and 1 dropped
        if k % _SMALL >= 2:
            hist[k % _SMALL] += hist[_SMALL_AT + k]
        hist[_SMALL_AT + k] = 0
    hist[_BIG_AT] = 0
    wide = mx.view(np.float64)
    maxes[0] = max(maxes[0], wide[0])
    maxes[1] = max(maxes[1], wide[1])
    maxes[2] = max(maxes[2], np.float64(mx[2]))
    maxes[3] = max(maxes[3], wide[3])
    maxes[4] = max(maxes[4], wide[4])
    out[0] = nf
    out[1] = nbig
