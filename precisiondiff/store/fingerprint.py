"""A cheap, deterministic content fingerprint of a tensor, computable on the device.

The fingerprint reads a tensor's *bits* (never its values), so it is exact for every dtype,
including NaN payloads, -0.0 and the float8 types, and it is the same on every device and
for every reduction order: it only uses int64 arithmetic modulo 2**64, which is associative.

For element ``i`` (in row-major order) with bit pattern ``b_i`` (zero-extended to int64)::

    x_i = mix(b_i XOR (i * C1))            mix(x) = y ^ (y >> 29), y = x * C2
    h1  = sum_i x_i                         (mod 2**64)
    h2  = sum_i x_i * (b_i | 1)             (mod 2**64)

Two tensors with equal dtype, shape and fingerprint hold the same bits with overwhelming
probability; the fingerprint is not cryptographic.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["fingerprint_tensor", "fingerprint_hex", "fingerprint"]

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """Return the int64 with the same bits as the unsigned 64-bit ``x``."""
    return x - (1 << 64) if x >= (1 << 63) else x


_C1 = _signed(0x9E3779B97F4A7C15)  # golden ratio, odd
_C2 = _signed(0xBF58476D1CE4E5B9)  # splitmix64 multiplier
_CHUNK = 1 << 24  # elements per pass: bounds the int64 temporaries to ~128 MiB each

# bit view of each element width, and the mask that zero-extends it to int64
_BITS = {1: (torch.uint8, None), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF),
         8: (torch.int64, None)}


def fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return the fingerprint of ``t`` as an int64 tensor of 2 elements on ``t``'s device.

    Nothing is copied to the host and nothing synchronizes: batch many fingerprints and read
    them back once, then format each with :func:`fingerprint_hex`.

    Args:
        t: any tensor of a dtype with 1, 2, 4 or 8 byte elements (bool and float8 included).

    Returns:
        ``tensor([h1, h2], dtype=torch.int64)`` (see the module docstring for the formula).

    Raises:
        TypeError: the element size is not 1, 2, 4 or 8 bytes (complex128).

    Example:
        >>> fingerprint_hex(fingerprint_tensor(torch.zeros(3)).tolist())[:8]
        '7ca3cab0'
    """
    size = t.element_size()
    if size not in _BITS:
        raise TypeError(f"fingerprint: unsupported dtype {t.dtype} ({size}-byte elements)")
    view_dtype, mask = _BITS[size]
    flat = t.detach().reshape(-1)
    if flat.dtype != view_dtype:
        flat = flat.view(view_dtype)
    n = flat.numel()
    parts = []
    for start in range(0, n, _CHUNK):
        b = flat[start:start + _CHUNK].to(torch.int64)
        if mask is not None:
            b = b & mask
        i = torch.arange(start, start + b.numel(), dtype=torch.int64, device=b.device)
        y = (b ^ (i * _C1)) * _C2
        x = y ^ (y >> 29)
        parts.append(torch.stack([x.sum(), (x * (b | 1)).sum()]))
    if not parts:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if len(parts) == 1:
        return parts[0]
    return torch.stack(parts).sum(dim=0)


def fingerprint_hex(t2: Sequence[int]) -> str:
    """Format a fingerprint (two int64 values, e.g. ``fingerprint_tensor(t).tolist()``).

    Returns:
        32 lowercase hex digits: ``h1`` then ``h2``, each as an unsigned 64-bit number.

    Example:
        >>> fingerprint_hex([1, -1])
        '0000000000000001ffffffffffffffff'
    """
    h1, h2 = (int(v) for v in t2)
    return f"{h1 & _MASK64:016x}{h2 & _MASK64:016x}"


def fingerprint(t: torch.Tensor) -> str:
    """Return the hex fingerprint of ``t`` (synchronizes: for one-off use and verification).

    Example:
        >>> fingerprint(torch.tensor([1.0])) == fingerprint(torch.tensor([1.0]))
        True
    """
    return fingerprint_hex(fingerprint_tensor(t).tolist())
