"""pandas frames of a dump, a comparison and a bisect result (report/frames.py)."""
from __future__ import annotations

import math
import sys

import pytest

import precisiondiff
from precisiondiff.bisect import BisectResult
from precisiondiff.errors import PrecisionDiffError
from precisiondiff.report.frames import bisect_frame

pd = pytest.importorskip("pandas")


def test_dump_frame_has_one_row_per_tensor_with_its_statistics(planted_dumps):
    dump = precisiondiff.load(planted_dumps[0])
    records = [(ev, t) for ev in dump.events() for t in ev.tensors]
    df = dump.to_pandas()
    assert len(df) == len(records)
    assert list(df.columns[:6]) == ["seq", "step", "rank", "kind", "scope", "name"]
    for i in (0, len(records) // 2, len(records) - 1):
        ev, t = records[i]
        row = df.iloc[i]
        assert (row.seq, row.scope, row["name"], row.slot, row.key, row["dtype"]) == \
            (ev.seq, ev.scope, ev.name, t.slot, t.key, t.dtype)
        assert row["shape"] == tuple(t.shape) and row.numel == math.prod(t.shape)
        assert row["max"] == pytest.approx(t.stats["max"]) and row["norm"] == pytest.approx(t.stats["norm"])
    ops = dump.to_pandas(kind="op")
    assert set(ops.kind) == {"op"} and len(ops) == sum(len(e.tensors) for e in dump.events(kind="op"))


def test_comparison_frame_has_one_row_per_row_and_a_column_per_metric(planted_dumps):
    c = precisiondiff.compare(*planted_dumps)
    df = c.to_pandas()
    assert len(df) == len(c.rows)
    assert list(df.key) == [r.key for r in c.rows]
    assert list(df.verdict) == [r.verdict for r in c.rows]
    failing = df[df.verdict == "fail"]
    assert len(failing) == c.summary["failed"] > 0
    assert set(failing["name"]) >= {"pdeco.rough_gelu.default"}
    worst = c.top(1)[0]
    row = df[df.key == worst.key].iloc[0]
    assert row.error == pytest.approx(worst.error)
    assert row.max_ulp == pytest.approx(worst.metrics["max_ulp"])
    assert row.max_abs_err == pytest.approx(worst.metrics["max_abs_err"])


def _result() -> BisectResult:
    unit = lambda scope, ulp: {"kind": "op", "scope": scope, "name": "pdeco.rough_gelu.default",  # noqa: E731
                               "direction": "forward", "call": 0, "local": {"max_ulp": ulp, "rel_l2": float("inf")},
                               "budget": {"dtype": "bfloat16", "max_ulp": 2.0}, "message": "m"}
    return BisectResult("kernel", "cpu/bf16", "cpu/float64", culprit=unit("blocks.0", 9.0),
                        candidates=[unit("blocks.1", 7.0)],
                        path=[{"kind": "module", "scope": "", "name": "Net", "local": {"rel_l2": 0.1}},
                              {"kind": "module", "scope": "blocks.0", "name": "Block", "local": {}}])


def test_bisect_frame_lists_culprit_candidates_and_path_with_metrics_and_budget():
    df = _result().to_pandas()
    assert list(df.role) == ["culprit", "candidate", "path", "path"]
    assert list(df.scope) == ["blocks.0", "blocks.1", "", "blocks.0"]
    assert list(df.max_ulp[:2]) == [9.0, 7.0] and df.max_ulp[2:].isna().all()
    assert list(df["budget.max_ulp"][:2]) == [2.0, 2.0]
    assert df.rel_l2[0] == float("inf") and df.rel_l2[2] == 0.1  # "inf" in the JSON is a float again
    assert bisect_frame(_result().to_json()).equals(df)  # the JSON dict gives the same frame


def test_parity_bisect_frame_is_empty_with_its_columns():
    df = BisectResult("parity", "cpu/bf16", "cpu/float64").to_pandas()
    assert df.empty and list(df.columns[:3]) == ["role", "rank_in_role", "kind"]


def test_without_pandas_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(PrecisionDiffError, match=r"pip install 'precisiondiff\[pandas\]'"):
        _result().to_pandas()
