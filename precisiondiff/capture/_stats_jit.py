"""The numba kernels of :mod:`precisiondiff.capture.stats_kernel` (imported on first use:
importing numba costs about half a second).

The tensor is read in blocks of :data:`_CHUNK` elements that stay in L1; each block goes
through three loops that LLVM vectorises, each at the element's own width:

* ``_sums``: float64 sum, sum |x|, sum x^2 of the values widened exactly to float64 (bfloat16
  by a 16-bit shift, float16 by integer arithmetic; no table lookups);
* ``_extremes``: minimum and maximum of the ordered integer keys of the bit patterns
  (int16 lanes for the 16-bit formats, int32 for float32, int64 for float64);
* ``_products``: the fingerprint's products ``A = sum b*S``, ``B = sum b*(b*S)``, from which
  each fingerprint period adds ``h1 += A + off*sum(S)``, ``h2 += B + off*A`` (the same value,
  modulo 2**64, as :mod:`precisiondiff.store.fingerprint`'s ``(b + off)*S`` terms).

Each function asks LLVM for 512-bit vectors (:func:`_wide`): x86 tunes for 256-bit vectors by
default, and the fingerprint's 64-bit products (``vpmullq``) run twice as fast in 512-bit ones.
"""
from __future__ import annotations

import numba
import numpy as np
from .._numba_wide import wide as _wide
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ..store.fingerprint import _C1, PERIOD

_CHUNK = 4096  # elements per block: each block is read from L1 by every loop; divides PERIOD
assert PERIOD % _CHUNK == 0

_HALF_BITS = np.int32(-0x70002000)  # 0x8FFFE000: a float16's sign, exponent and fraction, shifted by 13
_TWO112 = np.float32(2.0 ** 112)  # 2**(127 - 15)

_jit = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")


@intrinsic
def _bitcast(typingctx, x):  # pragma: no cover - compiled
    """The float32 (int32) or float64 (int64) with the same bits as ``x``."""
    target = {types.int32: types.float32, types.int64: types.float64}.get(x)
    if target is None:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType() if target == types.float32 else ir.DoubleType())
    return target(x), codegen


def _value(x):  # pragma: no cover - typed by the overload below
    """The float64 value of one element: a float, or the bits of a bfloat16 (int16) or float16
    (uint16)."""


@overload(_value, jit_options={"cache": True})
def _value_impl(x):  # pragma: no cover - compiled
    if x == types.int16:  # bfloat16: the high half of a float32
        return lambda x: np.float64(_bitcast(np.int32(np.int32(x) << 16)))
    if x == types.uint16:  # float16, exactly, without float denormals (safe under DAZ/FTZ)
        def half(x):
            h = np.int32(x)
            o = (h & 0x7FFF) << 13
            e = o & 0x0F800000
            o += 0x38000000  # rebias the exponent: 127 - 15
            if e == 0x0F800000:  # Inf/NaN: exponent all ones
                o += 0x38000000
            v = np.float64(_bitcast(np.int32(o)))
            if e == 0:  # zero or subnormal: m * 2**-24 = (2**-14 * (1 + m/1024)) - 2**-14
                v = np.float64(_bitcast(np.int32(o + 0x00800000))) - 6.103515625e-05
            return -v if h & 0x8000 else v
        return half
    if isinstance(x, types.Float):
        return lambda x: np.float64(x)
    return None


def _quick(x):  # pragma: no cover - typed by the overload below
    """:func:`_value`, faster for a float16 that is finite, where floats keep their denormals:
    its bits moved into a float32's (a subnormal half lands on a float32 denormal) times 2**112."""


@overload(_quick, jit_options={"cache": True})
def _quick_impl(x):  # pragma: no cover - compiled
    if x == types.uint16:
        return lambda x: np.float64(_bitcast(np.int32((np.int32(np.int16(x)) << 13) & _HALF_BITS)) * _TWO112)
    return lambda x: _value(x)


@_jit
def _sums(values, out, careful):  # pragma: no cover - compiled
    """out[2..6] += sum, sum|x|, sum x^2 (float64), then NaN and Inf counts, which are only
    counted when sum|x| is not finite (no NaN or Inf otherwise: the common case).
    ``careful``: the block may hold an Inf or NaN, or floats flush denormals (float16 only)."""
    _wide()
    s = sa = s2 = 0.0
    if careful:
        for k in range(values.shape[0]):
            v = _value(values[k])
            s += v
            sa += abs(v)
            s2 += v * v
    else:
        for k in range(values.shape[0]):
            v = _quick(values[k])
            s += v
            sa += abs(v)
            s2 += v * v
    out[2] += s
    out[3] += sa
    out[4] += s2
    if not np.isfinite(sa):
        nan = inf = 0.0
        for k in range(values.shape[0]):
            v = _value(values[k])
            nan += 1.0 if v != v else 0.0
            inf += 1.0 if abs(v) == np.inf else 0.0
        out[5] += nan
        out[6] += inf


