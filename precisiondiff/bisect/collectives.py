"""Collectives judged as units: each one recomputed from the inputs every rank of its group
recorded, and judged by the peer rule (docs/distributed.md, "Bisect a multi-rank job").

A collective is one computation spread over the ranks of its group: ``all_reduce`` on rank r
returns ``reduce_{r in group} x_r``. Its inputs are in the per-rank dumps (``--mode replay`` or
``tensors``: the input a rank contributed is recorded before the collective runs, its output
once it is ready), so it can be judged like an op whose inputs come from several processes:

* **reductions** (all-reduce, reduce-scatter): the golden is the reduction of the ranks' inputs
  in float64; the peer is a correct implementation in the DUT's dtype, the inputs accumulated in
  float32 (the wider of float32 and the dtype) in rank order and rounded once to the output
  dtype; ``K`` is the number of ranks and the magnitude ``sum_r |x_r|``. Each rank's output is
  judged against them by :func:`~precisiondiff.comparators.peers.judge_against_peers` (the rule
  ops are judged by). The reduce op is read from the recorded arguments when they say it
  (functional collectives), else the one of sum, average, max and min closest to the output is
  taken (c10d records a ``ReduceOp`` object), so a wrong reduce op is not invented;
* **data movement** (all-gather, broadcast, all-to-all): the output must equal the ranks' inputs
  bit for bit (all-to-all: each rank receives the chunk every rank addressed to it, split as the
  recorded input split sizes say, else evenly, or one tensor per destination in the list form).

Reduce-scatter is judged in its tensor and list (``c10d.reduce_scatter_``) forms. Other
collectives (send/recv, barriers; ``alltoall_base_``, whose output capture does not record) are
listed as not judged. Matching across
ranks is by ``(scope, name, direction, call)`` within the first step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..comparators.peers import compute_dtype, judge_against_peers, peer_dtype
from ..store.reader import iter_index

__all__ = ["CollectiveUnit", "CollectiveVerdict", "collect_units", "rank_collectives", "merge_units", "tensor_keys",
           "judge_collective", "is_collective_op", "JUDGED"]

# op name (without namespace and overload) -> kind of check
_KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
          "allreduce_coalesced_": "all_reduce", "all_reduce_coalesced": "all_reduce",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter_": "reduce_scatter",
          "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather", "allgather_": "all_gather",
          "broadcast_": "broadcast", "broadcast": "broadcast",
          "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all"}
# where an all-to-all's input split sizes are among its arguments (an empty list: equal splits)
_INPUT_SPLITS = {"all_to_all_single": 2, "alltoall_base_": 4}
JUDGED = tuple(sorted(set(_KINDS.values())))
_PREFIXES = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")


def is_collective_op(name: str) -> bool:
    """Whether an op name is a collective or one of its helpers (``wait_tensor``): per-rank
    bisect leaves these out, they are judged here from all ranks."""
    return name.startswith(_PREFIXES)


def _short(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else name


@dataclass
class CollectiveUnit:
    """One collective call, seen from every rank of its group that recorded it.

    Attributes:
        scope, name, direction, call: as recorded (the same on every rank).
        kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``all_to_all`` or
            None (not judged).
        group, ranks: the process group's name and ranks.
        seq: per rank, the event's execution position.
        records: per rank, ``{slot: tensor record}`` of the event.
        args: per rank, the recorded arguments (replay mode) or None.
    """

    scope: str
    name: str
    direction: str
    call: int
    kind: Optional[str]
    group: str
    ranks: List[int]
    seq: Dict[int, int] = field(default_factory=dict)
    records: Dict[int, Dict[str, Dict[str, Any]]] = field(default_factory=dict)
    args: Dict[int, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.direction} {self.scope or '<root>'} {self.name}#{self.call}"


@dataclass
class CollectiveVerdict:
    """What judging one collective found.

    Attributes:
        judged: False when it could not be (``reason`` says why).
        passed: every rank's output passes.
        wrong_ranks: the ranks whose output fails.
        reduce_op: the reduction the outputs were judged as (reductions only).
        peer: the worst rank's peer verdict (:meth:`PeerVerdict.as_dict`), or for data movement
            ``{"rule": "exact", "mismatched": n, "numel": m}``.
        message: one line when it fails.
    """

    judged: bool
    passed: bool = True
    wrong_ranks: List[int] = field(default_factory=list)
    reduce_op: Optional[str] = None
    peer: Dict[str, Any] = field(default_factory=dict)
    local: Dict[str, Any] = field(default_factory=dict)
    message: str = ""
    reason: str = ""


def collect_units(rank_paths: Dict[int, Any], *, direction: Optional[str] = None) -> List[CollectiveUnit]:
    """Every collective call of the first step, merged across the ranks that recorded it.

    ``rank_paths`` maps each rank to its dump directory. Units come in the execution order of
    their lowest rank.
    """
    return merge_units({rank: rank_collectives(path, direction=direction)
                        for rank, path in rank_paths.items()})


def rank_collectives(path: Any, *, direction: Optional[str] = None) -> List[Dict[str, Any]]:
    """The collective calls of one rank's first step, as plain records (what a process sends to
    process 0 when the ranks' dumps lie on different hosts): :func:`merge_units` joins them."""
    out: List[Dict[str, Any]] = []
    first = None
    for _, ev, _ in iter_index(path, strict=False):
        if not ev or ev.get("kind") != "op":
            continue
        first = ev.get("step") if first is None else first
        if ev.get("step") != first:
            break
        coll = ev.get("collective") or {}
        if "ranks" not in coll or coll.get("failed"):
            continue  # wait_tensor & co (no group), or a collective that failed on this rank
        if direction is not None and ev.get("direction") != direction:
            continue
        out.append({"scope": ev["scope"], "name": ev["name"], "direction": ev["direction"],
                    "call": int(ev.get("call") or 0), "group": str(coll.get("group")),
                    "ranks": [int(r) for r in coll["ranks"]], "seq": int(ev["seq"]),
                    "records": {t["slot"]: t for t in ev.get("tensors") or ()}, "args": ev.get("args")})
    return out


