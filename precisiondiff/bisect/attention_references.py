"""Reference semantics of the fused attention kernels of GPUs and MLUs, for bisect's replays.

``F.scaled_dot_product_attention`` on CUDA (and on ``torch_mlu``, which registers the same aten
ops) runs ``aten._scaled_dot_product_flash_attention`` or ``aten._scaled_dot_product_efficient_attention``
and their backward ops: none has a CPU or float64 kernel, so without a reference the op cannot be
replayed on ``cpu/float64`` and bisect can judge only the module around it (docs/bisect.md, "Ops that
cannot be replayed"). Each function here is the math attention with the op's own signature and
outputs, every step in the dtype of its inputs: in float64 it is the golden; in the DUT dtype it is
the op's decomposition peer (PyTorch's math attention, with its intermediate roundings), as
``torch._decomp`` gives the CPU flash kernel one.

Semantics (PyTorch's ``scaled_dot_product_attention``): ``softmax(q k^T * scale + bias) v``, scale
``1/sqrt(E)`` by default; ``is_causal`` masks with the top-left aligned lower triangle; grouped-query
attention (fewer key/value heads) repeats each key/value head over its group. The logsumexp output is
float32 or wider, as the kernels keep it; the memory-efficient kernel pads it to a multiple of 32 rows
with +inf (its ``kAlignLSE``; the padding saves the backward bound checks). Random seeds and offsets are returned as zeros (integers: not judged). Dropout inside a
fused kernel draws from its own generator and cannot be replayed: such a call stays unreplayable.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["ATTENTION_REFERENCES", "efficient_attention_reference", "efficient_attention_backward_reference",
           "flash_attention_reference", "flash_attention_backward_reference"]

_LSE_ALIGN = 32  # rows of the memory-efficient kernel's logsumexp (kAlignLSE)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("dropout inside a fused attention kernel draws from the kernel's own generator")


def _scores(query: torch.Tensor, key: torch.Tensor, attn_bias: Optional[torch.Tensor], is_causal: bool,
            scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor, float, int]:
    """Masked, scaled scores; the keys repeated over the query groups; the scale; the group size."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[-3] // key.shape[-3]
    k = key.repeat_interleave(groups, dim=-3) if groups > 1 else key
    s = (query @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_bias is not None:
        s = s.masked_fill(~attn_bias, float("-inf")) if attn_bias.dtype == torch.bool else s + attn_bias.to(s.dtype)
    return s, k, scale, groups


def _forward(query, key, value, attn_bias, is_causal, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    s, _, _, groups = _scores(query, key, attn_bias, is_causal, scale)
    v = value.repeat_interleave(groups, dim=-3) if groups > 1 else value
    out = torch.softmax(s, -1) @ v
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, torch.logsumexp(s, -1).to(wide)


def _backward(grad_out, query, key, value, out, attn_bias, is_causal, scale):
    """Gradients of the math attention (written out: autograd does not run below the dispatcher).
    D = rowsum(dO * O) uses the ``out`` the kernel was given, as the fused backward kernels do."""
    s, k, scale, groups = _scores(query, key, attn_bias, is_causal, scale)
    v = value.repeat_interleave(groups, dim=-3) if groups > 1 else value
    p = torch.softmax(s, -1)
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ v.transpose(-2, -1) - (grad_out * out.to(grad_out.dtype)).sum(-1, keepdim=True))
    dq = (ds @ k) * scale
    dk = (ds.transpose(-2, -1) @ query) * scale
    if groups > 1:
        dk = dk.unflatten(-3, (key.shape[-3], groups)).sum(-3)
        dv = dv.unflatten(-3, (key.shape[-3], groups)).sum(-3)
    return dq, dk, dv, ds


def _zeros_int(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def efficient_attention_reference(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                  is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention``: (output, logsumexp, philox_seed, philox_offset)."""
    _no_dropout(dropout_p)
    out, lse = _forward(query, key, value, attn_bias, is_causal, scale)
    rows = -(-lse.shape[-1] // _LSE_ALIGN) * _LSE_ALIGN if compute_log_sumexp else 0
    padded = lse.new_full((*lse.shape[:-1], rows), float("inf"))
    if rows:
        padded[..., :lse.shape[-1]] = lse
    return out, padded, _zeros_int(query.device), _zeros_int(query.device)


def efficient_attention_backward_reference(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed,
                                           philox_offset, dropout_p, grad_input_mask: Sequence[bool],
                                           is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention_backward``: (grad_query, grad_key, grad_value,
    grad_bias); a gradient not asked for in ``grad_input_mask`` is None (an undefined tensor)."""
    _no_dropout(dropout_p)
    dq, dk, dv, ds = _backward(grad_out, query, key, value, out, attn_bias, is_causal, scale)
    dbias = None
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        dbias = ds.sum_to_size(attn_bias.shape).to(attn_bias.dtype) if attn_bias.is_floating_point() else None
    grads = [g if want else None for g, want in zip((dq, dk, dv), grad_input_mask)]
    return (*grads, dbias)


def flash_attention_reference(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                              scale=None):
    """``aten._scaled_dot_product_flash_attention``: (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    rng_state, unused, debug_attn_mask); the sequence offsets are undefined for a padded batch."""
    _no_dropout(dropout_p)
    out, lse = _forward(query, key, value, None, is_causal, scale)
    device = query.device
    return (out, lse, None, None, query.shape[-2], key.shape[-2], torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device), query.new_empty(0))


def flash_attention_backward_reference(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                       max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten._scaled_dot_product_flash_attention_backward``: (grad_query, grad_key, grad_value)."""
    _no_dropout(dropout_p)
    dq, dk, dv, _ = _backward(grad_out, query, key, value, out, None, is_causal, scale)
    return dq, dk, dv


#: op name -> reference; each is the op's math semantics (its decomposition peer runs it in the DUT dtype)
ATTENTION_REFERENCES = {
    "aten._scaled_dot_product_efficient_attention.default": efficient_attention_reference,
    "aten._scaled_dot_product_efficient_attention_backward.default": efficient_attention_backward_reference,
    "aten._scaled_dot_product_flash_attention.default": flash_attention_reference,
    "aten._scaled_dot_product_flash_attention_backward.default": flash_attention_backward_reference,
}
