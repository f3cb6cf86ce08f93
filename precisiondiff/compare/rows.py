"""The rows of one rank: its events aligned with the reference's, each matched tensor pair judged
(:mod:`.judge`), unmatched events and slots reported, DTensor shards against a single-process
reference reassembled or combined (:mod:`.shards`)."""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterator, List, Optional

from .align import Alignment, EventRef, align_events
from .comparison import Row
from .judge import Judge, apply_noise, bitwise, judge_row
from .precision import RunPrecision
from .shard_rows import shard_row
from .suspects import InputErrors, set_growth
from ..errors import DumpError

__all__ = ["DEFAULT_SLOTS", "UNINITIALIZED", "compare_rank"]

Progress = Callable[[int, int], None]

# Slots compared by default: what an event produces. Inputs are the outputs of earlier events
# (compared there); include them with ``inputs=True``.
DEFAULT_SLOTS = ("output", "grad_input", "param_grad")

# Allocation ops return uninitialized memory: their outputs (and records whose stored data is
# such an output, e.g. an in-place op's result recorded before it ran) are not compared.
UNINITIALIZED = re.compile(r"\baten\.(new_)?empty")


def _refs(events: List[Any]) -> List[EventRef]:
    out = []
    for i, ev in enumerate(events):
        shapes = tuple(tuple(t.shape) for t in ev.tensors if t.slot.startswith(("output", "grad_input")))
        out.append(EventRef(i, ev.seq, ev.kind, ev.scope, ev.name, ev.direction, ev.call, ev.step, shapes))
    return out


def _wanted(slot: str, inputs: bool) -> bool:
    return inputs or slot.startswith(DEFAULT_SLOTS)


def compare_rank(da: Any, db: Any, dn: Any, keep: Callable, inputs: bool, judge: Judge,
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
    # full tensors gathered at capture are compared as their shards' rows against a single reference
    kind = getattr(keep, "kind", None)
    wide = keep.without_kind() if kind else keep  # --kind: aligned with every kind, rows of that kind
    ev_a = [e for e in ev_a if wide(e) and not (judge.single_ref and e.kind == "gathered")]
    ev_b = [e for e in ev_b if wide(e)]
    scripts = (da.meta.get("target") == "script", db.meta.get("target") == "script")
    alignment: Alignment = align_events(_refs(ev_a), _refs(ev_b), script=scripts)
    if kind:
        alignment.order = [(i, j) for i, j in alignment.order
                           if (ev_a[i] if i is not None else ev_b[j]).kind == kind]
    notes.extend(n for n in alignment.notes if n not in notes)
    noise_of: Dict[int, Any] = {}
    if dn is not None:
        ev_n = [e for e in dn.events() if wide(e)]
        al_n = align_events(_refs(ev_a), _refs(ev_n))
        noise_of = {p.a: ev_n[p.b] for p in al_n.pairs}
    how = {p.a: p.how for p in alignment.pairs}
    input_errors = InputErrors(da, db, device)
    precision, target_dtype = RunPrecision(judge.run_dtype), judge.run_dtype
    try:
        yield from _rows_in_order(da, db, dn, ev_a, ev_b, alignment, noise_of, how, inputs, judge, device,
                                  input_errors, precision, progress)
    finally:
        judge.run_dtype = target_dtype
    note = precision.note()
    if note and note not in notes:
        notes.append(note)


def _rows_in_order(da: Any, db: Any, dn: Any, ev_a: List[Any], ev_b: List[Any], alignment: Alignment,
                   noise_of: Dict[int, Any], how: Dict[int, str], inputs: bool, judge: Judge,
                   device: Optional[str], input_errors: InputErrors, precision: RunPrecision,
                   progress: Optional[Progress]) -> Iterator[Row]:
    total = len(alignment.order)
    for done, (i, j) in enumerate(alignment.order, start=1):
        if i is not None:  # judged at the precision A's run has computed in so far
            judge.run_dtype = precision.see(ev_a[i])
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
               judge: Judge, device: Optional[str], input_errors: Optional[InputErrors] = None
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
        row.bitwise = bitwise(ra, rb)
        if judge.single_ref and (ra.key in judge.shards or tuple(ra.shape) != tuple(rb.shape)):
            shard_row(row, da, db, ra, rb, judge, device)
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
        judge_row(row, da, db, ra, rb, judge, device)
        if input_errors is not None and row.mode == "tensors":
            input_errors.remember(ra, rb, row.error)
        rn = recs_n.get(ra.slot)
        if rn is not None and row.verdict == "fail":
            apply_noise(row, da, dn, ra, rn, device)
        yield row
    for rb in eb.tensors:  # B slots A lacks
        if _wanted(rb.slot, inputs) and how != "fused" and rb.slot not in {t.slot for t in ea.tensors}:
            yield Row(key=rb.key, seq=ea.seq, rank=eb.rank, step=eb.step, scope=eb.scope,
                      name=eb.name, kind=eb.kind, direction=eb.direction, call=eb.call,
                      slot=rb.slot, dtype_a=None, dtype_b=rb.dtype, shape=list(rb.shape),
                      seq_b=eb.seq, side="b", verdict="unmatched", mode="none",
                      message=f"A's {ea.name} has no slot {rb.slot}")


