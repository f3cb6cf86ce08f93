"""Bisect a multi-rank job (tensor parallel, data parallel...) from its per-rank replay dumps.

``precisiondiff bisect RUN_DIR`` on a directory of ``rank{N}/`` dumps (``torchrun ... capture
--mode replay``, or the Python API inside a process group), or :func:`bisect_ranks` (live, in one
command: ``torchrun ... bisect --script``, :mod:`.script`):

1. **Each rank bisects its own ops** from its own recorded inputs (:func:`bisect_dump` on its
   dump): op-local judging needs nothing from the other ranks, so a kernel wrong on rank 1 only
   is named on rank 1, with ``rank: 1`` in the culprit, and the other ranks say parity. Collective
   ops are left out of the per-rank search (they cannot run in one process).
2. **Collectives are judged as units** (:mod:`.collectives`): the inputs every rank of the group
   recorded are gathered from the dumps, the collective is recomputed in float64 and each rank's
   output is judged by the peer rule against a correct implementation in its dtype (a float32
   accumulation of the K ranks' inputs rounded once): a bf16-accumulating all-reduce is named,
   though its output is the same on every rank.
3. **One result**: the first offending unit in execution order (forward before backward, then
   by the rank's sequence number; ties by rank) is the culprit; every rank's verdict is kept in
   ``ranks``, the collectives in ``collectives``.

Modules are not replayed (a module of a parallel model calls collectives); ``workload`` only
imports its module, so that its custom ops are known.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import BisectError, PrecisionDiffError
from ..runtime.gloo_exit import guard_exit
from .collectives import (CollectiveUnit, CollectiveVerdict, collect_units, judge_collective, merge_units,
                          rank_collectives, tensor_keys)
from .offline import bisect_dump
from .result import BisectResult, _clean
from .shards import first_step_events, placements_of, prepare_events

__all__ = ["RanksBisectResult", "bisect_ranks", "is_multi_rank", "ranks_summary_lines"]

_ORDER = {"forward": 0, "backward": 1}


@dataclass
class RanksBisectResult(BisectResult):
    """A :class:`BisectResult` of a multi-rank job; the culprit carries ``rank``.

    Attributes:
        ranks: per rank, ``{"verdict", "culprit", "final_error", "candidates"}`` of its own ops.
        collectives: ``{"judged", "wrong": [...], "not_judged": [...]}`` (see :mod:`.collectives`).
    """

    ranks: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    collectives: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        """DESIGN.md's fields, then ``ranks`` and ``collectives``."""
        out = super().to_json()
        out["ranks"] = _clean({str(r): v for r, v in sorted(self.ranks.items())})
        out["collectives"] = _clean(self.collectives)
        return out


def is_multi_rank(path: "str | Path") -> bool:
    """Whether ``path`` is a directory of ``rank{N}/`` dumps (no ``meta.json`` of its own)."""
    p = Path(path)
    if not p.is_dir() or (p / "meta.json").exists():
        return False
    return any(c.is_dir() and c.name.startswith("rank") and c.name[4:].isdigit() and (c / "meta.json").exists()
               for c in p.iterdir())


def _import_workload_module(workload: Any) -> None:
    """Import the module of a workload spec (its custom ops): :func:`.workers.import_workload_module`."""
    from .workers import import_workload_module
    import_workload_module(workload)


def _seqs(path: Path) -> Dict[Tuple[str, str, str, str, int], int]:
    """(kind, scope, name, direction, call) -> seq, first step of one rank's dump."""
    out: Dict[Tuple[str, str, str, str, int], int] = {}
    for ev in first_step_events(path):
        out.setdefault((ev["kind"], ev["scope"], ev["name"], ev["direction"], int(ev.get("call") or 0)),
                       int(ev["seq"]))
    return out


def _unit_key(unit: Dict[str, Any]) -> Tuple[str, str, str, str, int]:
    return (unit["kind"], unit["scope"], unit["name"], unit["direction"], int(unit.get("call") or 0))


