"""Statistics throughput: the fused CPU kernel vs the eager PyTorch passes vs a memory copy.

    python benchmarks/bench_capture_stats.py [--mib 64] [--repeats 5]

One thread (``torch.set_num_threads(1)``, numba kernels are single-threaded): GB/s per core of
the tensor's bytes, best of ``--repeats``, measured side by side in one run. "eager" is the
fallback when numba is missing: min/max, mean, |x| mean, norm, NaN/Inf counts and the fingerprint
in separate PyTorch passes. Also the cost of one tiny (64-element) tensor through each path.
"""
from __future__ import annotations

import argparse
import os
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


def _stats(t: torch.Tensor, fast: bool) -> None:
    batch = StatsBatch(fast=fast)
    batch.get(batch.add(t)) if fast else (batch.add(t), batch.resolve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"numba available: {stats_kernel.AVAILABLE}; one thread; {args.mib} MiB per tensor")
    print(f"{'dtype':>9} {'copy GB/s':>10} {'fused GB/s':>11} {'eager GB/s':>11} {'fused/eager':>12} "
          f"{'fused/copy':>11} {'tiny fused us':>14} {'tiny eager us':>14}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        n = (args.mib << 20) // dtype.itemsize
        t = torch.randn(n).to(dtype)
        dst = torch.empty_like(t)
        nbytes = n * dtype.itemsize
        t_copy = _best(lambda: dst.copy_(t), args.repeats)
        t_fused = _best(lambda: _stats(t, True), args.repeats) if stats_kernel.AVAILABLE else float("nan")
        t_eager = _best(lambda: _stats(t, False), max(1, args.repeats // 2))
        tiny = torch.randn(64).to(dtype)
        k = 2000
        tiny_fused = _best(lambda: [_stats(tiny, True) for _ in range(k)], 2) / k * 1e6
        tiny_eager = _best(lambda: [_stats(tiny, False) for _ in range(k)], 2) / k * 1e6
        gb = lambda s: nbytes / s / 1e9  # noqa: E731
        print(f"{str(dtype)[6:]:>9} {gb(t_copy):10.2f} {gb(t_fused):11.2f} {gb(t_eager):11.3f} "
              f"{t_eager / t_fused:12.1f} {t_copy / t_fused:11.2f} {tiny_fused:14.1f} {tiny_eager:14.1f}",
              flush=True)


if __name__ == "__main__":
    main()
