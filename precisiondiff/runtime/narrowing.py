"""What a device really holds: silent 64 -> 32-bit conversions, found by probing.

torch_mlu converts float64 tensors to float32 when they are copied to the MLU (one
``TORCH_WARN_ONCE``, "MLU operators don't support 64-bit calculation"), and computes many ops
on int64 tensors in int32 without an overflow check (docs/mlu.md, "Silent conversions"). A
``mlu/float64`` target therefore runs in float32. Nothing here trusts a device's name: a float64
tensor whose values float32 cannot hold is copied to the device, and created on it, and read
back; what comes back says what the device holds.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch

__all__ = ["held_dtype", "forget_probes", "INT32_MIN", "INT32_MAX", "beyond_int32"]

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1

# device string -> what its float64 tensors hold (probed once per process)
_HELD: Dict[str, torch.dtype] = {}
# 1 + 2^-40 rounds to 1 in float32; 1e-300 underflows to 0
_PROBE = (1.0 + 2.0 ** -40, 1e-300, -3.0)


def held_dtype(device: "str | torch.device", dtype: torch.dtype = torch.float64) -> torch.dtype:
    """The dtype whose values a ``dtype`` tensor on ``device`` really holds.

    For float64 on a device other than the CPU: a float64 tensor is copied to the device and one
    is created there (``torch.full``); either read back rounded to float32 means float32. The
    result is cached per device; the probe's own warning (torch_mlu's) is swallowed. Any other
    dtype is returned as it is.

    Example:
        >>> held_dtype("cpu")
        torch.float64
    """
    dev = str(device)
    if dtype != torch.float64 or dev.startswith("cpu") or dev == "meta":
        return dtype
    found = _HELD.get(dev)
    if found is None:
        found = _HELD[dev] = _probe(dev)
    return found


def forget_probes() -> None:
    """Probe again on next use (a device whose conversions were switched: the test stand-in)."""
    _HELD.clear()


def _probe(device: str) -> torch.dtype:
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():  # a capture running: the probe is not the user's work
        return _probe_unobserved(device)


def _probe_unobserved(device: str) -> torch.dtype:
    host = torch.tensor(_PROBE, dtype=torch.float64)
    narrowed = host.to(torch.float32).to(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copied = host.to(device)
        created = torch.full((1,), _PROBE[0], dtype=torch.float64, device=device)
        back, made = copied.cpu(), created.cpu()
    if copied.dtype != torch.float64:
        return copied.dtype
    if torch.equal(back, narrowed) or made.item() == narrowed[0].item():
        return torch.float32
    return torch.float64


def beyond_int32(stats: Optional[dict]) -> bool:
    """Whether an integer tensor's statistics (min, max) leave the int32 range.

    On an accelerator the statistics are float32, exact for integers up to 2^24: a value within
    128 of 2^31 - 1 can read as 2^31 and be reported (never the reverse)."""
    if not stats:
        return False
    lo, hi = stats.get("min"), stats.get("max")
    return (isinstance(hi, (int, float)) and hi > INT32_MAX) or (isinstance(lo, (int, float)) and lo < INT32_MIN)
