"""Tensor ↔ HDF5 conversion for the ``h5`` dump format.

numpy has no bfloat16 or float8 types, so those tensors are stored as their raw bits
(bfloat16 as int16, float8 as uint8); every dataset carries an attribute ``dtype`` with the
torch dtype name, from which :func:`from_numpy` rebuilds the tensor bit for bit.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np
import torch

from .schema import dtype_from_name, dtype_name

__all__ = ["to_numpy", "from_numpy"]

# torch dtypes numpy cannot represent, stored as a same-width integer view
_RAW_VIEW = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _RAW_VIEW[getattr(torch, _name)] = torch.uint8


def to_numpy(t: torch.Tensor) -> Tuple[np.ndarray, str]:
    """Return (array to store, torch dtype name) for a CPU tensor.

    Example:
        >>> to_numpy(torch.ones(2, dtype=torch.bfloat16))[0].dtype
        dtype('int16')
    """
    t = t.detach().cpu().contiguous()
    name = dtype_name(t.dtype)
    raw = _RAW_VIEW.get(t.dtype)
    if raw is not None:
        t = t.view(raw)
    return t.numpy(), name


def from_numpy(array: Any, dtype: str) -> torch.Tensor:
    """Rebuild a tensor from a stored array and its ``dtype`` attribute.

    Raises:
        ValueError: the array's width does not match ``dtype``.

    Example:
        >>> a, d = to_numpy(torch.tensor([1.5], dtype=torch.bfloat16))
        >>> from_numpy(a, d).dtype
        torch.bfloat16
    """
    target = dtype_from_name(dtype)
    array = np.asarray(array)  # keeps 0-d arrays 0-d (np.ascontiguousarray would not)
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = array.copy()
    t = torch.from_numpy(array)
    if t.dtype != target:
        if t.element_size() != torch.empty((), dtype=target).element_size():
            raise ValueError(f"stored {t.dtype} data cannot hold {dtype}")
        t = t.view(target)
    return t
