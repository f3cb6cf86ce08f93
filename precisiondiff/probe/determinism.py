"""Run-to-run determinism and batch invariance, bitwise.

- **deterministic**: the same random input (64 rows; 1024 terms per row for summing kernels,
  256 for row-wise ones) run 5 times; any bit that differs between runs makes it ``False``.
- **batch invariant**: each row's result computed in the batch of 64 against the same row
  computed in batches of 1, 7 and 33 (the first rows of the batch); any bit that differs makes it
  ``False`` (a kernel that picks its reduction strategy from the batch size, as in the
  batch-variance nondeterminism of LLM inference).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .kernels import DOT_FAMILIES, Kernels, rows

__all__ = ["deterministic", "batch_invariant"]


def _inputs(k: Kernels, family: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    width = 1024 if family in DOT_FAMILIES else 256
    return torch.randn(64, width, generator=gen, dtype=torch.float64).to(k.dtype).to(torch.float64)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: bitwise equal (NaN equal to NaN)."""
    eq = (a == b) | (a.isnan() & b.isnan())
    eq &= torch.signbit(a) == torch.signbit(b)
    return eq.all(dim=-1)


def deterministic(k: Kernels, family: str, runs: int = 5, seed: int = 0) -> Tuple[bool, str]:
    """Whether repeated runs on the same input are bitwise identical."""
    x = _inputs(k, family, seed)
    first = rows(k, family, x)
    for run in range(1, runs):
        again = rows(k, family, x)
        same = _same(first, again)
        if not bool(same.all()):
            return False, f"run {run + 1} differs from run 1 in {int((~same).sum())} of {len(same)} rows"
    return True, f"{runs} runs bitwise identical ({x.shape[0]} rows of {x.shape[1]})"


def batch_invariant(k: Kernels, family: str, seed: int = 1) -> Tuple[bool, str]:
    """Whether a row's result is independent of the batch it is computed in."""
    x = _inputs(k, family, seed)
    full = rows(k, family, x)
    for size in (1, 7, 33):
        part = rows(k, family, x[:size])
        same = _same(part, full[:size])
        if not bool(same.all()):
            return False, (f"{int((~same).sum())} of the first {size} rows differ when computed in a "
                           f"batch of {size} instead of {x.shape[0]}")
    return True, f"rows bitwise equal in batches of 1, 7, 33 and {x.shape[0]}"
