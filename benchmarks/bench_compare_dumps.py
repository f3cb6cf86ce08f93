"""Benchmark: `compare` of two tensor dumps (bf16 DUT vs float64 reference, >= 1 GB together)
against a plain read of every tensor once, measured in the same run.

    python benchmarks/bench_compare_dumps.py [--dir runs/bench] [--gb 1.0] [--keep]

Prints: sizes, plain read time, compare time and their ratio (compare / read), the compare's
CPU time per element (all threads) and how much of it ``compare_tensors`` alone takes on the
same pairs already in memory (the rest is loading, alignment and bookkeeping), twice:
warm (every file in the page cache: the read is nearly a memory copy, the hardest baseline) and
cold (the dumps' pages dropped from the cache with posix_fadvise before each pass, as when
dumps copied from an accelerator machine are read for the first time).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from precisiondiff.comparators import compare_tensors
from precisiondiff.compare import compare
from precisiondiff.store import DumpWriter, load, tensor_key

NUMEL = 2 * 1024 * 1024  # elements per tensor: 4 MiB in bf16, 16 MiB in float64


def write(path: Path, dtype: torch.dtype, count: int, target: str) -> None:
    gen = torch.Generator().manual_seed(0)
    with DumpWriter(path, meta={"target": target, "level": "op", "mode": "tensors"}, overwrite=True) as w:
        for i in range(count):
            x = torch.randn(NUMEL, generator=gen, dtype=torch.float64)
            key = tensor_key(f"layers.{i}", "aten.mm.default", 0, "forward", "output.0")
            rec = {"key": key, "slot": "output.0", "dtype": str(dtype).rpartition(".")[2],
                   "shape": [NUMEL], "stats": {}, "data_key": key}
            w.write_event({"seq": i, "kind": "op", "scope": f"layers.{i}", "name": "aten.mm.default",
                           "direction": "forward", "call": 0, "device": "cpu", "tensors": [rec]},
                          {key: x.to(dtype)})


def read_all(*paths: Path) -> float:
    t0 = time.perf_counter()
    for p in paths:
        d = load(p)
        for rec in d.records():
            d.tensor(rec.key).sum()  # touch every byte once
        d.close()
    return time.perf_counter() - t0


def kernel_only(a: Path, b: Path) -> float:
    """Process CPU seconds of ``compare_tensors`` alone over the dumps' pairs (loaded first)."""
    da, db = load(a), load(b)
    pairs = [(da.tensor(r.key).clone(), db.tensor(r.key).clone()) for r in da.records()]
    da.close()
    db.close()
    c0 = time.process_time()
    for x, y in pairs:
        compare_tensors(x, y)
    return time.process_time() - c0


def drop_cache(*paths: Path) -> bool:
    """Evict the dumps' files from the page cache (POSIX_FADV_DONTNEED); False where unsupported."""
    import os
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        for f in p.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="runs/bench")
    ap.add_argument("--gb", type=float, default=1.0, help="total size of the two dumps")
    ap.add_argument("--keep", action="store_true", help="keep the dumps")
    args = ap.parse_args()
    root = Path(args.dir)
    count = max(1, int(args.gb * 1e9 / (NUMEL * (2 + 8)) + 0.999))
    a, b = root / "dut", root / "ref"
    t0 = time.perf_counter()
    write(a, torch.bfloat16, count, "cpu/bf16")
    write(b, torch.float64, count, "cpu/float64")
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"wrote {count} tensor pairs of {NUMEL} elements, {size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.1f} s")
    x = torch.randn(1 << 16, dtype=torch.float64)
    compare_tensors(x.to(torch.bfloat16), x)  # import numba and load the compiled kernels first
    for state in ("warm", "cold"):
        if state == "warm":
            read_all(a, b)  # warm the page cache
        elif not drop_cache(a, b):
            print("cold: posix_fadvise unavailable, skipped")
            break
        t_read = read_all(a, b)
        if state == "cold":
            drop_cache(a, b)
        t0, c0 = time.perf_counter(), time.process_time()
        c = compare(a, b)
        t_cmp, c_cmp = time.perf_counter() - t0, time.process_time() - c0
        print(f"{state}: plain read {t_read:.2f} s ({size / 1e9 / t_read:.2f} GB/s); compare {t_cmp:.2f} s "
              f"({size / 1e9 / t_cmp:.2f} GB/s, {c.summary['tensors']} pairs, {c.summary['failed']} failed); "
              f"compare / read = {t_cmp / t_read:.2f}; compare CPU {c_cmp / (count * NUMEL) * 1e9:.1f} ns "
              f"per element", flush=True)
    k = kernel_only(a, b)
    print(f"compare_tensors alone on the same pairs in memory: CPU {k / (count * NUMEL) * 1e9:.1f} ns per "
          f"element; load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
