"""One job's per-rank watch logs as one log of global statistics, so runs on different rank counts
or parallel layouts compare (``compare`` does it when the two sides' layouts differ).

Per step, for each quantity every rank holds:

- a tensor whose fingerprints are equal on every rank is replicated (a data-parallel replica, a
  tensor-parallel layer's all-reduced output): its statistics are one rank's;
- otherwise it is sharded (data parallelism splits the batch, FSDP and tensor parallelism split
  weights): min and max are the ranks' extremes, NaN/Inf counts and element counts add up, the
  L2 norm is the square root of the sum of the ranks' squared norms, the mean and the abs-mean
  are the ranks' weighted by their element counts; the fingerprint is the ranks' together;
- a parameter's norm (weight, grad, ``state.*``) equal on every rank is replicated; otherwise
  the square root of the sum of squares; ``update_ratio`` is recombined from each rank's
  ‖Δw‖ = ratio·‖w‖ and the global ‖w‖; a parameter only some ranks log (DeepSpeed ZeRO: each
  rank logs those it holds a fragment of, marked ``ZeRO`` in the header's ``model.shards``,
  watch/zero.py) combines over those ranks, and a ZeRO fragment is never taken as replicated;
- the loss is the ranks' mean (each rank's loss is a mean over its equal share of the batch);
- when the ranks' losses differ (data parallelism: R ranks see different data), each rank's
  activation gradients are those of its own mean loss, R times its share of the global mean's
  (the reason DDP averages parameter gradients by R): a sharded ``grad_*`` tensor's min, max,
  mean, abs-mean and norm are divided by R, the number of distinct losses.

The model's identity is then its parameters' names (their local shapes are per shard).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, List, Optional

from .log import FIELDS, WatchLog

__all__ = ["global_log", "names_signature"]

_I = {name: i for i, name in enumerate(FIELDS)}


def names_signature(header: Dict[str, Any]) -> str:
    """The identity of a log's model by its parameters' names only (shards have other shapes)."""
    names = sorted(p[0] for p in header.get("model", {}).get("params", []))
    return "names:" + hashlib.sha1(repr(names).encode()).hexdigest()[:16]


def _weighted(values: List[Optional[float]], weights: List[float]) -> Optional[float]:
    if any(v is None for v in values):
        return None
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else None


def _combine_tensor(stats: List[List[Any]], scale: float = 1.0) -> List[Any]:
    first = stats[0]
    if all(s[_I["fingerprint"]] == first[_I["fingerprint"]] for s in stats):
        return list(first)
    counts = [s[_I["numel"]] if len(s) > _I["numel"] and s[_I["numel"]] is not None else 1 for s in stats]
    out: List[Any] = [None] * len(FIELDS)
    lows = [s[_I["min"]] for s in stats if s[_I["min"]] is not None]
    highs = [s[_I["max"]] for s in stats if s[_I["max"]] is not None]
    out[_I["min"]] = min(lows) if lows else None
    out[_I["max"]] = max(highs) if highs else None
    out[_I["mean"]] = _weighted([s[_I["mean"]] for s in stats], counts)
    out[_I["abs_mean"]] = _weighted([s[_I["abs_mean"]] for s in stats], counts)
    norms = [s[_I["norm"]] for s in stats]
    out[_I["norm"]] = None if any(n is None for n in norms) else math.sqrt(sum(n * n for n in norms))
    out[_I["nan"]] = sum(s[_I["nan"]] or 0 for s in stats)
    out[_I["inf"]] = sum(s[_I["inf"]] or 0 for s in stats)
    out[_I["fingerprint"]] = "ranks:" + hashlib.sha1("|".join(str(s[_I["fingerprint"]]) for s in stats)
                                                       .encode()).hexdigest()[:16]
    out[_I["numel"]] = sum(counts)
    if scale != 1.0:
        for f in ("min", "max", "mean", "abs_mean", "norm"):
            if out[_I[f]] is not None:
                out[_I[f]] /= scale
    return out


def _root_sum_squares(values: List[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def _combine_params(params: List[Dict[str, Dict[str, float]]], fragments: frozenset = frozenset()) -> Dict[str, Dict[str, float]]:
    """Each parameter's norms over the ranks that logged it (``fragments``: names the headers
    mark as ZeRO fragments, never taken as replicated even where the ranks' numbers agree)."""
    out: Dict[str, Dict[str, float]] = {}
    names = dict.fromkeys(name for p in params for name in p)
    for name in names:
        # a parameter some ranks do not log is held by the others alone (DeepSpeed ZeRO's
        # fragments: watch/zero.py): its shards are those ranks' numbers
        per_rank = [p[name] for p in params if name in p]
        combined: Dict[str, float] = {}
        for what in per_rank[0]:
            values = [p.get(what) for p in per_rank]
            if any(v is None for v in values):
                continue
            if name not in fragments and all(v == values[0] for v in values):
                combined[what] = values[0]
            elif what == "update_ratio":
                weights = [p.get("weight") for p in per_rank]
                if any(w is None for w in weights):
                    continue
                total = _root_sum_squares(weights)
                combined[what] = _root_sum_squares([r * w for r, w in zip(values, weights)]) / total if total else 0.0
            else:
                combined[what] = _root_sum_squares(values)
        out[name] = combined
    return out


