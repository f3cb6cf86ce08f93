"""Global parameter statistics of a sharded job's watch log (FSDP2, tensor parallel).

Each rank of a job whose parameters are DTensors measures its own shard: the norm of the local
shard of the weight, its gradient and every optimizer state tensor (an optimizer keeps its state
in the parameter's layout, or as local shards). The header of such a log names each sharded
parameter's placements and mesh (``model.shards``). :func:`combine_ranks` turns the logs of every
rank into one log of the whole model:

- a norm of a ``S(d)`` parameter (sharded along one mesh dimension): ``sqrt(Σ_r n_r²)`` over the
  mesh's ranks (exact up to rounding: the shards partition the tensor);
- a ``R`` (replicated) parameter: the first rank's number;
- ``update_ratio`` (``‖Δw‖ / ‖w‖`` per shard): ``sqrt(Σ_r (ratio_r · ‖w_r‖)²) / sqrt(Σ_r ‖w_r‖²)``;
- the loss and the module statistics: the first rank's (each rank runs its own batch; a job fed
  the same batch on every rank has the single-process numbers there), with a note;
- a DeepSpeed ZeRO fragment (placements ``["ZeRO"]``, watch/zero.py: each rank logs the
  parameters it holds a piece of): ``sqrt(Σ n_r²)`` over the ranks whose logs have it, and the
  update ratio as for ``S(d)``;
- other placements (partial sums, 2-D meshes) are left out of the parameters, with a note.

The result has ``world_size`` 1 and the model signature of the ranks (names and global shapes),
so it compares with a single-process run of the same model (``compare`` does this when one side
has one rank and the other several).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from ..errors import PrecisionDiffError
from .log import WatchLog

__all__ = ["combine_ranks", "shard_fields"]


def shard_fields(param: Any) -> Optional[Dict[str, Any]]:
    """``{"placements", "mesh"}`` of a DTensor parameter (its local shard is what a rank
    measures), None for a plain tensor."""
    spec = getattr(param, "_spec", None)
    if spec is None or not hasattr(param, "_local_tensor"):
        return None
    return {"placements": [str(p) for p in spec.placements], "mesh": list(spec.mesh.mesh.flatten().tolist())}


def _kind(shard: Optional[Dict[str, Any]]) -> str:
    """"replicated", "sharded" (one mesh dimension, one S(d)), or why it does not combine."""
    if shard is None:
        return "replicated"
    placements = shard.get("placements", [])
    if placements == ["ZeRO"]:
        return "fragments"
    if all(p == "R" for p in placements):
        return "replicated"
    if len(placements) == 1 and placements[0].startswith("S("):
        return "sharded"
    return f"placements {placements} do not combine"


def _root_sum_squares(values: List[Any]) -> Optional[float]:
    if any(not isinstance(v, (int, float)) for v in values):
        return None
    return math.sqrt(sum(float(v) ** 2 for v in values))


def _union(ranks: List[int], by_step: Dict[int, Any], step: int) -> Dict[str, Dict[str, Any]]:
    """The parameters any rank logged at ``step`` (ZeRO: each rank logs those it holds), the
    first rank's fields where it has them."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in ranks:
        for name, fields in by_step[r][step].get("params", {}).items():
            out.setdefault(name, fields)
    return out


def _combine(per_rank: List[Dict[str, Any]], fields: Dict[str, Any]) -> Dict[str, Any]:
    """One parameter's norms over its shards (root sum of squares; the update ratio weighted)."""
    out: Dict[str, Any] = {}
    for what in fields:
        values = [p.get(what) for p in per_rank]
        if what == "update_ratio":
            weights = [p.get("weight") for p in per_rank]
            deltas = _root_sum_squares([v * w if isinstance(v, (int, float)) and isinstance(w, (int, float))
                                        else None for v, w in zip(values, weights)])
            whole = _root_sum_squares(weights)
            if deltas is not None and whole:
                out[what] = deltas / whole
            continue
        combined = _root_sum_squares(values)
        if combined is not None:
            out[what] = combined
    return out


def combine_ranks(logs: Dict[int, WatchLog]) -> WatchLog:
    """One log of the global statistics of a multi-rank watch (module docstring).

    Args:
        logs: ``{rank: WatchLog}`` of one job (:func:`precisiondiff.watch.log.read_logs`).

    Raises:
        PrecisionDiffError: the logs are of different models, or a rank's log is missing.
    """
    if not logs:
        raise PrecisionDiffError("no watch logs to combine")
    ranks = sorted(logs)
    first = logs[ranks[0]]
    for r in ranks[1:]:
        if logs[r].signature != first.signature:
            raise PrecisionDiffError(f"{logs[r].path} and {first.path} are watch logs of different models")
    shards = {r: logs[r].header.get("model", {}).get("shards", {}) for r in ranks}
    notes: List[str] = [f"combined from the logs of ranks {ranks}: parameter norms of sharded parameters "
                        "combine across their shards; the loss and module statistics are rank "
                        f"{ranks[0]}'s"]
    skipped: Dict[str, str] = {}
    by_step = {r: logs[r].by_step() for r in ranks}
    steps: List[Dict[str, Any]] = []
    for step in sorted(set.intersection(*(set(s) for s in by_step.values()))):
        base = by_step[ranks[0]][step]
        params: Dict[str, Dict[str, Any]] = {}
        for name, fields in _union(ranks, by_step, step).items():
            kind = _kind(next((shards[r][name] for r in ranks if name in shards[r]), None))
            if kind == "fragments":
                params[name] = _combine([by_step[r][step]["params"][name] for r in ranks
                                         if name in by_step[r][step].get("params", {})], fields)
                continue
            if kind == "replicated":
                params[name] = dict(fields)
                continue
            if kind != "sharded":
                skipped[name] = kind
                continue
            mesh = shards[ranks[0]][name].get("mesh", ranks)
            missing = [r for r in mesh if r not in by_step or step not in by_step[r]]
            if missing:
                skipped[name] = f"no log of its shard's rank(s) {missing}"
                continue
            per_rank = [by_step[r][step].get("params", {}).get(name, {}) for r in mesh]
            params[name] = _combine(per_rank, fields)
        steps.append({**base, "params": params})
    for name, why in sorted(skipped.items()):
        notes.append(f"{name}: not combined ({why})")
    header = {**first.header, "rank": 0, "world_size": 1, "combined_from": ranks}
    return WatchLog(path=first.path, header=header, steps=steps, notes=list(first.notes) + notes,
                    complete=all(logs[r].complete for r in ranks), torn_lines=sum(logs[r].torn_lines for r in ranks))
