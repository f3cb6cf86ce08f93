"""The pytest plugin with ``--parity-target mlu/bf16``: the tests run on the device, not skipped."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "tiny_transformer.py")

BODY = f"""
import torch
EXAMPLE = {EXAMPLE!r}

def test_model(parity):
    r = parity.check(EXAMPLE + ":build", kernels=True, direction="forward")
    assert r.passed

def test_op(parity):
    parity.check_op(torch.ops.aten.gelu.default, torch.randn(64), max_ulp=1)
"""


def test_parity_tests_run_on_the_device(pytester, standin):
    pytester.makepyfile(test_it=BODY)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", "--parity-target", "mlu/bf16")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["precisiondiff: parity target mlu/bf16, ref cpu/float64*",
                                 "*test_model?mlu/bf16? PASSED*", "*test_op?mlu/bf16? PASSED*"])


def test_a_planted_device_kernel_fails_the_parity_test_and_is_named(pytester, standin):
    standin.plant(gemm_chunk=1)
    pytester.makepyfile(test_it=BODY)
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-target", "mlu/bf16+autocast", "-k", "test_model")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*parity FAILED: *tiny_transformer.py:build on mlu/bf16+autocast vs cpu/float64",
                                 "culprit (kernel): op aten.*mm.default in scope *"])
