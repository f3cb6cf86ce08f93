"""The compare tile as one fused pass, compiled with numba (optional): bfloat16 or float32
``actual`` against float64 ``expected``, the pairs a precision comparison mostly sees.

It computes exactly what :func:`precisiondiff.comparators.tiles.finite_tile` computes with
PyTorch, bit for bit: the same IEEE float64 operations per element (no fast-math, no fused
multiply-add), the same fixed pairwise tree over each 4096-element block, the same
correctly rounded ``expected`` (one rounding to nearest even, done on the float64 bits),
integer ULP distances and the same counts and maxima. A tile it cannot take (a NaN or
infinity, ``|expected|`` above the format's largest value, more ULP distances of 2**16 or
more than it keeps) is left untouched and reported, for the PyTorch path. How the pass is
laid out for SIMD: :mod:`precisiondiff.comparators._tiles_jit`.

The kernel releases the GIL: :func:`run` hands the tiles out in batches to
``torch.get_num_threads()`` threads, on a pool kept between calls.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from .. import _numba

__all__ = ["AVAILABLE", "compare_range", "BF16", "F32"]

#: whether the fused kernel can be used (numba installed and not disabled by PRECISIONDIFF_NO_NUMBA;
#: False after a failed import of the kernels)
AVAILABLE = _numba.ENABLED
BF16, F32 = 0, 1
_loader = _numba.Kernels(__name__.rpartition(".")[0] + "._tiles_jit")


def _kernels():
    """The compiled kernels, imported on first use; None (and AVAILABLE False) when that fails."""
    global AVAILABLE
    kernels = _loader() if AVAILABLE else None
    AVAILABLE = kernels is not None
    return kernels


def compare_range(kind: int, a: np.ndarray, e: np.ndarray, n: int, tile: int, t0: int, t1: int,
                  params: tuple, block_sums: np.ndarray, counts: np.ndarray, maxes: np.ndarray,
                  hist: np.ndarray, bigs: "np.ndarray | None" = None) -> tuple:
    """Run tiles ``t0 .. t1 - 1``; return (tiles left for the PyTorch path, ULP distances
    >= 2**16 of the tiles done, as an int64 array: the start of ``bigs`` when given).

    Args:
        kind: :data:`BF16` (``a`` holds the int16 bit patterns) or :data:`F32` (``a`` holds
            the int32 bit patterns).
        a, e: the flat actual bit patterns and float64 expected arrays (the whole tensors).
        n, tile: element count and tile size (a multiple of 4096 unless ``n`` is below it).
        params: ``(tiny, sp_scale, sp_floor, th3, has_tol, tol_a, tol_r, max_finite, lvl1,
            lvl5)``.
        block_sums: float64 ``(9, blocks)``, written at the tiles' blocks.
        counts: int64 ``(9,)``, maxes: float64 ``(5,)``: accumulated; hist: int32 or int64
            ``(HIST_SIZE,)``, bins 0 .. 2**16 - 1 accumulated (the rest: the kernel's scratch,
            zero before and after).
        bigs: int64 room for the large distances (a tile that does not fit goes to the
            PyTorch path); by default as many as the tiles hold, at most ``_MAX_BIG``.
    """
    if hist.shape[0] < HIST_SIZE:  # the kernel writes its scratch there, unchecked
        raise ValueError(f"hist holds {hist.shape[0]} bins, the kernel needs {HIST_SIZE}")
    failed = np.empty(max(t1 - t0, 1), dtype=np.int64)
    if bigs is None:
        bigs = np.empty(min(max(t1 - t0, 1) * tile, _MAX_BIG), dtype=np.int64)
    out = np.zeros(2, dtype=np.int64)
    _kernels()._tiles(kind, a, e, n, tile, t0, t1, *params, block_sums, counts, maxes, hist,
                      bigs, failed, out)
    return failed[: out[0]].tolist(), bigs[: out[1]]


# the histogram's 2**16 bins and the scan's scratch past them (_tiles_jit: a spare bin and 8
# interleaved copies of its first 512 bins), left at zero by every call
HIST_SIZE = (1 << 16) + 1 + 8 * 512
_MAX_BIG = 1 << 20  # large ULP distances kept per thread; past it, tiles go to the PyTorch path
_MIN_PER_THREAD = 1 << 20  # elements: below this one thread (starting threads costs ~0.1 ms)
_MAX_BATCH = 8  # tiles a thread takes at a time, at most (8 * 65536 elements: ~3 ms)


def usable(actual: "torch.Tensor", expected: "torch.Tensor", device: "torch.device") -> bool:
    """Whether :func:`run` takes this pair: numba present, CPU, bfloat16 or float32 actual,
    float64 expected, both flat and contiguous."""
    import torch
    return (AVAILABLE and _kernels() is not None and device.type == "cpu" and actual.device.type == "cpu"
            and expected.device.type == "cpu" and actual.dtype in (torch.bfloat16, torch.float32)
            and expected.dtype == torch.float64 and actual.is_contiguous() and expected.is_contiguous()
            and not actual.requires_grad and not expected.requires_grad)


def run(actual: "torch.Tensor", expected: "torch.Tensor", n: int, tile: int, params: tuple, block_sums: "torch.Tensor", counts: "torch.Tensor", maxes: "torch.Tensor",
        hist: object) -> list:
    """Every tile of the pair on ``torch.get_num_threads()`` threads; accumulates into the
    PyTorch accumulators (``block_sums``, ``counts``, ``maxes`` CPU tensors and the
    :class:`~precisiondiff.comparators.tiles.P99Histogram`); returns the indices of the tiles
    left for the PyTorch path."""
    import torch
    if actual.dtype == torch.bfloat16:
        kind, a = BF16, actual.view(torch.int16).numpy()
    else:
        kind, a = F32, actual.view(torch.int32).numpy()
    e = expected.numpy()
    tiles = -(-n // tile)
    if not _compiles(kind, a.dtype, params):
        return list(range(tiles))
    threads = max(1, min(torch.get_num_threads(), n // _MIN_PER_THREAD, tiles))
    # the threads take batches of tiles as they go (on a shared machine one core may run
    # slower: equal shares would leave the other waiting), ~8 batches per thread or more
    # (a call costs ~50 us: 2 ms per tile would not pay for them)
    batch = tiles if threads == 1 else max(1, min(_MAX_BATCH, tiles // (8 * threads)))
    grab = itertools.count()  # next() of a count is atomic under the GIL
    sums = block_sums.numpy()
    # int32 counts while no count can reach 2**31: half the histogram's cache footprint (its
    # increments land at random in 65536 bins: float32 distances spread over thousands)
    hdt = np.int32 if n < 1 << 31 else np.int64
    parts = [(np.zeros(9, dtype=np.int64), np.zeros(5), np.zeros(HIST_SIZE, dtype=hdt))
             for _ in range(threads)]

    def work(k: int) -> tuple:
        c, m, h = parts[k]
        bigs = np.empty(min(tiles * tile, _MAX_BIG), dtype=np.int64)  # per thread, as before
        used, left = 0, []
        while True:
            t0 = next(grab) * batch
            if t0 >= tiles:
                return left, bigs[:used]
            f, b = compare_range(kind, a, e, n, tile, t0, min(t0 + batch, tiles), params, sums,
                                 c, m, h, bigs[used:])
            left += f
            used += b.size

    if threads == 1:
        results = [work(0)]
    else:  # the calling thread works too
        futures = [_pool(threads - 1).submit(work, k) for k in range(1, threads)]
        results = [work(0)] + [f.result() for f in futures]
    failed = []
    total = parts[0][2]
    done = 0
    for k, ((c, m, h), (tiles_left, bigs)) in enumerate(zip(parts, results)):
        counts += torch.from_numpy(c)
        torch.maximum(maxes, torch.from_numpy(m), out=maxes)
        if k:
            total += h
        done += int(c[0])
        if bigs.size:
            hist.add(torch.from_numpy(bigs))
        failed.extend(tiles_left)
    failed.sort()
    if done:  # distances below 2**16 reach at most the largest one: hand over only that much
        top = min(int(max(m[2] for _, m, _ in parts)) + 1, 1 << 16)
        hist.add_counts(torch.from_numpy(total[:top].astype(np.int64)))
    return failed


_COMPILED: dict = {}  # (kind, actual's dtype) -> whether the kernel compiled here


def _compiles(kind: int, a_dtype: np.dtype, params: tuple) -> bool:
    """Whether the kernel for ``kind`` compiles (or loads from numba's cache) on this machine: tried
    once per process on one tile of zeros. Part of it is LLVM vector code written by hand
    (_tiles_jit.py); an LLVM that refuses it disables the kernels, and every tile takes the
    PyTorch path (the same figures), with one warning."""
    global AVAILABLE
    key = (kind, np.dtype(a_dtype).str)
    if key not in _COMPILED:
        try:
            compare_range(kind, np.zeros(_CHECK, dtype=a_dtype), np.zeros(_CHECK), _CHECK, _CHECK, 0, 1, params,
                          np.zeros((9, 1)), np.zeros(9, dtype=np.int64), np.zeros(5),
                          np.zeros(HIST_SIZE, dtype=np.int32))
            _COMPILED[key] = True
        except Exception as err:  # noqa: BLE001 - any failure: the PyTorch path
            _COMPILED[key] = False
            _loader.disable()
            AVAILABLE = False
            import logging
            logging.getLogger(__name__).warning("the fused compare kernel failed to compile (%s): using PyTorch",
                                                err)
    return _COMPILED[key]


_CHECK = 4096  # one block
_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> "ThreadPoolExecutor":
    """A thread pool kept between calls (starting threads per pair cost ~1 ms each on a loaded
    machine)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < workers:
            from concurrent.futures import ThreadPoolExecutor
            old, _POOL = _POOL, ThreadPoolExecutor(workers, thread_name_prefix="precisiondiff-tiles")
            _POOL_SIZE = workers
            if old is not None:
                old.shutdown(wait=False)
        return _POOL