def _key(b):  # pragma: no cover - typed by the overload below
    """The ordered key of a bit pattern, at its width: ``b`` flipped below the sign bit when
    negative, so that integer order is float order (-0 below +0). The map is an involution."""


@overload(_key, jit_options={"cache": True})
def _key_impl(b):  # pragma: no cover - compiled
    # numba widens small integers to int64 in arithmetic: cast back, or the loop runs in int64 lanes
    if b == types.int16:
        return lambda b: np.int16(b ^ ((b >> 15) & 0x7FFF))
    if b == types.int32:
        return lambda b: np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))
    if b == types.int64:
        return lambda b: b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF)
    return None


@_jit
def _extremes(bits, lo, hi):  # pragma: no cover - compiled
    """Minimum and maximum ordered key of a block, from ``lo`` and ``hi``."""
    _wide()
    for k in range(bits.shape[0]):
        key = _key(bits[k])
        lo = min(lo, key)
        hi = max(hi, key)
    return lo, hi


@_jit
def _products(bits, table):  # pragma: no cover - compiled
    """``sum b*S`` and ``sum b*(b*S)`` modulo 2**64 over one block of one period."""
    _wide()
    a = np.int64(0)
    q = np.int64(0)
    for k in range(bits.shape[0]):
        b = np.int64(bits[k])
        p = b * table[k]
        a += p
        q += p * b
    return a, q


@_jit
def _period(values, bits, table, infinities, out, neutral_lo, neutral_hi, flushes):  # pragma: no cover - compiled
    """One fingerprint period (at most PERIOD elements, the first at a multiple of PERIOD), in
    blocks of _CHUNK: adds the sums to ``out``; returns its minimum and maximum keys and the
    fingerprint's products ``a = sum b*S``, ``q = sum b*(b*S)``."""
    lo, hi = neutral_lo, neutral_hi
    a = np.int64(0)
    q = np.int64(0)
    n = bits.shape[0]
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        block_lo, block_hi = _extremes(bits[start:stop], neutral_lo, neutral_hi)
        lo = min(lo, block_lo)
        hi = max(hi, block_hi)
        special = block_hi >= infinities[0] or block_lo <= infinities[1]
        _sums(values[start:stop], out, special or flushes)
        da, dq = _products(bits[start:stop], table[start:stop])
        a += da
        q += dq
    return lo, hi, a, q


@_jit
def _flushes(cumulative):  # pragma: no cover - compiled
    """Whether floats flush denormals here (DAZ, e.g. torch.set_flush_denormal(True)): 2**-149
    reads as 0. The 1 comes from memory so that LLVM cannot fold the probe."""
    return _bitcast(np.int32(cumulative[0] + 1)) * _TWO112 == 0


@_jit
def _finish(keys, lo, hi, values, h1, h2, o, fps, row):  # pragma: no cover - compiled
    """Write the minimum and maximum (decoded from their keys, at the width of ``values``) and
    the fingerprint."""
    keys[0] = _key(lo)
    keys[1] = _key(hi)
    decoded = keys.view(values.dtype)
    o[0] = _value(decoded[0])
    o[1] = _value(decoded[1])
    fps[row, 0] = h1
    fps[row, 1] = h2


