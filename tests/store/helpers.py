"""Helpers shared by the store tests: build events the way the capture does."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from precisiondiff.store import tensor_key
from precisiondiff.store.schema import dtype_name


def record(key: str, t: torch.Tensor, *, slot: str = "output.0", data_key: Optional[str] = "",
           stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A JSON-ready tensor record; data_key defaults to the key (None: stats mode)."""
    return {"key": key, "slot": slot, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "stats": stats or {}, "data_key": key if data_key == "" else data_key}


def op_event(seq: int, tensors: List[Tuple[str, torch.Tensor]], *, scope: str = "blocks.0",
             name: str = "aten.mm.default", step: int = 0, stats_mode: bool = False,
             kind: str = "op") -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """An event with one record per (slot, tensor); returns (event, data)."""
    recs, data = [], {}
    for slot, t in tensors:
        key = tensor_key(scope, name, seq, "forward", slot)
        recs.append(record(key, t, slot=slot, data_key=None if stats_mode else ""))
        if not stats_mode:
            data[key] = t
    event = {"seq": seq, "step": step, "rank": 0, "kind": kind, "scope": scope, "name": name,
             "direction": "forward", "call": seq, "device": "cpu", "tensors": recs, "args": None}
    return event, data


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as an integer tensor (NaN-safe equality)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view) if t.dim() else t.reshape(1).view(view)


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    assert torch.equal(bits(got), bits(want))