def _combine_step(records: List[Dict[str, Any]], fragments: frozenset = frozenset()) -> Dict[str, Any]:
    keys = [k for k in records[0]["tensors"] if all(k in r["tensors"] for r in records)]
    losses = [r.get("loss") for r in records]
    loss = None if any(x is None for x in losses) else sum(losses) / len(losses)
    data_parallel = len(set(losses)) if loss is not None else 1

    def scale(key: str) -> float:
        return float(data_parallel) if key.rpartition(":")[2].startswith("grad_") else 1.0

    out = {"step": records[0]["step"], "loss": loss,
           "tensors": {k: _combine_tensor([r["tensors"][k] for r in records], scale(k)) for k in keys},
           "params": _combine_params([r.get("params", {}) for r in records], fragments)}
    if records[0].get("dtypes"):
        out["dtypes"] = records[0]["dtypes"]
    return out


def global_log(logs: Dict[int, WatchLog]) -> WatchLog:
    """Every rank's log of one job as one log of global statistics (module docstring); its
    header's signature is :func:`names_signature`."""
    ranks = [logs[r] for r in sorted(logs)]
    first = ranks[0]
    header = {**first.header, "rank": 0, "world_size": 1, "combined_ranks": len(ranks)}
    header["model"] = {**first.header.get("model", {}), "signature": names_signature(first.header)}
    by_step = [lg.by_step() for lg in ranks]
    steps = sorted(set.intersection(*(set(b) for b in by_step)))
    dtypes, param_dtypes = first.held_dtypes()
    for lg in ranks[1:]:  # under ZeRO each rank logs its own parameters
        for name, kinds in lg.held_dtypes()[1].items():
            param_dtypes.setdefault(name, kinds)
    fragments = frozenset(name for lg in ranks for name, f in lg.header.get("model", {}).get("shards", {}).items()
                          if f.get("placements") == ["ZeRO"])
    records = []
    for s in steps:
        record = _combine_step([b[s] for b in by_step], fragments)
        if not records:
            if dtypes:
                record["dtypes"] = dtypes
            if param_dtypes:
                record["param_dtypes"] = param_dtypes
        records.append(record)
    path = first.path if len(ranks) == 1 else f"{first.path} (+{len(ranks) - 1} ranks, global statistics)"
    return WatchLog(path=path, header=header, steps=records, notes=[n for lg in ranks for n in lg.notes],
                    complete=all(lg.complete for lg in ranks), torn_lines=sum(lg.torn_lines for lg in ranks))
