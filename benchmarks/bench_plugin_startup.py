"""Start-up cost of the pytest plugin on an unrelated suite, with and without it, side by side.

Usage: python benchmarks/bench_plugin_startup.py [--repeat 7]

Installing precisiondiff enables its pytest plugin (entry point ``pytest11``) in every pytest
run. An unrelated one-test suite (``def test_x(): assert 1``) is run in a temporary directory,
alternately with the plugin and with ``-p no:precisiondiff``; the table shows the median and
best wall time of each (whole ``python -m pytest`` process) and their ratio, and which heavy
modules the plugin's run had loaded. Both are timed in the same run, interleaved, so a busy
machine slows both alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = """
import sys

def test_x():
    assert 1

def test_zz_report_modules():
    heavy = [m for m in ("torch", "numpy", "click", "safetensors", "h5py", "rich") if m in sys.modules]
    print("HEAVY", ",".join(heavy) or "none")
"""


def _run(path: str, *args: str) -> "tuple[float, str]":
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args],
                         cwd=path, capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - t
    heavy = next((line.split("HEAVY ")[1].split()[0] for line in out.stdout.splitlines() if "HEAVY " in line), "?")
    return elapsed, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    times: dict = {"with plugin": [], "-p no:precisiondiff": []}
    heavy: dict = {}
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "test_unrelated.py"), "w") as fh:
            fh.write(SUITE)
        _run(path)  # warm the file system caches once
        for _ in range(args.repeat):
            for label, extra in (("with plugin", ()), ("-p no:precisiondiff", ("-p", "no:precisiondiff"))):
                elapsed, heavy[label] = _run(path, *extra)
                times[label].append(elapsed)
    base = statistics.median(times["-p no:precisiondiff"])
    print(f"{'pytest run':<22} {'median s':>9} {'best s':>8} {'ratio':>6}  heavy modules loaded")
    for label, values in times.items():
        med = statistics.median(values)
        print(f"{label:<22} {med:>9.3f} {min(values):>8.3f} {med / base:>6.2f}  {heavy[label]}")


if __name__ == "__main__":
    main()
