"""DTensor shards of a multi-rank job against a single-process reference.

Capture records a DTensor as its local shard with ``placements`` (``S(d)``, ``R``,
``P(sum)``...), ``global_shape``, ``mesh`` (the mesh's ranks, row-major) and ``mesh_shape``.
Against a reference that holds the global tensor, each such record of rank ``r`` is resolved so:

* a plain tensor with the content (fingerprint), dtype and shape of a shard recorded on the
  same rank is taken for that shard's local tensor (``to_local()``: a TP plan's
  ``use_local_output``, a backward's grad_output) and gets its placements (``inferred_from``);
* a full tensor gathered at capture (``gather_full``; a ``gathered`` event whose record names
  the shard in ``full_of``) is compared as it is, on every rank;
* tensors mode: the global tensor is **reassembled** from the shards of every rank of the mesh
  (``S(d)``: chunks concatenated in mesh order as ``torch.chunk`` cut them; ``R``: one copy;
  ``P(sum)``/``P(avg)``: summed (averaged) in float64, rounded to the dtype once) and compared
  on the mesh's first rank; every other rank compares its own shard with the reference's
  matching slice (so a kernel wrong on one rank shows on that rank), or, for partial sums
  (no slice of the reference matches one), says where the reassembled tensor was compared;
* stats mode: statistics of ``S(d)``/``R`` shards combine exactly up to rounding: min, max,
  NaN and Inf counts, mean and mean |x| (weighted by element counts), the L2 norm (from the sum
  of squared norms); the content fingerprint does not. Statistics of partial sums do not
  combine (the sum of the parts' minima is not the minimum of the sum): those rows stay
  unmatched, mode ``shard``, with the reason.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..store.schema import TensorRecord, dtype_from_name

__all__ = ["ShardLayout", "reassemble", "local_slice", "combine_stats", "is_sharded"]

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\((sum|avg)\)$")


def is_sharded(fields: Dict[str, Any]) -> bool:
    """Whether a record is a DTensor shard or partial sum (placements other than ``R``)."""
    placements = fields.get("placements")
    return bool(placements) and any(p not in ("R", "Replicate()") for p in placements)


def _mesh(fields: Dict[str, Any]) -> Tuple[List[int], Tuple[int, ...]]:
    mesh = [int(r) for r in fields.get("mesh") or ()]
    shape = tuple(int(s) for s in fields.get("mesh_shape") or (len(mesh),))
    return mesh, shape


def _coords(fields: Dict[str, Any], rank: int) -> Optional[Tuple[int, ...]]:
    mesh, shape = _mesh(fields)
    if rank not in mesh or math.prod(shape) != len(mesh):
        return None
    flat, coords = mesh.index(rank), []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def supported(fields: Dict[str, Any]) -> Optional[str]:
    """None when the placements can be reassembled here, else why not."""
    placements = fields.get("placements") or []
    _, shape = _mesh(fields)
    if len(placements) != len(shape) or not fields.get("global_shape"):
        return "its mesh or global shape was not recorded"
    for p in placements:
        if p != "R" and not _SHARD.match(p) and not _PARTIAL.match(p):
            return f"placement {p} is not reassembled (S(d), R, P(sum) and P(avg) are)"
    return None


def local_slice(full: torch.Tensor, placements: Sequence[str], coords: Sequence[int],
                mesh_shape: Sequence[int]) -> Optional[torch.Tensor]:
    """The part of the global tensor ``full`` the rank at mesh ``coords`` holds (a view), or
    None when a placement is a partial sum (no slice of the global tensor equals it)."""
    view = full
    for placement, c, n in zip(placements, coords, mesh_shape):
        m = _SHARD.match(placement)
        if m:
            chunks = view.chunk(n, dim=int(m.group(1)))
            # torch.chunk gives fewer chunks than ranks for a short dimension: this one is empty
            view = chunks[c] if c < len(chunks) else view.narrow(int(m.group(1)), 0, 0)
        elif placement != "R":
            return None
    return view


def reassemble(fields: Dict[str, Any], shards: Dict[int, torch.Tensor]) -> torch.Tensor:
    """The global tensor from every mesh rank's local shard (``shards[rank]``), in its dtype.

    Raises:
        KeyError: a rank of the mesh is missing from ``shards``.
    """
    placements = fields["placements"]
    mesh, mesh_shape = _mesh(fields)
    dtype = next(iter(shards.values())).dtype
    exact = dtype.is_floating_point or dtype.is_complex
    acc = torch.float64 if dtype.is_floating_point else (torch.complex128 if dtype.is_complex else dtype)
    full = torch.zeros(fields["global_shape"], dtype=acc)
    for rank in mesh:
        coords = _coords(fields, rank)
        if any(p == "R" and c != 0 for p, c, in zip(placements, coords)):
            continue  # a replica of what coordinate 0 holds
        region = full
        for placement, c, n in zip(placements, coords, mesh_shape):
            m = _SHARD.match(placement)
            if m:
                chunks = region.chunk(n, dim=int(m.group(1)))
                region = chunks[c] if c < len(chunks) else region.narrow(int(m.group(1)), 0, 0)
        local = shards[rank]
        if region.numel():
            region += local.to(acc).reshape(region.shape)
    for placement, n in zip(placements, mesh_shape):
        if placement == "P(avg)":
            full /= n
    return full.to(dtype) if exact else full


def combine_stats(parts: List[Dict[str, Any]], numels: List[int]) -> Dict[str, Any]:
    """Statistics of the concatenation of disjoint parts (``S(d)`` shards).

    min/max/NaN/Inf counts combine exactly; mean and mean |x| as element-weighted means; the
    norm as the root of the summed squared norms (exact up to rounding). No fingerprint."""
    def values(name: str) -> List[float]:
        return [float(p[name]) for p, n in zip(parts, numels) if n and p.get(name) is not None]
    total = sum(numels)
    out: Dict[str, Any] = {"nan": sum(int(p.get("nan") or 0) for p in parts),
                           "inf": sum(int(p.get("inf") or 0) for p in parts)}
    lows, highs = values("min"), values("max")
    out["min"] = min(lows) if lows else None
    out["max"] = max(highs) if highs else None
    for name in ("mean", "abs_mean"):
        weighted = [(float(p[name]), n) for p, n in zip(parts, numels) if n and p.get(name) is not None]
        out[name] = sum(v * n for v, n in weighted) / total if weighted and total else None
    norms = values("norm")
    out["norm"] = math.sqrt(sum(v * v for v in norms)) if norms else None
    return out


def _layout(rec: Dict[str, Any]) -> tuple:
    return (tuple(rec.get("placements") or ()), tuple(rec.get("global_shape") or ()), tuple(rec.get("mesh") or ()))


def _content(rec: Dict[str, Any]) -> Optional[tuple]:
    fingerprint = (rec.get("stats") or {}).get("fingerprint")
    if not fingerprint:
        return None
    return fingerprint, rec.get("dtype"), tuple(rec.get("shape") or ())


class ShardLayout:
    """The DTensor fields of a multi-rank dump A, read lazily per rank (``key -> fields``), and
    the full tensors gathered at capture (``full_of`` key -> record)."""

    def __init__(self, dump: Any) -> None:
        self.dump = dump
        self._fields: Dict[int, Dict[str, Dict[str, Any]]] = {}
        self._gathered: Dict[int, Dict[str, TensorRecord]] = {}
        self._ambiguous: Dict[int, Dict[str, List[str]]] = {}

    def _load(self, rank: int) -> None:
        from ..store.reader import iter_index
        fields: Dict[str, Dict[str, Any]] = {}
        gathered: Dict[str, TensorRecord] = {}
        sub = self.dump.ranks.get(rank)
        by_content: Dict[tuple, Dict[str, Any]] = {}
        conflicts: Dict[tuple, List[Dict[str, Any]]] = {}
        ambiguous: Dict[str, List[str]] = {}
        if sub is not None:
            for _, obj, _ in iter_index(sub.path, strict=False):
                records = (obj or {}).get("tensors") or ()
                if obj and obj.get("full_of") and records:  # a gathered event: one full tensor
                    gathered[obj["full_of"]] = sub.record(records[0]["key"])
                    continue
                for rec in records:
                    if rec.get("placements"):
                        fields[rec["key"]] = rec
                        content = _content(rec) if is_sharded(rec) else None
                        if content is not None:
                            first = by_content.setdefault(content, rec)
                            if _layout(first) != _layout(rec):
                                conflicts.setdefault(content, [first]).append(rec)
            if by_content:
                self._infer(sub, fields, by_content, conflicts, ambiguous)
        self._fields[rank], self._gathered[rank] = fields, gathered
        self._ambiguous[rank] = ambiguous

    @staticmethod
    def _infer(sub: Any, fields: Dict[str, Dict[str, Any]], by_content: Dict[tuple, Dict[str, Any]],
               conflicts: Dict[tuple, List[Dict[str, Any]]], ambiguous: Dict[str, List[str]]) -> None:
        """A plain tensor with the content, dtype and shape of a shard recorded on the same rank
        is that shard after ``to_local()`` (a TP plan's ``use_local_output``, a backward's
        grad_output): it takes the shard's placements, noted ``inferred_from``. When shards of
        different layouts (placements, global shape, mesh) have that content, which one it is
        cannot be told: it is not resolved (``ambiguous``: key -> those shards' keys)."""
        from ..store.reader import iter_index
        for _, obj, _ in iter_index(sub.path, strict=False):
            for rec in (obj or {}).get("tensors") or ():
                content = _content(rec) if not rec.get("placements") else None
                if content in conflicts:
                    ambiguous[rec["key"]] = [r["key"] for r in conflicts[content]]
                    continue
                shard = by_content.get(content) if content is not None else None
                if shard is not None and rec["key"] not in fields:
                    fields[rec["key"]] = {**rec, "inferred_from": shard["key"],
                                          **{k: shard[k] for k in ("placements", "global_shape", "mesh",
                                                                   "mesh_shape") if k in shard}}

    def fields(self, rank: int, key: str) -> Optional[Dict[str, Any]]:
        """The raw record of ``key`` on ``rank`` when it is a DTensor, else None."""
        if rank not in self._fields:
            self._load(rank)
        return self._fields[rank].get(key)

    def ambiguous(self, rank: int, key: str) -> Optional[List[str]]:
        """The keys of the shards of different layouts whose content plain tensor ``key`` has, if any."""
        if rank not in self._fields:
            self._load(rank)
        return self._ambiguous[rank].get(key)

    def sharded_keys(self, rank: int) -> set:
        """Keys of ``rank`` that hold a shard or partial sum."""
        if rank not in self._fields:
            self._load(rank)
        return {k for k, f in self._fields[rank].items() if is_sharded(f)}

    def gathered(self, rank: int, key: str) -> Optional[TensorRecord]:
        """The full tensor gathered at capture for shard ``key`` of ``rank``, if any."""
        if rank not in self._gathered:
            self._load(rank)
        return self._gathered[rank].get(key)

    def first_rank(self, fields: Dict[str, Any]) -> int:
        """The rank whose row compares the reassembled tensor: the mesh's first rank in A."""
        mesh, _ = _mesh(fields)
        present = [r for r in mesh if r in self.dump.ranks]
        return min(present) if present else -1

    def shards(self, key: str, fields: Dict[str, Any]) -> Tuple[Dict[int, Any], Optional[str]]:
        """Every mesh rank's fields of ``key``, or why one is missing."""
        mesh, _ = _mesh(fields)
        out = {}
        for rank in mesh:
            f = self.fields(rank, key)
            if f is None:
                return out, f"rank {rank} of its mesh has no record {key}"
            out[rank] = f
        return out, None

    def coords(self, fields: Dict[str, Any], rank: int) -> Optional[Tuple[int, ...]]:
        """``rank``'s coordinates in the record's mesh."""
        return _coords(fields, rank)

    def mesh(self, fields: Dict[str, Any]) -> Tuple[List[int], Tuple[int, ...]]:
        """The record's mesh ranks and mesh shape (1-D when the shape was not recorded)."""
        return _mesh(fields)


class MemoryTensors:
    """Stands in for a dump in the judges: ``tensor(key)`` returns the tensor held here."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def full_record(key: str, fields: Dict[str, Any], *, stats: Optional[Dict[str, Any]] = None,
                data: bool = False) -> TensorRecord:
    """A record of the global tensor (reassembled or combined) for the judges."""
    return TensorRecord(key=key, slot=str(fields.get("slot", "")), dtype=str(fields["dtype"]),
                        shape=tuple(int(s) for s in fields["global_shape"]), stats=dict(stats or {}),
                        data_key=key if data else None)


def dtype_of(fields: Dict[str, Any]) -> torch.dtype:
    return dtype_from_name(str(fields["dtype"]))
