"""Throughput of compare_tensors vs a plain memory copy of the same bytes, side by side.

Usage: python benchmarks/bench_compare.py [--sizes 64M,1G] [--dtypes float32,bfloat16]
       [--expected float64] [--device cpu] [--repeat 1] [--fallback] [--noise 1e-3]

SIZE is the bytes of the *actual* tensor (DTYPE); expected is ``--expected`` (float64 by
default: the reference run's dtype; ``same`` for DTYPE). Throughput = bytes of the pair / s;
``ratio`` = compare / copy throughput (goal >= 0.5), ``x copy`` = its inverse (how many
copies of the pair one comparison costs). The copy copies the pair's own bytes once, with
the same thread count: it reads them and writes as many (the compare only reads), so ``read
GB/s`` (a plain int64 sum over the same bytes) is printed too: the memory's read rate, a
compare's bound. ``--fallback`` also times the pure-PyTorch path (numba disabled for the
call). Everything is timed in the same run, the copy, the read and the compare interleaved
repeat by repeat; the figures are medians, and ``cpu ns/el`` is the compare's process CPU
time per element (all threads: what a loaded machine does not inflate). The load average is
printed before and after: on a shared machine the ratio moves with it. ``--noise`` is the
actual's relative error (1e-3 by default: ~8000 ULP in float32, ~0.1-0.3 ULP in bfloat16);
real pairs spread their ULP distances over a few to a few hundred (float32 at 1e-5, bfloat16 at
1e-2), which the kernel's histogram scan sees differently.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from precisiondiff.comparators import compare_tensors

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    text = text.strip().upper()
    if text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev: torch.device) -> tuple:
    """(wall seconds, process CPU seconds) of one call."""
    _sync(dev)
    t, c = time.perf_counter(), time.process_time()
    fn()
    _sync(dev)
    return time.perf_counter() - t, time.process_time() - c


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64M,1G")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chunk-elems", type=int, default=None)
    p.add_argument("--expected", default="float64", help="float64 or same")
    p.add_argument("--fallback", action="store_true", help="also time the PyTorch fallback")
    p.add_argument("--noise", type=float, default=1e-3, help="the actual's relative error (default 1e-3)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {dev}, "
          f"repeats {args.repeat} (medians), noise {args.noise:g}, load average {_load()}")
    print(f"{'dtype':>9} {'expected':>9} {'size':>6} {'copy GB/s':>10} {'compare GB/s':>13} {'ratio':>7} "
          f"{'compare s':>10} {'x copy':>7} {'cpu ns/el':>9} {'read GB/s':>9} {'/read':>6}"
          + (f" {'fallback s':>11} {'speed-up':>9}" if args.fallback else ""))
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        for s in args.sizes.split(","):
            nbytes = _size(s)
            n = nbytes // torch.empty((), dtype=dt).element_size()
            g = torch.Generator(device=dev).manual_seed(0)
            edt = dt if args.expected == "same" else getattr(torch, args.expected)
            e = torch.randn(n, generator=g, device=dev, dtype=torch.float64)
            a = (e * (1 + args.noise * torch.randn(n, generator=g, device=dev, dtype=torch.float64))).to(dt)
            e = e.to(edt)
            pair = nbytes + n * e.element_size()
            # the pair's own bytes: a never-written buffer would be read from the kernel's one
            # zero page (in cache), which made the copy 30-40% faster than a copy of data
            src = torch.cat([a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)])
            dst = torch.empty_like(src)
            kw = {} if args.chunk_elems is None else {"chunk_elems": args.chunk_elems}
            dst.copy_(src)
            compare_tensors(a[:65536], e[:65536], **kw)  # compile / warm up
            copies, cmps, cpus, fbs, reads = [], [], [], [], []
            words = src[: pair // 8 * 8].view(torch.int64)
            for _ in range(args.repeat):  # interleaved: the same machine state for both
                copies.append(_timed(lambda: dst.copy_(src), dev)[0])
                reads.append(_timed(lambda: words.sum(), dev)[0])
                wall, cpu = _timed(lambda: compare_tensors(a, e, **kw), dev)
                cmps.append(wall)
                cpus.append(cpu)
                if args.fallback:
                    from precisiondiff.comparators import tiles_kernel
                    saved, tiles_kernel.AVAILABLE = tiles_kernel.AVAILABLE, False
                    try:
                        fbs.append(_timed(lambda: compare_tensors(a, e, **kw), dev)[0])
                    finally:
                        tiles_kernel.AVAILABLE = saved
            del src, dst, words
            t_copy, t_cmp = statistics.median(copies), statistics.median(cmps)
            c, m = pair / t_copy / 1e9, pair / t_cmp / 1e9
            rd = pair / statistics.median(reads) / 1e9
            extra = ""
            if args.fallback:
                t_fb = statistics.median(fbs)
                extra = f" {t_fb:11.2f} {t_fb / t_cmp:9.1f}"
            print(f"{name:>9} {str(edt)[6:]:>9} {s:>6} {c:10.2f} {m:13.3f} {m / c:7.4f} {t_cmp:10.3f} "
                  f"{t_cmp / t_copy:7.1f} {statistics.median(cpus) / n * 1e9:9.2f} {rd:9.2f} {m / rd:6.3f}"
                  + extra, flush=True)
            del a, e
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
