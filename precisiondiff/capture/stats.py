"""Per-tensor statistics computed on the tensor's device and read back in batches.

For each tensor: ``min, max, mean, abs_mean, norm, nan, inf`` and the content fingerprint of
:mod:`precisiondiff.store.fingerprint`. Accumulation is float64 on the CPU and float32 on
accelerators (which may lack fast float64).

Small tensors (most of a model's ops) are snapshotted with one copy when recorded and reduced
*together* at read-back: one concatenation and a dozen segmented reductions per (device, dtype)
group instead of a dozen kernel launches per tensor. Large tensors are reduced immediately (the
launch cost is negligible next to their work, and snapshotting them would double memory).
Either way the results reach the host in one copy per device per batch, into pinned memory
without blocking (:meth:`StatsBatch.start`); reading them waits for that copy only: capture
never synchronizes per tensor.

On the CPU, when numba is installed (``precisiondiff[fast]``), floating tensors take the fused
kernel of :mod:`precisiondiff.capture.stats_kernel` instead, at once: one pass over the
tensor's memory, no snapshot copy, no concatenation; results are formatted only when read.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..store.fingerprint import _BITS, PERIOD, bits_of, fingerprint_hex, fingerprint_tensor, salts
from . import stats_kernel

__all__ = ["STAT_FIELDS", "StatsBatch", "SMALL_TENSOR_ELEMENTS", "copy_to_host"]

STAT_FIELDS = ("min", "max", "mean", "abs_mean", "norm", "nan", "inf")
SMALL_TENSOR_ELEMENTS = PERIOD  # batched tensors fit one fingerprint period
_FUSED_DTYPES = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))
_EMPTY = {"min": None, "max": None, "mean": None, "abs_mean": None, "norm": 0.0, "nan": 0, "inf": 0,
          "fingerprint": fingerprint_hex([0, 0])}


def _acc_dtype(device: torch.device, dtype: "torch.dtype | None" = None) -> torch.dtype:
    """float64 on the CPU; float32 on accelerators (which may lack fast float64). Not float32 for
    16-bit floats on the CPU: bf16 reaches 3.4e38, whose square or sum overflows float32."""
    return torch.float64 if device.type == "cpu" else torch.float32


def _stat_vector(t: torch.Tensor) -> torch.Tensor:
    acc = _acc_dtype(t.device)
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    x = x.to(acc) if x.dtype != acc else x
    lo, hi = torch.aminmax(x)
    return torch.stack([lo, hi, x.mean(), x.abs().mean(), torch.linalg.vector_norm(x),
                        torch.isnan(x).sum().to(acc), torch.isinf(x).sum().to(acc)])


def _segmented(flats: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Statistics and fingerprints of many small flat tensors of one dtype and device at once.

    Returns (k×7 stats in the accumulation dtype, k×2 int64 fingerprints), row i for flats[i].
    The fingerprint is the same formula as ``fingerprint_tensor`` (a sum modulo 2**64, so the
    segmented order gives the same value).
    """
    device = flats[0].device
    acc = _acc_dtype(device, flats[0].dtype)
    buf = torch.cat(flats)
    lengths = torch.tensor([f.numel() for f in flats], device=device)
    k = len(flats)
    x = buf.to(acc)
    lo = torch.segment_reduce(x, "min", lengths=lengths)
    hi = torch.segment_reduce(x, "max", lengths=lengths)
    total = torch.segment_reduce(x, "sum", lengths=lengths)
    absolute = torch.segment_reduce(x.abs(), "sum", lengths=lengths)
    squares = torch.segment_reduce(x * x, "sum", lengths=lengths)
    nonfinite = ~torch.isfinite(x)
    if bool(nonfinite.any()):  # one check per batch; the common case skips two reductions
        nans = torch.segment_reduce(torch.isnan(x).to(acc), "sum", lengths=lengths)
        infs = torch.segment_reduce(torch.isinf(x).to(acc), "sum", lengths=lengths)
    else:
        nans = infs = torch.zeros(k, dtype=acc, device=device)
    n = lengths.to(acc)
    stats = torch.stack([lo, hi, total / n, absolute / n, squares.sqrt(), nans, infs], dim=1)
    # NaN propagates through min/max as in torch.aminmax
    has_nan = nans > 0
    stats[:, 0] = torch.where(has_nan, torch.nan, lo)
    stats[:, 1] = torch.where(has_nan, torch.nan, hi)

    # fingerprints (the formula of precisiondiff.store.fingerprint; every tensor here has at
    # most PERIOD elements, so its period index j is 0): y = (b + 1) * S[r]
    bits = bits_of(buf)
    table = salts(device)
    salt = torch.cat([table[: f.numel()] for f in flats])
    y = (bits + 1) * salt
    ends = torch.cumsum(lengths, 0)
    # Segment sums of int64 as differences of a wrapping prefix sum: exact modulo 2**64.
    h1 = _segment_sums_int(y, ends)
    h2 = _segment_sums_int(y * bits, ends)
    return stats, torch.stack([h1, h2], dim=1)