def _collective_json(unit: CollectiveUnit, verdict: CollectiveVerdict) -> Dict[str, Any]:
    return {"kind": "collective", "scope": unit.scope, "name": unit.name, "direction": unit.direction,
            "call": unit.call, "rank": verdict.wrong_ranks[0] if verdict.wrong_ranks else None,
            "ranks": verdict.wrong_ranks, "group": {"name": unit.group, "ranks": unit.ranks},
            "collective": unit.kind, "reduce_op": verdict.reduce_op, "local": verdict.local,
            "budget": {"rule": "peer: recomputed in float64 from every rank's input; peer = float32 "
                               "accumulation of the ranks' inputs, rounded once"
                       if verdict.reduce_op else "exact: the output is the ranks' inputs, bit for bit",
                       "k": len(unit.ranks)},
            "peer": verdict.peer, "message": verdict.message}


def bisect_ranks(run_dir: "str | Path", *, ref: str = "cpu/float64", workload: Any = None,
                 direction: Optional[str] = None, budgets: Any = None,
                 progress: Optional[Callable[[int, int, str], None]] = None,
                 max_candidates: int = 3, across_processes: bool = False,
                 group: Any = None, workers: int = 1,
                 accept: Optional[Sequence[str]] = None, blame_known: bool = False) -> Optional[RanksBisectResult]:
    """Bisect a multi-rank job from its per-rank ``--mode replay`` dumps (module docstring).

    Args:
        run_dir: the directory holding ``rank0/``, ``rank1/``...
        ref: the reference target ops and collectives are recomputed on.
        workload: a workload spec whose module defines the job's custom ops (only imported).
        direction: ``"forward"`` or ``"backward"`` only.
        budgets: op budget overrides (see :func:`precisiondiff.bisect.bisect`).
        progress: called as ``progress(done, total, label)`` (per rank, labels prefixed).
        max_candidates: offending units reported after the culprit.
        across_processes: run under ``torchrun``: each process bisects the ranks whose dumps it
            finds under ``run_dir`` on its own host (process ``i`` of ``W`` ranks ``i, i+W, ...`` when
            every process sees every rank); process 0 gathers the verdicts and each collective
            call's tensors from the processes holding them (gloo, from torchrun's environment),
            judges the collectives and returns the result. No shared storage is needed.
        group: with ``across_processes``, the process group to share the ranks over (default:
            the default group, created from torchrun's environment when there is none).
        workers: without ``across_processes``, bisect this many ranks at a time, each in a
            process of its own on this host (``bisect RUN_DIR --workers N``).
        accept: accepted findings ``["OP[@SCOPE]", ...]`` on every rank (see
            :func:`precisiondiff.bisect.bisect`); the result's ``accepted`` lists them with their rank.
        blame_known: judge the documented stock findings as offenders (see
            :func:`precisiondiff.bisect.bisect`).

    Returns:
        A :class:`RanksBisectResult`: ``culprit["rank"]`` names the rank; a wrong collective is
        ``kind: "collective"`` with the ranks whose output is wrong and its group. None on a
        process other than 0 with ``across_processes``.

    Raises:
        BisectError: not a multi-rank dump, a rank not captured in replay mode.

    Example:
        >>> r = bisect_ranks("runs/tp")  # doctest: +SKIP
        >>> r.culprit["rank"], r.culprit["name"]  # doctest: +SKIP
    """
    started = time.perf_counter()
    options = {"ref": ref, "direction": direction, "budgets": budgets, "max_candidates": max_candidates,
               "accept": list(accept) if accept is not None else None, "blame_known": blame_known}
    if across_processes:
        return _across_processes(run_dir, options, workload, group, progress, started)
    if not is_multi_rank(run_dir):
        raise BisectError(f"{run_dir} is not a multi-rank dump (a directory of rank0/, rank1/... dumps)")
    _import_workload_module(workload)
    dump = _load(run_dir)
    paths = {r: d.path for r, d in sorted(dump.ranks.items())}
    if workers > 1:
        done = _on_local_workers(paths, options, workers, workload)
    else:
        done = {r: _bisect_rank(r, paths[r], options, _labelled(progress, r)) for r in paths}
    units = collect_units(paths, direction=direction)
    verdicts = [(u, judge_collective(u, lambda r, key: dump.ranks[r].tensor(key))) for u in units]
    return _result({r: (*done[r], _seqs(paths[r])) for r in done}, verdicts, max_candidates, started)


def _load(run_dir: "str | Path") -> Any:
    from ..store import load
    try:
        return load(run_dir)
    except PrecisionDiffError as err:
        raise BisectError(f"{run_dir}: {err}") from err


