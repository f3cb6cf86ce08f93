"""Safe, JSON-serializable form of an op's or module's arguments, enough to re-execute it.

Tensors become ``{"t": slot}`` references to tensors stored in the dump; dtypes, devices,
layouts, memory formats and non-finite floats get tagged forms; anything else is recorded as
``{"unsupported": repr}`` and makes the event non-replayable. Nothing here ever pickles.

A tensor argument also carries the layout the call saw when it is not a plain contiguous tensor
of its own (``stride``, ``offset``: the storage offset in elements, and ``s``: the same number for
the arguments that were views of one storage). The dump stores every tensor contiguous; replay
re-creates that layout (:func:`decode_call`), because a kernel may take another path, and round
differently, for another layout (the portable bf16 GEMM does for a transposed weight).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["encode_args", "encode_call", "decode_args", "decode_call", "is_replayable", "flatten_tensors"]

_TensorBase = torch._C.TensorBase
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
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


class _Storages:
    """The storages of one call's tensor arguments, to mark the arguments that share one."""

    def __init__(self) -> None:
        self.entries: Dict[Any, List[Tuple[dict, torch.Tensor]]] = {}

    def note(self, entry: dict, t: torch.Tensor) -> None:
        if type(t) is not _Tensor and type(t) is not _Parameter:
            return  # a subclass (DTensor, fake): replayed from its local data, as recorded
        try:
            key = (t.device, t.untyped_storage().data_ptr(), t.dtype)
            if not t.is_contiguous():
                entry["stride"] = list(t.stride())
            if t.storage_offset():
                entry["offset"] = t.storage_offset()
        except (RuntimeError, NotImplementedError):  # no storage (meta, sparse, functional)
            return
        self.entries.setdefault(key, []).append((entry, t))

    def finish(self) -> None:
        """Number the storages that more than one argument views (``s``), in argument order."""
        shared = 0
        for group in self.entries.values():
            if len({id(t) for _, t in group}) < 2:
                continue
            for entry, t in group:
                entry["s"] = shared
                entry["stride"], entry["offset"] = list(t.stride()), t.storage_offset()
            shared += 1


def encode_call(args: Any, kwargs: Any, slot_of: Callable[[torch.Tensor], str]) -> dict:
    """``{"args", "kwargs", "replayable"}`` of one call, each tensor with its layout (module doc)."""
    storages = _Storages()
    encoded = {"args": encode_args(list(args), slot_of, storages),
               "kwargs": encode_args(dict(kwargs), slot_of, storages)}
    storages.finish()
    encoded["replayable"] = is_replayable(encoded)
    return encoded


def encode_args(value: Any, slot_of: Callable[[torch.Tensor], str], storages: "_Storages | None" = None) -> Any:
    """Encode ``value`` to JSON; ``slot_of(tensor)`` names the slot each tensor is stored in;
    with ``storages`` (:func:`encode_call`) each tensor's layout is noted too."""
    if isinstance(value, torch.Tensor):
        try:
            entry = {"t": slot_of(value)}
        except KeyError:  # not recorded (an overwritten destination): only its layout matters
            entry = {"like": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}}
            if storages is not None and not value.is_contiguous():
                entry["like"]["stride"] = list(value.stride())
            return entry
        if storages is not None:
            storages.note(entry, value)
        return entry
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return encode_args(int(value) if isinstance(value, torch.SymInt) else float(value), slot_of, storages)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_args(v, slot_of, storages) for v in value]}
    if isinstance(value, list):
        return [encode_args(v, slot_of, storages) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode_args(v, slot_of, storages) for k, v in value.items()}}
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


def decode_call(encoded: Any, tensor_of: Callable[[str], torch.Tensor], *,
                device: "str | None" = None,
                dtype_map: "Callable[[torch.dtype], torch.dtype] | None" = None) -> Tuple[Any, Any]:
    """``(args, kwargs)`` of a call encoded by :func:`encode_call`, each tensor argument in the
    layout the recorded call saw (a dump without layouts gives contiguous tensors, as recorded)."""
    layouts = _Layouts(tensor_of, [encoded.get("args", []), encoded.get("kwargs", {})])
    return (decode_args(encoded.get("args", []), tensor_of, device=device, dtype_map=dtype_map, layouts=layouts),
            decode_args(encoded.get("kwargs", {}), tensor_of, device=device, dtype_map=dtype_map, layouts=layouts))


