"""Matching the events of two dumps: :func:`align_events`. Pure Python, no torch.

Rules (see docs/compare.md):

* **module** and **param** events match by ``(step, kind, scope, name, direction, call)``:
  the same module class at the same path, the n-th call of it in the step.
* **op** events are grouped by ``(step, direction, scope, segment)``, where *segment* is the
  number of events of the enclosing module (same scope and direction) that finished before
  the op: the ops of one module call. Inside a group the op-name sequences are aligned with
  a longest-matching-block alignment (``difflib.SequenceMatcher``, no junk heuristic), so
  ops present on one side only (an extra cast, a copy) are left unmatched while the others
  still pair up. In a replaced stretch (a fused kernel on one side where the other runs
  three ATen ops) the *last* ops of both stretches are paired as ``"fused"`` when their
  output shapes agree: the fused kernel's output is the stretch's output. A pair of one name
  whose output shapes disagree is re-paired with an op of that name in the group whose shapes
  fit (:func:`_repair_by_shape`): sibling ops that ran in another order, an extra op of the name. Dtype casts
  (``aten._to_copy``) are aligned after the other ops, within the stretch between two matched
  ones: a run in another dtype adds casts by design, and an extra cast next to a repeated
  pattern (``mul mul sum``) must not shift the pattern's pairing.
* Every event ends up in exactly one place: a pair, or the unmatched list of its side.
* A wrapper's prefix on one side (``module.`` of DDP/DeepSpeed/Megatron, ``_orig_mod.``,
  ``_fsdp_wrapped_module.``) is removed before matching (:mod:`.unwrap`), with a note.
* A script's dump against a workload's: the script's own ops (at the root before the first
  module call of the step, after its last backward module call, and parameter updates) are
  left unmatched without being aligned, with a note: a workload's dump starts at the model's
  call and has none of them.

Structural checks raise :class:`~precisiondiff.errors.AlignmentError` (different steps,
different ranks, or different models: too few events match).
"""
from __future__ import annotations

import bisect
import difflib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import AlignmentError
from .unwrap import unwrap

__all__ = ["EventRef", "Pair", "Alignment", "align_events", "check_same_structure"]

# Below this fraction of matched events (of the larger side) the dumps are declared to hold
# different models rather than compared into hundreds of meaningless unmatched rows.
MIN_MATCHED_FRACTION = 0.5


@dataclass(frozen=True)
class EventRef:
    """What alignment needs to know about an event (no tensors).

    Attributes:
        index: position of the event in its dump's event list (0-based).
        seq: execution order.
        kind: ``"module"``, ``"op"`` or ``"param"``.
        scope: module path, ``""`` for the root.
        name: op name or module class.
        direction: ``"forward"`` or ``"backward"``.
        call: n-th call of (scope, name, direction) in the step.
        step: training step.
        out_shapes: shapes of the output slots (used to pair fused stretches).
    """

    index: int
    seq: int
    kind: str
    scope: str
    name: str
    direction: str
    call: int = 0
    step: int = 0
    out_shapes: Tuple[Tuple[int, ...], ...] = ()

    @property
    def ident(self) -> Tuple:
        """The key module and param events match on."""
        return (self.step, self.kind, self.scope, self.name, self.direction, self.call)


@dataclass(frozen=True)
class Pair:
    """Two matched events, by their indices; ``how`` is ``"exact"`` or ``"fused"``."""

    a: int
    b: int
    how: str = "exact"


