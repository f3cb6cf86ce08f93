"""A rank's op calls as its per-rank bisect replays them: collectives out, DTensor ops adapted.

Capture records an op on DTensors (``parallelize_module``, FSDP2) as the op the model called,
with each tensor's *local shard* and its placements (docs/distributed.md). The local op DTensor
then ran is that op on those shards, unless DTensor first redistributed an input, which capture
does not see. The redistributions that keep the local shapes are the ones replay could be fooled
by (the others give a shape mismatch, reported as not replayable):

* **Replicate -> Partial(sum)**: an op whose output is a partial sum and which takes a replicated
  tensor (the bias of a row-parallel ``addmm``) ran on that tensor divided by the mesh size
  (``Partial._partition_value``); the replay does the same division, in the tensor's dtype;
* **Partial inputs**: DTensor reduces them, or keeps them, as the op's sharding strategy says:
  not knowable from the dump, so such calls are left out and listed.

Calls on a mesh of more than one dimension with a partial placement are left out too.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ..store.reader import iter_index
from .collectives import is_collective_op
from .isolate import UnitEvent

__all__ = ["first_step_events", "placements_of", "prepare_events"]


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
    """seq -> slot -> (placements, mesh size) of every DTensor record of a rank's first step."""
    out: Dict[int, Dict[str, Tuple[List[str], int]]] = {}
    for ev in first_step_events(path):
        for t in ev.get("tensors") or ():
            if t.get("placements"):
                out.setdefault(int(ev["seq"]), {})[t["slot"]] = (list(t["placements"]), len(t.get("mesh") or ()))
    return out


def _divided(load: Callable[[str], torch.Tensor], slots: Dict[str, int]) -> Callable[[str], torch.Tensor]:
    def read(slot: str) -> torch.Tensor:
        t = load(slot)
        n = slots.get(slot)
        return t / n if n and t.is_floating_point() else t
    return read


def prepare_events(placements: Dict[int, Dict[str, Tuple[List[str], int]]],
                   left_out: List[Dict[str, Any]]) -> Callable[[List[UnitEvent]], List[UnitEvent]]:
    """The ``prepare`` hook of :func:`~precisiondiff.bisect.offline.bisect_dump` for one rank:
    collectives removed, DTensor op calls adapted or left out (appended to ``left_out`` with why)."""
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
            kept.append(ev)
        return kept
    return prepare
