"""Writing a dump: :class:`DumpWriter`, asynchronous, atomic and crash-tolerant.

The caller hands events and host tensors to :meth:`DumpWriter.write_events` (a batch: one
lock and one queue item per batch) or :meth:`DumpWriter.write_event`, which only queue them (a
queue bounded by the bytes of pending tensors applies back-pressure). One writer thread groups
tensors into shards, writes each shard under a temporary name and renames it into place, then
appends the index lines whose tensors are now in a shard. So at every instant the directory
holds a readable dump: every index line refers to data that is fully written, and a killed run
leaves a partial dump that says so (``meta.json`` has ``"complete": false``).

Durability: writes reach the operating system as they are made (a shard when it is full, the
index after every batch and at every :meth:`~DumpWriter.flush`), so a killed process (SIGKILL,
an out-of-memory kill, a crash) loses nothing that was written. ``fsync`` runs once, at
:meth:`~DumpWriter.close`, before ``meta.json`` is marked complete: only a power loss or a
kernel crash during the run can lose the last written steps. ``durable=True`` fsyncs every
shard and every index append as well (the price: one ``fsync`` per batch).
"""
from __future__ import annotations

import atexit
import collections
import errno
import functools
import logging
import os
import queue
import threading
import weakref
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

import torch

from ..errors import DumpError
from .files import (fsync_dir, fsync_file, h5_dataset_name, now, prepare_dir, unlink_quietly,
                    write_json_atomic)
from .lines import canonical, encode
from .schema import FORMAT_VERSION, FORMATS, H5_FILE, INDEX, META, SUPPORTED_DTYPES, dtype_name, shard_name

__all__ = ["DumpWriter", "write_json_atomic", "h5_dataset_name"]

log = logging.getLogger(__name__)

_MiB = 1 << 20
_BATCH = 64  # queue items (batches of events) handled before the index is appended


def _save_safetensors(tensors: Dict[str, torch.Tensor], path: str) -> None:
    """Write one shard file (a module function so tests can simulate a full disk)."""
    from safetensors.torch import save_file

    save_file(tensors, path)


