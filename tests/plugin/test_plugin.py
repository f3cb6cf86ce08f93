"""The pytest plugin, driven through pytester: fixture, marker, options, skips, dumps, reports."""
from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_transformer.py")

HEADER = f"""
import pytest, torch
EXAMPLE = {EXAMPLE!r}
"""


def run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_it=HEADER + body)
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def test_passing_model_and_op_checks_show_the_target_in_the_id(pytester):
    result = run(pytester, """
def test_model(parity):
    r = parity.check(EXAMPLE + ":build")
    assert r.passed and r["output"].metrics["rel_l2"] < 0.031

def test_op(parity):
    r = parity.check_op(torch.ops.aten.gelu.default, torch.randn(64), max_ulp=1)
    assert r.checks[0].bound["max_ulp"] == 1.0
""", "-v", "--parity-target", "cpu/bf16")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["precisiondiff: parity target cpu/bf16, ref cpu/float64, bisect on",
                                 "*test_model?cpu/bf16? PASSED*", "*test_op?cpu/bf16? PASSED*"])


def test_several_targets_make_several_tests(pytester):
    result = run(pytester, """
def test_op(parity):
    parity.check_op(torch.exp, torch.randn(16))
""", "-v", "--parity-target", "cpu/bf16,cpu/fp16")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_op?cpu/bf16? PASSED*", "*test_op?cpu/fp16? PASSED*"])


def test_parity_kernels_switches_a_suite_to_kernel_checks_with_a_compact_report(pytester):
    body = """
def test_buggy(parity):
    parity.check(EXAMPLE + ":build_with_bug", direction="forward")
"""
    # end to end, the planted bf16 accumulator hides inside the output's bound ...
    run(pytester, body, "--parity-target", "cpu/bf16", "--no-parity-bisect").assert_outcomes(passed=1)
    # ... and the kernel CI's switch names it, without editing the test
    result = run(pytester, body, "--parity-target", "cpu/bf16", "--parity-kernels")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "precisiondiff: parity target cpu/bf16, ref cpu/float64, bisect on, kernels on",
        "*parity FAILED: *tiny_transformer.py:build_with_bug on cpu/bf16 vs cpu/float64",
        "*kernels (forward)*FAIL",
        "first divergence: kernels (forward)",
        "culprit (kernel): op pdexample.fused_rms_norm.default in scope 'blocks.0.norm1' (forward)",
        "pdexample.fused_rms_norm.default output.0: worst element * exceeds * the emulated peers' *",
        "output.0: * of 2048 elements (*%) exceed *",
        "Worst at index (*): actual *, golden *: abs err *, rel err *, * ULP; bound *",
        "Hint: `precisiondiff bisect *tiny_transformer.py:build_with_bug --target cpu/bf16 --ref cpu/float64 "
        "--direction forward --format json` shows *",
    ])
    report = out[out.index("parity FAILED"):out.index("short test summary")]
    assert report.count("Hint:") == 1 and "local error:" not in report
    assert "Traceback" not in out and "def check(" not in out  # a report, not a traceback wall


def test_end_to_end_failure_runs_bisect_or_not(pytester):
    body = """
def test_tight(parity):
    parity.check(EXAMPLE + ":build_with_bug", rel_l2=1e-4)
"""
    result = run(pytester, body, "--parity-target", "cpu/bf16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["first divergence: output",
                                 "culprit (kernel): op pdexample.fused_rms_norm.default in scope 'blocks.0.norm1'*",
                                 "output: * of 4096 elements (*%) are more than 1 ULP of bf16 off; relative L2 error * exceeds rel_l2 0.0001.",
                                 "Worst at index (*): actual *, golden *: abs err *, rel err *, * ULP.",
                                 "Hint: *"])
    result = run(pytester, body, "--parity-target", "cpu/bf16", "--no-parity-bisect")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["culprit: not searched (bisect disabled (--no-parity-bisect))"])


def test_op_failure_reports_the_worst_element(pytester):
    result = run(pytester, """
def bad_exp(x):
    y = torch.exp(x)
    return y * (1 + 2 ** -6) if x.dtype == torch.bfloat16 else y  # 2 ULP off, in bf16 only

def test_op(parity):
    parity.check_op(bad_exp, torch.linspace(-2, 2, 32), max_ulp=1)
""", "--parity-target", "cpu/bf16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["parity FAILED: *bad_exp on cpu/bf16 vs cpu/float64",
                                 "*output*max_ulp<=1*FAIL",
                                 "first divergence: output",
                                 "output: * of 32 elements (*%) exceed the bfloat16 unknown budget.",
                                 "Worst at index (*,): actual *, golden *: abs err *, rel err *, * ULP; bound * (1 ULP of bfloat16).",
                                 "Hint: *"])


