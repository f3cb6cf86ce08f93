"""The per-event path of capture as it was before the 2026-12-02 speed pass (main 92edc4d): the
oracle of ``test_capture_equivalence.py``. Only the methods that pass rewrote are kept here, as
overrides of the current classes, verbatim; everything else is shared.

Frozen: do not optimise this file. A deliberate change of what capture records changes both.
"""
# flake8: noqa
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from precisiondiff.capture import recorder as _recorder, stats as _stats_mod, stats_kernel
from precisiondiff.capture.recorder import (_F64, _I64, _Parameter, _Tensor, PendingEvent, _conversion_marks,
                                            _device_name, _host_copy, _moved, _nbytes, local_view)
from precisiondiff.capture.stats import _BITS, _EMPTY, _FUSED_DTYPES, SMALL_TENSOR_ELEMENTS, _stat_vector
from precisiondiff.store.fingerprint import fingerprint_hex, fingerprint_tensor
from precisiondiff.store.schema import SUPPORTED_DTYPES


class LegacyStatsBatch(_stats_mod.StatsBatch):
    """StatsBatch with the previous ``add`` and ``_resolve_fused``."""

    def add(self, t: torch.Tensor, *, snapshot: Optional[torch.Tensor] = None) -> int:
        """Queue statistics of ``t``; returns a handle for :meth:`get` after :meth:`resolve`.

        Args:
            t: the tensor.
            snapshot: a private contiguous copy of ``t`` the caller already made (saves a copy).
        """
        handle = self._next
        self._next += 1
        numel = t.numel()
        if numel == 0:
            self._results[handle] = dict(_EMPTY)
            return handle
        if self.fast and t.dtype in _FUSED_DTYPES and t.device.type == "cpu":
            row = len(self._fused)
            if row == self._out.shape[0]:
                self._out = np.concatenate([self._out, np.empty_like(self._out)])
                self._fps = np.concatenate([self._fps, np.empty_like(self._fps)])
            try:
                stats_kernel.stats_into(t, self._out, self._fps, row)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                pass  # no NumPy view (a negative-bit view, a tensor subclass): the eager path below
            else:
                self._fused[handle] = (row, numel)
                return handle
        with torch.no_grad():
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

    def _resolve_fused(self) -> None:
        if not self._fused:
            return
        rows = len(self._fused)
        out = self._out[:rows].tolist()
        fps = self._fps[:rows].tolist()
        for handle, (row, numel) in self._fused.items():
            lo, hi, total, absolute, squares, nan, inf = out[row]
            if nan:
                lo = hi = math.nan
            self._results[handle] = {
                "min": lo, "max": hi, "mean": total / numel, "abs_mean": absolute / numel,
                "norm": math.sqrt(squares), "nan": int(nan), "inf": int(inf),
                "fingerprint": fingerprint_hex(fps[row][:2])}
        self._fused.clear()


