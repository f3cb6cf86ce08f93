"""Reference semantics of the fused attention kernels of GPUs and MLUs, for bisect's replays.

``F.scaled_dot_product_attention`` on CUDA (and on ``torch_mlu``, which registers the same aten
ops) runs ``aten._scaled_dot_product_flash_attention`` or ``aten._scaled_dot_product_efficient_attention``
and their backward ops: none has a CPU or float64 kernel, so without a reference the op cannot be
replayed on ``cpu/float64`` and bisect can judge only the module around it (docs/bisect.md, "Ops that
cannot be replayed"). Each function here is the math attention with the op's own signature and
outputs, every step in the dtype of its inputs: in float64 it is the golden; in the DUT dtype it is
the op's decomposition peer (PyTorch's math attention, with its intermediate roundings), as
``torch._decomp`` gives the CPU flash kernel one.

The semantics are :mod:`precisiondiff.comparators.attention_math`'s. The logsumexp output is float32 or
wider, as the kernels keep it; the memory-efficient kernel pads it to a multiple of 32 rows with +inf (its
``kAlignLSE``; the padding saves the backward bound checks). Random seeds and offsets are returned as
zeros (integers: not judged). Dropout inside a fused kernel draws from its own generator and cannot be
replayed: such a call stays unreplayable.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..comparators.attention_math import attention_backward, attention_forward

__all__ = ["ATTENTION_REFERENCES", "efficient_attention_reference", "efficient_attention_backward_reference",
           "flash_attention_reference", "flash_attention_backward_reference"]

_LSE_ALIGN = 32  # rows of the memory-efficient kernel's logsumexp (kAlignLSE)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("dropout inside a fused attention kernel draws from the kernel's own generator")


def _zeros_int(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def efficient_attention_reference(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                  is_causal=False, *, scale=None):
    """``aten._scaled_dot_product_efficient_attention``: (output, logsumexp, philox_seed, philox_offset)."""
    _no_dropout(dropout_p)
    out, lse = attention_forward(query, key, value, attn_bias, is_causal, scale)
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
    dq, dk, dv, ds = attention_backward(grad_out, query, key, value, out, attn_bias, is_causal, scale)
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
    out, lse = attention_forward(query, key, value, None, is_causal, scale)
    device = query.device
    return (out, lse, None, None, query.shape[-2], key.shape[-2], torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.int64, device=device), query.new_empty(0))


def flash_attention_backward_reference(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                       max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten._scaled_dot_product_flash_attention_backward``: (grad_query, grad_key, grad_value)."""
    _no_dropout(dropout_p)
    dq, dk, dv, _ = attention_backward(grad_out, query, key, value, out, None, is_causal, scale)
    return dq, dk, dv


#: op name -> reference; each is the op's math semantics (its decomposition peer runs it in the DUT dtype)
ATTENTION_REFERENCES = {
    "aten._scaled_dot_product_efficient_attention.default": efficient_attention_reference,
    "aten._scaled_dot_product_efficient_attention_backward.default": efficient_attention_backward_reference,
    "aten._scaled_dot_product_flash_attention.default": flash_attention_reference,
    "aten._scaled_dot_product_flash_attention_backward.default": flash_attention_backward_reference,
}