@_jit
def _stats(values, bits, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    """Statistics and fingerprint of a flat tensor: ``values`` (float32/float64, or the int16
    bits of a bfloat16, the uint16 bits of a float16) and ``bits`` view the same memory;
    ``infinities``: the keys of +Inf and -Inf (beyond them: NaN); ``cumulative[r] = S[0] +
    ... + S[r-1]`` (mod 2**64)."""
    _wide()
    flushes = _flushes(cumulative)
    n = bits.shape[0]
    o = out[row]
    o[:] = 0.0
    keys = np.empty(2, dtype=bits.dtype)  # typed at the element's width
    keys[0] = np.iinfo(bits.dtype).max  # neutral for min
    keys[1] = np.iinfo(bits.dtype).min
    lo, hi = keys[0], keys[1]
    neutral_lo, neutral_hi = lo, hi
    h1 = np.int64(0)
    h2 = np.int64(0)
    for first in range(0, n, PERIOD):
        last = min(n, first + PERIOD)
        block_lo, block_hi, a, q = _period(values[first:last], bits[first:last], table, infinities, o,
                                           neutral_lo, neutral_hi, flushes)
        lo = min(lo, block_lo)
        hi = max(hi, block_hi)
        off = np.int64(first // PERIOD) * np.int64(_C1) + np.int64(1)
        h1 += a + off * cumulative[last - first]
        h2 += q + off * a
    _finish(keys, lo, hi, values, h1, h2, o, fps, row)


_TILE = 16  # rows gathered side by side: a transposed matrix's rows share their cache lines


@_jit
def _row_offset(r, sizes, strides):  # pragma: no cover - compiled
    """The memory offset (in elements) of logical row ``r``: every dimension but the last."""
    off = 0
    for d in range(sizes.shape[0] - 2, -1, -1):
        size = sizes[d]
        off += (r % size) * strides[d]
        r //= size
    return off


@_jit
def _gather(src, sizes, strides, first, count, dst):  # pragma: no cover - compiled
    """``dst[k]`` = the element of logical (row-major) index ``first + k`` of the strided tensor
    over ``src``, for k < count. Rows whose elements are neighbours go whole; others ``_TILE``
    rows at a time, column by column, through a small tile: the rows of a transposed matrix are
    neighbours in memory, so each cache line read serves them all, and written straight, the
    rows' streams would lie a row apart (for power-of-two widths, in the same L1 sets).
    Indices are unsigned: numba then emits no negative-index wrap-around, which kept LLVM from
    vectorising these loops (2 ns per element for a plain copy)."""
    cols = sizes[sizes.shape[0] - 1]
    step = np.uint64(strides[strides.shape[0] - 1])
    width_all = np.uint64(cols)
    offsets = np.empty(_TILE, dtype=np.uint64)
    tile = np.empty(_TILE * _TILE, dtype=dst.dtype)
    i = first
    end = first + count
    k = np.uint64(0)
    while i < end:
        r = i // cols
        c0 = i - r * cols
        if c0 != 0 or end - i < cols or step == 1:  # one row, or part of one
            c1 = min(cols, c0 + (end - i))
            base = np.uint64(_row_offset(r, sizes, strides))
            for c in range(np.uint64(c0), np.uint64(c1)):
                dst[k + c - np.uint64(c0)] = src[base + c * step]
            k += np.uint64(c1 - c0)
            i += c1 - c0
            continue
        rows = np.uint64(min(_TILE, (end - i) // cols))
        for t in range(rows):
            offsets[t] = _row_offset(r + t, sizes, strides)
        for c0 in range(np.uint64(0), width_all, np.uint64(_TILE)):
            width = min(width_all - c0, np.uint64(_TILE))
            for c in range(width):
                at = (c0 + c) * step
                for t in range(rows):
                    tile[t * np.uint64(_TILE) + c] = src[offsets[t] + at]
            for t in range(rows):
                row = k + t * width_all + c0
                for c in range(width):
                    dst[row + c] = tile[t * np.uint64(_TILE) + c]
        k += rows * width_all
        i += rows * cols


@_jit
def _stats_strided(memory, sizes, strides, values_of, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    """:func:`_stats` of a strided tensor over ``memory`` (its elements' bits), read in row-major
    order a period at a time through a scratch buffer: the same results as :func:`_stats` of its
    row-major copy, bit for bit, without the copy. ``values_of``: an empty array of the dtype
    the values are read as (the bits' own dtype for bfloat16)."""
    _wide()
    flushes = _flushes(cumulative)
    n = 1
    for d in range(sizes.shape[0]):
        n *= sizes[d]
    o = out[row]
    o[:] = 0.0
    bits = np.empty(min(n, PERIOD), dtype=memory.dtype)
    values = bits.view(values_of.dtype)
    keys = np.empty(2, dtype=memory.dtype)
    keys[0] = np.iinfo(memory.dtype).max
    keys[1] = np.iinfo(memory.dtype).min
    lo, hi = keys[0], keys[1]
    neutral_lo, neutral_hi = lo, hi
    h1 = np.int64(0)
    h2 = np.int64(0)
    for first in range(0, n, PERIOD):
        count = min(n, first + PERIOD) - first
        _gather(memory, sizes, strides, first, count, bits)
        block_lo, block_hi, a, q = _period(values[:count], bits[:count], table, infinities, o,
                                           neutral_lo, neutral_hi, flushes)
        lo = min(lo, block_lo)
        hi = max(hi, block_hi)
        off = np.int64(first // PERIOD) * np.int64(_C1) + np.int64(1)
        h1 += a + off * cumulative[count]
        h2 += q + off * a
    _finish(keys, lo, hi, values, h1, h2, o, fps, row)


@intrinsic
def _pointer(typingctx, address):  # pragma: no cover - compiled
    """The memory address ``address`` (an integer) as a ``void*`` for :func:`numba.carray`."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(address), codegen


# Entry points: the tensor's memory as (address, element count), which costs ~0.1 us from
# Python where a NumPy view through DLPack costs ~4 us (most of a small tensor's statistics).


@_jit
def stats_f32(address, n, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float32)
    _stats(values, values.view(np.int32), infinities, table, cumulative, out, fps, row)


@_jit
def stats_f64(address, n, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float64)
    _stats(values, values.view(np.int64), infinities, table, cumulative, out, fps, row)


@_jit
def stats_bf16(address, n, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    _stats(bits, bits, infinities, table, cumulative, out, fps, row)


@_jit
def stats_f16(address, n, infinities, table, cumulative, out, fps, row):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    _stats(bits.view(np.uint16), bits, infinities, table, cumulative, out, fps, row)


# The same entry points with every array as an address (``*_at``): numba checks the type of
# each NumPy argument on every call (~0.25 us apiece), which integers skip. ``out`` and ``fps``
# point at the row to fill (7 float64, 2 int64); ``infinities`` at the two keys, ``table`` at
# the PERIOD salts, ``cumulative`` at their PERIOD + 1 prefix sums.


@_jit
def stats_f32_at(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float32)
    _stats(values, values.view(np.int32), numba.carray(_pointer(infinities), 2, np.int32),
           numba.carray(_pointer(table), PERIOD, np.int64), numba.carray(_pointer(cumulative), PERIOD + 1, np.int64),
           numba.carray(_pointer(out), (1, 7), np.float64), numba.carray(_pointer(fps), (1, 2), np.int64), 0)


@_jit
def stats_f64_at(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    values = numba.carray(_pointer(address), n, np.float64)
    _stats(values, values.view(np.int64), numba.carray(_pointer(infinities), 2, np.int64),
           numba.carray(_pointer(table), PERIOD, np.int64), numba.carray(_pointer(cumulative), PERIOD + 1, np.int64),
           numba.carray(_pointer(out), (1, 7), np.float64), numba.carray(_pointer(fps), (1, 2), np.int64), 0)


@_jit
def stats_bf16_at(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    _stats(bits, bits, numba.carray(_pointer(infinities), 2, np.int16),
           numba.carray(_pointer(table), PERIOD, np.int64), numba.carray(_pointer(cumulative), PERIOD + 1, np.int64),
           numba.carray(_pointer(out), (1, 7), np.float64), numba.carray(_pointer(fps), (1, 2), np.int64), 0)


@_jit
def stats_f16_at(address, n, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    bits = numba.carray(_pointer(address), n, np.int16)
    _stats(bits.view(np.uint16), bits, numba.carray(_pointer(infinities), 2, np.int16),
           numba.carray(_pointer(table), PERIOD, np.int64), numba.carray(_pointer(cumulative), PERIOD + 1, np.int64),
           numba.carray(_pointer(out), (1, 7), np.float64), numba.carray(_pointer(fps), (1, 2), np.int64), 0)



# Strided tensors (a transposed weight, a permuted attention head), every argument an address as
# in ``*_at``: ``sizes`` and ``strides`` point at ``ndim`` int64 each (strides in elements, none
# negative), ``address`` at the element of logical index 0.


@_jit
def _memory(address, ndim, sizes, strides, dtype):  # pragma: no cover - compiled
    """(memory, sizes, strides) as arrays: the memory spans the tensor's furthest element."""
    shape = numba.carray(_pointer(sizes), ndim, np.int64)
    steps = numba.carray(_pointer(strides), ndim, np.int64)
    extent = 1
    for d in range(ndim):
        extent += (shape[d] - 1) * steps[d]
    return numba.carray(_pointer(address), extent, dtype), shape, steps


@_jit
def _strided_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps, bits_of, values_of):  # pragma: no cover - compiled
    """The ``strided_*_at`` entry points' body: ``bits_of`` and ``values_of`` are empty arrays of
    the element's bits' dtype and of the dtype its values are read as."""
    memory, shape, steps = _memory(address, ndim, sizes, strides, bits_of.dtype)
    _stats_strided(memory, shape, steps, values_of, numba.carray(_pointer(infinities), 2, bits_of.dtype),
                   numba.carray(_pointer(table), PERIOD, np.int64), numba.carray(_pointer(cumulative), PERIOD + 1, np.int64),
                   numba.carray(_pointer(out), (1, 7), np.float64), numba.carray(_pointer(fps), (1, 2), np.int64), 0)


@_jit
def strided_f32_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    _strided_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps, np.empty(0, np.int32),
                np.empty(0, np.float32))


@_jit
def strided_f64_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    _strided_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps, np.empty(0, np.int64),
                np.empty(0, np.float64))


@_jit
def strided_bf16_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    _strided_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps, np.empty(0, np.int16),
                np.empty(0, np.int16))


@_jit
def strided_f16_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps):  # pragma: no cover - compiled
    _strided_at(address, ndim, sizes, strides, infinities, table, cumulative, out, fps, np.empty(0, np.int16),
                np.empty(0, np.uint16))