def test_marker_sets_defaults_and_closest_wins(pytester):
    result = run(pytester, """
pytestmark = pytest.mark.parity(target="cpu/fp16", max_ulp=0)

@pytest.mark.parity(max_ulp=3)
def test_function_marker(parity):
    r = parity.check_op(torch.exp, torch.randn(8))
    assert r.target == "cpu/fp16" and r.checks[0].bound["max_ulp"] == 3.0

def test_module_marker(parity):
    r = parity.check_op(torch.exp, torch.randn(8), expect=False)
    assert r.checks[0].bound["max_ulp"] == 0.0
""", "-v", "--parity-target", "cpu/bf16")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_function_marker?cpu/fp16? PASSED*"])


def test_unknown_marker_keyword_is_a_usage_error(pytester):
    result = run(pytester, """
@pytest.mark.parity(max_ulps=1)
def test_typo(parity):
    pass
""")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown @pytest.mark.parity argument(s) max_ulps; use target, ref,*"])


def test_bad_target_is_a_usage_error(pytester):
    result = run(pytester, "def test_x(parity):\n    pass\n", "--parity-target", "cpu/int8")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-target: unknown dtype 'int8'*"])


def test_marker_is_registered_for_strict_markers(pytester):
    result = run(pytester, """
@pytest.mark.parity(target="cpu/bf16")
def test_x():
    pass
""", "--strict-markers")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.parity(target=None, ref=None, *"])


@pytest.mark.parametrize("target", ["cuda:7/bf16", "mlu/bf16"])
def test_unavailable_device_skips_with_a_reason(pytester, target):
    result = run(pytester, """
def test_x(parity):
    raise AssertionError("must not run")
""", "-rs", "--parity-target", target)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED * parity target {target} is not available: *"])


def test_a_target_given_in_the_call_skips_too_when_its_device_is_absent(pytester):
    result = run(pytester, """
def test_model(parity):
    parity.check(EXAMPLE + ":build", target="mlu/bf16")
    raise AssertionError("must not run")

def test_op(parity):
    parity.check_op(torch.exp, torch.randn(4), target="cuda:7/bf16")
    raise AssertionError("must not run")

def test_ref(parity):
    parity.check_op(torch.exp, torch.randn(4), ref="mlu/float32")
    raise AssertionError("must not run")
""", "-rs", "--parity-target", "cpu/bf16")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["SKIPPED * parity target mlu/bf16 is not available: *",
                                 "SKIPPED * parity target cuda:7/bf16 is not available: *",
                                 "SKIPPED * parity target mlu/fp32 is not available: *"],
                                consecutive=False)


def test_dumps_of_failing_tests_are_kept(pytester):
    dump_dir = pytester.path / "dumps"
    result = run(pytester, """
def test_ok(parity):
    parity.check_op(torch.exp, torch.randn(4))

def test_tight(parity):
    parity.check(EXAMPLE + ":build_with_bug", rel_l2=1e-4)
""", "--parity-target", "cpu/bf16", "--no-parity-bisect", "--parity-dump-dir", str(dump_dir))
    result.assert_outcomes(passed=1, failed=1)
    kept = sorted(p.relative_to(dump_dir).as_posix() for p in dump_dir.glob("*/*/*/meta.json"))
    assert kept == ["test_it.py_test_tight_cpu_bf16/0/dut/meta.json",
                    "test_it.py_test_tight_cpu_bf16/0/ref/meta.json"]
    result.stdout.fnmatch_lines(["dumps kept: precisiondiff report */dut */ref -o report.html"])


def test_check_without_raising_returns_the_result(pytester):
    result = run(pytester, """
def test_x(parity):
    r = parity.check(EXAMPLE + ":build_with_bug", rel_l2=1e-4, expect=False, bisect=False)
    assert not r and r.failures[0].key == "output"
    assert r.to_json()["passed"] is False
""", "--parity-target", "cpu/bf16")
    result.assert_outcomes(passed=1)
