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
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from .align import Alignment, EventRef, align_events
from .constants import constant_fill_note, rest_metrics
from .suspects import InputErrors, bisect_hint, rank as _rank_suspects, set_growth
from .stats import compare_stats, judge_stats, run_dtype, stats_error
from .comparison import NOISE_FACTOR, Comparison, Row, _finite, _sort_value  # noqa: F401
from .comparison import add_notes as _add_notes, determinism as _determinism  # noqa: F401
from .comparison import first_divergence as _first_divergence, growth as _growth, summarize as _summarize
from ..errors import AlignmentError, DumpError, PrecisionDiffError

__all__ = ["Row", "Comparison", "compare", "NOISE_FACTOR", "DEFAULT_SLOTS", "UNINITIALIZED"]

log = logging.getLogger(__name__)

# Slots compared by default: what an event produces. Inputs are the outputs of earlier events
# (compared there); include them with ``inputs=True``.
DEFAULT_SLOTS = ("output", "grad_input", "param_grad")

# Allocation ops return uninitialized memory: their outputs (and records whose stored data is
# such an output, e.g. an in-place op's result recorded before it ran) are not compared.
UNINITIALIZED = re.compile(r"\baten\.(new_)?empty")

PathLike = Union[str, Path]
Progress = Callable[[int, int], None]


# -- helpers ------------------------------------------------------------------------------

def _refs(events: List[Any]) -> List[EventRef]:
    out = []
    for i, ev in enumerate(events):
        shapes = tuple(tuple(t.shape) for t in ev.tensors if t.slot.startswith(("output", "grad_input")))
        out.append(EventRef(i, ev.seq, ev.kind, ev.scope, ev.name, ev.direction, ev.call, ev.step, shapes))
    return out


def _wanted(slot: str, inputs: bool) -> bool:
    return inputs or slot.startswith(DEFAULT_SLOTS)


class _Judge:
    """The end-to-end rule for rows of two whole runs, with an optional ``rel_l2`` override."""

    def __init__(self, budgets: Any) -> None:
        from .. import comparators as C
        self._C = C
        if budgets is not None and (not isinstance(budgets, Mapping) or set(budgets) - {"rel_l2"}
                                    or not isinstance(budgets.get("rel_l2"), (int, float))):
            raise PrecisionDiffError(f"compare budgets: only {{'rel_l2': number}} is accepted, not "
                                     f"{budgets!r} (per-op kernel budgets are bisect's: --budget)")
        self._overrides = budgets
        self.run_dtype: Optional[str] = None  # the DUT run's dtype (from its target)
        self.single_ref = False  # every rank of A against B's single rank: shards are not compared
        self.shards: set = set()  # keys of the rank being compared whose DTensor is not replicated

    def op_class(self, name: str) -> str:
        return str(self._C.op_class(name))

    def end_to_end(self, dtype: str, key: str, m: Mapping[str, Any], error: Optional[float]) -> Tuple[bool, str]:
        """Judge one tensor of two whole runs: NaN/Inf mismatches always fail; otherwise its
        relative L2 error (diff2) against ``end_to_end_bound`` of A's dtype (or ``rel_l2`` from
        the overrides). Per-element kernel budgets belong to isolated kernels (bisect): here
        every tensor carries its inputs' error too."""
        from ..store.schema import dtype_from_name
        bound = self._C.end_to_end_bound(dtype_from_name(dtype))
        if self.run_dtype:  # a float32 tensor of a bf16 run inherits bf16 error
            bound = max(bound, self._C.end_to_end_bound(dtype_from_name(self.run_dtype)))
        rule = f"{self._C.END_TO_END_FACTOR:g} unit roundoffs of the run's precision"
        if isinstance(self._overrides, Mapping) and isinstance(self._overrides.get("rel_l2"), (int, float)):
            bound, rule = float(self._overrides["rel_l2"]), "the rel_l2 override"
        nan_mm, inf_mm = int(m.get("nan_mismatch") or 0), int(m.get("inf_mismatch") or 0)
        numel = int(m.get("numel") or 0)
        if nan_mm or inf_mm:
            return False, (f"{key}: {nan_mm} NaN and {inf_mm} Inf mismatches of {numel} elements. "
                           "Hint: precisiondiff scan A finds the first event that produced them.")
        if error is None or error <= bound:
            return True, ""
        return False, (f"{key}: relative L2 error {error:.3g} > {bound:.3g} ({rule}); worst element: abs err {_fmt(m.get('max_abs_err'))}, rel err "
                       f"{_fmt(m.get('max_rel_err'))}, {_fmt(m.get('max_ulp_error'))} ULP. "
                       "Hint: precisiondiff bisect tells whether this op's own arithmetic is at fault.")


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _verdict_parts(verdict: Any) -> Tuple[bool, str]:
    if isinstance(verdict, bool):
        return verdict, ""
    ok = getattr(verdict, "passed", None)
    if ok is None:
        ok = getattr(verdict, "ok", None)
    if ok is None:
        ok = str(getattr(verdict, "verdict", "pass")) == "pass"
    return bool(ok), str(getattr(verdict, "message", "") or "")


