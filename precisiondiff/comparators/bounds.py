"""Bounds on whole tensors: the end-to-end bound (relative L2 in unit roundoffs) and the peer
ratio standard (Dynamo ``same()``)."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .overrides import dtype_of
from .ulp import ComparatorError, float_format

__all__ = ["END_TO_END_FACTOR", "end_to_end_bound", "peer_ratio_check", "PEER_FACTOR", "PEER_FACTOR_LOW",
           "PEER_FLOOR"]

#: Peer ratio standard (Dynamo ``same()``): factor 3 for 16-bit and fp8, 2 otherwise;
#: floor = Dynamo's tol / 10 with its default tol 1e-4.
PEER_FACTOR_LOW = 3.0
PEER_FACTOR = 2.0
PEER_FLOOR = 1e-5


#: End-to-end tensors (a model's outputs, gradients, any tensor compared across two whole runs)
#: carry every upstream rounding error, so per-element kernel budgets do not apply to them. They
#: are judged by their relative L2 error (mlu-ops diff2) against this many unit roundoffs of the
#: run's dtype: bf16 8 * 2**-8 = 0.031, fp16 0.0039, fp32 4.8e-7. Rounding errors of a correctly
#: computed network of moderate depth grow roughly like sqrt(depth) * u; 8u leaves room for a few
#: dozen layers while a kernel that loses a few bits shows up clearly.
END_TO_END_FACTOR = 8.0


def end_to_end_bound(dtype: torch.dtype) -> float:
    """Relative L2 error allowed for an end-to-end tensor of ``dtype``: ``END_TO_END_FACTOR * u``.

    Example:
        >>> end_to_end_bound(torch.bfloat16)
        0.03125
    """
    return END_TO_END_FACTOR * float_format(dtype).unit_roundoff


def peer_ratio_check(
    dut_error: float,
    peer_error: float,
    *,
    factor: Optional[float] = None,
    floor: float = PEER_FLOOR,
    dtype: Optional[Union[str, torch.dtype]] = None,
) -> bool:
    """Peer ratio standard: pass iff ``dut_error <= factor * peer_error + floor``.

    Both errors are measured against the same golden (e.g. RMSE vs float64), the peer being a
    trusted device running the DUT's dtype. Defaults follow Dynamo's ``same()``: factor 3.0
    for float16/bfloat16/float8, 2.0 otherwise; floor 1e-5 (its ``tol / 10``, tol = 1e-4).
    A NaN DUT error fails; a NaN peer error passes only a finite DUT error under ``floor``.

    Args:
        dut_error: Error of the device under test.
        peer_error: Error of the peer.
        factor: Allowed ratio; if None it comes from ``dtype``.
        floor: Absolute slack in the errors' unit.
        dtype: Result dtype, used for the default factor.

    Raises:
        ComparatorError: Neither ``factor`` nor ``dtype`` given, or a negative value.

    Example:
        >>> peer_ratio_check(2.5e-3, 1e-3, dtype="bfloat16")
        True
    """
    if factor is None:
        if dtype is None:
            raise ComparatorError("peer_ratio_check needs factor= or dtype= (for the default)")
        dt = dtype_of(dtype)
        factor = PEER_FACTOR if dt in (torch.float32, torch.float64) else PEER_FACTOR_LOW
    if factor < 0 or floor < 0:
        raise ComparatorError(f"factor and floor must be >= 0, got {factor}, {floor}")
    if math.isnan(dut_error):
        return False
    if math.isnan(peer_error):
        return dut_error <= floor
    return dut_error <= factor * peer_error + floor
