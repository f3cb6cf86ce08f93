"""A wrapper's prefix on one side (DDP/DeepSpeed/Megatron ``module.``, ``_orig_mod.``, FSDP1's
``_fsdp_wrapped_module.``) does not stop alignment, nor do a script capture's extra roots and
optimizer updates: hypothesis properties on random event sequences, and two real captures
compared (precisiondiff/compare/unwrap.py)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precisiondiff.compare.align import EventRef, align_events
from precisiondiff.compare.unwrap import WRAPPER_SCOPE, unwrap, wrapper_prefix
from precisiondiff.errors import AlignmentError
from tests.compare.test_align import _renumber, aligns_as_plain, event


def _wrap_scope(scope: str, prefix: str, inner: bool) -> str:
    if inner:  # FSDP1: every wrapped block keeps its module under _fsdp_wrapped_module
        scope = scope.replace("blocks.0", "blocks.0._fsdp_wrapped_module")
    return f"{prefix}.{scope}" if scope else prefix


@st.composite
def wrapped_with_prefix(draw):
    """(A, B, where, prefix): A is B's events seen through a wrapper (``prefix``), plus the
    wrapper's own events (a root module event and ops outside the model); where[i] is the index
    in A of B's event i."""
    b = _renumber(draw(st.lists(event, min_size=1, max_size=40)))
    prefix = draw(st.sampled_from(["module", "module.module", "_orig_mod"]))
    inner = draw(st.booleans())
    before = draw(st.integers(0, 3))
    a, where = [], []
    for i in range(before):  # the wrapper's own ops before it calls the model (a broadcast...)
        a.append(EventRef(len(a), len(a), "op", "", "c10d.broadcast_", "forward", i))
    for e in b:
        where.append(len(a))
        a.append(dataclasses.replace(e, index=len(a), seq=len(a), scope=_wrap_scope(e.scope, prefix, inner)))
    a.append(EventRef(len(a), len(a), "module", "", "DistributedDataParallel", "forward"))
    return a, b, where, prefix


wrapped = wrapped_with_prefix().map(lambda abwp: abwp[:3])


@settings(max_examples=200, deadline=None)
@given(wrapped)
def test_a_wrapped_side_aligns_as_the_unwrapped_one(abw):
    a, b, where = abw
    al = align_events(a, b, check=False)
    assert aligns_as_plain(al, b, where)
    wrapper_events = set(range(len(a))) - set(where)
    assert wrapper_events <= set(al.unmatched_a)
    if any(e.scope for e in b) or any(e.kind != "op" for e in b):
        assert al.notes and "wrapper" in al.notes[-1]


@settings(max_examples=100, deadline=None)
@given(st.lists(event, max_size=40))
def test_unwrapped_sides_are_left_as_they_are(raw):
    a = _renumber(raw)
    a2, b2, notes = unwrap(a, list(a))
    assert a2 == a and b2 == a and notes == []


def test_the_prefix_of_a_plain_child_is_not_stripped():
    # both sides hold the model under "encoder": no wrapper, nothing removed
    ev = lambda i, scope, name: EventRef(i, i, "module", scope, name, "forward")  # noqa: E731
    a = [ev(0, "encoder.0", "Linear"), ev(1, "encoder", "Sequential"), ev(2, "", "Model")]
    b = [ev(0, "encoder.0", "Linear"), ev(1, "encoder.1", "ReLU"), ev(2, "encoder", "Sequential"), ev(3, "", "Model")]
    assert unwrap(a, b)[2] == []
    # a wrapper whose class differs from the reference's root, under a name of its own
    a = [ev(0, "inner.0", "Linear"), ev(1, "inner", "Model"), ev(2, "", "MyWrapper")]
    b = [ev(0, "0", "Linear"), ev(1, "", "Model")]
    assert [e.scope for e in unwrap(a, b)[0]] == ["0", "", WRAPPER_SCOPE]


def _script_extras(a: list, prefix: str, n_roots: int, n_updates: int) -> list:
    """A ``--script`` capture's extra events on the wrapped side: modules built inside a forward,
    named as new roots ``Softmax_N`` with an op each, and optimizer updates of the parameters of
    ``prefix.0`` (``optimizer.param_groups.0/PREFIX.0.weight``)."""
    out = list(a)
    for k in range(1, n_roots + 1):
        out.append(EventRef(len(out), len(out), "op", f"Softmax_{k}", "aten._softmax", "forward"))
        out.append(EventRef(len(out), len(out), "module", f"Softmax_{k}", "Softmax", "forward"))
    for k in range(n_updates):
        out.append(EventRef(len(out), len(out), "op", f"optimizer.param_groups.0/{prefix}.0.weight",
                            "aten.lerp_.Scalar", "optimizer", k))
    return out


