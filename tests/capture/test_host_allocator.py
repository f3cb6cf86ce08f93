"""Capture hands large freed host blocks back to the system (runtime/host_allocator.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Blocks of 8 MiB freed while small blocks made after each stay: from the heap, they would stay
# resident (glibc raised its mmap threshold past 8 MiB when the first one was freed).
SCRIPT = textwrap.dedent("""
    import ctypes, sys
    from precisiondiff.runtime.host_allocator import return_large_blocks
    if sys.argv[1] == "fixed" and not return_large_blocks():
        print("not set"); sys.exit(0)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    size = 8 << 20
    libc.free(libc.malloc(size))  # one large block freed: glibc's dynamic threshold rises past it
    big, small = [], []
    for _ in range(32):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        big.append(p)
        small.append(libc.malloc(64 << 10))
    before = rss()
    for p in big:
        libc.free(p)
    print(before - rss())
""")


def _freed_mib(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_large_blocks_freed_during_a_capture_leave_the_resident_set():
    """With the threshold fixed, 32 freed blocks of 8 MiB leave the resident set (256 MiB), whatever
    glibc's dynamic threshold would have done with them."""
    freed = _freed_mib("fixed")
    if freed == "not set":
        pytest.skip("no glibc mallopt here")
    assert int(freed) >= 200


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    from precisiondiff.runtime.host_allocator import return_large_blocks
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_large_blocks() is False