def decode_args(encoded: Any, tensor_of: Callable[[str], torch.Tensor], *,
                device: "str | None" = None,
                dtype_map: "Callable[[torch.dtype], torch.dtype] | None" = None,
                layouts: "_Layouts | None" = None) -> Any:
    """Rebuild arguments; ``device`` replaces recorded devices, ``dtype_map`` rewrites dtypes
    (bisect maps the DUT's low-precision dtype to the golden one)."""
    layouts = layouts if layouts is not None else _Layouts(tensor_of, [encoded])

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "t" in v:
            return layouts.tensor(v)
        if "f" in v:
            return float(v["f"])
        if "like" in v:
            dt = getattr(torch, v["like"]["dtype"])
            dt = dtype_map(dt) if dtype_map is not None and dt.is_floating_point else dt
            shape = v["like"]["shape"]
            stride = v["like"].get("stride") or torch.empty(shape, device="meta").stride()
            return torch.empty_strided(shape, stride, dtype=dt, device=device or "cpu").zero_()
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


#: Storage offsets are kept modulo this many elements: the data's alignment, without the rest of
#: a storage the call never read (a flat parameter buffer, say).
_ALIGN = 64
#: Views of one storage are re-created in one buffer only when its span is at most this many times
#: their elements (plus _ALIGN): otherwise each gets its own (the aliasing is then not re-created).
_SPAN = 4


def _extent(shape: Any, stride: Any) -> int:
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride))


def _fill(view: torch.Tensor, value: torch.Tensor) -> bool:
    """Write ``value`` through ``view`` (a broadcast dimension once); False when the view's own
    elements overlap otherwise (such a layout is not re-created)."""
    index = tuple(slice(0, 1) if s == 0 and n > 1 else slice(None) for n, s in zip(view.shape, view.stride()))
    try:
        with torch.no_grad():
            view[index].copy_(value.detach()[index])
    except RuntimeError:
        return False
    return True


class _Layouts:
    """Re-creates the recorded layouts of one call's tensor arguments (``stride``, ``offset``,
    and one buffer for the arguments that viewed one storage, ``s``)."""

    def __init__(self, tensor_of: Callable[[str], torch.Tensor], encoded: List[Any]) -> None:
        self.tensor_of = tensor_of
        self.groups: Dict[int, List[dict]] = {}
        self.made: Dict[Tuple[Any, ...], torch.Tensor] = {}
        stack = list(encoded)
        while stack:
            v = stack.pop()
            if isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, dict):
                if "t" in v:
                    if "s" in v:
                        self.groups.setdefault(v["s"], []).append(v)
                else:
                    stack.extend(v.values())

    @staticmethod
    def _ident(entry: dict) -> Tuple[Any, ...]:
        return (entry["t"], tuple(entry.get("stride", ())), entry.get("offset", 0))

    def tensor(self, entry: dict) -> torch.Tensor:
        """The argument ``entry`` names, in its recorded layout."""
        value = self.tensor_of(entry["t"])
        if "stride" not in entry and "offset" not in entry:
            return value
        ident = self._ident(entry)
        if ident not in self.made:
            members = self.groups.get(entry["s"], [entry]) if "s" in entry else [entry]
            self._make(members)
        return self.made.get(ident, value)

    def _make(self, members: List[dict]) -> None:
        values = [self.tensor_of(m["t"]) for m in members]
        dtype, device = values[0].dtype, values[0].device
        strides = [m.get("stride") or list(v.stride()) for m, v in zip(members, values)]
        offsets = [m.get("offset", 0) for m in members]
        spans = [(o, o + _extent(v.shape, s)) for o, v, s in zip(offsets, values, strides)]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        shared = all(v.dtype == dtype and v.device == device for v in values) \
            and hi - lo <= _SPAN * sum(v.numel() for v in values) + _ALIGN
        if not shared and len(members) > 1:
            for m in members:
                self._make([{k: x for k, x in m.items() if k != "s"}])
            return
        base = lo - lo % _ALIGN
        buffer = torch.empty(max(hi - base, 1), dtype=dtype, device=device)
        for m, v, stride, offset in zip(members, values, strides, offsets):
            if v.numel() == 0 or len(stride) != v.dim():
                continue
            view = buffer.as_strided(v.shape, stride, offset - base)
            if not _fill(view, v):
                continue
            if v.requires_grad:
                view.requires_grad_(True)
            self.made[self._ident(m)] = view


def split_args(encoded: Any) -> Tuple[Any, Any]:
    """``{"args": ..., "kwargs": ...}`` → (args, kwargs) helper for callers."""
    return encoded.get("args", []), encoded.get("kwargs", {})