class LegacyRecorder(_recorder.Recorder):
    """Recorder with the previous ``add`` (and its ``_note_slot``) over :class:`LegacyStatsBatch`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stats = LegacyStatsBatch()

    def add(self, event: PendingEvent, slot: str, t: torch.Tensor, *, store: bool = True,
            fresh: bool = False) -> None:
        """Record tensor ``t`` under ``slot`` (``input.0``, ``output.0``, ``param.weight``...).

        ``fresh`` skips de-duplication: the tensor's contents changed without a new identity.
        A DTensor is measured on its local shard; a meta or fake tensor is recorded unmeasured.
        """
        # The hot path of capture (every tensor of every op): no key strings here (built when
        # the event is emitted, and only in tensors/replay mode when the data is stored now).
        last = self._last
        if last is not None and t is last[0] and not fresh:
            # the tensor recorded last (an op's input is most often the previous op's output),
            # unchanged since: the same record without looking its identity up again
            try:
                version = t._version
            except RuntimeError:
                version = -1
            ident = last[2]
            # ``t.data = other`` swaps the memory under the same tensor and version counter
            if version == last[1] and (last[3] is not None or not (store and self._stores)) \
                    and t.data_ptr() == ident[1]:
                if ident[0].type != "cpu":
                    self._streams.note(ident[0])
                event.tensors.append((slot, ident[4], ident[2], last[3], last[4], None))
                return self._note_slot(event, slot, t, ident[0])
        original, extra = t, None
        cls = type(t)
        if (cls is not _Tensor and cls is not _Parameter) or t.is_meta:
            t, extra = local_view(t)
            if t is None:
                return self.add_unmeasured(event, slot, original, extra)
            if self.gather is not None and extra and "placements" in extra:
                self.gather.note(self._key(event, slot), event, slot, original, t)
        stores = store and self._stores
        if stores and t.dtype not in SUPPORTED_DTYPES:
            stores, extra = False, {**(extra or {}), "not_stored": "no dump encoding for this dtype"}
        device = t.device
        if device.type != "cpu":
            self._streams.note(device)
            if t.dtype is _F64 or t.dtype is _I64:
                marks = _conversion_marks(device, t.dtype)
                if marks:
                    extra = {**(extra or {}), **marks}
        # _identity(t), inline: this runs for every tensor of every op
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter, so never de-duplicated
            version = -1
            fresh = True
        try:
            ptr = t.data_ptr()
        except RuntimeError:
            ptr = id(t)
        # a negative or conjugate view of recorded memory holds other values than the memory
        # read plainly: its bits are part of its identity (and of its content's, below)
        ident = (device, ptr, t.shape, t.stride(), t.dtype, version, (t.is_neg() << 1) | t.is_conj())
        seen_map = self._seen
        seen = None if fresh else seen_map.get(ident)
        if seen is not None and seen[0] is not t and _moved(seen[0], ptr):
            # the tensor kept for this identity had its memory swapped (``.data =``): the old
            # memory may have been freed and reused by this one, which is a new tensor
            del seen_map[ident]
            self._kept_bytes -= _nbytes(seen[0])
            seen = None
        if seen is not None:
            seen_map.move_to_end(ident)
            _, data_key, handle = seen
            if data_key is None and stores:
                data_key = self._key(event, slot)
                self._data[data_key] = _host_copy(t)
                self._data_bytes += _nbytes(t)
                seen_map[ident] = (t, data_key, handle)
        else:
            data_key = None
            copy = None
            if stores:
                data_key = self._key(event, slot)
                copy = self._data[data_key] = _host_copy(t)
                self._data_bytes += _nbytes(t)
            # A reshaped view of a recorded contiguous tensor (view, unsqueeze, _unsafe_view: ops
            # that are not recorded) holds the same elements in the same order: same statistics
            # and fingerprint, so they are not computed again. Its data is stored under its own key.
            # (not for inference tensors: without a version counter an in-place change is invisible)
            numel = t.numel()
            content = (device, ident[1], numel, ident[4], ident[5], ident[6]) \
                if not fresh and t.is_contiguous() else None
            same = self._same_content.get(content) if content is not None else None
            if same is not None:
                handle = same[1]
            else:
                handle = self._stats.add(t, snapshot=copy)
                if content is not None:
                    # keeping the tensor alive keeps its memory from being reused meanwhile
                    # (the same tensor as the _seen entry below: its bytes are counted there)
                    self._same_content[content] = (t, handle)
            if ident[5] != -1:
                seen_map[ident] = (t, data_key, handle)
                self._unindexed.append(ident)
                self._kept_bytes += numel * t.element_size()
                if len(seen_map) > self.dedup_window or self._kept_bytes > self.dedup_bytes:
                    self._evict()
        event.tensors.append((slot, ident[4], ident[2], data_key, handle, extra))
        if extra is None and version != -1:
            self._last = (t, version, ident, data_key, handle)
        self._note_slot(event, slot, original, device)

    @staticmethod
    def _note_slot(event: PendingEvent, slot: str, original: torch.Tensor, device: torch.device) -> None:
        slots = event.slots
        if id(original) not in slots:
            slots[id(original)] = slot  # an in-place op returns its input: args name the input
        if event.output_seen:
            return
        if slot[0] == "o" and slot.startswith("output"):
            event.device, event.output_seen = _device_name(device), True
        elif event.device is None:
            event.device = _device_name(device)