def _num(m: Mapping[str, Any], *names: str) -> Optional[float]:
    """The first metric present among ``names`` as a float (``"inf"`` strings included)."""
    for n in names:
        v = m.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if v in ("inf", "-inf", "nan"):
            return float(v)
    return None


def _is_float(dtype: Optional[str]) -> bool:
    return bool(dtype) and dtype.startswith(("float", "bfloat"))  # type: ignore[union-attr]


def _compare_tensor_pair(dump_a: Any, dump_b: Any, rec_a: Any, rec_b: Any, device: Optional[str]
                         ) -> Any:
    """Element-wise metrics of one pair (a TensorMetrics; a dict for integer/bool tensors),
    read lazily and dropped after."""
    from ..comparators import compare_tensors
    ta, tb = dump_a.tensor(rec_a.key), dump_b.tensor(rec_b.key)
    if device:
        ta, tb = ta.to(device, non_blocking=True), tb.to(device, non_blocking=True)
    if not (_is_float(rec_a.dtype) and _is_float(rec_b.dtype)):
        mismatched = int((ta.to(tb.dtype) != tb).sum()) if ta.shape == tb.shape else -1
        return {"mismatched": mismatched, "numel": int(tb.numel())}
    return compare_tensors(ta, tb)


def _bitwise(rec_a: Any, rec_b: Any) -> Optional[bool]:
    fa, fb = rec_a.stats.get("fingerprint"), rec_b.stats.get("fingerprint")
    if rec_a.dtype != rec_b.dtype or fa is None or fb is None:
        return None
    return fa == fb


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
    judge = _Judge(budgets)
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
    from ..store.notes import meta_notes
    for side, dump in (("A", dump_a), ("B", dump_b)):
        for rank, sub in sorted(dump.ranks.items()):
            where = f"{side} rank{rank}" if len(dump.ranks) > 1 else side
            comparison.notes += [f"{where}: {n}" for n in meta_notes(sub.meta)]
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


def _rank_worker(a: str, b: str, noise: Optional[str], rank: int, ref_rank: Optional[int],
                 options: dict) -> Tuple[int, list, List[str]]:
    """Compare one rank in a worker process (rank-parallel compare, :mod:`.parallel`)."""
    from ..capture.filters import compile_regex
    from ..store import load
    dump_a, dump_b = load(a), load(b)
    dump_n = load(noise) if noise is not None else None
    judge = _Judge(options["budgets"])
    judge.run_dtype = run_dtype(dump_a.meta.get("target"))
    keep = _Keep(compile_regex(options["scope"], "--scope"), compile_regex(options["op"], "--op"),
                 options["direction"], options["kind"])
    notes: List[str] = []
    rows = _one_rank(dump_a, dump_b, dump_n, rank, ref_rank, keep, options["inputs"], judge,
                     options["device"], None, notes)
    return rank, rows, notes


def _one_rank(dump_a: Any, dump_b: Any, dump_n: Any, rank: int, ref_rank: Optional[int], keep: Callable,
              inputs: bool, judge: "_Judge", device: Optional[str], progress: Optional[Progress],
              notes: List[str]) -> List[Row]:
    """The rows of one rank (against B's same rank, or B's single rank ``ref_rank``)."""
    ra, rb = dump_a.ranks[rank], dump_b.ranks[ref_rank if ref_rank is not None else rank]
    judge.single_ref = ref_rank is not None
    judge.shards = _not_replicated(ra) if judge.single_ref else set()
    rn = dump_n.ranks.get(rank) if dump_n else None
    return list(_compare_rank(ra, rb, rn, keep, inputs, judge, device, progress, notes))


def _not_replicated(dump: Any) -> set:
    """Keys of records that hold a DTensor shard or partial sum (placements other than ``R``)."""
    from ..store.reader import iter_index
    keys = set()
    for _, obj, _ in iter_index(dump.path, strict=False):
        for rec in (obj or {}).get("tensors") or ():
            placements = rec.get("placements")
            if placements and any(p not in ("R", "Replicate()") for p in placements):
                keys.add(rec["key"])
    return keys


