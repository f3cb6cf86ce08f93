"""The row of a DTensor shard of rank ``r`` against a single-process reference's global tensor
(the rules are in :mod:`.shards`): the gathered full tensor, the reassembled tensor on the
mesh's first rank, this rank's shard against the reference's slice, or combined statistics."""
from __future__ import annotations

from typing import Any, Optional

from .comparison import Row
from .judge import Judge, judge_row
from .shards import MemoryTensors, combine_stats, full_record, local_slice, reassemble, supported
from ..store.schema import TensorRecord

__all__ = ["shard_row"]


def _unmatched(row: Row, message: str) -> None:
    row.verdict, row.side, row.mode, row.message = "unmatched", "a", "shard", message


def shard_row(row: Row, da: Any, db: Any, ra: Any, rb: Any, judge: Judge, device: Optional[str]) -> None:
    """Fill ``row`` for A's shard record ``ra`` (rank ``judge.rank``) against B's record ``rb``."""
    layout, rank = judge.layout, judge.rank
    fields = layout.fields(rank, ra.key) if layout is not None else None
    row.bitwise = None
    if fields is None:
        same = layout.ambiguous(rank, ra.key) if layout is not None else None
        if same:
            return _unmatched(row, f"{ra.key}: shape {list(ra.shape)} on rank {rank}, {list(rb.shape)} in the "
                                   "single-process reference, no DTensor placements recorded, and its content is "
                                   f"that of DTensor shards of different layouts ({', '.join(same[:2])}): "
                                   "which one it is cannot be told; not compared")
        return _unmatched(row, f"{ra.key}: shape {list(ra.shape)} on rank {rank}, {list(rb.shape)} in the "
                               "single-process reference, and no DTensor placements recorded: not compared")
    where = f"{ra.key} ({' '.join(fields['placements'])} of {fields.get('global_shape')})"
    gathered = layout.gathered(rank, ra.key)
    if gathered is not None and tuple(gathered.shape) == tuple(rb.shape):
        row.shape = list(gathered.shape)
        judge_row(row, da, db, gathered, rb, judge, device)
        _note(row, "gathered full tensor: DTensor.full_tensor() at capture (gather_full)")
        return
    why = supported(fields)
    if why is not None:
        return _unmatched(row, f"{where}: {why}; not compared")
    if tuple(fields["global_shape"]) != tuple(rb.shape):
        return _unmatched(row, f"{where}: global shape {fields['global_shape']}, {list(rb.shape)} in the "
                               "reference: not compared")
    placements = fields["placements"]
    if fields.get("inferred_from"):
        _note(row, f"the local tensor of DTensor {fields['inferred_from']} (same content)")
    partial = any(p.startswith("P(") for p in placements)
    first = layout.first_rank(fields)
    shards, missing = layout.shards(ra.key, fields) if rank == first else ({}, None)
    if missing is not None:
        return _unmatched(row, f"{where}: {missing}; not reassembled")
    if ra.has_data and rb.has_data:
        if rank == first:
            if any(f.get("data_key") is None for f in shards.values()):
                return _unmatched(row, f"{where}: a rank stored no data for it; not reassembled")
            full = reassemble(fields, {r: layout.dump.ranks[r].tensor(ra.key) for r in shards})
            row.shape = list(full.shape)
            judge_row(row, MemoryTensors({ra.key: full}), db, full_record(ra.key, fields, data=True), rb,
                      judge, device)
            _note(row, f"reassembled from ranks {sorted(shards)} ({' '.join(placements)})")
            return
        if partial:
            return _unmatched(row, f"{where}: a partial sum; the reassembled tensor is compared on rank {first}")
        _, mesh_shape = layout.mesh(fields)
        part = local_slice(db.tensor(rb.key), placements, layout.coords(fields, rank), mesh_shape)
        ref = TensorRecord(key=rb.key, slot=rb.slot, dtype=rb.dtype, shape=tuple(part.shape), data_key=rb.key)
        judge_row(row, da, MemoryTensors({rb.key: part}), ra, ref, judge, device)
        _note(row, (f"shard against the reference's slice: this rank's part; the reassembled tensor is "
                    f"compared on rank {first}"))
        return
    if partial:
        return _unmatched(row, f"{where}: statistics of partial sums do not combine; capture with "
                               "gather_full or mode tensors to compare it")
    if rank != first:
        return _unmatched(row, f"{where}: its statistics are combined with the other shards' on rank {first}")
    parts = [(f["stats"] or {}, _numel(f["shape"])) for r, f in sorted(shards.items())
             if all(c == 0 for p, c in zip(placements, layout.coords(fields, r)) if p == "R")]
    stats = combine_stats([p for p, _ in parts], [n for _, n in parts])
    row.shape = list(fields["global_shape"])
    judge_row(row, da, db, full_record(ra.key, fields, stats=stats), rb, judge, device)
    _note(row, (f"statistics combined from ranks {sorted(shards)}: min, max, mean, mean |x|, "
                "norm, NaN/Inf counts (no fingerprint)"))


def _note(row: Row, note: str) -> None:
    row.note = f"{note}; {row.note}" if row.note else note  # the shard's story first (the report's label)


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
