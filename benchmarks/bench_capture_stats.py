"""Statistics throughput: the fused CPU kernel vs the eager PyTorch passes vs a memory copy.

    python benchmarks/bench_capture_stats.py [--mib 64] [--repeats 5] [--loops]

One thread (``torch.set_num_threads(1)``, numba kernels are single-threaded): GB/s per core of
the tensor's bytes, measured side by side in one run, the paths interleaved in each repeat. The
table gives the median over ``--repeats`` of the thread's CPU time (what one core does, less
sensitive to other jobs sharing the machine), then the wall-time median. "eager" is the fallback
when numba is missing: min/max, mean, |x| mean, norm, NaN/Inf counts and the fingerprint in
separate PyTorch passes. "msprobe" is what msprobe's statistics dump computes per tensor (its
``get_stat_info``: ``torch.max``, ``min``, ``mean`` and ``norm``, four PyTorch passes without NaN/Inf
counts or a fingerprint): "fused/msprobe" is the floor of the ratio of capture overheads where
large tensors' statistics dominate (docs/performance.md, "Where issue 22's capture-floor goals
stand"). Also the cost of one tiny (64-element) tensor through each path, and the load average
seen. ``--loops``: each loop of the fused kernel alone over the same tensor,
block by block (where its time goes), next to the whole kernel.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from precisiondiff.capture import stats_kernel  # noqa: E402
from precisiondiff.capture.stats import StatsBatch  # noqa: E402


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _interleaved(fns: dict, repeats: int) -> dict:
    """name -> (median thread CPU seconds, median wall seconds), the functions run in turn."""
    for fn in fns.values():
        fn()
    cpu = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c, w = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in fns}


def _stats(t: torch.Tensor, fast: bool) -> None:
    batch = StatsBatch(fast=fast)
    batch.get(batch.add(t)) if fast else (batch.add(t), batch.resolve())


def _msprobe_stats(t: torch.Tensor) -> None:
    torch.max(t), torch.min(t), torch.mean(t), torch.norm(t)


def _loop_profile(t: torch.Tensor, repeats: int) -> str:
    """GB/s (thread CPU time, median) of each loop of the fused kernel alone, then of the kernel."""
    import numba
    import numpy as np

    jit = stats_kernel._kernels()
    chunk = jit._CHUNK

    @numba.njit(nogil=True)
    def sums(values, out):
        for s in range(0, values.shape[0], chunk):
            jit._sums(values[s:s + chunk], out, False)

    @numba.njit(nogil=True)
    def extremes(bits):
        keys = np.empty(2, dtype=bits.dtype)
        keys[0], keys[1] = np.iinfo(bits.dtype).max, np.iinfo(bits.dtype).min
        lo, hi = keys[0], keys[1]
        for s in range(0, bits.shape[0], chunk):
            lo, hi = jit._extremes(bits[s:s + chunk], lo, hi)
        return lo, hi

    @numba.njit(nogil=True)
    def products(bits, table):
        total = 0
        for s in range(0, bits.shape[0], chunk):
            r = s % table.shape[0]
            a, q = jit._products(bits[s:s + chunk], table[r:r + chunk])
            total += a + q
        return total

    if t.element_size() == 2:
        bits = stats_kernel._array(t.view(torch.int16))
        values = bits if t.dtype == torch.bfloat16 else bits.view(np.uint16)
    else:
        values = stats_kernel._array(t)
        bits = values.view(np.int32 if t.dtype == torch.float32 else np.int64)
    out = np.zeros(7)
    fns = {"sums": lambda: sums(values, out), "extremes": lambda: extremes(bits),
           "products": lambda: products(bits, stats_kernel._TABLE), "kernel": lambda: _stats(t, True)}
    times = _interleaved(fns, repeats)
    nbytes = t.numel() * t.element_size()
    return "  ".join(f"{name} {nbytes / c / 1e9:5.2f}" for name, (c, _) in times.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loops", action="store_true", help="also time each loop of the fused kernel")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"numba available: {stats_kernel.AVAILABLE}; one thread; {args.mib} MiB per tensor; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("GB/s: median of the thread's CPU time (median of wall time)")
    print(f"{'dtype':>9} {'copy GB/s':>14} {'fused GB/s':>14} {'eager GB/s':>14} {'fused/eager':>12} "
          f"{'fused/copy':>11} {'msprobe GB/s':>14} {'fused/msprobe':>14} {'tiny fused us':>14} {'tiny eager us':>14}")
    loops = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        n = (args.mib << 20) // dtype.itemsize
        t = torch.randn(n).to(dtype)
        dst = torch.empty_like(t)
        nbytes = n * dtype.itemsize
        fns = {"copy": lambda: dst.copy_(t), "eager": lambda: _stats(t, False), "msprobe": lambda: _msprobe_stats(t)}
        if stats_kernel.AVAILABLE:
            fns["fused"] = lambda: _stats(t, True)
        times = _interleaved(fns, args.repeats)
        nan = (float("nan"), float("nan"))
        cpu = {name: times.get(name, nan)[0] for name in ("copy", "fused", "eager", "msprobe")}
        gb = {name: (nbytes / c / 1e9, nbytes / w / 1e9) for name, (c, w) in
              ((k, times.get(k, nan)) for k in ("copy", "fused", "eager", "msprobe"))}
        tiny = torch.randn(64).to(dtype)
        k = 2000
        tiny_fused = _best(lambda: [_stats(tiny, True) for _ in range(k)], 2) / k * 1e6
        tiny_eager = _best(lambda: [_stats(tiny, False) for _ in range(k)], 2) / k * 1e6
        cell = lambda name: f"{gb[name][0]:6.2f} ({gb[name][1]:5.2f})"  # noqa: E731
        print(f"{str(dtype)[6:]:>9} {cell('copy'):>14} {cell('fused'):>14} {cell('eager'):>14} "
              f"{cpu['eager'] / cpu['fused']:12.1f} {cpu['copy'] / cpu['fused']:11.2f} {cell('msprobe'):>14} "
              f"{cpu['fused'] / cpu['msprobe']:14.2f} {tiny_fused:14.1f} "
              f"{tiny_eager:14.1f}", flush=True)
        if args.loops and stats_kernel.AVAILABLE:
            loops.append(f"{str(dtype)[6:]:>9}  {_loop_profile(t, args.repeats)}")
    if loops:
        print("each loop alone, GB/s of the tensor's bytes (thread CPU time, median):")
        print("\n".join(loops))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
