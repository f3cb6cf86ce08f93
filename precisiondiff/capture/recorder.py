"""Builds events: call numbering, tensor keys, de-duplication, batched statistics, copies.

A :class:`Recorder` turns "module X ran with these tensors" into event records and hands them,
with the tensor data to persist, to a sink (a dump writer or an in-memory list). Events are
held until their statistics are read back in one batch, then emitted in execution order.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..runtime.narrowing import beyond_int32, held_dtype
from ..store.schema import SUPPORTED_DTYPES, tensor_key
from .distributed import local_view
from .stats import StatsBatch
from .streams import StreamSet

__all__ = ["Sink", "MemorySink", "Recorder", "PendingEvent", "make_key", "MODES"]

MODES = ("stats", "tensors", "replay")

_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


def make_key(scope: str, name: str, call: int, direction: str, slot: str, step: Optional[int] = None) -> str:
    """``{scope}/{name}#{call}:{direction}:{slot}``, prefixed ``step{N}/`` when ``step`` is given
    (the store's :func:`~precisiondiff.store.schema.tensor_key`)."""
    return tensor_key(scope, name, call, direction, slot, step=step, multi_step=step is not None)


class Sink(Protocol):
    """Where finished events go."""

    def write_event(self, event: dict, data: Dict[str, torch.Tensor]) -> None: ...

    def close(self, complete: bool = True) -> None: ...


class MemorySink:
    """Keeps events and tensor data in memory (bisect, tests)."""

    def __init__(self) -> None:
        self.events: List[dict] = []
        self.data: Dict[str, torch.Tensor] = {}
        self.complete: Optional[bool] = None

    def write_event(self, event: dict, data: Dict[str, torch.Tensor]) -> None:
        self.events.append(event)
        self.data.update(data)

    def write_events(self, items: List[Tuple[dict, Dict[str, torch.Tensor]]]) -> None:
        """:meth:`write_event` for each ``(event, data)`` in order (a subclass that overrides
        ``write_event`` sees every event)."""
        write = self.write_event
        for event, data in items:
            write(event, data)

    def close(self, complete: bool = True) -> None:
        self.complete = complete

    def tensor(self, record: dict) -> torch.Tensor:
        """The stored data of a tensor record (aliases resolved)."""
        return self.data[record["data_key"]]


class PendingEvent:
    """An event being recorded; finished by :meth:`Recorder.finish`.

    ``tensors`` holds one ``(slot, dtype, shape, data_key, stats handle, extra fields)`` per
    recorded tensor; the index records (and their keys) are built when the event is emitted.
    ``extra`` holds event fields beyond the schema's (a collective's group)."""

    __slots__ = ("kind", "scope", "name", "direction", "call", "step", "tensors", "slots", "device",
                 "output_seen", "seq", "args", "extra", "unread")

    def __init__(self, kind: str, scope: str, name: str, direction: str, call: int, step: int) -> None:
        self.kind = kind
        self.scope = scope
        self.name = name
        self.direction = direction
        self.call = call
        self.step = step
        self.tensors: List[tuple] = []
        self.slots: Dict[int, str] = {}
        self.device: Optional[str] = None
        self.output_seen = False
        self.seq = 0
        self.args: Any = None
        self.extra: Optional[dict] = None
        self.unread: Optional[set] = None  # ids of uninitialized buffers the op fills (dispatch.py)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}
_DEVICE_NAMES: Dict[torch.device, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


_F64, _I64 = torch.float64, torch.int64
_INT64_ON_DEVICE = "_int64_on_device"  # a mark until the statistics say whether it leaves int32


def _conversion_marks(device: torch.device, dtype: torch.dtype) -> dict:
    """Record fields of a 64-bit tensor on an accelerator: ``held_dtype`` where the device holds
    float64 as float32 (probed once per device), a mark for an int64 (checked at flush)."""
    if dtype is _I64:
        return {_INT64_ON_DEVICE: True}
    held = held_dtype(device, dtype)
    return {"held_dtype": _dtype_name(held)} if held != dtype else {}


def _int32_overflow(record: dict) -> None:
    """An int64 on an accelerator whose values leave int32 (torch_mlu computes many ops in int32,
    unchecked): ``int32_overflow`` with its range."""
    if record.pop(_INT64_ON_DEVICE, False) and beyond_int32(record.get("stats")):
        record["int32_overflow"] = {"min": record["stats"]["min"], "max": record["stats"]["max"]}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _moved(t: torch.Tensor, ptr: int) -> bool:
    """Whether ``t`` no longer holds the memory at ``ptr`` it was recorded with."""
    try:
        return t.data_ptr() != ptr
    except RuntimeError:  # no storage: it was identified by id(), which it still has
        return False


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    try:
        # Non-blocking into pinned memory; the batched stats read-back orders it before use.
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    except RuntimeError:
        return t.to("cpu")


class Recorder:
    """Numbering, keys, de-duplication and batching for one capture.

    Args:
        sink: receives finished events.
        mode: ``stats``, ``tensors`` or ``replay``.
        multi_step: prefix tensor keys with ``step{N}/``: True always, False never, None from
            step 1 on.
        rank: this process's rank.
        batch_events: events held before their statistics are read back at once.
        batch_elements: snapshotted small-tensor elements held before a read-back (memory bound).
        dedup_bytes: ... and at most this many bytes of them (large activations on a device).
        dedup_window: recently recorded tensors kept alive so their storage cannot be reused
            by another tensor that would then be mistaken for them.
        host_bytes: bytes of host copies held before a read-back hands them to the sink.
    """

    def __init__(self, sink: Sink, *, mode: str = "stats", multi_step: Optional[bool] = None, rank: int = 0,
                 batch_events: int = 512, batch_elements: int = 1 << 24, dedup_window: int = 1024,
                 dedup_bytes: int = 256 << 20, host_bytes: int = 256 << 20) -> None:
        self.sink, self.mode, self.multi_step, self.rank = sink, mode, multi_step, rank
        self.batch_events, self.batch_elements, self.dedup_window = batch_events, batch_elements, dedup_window
        self.dedup_bytes = dedup_bytes
        self._kept_bytes = 0
        self.host_bytes = host_bytes
        self._data_bytes = 0  # host copies not yet handed to the sink
        self._streams = StreamSet()  # accelerator streams tensors of this batch were recorded on
        self.gather: Any = None  # a gather.FullGather when full DTensors are asked for
        self.step = 0
        self.seq = 0
        self.events_written = 0
        self._stores = mode != "stats"
        self._calls: Dict[tuple, int] = {}
        self._stats = StatsBatch()
        self._last: Optional[tuple] = None  # (tensor, version, identity, data_key, handle) last recorded
        self._pending: List[Any] = []  # PendingEvent, or a record formatted elsewhere (add_records)
        # Host copies not yet handed to the sink. The first emitted event that references a copy
        # carries it: a module's inputs are recorded when it starts but it finishes (and is
        # numbered) after the ops inside it, which may reference the same tensors.
        self._data: Dict[str, torch.Tensor] = {}
        self._seen: "collections.OrderedDict[tuple, Tuple[torch.Tensor, Optional[str], int]]" = collections.OrderedDict()
        # content identity -> (tensor, stats handle), the same bounded window as _seen
        self._same_content: "collections.OrderedDict[tuple, Tuple[torch.Tensor, int]]" = collections.OrderedDict()
        # (device, storage base address) -> [(identity, content identity)] of what _seen holds
        # there, for forget(): a write through another alias (.data) bumps no version counter.
        # Built lazily, at the first write after new records (most steps write rarely).
        self._by_base: Dict[tuple, List[tuple]] = {}
        self._unindexed: List[tuple] = []  # identities recorded since _by_base was last built
        # called before an event is begun or a batch is read back: the compiled engine hands over
        # the calls it recorded meanwhile, so that events keep their execution order
        self.before_events: Optional[Any] = None
        self._fixups: List[tuple] = []  # (record, handle) of events formatted elsewhere (add_records)

    @property
    def stores_data(self) -> bool:
        return self.mode in ("tensors", "replay")

    def begin(self, kind: str, scope: str, name: str, direction: str) -> PendingEvent:
        """Start an event: its call number is fixed now."""
        if self.before_events is not None:
            self.before_events()
        ident = (kind, scope, name, direction)
        calls = self._calls
        call = calls.get(ident, 0)
        calls[ident] = call + 1
        return PendingEvent(kind, scope, name, direction, call, self.step)

    def add(self, event: PendingEvent, slot: str, t: torch.Tensor, *, store: bool = True,
            fresh: bool = False) -> None:
        """Record tensor ``t`` under ``slot`` (``input.0``, ``output.0``, ``param.weight``...).

        ``fresh`` skips de-duplication: the tensor's contents changed without a new identity.
        A DTensor is measured on its local shard; a meta or fake tensor is recorded unmeasured.
        """
        # The hot path of capture (every tensor of every op): no key strings here (built when
        # the event is emitted, and only in tensors/replay mode when the data is stored now).
        # ``device.type`` costs ~1 us (a new string each time): devices are looked up in a dict.
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
                name = last[5]
                if name != "cpu":
                    self._streams.note(ident[0])
                event.tensors.append((slot, ident[4], ident[2], last[3], last[4], None))
                slots = event.slots
                if id(t) not in slots:
                    slots[id(t)] = slot
                if not event.output_seen:
                    if slot[0] == "o" and slot.startswith("output"):
                        event.device, event.output_seen = name, True
                    elif event.device is None:
                        event.device = name
                return None
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
        name = _DEVICE_NAMES.get(device) or _device_name(device)
        if name != "cpu":
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
            content = (device, ptr, numel, ident[4], version, ident[6]) \
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
            if version != -1:
                seen_map[ident] = (t, data_key, handle)
                self._unindexed.append(ident)
                self._kept_bytes += numel * t.element_size()
                if len(seen_map) > self.dedup_window or self._kept_bytes > self.dedup_bytes:
                    self._evict()
        event.tensors.append((slot, ident[4], ident[2], data_key, handle, extra))
        if extra is None and version != -1:
            self._last = (t, version, ident, data_key, handle, name)
        slots = event.slots
        if id(original) not in slots:
            slots[id(original)] = slot  # an in-place op returns its input: args name the input
        if not event.output_seen:
            if slot[0] == "o" and slot.startswith("output"):
                event.device, event.output_seen = name, True
            elif event.device is None:
                event.device = name
        return None

    def _key(self, event: PendingEvent, slot: str) -> str:
        # Keys carry the step when the dump holds several: always for an explicit multi-step
        # selection; with no selection, from the second step on (a one-step capture stays plain).
        step = event.step if (self.multi_step is True or (self.multi_step is None and event.step > 0)) else None
        return make_key(event.scope, event.name, event.call, event.direction, slot, step)

    def add_unmeasured(self, event: PendingEvent, slot: str, t: torch.Tensor, extra: dict, *,
                       name_slot: bool = True) -> None:
        """A tensor recorded without statistics: one capture cannot read (meta, fake, opaque
        subclass) or whose contents are noise (an uninitialized buffer). ``name_slot=False``
        keeps replay arguments from referring to it (replay allocates it from dtype and shape)."""
        event.tensors.append((slot, t.dtype, t.shape, None, None, extra))
        if name_slot:
            event.slots.setdefault(id(t), slot)
        if event.device is None:
            event.device = str(t.device)

    def forget(self, tensors: Sequence[torch.Tensor]) -> None:
        """The memory of these tensors was written: what was recorded of it (through any alias,
        any view) is no longer what a later read sees, whatever its version counter says."""
        self._last = None
        if self._unindexed:
            self._index()
        by_base, seen, same = self._by_base, self._seen, self._same_content
        if not by_base:
            return
        for t in tensors:
            try:
                base = (t.device, t.data_ptr() - t.storage_offset() * t.element_size())
            except (RuntimeError, NotImplementedError):  # no storage: nothing of it was recorded
                continue
            for ident, content in by_base.pop(base, ()):
                entry = seen.pop(ident, None)
                if entry is not None:
                    self._kept_bytes -= _nbytes(entry[0])
                if content is not None:
                    same.pop(content, None)

    def _index(self) -> None:
        """File the identities recorded since the last write under their storage's base address."""
        by_base, seen = self._by_base, self._seen
        for ident in self._unindexed:
            entry = seen.get(ident)
            if entry is None:  # evicted already: nothing of it left to forget
                continue
            t = entry[0]
            try:
                base = ident[1] - t.storage_offset() * t.element_size()
            except RuntimeError:
                continue
            content = (ident[0], ident[1], ident[2].numel(), ident[4], ident[5], ident[6])
            by_base.setdefault((ident[0], base), []).append((ident, content))
        self._unindexed.clear()

    def _evict(self) -> None:
        """Forget the oldest tensors beyond the window's count or bytes (they may be freed)."""
        while self._seen and (len(self._seen) > self.dedup_window or self._kept_bytes > self.dedup_bytes):
            _, entry = self._seen.popitem(last=False)
            self._kept_bytes -= _nbytes(entry[0])
        while len(self._same_content) > len(self._seen):
            self._same_content.popitem(last=False)
        if len(self._by_base) > 2 * self.dedup_window:  # entries of evicted tensors: rebuilt from _seen
            kept = set(self._seen)
            self._by_base = {k: v for k, v in ((k, [e for e in v if e[0] in kept])
                                               for k, v in self._by_base.items()) if v}
        if len(self._unindexed) > 4 * self.dedup_window:
            # once: freed memory reused by a new tensor of the same layout gives an identity equal
            # to an old one, so without dropping repeats the list stayed long and was rebuilt at
            # every add (O(window) each) on any step recording more than 4 windows of tensors
            seen = self._seen
            self._unindexed = [i for i in dict.fromkeys(self._unindexed) if i in seen]

    def slot_of(self, event: PendingEvent, t: torch.Tensor) -> str:
        """The slot a tensor of this event was recorded under (for replay arguments)."""
        return event.slots[id(t)]

    def finish(self, event: PendingEvent, *, args: Any = None) -> None:
        """Close an event; it is emitted at the next batch read-back."""
        if self.before_events is not None:
            self.before_events()
        if not event.tensors:
            return
        event.seq = self.seq
        self.seq += 1
        event.args = args
        self._pending.append(event)
        if (len(self._pending) >= self.batch_events or self._stats.pending_elements > self.batch_elements
                or self._data_bytes > self.host_bytes):
            self.flush()

    def add_records(self, events: List[dict], fixups: List[tuple]) -> None:
        """Op events recorded and formatted elsewhere (the compiled engine's hook: numbered from
        this recorder's counters, sequence numbers from :attr:`seq` on), queued in order with the
        events recorded here. ``fixups``: ``(tensor record, statistics handle)`` for tensors
        measured through this recorder's :class:`StatsBatch`, filled at the read-back."""
        self.seq += len(events)
        self._pending.extend(events)
        self._fixups.extend(fixups)
        if (len(self._pending) >= self.batch_events or self._stats.pending_elements > self.batch_elements
                or self._data_bytes > self.host_bytes):
            self.flush()

    def flush(self) -> None:
        """Read back all queued statistics at once and emit pending events in order."""
        if self.before_events is not None:
            self.before_events()
        if not self._pending:
            return
        self._streams.join()
        self._stats.resolve()
        pending, self._pending = self._pending, []
        get = self._stats.get
        results = self._stats._results  # every handle of this batch is there after resolve()
        batch = []
        rank = self.rank
        multi = self.multi_step
        if self._fixups:
            for record, handle in self._fixups:
                record["stats"] = results.get(handle) or get(handle)
            self._fixups.clear()
        for ev in pending:
            if type(ev) is dict:  # formatted already (add_records)
                batch.append((ev, {}))
                continue
            tensors, data = [], {}
            step = ev.step
            prefix = (f"step{step}/" if multi is True or (multi is None and step > 0) else "") + \
                f"{ev.scope}/{ev.name}#{ev.call}:{ev.direction}:"
            for slot, dtype, shape, data_key, handle, extra in ev.tensors:
                name = _DTYPE_NAMES.get(dtype) or _dtype_name(dtype)
                stats = None if handle is None else (results.get(handle) or get(handle))
                record = {"key": prefix + slot, "slot": slot, "dtype": name,
                          "shape": list(shape), "stats": stats, "data_key": data_key}
                if extra:
                    record.update(extra)
                    if _INT64_ON_DEVICE in extra:
                        _int32_overflow(record)
                tensors.append(record)
                if data_key is not None:
                    copy = self._data.pop(data_key, None)
                    if copy is not None:
                        data[data_key] = copy
            out = {"seq": ev.seq, "step": ev.step, "rank": rank, "kind": ev.kind,
                   "scope": ev.scope, "name": ev.name, "direction": ev.direction, "call": ev.call,
                   "device": ev.device, "tensors": tensors, "args": ev.args}
            if ev.extra:
                out.update(ev.extra)
            batch.append((out, data))
        write_events = getattr(self.sink, "write_events", None)
        if write_events is not None:
            write_events(batch)  # one hand-off per read-back, not one per event
        else:
            for out, data in batch:
                self.sink.write_event(out, data)
        self.events_written += len(batch)
        # copies of events still open (a module whose inputs were recorded) stay held
        self._data_bytes = sum(_nbytes(t) for t in self._data.values())

    def release(self) -> None:
        """Let go of the tensors kept for de-duplication (the session closed): they hold their
        autograd graphs, whose hooks hold the session."""
        self._last = None
        self._seen.clear()
        self._same_content.clear()
        self._by_base.clear()
        self._unindexed.clear()
        self._kept_bytes = 0

    def end_step(self) -> None:
        """Flush and start the next step: call numbers restart, de-duplication forgets.

        The sink is flushed too, so a run killed later keeps every finished step on disk."""
        self.flush()
        if hasattr(self.sink, "flush"):
            self.sink.flush()
        self._stats.clear()
        self.release()
        self._data.clear()
        self._data_bytes = 0
        self._calls.clear()
        self.step += 1

    def tensors_of(self, values: Sequence[Any]) -> List[torch.Tensor]:
        from .serialize import flatten_tensors
        return flatten_tensors(list(values))