def _labelled(progress: Optional[Callable[[int, int, str], None]], rank: int
              ) -> Optional[Callable[[int, int, str], None]]:
    if progress is None:
        return None
    return lambda done, total, label: progress(done, total, f"rank {rank}: {label}")


def _result(done: Dict[int, Tuple[BisectResult, List[Dict[str, Any]], Dict[Any, int]]],
            verdicts: List[Tuple[CollectiveUnit, CollectiveVerdict]], max_candidates: int,
            started: float) -> RanksBisectResult:
    """The ranks' results ``(result, DTensor calls left out, first step's seqs)`` and the
    collectives' verdicts as one result."""
    per_rank = {r: done[r][0] for r in sorted(done)}
    left_out = {r: done[r][1] for r in sorted(done)}
    result = _merge(per_rank, {r: done[r][2] for r in done}, verdicts, max_candidates,
                    time.perf_counter() - started)
    shards = sorted({(u["scope"], u["name"], u["reason"]) for units in left_out.values() for u in units})
    if shards:
        result.notes.append(f"{sum(map(len, left_out.values()))} DTensor op call(s) not judged: "
                            + "; ".join(f"{n} in {s or '<root>'} ({why})" for s, n, why in shards[:3])
                            + (" ..." if len(shards) > 3 else ""))
    result.cost["dtensor_ops_not_judged"] = sum(map(len, left_out.values()))
    return result


def _bisect_rank(rank: int, path: Path, options: Dict[str, Any],
                 progress: Optional[Callable[[int, int, str], None]] = None,
                 ) -> Tuple[BisectResult, List[Dict[str, Any]]]:
    """One rank's own ops, from its dump: its result and the DTensor op calls left out."""
    left: List[Dict[str, Any]] = []
    try:
        res = bisect_dump(path, progress=progress, prepare=prepare_events(placements_of(path), left, rank),
                          **options)
    except BisectError as err:
        raise BisectError(f"rank {rank}: {err}") from err
    return res, left


def _rank_worker(rank: int, path: Path, options: Dict[str, Any], workload: Any, threads: int
                 ) -> Tuple[BisectResult, List[Dict[str, Any]]]:
    import torch
    torch.set_num_threads(threads)
    _import_workload_module(workload)
    return _bisect_rank(rank, path, options)


def _on_local_workers(paths: Dict[int, Path], options: Dict[str, Any], workers: int,
                      workload: Any) -> Dict[int, Any]:
    """Every rank's :func:`_bisect_rank` on ``workers`` processes of this host."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from .workers import threads_per_worker
    if workload is not None and not isinstance(workload, str):
        raise BisectError("--workers: the ranks are bisected in worker processes, which need the workload "
                          "as path/file.py:fn or package.module:fn")
    with ProcessPoolExecutor(min(workers, len(paths)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {r: pool.submit(_rank_worker, r, p, options, workload, threads_per_worker(workers))
                   for r, p in paths.items()}
        return {r: f.result() for r, f in futures.items()}


def _across_processes(run_dir: "str | Path", options: Dict[str, Any], workload: Any, group: Any,
                      progress: Optional[Callable[[int, int, str], None]], started: float
                      ) -> Optional[RanksBisectResult]:
    """:func:`bisect_ranks` over the processes of a torch.distributed job (torchrun), gloo from
    torchrun's environment unless ``group`` is given or a group exists."""
    import torch.distributed as dist
    owned = group is None and not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
        guard_exit()  # gloo's workers idle before the interpreter finalizes (runtime/gloo_exit.py)
    try:
        return _shared_out(run_dir, options, workload, group, progress, started)
    finally:
        if owned:
            dist.destroy_process_group()


def _owners(held: List[List[int]]) -> Dict[int, int]:
    """rank -> the process that bisects it, one of the processes holding its dump: the ``i``-th
    rank goes to process ``i % W`` when that one holds it and has no more ranks than the other
    holders (so with every dump everywhere, process ``i`` bisects ranks ``i, i+W, ...``), else to
    the holder with the fewest ranks so far (16 ranks on 2 hosts of 8, bisected by 2 processes
    per host: 4 ranks each, each on the host holding them)."""
    holders: Dict[int, List[int]] = {}
    for process, ranks in enumerate(held):
        for r in ranks:
            holders.setdefault(r, []).append(process)
    load = [0] * len(held)
    out: Dict[int, int] = {}
    for i, r in enumerate(sorted(holders)):
        fewest = min(load[h] for h in holders[r])
        preferred = i % len(held)
        owner = preferred if preferred in holders[r] and load[preferred] == fewest else \
            min(holders[r], key=lambda h: (load[h], h))
        out[r] = owner
        load[owner] += 1
    return out


