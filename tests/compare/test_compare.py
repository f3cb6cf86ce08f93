"""compare(): end to end on the example, the JSON shape, noise and determinism, bad input."""
from __future__ import annotations

import json

import pytest

from precisiondiff.compare import compare
from precisiondiff.errors import AlignmentError, DumpError

from .conftest import needs_budgets, stats, write_dump

LEVELS = ("module", "op", "all")
MODES = ("stats", "tensors", "replay")


def _check_structure(c, level: str, mode: str) -> None:
    kinds = {r.kind for r in c.rows}
    assert kinds <= {"module", "op", "param"}
    assert ("op" in kinds) == (level != "module")
    assert ("module" in kinds) == (level != "op")
    assert {r.verdict for r in c.rows} <= {"pass", "fail", "unmatched"}
    # A's rows come in execution order
    a_seqs = [r.seq for r in c.rows if r.side in ("both", "a") and r.verdict != "unmatched"]
    assert a_seqs == sorted(a_seqs)
    compared = [r for r in c.rows if r.verdict != "unmatched" and r.mode != "uninitialized"]
    want_mode = "stats" if mode == "stats" else "tensors"
    assert {r.mode for r in compared if r.dtype_a in ("bfloat16",)} == {want_mode}
    assert all(r.dtype_b == "float64" for r in compared if r.dtype_a == "bfloat16")
    assert {r.direction for r in compared} == {"forward", "backward"}
    # the bf16 run casts the logits for the loss: two extra ops on A, nothing only in B
    assert c.summary["unmatched_b"] == 0
    assert c.summary["unmatched_a"] == (0 if level == "module" else 2)
    assert c.summary["tensors"] == len(compared) + sum(r.mode == "uninitialized" for r in c.rows)
    assert c.summary["failed"] == sum(r.verdict == "fail" for r in c.rows)
    assert c.exit_code == (1 if c.summary["failed"] else 0)
    if c.first_divergence:
        first = next(r for r in c.rows if r.verdict == "fail")
        assert c.first_divergence["key"] == first.key
    json.loads(c.to_json())


@pytest.mark.parametrize("level", LEVELS)
def test_example_bf16_vs_float64_stats(capture_example, level):
    c = compare(capture_example("cpu/bf16", level, "stats"), capture_example("cpu/float64", level, "stats"))
    _check_structure(c, level, "stats")
    # statistics of a healthy bf16 run stay within the loose stats bounds
    assert c.summary["failed"] == 0, [r.message for r in c.rows if r.verdict == "fail"][:3]
    assert c.growth["forward"] and c.growth["backward"] if level != "op" else True


@needs_budgets
@pytest.mark.parametrize("mode", ("tensors", "replay"))
@pytest.mark.parametrize("level", LEVELS)
def test_example_bf16_vs_float64_tensors(capture_example, level, mode):
    c = compare(capture_example("cpu/bf16", level, mode), capture_example("cpu/float64", level, mode))
    _check_structure(c, level, mode)
    rows = [r for r in c.rows if r.mode == "tensors" and r.dtype_a == "bfloat16" and r.dtype_b]
    assert all("max_ulp" in r.metrics and "diff2" in r.metrics for r in rows)
    assert all(r.error is not None for r in rows)


