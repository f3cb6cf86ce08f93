"""What the watch measures a tensor with, shared by the monitor and its ZeRO path (zero.py): the
model inside framework wrappers, and L2 norms batched per device and dtype."""
from __future__ import annotations

import ctypes
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _numba

__all__ = ["unwrapped", "snapshot", "update_norms", "SnapshotMemory"]

_log = logging.getLogger(__name__)
_kernels = _numba.Kernels(__name__.rpartition(".")[0] + "._norms_jit")
_ENTRIES = {torch.float32: "update_f32", torch.float64: "update_f64", torch.bfloat16: "update_bf16",
            torch.float16: "update_f16"}
_PARTS = {dtype: "parts" + name[len("update"):] for dtype, name in _ENTRIES.items()}
# from this many elements a weight's sums (and from this many bytes its snapshot) go in parts on
# numba's threads, when it has thread-safe ones (_numba.threads)
_PARTS_FROM = 4 << 16
_COPY_PARTS_FROM = 4 << 20
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


class SnapshotMemory:
    """One CPU buffer that :func:`snapshot` copies the weights into, kept from one full step to
    the next while the watch is open.

    Fresh memory for every snapshot costs a page fault per 4 KiB (0.13 s of a 4.6 s step for the
    97.6M-parameter watch benchmark), and, taken from the C library's heap, it fills the free room
    that the optimizer's temporaries would have reused, so AdamW's own step ran 0.09 s slower on
    every full step (docs/performance.md, "Watch"). One buffer allocated once (one large block,
    which the C library maps apart from its heap) avoids both; it holds one copy of the CPU
    weights' memory until :meth:`release`."""

    def __init__(self) -> None:
        self._flat: Optional[torch.Tensor] = None

    def views(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Contiguous views of the buffer shaped as ``tensors`` (one each, 64-byte aligned),
        growing the buffer when they do not fit."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        total = sum(sizes)
        if self._flat is None or self._flat.numel() < total:
            self._flat = None  # the old one first: never two copies at once
            self._flat = torch.empty(max(total, 1), dtype=torch.uint8)
        out, offset = [], 0
        for t, size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            out.append(self._flat[offset:offset + nbytes].view(t.dtype).view(t.shape))
            offset += size
        return out

    def release(self) -> None:
        """Give the buffer back (the watch closes)."""
        self._flat = None


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def snapshot(tensors: Sequence[torch.Tensor], memory: Optional[SnapshotMemory] = None) -> List[torch.Tensor]:
    """Copies of ``tensors`` (their local shards) for the update ratio of :func:`update_norms`;
    with ``memory``, the plain CPU ones are copied into its kept buffer (the others are cloned).

    A CPU tensor is copied by ``memcpy`` on the calling thread (a large one in parts on numba's
    threads, when it has thread-safe ones): ``clone`` would run on every intra-op thread, each
    paying for a pass that memory bandwidth bounds (docs/performance.md, "Watch")."""
    tensors = [_local(t) for t in tensors]
    flat = [i for i, t in enumerate(tensors) if _flat_cpu(t)]
    out: List[Optional[torch.Tensor]] = [None] * len(tensors)
    if memory is not None and flat:
        for i, view in zip(flat, memory.views([tensors[i] for i in flat])):
            out[i] = view
    kernels = None
    if flat and _numba.threads(torch.get_num_threads()):
        kernels = _kernels()
    for i, t in enumerate(tensors):
        if not _flat_cpu(t):
            out[i] = t.clone()
            continue
        copy = out[i] if out[i] is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
        nbytes = t.numel() * t.element_size()
        copied = False
        if kernels is not None and nbytes >= _COPY_PARTS_FROM:
            try:
                kernels.copy_parts(copy.data_ptr(), t.data_ptr(), nbytes)
                copied = True
            except Exception as err:  # noqa: BLE001 - the kernel fails to compile or run: memmove
                _log.warning("the snapshot kernel failed (%s): using memmove", err)
                _kernels.disable()
                kernels = None
        if not copied:
            ctypes.memmove(copy.data_ptr(), t.data_ptr(), nbytes)
        out[i] = copy
    return out  # type: ignore[return-value]


def update_norms(after: Sequence[torch.Tensor], before: List[torch.Tensor]
                 ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(‖w‖, ‖w − w_before‖)`` per tensor as 0-d tensors: ``after`` the weights after the
    optimizer's step, ``before`` their :func:`snapshot` (consumed: it may be overwritten).

    CPU tensors of the four floating formats take one pass of a numba kernel (float64 sums of the
    exact values; a large one in parts on numba's threads, added in part order, when numba has
    thread-safe threads); the others, or without numba, PyTorch's in-place subtraction and
    :func:`_norms`."""
    after = [_local(t) for t in after]
    weights: List[Optional[torch.Tensor]] = [None] * len(after)
    updates: List[Optional[torch.Tensor]] = [None] * len(after)
    kernels = _kernels() if any(t.device.type == "cpu" for t in after) else None
    parts = kernels is not None and _numba.threads(torch.get_num_threads())
    fast, rest = [], []
    for i, (a, b) in enumerate(zip(after, before)):
        ok = kernels is not None and a.dtype in _ENTRIES and b.dtype == a.dtype and a.shape == b.shape \
            and a.numel() > 0 and _flat_cpu(a) and _flat_cpu(b)
        (fast if ok else rest).append(i)
    if fast:
        try:
            sums = []
            for i in fast:
                a = after[i]
                entry = (_PARTS if parts and a.numel() >= _PARTS_FROM else _ENTRIES)[a.dtype]
                sums.append(getattr(kernels, entry)(a.data_ptr(), before[i].data_ptr(), a.numel()))
        except Exception as err:  # noqa: BLE001 - a kernel that fails to compile or run: PyTorch's path
            _log.warning("the update-ratio kernel failed (%s): using PyTorch", err)
            _kernels.disable()
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
