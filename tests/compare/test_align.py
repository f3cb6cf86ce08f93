"""Alignment: hypothesis properties on random event sequences, and hand-written cases."""
from __future__ import annotations

import dataclasses
from typing import List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.compare.align import EventRef, align_events
from precisiondiff.compare.unwrap import unwrap
from precisiondiff.errors import AlignmentError

OPS = ["aten.mm", "aten.add", "aten.mul", "aten.rsqrt", "aten.mean", "aten._to_copy", "aten.gelu"]
SCOPES = ["", "blocks.0", "blocks.0.attn", "blocks.1"]


def _renumber(raw: List[tuple]) -> List[EventRef]:
    """(kind, scope, name, direction, shape) tuples -> EventRefs with seq and per-key call."""
    calls: dict = {}
    out = []
    for i, (kind, scope, name, direction, shape) in enumerate(raw):
        k = (scope, name, direction)
        calls[k] = calls.get(k, -1) + 1
        out.append(EventRef(i, i, kind, scope, name, direction, calls[k], 0, ((shape,),)[0:1]))
    return out


event = st.tuples(st.sampled_from(["op", "op", "op", "module", "param"]), st.sampled_from(SCOPES),
                  st.sampled_from(OPS), st.sampled_from(["forward", "backward"]),
                  st.tuples(st.integers(1, 3)))


@st.composite
def mutated_pair(draw):
    base = draw(st.lists(event, max_size=40))
    other = list(base)
    for _ in range(draw(st.integers(0, 6))):
        what = draw(st.sampled_from(["insert", "delete", "fuse"]))
        pos = draw(st.integers(0, len(other)))
        if what == "insert":
            other.insert(pos, draw(event))
        elif what == "delete" and other:
            del other[min(pos, len(other) - 1)]
        elif what == "fuse" and len(other) >= 2:
            n = draw(st.integers(2, 3))
            run = other[pos:pos + n]
            if run:
                kind, scope, _, direction, shape = run[-1]
                other[pos:pos + n] = [(kind, scope, "mylib.fused", direction, shape)]
    if draw(st.booleans()):
        return _renumber(base), _renumber(other)
    return _renumber(other), _renumber(base)


@settings(max_examples=200, deadline=None)
@given(mutated_pair())
def test_every_event_matched_or_unmatched_exactly_once(ab):
    a, b = ab
    al = align_events(a, b, check=False)
    a_seen = [p.a for p in al.pairs] + al.unmatched_a
    b_seen = [p.b for p in al.pairs] + al.unmatched_b
    assert sorted(a_seen) == [e.index for e in a]
    assert sorted(b_seen) == [e.index for e in b]
    # the merged order holds every event once, A in execution order
    order_a = [i for i, _ in al.order if i is not None]
    order_b = [j for _, j in al.order if j is not None]
    assert order_a == [e.index for e in a]
    assert sorted(order_b) == [e.index for e in b]
    assert len(al.order) == len(a) + len(b) - len(al.pairs)


def test_an_op_in_a_fused_pair_is_not_paired_again_by_the_shape_repair():
    """Found by the property above with a random seed: name order paired the two ``rsqrt`` with
    different shapes (a repair by shape follows) and fused A's ``mm`` with B's second ``rsqrt``
    (same shape); the repair paired that ``rsqrt`` a second time."""
    def ev(i, name, call, shape, scope="blocks.0"):
        return EventRef(index=i, seq=i, kind="op", scope=scope, name=name, direction="forward", call=call,
                        step=0, out_shapes=(((shape,),),))
    a = [ev(0, "aten.rsqrt", 0, 1), ev(1, "aten.mm", 0, 1, scope=""), ev(2, "aten.mm", 0, 1)]
    b = [ev(0, "aten.rsqrt", 0, 2), ev(1, "aten.mm", 0, 1, scope=""), ev(2, "aten.rsqrt", 1, 1)]
    al = align_events(a, b, check=False)
    b_seen = sorted([p.b for p in al.pairs] + al.unmatched_b)
    assert b_seen == [0, 1, 2]
    assert len(al.order) == len(a) + len(b) - len(al.pairs)


@settings(max_examples=100, deadline=None)
@given(st.lists(event, max_size=40))
def test_identical_sequences_match_completely(raw):
    a = _renumber(raw)
    al = align_events(a, a)
    assert not al.unmatched_a and not al.unmatched_b
    assert sorted((p.a, p.b) for p in al.pairs) == [(e.index, e.index) for e in a]
    assert all(p.how == "exact" for p in al.pairs)