def _compare_rank(da: Any, db: Any, dn: Any, keep: Callable, inputs: bool, judge: _Judge,
                  device: Optional[str], progress: Optional[Progress], notes: List[str]
                  ) -> Iterator[Row]:
    ev_a, ev_b = list(da.events()), list(db.events())
    for side, d in (("A", da), ("B", db)):
        if d.damaged_lines:
            raise DumpError(f"{side} ({d.path}): index.jsonl line {d.damaged_lines[0]} is corrupted "
                            f"({len(d.damaged_lines)} damaged line(s)); run `precisiondiff verify {d.path}`")
    la, lb = da.meta.get("level"), db.meta.get("level")
    if la != lb and "all" in (la, lb):  # compare only the kinds both levels record
        other = lb if la == "all" else la
        kinds = {"op"} if other == "op" else {"module", "param"}
        ev_a = [e for e in ev_a if e.kind in kinds]
        ev_b = [e for e in ev_b if e.kind in kinds]
        what = "op" if other == "op" else "module and parameter-gradient"
        notes.append(f"A was captured at level {la}, B at {lb}: only {what} events are compared")
    ev_a = [e for e in ev_a if keep(e)]
    ev_b = [e for e in ev_b if keep(e)]
    alignment: Alignment = align_events(_refs(ev_a), _refs(ev_b))
    noise_of: Dict[int, Any] = {}
    if dn is not None:
        ev_n = [e for e in dn.events() if keep(e)]
        al_n = align_events(_refs(ev_a), _refs(ev_n))
        noise_of = {p.a: ev_n[p.b] for p in al_n.pairs}
    how = {p.a: p.how for p in alignment.pairs}
    total = len(alignment.order)
    input_errors = InputErrors(da, db, device)
    for done, (i, j) in enumerate(alignment.order, start=1):
        if i is not None and j is not None:
            pair = list(_pair_rows(da, db, dn, ev_a[i], ev_b[j], noise_of.get(i), how[i], inputs,
                                   judge, device, input_errors))
            set_growth(pair, ev_a[i], ev_b[j], input_errors)
            yield from pair
        elif i is not None:
            yield from _unmatched_rows(ev_a[i], "a", inputs)
        else:
            yield from _unmatched_rows(ev_b[j], "b", inputs)
        if progress is not None:
            progress(done, total)


def _unmatched_rows(ev: Any, side: str, inputs: bool) -> Iterator[Row]:
    recs = [t for t in ev.tensors if _wanted(t.slot, inputs)] or [None]
    other = "B" if side == "a" else "A"
    for t in recs:
        yield Row(key=t.key if t else f"{ev.scope}/{ev.name}#{ev.call}:{ev.direction}",
                  seq=ev.seq, rank=ev.rank, step=ev.step, scope=ev.scope, name=ev.name,
                  kind=ev.kind, direction=ev.direction, call=ev.call, slot=t.slot if t else "",
                  dtype_a=t.dtype if t and side == "a" else None,
                  dtype_b=t.dtype if t and side == "b" else None,
                  shape=list(t.shape) if t else None, side=side, verdict="unmatched", mode="none",
                  match="none", message=f"no matching event in {other}")


def _pair_rows(da: Any, db: Any, dn: Any, ea: Any, eb: Any, en: Any, how: str, inputs: bool,
               judge: _Judge, device: Optional[str], input_errors: Optional[InputErrors] = None
               ) -> Iterator[Row]:
    recs_b = {t.slot: t for t in eb.tensors}
    recs_n = {t.slot: t for t in en.tensors} if en is not None else {}
    for ra in ea.tensors:
        if not _wanted(ra.slot, inputs) or (how == "fused" and not ra.slot.startswith("output")):
            continue
        row = Row(key=ra.key, seq=ea.seq, rank=ea.rank, step=ea.step, scope=ea.scope, name=ea.name,
                  kind=ea.kind, direction=ea.direction, call=ea.call, slot=ra.slot,
                  dtype_a=ra.dtype, dtype_b=None, shape=list(ra.shape), seq_b=eb.seq, match=how)
        rb = recs_b.get(ra.slot)
        if rb is None:
            row.verdict, row.side, row.mode = "unmatched", "a", "none"
            row.message = f"B's {eb.name} has no slot {ra.slot}"
            yield row
            continue
        row.key_b, row.dtype_b = rb.key, rb.dtype
        row.bitwise = _bitwise(ra, rb)
        if judge.single_ref and (ra.key in judge.shards or tuple(ra.shape) != tuple(rb.shape)):
            row.verdict, row.side, row.mode = "unmatched", "a", "shard"
            row.message = (f"{ra.key}: a shard or partial sum on rank {ea.rank} (shape {list(ra.shape)}, "
                           f"{list(rb.shape)} in the single-process reference): not compared")
            yield row
            continue
        if tuple(ra.shape) != tuple(rb.shape):
            row.verdict = "fail"
            row.message = f"{ra.key}: shape {list(ra.shape)} in A, {list(rb.shape)} in B"
            yield row
            continue
        if UNINITIALIZED.search(ea.name) or UNINITIALIZED.search(ra.data_key or ""):
            row.mode = "uninitialized"
            row.message = "uninitialized memory (an allocation op's output): not compared"
            yield row
            continue
        _judge_row(row, da, db, ra, rb, judge, device)
        if input_errors is not None and row.mode == "tensors":
            input_errors.remember(ra, rb, row.error)
        rn = recs_n.get(ra.slot)
        if rn is not None and row.verdict == "fail":
            _apply_noise(row, da, dn, ra, rn, device)
        yield row
    for rb in eb.tensors:  # B slots A lacks
        if _wanted(rb.slot, inputs) and how != "fused" and rb.slot not in {t.slot for t in ea.tensors}:
            yield Row(key=rb.key, seq=ea.seq, rank=eb.rank, step=eb.step, scope=eb.scope,
                      name=eb.name, kind=eb.kind, direction=eb.direction, call=eb.call,
                      slot=rb.slot, dtype_a=None, dtype_b=rb.dtype, shape=list(rb.shape),
                      seq_b=eb.seq, side="b", verdict="unmatched", mode="none",
                      message=f"A's {ea.name} has no slot {rb.slot}")


