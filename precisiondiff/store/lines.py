"""Index lines, fast: canonical order without copying and a compiled JSON encoder.

The dump writer's per-event work is putting an event into the canonical field order
(:func:`~precisiondiff.store.schema.canonical_event`) and encoding it as one JSON line
(:func:`~precisiondiff.store.schema.encode_line`). Both are general (any mapping, tensors and
NumPy scalars inside) and cost ~40 us per two-tensor event; the events a capture emits are
already plain dicts in canonical order. :func:`canonical_in_place` recognizes those and only
fills defaults; :func:`encode` uses ``orjson`` (``pip install precisiondiff[fast]``, ~15x
faster than the standard encoder on an index line) when the line holds no NaN or infinity
(orjson would write ``null``; the format writes ``NaN``/``Infinity``), else a reused standard
encoder. The bytes can differ from ``encode_line``'s in float spelling only (``1e-05`` against
``1e-5``): both are the shortest text that reads back as the same float.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional

import torch

from .schema import _EVENT_FIELDS, _RECORD_FIELDS, _jsonable, canonical_event, dtype_name

__all__ = ["canonical_in_place", "encode", "ORJSON"]

try:  # optional: the `fast` extra
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

ORJSON = _orjson is not None
_RECORD_GIVEN = _RECORD_FIELDS[:-1]  # what a capture's record holds before the writer adds "shard"
_PLAIN = (str, int, bool, type(None))


def _default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True, default=_default)


def canonical_in_place(event: Dict[str, Any], defaults: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """``event`` itself in canonical form when it already has the canonical fields in order
    (records without ``shard``, which is added as None); None when it needs the general path.

    ``defaults`` fills fields that are None (``seq``, ``step``, ``rank``...)."""
    if type(event) is not dict or tuple(event) != _EVENT_FIELDS:
        return None
    tensors = event["tensors"]
    if type(tensors) is not list:
        return None
    for rec in tensors:
        if type(rec) is not dict or tuple(rec) != _RECORD_GIVEN or type(rec["shape"]) is not list:
            return None
    for rec in tensors:
        rec["shard"] = None
        if rec["stats"] is None:
            rec["stats"] = {}
    for field, value in defaults.items():
        if event[field] is None:
            event[field] = value
    return event


def canonical(event: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """:func:`canonical_in_place` when it applies, else a canonical copy."""
    line = canonical_in_place(event, defaults) if type(event) is dict else None
    if line is None:
        line = canonical_event(event)
        for field, value in defaults.items():
            if line[field] is None:
                line[field] = value
    return line


def _finite(value: Any) -> bool:
    """No float NaN or infinity anywhere in ``value`` (and nothing orjson would refuse to see)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is float:
            if v - v:  # NaN - NaN and inf - inf are NaN; a finite float gives 0.0
                return False
        elif t is dict:
            stack.extend(v.values())
        elif t is list or t is tuple:
            stack.extend(v)
        elif t not in _PLAIN:
            return False  # tensors, numpy scalars, subclasses: the general encoder decides
    return True


def _finite_line(line: Dict[str, Any]) -> bool:
    for rec in line["tensors"]:
        for v in rec["stats"].values():
            t = type(v)
            if t is float:
                if v - v:
                    return False
            elif t is not int and t is not str and v is not None and not _finite(v):
                return False
        if len(rec) > len(_RECORD_FIELDS) and not _finite(
                [v for k, v in rec.items() if k not in _RECORD_FIELDS]):
            return False
    args = line["args"]
    if args is not None and not _finite(args):
        return False
    if len(line) > len(_EVENT_FIELDS):
        return _finite([v for k, v in line.items() if k not in _EVENT_FIELDS])
    return True


def encode(line: Dict[str, Any], use_orjson: bool = True) -> bytes:
    """One canonical index line as compact JSON bytes, without the newline."""
    if use_orjson and _orjson is not None and _finite_line(line):
        try:
            return _orjson.dumps(line)
        except TypeError:  # an int beyond 64 bits, a non-str key...
            pass
    try:
        return _ENCODER.encode(line).encode()
    except (TypeError, ValueError):  # non-str keys that json cannot coerce
        return json.dumps(_jsonable(line), separators=(",", ":"), allow_nan=True).encode()
