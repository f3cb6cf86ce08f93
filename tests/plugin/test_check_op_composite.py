"""check_op of a function of several ops: each op judged as bisect judges it, then the whole;
sparse outputs compared densified."""
from __future__ import annotations

import torch

from precisiondiff.testing.parity import check_op


@torch.library.custom_op("pdcomposite::exp", mutates_args=())
def planted_exp(x: torch.Tensor) -> torch.Tensor:
    """exp whose bf16 path is 3 % high (a wrong kernel); correct in other dtypes."""
    if x.dtype == torch.bfloat16:
        return (torch.exp(x.float()) * (1 + 2 ** -5)).to(x.dtype)
    return torch.exp(x)


@planted_exp.register_fake
def _(x):
    return torch.empty_like(x)


def _cancel(x, y):
    """(x + y) - y: every op correctly rounded in bf16, the whole far from float32 rounded once."""
    return (x + y) - y


def _with_planted(x, y):
    return torch.tanh(planted_exp(x) * y).sum(-1)


def test_a_function_of_correct_ops_passes_as_their_rounding_explains_it():
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randn(64, 64) * 300
    r = check_op(_cancel, x, y, target="cpu/bf16")
    assert r.passed, r.checks[0].message
    c = r.checks[0]
    assert c.bound["rule"] == "composite" and c.bound["composite"]["ops"] >= 2
    assert c.metrics["rel_l2"] > 0.01  # the whole is far from its inputs' x: only the ops' rounding explains it


def test_a_function_with_one_wrong_kernel_names_it():
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    r = check_op(_with_planted, x, y, target="cpu/bf16")
    assert not r.passed
    c = r.checks[0]
    assert c.bound["culprit"]["name"] == "pdcomposite.exp.default"
    assert "runs op pdcomposite.exp.default" in c.message


def test_sparse_outputs_are_compared_densified():
    x = torch.randn(8, 8)
    x[x < 0.5] = 0
    r = check_op(lambda t: (t * 2).to_sparse(), x, target="cpu/bf16")
    assert r.passed and r.checks[0].metrics["numel"] == 64