def merge_units(per_rank: Dict[int, List[Dict[str, Any]]]) -> List[CollectiveUnit]:
    """The ranks' :func:`rank_collectives` as units, matched by (scope, name, direction, call,
    group), in the execution order of their lowest rank."""
    units: Dict[Tuple[str, str, str, int, str], CollectiveUnit] = {}
    for rank, calls in sorted(per_rank.items()):
        for c in calls:
            key = (c["scope"], c["name"], c["direction"], c["call"], c["group"])
            unit = units.get(key)
            if unit is None:
                unit = units[key] = CollectiveUnit(c["scope"], c["name"], c["direction"], c["call"],
                                                   _KINDS.get(_short(c["name"])), c["group"], list(c["ranks"]))
            unit.seq[rank] = c["seq"]
            unit.records[rank] = c["records"]
            unit.args[rank] = c["args"]
    order = {"forward": 0, "backward": 1}
    return sorted(units.values(), key=lambda u: (order.get(u.direction, 2), min(u.seq.values()), u.name))


def tensor_keys(unit: CollectiveUnit, rank: int) -> List[str]:
    """The keys of the tensors :func:`judge_collective` reads from ``rank``'s dump for ``unit``."""
    records = unit.records.get(rank) or {}
    return [records[s]["key"] for s in _slots(records, "input.") + _slots(records, "output.")]


def _slots(records: Dict[str, Dict[str, Any]], prefix: str) -> List[str]:
    found = [s for s, r in records.items() if s.startswith(prefix) and r.get("data_key")
             and str(r.get("dtype", "")).startswith(("float", "bfloat", "int", "uint"))]
    return sorted(found, key=lambda s: int(s.split(".")[1]))


def _reduce_op_of(unit: CollectiveUnit) -> Optional[str]:
    """The reduce op the recorded arguments name (functional collectives pass a string)."""
    for args in unit.args.values():
        for a in (args or {}).get("args", []):
            if isinstance(a, str) and a.lower() in ("sum", "avg", "max", "min", "product", "premul_sum"):
                return a.lower()
    return None


def _reductions(stacked: torch.Tensor, acc: torch.dtype) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """op -> (float64 golden, peer computed in ``acc`` in rank order, not yet rounded)."""
    n = stacked.shape[0]
    gold = stacked.double()
    peer = stacked[0].to(acc)
    for r in range(1, n):
        peer = peer + stacked[r].to(acc)
    return {"sum": (gold.sum(0), peer), "avg": (gold.mean(0), peer / n),
            "max": (gold.max(0).values, stacked.to(acc).max(0).values),
            "min": (gold.min(0).values, stacked.to(acc).min(0).values)}


