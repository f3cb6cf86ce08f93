"""The compiled engine (a C++ dispatcher hook in front of the Python mode) records exactly what the
Python engine records: the same events in the same order, the same call numbers, the statistics
to the last bit. The Python engine is the oracle; both capture the same real small models.

The hook is built on first use (~30-60 s on two cores, cached after); where it cannot be built
(no compiler) these tests are skipped with the reason, and capture falls back to the Python
engine (tested below with the build refused)."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from precisiondiff.capture import MemorySink, capture
from precisiondiff.capture import compiled

from .test_capture_equivalence import _Block, _ids, _run, _same

needs_hook = pytest.mark.skipif(compiled.load() is None, reason=f"no compiled hook: {compiled.unavailable_reason()}")


def _run_grad(model: nn.Module, ids: torch.Tensor, dtype: torch.dtype, steps: int, **kw) -> MemorySink:
    """:func:`_run` with the gradients taken by ``torch.autograd.grad`` (none accumulated)."""
    sink = MemorySink()
    params = [p for p in model.parameters() if p.requires_grad]
    with capture(model=model, sink=sink, **kw) as cap:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(ids)
            torch.autograd.grad(loss, params)
            with torch.no_grad():
                bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0], dtype=dtype)
                (bad * 2.0).sum()
            cap.step()
    return sink


def _engines(dtype: torch.dtype, run=_run_grad, steps: int = 2, **kw):
    torch.manual_seed(0)
    base = _Block().train(False)
    ids = _ids()
    out = {}
    for engine in ("python", "compiled"):
        out[engine] = run(copy.deepcopy(base), ids, dtype, steps, engine=engine, **kw)
    return out["compiled"], out["python"]


@needs_hook
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["op", "all"])
def test_the_compiled_engine_records_what_the_python_engine_records(dtype, level):
    fast, oracle = _engines(dtype, level=level, mode="stats")
    _same(fast, oracle)
    names = {e["name"] for e in fast.events if e["kind"] == "op"}
    # forward and backward ops, in-place ops (left to the Python mode), integer outputs, a
    # negative view (resolved by a clone the Python mode records)
    assert {"aten.mm.default", "aten.mul_.Tensor", "aten.embedding.default", "aten.clone.default"} <= names
    assert {e["direction"] for e in fast.events} == {"forward", "backward"}


def _without_gradient_copies(sink: MemorySink) -> list:
    return [{k: v for k, v in e.items() if k != "seq"} for e in sink.events
            if not (e["direction"] == "backward" and e["name"] == "aten.copy_.default")]


@needs_hook
def test_under_backward_the_compiled_engine_differs_only_by_the_gradient_copies_it_does_not_cause():
    """The Python engine keeps recorded tensors alive (its de-duplication window), so autograd
    cannot steal a fresh gradient into ``.grad`` and copies it instead (``AccumulateGrad``): the
    Python engine records that ``copy_``, which only capture caused. The compiled engine holds
    copies of small tensors, not the tensors: the gradient is stolen as without capture, and
    every other event is the same."""
    fast, oracle = _engines(torch.bfloat16, run=_run, level="all", mode="stats")
    copies = [e for e in oracle.events if e["direction"] == "backward" and e["name"] == "aten.copy_.default"]
    assert copies and len(fast.events) < len(oracle.events)
    a, b = _without_gradient_copies(fast), _without_gradient_copies(oracle)
    assert len(a) == len(b) > 30
    for x, y in zip(a, b):
        assert repr(x) == repr(y)


@needs_hook
def test_most_calls_are_recorded_by_the_hook_and_the_engine_is_noted_in_the_dump(tmp_path):
    import json
    torch.manual_seed(0)
    model = _Block().train(False)
    with capture(tmp_path / "d", model=model, level="op", mode="stats", engine="compiled") as cap:
        model(_ids()).backward()
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    engine = meta["capture_engine"]
    assert engine["name"] == "compiled" and cap.engine_report == engine
    from precisiondiff.store import load
    events = sum(1 for _ in load(tmp_path / "d").events(kind="op"))
    # in-place ops (mul_, the gradients' accumulation) go to the Python mode; most calls do not
    assert engine["compiled_events"] >= events // 2 and engine["compiled_events"] < events


@needs_hook
def test_a_scope_filter_and_a_paused_session_hold_on_the_compiled_engine():
    torch.manual_seed(0)
    base = _Block().train(False)
    ids = _ids()
    got = {}
    for engine in ("python", "compiled"):
        model = copy.deepcopy(base)
        sink = MemorySink()
        with capture(model=model, sink=sink, level="op", scope="norm|proj", engine=engine) as cap:
            model(ids)
            with cap.suspended():
                model(ids)  # not recorded
            torch.autograd.grad(model(ids), list(model.parameters()))
        got[engine] = sink
    fast, oracle = got["compiled"].events, got["python"].events
    assert len(fast) == len(oracle) >= 6
    assert all(repr(a) == repr(b) for a, b in zip(fast, oracle))
    assert {e["scope"] for e in fast} == {"norm", "proj"}


@needs_hook
def test_the_collectors_young_threshold_is_raised_while_the_hook_records_and_then_put_back():
    import gc
    before = gc.get_threshold()
    seen = []
    model = nn.Linear(4, 4)
    try:
        gc.set_threshold(700, *before[1:])
        with capture(model=model, sink=MemorySink(), level="op", engine="compiled"):
            model(torch.randn(2, 4))
            seen.append(gc.get_threshold())
        from precisiondiff.capture.session import YOUNG_THRESHOLD
        assert seen == [(YOUNG_THRESHOLD, *before[1:])]
        assert gc.get_threshold() == (700, *before[1:])
        # a threshold the program set meanwhile is the program's: left as it is
        with capture(model=model, sink=MemorySink(), level="op", engine="compiled"):
            gc.set_threshold(123, *before[1:])
        assert gc.get_threshold() == (123, *before[1:])
    finally:
        gc.set_threshold(*before)


def test_without_a_compiler_capture_falls_back_to_the_python_engine(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled, "_EXT", None)
    monkeypatch.setattr(compiled, "_ERROR", "RuntimeError: no C++ compiler (planted)")
    model = nn.Linear(4, 4)
    sink = MemorySink()
    with capture(model=model, sink=sink, level="op", engine="compiled") as cap:
        model(torch.randn(2, 4)).sum().backward()
    assert cap.engine_report == {"name": "python", "asked": "compiled",
                                 "why": "RuntimeError: no C++ compiler (planted)"}
    assert any(e["name"] == "aten.addmm.default" for e in sink.events)


def test_an_unknown_engine_is_one_clear_error():
    from precisiondiff.errors import PrecisionDiffError
    with pytest.raises(PrecisionDiffError, match="unknown capture engine 'cxx'"):
        capture(model=nn.Linear(2, 2), sink=MemorySink(), engine="cxx")


_C_CALL = None


def _c_stats(t: torch.Tensor):
    """The kernel's C entry point (what the hook calls) on ``t``, through ctypes."""
    import ctypes

    import numpy as np
    from precisiondiff.capture import stats_kernel
    global _C_CALL
    if _C_CALL is None:
        _C_CALL = (stats_kernel.c_entries(), ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 7))
    entries, proto = _C_CALL
    out, words = np.zeros(7), np.zeros(2, dtype=np.int64)
    proto(entries["functions"][t.dtype])(t.data_ptr(), t.numel(), entries["infinities"][t.dtype], entries["table"],
                                         entries["cumulative"], out.ctypes.data, words.ctypes.data)
    return out, words