@settings(max_examples=150, deadline=None)
@given(wrapped_with_prefix(), st.integers(0, 3), st.integers(0, 4))
def test_script_roots_and_updates_on_the_wrapped_side_do_not_stop_unwrapping(abwp, n_roots, n_updates):
    a, b, where, prefix = abwp
    a = _script_extras(a, prefix, n_roots, n_updates)
    al = align_events(a, b, check=False)
    # every event of the model pairs as without the extras (they stay unmatched)
    assert aligns_as_plain(al, b, where)
    unwrapped = {e.index: e.scope for e in unwrap(a, b)[0]}
    for e in a[len(a) - 2 * n_roots - n_updates:]:
        if e.direction == "optimizer" and al.notes:
            assert unwrapped[e.index] == "optimizer.param_groups.0/0.weight"
        elif e.direction != "optimizer":
            assert unwrapped[e.index] == e.scope  # a script root keeps its path


def test_updates_only_one_side_ran_are_not_counted_as_another_model():
    ev = lambda i, scope, name, d="forward": EventRef(i, i, "op", scope, name, d)  # noqa: E731
    b = [ev(i, "0", "aten.mm") for i in range(4)]
    a = b + [ev(4 + i, f"optimizer.param_groups.0/0.w{i}", "aten.add_", "optimizer") for i in range(8)]
    align_events(a, b)  # 4 of 12 events match, but the 8 are updates B never ran: no AlignmentError
    c = [ev(i, "0", "aten.mm") for i in range(2)] + [ev(2 + i, "1", "aten.relu") for i in range(6)]
    with pytest.raises(AlignmentError):
        align_events(c, b + [ev(4 + i, "2", "aten.gelu") for i in range(4)])


WORKLOAD = '''
import torch, precisiondiff
from torch import nn

class Float16Module(nn.Module):
    """Megatron's wrapper: the model under .module, its input cast to the model's dtype."""
    def __init__(self, module):
        super().__init__()
        self.module = module
    def forward(self, x):
        return self.module(x.to(next(self.module.parameters()).dtype))

def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))

def _loss(o):
    return o.double().square().mean()

def wrapped():
    model = Float16Module(_model())
    return precisiondiff.Workload(model, torch.randn(4, 8), loss=_loss)

def plain():
    model = _model()
    return precisiondiff.Workload(model, torch.randn(4, 8), loss=_loss)
'''


def test_a_megatron_style_wrapped_capture_compares_with_the_plain_reference(tmp_path):
    from precisiondiff.capture.runner import capture_workload
    from precisiondiff.compare import compare
    (tmp_path / "wl.py").write_text(WORKLOAD)
    for fn, target, out in (("wrapped", "cpu/bf16", "dut"), ("plain", "cpu/float64", "ref")):
        capture_workload(f"{tmp_path / 'wl.py'}:{fn}", tmp_path / out, target=target, mode="tensors")
    cmp = compare(tmp_path / "dut", tmp_path / "ref")
    assert cmp.exit_code == 0, [r.message for r in cmp.rows if r.verdict == "fail"]
    assert any("wrapper prefix 'module.'" in n and "Float16Module" in n for n in cmp.notes), cmp.notes
    matched = [row for row in cmp.rows if row.verdict != "unmatched"]
    assert {row.scope for row in matched if row.kind == "module"} >= {"module.0", "module.3", "module"}
    # only the wrapper's own events (its root module and its input cast) have no partner
    unmatched = {(row.scope, row.name) for row in cmp.rows if row.verdict == "unmatched"}
    assert unmatched and all(scope == "" for scope, _ in unmatched), unmatched


@pytest.mark.parametrize("recorded, model, prefix", [
    (["", "module", "module.fc"], ["", "fc"], "module"),
    (["", "module", "module.module", "module.module.fc"], ["", "fc"], "module.module"),
    (["", "fc"], ["", "fc"], ""),             # nothing to resolve
    (["", "module", "module.other"], ["", "fc"], ""),  # another model: no prefix fits
    (["", "encoder", "encoder.fc"], ["", "fc"], ""),   # a child of another name is not a wrapper
])
def test_the_wrapper_prefix_of_recorded_paths_in_a_model(recorded, model, prefix):
    assert wrapper_prefix(recorded, model) == prefix
