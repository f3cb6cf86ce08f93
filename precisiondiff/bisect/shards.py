"""A rank's op calls as its per-rank bisect replays them: collectives out, DTensor ops adapted.

Capture records an op on DTensors (``parallelize_module``, FSDP2) as the op the model called,
with each tensor's *local shard* and its placements (docs/distributed.md). The local op DTensor
then ran is that op on those shards, unless DTensor first redistributed an input, which capture
does not see. The redistributions that keep the local shapes are the ones replay could be fooled
by (for the others, see below):

* **Replicate -> Partial(sum)**: an op whose output is a partial sum and which takes a replicated
  tensor (the bias of a row-parallel ``addmm``) ran on that tensor divided by the mesh size
  (``Partial._partition_value``); the replay does the same division, in the tensor's dtype;
* **Partial inputs**: DTensor reduces them, or keeps them, as the op's sharding strategy says:
  not knowable from the dump, so such calls are left out and listed.

Calls on a mesh of more than one dimension with a partial placement are left out too.

A redistribution that changes a local shape is **Replicate -> Shard(d)** of an input (a local
chunk, no communication): the recorded input is the whole tensor, the op ran on this rank's chunk
of it. For a pointwise op (``torch.Tag.pointwise``) with an ``S(d)`` output on a 1-D mesh that is
the only strategy DTensor has (an input must be sharded as the output is), so the replay takes
the same chunk (``torch.chunk`` at the rank's position in the mesh, the input's dimension aligned
with the output's by broadcasting) and the call is judged. Any other call with a replicated input
and a sharded output is run on meta tensors of the recorded shapes: if the shapes do not go
together (or give other output shapes than recorded), it is left out with that reason
(:data:`REDISTRIBUTED`), not handed to the replay (whose failure would read as an op missing
from this process).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..capture.serialize import decode_call, flatten_tensors
from ..store.reader import iter_index
from ..store.schema import dtype_from_name
from .collectives import is_collective_op
from .isolate import UnitEvent, Unreplayable, resolve_op

_SHARD = re.compile(r"^S\((\d+)\)$")

__all__ = ["first_step_events", "placements_of", "prepare_events", "REDISTRIBUTED"]

#: the reason given for a DTensor op call whose replay on the recorded shards fails
REDISTRIBUTED = ("an input was redistributed by DTensor before the op (a replicated input held whole beside "
                 "a sharded output): the recorded local shard shapes disagree with the op")


class Placed(tuple):
    """``(placements, mesh size)`` of a DTensor record, with its ``mesh`` ranks and ``global_shape``."""

    mesh: List[int]
    global_shape: List[int]

    def __new__(cls, placements: List[str], mesh: List[int], global_shape: List[int]) -> "Placed":
        self = super().__new__(cls, (placements, len(mesh)))
        self.mesh, self.global_shape = mesh, global_shape
        return self

    def __getnewargs__(self) -> tuple:
        return self[0], self.mesh, self.global_shape


def first_step_events(path: "str | Path") -> Iterator[Dict[str, Any]]:
    """The index records of a rank's dump up to the end of its first step (damaged lines skipped)."""
    first = None
    for _, ev, _ in iter_index(path, strict=False):
        if not ev:
            continue
        first = ev.get("step") if first is None else first
        if ev.get("step") != first:
            return
        yield ev


def placements_of(path: "str | Path") -> Dict[int, Dict[str, Tuple[List[str], int]]]:
    """seq -> slot -> (placements, mesh size) of every DTensor record of a rank's first step
    (a :class:`Placed`: also the mesh's ranks and the global shape)."""
    out: Dict[int, Dict[str, Tuple[List[str], int]]] = {}
    for ev in first_step_events(path):
        for t in ev.get("tensors") or ():
            if t.get("placements"):
                out.setdefault(int(ev["seq"]), {})[t["slot"]] = Placed(
                    list(t["placements"]), [int(r) for r in t.get("mesh") or ()],
                    [int(d) for d in t.get("global_shape") or ()])
    return out


def _is_pointwise(name: str) -> bool:
    try:
        op = resolve_op(name)
    except Unreplayable:
        return False
    return torch.Tag.pointwise in getattr(op, "tags", ())


def _chunks(ins: Dict[str, Tuple[List[str], int]], out: Tuple[List[str], int], slots: Dict[str, tuple],
            rank: Optional[int]) -> Optional[Dict[str, Tuple[int, int, int]]]:
    """slot -> (dim, chunks, index) for each replicated input DTensor cut to the sharded output's
    chunk (Replicate -> Shard(d)), {} when none is, None when this rank's chunk is not known."""
    m = _SHARD.match(out[0][0])
    global_shape = list(getattr(out, "global_shape", None) or ())
    mesh = list(getattr(out, "mesh", None) or ())
    if m is None or not global_shape:
        return {}
    d = int(m.group(1))
    cut: Dict[str, Tuple[int, int, int]] = {}
    for slot, (pl, n) in ins.items():
        shape = list((slots.get(slot) or (None, ()))[1] or ())
        if pl != ["R"] or n < 2:
            continue
        dim = d - (len(global_shape) - len(shape))
        if dim < 0 or shape[dim] == 1 or shape[dim] != global_shape[d]:
            continue  # broadcast along the sharded dimension, or not aligned with it: as it is
        if rank is None or rank not in mesh:
            return None
        cut[slot] = (dim, n, mesh.index(rank))
    return cut


