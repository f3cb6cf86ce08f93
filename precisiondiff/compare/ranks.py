"""Across ranks: tensors that must be identical on every rank of a group, checked bit for bit.

A multi-rank job replicates some tensors by construction; when two replicas differ, a rank
computed something else (a kernel wrong on one device, a collective that did not reduce what
the others did, a rank fed different weights). :func:`check_replicas` finds, in one multi-rank
dump, every record that must be replicated and compares its content fingerprint across the
ranks that hold it:

* the outputs of replicating collectives (all-reduce, all-gather, broadcast, c10d and
  functional) across the ranks of their group;
* DTensor records whose placements are all ``Replicate`` (``"R"``), and full tensors gathered
  at capture (``gather_full``), across their mesh;
* parameter gradients of a ``DistributedDataParallel`` model (all-reduced before
  ``optimizer.step()``), across all ranks;
* any key matching ``replicated`` (a regex), across all ranks.

Fingerprints are exact: two replicas that differ in one bit are flagged. Where both ranks
stored the data, the largest absolute difference is reported too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ..errors import PrecisionDiffError
from ..store import load
from ..store.reader import iter_index

__all__ = ["ReplicaMismatch", "ReplicaReport", "check_replicas", "REPLICATING_COLLECTIVES"]

# collectives after which every rank of the group holds the same output
REPLICATING_COLLECTIVES = re.compile(
    r"^(allreduce|all_reduce|allgather|all_gather|_allgather_base|broadcast|allreduce_coalesced|"
    r"all_reduce_coalesced|all_gather_into_tensor|all_gather_into_tensor_coalesced)_?$")


@dataclass
class ReplicaMismatch:
    """One tensor whose replicas differ: the ranks holding each distinct fingerprint."""

    key: str
    why: str  # the rule that makes it a replica
    groups: List[List[int]]  # ranks grouped by identical content, largest group first
    max_abs_diff: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "why": self.why, "groups": self.groups, "max_abs_diff": self.max_abs_diff}


@dataclass
class ReplicaReport:
    """The result of :func:`check_replicas`."""

    path: str
    ranks: List[int]
    checked: int = 0
    mismatches: List[ReplicaMismatch] = field(default_factory=list)
    by_rule: Dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "ranks": self.ranks, "checked": self.checked, "ok": self.ok,
                "by_rule": self.by_rule, "mismatches": [m.to_dict() for m in self.mismatches]}

    def summary(self) -> str:
        """A few lines for the terminal."""
        rules = ", ".join(f"{n} {r}" for r, n in sorted(self.by_rule.items())) or "none"
        lines = [f"{self.path}: ranks {self.ranks}, {self.checked} replicated tensors checked ({rules})"]
        if self.ok:
            lines.append("every replica is bitwise identical across its ranks")
        for m in self.mismatches[:20]:
            diff = f", max |diff| {m.max_abs_diff:.3g}" if m.max_abs_diff is not None else ""
            lines.append(f"DIFFER {m.key} ({m.why}): ranks " + " vs ".join(map(str, m.groups)) + diff)
        if len(self.mismatches) > 20:
            lines.append(f"... and {len(self.mismatches) - 20} more")
        return "\n".join(lines)


def _why(event: Dict[str, Any], record: Dict[str, Any], ddp: bool,
         pattern: Optional["re.Pattern[str]"]) -> Optional[Tuple[str, Optional[List[int]]]]:
    """The rule making ``record`` a replica and the ranks it spans (None: all), or None."""
    if pattern is not None and pattern.search(record["key"]):
        return "--replicated", None
    coll = event.get("collective")
    if coll and record["slot"].startswith("output") and REPLICATING_COLLECTIVES.match(str(coll.get("op", ""))):
        return "collective output", coll.get("ranks")
    if event.get("full_of"):  # DTensor.full_tensor() at capture: the same on every rank of its mesh
        return "gathered full tensor", event.get("mesh")
    placements = record.get("placements")
    if placements and all(p in ("R", "Replicate()") for p in placements):
        return "replicated DTensor", record.get("mesh")
    if ddp and record["slot"].startswith("param_grad"):
        return "DDP gradient", None
    return None


def check_replicas(path: Union[str, Path], *, replicated: Optional[str] = None,
                   data: bool = True) -> ReplicaReport:
    """Compare every replicated tensor of a multi-rank dump across its ranks (see the module doc).

    Args:
        path: a multi-rank dump (``rank0/``, ``rank1/``...).
        replicated: a regex on tensor keys that must also be identical on every rank.
        data: read stored tensors of differing replicas to report the largest difference.

    Raises:
        PrecisionDiffError: not a dump, a single-rank dump or a malformed regex.
    """
    dump = load(path)
    if len(dump.ranks) < 2:
        raise PrecisionDiffError(f"{path} holds one rank: replicas are checked across the ranks of a "
                                 "multi-rank dump (rank0/, rank1/...)")
    try:
        pattern = re.compile(replicated) if replicated else None
    except re.error as err:
        raise PrecisionDiffError(f"bad --replicated regex {replicated!r}: {err}") from err
    # key -> (why, span, {rank: (fingerprint, has_data)})
    found: Dict[str, Tuple[str, Optional[List[int]], Dict[int, Tuple[Optional[str], bool]]]] = {}
    for rank, sub in sorted(dump.ranks.items()):
        events = [obj for _, obj, _ in iter_index(sub.path, strict=False) if obj is not None]
        ddp = any(e.get("kind") == "module" and e.get("name") == "DistributedDataParallel" for e in events)
        for event in events:
            for record in event.get("tensors") or ():
                rule = _why(event, record, ddp, pattern)
                if rule is None:
                    continue
                entry = found.setdefault(record["key"], (rule[0], rule[1], {}))
                stats = record.get("stats") or {}
                entry[2][rank] = (stats.get("fingerprint"), record.get("data_key") is not None)
    report = ReplicaReport(str(path), sorted(dump.ranks))
    for key, (why, span, per_rank) in found.items():
        holders = {r: v for r, v in per_rank.items() if span is None or r in span}
        prints = {r: fp for r, (fp, _) in holders.items() if fp is not None}
        if len(prints) < 2:
            continue
        report.checked += 1
        report.by_rule[why] = report.by_rule.get(why, 0) + 1
        groups: Dict[str, List[int]] = {}
        for r, fp in sorted(prints.items()):
            groups.setdefault(fp, []).append(r)
        if len(groups) == 1:
            continue
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g))
        diff = _max_diff(dump, key, [g[0] for g in ordered]) if data else None
        report.mismatches.append(ReplicaMismatch(key, why, ordered, diff))
    return report


def _max_diff(dump: Any, key: str, ranks: List[int]) -> Optional[float]:
    """Largest |a - b| between the first rank's stored tensor and the others' (None without data)."""
    try:
        tensors = [dump.tensor(key, rank=r) for r in ranks]
    except Exception:  # noqa: BLE001 - stats-only dump or a partial one: the fingerprints suffice
        return None
    if any(t is None for t in tensors) or len({tuple(t.shape) for t in tensors}) != 1:
        return None
    base = tensors[0].double()
    return max(float((t.double() - base).abs().max()) for t in tensors[1:]) if base.numel() else 0.0
