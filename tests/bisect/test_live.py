"""Live bisect on planted-bug models: the exact culprit, or the verdict."""
from __future__ import annotations

import json as json_module

import pytest

from precisiondiff.bisect import BisectResult, bisect, register_reference
from precisiondiff.bisect.references import unregister_reference

from . import planted

EXAMPLE = "examples/tiny_transformer.py"
PLANTED = "tests/bisect/planted.py"


def _culprit(r: BisectResult) -> tuple:
    c = r.culprit
    return (c["kind"], c["scope"], c["name"], c["direction"]) if c else None


def test_fused_rms_norm_bf16_accumulation_is_named():
    r = bisect(f"{EXAMPLE}:build_with_bug", target="cpu/bf16", confirm=True)
    assert r.verdict == "kernel"
    assert _culprit(r) == ("op", "blocks.0.norm1", "pdexample.fused_rms_norm.default", "forward")
    assert [p["scope"] for p in r.path] == ["", "blocks.0", "blocks.0.norm1"]
    assert r.evidence["upstream_passed"] == r.evidence["upstream_units"]
    assert r.evidence["inputs_fine"] is True and r.evidence["inputs"][0]["rel_l2"] < r.parity_bound
    assert r.confirmation["final_error_after_substitution"] < r.confirmation["final_error_before"]
    json = r.to_json()
    assert list(json)[:8] == ["verdict", "dut", "ref", "culprit", "path", "confirmation", "cost", "candidates"]
    assert set(json["cost"]) >= {"dut_runs", "ref_runs", "forward_equivalents"}


def test_unconfirmed_kernel_verdict_costs_one_captured_step_and_the_replays():
    r = bisect(f"{EXAMPLE}:build_with_bug", target="cpu/bf16")
    assert _culprit(r) == ("op", "blocks.0.norm1", "pdexample.fused_rms_norm.default", "forward")
    c = r.cost
    assert (c["dut_runs"], c["ref_runs"]) == (1, 0)  # the verdict needs no reference run
    assert r.final_error is None and r.confirmation["final_error_after_substitution"] is None
    assert any(n.startswith("not confirmed") for n in r.notes)
    assert set(c["breakdown"]) <= {"dut_capture", "op_golden", "op_magnitude", "op_peers", "module_golden",
                                   "module_emulated", "module_semantic"}
    assert c["breakdown"]["dut_capture"] == 3.0  # a forward + backward step
    assert sum(c["breakdown"].values()) == pytest.approx(c["forward_equivalents"], abs=0.02)
    assert c["steps"] == pytest.approx(c["forward_equivalents"] / 3, abs=0.01)
    assert c["steps"] < 2.5  # was 6.1 (timing forward, reference run, substitution, magnitudes)


def test_parity_verdict_runs_the_reference_for_its_final_error():
    r = bisect(planted.mlp_workload, target="cpu/bf16", time_step=True)
    assert r.verdict == "parity" and 0 < r.final_error <= r.parity_bound
    assert (r.cost["dut_runs"], r.cost["ref_runs"]) == (1, 1) and r.cost["breakdown"]["reference"] == 3.0
    # timing the step is asked for: a warm-up and a timed forward, both counted
    assert r.cost["breakdown"]["timing"] == 2.0 and r.cost["plain_forward_s"] > 0


def test_fused_softmax_bf16_accumulation_is_named():
    r = bisect(planted.softmax_workload, target="cpu/bf16")
    assert _culprit(r) == ("op", "1", "pdtest.fused_softmax.default", "forward")


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_autograd_function_wrong_backward_blames_its_module():
    r = bisect(planted.bad_backward_workload, target="cpu/bf16", confirm=True)
    assert r.verdict == "kernel"
    assert _culprit(r) == ("module", "scale", "Scale", "backward")
    assert r.confirmation["final_error_after_substitution"] < 0.1 * r.confirmation["final_error_before"]


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_direction_forward_skips_the_backward_culprit():
    r = bisect(planted.bad_backward_workload, target="cpu/bf16", direction="forward")
    assert r.verdict != "kernel"