def _segment_sums_int(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    prefix = torch.cumsum(values, 0)[ends - 1]
    return torch.diff(prefix, prepend=prefix.new_zeros(1))


# integer tensors measured exactly by NumPy (_integer_stats): their bit patterns are their values
_INTEGERS = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
             torch.bool: np.bool_}
_EXACT = float(1 << 53)  # float64 holds every integer up to this, and sums of them below it
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SALTS = salts("cpu").numpy()


def _integer_stats(t: torch.Tensor, numel: int) -> "Tuple[dict, float] | None":
    """The statistics record of a small plain CPU integer (or bool) tensor computed by NumPy,
    and its sum of squares (the record's ``norm`` is its square root by PyTorch, as the batched
    path takes it: :meth:`StatsBatch._resolve_integers`); None where they could differ from
    :func:`_segmented`'s in any bit.

    Token ids and masks: the batched path's ~25 PyTorch ops cost ~0.4 ms for one such tensor.
    When ``numel * max|x|**2`` stays below 2**53, each float64 sum (of x, |x|, x**2) is an exact
    integer whatever the order of its additions, so these are the batched path's numbers to the
    last bit (the divisions are IEEE's in both); the fingerprint is the same formula modulo 2**64."""
    if type(t) not in _PLAIN or not t.is_cpu or t.is_neg():
        return None
    try:
        values = t.numpy().reshape(-1).astype(np.int64)
    except (RuntimeError, TypeError, ValueError):  # memory NumPy cannot view
        return None
    top = float(max(-int(values.min()), int(values.max())))
    if top * top * numel >= _EXACT:
        return None
    x = values.astype(np.float64)
    total, absolute, squares = float(x.sum()), float(np.abs(x).sum()), float((x * x).sum())
    salted = (values + 1) * _SALTS[:numel]  # int64 arithmetic wraps, as the batched path's
    record = {"min": float(x.min()), "max": float(x.max()), "mean": total / numel,
              "abs_mean": absolute / numel, "norm": None, "nan": 0, "inf": 0,
              "fingerprint": fingerprint_hex([int(salted.sum()), int((salted * values).sum())])}
    return record, squares


def copy_to_host(tensors: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Optional[torch.Event]]:
    """Start copying tensors of one device to the host: into pinned memory without blocking, with
    an event recorded after the copies; (host tensors, event). CPU tensors are returned as they
    are (event None); where pinned memory or events are missing, a blocking copy (event None)."""
    if tensors[0].device.type == "cpu":
        return list(tensors), None
    device = tensors[0].device
    try:
        stream = torch.accelerator.current_stream(device)  # where the copies are queued
        done = torch.Event(device=device)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
        return [t.cpu() for t in tensors], None
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    done.record(stream)
    return host, done


def _to_host(stats: torch.Tensor, fps: torch.Tensor
             ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Event]]:
    """:func:`copy_to_host` of a batch's statistics and fingerprints."""
    (host_stats, host_fps), done = copy_to_host([stats, fps])
    return host_stats, host_fps, done


