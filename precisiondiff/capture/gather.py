"""Full tensors of DTensors, gathered only when asked (``capture(..., gather_full=True)``,
``precisiondiff capture --gather-full [REGEX]``).

Capture measures a DTensor on its local shard. With ``gather_full`` it also records the global
tensor (``DTensor.full_tensor()``: an all-gather for ``S(d)``, an all-reduce for ``P(...)``).
Those are collectives, which every rank of the mesh must issue in the same order, so they are
not issued where the DTensor is met (ranks may disagree there: a ``--ranks`` selection, a
capture error on one rank, de-duplication) but at the end of each step (``cap.step()``, and
when capture closes normally), in three moves:

1. where met: a copy of the local shard (its value now: parameters and gradients change later)
   with its mesh and placements, under the record's key, when the key matches the regex;
2. at the step's end, on every rank whatever happened (an empty list when nothing was noted):
   ``all_gather_object`` of the noted ``(key, mesh ranks)``;
3. the keys every rank of their mesh noted, in sorted key order, rebuilt with
   ``DTensor.from_local`` and gathered with ``full_tensor()``; recorded as an event of kind
   ``gathered`` (the shard's scope, name, direction and call; slot ``SLOT.full``; ``full_of``:
   the shard's key; placements ``R``). A key some rank lacks is not gathered anywhere.

Agreement and gathers run on the job's groups with capture paused. A rank that died leaves the
others in step 2 until the process group's timeout (torchrun stops them first); a rank whose
workload raised skips the closing exchange. Host memory: the noted local shards of one step.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

__all__ = ["FullGather"]


class _Noted:
    __slots__ = ("key", "scope", "name", "direction", "call", "slot", "local", "spec", "shape", "stride", "mesh")

    def __init__(self, **fields: Any) -> None:
        for k, v in fields.items():
            setattr(self, k, v)


class FullGather:
    """The DTensors to gather at the end of the step (see the module docstring).

    Args:
        pattern: ``True`` for every DTensor, or a regex searched in the record key
            (``0/Linear#0:forward:output.0``) selecting them.
    """

    def __init__(self, pattern: "bool | str") -> None:
        from .filters import compile_regex
        self.regex = None if pattern is True else compile_regex(str(pattern), "--gather-full")
        self._noted: List[_Noted] = []
        self.gathered = 0

    def note(self, key: str, event: Any, slot: str, dtensor: Any, local: torch.Tensor) -> None:
        """Remember a DTensor met under ``key`` (a copy of its local shard, taken now)."""
        if self.regex is not None and self.regex.search(key) is None:
            return
        spec = dtensor._spec
        if all(str(p) == "R" for p in spec.placements):  # already whole on every rank
            return
        self._noted.append(_Noted(key=key, scope=event.scope, name=event.name, direction=event.direction,
                                  call=event.call, slot=slot, local=local.detach().clone(), spec=spec,
                                  shape=tuple(dtensor.shape), stride=tuple(dtensor.stride()),
                                  mesh=tuple(spec.mesh.mesh.flatten().tolist())))

    def exchange(self, recorder: Optional[Any]) -> None:
        """Steps 2 and 3 on every rank (``recorder`` None: this rank records nothing, but agrees)."""
        noted, self._noted = self._noted, []
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = [(n.key, n.mesh) for n in noted] if recorder is not None else []
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        held = [{_as_pair(item) for item in part or ()} for part in everyone]
        agreed = sorted({(k, m) for part in held for k, m in part
                         if all((k, m) in held[r] for r in m if r < len(held))})
        by_key = {n.key: n for n in noted}
        from torch.distributed.tensor import DTensor
        for key, _ in agreed:
            n = by_key.get(key)
            if n is None:  # another mesh's tensor
                continue
            full = DTensor.from_local(n.local, n.spec.mesh, n.spec.placements, run_check=False,
                                      shape=torch.Size(n.shape), stride=n.stride).full_tensor()
            if recorder is not None:
                self._record(recorder, n, full)

    def _record(self, recorder: Any, n: _Noted, full: torch.Tensor) -> None:
        event = recorder.begin("gathered", n.scope, n.name, n.direction)
        event.call = n.call
        event.extra = {"full_of": n.key, "mesh": list(n.mesh)}
        recorder.add(event, f"{n.slot}.full", full, fresh=True)
        recorder.finish(event)
        self.gathered += 1


def _as_pair(item: Any) -> Tuple[str, Tuple[int, ...]]:
    key, mesh = item
    return str(key), tuple(int(r) for r in mesh)


def wanted(pattern: Any) -> bool:
    """Whether a ``gather_full`` argument asks for anything."""
    return pattern is True or (isinstance(pattern, str) and bool(pattern))