class DumpWriter:
    """Write a dump directory asynchronously.

    Args:
        path: the dump directory (created). With ``meta["world_size"] > 1`` the dump goes to
            ``path/rank{N}`` with ``N = meta["rank"]``.
        format: ``"safetensors"`` (shards, default) or ``"h5"`` (one ``data.h5``).
        meta: what the capture knows (target, versions, host, argv, seed, rank, world_size...);
            ``format_version``, ``format``, ``complete`` and ``created`` are added.
        shard_bytes: a shard is written when its tensors reach this size.
        queue_bytes: bytes of tensors waiting for the writer thread before ``write_event``
            blocks. Host memory held by the writer stays below ``queue_bytes + shard_bytes``
            (plus one oversized tensor).
        overwrite: replace a dump already in the directory instead of refusing.
        durable: fsync every shard and index append (default: written at once, fsynced when the
            dump is closed; a killed process loses nothing either way, see the module docstring).

    Raises:
        DumpError: the directory cannot be created or written, or already holds a dump.

    Example:
        >>> with DumpWriter(tmp / "run", meta={"target": "cpu/bf16"}) as w:  # doctest: +SKIP
        ...     w.write_event(event, {key: tensor})
    """

    def __init__(self, path: Union[str, os.PathLike], *, format: str = "safetensors",
                 meta: Optional[Mapping[str, Any]] = None, shard_bytes: int = 256 * _MiB,
                 queue_bytes: int = 512 * _MiB, overwrite: bool = False, durable: bool = False) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
        if shard_bytes <= 0 or queue_bytes <= 0:
            raise ValueError("shard_bytes and queue_bytes must be positive")
        meta = dict(meta or {})
        self.format = format
        self.root = Path(path)
        self.rank = int(meta.get("rank") or 0)
        world_size = int(meta.get("world_size") or 1)
        self.path = self.root / f"rank{self.rank}" if world_size > 1 else self.root
        self._shard_bytes = int(shard_bytes)
        self._queue_bytes = int(queue_bytes)
        self.durable = bool(durable)

        prepare_dir(self.path, overwrite)
        self._meta = dict(meta, format_version=FORMAT_VERSION, format=format,
                          complete=False, created=now())
        try:
            write_json_atomic(self.path / META, self._meta, sync=self.durable)
            self._index = open(self.path / INDEX, "ab")
            self._h5 = self._open_h5() if format == "h5" else None
        except OSError as err:
            raise DumpError(f"cannot write dump {self.path}: {err.strerror or err}; "
                            "choose a writable output path with free space") from err

        # caller side (guarded by _cond)
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._submitted: Set[str] = set()
        self._closed = False
        self._error: Optional[BaseException] = None
        self._next_seq = 0
        # writer thread side
        self._queue: "queue.Queue[tuple]" = queue.Queue()
        self._buf: Dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._buf_ptrs: Set[int] = set()
        self._where: Dict[str, str] = {}  # data_key -> file holding it, once on disk
        self._waiting: Deque[Dict[str, Any]] = collections.deque()
        self._shard_no = 0
        self._events = 0
        self._tensors = 0
        self._bytes = 0
        self._shards: List[Path] = []  # written, not yet fsynced
        self._defaults = {"step": 0, "rank": self.rank, "call": 0, "device": ""}

        # Started with the first tensor data: events without data (a statistics capture) are
        # encoded and appended on the caller's thread, with no thread to start, wake and join.
        self._thread: Optional[threading.Thread] = None
        # a script that never closes its writer still leaves a readable (partial) dump
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # -- caller side ---------------------------------------------------------------------

    @property
    def events_written(self) -> int:
        """Events whose index line is on disk."""
        return self._events

    def write_event(self, event: Mapping[str, Any], data: Mapping[str, torch.Tensor]) -> None:
        """Queue one event and the tensors it stores; returns at once unless the queue is full.

        The writer takes ownership of ``event`` and of the tensors: do not modify them later.

        Args:
            event: the JSON-ready event (fields of :class:`~precisiondiff.store.Event`); each
                of its ``tensors`` is a dict with key, slot, dtype, shape, stats, data_key.
                ``seq`` defaults to the submission order, ``rank`` to ``meta["rank"]``.
            data: data_key → CPU tensor to store. Records whose data_key was written by an
                earlier event (aliases) need no entry; in stats mode ``data`` is empty.

        Raises:
            DumpError: an earlier write failed (disk full...) or a tensor's dtype cannot be
                stored.
            ValueError: the writer is closed, or a record names a data_key never written.
        """
        self.write_events(((event, data),))

    def write_events(self, items: Iterable[Tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]) -> None:
        """Queue a batch of ``(event, data)`` pairs, as :meth:`write_event` each, in order.

        One lock and one queue item for the whole batch (what a capture emits per statistics
        read-back). A batch whose tensors exceed ``queue_bytes`` waits until the queue is empty.

        Raises:
            DumpError, ValueError: as :meth:`write_event`; then no event of the batch is queued.
        """
        items = list(items)
        if not items:
            return
        nbytes = 0
        keys: List[str] = []
        for _, data in items:
            for key, t in data.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"data[{key!r}] is a {type(t).__name__}, not a tensor")
                if t.dtype not in SUPPORTED_DTYPES:
                    raise DumpError(f"cannot store tensor {key} of dtype {dtype_name(t.dtype)} in a "
                                    "dump; exclude it (--scope/--op) or capture with --mode stats")
                nbytes += t.numel() * t.element_size()
                keys.append(key)
        with self._cond:
            self._check_open()
            submitted = self._submitted
            batch_keys = set(keys)
            for event, data in items:
                for rec in event.get("tensors") or ():
                    dk = rec.get("data_key")
                    if dk is not None and dk not in submitted and dk not in batch_keys:
                        raise ValueError(f"record {rec.get('key')!r} points at data_key {dk!r}, "
                                         "which no event has written")
            while (self._pending_bytes > 0 and self._error is None
                   and self._pending_bytes + nbytes > self._queue_bytes):
                self._cond.wait()
            self._raise_if_failed()
            submitted.update(batch_keys)
            seq = self._next_seq
            self._next_seq += len(items)
            if self._thread is None and nbytes == 0:
                self._inline(self._add_events, items, seq)
                return
            self._pending_bytes += nbytes
            self._start_thread()
            self._queue.put(("events", items, nbytes, seq))

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="precisiondiff-dump-writer",
                                            daemon=True)
            self._thread.start()

    def _inline(self, work: Any, *args: Any) -> None:
        """Do the writer thread's work on the caller's thread (no thread yet); caller holds _cond."""
        if self._error is None:
            try:
                work(*args)
            except Exception as err:  # noqa: BLE001 - reported as the writer thread's errors are
                self._fail(err)
        self._raise_if_failed()

    def _add_events(self, items: List[tuple], seq: int) -> None:
        for event, data in items:
            self._add_event(event, data, seq)
            seq += 1
        self._append_ready()

    def _flush_files(self) -> None:
        self._write_shard()
        self._append_ready()

    def update_meta(self, **fields: Any) -> None:
        """Add fields to ``meta.json``; they are written when the dump is closed."""
        with self._cond:
            self._meta.update(fields)

    def flush(self) -> None:
        """Write the partial shard and every pending index line; wait until on disk.

        Raises:
            DumpError: a write failed (disk full...).
        """
        with self._cond:
            self._check_open()
            if self._thread is None:
                self._inline(self._flush_files)
                return
            done = threading.Event()
            self._queue.put(("flush", done))
        done.wait()
        with self._cond:
            self._raise_if_failed()

    def close(self, complete: bool = True) -> None:
        """Flush, stop the writer thread and finalize ``meta.json``.

        ``meta.json`` gets ``complete`` (False when a write failed) and the counts
        ``events``, ``tensors`` (records) and ``bytes`` (tensor data stored). Closing twice
        does nothing.

        Args:
            complete: whether the capture ran to its end.

        Raises:
            DumpError: a write failed; what was written before stays readable.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is None:
                if self._error is None:
                    try:
                        self._flush_files()
                        self._sync()
                    except Exception as err:  # noqa: BLE001 - raised below, after meta.json
                        self._fail(err)
            else:
                done = threading.Event()
                self._queue.put(("stop", done))
        if thread is not None:
            done.wait()
            thread.join()
        atexit.unregister(self._atexit)
        for fh in (self._index, self._h5):
            try:
                if fh is not None:
                    fh.close()
            except (OSError, RuntimeError, ValueError) as err:  # pragma: no cover
                log.warning("closing %s: %s", self.path, err)
        failed = self._error is not None
        meta = dict(self._meta, complete=bool(complete) and not failed, events=self._events,
                    tensors=self._tensors, bytes=self._bytes, closed=now())
        try:
            # the directory is synced only when shards were renamed into it (in _sync) or with
            # durable=True: after a power loss a stats dump reads as complete or as partial
            write_json_atomic(self.path / META, meta, sync_dir=self.durable)
            self._meta = meta
        except OSError as err:
            if not failed:
                raise DumpError(f"cannot finalize {self.path / META}: {err.strerror or err}; "
                                "free space and capture again") from err
            log.warning("cannot finalize %s after a failed write: %s", self.path / META, err)
        if failed:
            self._raise_if_failed()

    def __enter__(self) -> "DumpWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(complete=False)
        except Exception as err:  # noqa: BLE001 - never hide the exception already propagating
            log.error("closing dump %s after an error: %s", self.path, err)

    def _check_open(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise ValueError(f"DumpWriter for {self.path} is closed")

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is None:
            return
        if isinstance(err, OSError):
            reason = f"[Errno {err.errno}] {err.strerror}" if err.errno else str(err)
            if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise DumpError(f"disk full while writing {self.path}: kept {self._events} events "
                                f"already written ({reason}); free space and capture again"
                                ) from err
            raise DumpError(f"cannot write dump {self.path} ({reason}): kept {self._events} "
                            "events already written; check the disk and permissions, then "
                            "capture again") from err
        raise RuntimeError(f"the dump writer thread failed: {err!r}") from err

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < _BATCH and batch[-1][0] == "events":
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in batch:
                kind = item[0]
                try:
                    if self._error is None:
                        if kind == "events":
                            seq = item[3]
                            for event, data in item[1]:
                                self._add_event(event, data, seq)
                                seq += 1
                        else:
                            self._flush_files()
                            if kind == "stop":
                                self._sync()
                except Exception as err:  # captured; raised on the caller's next call
                    self._fail(err)
                finally:
                    if kind == "events":
                        with self._cond:
                            self._pending_bytes -= item[2]
                            self._cond.notify_all()
                    else:
                        stop = stop or kind == "stop"
                        item[1].set()
            if self._error is None and not stop:
                try:
                    self._append_ready()
                except Exception as err:
                    self._fail(err)

    def _fail(self, err: BaseException) -> None:
        log.error("dump writer for %s stopped: %s", self.path, err)
        with self._cond:
            self._error = err
            self._buf.clear()
            self._cond.notify_all()

    def _add_event(self, event: Mapping[str, Any], data: Dict[str, torch.Tensor],
                   seq: int) -> None:
        for key, t in data.items():
            if key in self._where or key in self._buf:
                continue  # stored once
            t = self._own(t)
            self._buf[key] = t
            self._buf_bytes += t.numel() * t.element_size()
        self._defaults["seq"] = seq
        self._waiting.append(canonical(event, self._defaults))
        if self._buf_bytes >= self._shard_bytes:
            self._write_shard()

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU, contiguous tensor that shares storage with no other tensor of the shard."""
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            return t.contiguous()
        if self.format == "safetensors" and t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            if (t.storage_offset() != 0 or ptr in self._buf_ptrs
                    or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            self._buf_ptrs.add(ptr)
        return t

    def _write_shard(self) -> None:
        if not self._buf:
            return
        if self.format == "safetensors":
            name = shard_name(self._shard_no)
            final = self.path / name
            tmp = self.path / (name + ".tmp")
            try:
                _save_safetensors(self._buf, str(tmp))
                if self.durable:
                    fsync_file(tmp)
                os.replace(tmp, final)
            except BaseException:
                unlink_quietly(tmp)
                raise
            if self.durable:
                fsync_dir(self.path)
            else:
                self._shards.append(final)
            self._shard_no += 1
        else:
            name = H5_FILE
            self._write_h5(self._buf)
        for key in self._buf:
            self._where[key] = name
        self._bytes += self._buf_bytes
        self._buf = {}
        self._buf_bytes = 0
        self._buf_ptrs = set()

    def _append_ready(self) -> None:
        """Append the index lines of the leading events whose tensors are all on disk."""
        lines = []
        records = 0
        waiting, where = self._waiting, self._where
        while waiting:
            line = waiting[0]
            ready = True
            for r in line["tensors"]:
                dk = r["data_key"]
                if dk is not None:
                    shard = where.get(dk)
                    if shard is None:
                        ready = False
                        break
                    r["shard"] = shard
            if not ready:
                break
            waiting.popleft()
            lines.append(encode(line))
            records += len(line["tensors"])
        if not lines:
            return
        lines.append(b"")
        self._index.write(b"\n".join(lines))
        self._index.flush()
        if self.durable:
            os.fsync(self._index.fileno())
        self._events += len(lines) - 1
        self._tensors += records

    def _sync(self) -> None:
        """Make everything written durable before meta.json says the dump is complete."""
        if self.durable:
            return
        if self._index.tell():
            os.fsync(self._index.fileno())
        if self._h5 is not None:
            self._sync_h5()
        for shard in self._shards:
            fsync_file(shard)
        if self._shards:
            fsync_dir(self.path)
        self._shards.clear()

    # -- h5 --------------------------------------------------------------------------------

    def _open_h5(self) -> Any:
        import h5py

        return h5py.File(self.path / H5_FILE, "w")

    def _write_h5(self, tensors: Dict[str, torch.Tensor]) -> None:
        from .h5 import to_numpy

        for key, t in tensors.items():
            array, dtype = to_numpy(t)
            ds = self._h5.create_dataset(h5_dataset_name(key), data=array)
            ds.attrs["dtype"] = dtype
            ds.attrs["key"] = key
        self._h5.flush()
        if self.durable:
            self._sync_h5()

    def _sync_h5(self) -> None:
        try:
            os.fsync(self._h5.id.get_vfd_handle())
        except (OSError, TypeError, ValueError):  # pragma: no cover - driver without an fd
            pass


def _close_at_exit(ref: "weakref.ref[DumpWriter]") -> None:
    writer = ref()
    if writer is None or writer._closed:
        return
    log.warning("dump %s was not closed; closing it as incomplete", writer.path)
    try:
        writer.close(complete=False)
    except Exception as err:  # noqa: BLE001 - interpreter exit: report, never raise
        log.error("closing dump %s at exit: %s", writer.path, err)
