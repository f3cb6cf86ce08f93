"""Large host blocks handed back to the system when freed (glibc).

glibc serves an allocation from its own mapping (returned to the system on ``free``) only above
its mmap threshold, and it raises that threshold, up to 32 MiB, each time such a block is freed.
After the first few freed tensors of a step, every tensor copy up to 32 MiB (a 2048 x 5632 bf16
weight is 22 MiB) comes from the heap instead, and freed heap memory below its top stays
resident. A capture makes and frees such copies all step long (its bounded queue, the observer
check's copy of the model, statistics' temporaries): at 1.12 B parameters that retention was
~2.5 GiB of its peak (docs/performance.md, "Scale"). A fixed threshold stops the raising.
"""
from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["return_large_blocks", "LARGE_BLOCK_BYTES"]

#: Allocations of at least this many bytes get their own mapping (what MALLOC_MMAP_THRESHOLD_ sets).
LARGE_BLOCK_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process, so that freed blocks of
    that size or more go back to the system. A no-op (False) off Linux, without glibc's
    ``mallopt``, or when the user set ``MALLOC_MMAP_THRESHOLD_`` themselves; True when set."""
    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
