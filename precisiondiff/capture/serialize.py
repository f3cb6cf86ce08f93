"""Safe, JSON-serializable form of an op's or module's arguments, enough to re-execute it.

Tensors become ``{"t": slot}`` references to tensors stored in the dump; dtypes, devices,
layouts, memory formats and non-finite floats get tagged forms; anything else is recorded as
``{"unsupported": repr}`` and makes the event non-replayable. Nothing here ever pickles.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Tuple

import torch

__all__ = ["encode_args", "decode_args", "is_replayable", "flatten_tensors"]

_TensorBase = torch._C.TensorBase
_SCALARS = (int, float, bool, str, type(None))
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo)}
_FORMATS = {str(v): v for v in (torch.contiguous_format, torch.channels_last,
                                 torch.preserve_format, torch.channels_last_3d)}


def flatten_tensors(value: Any) -> List[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts, in order."""
    if isinstance(value, _TensorBase):
        return [value]
    found: List[torch.Tensor] = []
    stack = [value]
    while stack:  # iterative: this runs for every op, recursion costs too much
        v = stack.pop()
        if isinstance(v, _TensorBase):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            if v and not isinstance(v[0], _SCALARS):
                stack.extend(reversed(v))
            elif any(not isinstance(x, _SCALARS) for x in v):
                stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return found


def encode_args(value: Any, slot_of: Callable[[torch.Tensor], str]) -> Any:
    """Encode ``value`` to JSON; ``slot_of(tensor)`` names the slot each tensor is stored in."""
    if isinstance(value, torch.Tensor):
        try:
            return {"t": slot_of(value)}
        except KeyError:  # not recorded (an overwritten destination): only its layout matters
            return {"like": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return encode_args(int(value) if isinstance(value, torch.SymInt) else float(value), slot_of)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_args(v, slot_of) for v in value]}
    if isinstance(value, list):
        return [encode_args(v, slot_of) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode_args(v, slot_of) for k, v in value.items()}}
    return {"unsupported": type(value).__name__}


def is_replayable(encoded: Any) -> bool:
    """False when any argument could not be encoded."""
    if isinstance(encoded, dict):
        if "unsupported" in encoded:
            return False
        return all(is_replayable(v) for v in encoded.values())
    if isinstance(encoded, list):
        return all(is_replayable(v) for v in encoded)
    return True


def decode_args(encoded: Any, tensor_of: Callable[[str], torch.Tensor], *,
                device: "str | None" = None,
                dtype_map: "Callable[[torch.dtype], torch.dtype] | None" = None) -> Any:
    """Rebuild arguments; ``device`` replaces recorded devices, ``dtype_map`` rewrites dtypes
    (bisect maps the DUT's low-precision dtype to the golden one)."""
    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "t" in v:
            return tensor_of(v["t"])
        if "f" in v:
            return float(v["f"])
        if "like" in v:
            dt = getattr(torch, v["like"]["dtype"])
            dt = dtype_map(dt) if dtype_map is not None and dt.is_floating_point else dt
            return torch.zeros(v["like"]["shape"], dtype=dt, device=device or "cpu")
        if "dtype" in v:
            dt = getattr(torch, v["dtype"])
            return dtype_map(dt) if dtype_map is not None else dt
        if "device" in v:
            return torch.device(device) if device is not None else torch.device(v["device"])
        if "layout" in v:
            return _LAYOUTS[v["layout"]]
        if "memory_format" in v:
            return _FORMATS[v["memory_format"]]
        if "tuple" in v:
            return tuple(dec(x) for x in v["tuple"])
        if "dict" in v:
            return {k: dec(x) for k, x in v["dict"].items()}
        raise ValueError(f"argument not replayable: {v}")

    return dec(encoded)


def split_args(encoded: Any) -> Tuple[Any, Any]:
    """``{"args": ..., "kwargs": ...}`` → (args, kwargs) helper for callers."""
    return encoded.get("args", []), encoded.get("kwargs", {})
