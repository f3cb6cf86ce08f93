"""Offline bisect from a replay dump: the same culprit as live bisect, via the API and the CLI."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from precisiondiff.bisect import bisect_dump
from precisiondiff.capture.runner import capture_workload
from precisiondiff.cli import cli

BUGGY = "examples/tiny_transformer.py:build_with_bug"
CULPRIT = ("op", "blocks.0.norm1", "pdexample.fused_rms_norm.default", "forward")  # as live bisect says


@pytest.fixture(scope="module")
def dut_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("bisect") / "dut"
    capture_workload(BUGGY, path, target="cpu/bf16", mode="replay")
    return str(path)


def _culprit(c):
    return (c["kind"], c["scope"], c["name"], c["direction"]) if c else None


def test_offline_names_the_live_culprit_with_evidence(dut_dump):
    r = bisect_dump(dut_dump, ref="cpu/float64", workload=BUGGY)
    assert r.verdict == "kernel"
    assert _culprit(r.culprit) == CULPRIT
    assert [p["scope"] for p in r.path] == ["", "blocks.0", "blocks.0.norm1"]
    assert r.evidence["inputs_fine"] is True
    assert r.final_error > 0 and r.cost["dut_runs"] == 0


def test_offline_without_workload_judges_ops_from_the_dump_alone(dut_dump):
    r = bisect_dump(dut_dump, direction="forward")
    assert _culprit(r.culprit) == CULPRIT
    assert any("no --workload" in n for n in r.notes)


def test_cli_offline_bisect(dut_dump):
    res = CliRunner().invoke(cli, ["bisect", dut_dump, "--ref", "cpu/float64", "--workload", BUGGY,
                                   "--format", "json"])
    assert res.exit_code == 1, res.output
    assert _culprit(json.loads(res.output)["culprit"]) == CULPRIT


def test_cli_rejects_a_ref_dump_for_a_workload():
    res = CliRunner().invoke(cli, ["bisect", BUGGY, "runs/ref"])
    assert res.exit_code == 2
    assert "REF_DUMP makes no sense" in res.output


def test_a_ref_dump_of_another_model_is_refused(dut_dump, tmp_path):
    from precisiondiff.errors import BisectError
    other = tmp_path / "other"
    capture_workload("tests/compare/planted.py:build_drift", other, target="cpu/float64", mode="tensors")
    with pytest.raises(BisectError, match="same workload"):
        bisect_dump(dut_dump, other)
