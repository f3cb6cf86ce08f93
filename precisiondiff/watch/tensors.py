"""What the watch measures a tensor with, shared by the monitor and its ZeRO path (zero.py): the
model inside framework wrappers, and L2 norms batched per device and dtype."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["unwrapped"]

# framework wrappers that keep the model as .module (DDP, DeepSpeed, Megatron) or ._orig_mod
# (torch.compile): watch sees through them, so a wrapped job's log has the bare model's paths
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "Float16Module", "DeepSpeedEngine", "OptimizedModule")


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside framework wrappers (``_WRAPPERS``), or ``module`` itself."""
    while type(module).__name__ in _WRAPPERS:
        inner = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" \
            else getattr(module, "module", None)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    return module


def _norms(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """L2 norms of ``tensors`` as 0-d tensors on their devices: one ``_foreach_norm`` per (device,
    dtype), accumulated in float64 for float64 tensors and float32 otherwise."""
    # a DTensor (an FSDP2 or TP parameter, its gradient and state) is measured on its local shard
    tensors = [getattr(t, "_local_tensor", t) for t in tensors]
    out: List[Optional[torch.Tensor]] = [None] * len(tensors)
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), index in groups.items():
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        group = [tensors[i].detach() for i in index]
        if dtype.is_floating_point:
            norms = torch._foreach_norm(group, 2, dtype=acc)
        else:
            norms = [torch.linalg.vector_norm(t.to(acc)) for t in group]
        for i, n in zip(index, norms):
            out[i] = n
    return out  # type: ignore[return-value]
