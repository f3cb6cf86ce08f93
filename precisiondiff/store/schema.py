"""The dump format's names and records: file names, :class:`Event`, :class:`TensorRecord`.

A dump directory holds::

    meta.json                 format_version, format, complete, created, plus the capture's meta
    index.jsonl               one Event per line, in execution (seq) order
    shard-00000.safetensors   tensor data, named by data_key   (format "safetensors")
    data.h5                   tensor data, one dataset per data_key (format "h5")

See docs/dump-format.md for the full specification.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

__all__ = [
    "FORMAT_VERSION",
    "META",
    "INDEX",
    "H5_FILE",
    "SHARD_PREFIX",
    "SHARD_SUFFIX",
    "FORMATS",
    "shard_name",
    "is_shard_name",
    "TensorRecord",
    "Event",
    "tensor_key",
    "dtype_name",
    "dtype_from_name",
    "SUPPORTED_DTYPES",
    "canonical_event",
    "encode_line",
]

#: Version of the on-disk layout. Readers refuse a dump with a larger version.
FORMAT_VERSION = 1

META = "meta.json"
INDEX = "index.jsonl"
H5_FILE = "data.h5"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"
FORMATS = ("safetensors", "h5")


def shard_name(number: int) -> str:
    """Return the file name of shard ``number``: ``shard-00000.safetensors``.

    Example:
        >>> shard_name(3)
        'shard-00003.safetensors'
    """
    return f"{SHARD_PREFIX}{number:05d}{SHARD_SUFFIX}"


def is_shard_name(name: str) -> bool:
    """Return True when ``name`` is a final (not temporary) shard file name."""
    middle = name[len(SHARD_PREFIX):-len(SHARD_SUFFIX)]
    return (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)
            and middle.isdigit())


# dtypes a dump can hold: the set safetensors can store (the h5 backend stores the same set).
SUPPORTED_DTYPES: Tuple[torch.dtype, ...] = tuple(
    d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64,
        getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    ) if d is not None
)


def dtype_name(dtype: torch.dtype) -> str:
    """Return the dump's name of a torch dtype: the torch name without ``torch.``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).rpartition(".")[2]


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype named ``name`` (``"bfloat16"``, ``"float8_e4m3fn"``...).

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    dtype = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def tensor_key(scope: str, name: str, call: int, direction: str, slot: str,
               step: Optional[int] = None, multi_step: bool = False) -> str:
    """Build a tensor key: ``{scope}/{name}#{call}:{direction}:{slot}``.

    With ``multi_step`` (a dump holding several steps) the key is prefixed ``step{N}/``.

    Args:
        scope: module path, ``""`` for the root.
        name: op or module class name.
        call: n-th call of (scope, name, direction) in this step.
        direction: ``"forward"`` or ``"backward"``.
        slot: ``"input.0"``, ``"output.0"``, ``"param_grad.weight"``...
        step: the training step; required when ``multi_step``.
        multi_step: prefix the step.

    Returns:
        The key.

    Example:
        >>> tensor_key("blocks.0.attn", "aten.mm.default", 1, "forward", "output.0")
        'blocks.0.attn/aten.mm.default#1:forward:output.0'
    """
    key = f"{scope}/{name}#{call}:{direction}:{slot}"
    if multi_step:
        if step is None:
            raise ValueError("tensor_key: multi_step needs a step")
        key = f"step{step}/{key}"
    return key