def judge_collective(unit: CollectiveUnit, load: Callable[[int, str], torch.Tensor]) -> CollectiveVerdict:
    """Judge one collective from its group's recorded inputs; ``load(rank, key)`` reads a tensor."""
    if unit.kind is None:
        return CollectiveVerdict(False, reason=f"{_short(unit.name)}: not a collective bisect judges "
                                               f"({', '.join(JUDGED)})")
    missing = [r for r in unit.ranks if r not in unit.records]
    if missing:
        return CollectiveVerdict(False, reason=f"not recorded on rank(s) {missing} of its group")
    ins = {r: _slots(unit.records[r], "input.") for r in unit.ranks}
    outs = {r: _slots(unit.records[r], "output.") for r in unit.ranks}
    if _short(unit.name) == "alltoall_base_" and not any(outs.values()):
        return CollectiveVerdict(False, reason="alltoall_base_ (dist.all_to_all_single): capture does not record "
                                               "its output (written in place, not returned)")
    if any(not ins[r] for r in unit.ranks) or any(not outs[r] for r in unit.ranks):
        return CollectiveVerdict(False, reason="inputs or outputs not stored (capture with --mode replay or tensors)")

    def tensors(rank: int, slots: List[str]) -> List[torch.Tensor]:
        return [load(rank, unit.records[rank][s]["key"]) for s in slots]
    inputs = {r: tensors(r, ins[r]) for r in unit.ranks}
    outputs = {r: tensors(r, outs[r]) for r in unit.ranks}
    if unit.kind == "reduce_scatter" and any(len(v) > 1 for v in inputs.values()):
        # the list form (c10d.reduce_scatter_): rank r's chunk j goes to the group's j-th rank
        inputs = {r: [torch.cat([x.reshape(-1) for x in xs])] for r, xs in inputs.items()}
    if unit.kind in ("all_gather", "broadcast", "all_to_all"):
        return _judge_exact(unit, inputs, outputs)
    return _judge_reduction(unit, inputs, outputs)


def _input_splits(unit: CollectiveUnit, rank: int) -> Optional[List[int]]:
    at = _INPUT_SPLITS.get(_short(unit.name))
    args = (unit.args.get(rank) or {}).get("args") or []
    if at is None or at >= len(args) or not isinstance(args[at], list) or not args[at]:
        return None
    return [int(n) for n in args[at]]


