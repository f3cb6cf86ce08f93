"""One-pass statistics and fingerprint of a CPU tensor, compiled with numba (optional).

:func:`fused_stats` reads each element once and returns what the eager path of
:mod:`precisiondiff.capture.stats` computes with about a dozen passes: ``min, max, sum,
sum |x|, sum x^2, NaN count, Inf count`` (float64 accumulation) and the two 64-bit words of
:mod:`precisiondiff.store.fingerprint` (exact: integer arithmetic modulo 2**64, the same
value in any order). Sums are accumulated in a different order from PyTorch's reductions,
so ``mean``, ``abs_mean`` and ``norm`` may differ from the eager path's in the last bits of
float64; minimum, maximum, counts and fingerprint are identical.

numba is an optional dependency (``pip install precisiondiff[fast]``): without it,
:data:`AVAILABLE` is False and the callers use the eager PyTorch path. Compiled code is
cached on disk (``cache=True``); four signatures are compiled, on first use.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import numpy as np
import torch

from ..store.fingerprint import PERIOD, salts

__all__ = ["AVAILABLE", "fused_stats", "stats_into", "supports"]

#: whether the fused kernel can be used (numba installed and not disabled by PRECISIONDIFF_NO_NUMBA)
AVAILABLE = importlib.util.find_spec("numba") is not None and not os.environ.get("PRECISIONDIFF_NO_NUMBA")
_jit = None


def _kernels():
    """The compiled kernels, imported on first use; None (and AVAILABLE False) when that fails."""
    global _jit, AVAILABLE
    if _jit is None and AVAILABLE:
        try:
            from . import _stats_jit
        except Exception:  # noqa: BLE001 - a broken numba install: the eager path
            AVAILABLE = False
            return None
        _jit = _stats_jit
    return _jit


_LUTS: dict = {}
_TABLE = salts("cpu").numpy()  # 1 ms (store.fingerprint builds it with NumPy)
assert _TABLE.shape[0] == PERIOD
_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def supports(t: torch.Tensor) -> bool:
    """Whether :func:`stats_into` handles ``t`` (a CPU float16/bfloat16/float32/float64 tensor)."""
    return AVAILABLE and t.dtype in _KINDS and t.device.type == "cpu"


def _lut(dtype: torch.dtype) -> np.ndarray:
    """float32 value of every 16-bit pattern of ``dtype``."""
    lut = _LUTS.get(dtype)
    if lut is None:
        codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        lut = _LUTS[dtype] = codes.view(dtype).to(torch.float32).numpy()
    return lut


def stats_into(t: torch.Tensor, out: np.ndarray, fps: np.ndarray, row: int) -> None:
    """Statistics and fingerprint of a CPU floating tensor in one pass over its memory.

    Writes ``out[row] = [min, max, sum, sum|x|, sum x^2, nan, inf]`` (float64; min and max
    ignore NaN: the caller applies NaN propagation) and ``fps[row, :2] = [h1, h2]`` (int64).

    Args:
        t: a tensor with :func:`supports` true and at least one element, any shape and strides
            (a non-contiguous tensor is copied once, in row-major order).
        out: float64 array of shape ``(rows, 7)``.
        fps: int64 array of shape ``(rows, 2)`` or more columns.
        row: the row to write.

    Raises:
        RuntimeError: PyTorch cannot expose the tensor's memory to NumPy (conjugate or
            negative views): use the eager path.
    """
    k = _kernels()
    if k is None:
        raise RuntimeError("numba is not available")
    if t.requires_grad:
        t = t.detach()
    dtype = t.dtype
    if dtype is torch.float32:
        k._stats_f32(_array(t), _TABLE, out, fps, row)
    elif dtype is torch.float64:
        k._stats_f64(_array(t), _TABLE, out, fps, row)
    else:
        k._stats_16(_array(t.view(torch.int16)), _lut(dtype), _TABLE, out, fps, row)


def _array(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat NumPy array, through DLPack: ``Tensor.numpy()`` would mark
    the storage non-resizable for good, which breaks FSDP2 freeing its unsharded parameters."""
    if t.is_neg() or t.is_conj():  # lazy views whose memory does not hold their values
        raise RuntimeError("a negative or conjugate view: its memory does not hold its values")
    try:
        return np.from_dlpack(t).ravel()
    except (BufferError, TypeError, ValueError) as err:
        raise RuntimeError(f"cannot expose the tensor to NumPy: {err}") from err


def fused_stats(t: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`stats_into` for one tensor: ``([min, max, sum, sum|x|, sum x^2, nan, inf],
    [h1, h2])`` with min and max as floats (NaN ignored).

    Example:
        >>> acc, fp = fused_stats(torch.tensor([1.0, -2.0]))  # doctest: +SKIP
        >>> acc[:3].tolist()  # doctest: +SKIP
        [-2.0, 1.0, -1.0]
    """
    out = np.zeros((1, 7))
    fps = np.zeros((1, 2), dtype=np.int64)
    stats_into(t, out, fps, 0)
    return out[0], fps[0]