def test_json_shape_is_the_design_contract(tmp_path):
    a = write_dump(tmp_path / "a", [{"name": "aten.mm.default", "scope": "l.0", "tensors": {"output.0": stats(1.0)}},
                                    {"name": "aten.add.Tensor", "scope": "l.0", "tensors": {"output.0": stats(2.0)}}])
    b = write_dump(tmp_path / "b", [{"name": "aten.mm.default", "scope": "l.0", "tensors": {"output.0": stats(1.0)}},
                                    {"name": "aten.add.Tensor", "scope": "l.0", "tensors": {"output.0": stats(3.0)}}],
                   target="cpu/float64")
    doc = json.loads(compare(a, b).to_json())
    assert list(doc)[:5] == ["a", "b", "summary", "first_divergence", "rows"]
    assert {k: doc["summary"][k] for k in ("tensors", "failed", "unmatched_a", "unmatched_b")} == \
        {"tensors": 2, "failed": 1, "unmatched_a": 0, "unmatched_b": 0}
    assert {k: doc["first_divergence"][k] for k in ("key", "scope", "name", "direction")} == \
        {"key": "l.0/aten.add.Tensor#0:forward:output.0", "scope": "l.0", "name": "aten.add.Tensor",
         "direction": "forward"}
    row = doc["rows"][0]
    assert list(row)[:11] == ["key", "seq", "scope", "name", "kind", "direction", "slot", "dtype_a",
                              "dtype_b", "metrics", "verdict"]
    assert (row["seq"], row["kind"], row["dtype_a"], row["verdict"]) == (0, "op", "bfloat16", "pass")
    assert isinstance(row["metrics"]["rel_norm"], float)
    assert doc["rows"][1]["verdict"] == "fail"


def test_unmatched_events_are_rows_not_failures(tmp_path):
    ev = lambda n, v=1.0: {"name": n, "tensors": {"output.0": stats(v)}}  # noqa: E731
    a = write_dump(tmp_path / "a", [ev("aten.mm"), ev("aten._to_copy"), ev("aten.add"), ev("aten.mul")])
    b = write_dump(tmp_path / "b", [ev("aten.mm"), ev("aten.add"), ev("aten.mul"), ev("aten.relu")],
                   target="cpu/float64")
    c = compare(a, b)
    assert [(r.name, r.verdict, r.side) for r in c.rows] == [
        ("aten.mm", "pass", "both"), ("aten._to_copy", "unmatched", "a"), ("aten.add", "pass", "both"),
        ("aten.mul", "pass", "both"), ("aten.relu", "unmatched", "b")]
    assert (c.summary["unmatched_a"], c.summary["unmatched_b"], c.exit_code) == (1, 1, 0)


def test_noise_floor_passes_rows_within_run_to_run_noise(tmp_path):
    ev = lambda v: [{"name": "aten.sum", "tensors": {"output.0": stats(v)}}]  # noqa: E731
    a = write_dump(tmp_path / "a", ev(1.0))
    b = write_dump(tmp_path / "b", ev(1.1), target="cpu/float64")   # 9% off: fails bf16 stats
    c = compare(a, b)
    assert c.rows[0].verdict == "fail"
    n = write_dump(tmp_path / "n", ev(1.06))                          # the DUT itself moves 6%
    c = compare(a, b, noise=n)
    assert c.rows[0].verdict == "pass" and c.rows[0].within_noise
    assert "within run-to-run noise" in c.rows[0].message
    assert any("noise" in note for note in c.notes) and c.exit_code == 0
    quiet = write_dump(tmp_path / "q", ev(1.001))
    assert compare(a, b, noise=quiet).rows[0].verdict == "fail"
    other = write_dump(tmp_path / "o", ev(1.0), target="cpu/float64")
    with pytest.raises(AlignmentError, match="noise dump .* not the DUT"):
        compare(a, b, noise=other)


def test_determinism_of_two_runs(capture_example):
    base = capture_example("cpu/bf16", "all", "stats", repeat=2)
    c = compare(f"{base}/run0", f"{base}/run1")
    assert c.determinism["bitwise"] is True and c.determinism["nondeterministic"] == 0
    assert c.exit_code == 0 and any("bitwise deterministic" in n for n in c.notes)


def test_nondeterminism_is_reported_with_its_floor(tmp_path):
    a = write_dump(tmp_path / "a", [{"name": "aten.sum", "tensors": {"output.0": stats(1.0, fp="x")}}])
    b = write_dump(tmp_path / "b", [{"name": "aten.sum", "tensors": {"output.0": stats(1.001, fp="y")}}])
    c = compare(a, b)
    assert c.determinism["bitwise"] is False and c.determinism["nondeterministic"] == 1
    assert c.determinism["noise_floor"][0]["error"] == pytest.approx(0.001 / 1.001)
    assert c.exit_code == 0


