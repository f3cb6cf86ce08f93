"""Is each all-reduce's output the reduction of its inputs? Checked across ranks from a dump.

A wrong collective (a reduction that accumulates in bf16, a vendor library's bad kernel) gives
every rank the *same* wrong output, which a replica check cannot see. With the tensors stored
(``--mode tensors``), every rank's recorded input of an all-reduce is in the dump: the reduction
is recomputed in float64 from them and each rank's output is judged against it, elementwise:

    |out - expected| <= n * u * sum_r |x_r| + tiny

(``n`` ranks, ``u`` the unit roundoff of the output's dtype: what any summation order of ``n``
terms in that precision may lose; an average gets one more rounding, max and min are exact up to
the output's rounding). The reduce op is not assumed: the
output must match one of sum, average, max or min of the inputs; an output that matches none
names the collective.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..store import load
from ..store.reader import iter_index

__all__ = ["WrongCollective", "CollectiveReport", "check_collectives"]

_ALL_REDUCE = re.compile(r"^(allreduce_|all_reduce)$")


@dataclass
class WrongCollective:
    """An all-reduce whose output is none of the reductions of its ranks' inputs."""

    key: str
    ranks: List[int]
    excess: float  # the smallest, over the reductions tried, of max(|out - expected| / bound)

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "ranks": self.ranks, "excess": self.excess}


@dataclass
class CollectiveReport:
    """The result of :func:`check_collectives`."""

    checked: int = 0
    skipped: int = 0  # all-reduces without stored data on every rank of their group
    wrong: List[WrongCollective] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.wrong

    def to_dict(self) -> Dict[str, Any]:
        return {"checked": self.checked, "skipped": self.skipped, "ok": self.ok,
                "wrong": [w.to_dict() for w in self.wrong]}

    def summary(self) -> str:
        lines = [f"{self.checked} all-reduces recomputed from their ranks' inputs"
                 + (f" ({self.skipped} without stored data: capture with --mode tensors)" if self.skipped else "")]
        for w in self.wrong[:20]:
            lines.append(f"WRONG COLLECTIVE {w.key}: the output on ranks {w.ranks} is no reduction of the inputs "
                         f"({w.excess:.3g}x the rounding bound)")
        return "\n".join(lines)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def _excess(out: torch.Tensor, inputs: List[torch.Tensor]) -> float:
    """min over sum/avg/max/min of max(|out - expected| / bound); <= 1 means a valid reduction."""
    stacked = torch.stack([t.double() for t in inputs])
    n = len(inputs)
    got = out.double()
    if not out.dtype.is_floating_point:
        candidates = (stacked.sum(0), stacked.max(0).values, stacked.min(0).values)
        return 0.0 if any(torch.equal(got, c) for c in candidates) else float("inf")
    u, tiny = _unit_roundoff(out.dtype), torch.finfo(out.dtype).tiny
    magnitude = stacked.abs().sum(0)
    candidates = ((stacked.sum(0), n * u * magnitude + tiny),
                  (stacked.mean(0), (n + 1) * u * magnitude / n + tiny),
                  (stacked.max(0).values, u * stacked.abs().max(0).values + tiny),
                  (stacked.min(0).values, u * stacked.abs().max(0).values + tiny))
    if got.numel() == 0:
        return 0.0
    return min(float(((got - expected).abs() / bound).max()) for expected, bound in candidates)


def check_collectives(path: Union[str, Path]) -> CollectiveReport:
    """Recompute every all-reduce of a multi-rank tensors dump from its ranks' inputs."""
    dump = load(path)
    # key -> {rank: (input data key, output data key)}, and the group's ranks
    found: Dict[str, Tuple[List[int], Dict[int, Tuple[Optional[str], Optional[str]]]]] = {}
    for rank, sub in sorted(dump.ranks.items()):
        for _, event, _ in iter_index(sub.path, strict=False):
            coll = (event or {}).get("collective")
            if not coll or not _ALL_REDUCE.match(str(coll.get("op", ""))) or coll.get("failed"):
                continue
            records = {r["slot"]: r for r in event.get("tensors") or ()}
            out, inp = records.get("output.0"), records.get("input.0")
            if out is None:
                continue
            group = coll.get("ranks") or sorted(dump.ranks)
            entry = found.setdefault(out["key"], (group, {}))
            entry[1][rank] = (inp.get("data_key") if inp else None, out.get("data_key"))
    report = CollectiveReport()
    for key, (group, per_rank) in found.items():
        if set(group) - set(per_rank) or any(i is None or o is None for i, o in per_rank.values()):
            report.skipped += 1
            continue
        inputs = [dump.ranks[r].tensor(per_rank[r][0]) for r in group]
        report.checked += 1
        wrong, worst = [], float("inf")
        for r in group:
            excess = _excess(dump.ranks[r].tensor(per_rank[r][1]), inputs)
            if excess > 1.0:
                wrong.append(r)
                worst = min(worst, excess)
        if wrong:
            report.wrong.append(WrongCollective(key, wrong, worst))
    return report
