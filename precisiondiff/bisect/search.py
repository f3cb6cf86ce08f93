"""The bisect search as a pure state machine: which unit to isolate next, and what the answer is.

No torch here. The torch side (:mod:`precisiondiff.bisect.engine`) builds the unit tree from a
capture, asks :meth:`Search.next_query` which unit to isolate, isolates it on the reference and
feeds the :class:`Judgement` back with :meth:`Search.record`, until ``next_query`` returns
``None``; then :meth:`Search.result` says what was found.

The rules (docs/bisect.md, "How the culprit is chosen"):

* Units are visited in execution order: forward before backward, then by sequence number.
  A module's sequence number is the moment it *finished*, so its ops and submodules come
  before it.
* An **op** offends when it is replayable and over its budget.
* A **module** offends when it is replayable, no unit inside it offends, and either ``far`` (its local error is far beyond
  what correctly rounded execution of its own ops explains: a fault in how the module composes
  correct ops, e.g. a custom autograd backward wrong only in low precision), or ``over`` and it
  is the innermost replayable module around an op that could not be replayed (that op cannot be
  judged on its own, so the fault is localized to the module).
* The culprit is the first offending unit in that order; the next offending ones are reported
  as further candidates. Every op is isolated (about one forward of work), so no op culprit can
  hide inside a module that happens to stay within its own budget.
* Phases: first every op, in execution order (stopping once the culprit and ``max_candidates``
  more offending ops are known); then modules **top-down**: the top-level module calls, and the
  children of every module that is ``over`` (or not replayable, or around an unreplayable op).
  A module within what rounding explains is not descended into: a module-level fault inside it
  would have shown in its own error (the assumption property tests encode); one around an
  unreplayable op is descended into only towards that op.
* Once an op or a module offends, modules that run after it (in the order above) and hold no
  module that runs before it are not isolated: none of them can be the culprit, so further
  candidates are ops (and modules before it); the modules around the first offending op are not isolated either (they hold an
  offending unit, so they cannot offend): the descent goes into their children as if they were
  over (``judge_after_culprit=True`` isolates them all, as before).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Unit", "Judgement", "Finding", "Search", "DIRECTIONS"]

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Unit:
    """One isolatable unit: a module call or an op call.

    Attributes:
        uid: unique id; its execution position (the capture's ``seq``).
        kind: ``"op"`` or ``"module"``.
        direction: ``"forward"`` or ``"backward"``.
        parent: uid of the innermost module call containing it (same direction), or None.
    """

    uid: int
    kind: str
    direction: str = "forward"
    parent: Optional[int] = None


@dataclass(frozen=True)
class Judgement:
    """What isolating one unit on the reference found.

    Attributes:
        replayable: the unit could be re-executed on the reference.
        over: its local error exceeds its budget (ops), or exceeds what correctly rounded
            execution of its ops explains (modules).
        far: modules only: the local error is far beyond that (see the module docstring).
    """

    replayable: bool = True
    over: bool = False
    far: bool = False


@dataclass
class Finding:
    """The answer of a search.

    Attributes:
        culprit: uid of the first offending unit, or None.
        candidates: the offending units after the culprit, in order (at most ``max_candidates``).
        path: uids of the modules enclosing the culprit, outermost first.
        unresolved: uids of ops that could not be replayed and have no replayable module
            around them.
        queries: how many units were isolated.
    """

    culprit: Optional[int] = None
    candidates: List[int] = field(default_factory=list)
    path: List[int] = field(default_factory=list)
    unresolved: List[int] = field(default_factory=list)
    queries: int = 0


def _order_key(unit: Unit) -> Tuple[int, int]:
    return (DIRECTIONS.index(unit.direction) if unit.direction in DIRECTIONS else len(DIRECTIONS),
            unit.uid)


class Search:
    """Isolate ops in execution order, then modules top-down; the culprit is the first
    offending unit in execution order.

    Args:
        units: every unit of the run (any order; parents must be among them or None).
        max_candidates: offending units to find after the culprit before stopping.
        judge_after_culprit: also isolate modules that run after the first offending op
            (further module candidates; they cannot change the culprit).

    Example:
        >>> s = Search([Unit(0, "op", parent=1), Unit(1, "module")])
        >>> while (uid := s.next_query()) is not None:
        ...     s.record(uid, Judgement(over=(uid == 0)))
        >>> s.result().culprit
        0
    """

    def __init__(self, units: Sequence[Unit], *, max_candidates: int = 3, judge_after_culprit: bool = False) -> None:
        self.units: Dict[int, Unit] = {u.uid: u for u in units}
        if len(self.units) != len(units):
            raise ValueError("unit ids must be unique")
        for u in units:
            if u.kind not in ("op", "module"):
                raise ValueError(f"unit {u.uid}: kind must be 'op' or 'module', not {u.kind!r}")
            if u.parent is not None and (u.parent not in self.units or self.units[u.parent].kind != "module"):
                raise ValueError(f"unit {u.uid}: parent {u.parent} is not a module unit")
        self.max_candidates = max_candidates
        self.judge_after_culprit = judge_after_culprit
        self.skipped: List[int] = []  # modules not isolated: they run after the culprit op
        self.children: Dict[Optional[int], List[int]] = {}
        for u in sorted(units, key=_order_key):
            if u.kind == "module":
                self.children.setdefault(u.parent, []).append(u.uid)
        self._ops = [u.uid for u in sorted(units, key=_order_key) if u.kind == "op"]
        self._op_pos = 0
        self._op_offending: List[int] = []
        self._mod_offending: List[int] = []  # offending modules, as judged (moot() after them too)
        self._queue: List[int] = list(self.children.get(None, []))
        self._queued = set(self._queue)
        self.judgements: Dict[int, Judgement] = {}
        self._holds_unreplayable: Dict[int, bool] = {}
        self._forced: set = set()  # modules around unreplayable ops: always judged
        self._unresolved: List[int] = []

    # -- the state machine -----------------------------------------------------------------
    def _ops_done(self) -> bool:
        return self._op_pos >= len(self._ops) or len(self._op_offending) > self.max_candidates

    def next_query(self) -> Optional[int]:
        """The uid of the unit to isolate next, or None when the search is over."""
        if not self._ops_done():
            return self._ops[self._op_pos]
        while True:
            self._queue.sort(key=lambda uid: _order_key(self.units[uid]))
            if not self._queue:
                return None
            head = self._queue[0]
            if self.moot(head):
                self.skipped.append(self._queue.pop(0))
            elif self._holds_first_offender(head):  # covered: descend without isolating it
                self.skipped.append(self._queue.pop(0))
                self._descend(head)
            else:
                return head

    def upcoming_ops(self, n: int) -> List[int]:
        """The next ``n`` op units the op phase would isolate if none of them offends (a replay
        pool judges them ahead, in parallel: bisect/workers.py); empty once the op phase is over."""
        return [] if self._ops_done() else self._ops[self._op_pos:self._op_pos + n]

    def upcoming_modules(self, n: int) -> List[int]:
        """The next ``n`` module units the module phase would isolate as far as known now (the
        queue, in order, without the moot and covered ones); a replay pool judges them ahead.
        Empty while the op phase goes on."""
        if not self._ops_done():
            return []
        queue = sorted(self._queue, key=lambda uid: _order_key(self.units[uid]))
        return [uid for uid in queue if self.will_judge(uid)][:n]

    def will_judge(self, uid: int) -> bool:
        """Whether the module ``uid`` (once queued) is isolated, as far as known now."""
        return not self.moot(uid) and not self._holds_first_offender(uid)

    def _first_offender(self) -> Optional[int]:
        found = self._op_offending + [m for m in self._mod_offending if self._settled(m)]
        if not found:
            return None
        return min(found, key=lambda u: _order_key(self.units[u]))

    def _settled(self, uid: int) -> bool:
        """An offending module is an offender only once no module inside it waits in the queue
        (one of them may offend and cover it; a backward module call can be recorded before its
        children, so the order alone does not say)."""
        for q in self._queue:
            parent = self.units[q].parent
            while parent is not None:
                if parent == uid:
                    return False
                parent = self.units[parent].parent
        return True

    def _holds_first_offender(self, uid: int) -> bool:
        """A module around the first offending op cannot offend (an offending unit is inside
        it), so it is not isolated; the descent goes on into its children as if it were over
        (``judge_after_culprit=False``)."""
        first = None if self.judge_after_culprit else self._first_offender()
        parent = self.units[first].parent if first is not None else None
        while parent is not None:
            if parent == uid:
                return True
            parent = self.units[parent].parent
        return False

    def _descend(self, uid: int, only: Optional[set] = None) -> None:
        for child in self.children.get(uid, []):
            if child not in self._queued and (only is None or child in only):
                self._queued.add(child)
                self._queue.append(child)

    def moot(self, uid: int) -> bool:
        """A module that runs after the first offending unit (op or module) and holds no module
        that runs before it: it cannot be the culprit (that unit comes first) and judging it cannot lead to a unit
        that could, so it is not isolated (``judge_after_culprit=False``)."""
        if self.judge_after_culprit or self._first_offender() is None:
            return False
        if self._holds_first_offender(uid):
            return False
        first = _order_key(self.units[self._first_offender()])
        if _order_key(self.units[uid]) < first:
            return False
        return all(_order_key(self.units[c]) > first for c in self.children.get(uid, []))

    def record(self, uid: int, judgement: Judgement) -> None:
        """Feed the judgement of the unit :meth:`next_query` returned."""
        expected = self.next_query()
        if uid != expected:
            raise ValueError(f"expected a judgement for unit {expected}, got {uid}")
        unit = self.units[uid]
        self.judgements[uid] = judgement
        if unit.kind == "op":
            self._op_pos += 1
            if not judgement.replayable:
                self._mark_unreplayable(unit)
            elif judgement.over:
                self._op_offending.append(uid)
            return
        self._queue.pop(0)
        # a module that cannot be replayed (arguments not recorded) hands an unreplayable *op*
        # up to its parent; one whose ops were all judged on their own has nothing to hand up
        if not judgement.replayable and self._holds_unreplayable.get(uid, False):
            self._mark_unreplayable(unit)
        if self._module_offends(uid):
            self._mod_offending.append(uid)
        if not judgement.replayable or judgement.over:
            self._descend(uid)
        elif uid in self._forced:  # within rounding: only on towards the unreplayable op
            self._descend(uid, only=self._forced)

    def _mark_unreplayable(self, unit: Unit) -> None:
        """Hand an unreplayable unit to its innermost replayable ancestor; force the descent
        to reach that ancestor."""
        if unit.parent is None:
            self._unresolved.append(unit.uid)
            return
        self._holds_unreplayable[unit.parent] = True
        parent: Optional[int] = unit.parent
        while parent is not None:
            self._forced.add(parent)
            parent = self.units[parent].parent
        # enqueue the forced chain's top-level entry if the descent already passed it by
        chain = []
        parent = unit.parent
        while parent is not None:
            chain.append(parent)
            parent = self.units[parent].parent
        for mod in chain:
            if mod in self.judgements and mod not in self._queue:
                for child in self.children.get(mod, []):
                    if child not in self._queued:
                        self._queued.add(child)
                        self._queue.append(child)

    def _module_offends(self, uid: int) -> bool:
        j = self.judgements[uid]
        if not j.replayable:
            return False
        return j.far or (j.over and self._holds_unreplayable.get(uid, False))

    def offending(self) -> List[int]:
        """Every offending unit found so far, in execution order. A module whose error is
        explained by an offending unit inside it is not itself offending."""
        mods = [u for u, j in self.judgements.items() if self.units[u].kind == "module" and self._module_offends(u)]
        covered = set()
        for uid in self._op_offending + mods:
            parent = self.units[uid].parent
            while parent is not None:
                covered.add(parent)
                parent = self.units[parent].parent
        found = self._op_offending + [m for m in mods if m not in covered]
        return sorted(found, key=lambda uid: _order_key(self.units[uid]))

    def result(self) -> Finding:
        """What the search found (complete once :meth:`next_query` returns None)."""
        found = self.offending()
        culprit = found[0] if found else None
        path: List[int] = []
        if culprit is not None:
            parent = self.units[culprit].parent
            while parent is not None:
                path.append(parent)
                parent = self.units[parent].parent
            path.reverse()
        unresolved = list(self._unresolved)
        return Finding(culprit=culprit, candidates=found[1:1 + self.max_candidates], path=path,
                       unresolved=unresolved, queries=len(self.judgements))