def _shared_out(run_dir: "str | Path", options: Dict[str, Any], workload: Any, group: Any,
                progress: Optional[Callable[[int, int, str], None]], started: float
                ) -> Optional[RanksBisectResult]:
    """Each process bisects ranks whose dumps it holds (under ``run_dir`` on its own host: shared
    storage is not required); process 0 gets every rank's result and, one collective call at a
    time, the tensors each holder reads for it (docs/distributed.md, "What moves between hosts").
    Every process reaches every gather, errors included, so none waits forever."""
    import torch.distributed as dist
    me, world = dist.get_rank(group), dist.get_world_size(group)
    error, dump, local = None, None, {}
    try:
        _import_workload_module(workload)
        if is_multi_rank(run_dir):  # a host may hold none of the ranks
            dump = _load(run_dir)
            local = {r: d.path for r, d in sorted(dump.ranks.items())}
    except BisectError as err:
        error = str(err)
    held: List[Any] = [None] * world
    dist.all_gather_object(held, (error, sorted(local)), group=group)
    errors = [e for e, _ in held if e]
    if not errors and not any(ranks for _, ranks in held):
        errors = [f"{run_dir} is not a multi-rank dump (a directory of rank0/, rank1/... dumps) on any process"]
    if errors:
        return _stop(me, error, errors)
    owner = _owners([ranks for _, ranks in held])
    mine: Dict[int, Any] = {}
    try:
        for r in sorted(owner):
            if owner[r] == me:
                res, left = _bisect_rank(r, local[r], options, _labelled(progress, r))
                mine[r] = (res, left, _seqs(local[r]), rank_collectives(local[r], direction=options["direction"]))
    except BisectError as err:
        error = str(err)
    parts: List[Any] = [None] * world
    dist.all_gather_object(parts, (error, mine), group=group)  # the collectives' records go to everyone
    errors = [e for e, _ in parts if e]
    if errors:
        return _stop(me, error, errors)
    done = {r: v for _, part in parts for r, v in part.items()}
    units = merge_units({r: v[3] for r, v in done.items()})
    verdicts = []
    for unit in units:
        tensors: Dict[Tuple[int, str], Any] = {}
        failed = None
        try:
            for r in unit.ranks:
                if owner.get(r) == me and r in unit.records:
                    for key in tensor_keys(unit, r):
                        tensors[(r, key)] = dump.ranks[r].tensor(key)
        except PrecisionDiffError as err:
            tensors, failed = {}, str(err)
        got: Optional[List[Any]] = [None] * world if me == 0 else None
        dist.gather_object((failed, tensors), got, group=group, group_dst=0)
        if me == 0:
            verdicts.append((unit, _judge_gathered(unit, got)))
    if me != 0:
        return None
    return _result({r: v[:3] for r, v in done.items()}, verdicts, options["max_candidates"], started)


def _judge_gathered(unit: CollectiveUnit, got: List[Any]) -> CollectiveVerdict:
    """Judge ``unit`` from the tensors its ranks' holders sent."""
    failed = [f for f, _ in got if f]
    if failed:
        return CollectiveVerdict(False, reason=f"a rank's tensors could not be read: {failed[0]}")
    tensors = {k: t for _, part in got for k, t in part.items()}
    try:
        return judge_collective(unit, lambda r, key: tensors[(r, key)])
    except KeyError as err:  # raising here would leave the other processes waiting at the next gather
        return CollectiveVerdict(False, reason=f"rank {err.args[0][0]}'s tensor {err.args[0][1]} did not arrive")


def _stop(me: int, error: Optional[str], errors: List[str]) -> None:
    """Process 0 raises the first error of any process; the others their own, or return None."""
    if me == 0 or error is not None:
        raise BisectError(error if me != 0 else errors[0])
    return None


