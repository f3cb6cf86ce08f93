"""Suspects: where error is introduced, ranked by growth against the error of each event's own
inputs (compare/suspects.py), in the JSON, the table and the HTML report."""
from __future__ import annotations

import io
import json
import math
import os
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from precisiondiff.compare import compare
from precisiondiff.compare.suspects import SUSPECT_GROWTH, growth, rank
from precisiondiff.report.html import render_html
from precisiondiff.report.table import render_table

from .conftest import stats, write_dump

DRIFT = os.path.join(os.path.dirname(__file__), "planted.py") + ":build_drift"


def test_the_planted_op_is_the_first_suspect_and_the_hint_names_bisect(capture_example):
    # rough_gelu (SiLU for GELU, in bf16 only) runs in blocks 1 and 2: its output error jumps
    # while every stock op passes its inputs' error on
    a = capture_example("cpu/bf16", "all", "tensors", spec=DRIFT)
    b = capture_example("cpu/float64", "all", "tensors", spec=DRIFT)
    c = compare(a, b)
    names = [(s["scope"], s["name"]) for s in c.suspects]
    assert names == [("1", "pdcompare.rough_gelu.default"), ("2", "pdcompare.rough_gelu.default")]
    first = c.suspects[0]
    assert first["growth"] >= 4 * SUSPECT_GROWTH and first["typical_growth"] < 1.5
    assert math.isclose(first["growth"], first["error"] / max(first["input_error"], 2.0 ** -8))
    # the module around it grows with it: only the innermost (the op) is named
    assert all(s["kind"] == "op" for s in c.suspects)
    hint = f"`precisiondiff bisect {DRIFT} --target cpu/bf16 --ref cpu/float64 --direction forward`"
    assert any(n.startswith("Hint:") and hint in n for n in c.notes)
    assert json.loads(c.to_json())["suspects"][0]["name"] == "pdcompare.rough_gelu.default"
    console = Console(width=300, record=True, file=io.StringIO())
    render_table(c, console)
    text = console.export_text()
    assert "FIRST DIVERGENCE; SUSPECT 1 (x" in text and "SUSPECT 2 (x" in text and "suspects (output error against their own inputs' error" in text
    assert "  1. seq 4 forward op 1 pdcompare.rough_gelu.default output.0: error " in text and hint in text
    html = render_html(c, worst=0)
    assert "<h2>Suspects: where error is introduced</h2>" in html and hint.replace("`", "") in html.replace("`", "")


def test_a_healthy_run_has_no_suspect(capture_example):
    c = compare(capture_example("cpu/bf16", "all", "tensors"), capture_example("cpu/float64", "all", "tensors"))
    grown = [r.growth for r in c.rows if r.growth is not None]
    assert grown and c.suspects == [] and not any(n.startswith("Hint:") for n in c.notes)


def _op(name, inputs, outputs):
    slots = {f"input.{i}": s for i, s in enumerate(inputs)}
    slots.update({f"output.{i}": s for i, s in enumerate(outputs)})
    return {"name": name, "tensors": slots}


def test_stats_dumps_link_inputs_by_their_statistics(tmp_path):
    # three ops in a chain; A's error: 1e-2 out of the first, the middle op jumps it to 0.5
    x, y, z = stats(1.0), stats(1.0), stats(1.0)
    xa, ya, za = stats(1.01), stats(1.5), stats(1.51)
    events_a = [_op("aten.exp.default", [stats(1.0)], [xa]), _op("aten.mul.Tensor", [xa], [ya]),
                _op("aten.neg.default", [ya], [za])]
    events_b = [_op("aten.exp.default", [stats(1.0)], [x]), _op("aten.mul.Tensor", [x], [y]),
                _op("aten.neg.default", [y], [z])]
    c = compare(write_dump(tmp_path / "a", events_a, meta={"workload": "m.py:build"}),
                write_dump(tmp_path / "b", events_b, target="cpu/float64"))
    assert [(s["name"], round(s["growth"])) for s in c.suspects] == [("aten.mul.Tensor", 50)]
    assert any("precisiondiff bisect m.py:build --target cpu/bf16 --ref cpu/float64" in n for n in c.notes)


def _row(seq, scope, kind, error, input_error, direction="forward"):
    g = growth(error, input_error, "bfloat16")
    return SimpleNamespace(key=f"{scope}/{kind}#{seq}", seq=seq, rank=0, scope=scope, name=kind, kind=kind,
                           direction=direction, slot="output.0", error=error, input_error=input_error,
                           growth=g, verdict="pass")


errors = st.floats(0, 1, allow_nan=False)
scopes = st.sampled_from(["", "a", "a.b", "a.b.c", "d"])


@given(st.lists(st.tuples(scopes, st.sampled_from(["op", "module"]), errors, st.none() | errors), max_size=30))
def test_rank_orders_by_growth_over_the_threshold_and_names_the_innermost(spec):
    rows = [_row(i, *t) for i, t in enumerate(spec)]
    picked = rank(rows, limit=len(rows) + 1)
    grown = [s["growth"] for s in picked]
    assert grown == sorted(grown, reverse=True) and all(g >= SUSPECT_GROWTH for g in grown)
    for s in picked:
        assert s["growth"] == s["error"] / max(s["input_error"] or 0.0, 2.0 ** -8)
        if s["kind"] == "module":  # no other suspect ran inside it
            inside = [o for o in picked if o is not s and (s["scope"] == "" or o["scope"] == s["scope"]
                      or o["scope"].startswith(s["scope"] + ".")) and not (o["kind"] == "module" and o["scope"] == s["scope"])]
            assert inside == []
    over = [r for r in rows if r.growth >= SUSPECT_GROWTH]
    assert bool(picked) == bool(over)