@settings(max_examples=100, deadline=None)
@given(mutated_pair())
def test_pairs_agree_on_kind_and_scope(ab):
    a, b = ab
    al = align_events(a, b, check=False)
    # the scopes alignment matches on: one side's wrapper prefix removed (compare/unwrap.py); a
    # random pair can look wrapped (B's root of another class, its "blocks.0" matching A's root)
    ua, ub, _ = unwrap(a, b)
    for p in al.pairs:
        ea, eb = ua[p.a], ub[p.b]
        assert (ea.kind, ea.scope, ea.direction) == (eb.kind, eb.scope, eb.direction)
        if p.how == "exact":
            assert ea.name == eb.name


def _ops(names, scope="blocks.0", shapes=None):
    return [EventRef(i, i, "op", scope, n, "forward", 0, 0, (shapes[i],) if shapes else ((4,),))
            for i, n in enumerate(names)]


def test_fused_kernel_pairs_with_the_last_op_of_the_stretch():
    a = _ops(["aten.mm", "mylib.fused_rms_norm", "aten.add"])
    b = _ops(["aten.mm", "aten.pow", "aten.mean", "aten.rsqrt", "aten.mul", "aten.add"])
    al = align_events(a, b)
    assert {(p.a, p.b, p.how) for p in al.pairs} == {(0, 0, "exact"), (1, 4, "fused"), (2, 5, "exact")}
    assert al.unmatched_b == [1, 2, 3] and al.unmatched_a == []


def test_extra_cast_is_unmatched_and_the_rest_still_pairs():
    a = _ops(["aten.mm", "aten._to_copy", "aten.add"])
    b = _ops(["aten.mm", "aten.add"])
    al = align_events(a, b)
    assert al.unmatched_a == [1] and al.unmatched_b == []
    assert al.order == [(0, 0), (1, None), (2, 1)]


def test_sibling_ops_run_in_another_order_pair_by_their_shapes():
    """ZeRO-3's autograd wrappers run ``lm_head``'s two backward GEMMs the other way round, with a
    view between them: name order alone pairs the wrong GEMMs and both rows fail on shape."""
    a = _ops(["aten.mm", "aten._unsafe_view", "aten.mm"], shapes=[((32, 32),), ((2, 16, 32),), ((64, 32),)])
    b = _ops(["aten.mm", "aten.mm"], shapes=[((64, 32),), ((32, 32),)])
    al = align_events(a, b)
    assert {(p.a, p.b) for p in al.pairs} == {(0, 1), (2, 0)} and al.unmatched_a == [1]


def test_an_extra_op_of_the_same_name_is_left_out_by_its_shape():
    """ZeRO-3 copies a bias gradient (128,) into its partition before the (32, 128) copy the
    reference runs too: the reference's copy pairs with the DUT copy of its shape."""
    a = _ops(["aten.sum", "aten.copy_", "aten.copy_", "aten.copy_"],
             shapes=[((1, 128),), ((128,),), ((32, 128),), ((32, 128),)])
    b = _ops(["aten.sum", "aten.copy_"], shapes=[((1, 128),), ((32, 128),)])
    al = align_events(a, b)
    assert {(p.a, p.b) for p in al.pairs} == {(0, 0), (2, 1)} and al.unmatched_a == [1, 3]


@settings(max_examples=100, deadline=None)
@given(st.permutations(range(4)), st.integers(0, 3))
def test_same_name_ops_in_any_order_pair_with_the_op_of_their_shape(order, extra):
    """Distinct shapes of one op name, in any order on one side and one more copy of a shape:
    every pair agrees on its shape, and only the extra op is left over."""
    shapes = [((k + 1, 8),) for k in range(4)]
    b = _ops(["aten.mm"] * 4, shapes=shapes)
    a_shapes = [shapes[k] for k in order]
    a_shapes.insert(extra, shapes[order[extra]])
    a = _ops(["aten.mm"] * 5, shapes=a_shapes)
    al = align_events(a, b)
    assert all(a[p.a].out_shapes == b[p.b].out_shapes for p in al.pairs) and len(al.pairs) == 4
    assert len(al.unmatched_a) == 1 and not al.unmatched_b


def test_ops_stay_inside_their_module_call():
    # two calls of the same module: an extra op in the first call must not shift the second
    def evs(first):
        names = first + ["Linear"] + ["aten.addmm"] + ["Linear"]
        return [EventRef(i, i, "module" if n == "Linear" else "op", "fc", n, "forward",
                         names[:i].count(n) if n == "Linear" else 0, 0)
                for i, n in enumerate(names)]
    a, b = evs(["aten.addmm", "aten.clone"]), evs(["aten.addmm"])
    al = align_events(a, b)
    assert al.unmatched_a == [1]
    assert (3, 2) in {(p.a, p.b) for p in al.pairs}