class StatsBatch:
    """Collects device-side statistics; :meth:`resolve` reads them all back at once.

    Args:
        small_elements: tensors up to this size are batched (eager path).
        fast: use the fused CPU kernel when available (False: always the eager path).
        parallel: a CPU tensor of ``stats_kernel.PARTS_FROM`` elements or more is measured in
            parts on numba's threads (:func:`~.stats_kernel.stats_in_parts`: the same minimum,
            maximum, counts and fingerprint; the sums added part by part).
    """

    def __init__(self, *, small_elements: int = SMALL_TENSOR_ELEMENTS, fast: bool = True,
                 parallel: bool = False) -> None:
        self.small_elements = small_elements
        self.fast = fast and stats_kernel.AVAILABLE
        self.parallel = parallel
        # fused-kernel rows: handle -> (row, numel), filled in place by the kernel
        self._fused: Dict[int, Tuple[int, int]] = {}
        self._out = np.empty((64, 7))
        self._fps = np.empty((64, 2), dtype=np.int64)
        self._large: Dict[torch.device, List[Tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._small: Dict[Tuple[torch.device, torch.dtype], List[Tuple[int, torch.Tensor]]] = {}
        self._results: Dict[int, dict] = {}
        self._integers: Dict[int, Tuple[dict, float]] = {}  # handle -> (record, sum of squares)
        # started read-backs: (handles, host stats, host fingerprints, copy-done event or None)
        self._inflight: List[Tuple[List[int], torch.Tensor, torch.Tensor, Optional[torch.Event]]] = []
        self._next = 0
        self.pending_elements = 0

    def add(self, t: torch.Tensor, *, snapshot: Optional[torch.Tensor] = None) -> int:
        """Queue statistics of ``t``; returns a handle for :meth:`get` after :meth:`resolve`.

        Args:
            t: the tensor.
            snapshot: a private contiguous copy of ``t`` the caller already made (saves a copy).
        """
        handle = self._next
        self._next = handle + 1
        numel = t.numel()
        if numel == 0:
            self._results[handle] = dict(_EMPTY)
            return handle
        if self.fast and t.is_cpu and t.dtype in _FUSED_DTYPES:
            row = len(self._fused)
            if row == self._out.shape[0]:
                self._out = np.concatenate([self._out, np.empty_like(self._out)])
                self._fps = np.concatenate([self._fps, np.empty_like(self._fps)])
            try:
                # the arrays themselves, not their addresses (stats_kernel.stats_at): withdrawn while
                # a heap corruption was traced (docs/performance.md)
                if self.parallel and numel >= stats_kernel.PARTS_FROM:
                    stats_kernel.stats_in_parts(t, self._out, self._fps, row)
                else:
                    stats_kernel.stats_into(t, self._out, self._fps, row)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                pass  # no NumPy view (a negative-bit view, a tensor subclass): the eager path below
            else:
                self._fused[handle] = (row, numel)
                return handle
        if t.dtype in _INTEGERS and numel <= min(self.small_elements, SMALL_TENSOR_ELEMENTS):
            found = _integer_stats(t, numel)
            if found is not None:
                self._integers[handle] = found
                return handle
        with torch.no_grad():
            if t.is_conj() or t.is_neg():  # lazy views: their values, not their memory's
                t = t.resolve_conj().resolve_neg()
            if numel <= min(self.small_elements, SMALL_TENSOR_ELEMENTS) and not t.is_complex() and t.element_size() in _BITS:
                if snapshot is not None and snapshot.device == t.device:
                    flat = snapshot.reshape(-1)
                else:
                    flat = t.detach().reshape(-1)
                    if flat.data_ptr() == t.data_ptr():
                        flat = flat.clone()  # later in-place ops must not change what we measure
                self._small.setdefault((t.device, t.dtype), []).append((handle, flat))
                self.pending_elements += numel
            else:
                vec = _stat_vector(t)
                fp = fingerprint_tensor(torch.view_as_real(t) if t.element_size() not in _BITS else t)
                self._large.setdefault(t.device, []).append((handle, vec, fp))
        return handle

    def start(self) -> None:
        """Reduce the queued small tensors and start copying every device's results to the host
        (one copy into pinned memory per device, without blocking); :meth:`resolve` waits for
        them. Calling this when a batch is full and :meth:`resolve` a batch later lets the
        device run on while its statistics travel."""
        per_device: Dict[torch.device, List[Tuple[List[int], torch.Tensor, torch.Tensor]]] = {}
        with torch.no_grad():
            for (device, _), items in self._small.items():
                stats, fps = _segmented([f for _, f in items])
                per_device.setdefault(device, []).append(([h for h, _ in items], stats.to(_acc_dtype(device)), fps))
            for device, items in self._large.items():
                stats = torch.stack([v.to(_acc_dtype(device)) for _, v, _ in items])  # float64 on CPU
                fps = torch.stack([f for _, _, f in items])
                per_device.setdefault(device, []).append(([h for h, _, _ in items], stats, fps))
            for groups in per_device.values():
                handles = [h for hs, _, _ in groups for h in hs]
                stats = torch.cat([s for _, s, _ in groups])
                fps = torch.cat([f for _, _, f in groups])
                self._inflight.append((handles, *_to_host(stats, fps)))
        self._small.clear()
        self._large.clear()
        self.pending_elements = 0

    def resolve(self) -> None:
        """Reduce the queued small tensors, then one host copy per device for everything."""
        self._resolve_fused()
        self._resolve_integers()
        self.start()
        for handles, stats, fps, done in self._inflight:
            if done is not None:
                done.synchronize()  # this copy only, not the whole device
            for handle, row, fp in zip(handles, stats.tolist(), fps.tolist()):
                result = dict(zip(STAT_FIELDS, row))
                result["nan"], result["inf"] = int(row[5]), int(row[6])
                result["fingerprint"] = fingerprint_hex(fp)
                self._results[handle] = result
        self._inflight.clear()

    def _resolve_fused(self) -> None:
        if not self._fused:
            return
        rows = len(self._fused)  # rows 0..rows-1, in the order of the handles
        out = self._out[:rows]
        numel = np.fromiter((n for _, n in self._fused.values()), dtype=np.float64, count=rows)
        nan = out[:, 5]
        # NumPy's division and square root are IEEE's, as Python's: the same floats, in one pass
        lo = np.where(nan > 0, np.nan, out[:, 0]).tolist()
        hi = np.where(nan > 0, np.nan, out[:, 1]).tolist()
        mean = (out[:, 2] / numel).tolist()
        abs_mean = (out[:, 3] / numel).tolist()
        norm = np.sqrt(out[:, 4]).tolist()
        nans = nan.astype(np.int64).tolist()
        infs = out[:, 6].astype(np.int64).tolist()
        # each row's two words as big-endian unsigned: fingerprint_hex's 32 digits, row after row
        digits = self._fps[:rows, :2].astype(">u8").tobytes().hex()
        results = self._results
        for i, handle in enumerate(self._fused):
            results[handle] = {
                "min": lo[i], "max": hi[i], "mean": mean[i], "abs_mean": abs_mean[i], "norm": norm[i],
                "nan": nans[i], "inf": infs[i], "fingerprint": digits[32 * i:32 * i + 32]}
        self._fused.clear()

    def _resolve_integers(self) -> None:
        """The norms of the integer tensors :func:`_integer_stats` measured: one PyTorch square
        root for all (PyTorch's float64 square root is not always the correctly rounded one, and
        the batched path takes it)."""
        if not self._integers:
            return
        items = list(self._integers.items())
        self._integers.clear()
        with torch.no_grad():
            norms = torch.tensor([squares for _, (_, squares) in items], dtype=torch.float64).sqrt().tolist()
        for (handle, (record, _)), norm in zip(items, norms):
            record["norm"] = norm
            self._results[handle] = record

    def put_results(self, records: List[dict]) -> int:
        """Statistics records computed elsewhere (the compiled capture engine's hook runs the
        fused kernel through its C entry points and formats the rows as :meth:`resolve` does);
        returns the first one's handle, the others follow in order."""
        first = self._next
        self._next = first + len(records)
        self._results.update(zip(range(first, first + len(records)), records))
        return first

    def get(self, handle: int) -> dict:
        result = self._results.get(handle)
        if result is None:
            self._resolve_fused()
            self._resolve_integers()
            result = self._results[handle]
        return result

    def clear(self) -> None:
        self._fused.clear()
        self._integers.clear()
        self._inflight.clear()
        self._small.clear()
        self._large.clear()
        self._results.clear()
        self.pending_elements = 0
