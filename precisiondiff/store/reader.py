"""Reading a dump: :func:`load` and :class:`Dump`, lazy and memory-mapped.

The index is read line by line when iterated; tensors are read one at a time from
memory-mapped safetensors shards (or HDF5 datasets). Nothing is ever unpickled.
"""
from __future__ import annotations

import dataclasses

import collections
import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..errors import DumpError
from .schema import FORMAT_VERSION, H5_FILE, INDEX, META, Event, TensorRecord, dtype_name
from .shard_file import ShardFile

__all__ = ["load", "Dump", "read_meta", "iter_index"]

log = logging.getLogger(__name__)

_RANK_DIR = re.compile(r"^rank(\d+)$")
_MAX_OPEN = 32  # shard handles kept open (least recently used are dropped)


def read_meta(path: Union[str, Path]) -> Dict[str, Any]:
    """Read and check ``meta.json`` of the dump directory ``path``.

    Raises:
        DumpError: it is missing, unparsable, not a dump's meta, or of a newer format.
    """
    meta_path = Path(path) / META
    try:
        text = meta_path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise DumpError(f"{path} is not a precisiondiff dump: {META} is missing; point at a "
                        "directory written by `precisiondiff capture`") from err
    except OSError as err:
        raise DumpError(f"cannot read {meta_path}: {err.strerror or err}; check permissions"
                        ) from err
    try:
        meta = json.loads(text)
    except ValueError as err:
        raise DumpError(f"{meta_path} is corrupted ({err}); capture the dump again") from err
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise DumpError(f"{meta_path} is not a precisiondiff dump's meta (no format_version); "
                        "capture the dump again")
    version = meta["format_version"]
    if not isinstance(version, int) or version < 1:
        raise DumpError(f"{meta_path}: invalid format_version {version!r}; capture again")
    if version > FORMAT_VERSION:
        raise DumpError(f"{path} has dump format {version}, newer than this precisiondiff "
                        f"reads ({FORMAT_VERSION}); upgrade precisiondiff")
    return meta


def iter_index(path: Union[str, Path], *, strict: bool = True
               ) -> Iterator[Tuple[int, Optional[Dict[str, Any]], Optional[str]]]:
    """Yield ``(line_number, parsed_dict_or_None, error_or_None)`` for each index line.

    A last line without its newline (a run killed while appending) that does not parse is
    skipped with a log message. With ``strict`` an unparsable line raises instead of
    being yielded with its error.

    Raises:
        DumpError: the index is missing, or (``strict``) a line is not valid JSON.
    """
    index = Path(path) / INDEX
    try:
        fh = open(index, "rb")
    except FileNotFoundError as err:
        raise DumpError(f"{index} is missing: the dump is damaged; capture it again") from err
    with fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                if not raw.endswith(b"\n"):
                    log.warning("%s: ignoring the truncated last line %d (the capture was "
                                "interrupted)", index, number)
                    return
                if strict:
                    raise DumpError(f"{index} line {number} is corrupted ({err}); run "
                                    f"`precisiondiff verify {path}`") from err
                yield number, None, str(err)
                continue
            yield number, obj, None


_WARNED: set = set()