def _all_to_all_expected(unit: CollectiveUnit, inputs: Dict[int, List[torch.Tensor]]) -> Dict[int, torch.Tensor]:
    """What each rank must receive: the chunk every rank of the group addressed to it, in group order."""
    chunks: Dict[int, List[torch.Tensor]] = {}
    for r in unit.ranks:
        xs = inputs[r]
        if len(xs) > 1:  # the list form: one tensor per destination
            chunks[r] = [x.reshape(-1) for x in xs]
            continue
        splits = _input_splits(unit, r)
        rows = xs[0] if xs[0].dim() else xs[0].reshape(1)
        if splits is None:
            if rows.shape[0] % len(unit.ranks):
                raise ValueError(f"rank {r}: {rows.shape[0]} rows do not split evenly over {len(unit.ranks)} ranks")
            splits = [rows.shape[0] // len(unit.ranks)] * len(unit.ranks)
        if len(splits) != len(unit.ranks) or sum(splits) != rows.shape[0]:
            raise ValueError(f"rank {r}: input split sizes {splits} do not match its input")
        chunks[r] = [c.reshape(-1) for c in rows.split(splits)]
    return {r: torch.cat([chunks[q][pos] for q in unit.ranks]) for pos, r in enumerate(unit.ranks)}


def _judge_exact(unit: CollectiveUnit, inputs: Dict[int, List[torch.Tensor]],
                 outputs: Dict[int, List[torch.Tensor]]) -> CollectiveVerdict:
    if unit.kind == "all_to_all":
        try:
            expect = _all_to_all_expected(unit, inputs)
        except ValueError as err:
            return CollectiveVerdict(False, reason=str(err))
    elif unit.kind == "all_gather":
        gathered = torch.cat([inputs[r][0].reshape(-1) for r in unit.ranks])
        expect = {r: gathered for r in unit.ranks}
    else:  # broadcast: the root's input on every rank (the root is the rank whose input it is)
        expected = outputs[unit.ranks[0]][0].reshape(-1)
        sent = [inputs[r][0].reshape(-1) for r in unit.ranks]
        if not any(x.numel() == expected.numel() and torch.equal(x, expected) for x in sent):
            expected = next((x for x in sent if x.numel() == expected.numel()), expected)
        expect = {r: expected for r in unit.ranks}
    wrong, worst = [], {"rule": "exact", "mismatched": 0, "numel": int(max(e.numel() for e in expect.values()))}
    for r in unit.ranks:
        got, expected = torch.cat([t.reshape(-1) for t in outputs[r]]), expect[r]
        if got.numel() != expected.numel():
            return CollectiveVerdict(False, reason=f"rank {r}: output has {got.numel()} elements, "
                                                   f"the inputs {expected.numel()}")
        bad = int((~((got == expected) | (torch.isnan(got) & torch.isnan(expected)))).sum())
        if bad:
            wrong.append(r)
            if bad > worst["mismatched"]:
                worst["mismatched"] = bad
    message = (f"{unit.kind}: {worst['mismatched']} of {worst['numel']} elements differ from what the ranks "
               f"sent, on rank(s) {wrong}" if wrong else "")
    return CollectiveVerdict(True, not wrong, wrong, None, worst, {"mismatched": worst["mismatched"]}, message)


def _judge_reduction(unit: CollectiveUnit, inputs: Dict[int, List[torch.Tensor]],
                     outputs: Dict[int, List[torch.Tensor]]) -> CollectiveVerdict:
    named = _reduce_op_of(unit)
    n_pairs = min(len(v) for v in inputs.values())
    wrong: List[int] = []
    worst: Optional[Any] = None
    chosen: Optional[str] = named
    for j in range(n_pairs):
        xs = [inputs[r][j] for r in unit.ranks]
        if any(x.shape != xs[0].shape for x in xs) or not xs[0].is_floating_point():
            return CollectiveVerdict(False, reason="inputs differ in shape across ranks or are not floating")
        stacked = torch.stack([x.detach() for x in xs])
        for pos, r in enumerate(unit.ranks):
            out = outputs[r][j] if unit.kind == "all_reduce" else outputs[r][0]
            dt = compute_dtype(out.dtype, [x.dtype for x in xs])
            reds = _reductions(stacked, peer_dtype(dt))
            if unit.kind == "reduce_scatter":
                reds = {k: (g.reshape(len(unit.ranks), -1)[pos].reshape(out.shape),
                            p.reshape(len(unit.ranks), -1)[pos].reshape(out.shape)) for k, (g, p) in reds.items()}
            op = chosen
            if op is None or op not in reds:  # closest reduction to what the first rank got
                op = chosen = min(reds, key=lambda k: float((out.double() - reds[k][0]).abs().max()))
            golden, peer = reds[op]
            mag = stacked.double().abs().sum(0)
            if unit.kind == "reduce_scatter":
                mag = mag.reshape(len(unit.ranks), -1)[pos].reshape(out.shape)
            if op == "avg":
                mag = mag / len(unit.ranks)
            verdict = judge_against_peers(out, golden, {"float32": peer.to(out.dtype)}, magnitude=mag,
                                          k=len(unit.ranks) if op in ("sum", "avg") else None, dtype=dt,
                                          what=f"rank {r} output.{j}")
            if not verdict.passed and r not in wrong:
                wrong.append(r)
            if worst is None or (not verdict.passed and worst.passed) or \
                    (verdict.passed == worst.passed and verdict.ratio > worst.ratio):
                worst = verdict
    assert worst is not None
    local = {"rel_l2": worst.error, "max_error": worst.max_error, "ranks": len(unit.ranks)}
    message = ""
    if wrong:
        message = (f"{unit.kind} ({chosen}) of {len(unit.ranks)} ranks: {worst.message}")
    return CollectiveVerdict(True, not wrong, wrong, chosen, worst.as_dict(), local, message)
