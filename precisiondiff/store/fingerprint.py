"""A cheap, deterministic content fingerprint of a tensor, computable on the device.

The fingerprint reads a tensor's *bits* (never its values), so it is exact for every dtype,
including NaN payloads, -0.0 and the float8 types, and it is the same on every device and
for every reduction order: it only uses int64 arithmetic modulo 2**64, which is associative.

Element ``i`` (row-major) is written ``i = j * P + r`` with ``P = 65536``; ``b_i`` is its bit
pattern read as a signed integer of the element's width and sign-extended to int64 (a
bijection, like zero-extension); ``S[r]`` is a fixed table of odd 64-bit salts
(``splitmix64(r) | 1``)::

    y_i = (b_i + j * C1 + 1) * S[r]        (mod 2**64)
    h1  = sum_i y_i                        (mod 2**64)
    h2  = sum_i y_i * b_i                  (mod 2**64)

Changing any one element changes ``h1`` (``S[r]`` is odd, so ``delta_b * S[r]`` is never 0 mod
2**64); moving values between positions changes it with overwhelming probability (the salts
differ). The salt table is computed once per device, so a tensor of up to 65536 elements costs
five integer passes. Not cryptographic.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

__all__ = ["fingerprint_tensor", "fingerprint_hex", "fingerprint", "salts", "PERIOD"]

_MASK64 = (1 << 64) - 1
PERIOD = 1 << 16


def _signed(x: int) -> int:
    """Return the int64 with the same bits as the unsigned 64-bit ``x``."""
    return x - (1 << 64) if x >= (1 << 63) else x


_C1 = _signed(0x9E3779B97F4A7C15)  # golden ratio, odd: separates the periods j
_CHUNK = 1 << 24  # elements per pass (rounded to a multiple of PERIOD): bounds temporaries

# signed integer view of each element width
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_SALTS: Dict[torch.device, torch.Tensor] = {}


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _salt_table() -> torch.Tensor:
    """``splitmix64(r) | 1`` for every r, vectorized (NumPy uint64 arithmetic wraps modulo
    2**64, as the scalar :func:`_splitmix64` masks): 1000x faster than a Python loop."""
    import numpy as np

    z = np.arange(PERIOD, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
    return torch.from_numpy(z.view(np.int64).copy())


def salts(device: "torch.device | str" = "cpu") -> torch.Tensor:
    """The ``PERIOD`` odd int64 salts ``S[r] = splitmix64(r) | 1`` on ``device`` (cached)."""
    table = _SALTS.get(device)  # type: ignore[call-overload]
    if table is not None:
        return table
    device = torch.device(device)
    table = _SALTS.get(device)
    if table is None:
        cpu = _SALTS.get(torch.device("cpu"))
        if cpu is None:
            cpu = _salt_table()
            _SALTS[torch.device("cpu")] = cpu
        table = _SALTS[device] = cpu.to(device)
    return table


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The flat, sign-extended int64 bit patterns of ``t``'s elements (row-major)."""
    size = t.element_size()
    if size not in _BITS:
        raise TypeError(f"fingerprint: unsupported dtype {t.dtype} ({size}-byte elements)")
    flat = t.detach().reshape(-1)
    if flat.dtype != _BITS[size]:
        flat = flat.view(_BITS[size])
    return flat.to(torch.int64)


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
        >>> len(fingerprint_hex(fingerprint_tensor(torch.zeros(3)).tolist()))
        32
    """
    if t.element_size() not in _BITS:
        raise TypeError(f"fingerprint: unsupported dtype {t.dtype} ({t.element_size()}-byte elements)")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    table = salts(t.device)
    chunk = max(PERIOD, _CHUNK // PERIOD * PERIOD)
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, n, chunk):
        b = bits_of(flat[start:start + chunk])
        rows = -(-b.numel() // PERIOD)
        first = start // PERIOD
        # one row per period j: b + j*C1 + 1, times the salts, all rows at once
        offsets = torch.arange(first, first + rows, dtype=torch.int64, device=b.device) * _C1 + 1
        full = (b.numel() // PERIOD) * PERIOD
        if full:
            head = b[:full].view(-1, PERIOD)
            y = (head + offsets[: full // PERIOD, None]) * table
            total += torch.stack([y.sum(), (y * head).sum()])
        if full < b.numel():
            tail = b[full:]
            y = (tail + offsets[-1]) * table[: tail.numel()]
            total += torch.stack([y.sum(), (y * tail).sum()])
    return total


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