def test_filters(capture_example):
    a, b = capture_example("cpu/bf16", "all", "stats"), capture_example("cpu/float64", "all", "stats")
    c = compare(a, b, scope=r"^blocks\.1\.mlp", direction="forward")
    assert c.rows and all(r.scope.startswith("blocks.1.mlp") and r.direction == "forward" for r in c.rows)
    c = compare(a, b, op="Linear", kind="module")
    assert {r.name for r in c.rows} == {"Linear"}


def test_different_models_and_steps_are_refused(tmp_path):
    ev = lambda scope, step=0: {"name": "aten.mm", "scope": scope, "step": step,  # noqa: E731
                                "tensors": {"output.0": stats()}}
    a = write_dump(tmp_path / "a", [ev(f"enc.{i}") for i in range(6)])
    b = write_dump(tmp_path / "b", [ev(f"dec.{i}") for i in range(6)])
    with pytest.raises(AlignmentError, match="different models"):
        compare(a, b)
    c = write_dump(tmp_path / "c", [ev(f"enc.{i}", step=1) for i in range(6)])
    with pytest.raises(AlignmentError, match=r"different training steps: A \[0\], B \[1\]"):
        compare(a, c)


def test_missing_and_non_dump_paths(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        compare(tmp_path / "nope", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="not a precisiondiff dump"):
        compare(tmp_path / "empty", tmp_path / "empty")


def test_clean_bf16_run_is_within_the_end_to_end_budget(capture_example):
    """bf16 rounding carried through a correct network is not called divergence."""
    result = compare(capture_example("cpu/bf16", "all", "tensors"), capture_example("cpu/float64", "all", "tensors"))
    assert result.summary["failed"] == 0 and result.first_divergence is None
    assert result.exit_code == 0


def test_planted_drift_is_the_first_divergence(capture_example):
    import os
    spec = os.path.join(os.path.dirname(__file__), "planted.py") + ":build_drift"
    result = compare(capture_example("cpu/bf16", "all", "tensors", spec=spec),
                     capture_example("cpu/float64", "all", "tensors", spec=spec))
    first = result.first_divergence
    assert first is not None and result.exit_code == 1
    assert (first["scope"], first["name"], first["direction"]) == ("1", "pdcompare.rough_gelu.default", "forward")
    row = next(r for r in result.rows if r.key == first["key"])
    assert "relative L2 error" in row.message and "bisect" in row.message


def _two_rank_capture(path, target, monkeypatch, scale=1.0):
    import torch
    from torch import nn

    from precisiondiff.capture import capture
    from precisiondiff.runtime.targets import Target
    t = Target.parse(target)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(rank)
        model = t.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)))
        x = t.prepare_inputs(torch.randn(4, 8)) * (scale if rank == 1 else 1.0)
        with capture(path, model=model, mode="tensors", meta={"target": target}):
            model(x)


def test_multi_rank_dumps_compare_rank_by_rank(tmp_path, monkeypatch):
    _two_rank_capture(tmp_path / "a", "cpu/bf16", monkeypatch)
    _two_rank_capture(tmp_path / "b", "cpu/float64", monkeypatch)
    result = compare(tmp_path / "a", tmp_path / "b")
    assert set(result.ranks) == {0, 1}
    assert {r.rank for r in result.rows} == {0, 1}
    assert result.summary["tensors"] == sum(v["tensors"] for v in result.ranks.values())
    data = json.loads(result.to_json())
    assert set(data["ranks"]) == {"0", "1"}


@pytest.mark.parametrize("level_b,kinds", [("op", {"op"}), ("module", {"module", "param"})])
def test_level_all_compares_with_a_narrower_level(capture_example, level_b, kinds):
    result = compare(capture_example("cpu/bf16", "all", "tensors"), capture_example("cpu/float64", level_b, "tensors"))
    assert result.summary["tensors"] > 20
    assert {r.kind for r in result.rows if r.verdict != "unmatched"} == kinds
    assert any("only" in n for n in result.notes)