def _merge(per_rank: Dict[int, BisectResult], seqs_of: Dict[int, Dict[Any, int]],
           verdicts: List[Tuple[CollectiveUnit, CollectiveVerdict]], max_candidates: int,
           wall_s: float) -> RanksBisectResult:
    """The ranks' verdicts and the collectives' as one result (module docstring, step 3)."""
    # (order key, unit json, (rank, whether it is that rank's own culprit) or None for a collective)
    offending: List[Tuple[Tuple[int, int, int], Dict[str, Any], Optional[Tuple[int, bool]]]] = []
    for rank, res in per_rank.items():
        seqs = seqs_of[rank]
        for i, unit in enumerate(([res.culprit] if res.culprit else []) + list(res.candidates)):
            seq = seqs.get(_unit_key(unit), 1 << 60)
            offending.append(((_ORDER.get(unit["direction"], 2), seq, rank), dict(unit, rank=rank), (rank, i == 0)))
    for unit, v in verdicts:
        if v.judged and not v.passed:
            first = min(v.wrong_ranks, key=lambda r: (unit.seq.get(r, 1 << 60), r))
            offending.append(((_ORDER.get(unit.direction, 2), unit.seq.get(first, 1 << 60), first),
                              _collective_json(unit, v), None))
    offending.sort(key=lambda o: o[0])
    first_rank = min(per_rank)
    base = per_rank[first_rank]
    notes = _merged_notes(per_rank)
    culprit = path = evidence = None
    if offending:
        _, culprit, origin = offending[0]
        if origin is not None:
            if origin[1]:  # the rank's own culprit: its path and evidence
                path, evidence = per_rank[origin[0]].path, per_rank[origin[0]].evidence
            same = sorted(r for r, res in per_rank.items() if any(
                _unit_key(u) == _unit_key(culprit) for u in ([res.culprit] if res.culprit else []) + res.candidates))
            culprit["found_on_ranks"] = same
            others = [r for r in per_rank if r not in same]
            if others:
                notes.insert(0, f"{culprit['name']} in {culprit['scope'] or '<root>'} is over budget on rank(s) "
                                f"{same} only; on rank(s) {others} the same op call passes")
        else:
            evidence = {"ranks": culprit["group"]["ranks"], "inputs": "every rank's recorded input"}
    not_judged = [{"scope": u.scope, "name": u.name, "direction": u.direction, "call": u.call, "reason": v.reason}
                  for u, v in verdicts if not v.judged]
    if not_judged:
        names = sorted({f"{n['name']} ({n['reason']})" for n in not_judged})
        notes.append(f"{len(not_judged)} collective call(s) not judged: " + "; ".join(names[:3])
                     + (" ..." if len(names) > 3 else ""))
    notes.append("modules not replayed (a module of a parallel job calls collectives): each rank's ops and the "
                 "collectives are judged from the dumps")
    unjudged = sorted({n for res in per_rank.values() for n in res.unreplayable})
    if unjudged:
        notes.insert(0, f"WARNING: {len(unjudged)} op(s) could not be judged on the reference: "
                        f"{', '.join(unjudged[:4])}{' ...' if len(unjudged) > 4 else ''} (an op not registered in "
                        "this process: pass --workload with the module that defines it; an op with no reference "
                        "implementation: precisiondiff.register_reference)")
    finals = [res.final_error for res in per_rank.values() if res.confirmation.get("final_error_before") is not None]
    final_error = max(finals) if finals else 0.0
    if culprit is not None:
        verdict = "kernel"
    elif any(res.verdict == "accumulated" for res in per_rank.values()):
        verdict = "accumulated"
    else:
        verdict = "parity"
    cost: Dict[str, Any] = {k: sum(int(res.cost.get(k) or 0) for res in per_rank.values())
                            for k in ("dut_runs", "ref_runs", "units_isolated", "ops_replayed", "ops_reused")}
    cost["forward_equivalents"] = round(sum(float(res.cost.get("forward_equivalents") or 0)
                                            for res in per_rank.values()), 2)
    cost.update(ranks=len(per_rank), collectives_judged=sum(1 for _, v in verdicts if v.judged),
                wall_s=round(wall_s, 3))
    ranks = {r: {"verdict": res.verdict, "final_error": res.final_error,
                 "culprit": ({k: res.culprit[k] for k in ("kind", "scope", "name", "direction", "call", "known")
                              if k in res.culprit} if res.culprit else None), "candidates": len(res.candidates)}
             for r, res in per_rank.items()}
    accepted = sorted((dict(u, rank=r) for r, res in per_rank.items() for u in res.accepted),
                      key=lambda u: (_ORDER.get(u.get("direction"), 2), u["rank"]))
    collectives = {"judged": cost["collectives_judged"],
                   "wrong": [_collective_json(u, v) for u, v in verdicts if v.judged and not v.passed],
                   "passed": [{"scope": u.scope, "name": u.name, "direction": u.direction, "call": u.call,
                               "reduce_op": v.reduce_op, "ranks": u.ranks, "ratio": v.peer.get("ratio")}
                              for u, v in verdicts if v.judged and v.passed],
                   "not_judged": not_judged}
    return RanksBisectResult(
        verdict=verdict, dut=base.dut, ref=base.ref, culprit=culprit, path=path or [],
        confirmation={"final_error_before": final_error if finals else None,
                      "final_error_after_substitution": None},
        cost=cost, candidates=[o[1] for o in offending[1:1 + max_candidates]], evidence=evidence or {},
        growth=[] if culprit else base.growth, unreplayable=sorted({n for res in per_rank.values()
                                                                    for n in res.unreplayable}),
        final_error=final_error, parity_bound=base.parity_bound, notes=notes, ranks=ranks,
        collectives=collectives, culprits=[o[1] for o in offending], accepted=accepted)