def test_early_error_amplified_later_names_the_early_op():
    r = bisect(planted.amplify_workload, target="cpu/bf16")
    assert _culprit(r) == ("op", "", "pdtest.sloppy_scale.default", "forward")


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("factory", [planted.mlp_workload, planted.ill_conditioned_workload])
def test_plain_pytorch_controls_are_never_kernel(factory):
    r = bisect(factory, target="cpu/bf16")
    assert r.verdict in ("parity", "accumulated"), r.culprit
    assert r.exit_code == (0 if r.verdict == "parity" else 1)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_ill_conditioned_control_is_accumulated():
    r = bisect(planted.ill_conditioned_workload, target="cpu/bf16")
    assert r.verdict == "accumulated"
    assert r.growth and r.final_error > r.parity_bound
    # the forward's error already exceeds the bound: the reference's backward is not run
    assert r.cost["breakdown"]["reference"] == 1.0 and r.cost["ref_runs"] == 1
    assert "param_grads" not in r.confirmation["detail_before"]
    assert any(n.startswith("the reference ran forward only") for n in r.notes)


def test_clean_example_is_at_parity_forward_and_backward():
    """The clean example runs only stock kernels: nothing is blamed (its embedding backward sums
    at most 3 rows per token, within the peer rule; docs/bisect.md)."""
    r = bisect(f"{EXAMPLE}:build", target="cpu/bf16")
    assert r.verdict == "parity" and r.culprit is None, r.culprit
    assert r.final_error <= r.parity_bound
    forward = bisect(f"{EXAMPLE}:build", target="cpu/bf16", direction="forward")
    assert forward.verdict == "parity" and forward.culprit is None


def test_op_without_float64_kernel_is_localized_to_its_module():
    r = bisect(planted.vendor_workload, target="cpu/bf16")
    assert r.verdict == "kernel"
    assert _culprit(r) == ("module", "1", "VendorNorm", "forward")
    assert [h["name"] for h in r.culprit["unreplayable_ops"]] == ["pdtest.vendor_rms_norm.default"]
    assert any("pdtest.vendor_rms_norm.default could not be replayed" in n for n in r.notes)
    assert "pdtest.vendor_rms_norm.default" in r.unreplayable


@pytest.fixture
def vendor_reference():
    register_reference("pdtest::vendor_rms_norm", planted.vendor_reference)
    yield
    unregister_reference("pdtest::vendor_rms_norm")


def test_registered_reference_names_the_op_itself(vendor_reference):
    r = bisect(planted.vendor_workload, target="cpu/bf16")
    assert r.verdict == "kernel"
    assert _culprit(r) == ("op", "1", "pdtest.vendor_rms_norm.default", "forward")
    assert r.unreplayable == []


def test_budget_override_judges_with_the_given_budget():
    r = bisect(planted.softmax_workload, target="cpu/bf16",
               budgets=["pdtest.fused_softmax:max_ulp=1e6", "pdtest.fused_softmax:rounding_ulps=1e6"])
    assert _culprit(r) != ("op", "1", "pdtest.fused_softmax.default", "forward")


def test_bad_budget_override_is_a_bisect_error():
    from precisiondiff.errors import BisectError
    with pytest.raises(BisectError, match="budget override .max_ulps=4.: unknown field"):
        bisect(planted.softmax_workload, target="cpu/bf16", budgets=["max_ulps=4"])


def test_cli_confirm_runs_the_reference_and_the_substitution(tmp_path):
    from click.testing import CliRunner
    from precisiondiff.cli import cli
    res = CliRunner().invoke(cli, ["bisect", f"{PLANTED}:softmax_workload", "--target", "cpu/bf16", "--confirm",
                                   "--format", "json"])
    out = json_module.loads(res.stdout)
    assert res.exit_code == 1 and out["culprit"]["name"] == "pdtest.fused_softmax.default"
    assert (out["cost"]["dut_runs"], out["cost"]["ref_runs"]) == (2, 1)
    assert out["confirmation"]["final_error_after_substitution"] < out["confirmation"]["final_error_before"]
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "meta.json").write_text("{}")
    res = CliRunner().invoke(cli, ["bisect", str(dump), "--confirm"])
    assert res.exit_code == 2 and "--confirm applies to live bisect" in res.stderr
