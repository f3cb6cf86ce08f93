"""What the watch measures a tensor with, shared by the monitor and its ZeRO path (zero.py): the
model inside framework wrappers, and L2 norms batched per device and dtype."""
from __future__ import annotations

import ctypes
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _numba

__all__ = ["unwrapped", "snapshot", "update_norms"]

_log = logging.getLogger(__name__)
_kernels = _numba.Kernels(__name__.rpartition(".")[0] + "._norms_jit")
_ENTRIES = {torch.float32: "update_f32", torch.float64: "update_f64", torch.bfloat16: "update_bf16",
            torch.float16: "update_f16"}
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))

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


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t).detach()


def _flat_cpu(t: torch.Tensor) -> bool:
    """A plain contiguous CPU tensor whose memory holds its values (what a one-thread pass reads)."""
    return type(t) in _PLAIN and t.device.type == "cpu" and t.is_contiguous() and not t.is_neg() \
        and t.data_ptr() != 0


def snapshot(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Copies of ``tensors`` (their local shards) for the update ratio of :func:`update_norms`.

    A CPU tensor is copied by one ``memcpy`` on the calling thread: ``clone`` would run on every
    intra-op thread, each paying for a pass that memory bandwidth bounds (docs/performance.md,
    "Watch")."""
    out = []
    for t in tensors:
        t = _local(t)
        if _flat_cpu(t):
            copy = torch.empty_like(t, memory_format=torch.contiguous_format)
            ctypes.memmove(copy.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
            out.append(copy)
        else:
            out.append(t.clone())
    return out


def update_norms(after: Sequence[torch.Tensor], before: List[torch.Tensor]
                 ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(‖w‖, ‖w − w_before‖)`` per tensor as 0-d tensors: ``after`` the weights after the
    optimizer's step, ``before`` their :func:`snapshot` (consumed: it may be overwritten).

    CPU tensors of the four floating formats take one pass of a numba kernel (float64 sums of the
    exact values, on the calling thread); the others, or without numba, PyTorch's in-place
    subtraction and :func:`_norms`."""
    after = [_local(t) for t in after]
    weights: List[Optional[torch.Tensor]] = [None] * len(after)
    updates: List[Optional[torch.Tensor]] = [None] * len(after)
    kernels = _kernels() if any(t.device.type == "cpu" for t in after) else None
    fast, rest = [], []
    for i, (a, b) in enumerate(zip(after, before)):
        ok = kernels is not None and a.dtype in _ENTRIES and b.dtype == a.dtype and a.shape == b.shape \
            and a.numel() > 0 and _flat_cpu(a) and _flat_cpu(b)
        (fast if ok else rest).append(i)
    if fast:
        try:
            sums = [getattr(kernels, _ENTRIES[after[i].dtype])(after[i].data_ptr(), before[i].data_ptr(),
                                                               after[i].numel()) for i in fast]
        except Exception as err:  # noqa: BLE001 - a kernel that fails to compile or run: PyTorch's path
            _log.warning("the update-ratio kernel failed (%s): using PyTorch", err)
            _kernels.failed, _kernels._loaded = True, None
            rest, fast = sorted(rest + fast), []
        else:
            values = torch.tensor(sums, dtype=torch.float64).sqrt_()
            for i, row in zip(fast, values.unbind()):
                weights[i], updates[i] = row.unbind()
    if rest:
        tail_after = [after[i] for i in rest]
        tail_before = [before[i] for i in rest]
        torch._foreach_sub_(tail_before, tail_after)  # in place: no new memory
        for i, w, d in zip(rest, _norms(tail_after), _norms(tail_before)):
            weights[i], updates[i] = w, d
    return weights, updates  # type: ignore[return-value]
