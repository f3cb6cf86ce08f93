"""The fused attention kernels of GPUs and MLUs (no CPU or float64 kernel) are judged as ops.

Their references (bisect/attention_references.py) must have the ops' semantics: checked against
PyTorch's own CPU attention and autograd. End to end, this CPU stands in for the GPU: the test
registers CPU kernels under the CUDA ops' names that refuse float64, as the CUDA kernels do (one
correct, flash-style in bf16; one whose P @ V accumulates in bf16), and bisect must judge the op
itself: the correct one passes, the wrong one is named.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import precisiondiff
from precisiondiff.bisect.attention_references import (efficient_attention_backward_reference,
                                                       efficient_attention_reference,
                                                       flash_attention_backward_reference, flash_attention_reference)
from precisiondiff.bisect.references import math_semantics, reference_for
from precisiondiff.comparators.peers import _flash_attention_cpu_backward

EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]),
       q_len=st.integers(1, 9), kv_len=st.integers(1, 9), dim=st.sampled_from([4, 8]), causal=st.booleans(),
       bias=st.sampled_from([None, "float", "broadcast"]), seed=st.integers(0, 2**16))
def test_the_references_are_the_math_attention_and_its_gradient(batch, kv_heads, groups, q_len, kv_len, dim,
                                                                 causal, bias, seed):
    if causal:
        kv_len = max(kv_len, q_len)  # top-left causal with fewer keys than queries leaves rows with nothing to attend to
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q = torch.randn(batch, heads, q_len, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, kv_len, dim, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    mask = None
    if bias is not None and not causal:  # SDPA takes one or the other
        shape = (batch, heads, q_len, kv_len) if bias == "float" else (1, 1, q_len, kv_len)
        mask = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=groups > 1)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    plain = [t.detach() for t in (q, k, v)]
    got, lse, seed_t, offset_t = efficient_attention_reference(*plain, None if mask is None else mask.detach(), True,
                                                               0.0, causal)
    torch.testing.assert_close(got, out.detach(), rtol=1e-12, atol=1e-12)
    assert lse.shape[-1] % 32 == 0 and torch.isinf(lse[..., q_len:]).all() and not seed_t.is_floating_point()
    if mask is None:
        flash = flash_attention_reference(*plain, 0.0, causal)
        torch.testing.assert_close(flash[0], out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(flash[1], lse[..., :q_len])
        dq, dk, dv = flash_attention_backward_reference(grad, *plain, out.detach(), flash[1], None, None, q_len,
                                                        kv_len, 0.0, causal, None, None)
        db = None
    else:
        dq, dk, dv, db = efficient_attention_backward_reference(grad, *plain, mask.detach(), out.detach(), lse,
                                                                seed_t, offset_t, 0.0, [True] * 4, causal)
        torch.testing.assert_close(db, mask.grad, rtol=1e-10, atol=1e-12)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    # the CPU flash kernel's backward peer shares the math (it aligned a causal mask bottom-right before: wrong
    # whenever there were more keys than queries)
    cpu = _flash_attention_cpu_backward(grad, *plain, out.detach(), lse, 0.0, causal,
                                        attn_mask=None if mask is None else mask.detach())
    for mine, theirs in zip(cpu, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_logsumexp_matches_the_cpu_flash_kernel():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    mine = flash_attention_reference(q, k, v, 0.0, True)
    torch.testing.assert_close(mine[0], out)
    torch.testing.assert_close(mine[1], lse)


def test_dropout_inside_the_kernel_is_not_replayed():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attention_reference(q, q, q, 0.1)


# -- end to end: CPU kernels under the CUDA ops' names ---------------------------------------------

def _flash_style(query, key, value, attn_bias, accumulate_in_bf16):
    """A fused kernel's arithmetic in bf16: float32 scores and softmax, P rounded to bf16, P @ V
    accumulated in float32 (or, planted, in bf16: each partial sum rounded)."""
    s = (query.float() @ key.float().transpose(-2, -1)) / query.shape[-1] ** 0.5
    if attn_bias is not None:
        s = s + attn_bias.float()
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(query.dtype)
    if not accumulate_in_bf16:
        out = p.float() @ value.float()
    else:
        out = torch.zeros(*p.shape[:-1], value.shape[-1], dtype=query.dtype)
        for j in range(p.shape[-1]):
            out = (out.float() + p[..., j:j + 1].float() * value[..., j:j + 1, :].float()).to(query.dtype)
    return out.to(query.dtype), lse


@pytest.fixture(params=["correct", "bf16 accumulation"])
def cuda_attention_on_the_cpu(request):
    """CPU kernels for the CUDA efficient attention and its backward, refusing float64 like CUDA's."""
    wrong = request.param != "correct"
    lib = torch.library.Library("aten", "IMPL")

    def forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        if query.dtype == torch.float64:
            raise NotImplementedError("no float64 kernel")
        out, lse = _flash_style(query, key, value, attn_bias, wrong)
        rows = -(-lse.shape[-1] // 32) * 32
        padded = torch.full((*lse.shape[:-1], rows), float("inf"))
        padded[..., :lse.shape[-1]] = lse
        zero = torch.zeros((), dtype=torch.int64)
        return out, padded, zero, zero

    def backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                 grad_input_mask, is_causal=False, *, scale=None):
        if query.dtype == torch.float64:
            raise NotImplementedError("no float64 kernel")
        grads = efficient_attention_backward_reference(
            grad_out.float(), query.float(), key.float(), value.float(),
            None if attn_bias is None else attn_bias.float(), out.float(), logsumexp, philox_seed, philox_offset,
            dropout_p, grad_input_mask, is_causal, scale=scale)
        return tuple(None if t is None else t.to(query.dtype) for t in grads)

    lib.impl("_scaled_dot_product_efficient_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", backward, "CPU")
    yield request.param
    lib._destroy()


class _Attention(torch.nn.Module):
    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0]
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


def _workload():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Attention(), torch.nn.LayerNorm(64))
    return precisiondiff.Workload(model, torch.randn(2, 256, 64), loss=lambda y: y.float().pow(2).mean())


def test_a_fused_attention_without_a_float64_kernel_is_judged_as_an_op(cuda_attention_on_the_cpu, monkeypatch):
    """Judged as an op, with the math attention in bf16 as its decomposition peer (without that peer the
    correct kernel, whose P is rounded to bf16, is blamed: checked by hand). Without the reference the op
    is unreplayable and only its module can be judged; by the stand-in rule the correct kernel was then
    blamed as `_Attention` (408 of 32768 elements over; checked by hand), as BERT's and ViT's attention
    modules were on an H200 (docs/bisect.md, "On a GPU")."""
    assert reference_for(EFFICIENT) is efficient_attention_reference and math_semantics(EFFICIENT)
    found = precisiondiff.bisect(_workload, target="cpu/bf16")
    assert EFFICIENT not in found.unreplayable
    if cuda_attention_on_the_cpu == "correct":
        assert found.verdict != "kernel", found.culprit
        from precisiondiff.bisect import references
        monkeypatch.delitem(references.BUILTIN_REFERENCES, EFFICIENT)
        assert EFFICIENT in precisiondiff.bisect(_workload, target="cpu/bf16", direction="forward").unreplayable
    else:
        assert found.verdict == "kernel"
        assert (found.culprit["kind"], found.culprit["name"]) == ("op", EFFICIENT), found.culprit
