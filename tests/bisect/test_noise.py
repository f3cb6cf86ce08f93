"""Live bisect with ``noise=True``: a nondeterministic kernel is not mistaken for a culprit."""
from __future__ import annotations

import json

from click.testing import CliRunner

from precisiondiff.bisect import bisect
from precisiondiff.bisect.render import summary_lines

from . import planted

NOISY = "pdtest.noisy_reduce.default"


def test_noisy_kernel_is_blamed_without_noise():
    r = bisect(planted.noisy_workload, target="cpu/bf16")
    assert r.verdict == "kernel"
    assert r.culprit["name"] == NOISY
    assert r.noise is None and "noise" not in r.to_json()


def test_noisy_kernel_is_within_noise_with_noise():
    r = bisect(planted.noisy_workload, target="cpu/bf16", noise=True)
    assert r.verdict in ("parity", "accumulated"), r.culprit
    assert r.noise["nondeterministic_ops"] == 1
    [w] = r.noise["within_noise"]
    assert (w["scope"], w["name"], w["direction"], w["call"]) == ("", NOISY, "forward", 0)
    assert 0 < w["max_abs_error"] <= 2 * w["noise"]
    note = [n for n in r.notes if "nondeterministic on the DUT" in n]
    assert len(note) == 1 and note[0].startswith("1 op call(s) nondeterministic") and NOISY in note[0]
    assert r.cost["dut_runs"] == 2  # capture + the second (noise) run; no substitution
    assert json.loads(r.dumps())["noise"]["within_noise"][0]["name"] == NOISY
    assert any(line.startswith("run-to-run noise: 1 of") for line in summary_lines(r))


def test_deterministic_bug_still_named_with_noise():
    r = bisect("examples/tiny_transformer.py:build_with_bug", target="cpu/bf16", direction="forward", noise=True)
    assert r.verdict == "kernel"
    assert (r.culprit["scope"], r.culprit["name"]) == ("blocks.0.norm1", "pdexample.fused_rms_norm.default")
    assert r.noise["nondeterministic_ops"] == 0 and r.noise["within_noise"] == []
    plain = bisect("examples/tiny_transformer.py:build_with_bug", target="cpu/bf16", direction="forward")
    assert r.cost["dut_runs"] == plain.cost["dut_runs"] + 1
    assert r.cost["forward_equivalents"] > plain.cost["forward_equivalents"]


def test_cli_noise_flag():
    from precisiondiff.cli import cli
    res = CliRunner().invoke(cli, ["bisect", "tests/bisect/planted.py:noisy_workload", "--target", "cpu/bf16",
                                    "--noise", "--format", "json"])
    assert res.exit_code in (0, 1), res.output
    out = json.loads(res.output)
    assert out["culprit"] is None and out["noise"]["within_noise"][0]["name"] == NOISY
