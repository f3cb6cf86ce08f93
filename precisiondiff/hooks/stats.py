"""Per-tensor statistics computed on the tensor's device and read back in batches.

For each tensor we queue a small vector ``[min, max, mean, abs_mean, norm, nan, inf]``
(float64 on the CPU, float32 on accelerators, which may lack fast float64) and a 2-element int64
content fingerprint; :class:`StatsBatch` stacks all queued vectors of a device and copies them to
the host once, so capture never synchronizes per tensor.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["STAT_FIELDS", "StatsBatch"]

STAT_FIELDS = ("min", "max", "mean", "abs_mean", "norm", "nan", "inf")


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    from ..store.fingerprint import fingerprint_tensor
    return fingerprint_tensor(t)


def _stat_vector(t: torch.Tensor) -> torch.Tensor:
    acc = torch.float64 if t.device.type == "cpu" else torch.float32
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.to(acc) if x.dtype != acc else x
    lo, hi = torch.aminmax(x)
    return torch.stack([lo, hi, x.mean(), x.abs().mean(), torch.linalg.vector_norm(x),
                        torch.isnan(x).sum().to(acc), torch.isinf(x).sum().to(acc)])


class StatsBatch:
    """Collects device-side statistics; :meth:`resolve` reads them all back at once."""

    def __init__(self) -> None:
        self._vectors: Dict[torch.device, List[Tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._results: Dict[int, dict] = {}
        self._next = 0

    def __len__(self) -> int:
        return self._next - len(self._results)

    def add(self, t: torch.Tensor) -> int:
        """Queue statistics of ``t``; returns a handle for :meth:`get` after :meth:`resolve`."""
        handle = self._next
        self._next += 1
        if t.numel() == 0:
            self._results[handle] = {"min": None, "max": None, "mean": None, "abs_mean": None,
                                     "norm": 0.0, "nan": 0, "inf": 0, "fingerprint": "0" * 32}
            return handle
        with torch.no_grad():
            vec = _stat_vector(t)
            fp = _fingerprint(t)
        self._vectors.setdefault(t.device, []).append((handle, vec, fp))
        return handle

    def resolve(self) -> None:
        """One host copy per device for every queued vector."""
        from ..store.fingerprint import fingerprint_hex
        for items in self._vectors.values():
            vecs = torch.stack([v.to(items[0][1].dtype) for _, v, _ in items]).cpu().tolist()
            fps = torch.stack([f for _, _, f in items]).cpu().tolist()
            for (handle, _, _), row, fp in zip(items, vecs, fps):
                stats = dict(zip(STAT_FIELDS, row))
                stats["nan"], stats["inf"] = int(row[5]), int(row[6])
                stats["fingerprint"] = fingerprint_hex(fp)
                self._results[handle] = stats
        self._vectors.clear()

    def get(self, handle: int) -> dict:
        return self._results[handle]

    def clear(self) -> None:
        self._vectors.clear()
        self._results.clear()

