"""Card data model, JSON round trip, rendering and the side-by-side diff."""
from __future__ import annotations

import json

import pytest

from precisiondiff.errors import PrecisionDiffError
from precisiondiff.probe import (Card, Finding, diff_rows, load_card, render_diff_html, render_diff_table,
                                 render_html, render_json, render_table)


def sample(bits=24, mode="nearest-even") -> Card:
    card = Card("cpu/bf16", meta={"torch": "2.13.0", "cpu_capability": "AVX2"})
    card.add("gemm", "gemm", "accumulator_bits", bits, "M + M*2^-24 lost")
    card.add("gemm", "gemm", "rounding", mode, "M+0.75u -> +1u")
    card.add("gemm", "gemm", "deterministic", True, "5 runs")
    card.add("exp", "exp", "max_ulp", 0.5, "worst at x=1")
    return card


def test_add_replaces_and_get_reads():
    card = sample()
    card.add("gemm", "gemm", "accumulator_bits", 8)
    assert card.get("gemm", "accumulator_bits") == 8
    assert [f.prop for f in card.findings].count("accumulator_bits") == 1
    assert card.get("gemm", "order", None) is None
    with pytest.raises(KeyError, match="gemm.order is not on the card of cpu/bf16"):
        card.get("gemm", "order")
    assert card.ops() == ["gemm", "exp"]


def test_json_round_trip(tmp_path):
    card = sample()
    path = str(tmp_path / "card.json")
    card.save(path)
    back = load_card(path)
    assert back == card
    assert json.loads(render_json(card)) == card.to_dict()
    assert back.findings[2] == Finding("gemm", "gemm", "deterministic", True, "5 runs")


def test_loading_bad_cards_says_what_is_wrong(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(PrecisionDiffError, match="cannot read card"):
        load_card(str(missing))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(PrecisionDiffError, match="is not JSON"):
        load_card(str(garbage))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(PrecisionDiffError, match="not a probe card"):
        load_card(str(other))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": "precisiondiff.probe/1", "target": "cpu/bf16",
                                  "findings": [{"op": "gemm"}]}))
    with pytest.raises(PrecisionDiffError, match="malformed probe card"):
        load_card(str(broken))


def test_table_lists_every_finding_once_grouped_by_op():
    text = render_table(sample())
    lines = text.splitlines()
    assert lines[0] == "numerics card: cpu/bf16 (torch 2.13.0; CPU capability AVX2)"
    assert lines[1].split() == ["op", "property", "value", "evidence"]
    assert lines[2].split()[:3] == ["gemm", "accumulator_bits", "24"]
    assert lines[3].split()[:2] == ["rounding", "nearest-even"]  # op printed once per group
    assert lines[4].split()[:2] == ["deterministic", "yes"]
    assert lines[5].split()[:3] == ["exp", "max_ulp", "0.5"]


def test_html_is_self_contained_and_escaped():
    card = sample()
    card.add("gemm", "gemm", "order", "unrecognised", "<script>x</script>")
    page = render_html(card)
    assert page.startswith("<!DOCTYPE html>")
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "http" not in page


def test_diff_marks_exactly_the_properties_that_differ():
    a, b = sample(), sample(bits=14, mode="toward-zero")
    b.add("gemm", "gemm", "extra_bits", 3)
    rows = {(op, prop): (va, vb, d) for op, prop, va, vb, d in diff_rows(a, b)}
    assert rows[("gemm", "accumulator_bits")] == ("24", "14", True)
    assert rows[("gemm", "rounding")] == ("nearest-even", "toward-zero", True)
    assert rows[("gemm", "extra_bits")] == ("(absent)", "3", True)
    assert rows[("gemm", "deterministic")] == ("yes", "yes", False)
    text = render_diff_table(a, b)
    assert "3 properties differ" in text
    assert sum(line.startswith("*") for line in text.splitlines()) == 3
    assert "3 properties differ" in render_diff_table(a, b, only_differences=True)
    assert "deterministic" not in render_diff_table(a, b, only_differences=True)
    assert render_diff_html(a, b).count('class="differs"') == 3


def test_identical_cards_have_no_difference():
    assert not any(d for *_, d in diff_rows(sample(), sample()))
    assert "0 properties differ" in render_diff_table(sample(), sample())
