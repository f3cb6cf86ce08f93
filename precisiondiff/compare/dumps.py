"""Comparing two dumps: :func:`compare` → :class:`Comparison` (rows in execution order).

A is the device under test (DUT), B the reference. Events are matched by
:mod:`precisiondiff.align`; each matched tensor pair becomes a row:

* tensor dumps (both sides hold data): element-wise :func:`~precisiondiff.comparators.compare_tensors`,
  judged end to end: relative L2 within 8 unit roundoffs of the run's precision, no NaN/Inf
  mismatch (per-kernel budgets are bisect's);
* otherwise the recorded statistics are compared (:mod:`precisiondiff.compare_stats`).

Rows of unmatched events have verdict ``"unmatched"``; they are reported, not failures.
The first divergence is the first ``"fail"`` row in execution order. With a *noise* dump (a
second capture of the DUT), a failing row whose error against the reference is within
``NOISE_FACTOR`` times the run-to-run error of the DUT is passed and marked ``within_noise``.
See docs/compare.md.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from .judge import Judge
from .rows import DEFAULT_SLOTS, UNINITIALIZED, compare_rank
from .shards import ShardLayout
from .suspects import bisect_hint, rank as _rank_suspects
from .stats import run_dtype
from .comparison import NOISE_FACTOR, Comparison, Row
from .comparison import add_notes as _add_notes, determinism as _determinism
from .comparison import first_divergence as _first_divergence, growth as _growth, summarize as _summarize
from ..errors import AlignmentError, PrecisionDiffError

__all__ = ["Row", "Comparison", "compare", "NOISE_FACTOR", "DEFAULT_SLOTS", "UNINITIALIZED"]

log = logging.getLogger(__name__)

PathLike = Union[str, Path]
Progress = Callable[[int, int], None]


# -- the comparison -----------------------------------------------------------------------

def compare(a: PathLike, b: PathLike, *, scope: Optional[str] = None, op: Optional[str] = None,
            direction: Optional[str] = None, kind: Optional[str] = None,
            only_failing: bool = False, inputs: bool = False, budgets: Any = None,
            device: Optional[str] = None, noise: Optional[PathLike] = None,
            progress: Optional[Progress] = None, jobs: int = 1,
            across_processes: bool = False) -> Comparison:
    """Align two dumps and compare every matched tensor pair.

    Args:
        a: the DUT dump directory.
        b: the reference dump directory.
        scope: keep events whose module path matches this regex.
        op: keep events whose op/module name matches this regex.
        direction: ``"forward"`` or ``"backward"``.
        kind: ``"module"``, ``"op"`` or ``"param"``.
        only_failing: keep only failing rows in :attr:`Comparison.rows` (the summary counts all).
        inputs: compare input slots too (default: outputs, grad inputs, parameter gradients).
        budgets: ``{"rel_l2": x}`` replaces the end-to-end bound (8 unit roundoffs of the run's
            precision) every tensor is judged against.
        device: run the element-wise comparisons there (``"cuda"``, ``"mlu"``).
        noise: a second capture of the DUT: rows within its run-to-run error are not divergence.
        progress: called as ``progress(done, total)`` after each event pair.
        jobs: compare the ranks of a multi-rank dump in this many worker processes (each
            holds one rank's dumps at a time: memory is bounded by ``jobs`` ranks).
        across_processes: run under ``torchrun``: each process compares its share of the ranks
            and process 0 gets the merged comparison; the others get None.

    Returns:
        The :class:`Comparison`.

    Raises:
        DumpError: a path is missing, not a dump, or damaged.
        AlignmentError: the dumps hold different models, steps, ranks or capture levels.

    Example:
        >>> cmp = compare("runs/dut", "runs/ref")  # doctest: +SKIP
        >>> cmp.first_divergence["scope"], cmp.exit_code  # doctest: +SKIP
    """
    from ..store import load
    dump_a, dump_b = load(a), load(b)
    dump_n = load(noise) if noise is not None else None
    for what, d in (("A", dump_a), ("B", dump_b)) + ((("noise", dump_n),) if dump_n else ()):
        if not d.complete:
            log.warning("%s (%s) is a partial dump: the capture did not finish", what, d.path)
    ranks_a, ranks_b = sorted(dump_a.ranks), sorted(dump_b.ranks)
    # every rank of a job against one single-process reference (data or tensor parallel: what
    # is replicated compares as is, a shard differs in shape and stays unmatched)
    single_ref = len(ranks_b) == 1 and len(ranks_a) > 1 and not dump_b.meta.get("world_size", 1) > 1
    if ranks_a != ranks_b and not single_ref:
        raise AlignmentError(f"the dumps hold different ranks: A {ranks_a}, B {ranks_b}; "
                             "capture both with the same --ranks and world size")
    _check_meta(dump_a.meta, dump_b.meta, dump_n.meta if dump_n else None, noise)
    judge = Judge(budgets)
    judge.single_ref = single_ref
    judge.run_dtype = run_dtype(dump_a.meta.get("target"))
    from ..capture.filters import compile_regex
    scope_re, op_re = compile_regex(scope, "--scope"), compile_regex(op, "--op")
    if device is not None:
        from ..errors import TargetError
        from ..runtime.targets import Target
        try:
            Target.parse(device).check_available()
        except TargetError as err:
            raise TargetError(f"--device {device}: {err}".replace("pick another --target", "pick another --device")) from err

    keep = _Keep(scope_re, op_re, direction, kind)
    rows: List[Row] = []
    notes: List[str] = []
    per_rank: Dict[int, Dict[str, Any]] = {}
    ref_rank = ranks_b[0] if single_ref else None
    if across_processes:
        from .parallel import compare_ranks_across_processes
        gathered = compare_ranks_across_processes(_rank_worker, a, b, noise, ranks_a, ref_rank, scope=scope,
                                                  op=op, direction=direction, kind=kind, inputs=inputs,
                                                  budgets=budgets, device=device)
        if gathered is None:
            return None  # type: ignore[return-value] - process 0 holds the comparison
        results = iter(gathered)
    elif jobs > 1 and len(ranks_a) > 1:
        from .parallel import compare_ranks_in_pool
        results = compare_ranks_in_pool(_rank_worker, a, b, noise, ranks_a, ref_rank, jobs, scope=scope,
                                        op=op, direction=direction, kind=kind, inputs=inputs,
                                        budgets=budgets, device=device)
    else:
        results = ((rank, _one_rank(dump_a, dump_b, dump_n, rank, ref_rank, keep, inputs, judge, device,
                                    progress, notes), []) for rank in ranks_a)
    for rank, rank_rows, rank_notes in results:
        notes += [n for n in rank_notes if n not in notes]
        rows.extend(rank_rows)
        if len(ranks_a) > 1:
            per_rank[rank] = _summarize(rank_rows)
            per_rank[rank]["first_divergence"] = _first_divergence(rank_rows)
    summary = _summarize(rows)
    if not rows and (scope or op or direction or kind):
        raise PrecisionDiffError("the filters (--scope/--op/--direction/--kind) matched no event of "
                                 "either dump; `precisiondiff ls A` shows the scopes and names")
    comparison = Comparison(a=str(a), b=str(b), rows=rows, summary=summary,
                            first_divergence=_first_divergence(rows), meta_a=dict(dump_a.meta),
                            meta_b=dict(dump_b.meta), ranks=per_rank, notes=notes,
                            noise=str(noise) if noise is not None else None)
    comparison.growth = _growth(rows)
    comparison.suspects = _rank_suspects(rows)
    if comparison.suspects:
        comparison.notes.append(bisect_hint(dump_a.meta, dump_b.meta, str(a), str(b), comparison.suspects))
    if _same_target(dump_a.meta, dump_b.meta):
        comparison.determinism = _determinism(rows, dump_a.meta.get("target"))
    _add_notes(comparison)
    from ..store.notes import dump_conversion_notes, meta_notes
    for side, dump in (("A", dump_a), ("B", dump_b)):
        for rank, sub in sorted(dump.ranks.items()):
            where = f"{side} rank{rank}" if len(dump.ranks) > 1 else side
            comparison.notes += [f"{where}: {n}" for n in meta_notes(sub.meta) + dump_conversion_notes(sub)]
    if only_failing:
        comparison.rows = [r for r in rows if r.verdict == "fail"]
    for d in (dump_a, dump_b, dump_n):
        if d is not None:
            d.close()
    return comparison


def _check_meta(ma: Mapping[str, Any], mb: Mapping[str, Any], mn: Optional[Mapping[str, Any]],
                noise: Any) -> None:
    la, lb = ma.get("level"), mb.get("level")
    if la and lb and la != lb and "all" not in (la, lb):
        raise AlignmentError(f"A was captured with --level {la}, B with --level {lb}: nothing "
                             "matches; capture both at the same level")
    if mn is not None and mn.get("target") != ma.get("target"):
        raise AlignmentError(f"the noise dump {noise} is of target {mn.get('target')}, not the "
                             f"DUT's {ma.get('target')}: pass a second capture of the DUT")


def _same_target(ma: Mapping[str, Any], mb: Mapping[str, Any]) -> bool:
    return bool(ma.get("target")) and ma.get("target") == mb.get("target")


class _Keep:
    """The event filter of --scope/--op/--direction/--kind (picklable, for worker processes)."""

    def __init__(self, scope_re: Any, op_re: Any, direction: Optional[str], kind: Optional[str]) -> None:
        self.scope_re, self.op_re, self.direction, self.kind = scope_re, op_re, direction, kind

    def __call__(self, ev: Any) -> bool:
        return ((self.scope_re is None or self.scope_re.search(ev.scope) is not None)
                and (self.op_re is None or self.op_re.search(ev.name) is not None)
                and (self.direction is None or ev.direction == self.direction)
                and (self.kind is None or ev.kind == self.kind))

    def without_kind(self) -> "_Keep":
        """The same filter for every kind: alignment needs the module events around the ops
        (their module calls, a script's own ops) even when only ops are compared."""
        return _Keep(self.scope_re, self.op_re, self.direction, None)


def _rank_worker(a: str, b: str, noise: Optional[str], rank: int, ref_rank: Optional[int],
                 options: dict) -> Tuple[int, list, List[str]]:
    """Compare one rank in a worker process (rank-parallel compare, :mod:`.parallel`)."""
    from ..capture.filters import compile_regex
    from ..store import load
    dump_a, dump_b = load(a), load(b)
    dump_n = load(noise) if noise is not None else None
    judge = Judge(options["budgets"])
    judge.run_dtype = run_dtype(dump_a.meta.get("target"))
    keep = _Keep(compile_regex(options["scope"], "--scope"), compile_regex(options["op"], "--op"),
                 options["direction"], options["kind"])
    notes: List[str] = []
    rows = _one_rank(dump_a, dump_b, dump_n, rank, ref_rank, keep, options["inputs"], judge,
                     options["device"], None, notes)
    return rank, rows, notes


def _one_rank(dump_a: Any, dump_b: Any, dump_n: Any, rank: int, ref_rank: Optional[int], keep: Callable,
              inputs: bool, judge: Judge, device: Optional[str], progress: Optional[Progress],
              notes: List[str]) -> List[Row]:
    """The rows of one rank (against B's same rank, or B's single rank ``ref_rank``)."""
    ra, rb = dump_a.ranks[rank], dump_b.ranks[ref_rank if ref_rank is not None else rank]
    judge.single_ref = ref_rank is not None
    judge.rank = rank
    if judge.single_ref:
        if judge.layout is None or judge.layout.dump is not dump_a:
            judge.layout = ShardLayout(dump_a)
        judge.shards = judge.layout.sharded_keys(rank)
    else:
        judge.shards = set()
    rn = dump_n.ranks.get(rank) if dump_n else None
    return list(compare_rank(ra, rb, rn, keep, inputs, judge, device, progress, notes))