def _merged_notes(per_rank: Dict[int, BisectResult]) -> List[str]:
    """Each rank's notes once, with the ranks it came from when not all of them."""
    seen: Dict[str, List[int]] = {}
    for rank, res in per_rank.items():
        for n in res.notes:
            if not n.startswith("modules not replayed"):  # said once, for the job (below)
                seen.setdefault(n, []).append(rank)
    return [n if len(rs) == len(per_rank) else f"(rank {', '.join(map(str, rs))}) {n}" for n, rs in seen.items()]


def ranks_summary_lines(r: RanksBisectResult) -> List[str]:
    """The terminal summary: the culprit and its rank, each rank's verdict, the collectives."""
    from .render import _num, summary_lines
    c = r.culprit
    head = f"bisect {r.dut} vs {r.ref} on {len(r.ranks)} ranks: {r.verdict.upper()}"
    if c is None or c["kind"] != "collective":
        lines = summary_lines(r)
        lines[0] = head
        if c is not None:
            lines[1] += f" on rank {c['rank']}"
    else:
        peer = c.get("peer") or {}
        lines = [head, f"culprit: collective {c['name']} in {c['scope'] or '<root>'} ({c['direction']}, call "
                       f"{c['call']}), group {c['group']['name']} ranks {c['group']['ranks']}"]
        if c.get("reduce_op"):
            lines.append(f"  recomputed from the {len(c['group']['ranks'])} ranks' inputs as {c['collective']} "
                         f"({c['reduce_op']}): rel-L2 {_num(peer.get('error'))} vs float32 accumulation rounded "
                         f"once {_num((peer.get('peers') or {}).get('float32'))}, bound {_num(peer.get('bound'))}; "
                         f"worst element {_num(peer.get('max_error'))} vs peer's {_num(peer.get('peer_max_error'))}")
        else:
            lines.append(f"  {peer.get('mismatched')} of {peer.get('numel')} elements differ from the ranks' inputs")
        lines.append(f"  wrong output on rank(s) {c['ranks']}")
        lines += [f"note: {n}" for n in r.notes]
        lines.append(f"cost: {r.cost.get('dut_runs')} DUT runs, {r.cost.get('ref_runs')} reference runs, "
                     f"{_num(r.cost.get('forward_equivalents'))} forward-equivalents, {_num(r.cost.get('wall_s'))} s")
    at = next((i for i, line in enumerate(lines) if line.startswith(("note:", "cost:"))), len(lines))
    extra = []
    for rank, info in sorted(r.ranks.items()):
        cu = info.get("culprit")
        extra.append(f"rank {rank}: {info['verdict'].upper()}" + (
            f", first over budget: {cu['kind']} {cu['name']} in {cu['scope'] or '<root>'} ({cu['direction']})"
            if cu else ", no op over budget"))
    col = r.collectives
    extra.append(f"collectives: {col.get('judged', 0)} recomputed from every rank's inputs, "
                 f"{len(col.get('wrong', []))} wrong"
                 + (f", {len(col.get('not_judged', []))} not judged" if col.get("not_judged") else ""))
    return lines[:at] + extra + lines[at:]