def _chunk_len(size: int, n: int, i: int) -> int:
    """The length of ``torch.chunk(n)``'s chunk ``i`` of a dimension of ``size`` (0 past the last)."""
    step = -(-size // n)
    return max(0, min(step, size - i * step))


def _chunked(load: Callable[[str], torch.Tensor], cut: Dict[str, Tuple[int, int, int]]
             ) -> Callable[[str], torch.Tensor]:
    def read(slot: str) -> torch.Tensor:
        t = load(slot)
        if slot not in cut:
            return t
        dim, n, i = cut[slot]
        chunks = t.chunk(n, dim=dim)
        return chunks[i] if i < len(chunks) else t.narrow(dim, 0, 0)
    return read


def _shapes_agree(ev: UnitEvent) -> Optional[bool]:
    """Whether the op runs on tensors of the recorded local shapes and gives the recorded output
    shapes (on meta tensors: no data read); None when that cannot be told (no meta kernel...)."""
    if not ev.args or not ev.args.get("replayable", False):
        return None
    try:
        fn = resolve_op(ev.name)
    except Unreplayable:
        return None

    def meta(slot: str) -> torch.Tensor:
        dt, shape, _ = ev.slots[slot]
        return torch.empty(tuple(shape), dtype=dtype_from_name(dt), device="meta")
    try:
        args, kwargs = decode_call(ev.args, meta, device="meta")
    except Exception:  # noqa: BLE001 - an argument capture could not encode: the engine says so
        return None
    try:
        with torch.no_grad():
            out = flatten_tensors(fn(*args, **kwargs))
    except NotImplementedError:
        return None
    except Exception:  # noqa: BLE001 - the shapes do not go together
        return False
    recorded = [tuple(ev.slots[s][1]) for s in sorted((s for s in ev.slots if s.startswith("output.")),
                                                      key=lambda s: int(s.split(".")[1]))]
    return [tuple(t.shape) for t in out[:len(recorded)]] == recorded


def _redistributed(ins: Dict[str, Tuple[List[str], int]], outs: List[Tuple[List[str], int]],
                   slots: Dict[str, tuple]) -> bool:
    """A replicated input held whole next to a sharded output: DTensor may have cut it first."""
    sharded = any(any(x.startswith("S(") for x in pl) for pl, _ in outs)
    return sharded and any(pl == ["R"] and n > 1 and (slots.get(s) or (None, ()))[1] for s, (pl, n) in ins.items())


def _divided(load: Callable[[str], torch.Tensor], slots: Dict[str, int]) -> Callable[[str], torch.Tensor]:
    def read(slot: str) -> torch.Tensor:
        t = load(slot)
        n = slots.get(slot)
        return t / n if n and t.is_floating_point() else t
    return read


def prepare_events(placements: Dict[int, Dict[str, Tuple[List[str], int]]],
                   left_out: List[Dict[str, Any]], rank: Optional[int] = None
                   ) -> Callable[[List[UnitEvent]], List[UnitEvent]]:
    """The ``prepare`` hook of :func:`~precisiondiff.bisect.offline.bisect_dump` for one rank:
    collectives removed, DTensor op calls adapted or left out (appended to ``left_out`` with why).

    Args:
        rank: the rank whose dump this is (its chunk of a replicated input cut to a shard).
    """
    def prepare(events: List[UnitEvent]) -> List[UnitEvent]:
        kept: List[UnitEvent] = []
        for ev in events:
            if ev.kind == "op" and is_collective_op(ev.name):
                continue
            recs = placements.get(ev.seq) if ev.kind == "op" else None
            if not recs:
                kept.append(ev)
                continue
            ins = {s: p for s, p in recs.items() if s.startswith("input.")}
            outs = [p for s, p in recs.items() if s.startswith("output.")]
            partial_in = [s for s, (pl, _) in ins.items() if any(x.startswith("P") for x in pl)]
            multi = any(len(pl) > 1 for pl, _ in recs.values())
            partial_out = any(any(x.startswith("P") for x in pl) for pl, _ in outs)
            why = None
            if partial_in:
                why = f"a Partial input ({partial_in[0]}): DTensor's strategy for it is not recorded"
            elif multi and partial_out:
                why = "a partial placement on a mesh of more than one dimension"
            if why is not None:
                left_out.append({"scope": ev.scope, "name": ev.name, "direction": ev.direction, "call": ev.call,
                                 "reason": why})
                continue
            if partial_out and any(pl == ["P(sum)"] for pl, _ in outs):
                divide = {s: n for s, (pl, n) in ins.items() if pl == ["R"] and n > 1}
                if divide:
                    ev = dataclasses.replace(ev, load=_divided(ev.load, divide))
            elif _redistributed(ins, outs, ev.slots):
                cut = _chunks(ins, outs[0], ev.slots, rank) if (
                    not multi and len(outs) == 1 and _is_pointwise(ev.name)) else None
                if cut:
                    slots = dict(ev.slots)
                    for slot, (dim, n, i) in cut.items():
                        dt, shape, has = slots[slot]
                        shape = list(shape)
                        shape[dim] = _chunk_len(shape[dim], n, i)
                        slots[slot] = (dt, tuple(shape), has)
                    chunked = dataclasses.replace(ev, slots=slots, load=_chunked(ev.load, cut))
                    if _shapes_agree(chunked) is not False:
                        kept.append(chunked)
                        continue
                if _shapes_agree(ev) is False:
                    left_out.append({"scope": ev.scope, "name": ev.name, "direction": ev.direction, "call": ev.call,
                                     "reason": REDISTRIBUTED})
                    continue
            kept.append(ev)
        return kept
    return prepare