@dataclass
class Alignment:
    """The result of :func:`align_events`.

    Attributes:
        pairs: matched events.
        unmatched_a: indices of events of A with no partner.
        unmatched_b: indices of events of B with no partner.
        order: the merged execution order: ``(a_index | None, b_index | None)`` tuples; every
            pair and every unmatched event appears once, unmatched B events right after the
            A event matched to their nearest matched predecessor.
        notes: sentences for the user (a wrapper prefix removed from one side's paths).
    """

    pairs: List[Pair] = field(default_factory=list)
    unmatched_a: List[int] = field(default_factory=list)
    unmatched_b: List[int] = field(default_factory=list)
    order: List[Tuple[Optional[int], Optional[int]]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _segments(events: Sequence[EventRef]) -> Dict[int, Tuple]:
    """Group key of each op event: (step, direction, scope, module-call segment)."""
    finished: Dict[Tuple, int] = defaultdict(int)  # (step, direction, scope) -> module events done
    groups: Dict[int, Tuple] = {}
    for ev in sorted(events, key=lambda e: (e.step, e.seq)):
        where = (ev.step, ev.direction, ev.scope)
        if ev.kind == "module":
            finished[where] += 1
        elif ev.kind == "op":
            groups[ev.index] = where + (finished[where],)
    return groups


# dtype casts: a run in another dtype adds or moves them by design (T5's LayerNorm casts to the
# weight's dtype only in bf16/fp16), so they must not steer the alignment of the arithmetic.
_CASTS = ("aten._to_copy.", "aten.to.", "aten._to_copy", "aten.to")


def _is_cast(ev: EventRef) -> bool:
    return ev.name.startswith(_CASTS[:2]) or ev.name in _CASTS[2:]


def _align_ops(a_ops: List[EventRef], b_ops: List[EventRef]) -> Tuple[List[Pair], List[int], List[int]]:
    """Sequence-align two op lists of one group by name: the ops that compute first, then the
    casts between each two matched ones (a cast present on one side only stays unmatched)."""
    pairs, un_a, un_b = _align_names([e for e in a_ops if not _is_cast(e)], [e for e in b_ops if not _is_cast(e)])
    casts_a, casts_b = [e for e in a_ops if _is_cast(e)], [e for e in b_ops if _is_cast(e)]
    if not (casts_a or casts_b):
        return pairs, un_a, un_b
    seq_a, seq_b = {e.index: e.seq for e in a_ops}, {e.index: e.seq for e in b_ops}
    bounds_a = sorted(seq_a[p.a] for p in pairs)
    bounds_b = sorted(seq_b[p.b] for p in pairs)
    gap_a: Dict[int, List[EventRef]] = defaultdict(list)
    gap_b: Dict[int, List[EventRef]] = defaultdict(list)
    for e in casts_a:
        gap_a[bisect.bisect_left(bounds_a, e.seq)].append(e)
    for e in casts_b:
        gap_b[bisect.bisect_left(bounds_b, e.seq)].append(e)
    for gap in sorted(set(gap_a) | set(gap_b)):
        more = _align_names(gap_a.get(gap, []), gap_b.get(gap, []))
        pairs += more[0]
        un_a += more[1]
        un_b += more[2]
    return pairs, un_a, un_b


def _align_names(a_ops: List[EventRef], b_ops: List[EventRef]) -> Tuple[List[Pair], List[int], List[int]]:
    """Longest-matching-block alignment of two op lists by name (see the module docstring)."""
    pairs: List[Pair] = []
    un_a: List[int] = []
    un_b: List[int] = []
    sm = difflib.SequenceMatcher(None, [e.name for e in a_ops], [e.name for e in b_ops],
                                 autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            pairs.extend(Pair(a_ops[i].index, b_ops[j].index) for i, j in zip(range(i1, i2), range(j1, j2)))
            continue
        a_run, b_run = a_ops[i1:i2], b_ops[j1:j2]
        if tag == "replace" and a_run[-1].out_shapes and a_run[-1].out_shapes == b_run[-1].out_shapes:
            pairs.append(Pair(a_run[-1].index, b_run[-1].index, "fused"))
            a_run, b_run = a_run[:-1], b_run[:-1]
        un_a.extend(e.index for e in a_run)
        un_b.extend(e.index for e in b_run)
    return pairs, un_a, un_b


def _repair_by_shape(pairs: List[Pair], un_a: List[int], un_b: List[int], a_ops: List[EventRef],
                     b_ops: List[EventRef]) -> Tuple[List[Pair], List[int], List[int]]:
    """Re-pair the ops of one name in one group by their output shapes when name order paired
    two of them whose shapes disagree: the k-th op of a shape on one side with the k-th of that
    shape on the other, in execution order; the ops left over pair in order (a real difference
    of shape still shows as a row) and the rest stay unmatched. Sibling backward ops run in
    another order under an engine's autograd wrappers (ZeRO-3's ``lm_head`` gradients), and an
    engine adds ops of a name the other side runs too (ZeRO-3's gradient copies): name order
    alone pairs them wrongly and every such row fails on its shape."""
    ev_a, ev_b = {e.index: e for e in a_ops}, {e.index: e for e in b_ops}
    bad = {ev_a[p.a].name for p in pairs if p.how == "exact" and ev_a[p.a].out_shapes
           and ev_b[p.b].out_shapes and ev_a[p.a].out_shapes != ev_b[p.b].out_shapes}
    if not bad:
        return pairs, un_a, un_b
    keep = [p for p in pairs if not (p.how == "exact" and ev_a[p.a].name in bad)]
    free_a, free_b = [i for i in un_a if ev_a[i].name not in bad], [j for j in un_b if ev_b[j].name not in bad]
    # a fused pair may hold an op of a bad name on one side (an ``mm`` fused with a ``rsqrt``):
    # that op stays in its pair and is not paired again
    kept_a, kept_b = {p.a for p in keep}, {p.b for p in keep}
    for name in sorted(bad):
        side_a = sorted((i for i in ev_a if ev_a[i].name == name and i not in kept_a), key=lambda i: ev_a[i].seq)
        side_b = sorted((j for j in ev_b if ev_b[j].name == name and j not in kept_b), key=lambda j: ev_b[j].seq)
        of_shape: Dict[Tuple, List[int]] = defaultdict(list)
        for j in side_b:
            of_shape[ev_b[j].out_shapes].append(j)
        left_a = []
        for i in side_a:
            same = of_shape.get(ev_a[i].out_shapes)
            if same:
                keep.append(Pair(i, same.pop(0)))
            else:
                left_a.append(i)
        left_b = sorted((j for js in of_shape.values() for j in js), key=lambda j: ev_b[j].seq)
        keep.extend(Pair(i, j) for i, j in zip(left_a, left_b))
        free_a.extend(left_a[len(left_b):])
        free_b.extend(left_b[len(left_a):])
    return keep, free_a, free_b


def _merge_order(a: Sequence[EventRef], b: Sequence[EventRef], pairs: List[Pair],
                 un_a: List[int], un_b: List[int]) -> List[Tuple[Optional[int], Optional[int]]]:
    a_seq = {e.index: (e.step, e.seq) for e in a}
    partner_of_b = {p.b: p.a for p in pairs}
    # for each unmatched B event: anchor after the A partner of its closest matched predecessor
    anchored: Dict[Optional[int], List[int]] = defaultdict(list)
    last_anchor: Optional[int] = None
    unmatched_b = set(un_b)
    for ev in sorted(b, key=lambda e: (e.step, e.seq)):
        if ev.index in partner_of_b:
            last_anchor = partner_of_b[ev.index]
        elif ev.index in unmatched_b:
            anchored[last_anchor].append(ev.index)
    partner_of_a = {p.a: p.b for p in pairs}
    order: List[Tuple[Optional[int], Optional[int]]] = [(None, j) for j in anchored.get(None, [])]
    for i in sorted(a_seq, key=a_seq.__getitem__):
        order.append((i, partner_of_a.get(i)))
        order.extend((None, j) for j in anchored.get(i, []))
    assert len(order) == len(a) + len(b) - len(pairs), "alignment lost an event"
    return order


def align_events(a: Sequence[EventRef], b: Sequence[EventRef], *, check: bool = True,
                 script: Tuple[bool, bool] = (False, False)) -> Alignment:
    """Match the events of two dumps (one rank each).

    Args:
        a: the events of dump A (the DUT), ``index`` unique.
        b: the events of dump B (the reference).
        check: raise when the dumps obviously hold different models.
        script: whether A, B were captured from a script (``capture --script``): against a
            dump that is not, a script's own ops outside the model's calls are left unaligned
            (:func:`_program_ops`, with a note).

    Returns:
        The :class:`Alignment`: every event of A and of B is in exactly one pair or in the
        unmatched list of its side.

    Raises:
        AlignmentError: ``check`` and fewer than half of the larger side's events match.

    Example:
        >>> ev = lambda i, n: EventRef(i, i, "op", "", n, "forward")
        >>> al = align_events([ev(0, "aten.mm"), ev(1, "aten.add")], [ev(0, "aten.mm")], check=False)
        >>> [(p.a, p.b) for p in al.pairs], al.unmatched_a
        ([(0, 0)], [1])
    """
    original = (a, b)
    a, b, notes = unwrap(a, b)
    pairs: List[Pair] = []
    un_a: List[int] = []
    un_b: List[int] = []
    everything = (a, b)
    a, b, left_out, more = _without_program_ops((a, b), original, script)
    notes = more + notes
    un_a.extend(left_out[0])
    un_b.extend(left_out[1])
    # modules and params: exact identity
    b_ident: Dict[Tuple, int] = {}
    for e in b:
        if e.kind != "op":
            b_ident.setdefault(e.ident, e.index)
    used_b = set()
    for e in a:
        if e.kind == "op":
            continue
        j = b_ident.get(e.ident)
        if j is not None and j not in used_b:
            pairs.append(Pair(e.index, j))
            used_b.add(j)
        else:
            un_a.append(e.index)
    un_b.extend(e.index for e in b if e.kind != "op" and e.index not in used_b)
    # ops: by group, sequence-aligned
    seg_a, seg_b = _segments(a), _segments(b)
    groups: Dict[Tuple, Tuple[List[EventRef], List[EventRef]]] = defaultdict(lambda: ([], []))
    for e in sorted(a, key=lambda e: (e.step, e.seq)):
        if e.kind == "op":
            groups[seg_a[e.index]][0].append(e)
    for e in sorted(b, key=lambda e: (e.step, e.seq)):
        if e.kind == "op":
            groups[seg_b[e.index]][1].append(e)
    for a_ops, b_ops in groups.values():
        p, ua, ub = _repair_by_shape(*_align_ops(a_ops, b_ops), a_ops, b_ops)
        pairs.extend(p)
        un_a.extend(ua)
        un_b.extend(ub)
    if check:
        check_same_structure(a, b, pairs)
    return Alignment(pairs=pairs, unmatched_a=sorted(un_a), unmatched_b=sorted(un_b),
                     order=_merge_order(everything[0], everything[1], pairs, un_a, un_b), notes=notes)


def _program_ops(events: Sequence[EventRef]) -> List[int]:
    """The indices of a script's own ops: ops at the root path before the first module event of
    their step (initialization) or, in a step with a backward, after its last backward module
    event (an engine's gradient checks), and parameter-update ops; none in a step without module
    events."""
    first: Dict[int, int] = {}
    last_backward: Dict[int, int] = {}
    for e in events:
        if e.kind == "module":
            first[e.step] = min(first.get(e.step, e.seq), e.seq)
            if e.direction == "backward":
                last_backward[e.step] = max(last_backward.get(e.step, e.seq), e.seq)
    out = []
    for e in events:
        if e.kind != "op" or e.step not in first:
            continue
        outside = e.seq < first[e.step] or (e.step in last_backward and e.seq > last_backward[e.step])
        if e.direction == "optimizer" or (e.scope == "" and outside):
            out.append(e.index)
    return out


def _without_program_ops(sides: Tuple[Sequence[EventRef], Sequence[EventRef]],
                         original: Tuple[Sequence[EventRef], Sequence[EventRef]],
                         script: Tuple[bool, bool]) -> tuple:
    """A script side's own ops (:func:`_program_ops`, by the paths it recorded) are left out of
    the alignment, unmatched, when the other side is not a script (a workload's dump records
    from the model's call on). Returns ``(a, b, (left out of A, left out of B), notes)``."""
    left: Tuple[List[int], List[int]] = ([], [])
    out_sides = [list(sides[0]), list(sides[1])]
    notes: List[str] = []
    for me, label in ((0, "A"), (1, "B")):
        if not script[me] or script[1 - me]:
            continue
        out = set(_program_ops(original[me]))
        if not out:
            continue
        left[me].extend(sorted(out))
        out_sides[me] = [e for e in out_sides[me] if e.index not in out]
        notes.append(f"{label} (a script) holds {len(out)} ops of its own outside the model's calls (at the root "
                     "before the first module call or after the last backward one: initialization, an engine's "
                     "checks; parameter updates), which the other dump does not record: left unaligned")
    return out_sides[0], out_sides[1], left, notes


def _describe(e: EventRef) -> str:
    return f"{e.kind} {e.scope or '(root)'} {e.name} {e.direction} #{e.call}"


def check_same_structure(a: Sequence[EventRef], b: Sequence[EventRef], pairs: Iterable[Pair]) -> None:
    """Raise :class:`AlignmentError` when A and B evidently hold different models or steps.

    Raises:
        AlignmentError: different training steps, or fewer than ``MIN_MATCHED_FRACTION`` of
            the larger side's events matched (naming the first event that differs).
    """
    steps_a, steps_b = sorted({e.step for e in a}), sorted({e.step for e in b})
    if a and b and steps_a != steps_b:
        raise AlignmentError(f"the dumps hold different training steps: A {steps_a}, B {steps_b}; "
                             "capture both with the same --steps")
    pairs = list(pairs)
    # a training step's parameter updates against a side that ran none (a forward/backward
    # workload as the reference) are events the other side cannot have, not another model
    updates_a, updates_b = (sum(e.direction == "optimizer" for e in side) for side in (a, b))
    n_a, n_b = len(a) - (updates_a if not updates_b else 0), len(b) - (updates_b if not updates_a else 0)
    smaller, larger = min(n_a, n_b), max(n_a, n_b)
    if smaller == 0 or len(pairs) >= MIN_MATCHED_FRACTION * larger:
        return
    matched_a = {p.a for p in pairs}
    matched_b = {p.b for p in pairs}
    first_a = next((e for e in sorted(a, key=lambda e: (e.step, e.seq)) if e.index not in matched_a), None)
    first_b = next((e for e in sorted(b, key=lambda e: (e.step, e.seq)) if e.index not in matched_b), None)
    raise AlignmentError(
        f"the dumps hold different models: only {len(pairs)} of {len(a)} (A) and {len(b)} (B) "
        "events match "
        f"(first unmatched: A {_describe(first_a) if first_a else '-'}, "
        f"B {_describe(first_b) if first_b else '-'}); capture the same workload on both targets")
