"""The pure search: property tests with random trees and random "which unit is bad" oracles."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.bisect.search import Judgement, Search, Unit


@st.composite
def trees(draw):
    """Random module trees with ops; uid = execution position (children finish first)."""
    units, counter = [], [0]

    def build(parent_slot, depth, direction):
        pending = []  # (kind, children builder)
        n = draw(st.integers(1, 3))
        for _ in range(n):
            if depth < 3 and draw(st.booleans()):
                mod = {"kind": "module", "children": []}
                pending.append(mod)
                mod["children"] = build(mod, depth + 1, direction)
            else:
                pending.append({"kind": "op", "children": []})
        return pending

    def number(nodes, parent_uid, direction):
        for node in nodes:
            if node["kind"] == "module":
                placeholder = len(units)
                units.append(None)
                number(node["children"], placeholder, direction)
                uid = counter[0]
                counter[0] += 1
                units[placeholder] = (uid, "module", direction, parent_uid, placeholder)
            else:
                uid = counter[0]
                counter[0] += 1
                units.append((uid, "op", direction, parent_uid, len(units)))

    for direction in ("forward", "backward"):
        number(build(None, 0, direction), None, direction)
    # map placeholder parents to uids
    by_slot = {slot: uid for uid, _, _, _, slot in units}
    return [Unit(uid, kind, d, by_slot[p] if p is not None else None) for uid, kind, d, p, _ in units]


def _ancestors(units, uid):
    by = {u.uid: u for u in units}
    out, p = [], by[uid].parent
    while p is not None:
        out.append(p)
        p = by[p].parent
    return out


def _run(units, bad_ops, far_modules, unreplayable=frozenset(), **options):
    """An oracle whose errors propagate: every ancestor of a bad unit is over budget."""
    over = set()
    for uid in set(bad_ops) | set(far_modules):
        over.update(_ancestors(units, uid))
    s = Search(units, **options)
    asked = []
    while (uid := s.next_query()) is not None:
        asked.append(uid)
        s.record(uid, Judgement(replayable=uid not in unreplayable, over=uid in bad_ops or uid in over
                                or uid in far_modules, far=uid in far_modules))
    return s.result(), asked


def _order(u):
    return (0 if u.direction == "forward" else 1, u.uid)


@settings(max_examples=150, deadline=None)
@given(trees(), st.data())
def test_culprit_is_first_bad_unit_in_execution_order(units, data):
    ops = [u.uid for u in units if u.kind == "op"]
    mods = [u.uid for u in units if u.kind == "module"]
    bad_ops = set(data.draw(st.lists(st.sampled_from(ops), max_size=3))) if ops else set()
    # far modules: only leaf-most ones that contain no bad op (a genuine module-level fault)
    far = set(data.draw(st.lists(st.sampled_from(mods), max_size=2))) if mods else set()
    far = {m for m in far if not any(m in _ancestors(units, b) for b in bad_ops | (far - {m}))}
    result, asked = _run(units, bad_ops, far)
    by = {u.uid: u for u in units}
    expected = sorted(bad_ops | far, key=lambda uid: _order(by[uid]))
    assert result.culprit == (expected[0] if expected else None)
    assert result.queries == len(set(asked)) == len(asked)
    if result.culprit is not None:
        assert result.path == list(reversed(_ancestors(units, result.culprit)))


@settings(max_examples=150, deadline=None)
@given(trees(), st.data())
def test_modules_after_or_around_the_first_bad_op_are_not_isolated_and_the_culprit_stays(units, data):
    ops = [u.uid for u in units if u.kind == "op"]
    mods = [u.uid for u in units if u.kind == "module"]
    bad_ops = set(data.draw(st.lists(st.sampled_from(ops), max_size=3))) if ops else set()
    far = set(data.draw(st.lists(st.sampled_from(mods), max_size=2))) if mods else set()
    far = {m for m in far if not any(m in _ancestors(units, b) for b in bad_ops | (far - {m}))}
    lean, asked = _run(units, bad_ops, far)
    full, asked_all = _run(units, bad_ops, far, judge_after_culprit=True)
    assert lean.culprit == full.culprit and set(asked) <= set(asked_all)
    if lean.culprit is None:
        assert asked == asked_all
        return
    by = {u.uid: u for u in units}
    first = _order(by[lean.culprit])  # the first offending op or module
    children = {}
    for u in units:
        children.setdefault(u.parent, []).append(u.uid)
    first_op = min(bad_ops, key=lambda b: _order(by[b])) if bad_ops else None
    for uid in asked:  # a module after the first offender only to reach a module before it
        if first_op is not None:
            assert uid not in _ancestors(units, first_op)  # it holds an offender: it cannot offend
        if by[uid].kind == "module" and _order(by[uid]) > first and uid not in _ancestors(units, lean.culprit):
            assert any(by[c].kind == "module" and _order(by[c]) < first for c in children.get(uid, []))


def test_modules_after_an_offending_module_are_not_isolated_once_nothing_inside_it_waits():
    """A backward module call whose inputs need no gradient is recorded before its children
    (uid 0 here): it offends (far), but it is an offender only once its children are judged; the
    first far child is the culprit and the sibling after it is not isolated."""
    units = [Unit(0, "module", "backward"), Unit(1, "op", "backward", 2), Unit(2, "module", "backward", 0),
             Unit(3, "op", "backward", 4), Unit(4, "module", "backward", 0),
             Unit(5, "op", "backward", 6), Unit(6, "module", "backward", 0)]
    for after in (False, True):
        result, asked = _run(units, set(), {4, 6}, judge_after_culprit=after)
        assert result.culprit == 4 and result.path == [0]
        assert asked == [1, 3, 5, 0, 2, 4] + ([6] if after else [])


@settings(max_examples=100, deadline=None)
@given(trees(), st.data())
def test_clean_oracle_isolates_every_op_and_only_top_modules(units, data):
    result, asked = _run(units, set(), set())
    assert result.culprit is None
    ops = {u.uid for u in units if u.kind == "op"}
    tops = {u.uid for u in units if u.kind == "module" and u.parent is None}
    assert set(asked) == ops | tops


@settings(max_examples=100, deadline=None)
@given(trees(), st.data())
def test_unreplayable_op_is_localized_to_innermost_module(units, data):
    inner = [u for u in units if u.kind == "op" and u.parent is not None]
    if not inner:
        return
    op = data.draw(st.sampled_from(inner))
    over = set(_ancestors(units, op.uid))
    s = Search(units)
    while (uid := s.next_query()) is not None:
        s.record(uid, Judgement(replayable=uid != op.uid, over=uid in over))
    assert s.result().culprit == op.parent


def test_record_must_follow_next_query():
    s = Search([Unit(0, "op"), Unit(1, "op")])
    try:
        s.record(1, Judgement())
    except ValueError as err:
        assert "expected a judgement for unit 0" in str(err)
    else:
        raise AssertionError("out-of-order record accepted")


def _search(units, judge):
    s = Search(units)
    while (uid := s.next_query()) is not None:
        s.record(uid, judge(uid))
    return s.result()


def test_module_unreplayable_for_its_arguments_hands_nothing_up():
    """A module whose arguments could not be recorded (a cache object) while all its ops were
    judged on their own does not make its over-budget parent a stand-in culprit."""
    units = [Unit(0, "op", parent=1), Unit(1, "module", parent=2), Unit(2, "module")]
    verdicts = {0: Judgement(), 1: Judgement(replayable=False), 2: Judgement(over=True)}
    assert _search(units, verdicts.__getitem__).culprit is None


def test_module_around_an_unreplayable_op_still_stands_in_for_it():
    units = [Unit(0, "op", parent=1), Unit(1, "module", parent=2), Unit(2, "module")]
    verdicts = {0: Judgement(replayable=False), 1: Judgement(replayable=False), 2: Judgement(over=True)}
    assert _search(units, verdicts.__getitem__).culprit == 2