def test_different_models_are_refused():
    a = _ops(["aten.mm"] * 2 + ["aten.add"] * 8, scope="encoder")
    b = _ops(["aten.mm"] * 2 + ["aten.add"] * 8, scope="layers.0")
    with pytest.raises(AlignmentError, match="different models.*encoder.*layers.0"):
        align_events(a, b)


def test_different_steps_are_refused():
    a = [EventRef(0, 0, "op", "", "aten.mm", "forward", 0, 0)]
    b = [EventRef(0, 0, "op", "", "aten.mm", "forward", 0, 1)]
    with pytest.raises(AlignmentError, match=r"different training steps: A \[0\], B \[1\]"):
        align_events(a, b)


def test_an_extra_cast_does_not_shift_a_repeated_pattern():
    # T5's LayerNorm backward: the bf16 run casts to the weight's dtype between the two
    # `mul mul sum` patterns, the float64 run after them. Longest-block matching on names alone
    # pairs A's first pattern (+ its cast) with B's second; casts are aligned last.
    ops = lambda names: _renumber([("op", "ln", f"aten.{n}", "backward", (2,)) for n in names.split()])  # noqa: E731
    a = ops("mul mul sum _to_copy mul mul _to_copy sum pow")
    b = ops("mul mul sum mul mul sum _to_copy pow")
    al = align_events(a, b)
    pairs = {(a[p.a].name, a[p.a].call): (b[p.b].name, b[p.b].call) for p in al.pairs}
    assert pairs[("aten.mul", 0)] == ("aten.mul", 0) and pairs[("aten.mul", 2)] == ("aten.mul", 2)
    assert pairs[("aten.sum", 0)] == ("aten.sum", 0) and pairs[("aten.pow", 0)] == ("aten.pow", 0)
    assert pairs[("aten.sum", 1)] == ("aten.sum", 1)
    # each cast sits between other ops on each side: reported unmatched, never paired across
    assert [a[i].name for i in al.unmatched_a] == ["aten._to_copy"] * 2
    assert [b[i].name for i in al.unmatched_b] == ["aten._to_copy"]
    # a cast between the same two matched ops on both sides is paired
    al = align_events(ops("mul _to_copy sum mul"), ops("mul _to_copy sum _to_copy mul"))
    assert len(al.pairs) == 4 and al.unmatched_a == [] and len(al.unmatched_b) == 1


def aligns_as_plain(al, b, where) -> bool:
    """Whether alignment ``al`` of A against ``b`` pairs exactly what ``b`` against itself pairs,
    ``where[i]`` being the index in A of ``b``'s event i."""
    plain = align_events(b, b, check=False)
    return sorted((p.a, p.b, p.how) for p in al.pairs) == sorted((where[p.a], p.b, p.how) for p in plain.pairs)


@st.composite
def script_and_workload(draw):
    """(A, B, where): B a workload's step (its root module's forward first, its backward last), A
    the same step captured from a script: the script's own root ops before it (initialization),
    after it (an engine's checks) and parameter updates; where[i] is the index in A of B's event i."""
    body = draw(st.lists(event, max_size=30))
    b = _renumber([("module", "", "Root", "forward", (1,))] + body + [("module", "", "Root", "backward", (1,))])
    a, where = [], []
    for i in range(draw(st.integers(0, 4))):
        a.append(EventRef(len(a), len(a), "op", "", draw(st.sampled_from(OPS)), "forward", i))
    for e in b:
        where.append(len(a))
        a.append(dataclasses.replace(e, index=len(a), seq=len(a)))
    for i in range(draw(st.integers(0, 4))):
        a.append(EventRef(len(a), len(a), "op", "", draw(st.sampled_from(OPS)), "forward", 100 + i))
    for i in range(draw(st.integers(0, 2))):
        a.append(EventRef(len(a), len(a), "op", "optimizer", "aten.add_", "optimizer", i))
    return a, b, where


@settings(max_examples=200, deadline=None)
@given(script_and_workload())
def test_a_scripts_own_ops_are_left_out_against_a_workload(abw):
    a, b, where = abw
    al = align_events(a, b, check=False, script=(True, False))
    assert aligns_as_plain(al, b, where)
    own = set(range(len(a))) - set(where)
    assert own <= set(al.unmatched_a) and len(al.order) == len(a) + len(b) - len(al.pairs)
    assert bool(own) == any("(a script)" in n for n in al.notes)
    # both sides scripts, or neither: nothing is left out
    assert not any("(a script)" in n for n in align_events(a, b, check=False, script=(True, True)).notes)