needs_c_kernel = pytest.mark.skipif(compiled.load() is None or __import__(
    "precisiondiff.capture.stats_kernel", fromlist=["c_entries"]).c_entries() is None, reason="no C statistics kernel")


@needs_c_kernel
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       n=st.sampled_from([1, 3, 64, 4095, 4096, 4097, 70000]), scale=st.sampled_from([1e-30, 1e-3, 1.0, 3e4]),
       special=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]), seed=st.integers(0, 2 ** 16))
def test_the_hooks_c_kernel_gives_the_python_paths_statistics_bit_for_bit(dtype, n, scale, special, seed):
    import numpy as np
    from precisiondiff.capture import stats_kernel
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    if special is not None:
        t[n // 2] = special
    out, fps = np.zeros((1, 7)), np.zeros((1, 2), dtype=np.int64)
    stats_kernel.stats_into(t, out, fps, 0)
    c_out, c_words = _c_stats(t)
    assert out[0].tobytes() == c_out.tobytes() and fps[0].tobytes() == c_words.tobytes()


@needs_hook
def test_a_session_inside_another_takes_the_python_engine():
    outer_sink, inner_sink = MemorySink(), MemorySink()
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with capture(model=a, sink=outer_sink, level="op", engine="compiled") as outer:
        with capture(model=b, sink=inner_sink, level="op", engine="compiled") as inner:
            b(torch.randn(2, 4))
        a(torch.randn(2, 4))
    assert inner.engine_report["name"] == "python" and "another capture session" in inner.engine_report["why"]
    assert outer.engine_report["name"] == "compiled"
    assert "aten.addmm.default" in {e["name"] for e in outer_sink.events}
    assert "aten.addmm.default" in {e["name"] for e in inner_sink.events}


@needs_hook
def test_a_higher_order_operator_is_one_unit_under_the_compiled_engine():
    """A HOP dispatches in Python from the thread's keys, where the hook's key has no kernel: it
    falls through it, reaches the Python mode and is recorded as one unit, its subgraph's ops not."""
    from torch._higher_order_ops.while_loop import while_loop
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def run():
        with torch.no_grad():
            return while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, lin(h).tanh()), (torch.tensor(0), x))
    plain = run()
    names = {}
    for engine in ("python", "compiled"):
        sink = MemorySink()
        with capture(sink=sink, model=lin, level="op", engine=engine) as cap:
            captured = run()
        assert not cap.errors and all(torch.equal(a, b) for a, b in zip(plain, captured))
        names[engine] = [e["name"] for e in sink.events]
    assert "higher_order.while_loop" in names["compiled"] and names["compiled"] == names["python"]
    assert "aten.tanh.default" not in names["compiled"]


@needs_hook
def test_a_backward_whose_mask_leaves_outputs_out_records_what_the_python_engine_records():
    """``convolution_backward`` without the input's gradient returns an undefined tensor (None in
    Python): not a recorded output, not counted in the slots' numbering."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3)
    x = torch.randn(1, 2, 6, 6)
    got = {}
    for engine in ("python", "compiled"):
        sink = MemorySink()
        with capture(model=conv, sink=sink, level="op", engine=engine) as cap:
            torch.autograd.grad(conv(x).sum(), list(conv.parameters()))
        assert cap.engine_report is None or cap.engine_report["name"] == engine
        got[engine] = sink.events
    (bwd,) = [e for e in got["compiled"] if e["name"] == "aten.convolution_backward.default"]
    assert [t["slot"] for t in bwd["tensors"] if t["slot"].startswith("output")] == ["output.0", "output.1"]
    assert len(got["compiled"]) == len(got["python"]) and all(
        repr(a) == repr(b) for a, b in zip(got["compiled"], got["python"]))