class Dump:
    """A dump on disk, read lazily. Build it with :func:`load`.

    Attributes:
        path: the dump directory.
        meta: the dict from ``meta.json`` (for a multi-rank dump: world_size, ranks, complete).
        complete: False when the capture did not finish (killed, disk full, an exception).
        ranks: ``{rank: Dump}``; one entry (itself) for a single-rank dump.
    """

    def __init__(self, path: Union[str, Path], meta: Dict[str, Any], *,
                 ranks: Optional[Dict[int, "Dump"]] = None) -> None:
        self.damaged_lines: List[int] = []  # index lines events() had to skip
        self.path = Path(path)
        self.meta = meta
        self._multi = ranks is not None
        self.ranks: Dict[int, Dump] = ranks if ranks is not None else {self.rank: self}
        self._records: Optional[Dict[str, TensorRecord]] = None
        self._handles: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
        self._h5: Any = None

    @property
    def complete(self) -> bool:
        """True when the capture ran to its end and closed the dump."""
        if self._multi:
            return all(d.complete for d in self.ranks.values())
        return bool(self.meta.get("complete", False))

    @property
    def rank(self) -> int:
        """The rank of a single-rank dump (``meta["rank"]``, default 0)."""
        return int(self.meta.get("rank") or 0)

    @property
    def format(self) -> str:
        """``"safetensors"`` or ``"h5"``."""
        if self._multi:
            return next(iter(self.ranks.values())).format
        return str(self.meta.get("format", "safetensors"))

    def __repr__(self) -> str:
        state = "complete" if self.complete else "partial"
        return f"Dump({str(self.path)!r}, {state}, ranks={sorted(self.ranks)})"

    # -- events and records ----------------------------------------------------------------

    def events(self, *, kind: Optional[str] = None, direction: Optional[str] = None,
               step: Optional[int] = None) -> Iterator[Event]:
        """Yield events in execution (seq) order, rank after rank, optionally filtered.

        Args:
            kind: ``"module"`` or ``"op"``.
            direction: ``"forward"`` or ``"backward"``.
            step: a training step.

        Raises:
            DumpError: the index is missing or a line is corrupted.

        Example:
            >>> for ev in load("runs/mlu").events(kind="op"):  # doctest: +SKIP
            ...     print(ev.seq, ev.scope, ev.name)
        """
        if self._multi:
            # keys carry their rank ("rank1/blocks.0/Linear#0:forward:output.0") so that
            # dump.tensor(t.key) works on the aggregate as on a single-rank dump
            for rank, d in self.ranks.items():
                for ev in d.events(kind=kind, direction=direction, step=step):
                    tensors = [dataclasses.replace(t, key=f"rank{rank}/{t.key}") for t in ev.tensors]
                    yield dataclasses.replace(ev, tensors=tensors)
            return
        # A damaged line loses that one event, not the dump: it is skipped with a warning (once
        # per line per process) and `precisiondiff verify` reports it as damage.
        for number, obj, error in iter_index(self.path, strict=False):
            try:
                if obj is None:
                    raise ValueError(error)
                ev = Event.from_json(obj)
            except ValueError as err:
                if number not in self.damaged_lines:
                    self.damaged_lines.append(number)
                if (str(self.path), number) not in _WARNED:
                    _WARNED.add((str(self.path), number))
                    log.warning("%s line %d is damaged (%s): that event is skipped; run "
                                "`precisiondiff verify %s`", self.path / INDEX, number, err, self.path)
                continue
            if ((kind is None or ev.kind == kind) and (direction is None or ev.direction == direction)
                    and (step is None or ev.step == step)):
                yield ev

    def records(self) -> Iterator[TensorRecord]:
        """Yield every tensor record, in event order."""
        for ev in self.events():
            yield from ev.tensors

    def _record_map(self) -> Dict[str, TensorRecord]:
        if self._records is None:
            records: Dict[str, TensorRecord] = {}
            for rec in self.records():
                records.setdefault(rec.key, rec)
            self._records = records
        return self._records

    def keys(self) -> List[str]:
        """All tensor keys (a multi-rank dump prefixes them ``rank{N}/``)."""
        if self._multi:
            return [f"rank{r}/{k}" for r, d in self.ranks.items() for k in d.keys()]
        return list(self._record_map())

    def _split_rank(self, key: str, rank: Optional[int]) -> Tuple["Dump", str]:
        if not self._multi:
            return self, key
        if rank is None:
            head, sep, rest = key.partition("/")
            m = _RANK_DIR.match(head)
            if sep and m:
                rank, key = int(m.group(1)), rest
        if rank is None:
            raise DumpError(f"{self.path} holds ranks {sorted(self.ranks)}: name one, as "
                            f"rank=N or a key 'rank{{N}}/{key}'")
        if rank not in self.ranks:
            raise DumpError(f"{self.path} has no rank {rank}; it holds ranks {sorted(self.ranks)}")
        return self.ranks[rank], key

    def record(self, key: str, *, rank: Optional[int] = None) -> TensorRecord:
        """Return the record of tensor ``key``.

        Raises:
            DumpError: no tensor has this key.
        """
        dump, key = self._split_rank(key, rank)
        try:
            return dump._record_map()[key]
        except KeyError:
            raise DumpError(f"no tensor {key!r} in {dump.path}; list the keys with "
                            f"`precisiondiff ls {dump.path}`") from None

    # -- tensor data ------------------------------------------------------------------------

    def tensor(self, key: str, *, rank: Optional[int] = None) -> torch.Tensor:
        """Read tensor ``key`` from disk (only its bytes; aliases resolved).

        Args:
            key: a tensor key; in a multi-rank dump prefixed ``rank{N}/`` unless ``rank``.
            rank: the rank to read from, for a multi-rank dump.

        Returns:
            A CPU tensor with the recorded dtype and shape.

        Raises:
            DumpError: unknown key, a record without data (stats mode), or missing/damaged
                data.

        Example:
            >>> load("runs/mlu").tensor("blocks.0/Linear#0:forward:output.0")  # doctest: +SKIP
        """
        dump, key = self._split_rank(key, rank)
        rec = dump.record(key)
        if rec.data_key is None:
            raise DumpError(f"tensor {key} was captured in stats mode: capture with "
                            "--mode tensors to read its values")
        if rec.shard is None:
            raise DumpError(f"tensor {key} in {dump.path} names no data file: the dump is "
                            f"damaged; run `precisiondiff verify {dump.path}`")
        t = dump._read(rec.shard, rec.data_key)
        if dtype_name(t.dtype) != rec.dtype or tuple(t.shape) != tuple(rec.shape):
            raise DumpError(f"tensor {key} in {dump.path / rec.shard} is "
                            f"{dtype_name(t.dtype)}{list(t.shape)}, the index says "
                            f"{rec.dtype}{list(rec.shape)}: the dump is damaged; run "
                            f"`precisiondiff verify {dump.path}`")
        return t

    def _read(self, shard: str, data_key: str) -> torch.Tensor:
        file = self.path / shard
        try:
            if shard == H5_FILE:
                return self._read_h5(data_key)
            handle = self._handle(shard)
            return handle.get_tensor(data_key)
        except DumpError:
            raise
        except FileNotFoundError as err:
            raise DumpError(f"{file} is missing: the dump is damaged; run "
                            f"`precisiondiff verify {self.path}`") from err
        except Exception as err:  # safetensors/h5py raise their own error types
            raise DumpError(f"cannot read {data_key!r} from {file} ({err}): the dump is "
                            f"damaged; run `precisiondiff verify {self.path}`") from err

    def _handle(self, shard: str) -> Any:
        handle = self._handles.get(shard)
        if handle is not None:
            self._handles.move_to_end(shard)
            return handle
        file = self.path / shard
        if not file.is_file():
            raise FileNotFoundError(str(file))
        handle = ShardFile(file)  # plain reads: no mapping kept in the resident set (shard_file.py)
        self._handles[shard] = handle
        while len(self._handles) > _MAX_OPEN:
            self._handles.popitem(last=False)[1].close()
        return handle

    def _read_h5(self, data_key: str) -> torch.Tensor:
        from .h5 import from_numpy
        from .writer import h5_dataset_name

        if self._h5 is None:
            import h5py

            file = self.path / H5_FILE
            if not file.is_file():
                raise FileNotFoundError(str(file))
            self._h5 = h5py.File(file, "r")
        ds = self._h5[h5_dataset_name(data_key)]
        return from_numpy(ds[()], str(ds.attrs["dtype"]))

    def to_pandas(self, *, kind: Optional[str] = None, direction: Optional[str] = None,
                  step: Optional[int] = None) -> Any:
        """Events and statistics as a ``pandas.DataFrame``, one row per tensor (optional extra
        ``pandas``; see :func:`precisiondiff.report.frames.dump_frame`)."""
        from ..report.frames import dump_frame  # the one call-time import of report/
        return dump_frame(self, kind=kind, direction=direction, step=step)

    def close(self) -> None:
        """Release open shard handles (they are reopened on demand)."""
        for d in self.ranks.values():
            if d is not self:
                d.close()
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None

    def __enter__(self) -> "Dump":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(path: Union[str, Path]) -> Dump:
    """Open the dump in directory ``path`` (lazily: nothing but meta.json is read).

    A directory without ``meta.json`` whose ``rank{N}/`` subdirectories hold dumps loads as
    one multi-rank :class:`Dump`.

    Args:
        path: the dump directory.

    Returns:
        The :class:`Dump`.

    Raises:
        DumpError: the path is missing, not a dump, or its meta.json is damaged.

    Example:
        >>> dump = load("runs/mlu")  # doctest: +SKIP
        >>> dump.complete, dump.meta["target"]  # doctest: +SKIP
    """
    path = Path(path)
    if not path.exists():
        raise DumpError(f"no dump at {path}: the directory does not exist; check the path "
                        "or capture a dump first")
    if not path.is_dir():
        raise DumpError(f"{path} is a file, not a dump directory; point at the directory "
                        "given to `precisiondiff capture -o`")
    if not (path / META).exists():
        rank_dirs = sorted((int(m.group(1)), p) for p in path.iterdir()
                           for m in [_RANK_DIR.match(p.name)] if m and p.is_dir())
        if rank_dirs:
            ranks = {r: Dump(p, read_meta(p)) for r, p in rank_dirs}
            first = next(iter(ranks.values())).meta
            # rank 0's provenance (target, level, mode, versions...), with the aggregate's fields
            meta = {k: v for k, v in first.items() if k not in ("rank", "pid", "events", "tensors", "bytes")}
            meta.update({"world_size": int(first.get("world_size") or len(ranks)),
                         "ranks": sorted(ranks), "complete": all(d.complete for d in ranks.values())})
            return Dump(path, meta, ranks=ranks)
    return Dump(path, read_meta(path))
