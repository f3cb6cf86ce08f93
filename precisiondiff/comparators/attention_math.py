"""The math attention and its gradient, every step in the dtype of the inputs: PyTorch's reference semantics of
``scaled_dot_product_attention``, for the fused kernels that ``torch._decomp`` has no entry for (the CPU flash
backward's peer, the GPU and MLU kernels' references in bisect/attention_references.py).

``softmax(q k^T * scale + mask) v``, scale ``1/sqrt(E)`` by default; ``is_causal`` masks with the top-left aligned
lower triangle (``torch.ones(L, S).tril()``, as PyTorch documents it and its CPU flash kernel computes it);
grouped-query attention (fewer key/value heads) repeats each key/value head over its group; a boolean mask keeps
where True, a floating one is added.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["attention_forward", "attention_backward"]


def _scores(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
            scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor, float, int]:
    """Masked, scaled scores; the keys repeated over the query groups; the scale; the group size."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[-3] // key.shape[-3]
    k = key.repeat_interleave(groups, dim=-3) if groups > 1 else key
    s = (query @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return s, k, scale, groups


def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      is_causal: bool = False, scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output and the logsumexp of the scores (float32 or wider, as fused kernels keep it)."""
    s, _, _, groups = _scores(query, key, mask, is_causal, scale)
    v = value.repeat_interleave(groups, dim=-3) if groups > 1 else value
    out = torch.softmax(s, -1) @ v
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, torch.logsumexp(s, -1).to(wide)


def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                       scale: Optional[float] = None) -> Tuple[torch.Tensor, ...]:
    """``(grad_query, grad_key, grad_value, grad_scores)``, written out (autograd does not run below the
    dispatcher). ``rowsum(dO * O)`` uses the ``out`` the kernel was given, as fused backward kernels do."""
    s, k, scale, groups = _scores(query, key, mask, is_causal, scale)
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