def _judge_row(row: Row, da: Any, db: Any, ra: Any, rb: Any, judge: _Judge,
               device: Optional[str]) -> None:
    if ra.has_data and rb.has_data:
        row.mode = "tensors"
        tm = _compare_tensor_pair(da, db, ra, rb, device)
        m = tm if isinstance(tm, dict) else dict(tm.to_dict())
        row.metrics = m
        if not (_is_float(ra.dtype) and _is_float(rb.dtype)):
            row.error = 0.0 if m["mismatched"] == 0 else 1.0
            row.verdict = "pass" if m["mismatched"] == 0 else "fail"
            if row.verdict == "fail":
                row.message = f"{ra.key}: {m['mismatched']} of {m['numel']} elements differ"
            return
        row.op_class = judge.op_class(row.name)
        row.error = _num(m, "diff2")
        if row.error is None and (m.get("nan_mismatch") or m.get("inf_mismatch")):
            row.error = math.nan
        ok, msg = judge.end_to_end(ra.dtype, ra.key, m, row.error)
        row.ulp = _num(m, "max_ulp")
        if not ok:
            ok, msg = _judge_fills(row, da, db, ra, rb, judge, device, msg)
    else:
        row.mode = "stats"
        m = compare_stats(ra.stats, rb.stats)
        row.metrics = m
        ok, msg = judge_stats(m, ra.dtype, key=ra.key, run_dtype=judge.run_dtype)
        row.error = stats_error(m)
        note = None if ok else constant_fill_note(ra.stats, rb.stats, ra.dtype, rb.dtype)
        if note:
            ok, row.note, row.error = True, note, 0.0
    row.verdict = "pass" if ok else "fail"
    row.message = "" if ok else msg


def _judge_fills(row: Row, da: Any, db: Any, ra: Any, rb: Any, judge: _Judge, device: Optional[str],
                 message: str) -> Tuple[bool, str]:
    """A failing tensor row whose only difference is dtype fill constants at the same positions
    (constants.py): judged on the other elements, with a note. Else the verdict stands."""
    ta, tb = da.tensor(ra.key), db.tensor(rb.key)
    rest = rest_metrics(ta.to(device) if device else ta, tb.to(device) if device else tb)
    if rest is None:
        return False, message
    m, row.note = rest
    row.metrics, row.error, row.ulp = m, _num(m, "diff2"), _num(m, "max_ulp")
    return judge.end_to_end(ra.dtype, ra.key, m, row.error)


def _apply_noise(row: Row, da: Any, dn: Any, ra: Any, rn: Any, device: Optional[str]) -> None:
    if ra.has_data and rn.has_data and row.mode == "tensors":
        nm = _compare_tensor_pair(da, dn, ra, rn, device)
        noise_m = nm if isinstance(nm, dict) else dict(nm.to_dict())
        err, floor = _num(row.metrics, "max_abs_err"), _num(noise_m, "max_abs_err")
    else:
        noise_m = compare_stats(ra.stats, rn.stats)
        err, floor = stats_error(row.metrics), stats_error(noise_m)
    row.noise = floor
    if err is not None and floor and err <= NOISE_FACTOR * floor:
        row.verdict, row.within_noise = "pass", True
        row.message = (f"within run-to-run noise: error {err:.3g} <= {NOISE_FACTOR:g} x noise "
                       f"{floor:.3g}")