def _jsonable(value: Any) -> Any:
    """Turn tensors and numpy scalars inside a JSON-ready structure into plain Python."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return value


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor of an event: its identity, statistics and where its data lives.

    Attributes:
        key: the tensor key (see :func:`tensor_key`).
        slot: ``"input.0"``, ``"output.0"``, ``"grad_input.0"``...
        dtype: torch dtype name without ``torch.``.
        shape: the shape.
        stats: statistics computed at capture (min, max, mean, ..., maybe ``fingerprint``).
        data_key: name of the stored data; equals ``key`` unless the record aliases a tensor
            stored earlier; ``None`` when no data was stored (stats mode).
        shard: the file holding ``data_key`` (``shard-00000.safetensors`` or ``data.h5``).
        held_dtype: the dtype whose values the device really held, where it differs from
            ``dtype`` (a float64 on a device that holds it as float32: torch_mlu); else None.
        int32_overflow: ``{"min", "max"}`` of an int64 on an accelerator whose values leave
            int32 (torch_mlu computes many int64 ops in int32, unchecked); else None.
    """

    key: str
    slot: str
    dtype: str
    shape: Tuple[int, ...]
    stats: Dict[str, Any] = dataclasses.field(default_factory=dict)
    data_key: Optional[str] = None
    shard: Optional[str] = None
    held_dtype: Optional[str] = None
    int32_overflow: Optional[Dict[str, Any]] = None

    @property
    def has_data(self) -> bool:
        """True when the tensor's values were stored."""
        return self.data_key is not None

    @property
    def is_alias(self) -> bool:
        """True when the record points at data stored under another key."""
        return self.data_key is not None and self.data_key != self.key

    def to_dict(self) -> Dict[str, Any]:
        """Return the JSON-ready dict of this record."""
        out = {"key": self.key, "slot": self.slot, "dtype": self.dtype,
               "shape": list(self.shape), "stats": dict(self.stats),
               "data_key": self.data_key, "shard": self.shard}
        if self.held_dtype is not None:
            out["held_dtype"] = self.held_dtype
        if self.int32_overflow is not None:
            out["int32_overflow"] = dict(self.int32_overflow)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> "TensorRecord":
        """Build a record from its JSON dict.

        Raises:
            KeyError, TypeError, ValueError: a required field is missing or malformed.
        """
        return cls(key=str(obj["key"]), slot=str(obj.get("slot", "")),
                   dtype=str(obj["dtype"]), shape=tuple(int(s) for s in obj["shape"]),
                   stats=dict(obj.get("stats") or {}), data_key=obj.get("data_key"),
                   shard=obj.get("shard"), held_dtype=obj.get("held_dtype"),
                   int32_overflow=obj.get("int32_overflow"))


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded call: a module or an op, forward or backward, with its tensors.

    Attributes:
        seq: global execution order within the rank.
        step: training step.
        rank: distributed rank.
        kind: ``"module"`` or ``"op"``.
        scope: module path, ``""`` for the root.
        name: op name (``"aten.addmm.default"``) or module class.
        direction: ``"forward"`` or ``"backward"``.
        call: n-th call of (scope, name, direction) in this step.
        device: the device it ran on (``"cuda:0"``).
        tensors: its tensor records.
        args: non-tensor arguments (replay mode), or None.
    """

    seq: int
    step: int
    rank: int
    kind: str
    scope: str
    name: str
    direction: str
    call: int
    device: str
    tensors: List[TensorRecord]
    args: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        """Return the JSON-ready dict of this event (one index line)."""
        return {"seq": self.seq, "step": self.step, "rank": self.rank, "kind": self.kind,
                "scope": self.scope, "name": self.name, "direction": self.direction,
                "call": self.call, "device": self.device,
                "tensors": [t.to_dict() for t in self.tensors], "args": self.args}

    def to_json(self) -> str:
        """Return the event as one compact JSON line (without the newline)."""
        return encode_line(self.to_dict())

    @classmethod
    def from_json(cls, obj: Union[str, bytes, Mapping[str, Any]]) -> "Event":
        """Build an event from an index line or its parsed dict.

        Raises:
            ValueError: the line is not valid JSON or lacks a required field.

        Example:
            >>> Event.from_json('{"seq":0,"kind":"op","scope":"","name":"aten.relu.default",'
            ...                 '"direction":"forward","call":0,"tensors":[]}').name
            'aten.relu.default'
        """
        if isinstance(obj, (str, bytes)):
            obj = json.loads(obj)
        if not isinstance(obj, Mapping):
            raise ValueError("an index line must be a JSON object")
        try:
            return cls(seq=int(obj["seq"]), step=int(obj.get("step") or 0),
                       rank=int(obj.get("rank") or 0), kind=str(obj["kind"]),
                       scope=str(obj.get("scope", "")), name=str(obj["name"]),
                       direction=str(obj["direction"]), call=int(obj.get("call") or 0),
                       device=str(obj.get("device") or ""),
                       tensors=[TensorRecord.from_dict(t) for t in obj.get("tensors") or []],
                       args=obj.get("args"))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed event: {err!r}") from err


_EVENT_FIELDS = ("seq", "step", "rank", "kind", "scope", "name", "direction", "call",
                 "device", "tensors", "args")
_RECORD_FIELDS = ("key", "slot", "dtype", "shape", "stats", "data_key", "shard")


def canonical_event(event: Mapping[str, Any]) -> Dict[str, Any]:
    """Order an event dict's fields canonically (extra fields kept, after the known ones)."""
    out = {f: event.get(f) for f in _EVENT_FIELDS}
    out.update({k: v for k, v in event.items() if k not in out})
    tensors = []
    for rec in event.get("tensors") or []:
        r = {f: rec.get(f) for f in _RECORD_FIELDS}
        r.update({k: v for k, v in rec.items() if k not in r})
        r["shape"] = list(r["shape"] or [])
        r["stats"] = r["stats"] or {}
        tensors.append(r)
    out["tensors"] = tensors
    return out


def encode_line(obj: Mapping[str, Any]) -> str:
    """Encode one index line: compact JSON; NaN/Inf stats are written as NaN/Infinity."""
    return json.dumps(_jsonable(obj), separators=(",", ":"), allow_nan=True)
