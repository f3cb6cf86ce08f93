"""Checking a dump's integrity: :func:`verify` and :class:`VerifyReport`.

Damage (``problems``, which make ``ok`` False): an unreadable meta.json or index line, a
record whose data file is missing, unopenable or truncated, whose data is absent or has
another dtype/shape than the index says, whose content fingerprint does not match, a key
recorded twice. Not damage (``notes``): a partial dump (the capture did not finish), shards
or temporary files that no index line refers to (left by a crash), a truncated last index
line of a partial dump.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from ..errors import DumpError
from .fingerprint import fingerprint
from .reader import _RANK_DIR, read_meta
from .schema import H5_FILE, INDEX, META, Event, is_shard_name

__all__ = ["verify", "VerifyReport"]


@dataclasses.dataclass
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
        path: the dump checked.
        ok: True when no damage was found (a partial dump can be ok).
        partial: the capture did not finish (``complete`` is false in meta.json).
        problems: one line per damage: file, event seq, key, what is wrong.
        notes: observations that are not damage (partial, orphan shards...).
        summary: counts: events, tensors, with_data, files, checked, fingerprints.
    """

    path: str
    problems: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)
    partial: bool = False
    summary: Dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def __str__(self) -> str:
        state = "ok" if self.ok else f"DAMAGED ({len(self.problems)} problems)"
        if self.partial:
            state += ", partial"
        counts = ", ".join(f"{k}={v}" for k, v in self.summary.items())
        lines = [f"{self.path}: {state} ({counts})"]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def verify(path: Union[str, Path], *, fingerprints: bool = True) -> VerifyReport:
    """Check every file and record of the dump at ``path``; never raises on damage.

    Args:
        path: a dump directory (or the parent of ``rank{N}/`` dumps).
        fingerprints: recompute content fingerprints (reads every tensor).

    Returns:
        The :class:`VerifyReport`.

    Example:
        >>> report = verify("runs/mlu")  # doctest: +SKIP
        >>> report.ok, report.problems  # doctest: +SKIP
    """
    path = Path(path)
    report = VerifyReport(str(path))
    if path.is_dir() and not (path / META).exists():
        rank_dirs = sorted((int(m.group(1)), p) for p in path.iterdir()
                           for m in [_RANK_DIR.match(p.name)] if m and p.is_dir())
        if rank_dirs:
            for _, sub in rank_dirs:
                part = verify(sub, fingerprints=fingerprints)
                report.problems += [f"{sub.name}: {p}" for p in part.problems]
                report.notes += [f"{sub.name}: {n}" for n in part.notes]
                report.partial = report.partial or part.partial
                for k, v in part.summary.items():
                    report.summary[k] = report.summary.get(k, 0) + v
            return report
    _Checker(path, report, fingerprints).run()
    return report


class _Checker:
    def __init__(self, path: Path, report: VerifyReport, fingerprints: bool) -> None:
        self.path = path
        self.report = report
        self.fingerprints = fingerprints
        self.counts = dict(events=0, tensors=0, with_data=0, files=0, checked=0, fingerprints=0)
        self.files: Dict[str, Optional[Any]] = {}  # file name -> open handle, None if broken
        self.shard_keys: Dict[str, Set[str]] = {}
        # data_key -> (problem text or None, fingerprint of the stored data or None)
        self.checked: Dict[str, Tuple[Optional[str], Optional[str]]] = {}

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def run(self) -> None:
        try:
            meta = read_meta(self.path)
        except DumpError as err:
            self.problem(str(err))
            return
        self.report.partial = not meta.get("complete", False)
        if self.report.partial:
            self.report.notes.append("partial dump: the capture did not finish "
                                     "(complete=false); what is indexed is readable")
        try:
            self.check_index()
        finally:
            referenced = set(self.files)
            self.close()
        self.check_orphans(referenced)
        self.report.summary = self.counts

    def check_index(self) -> None:
        index = self.path / INDEX
        try:
            raw_lines = open(index, "rb")
        except OSError as err:
            self.problem(f"{INDEX}: cannot be read ({err.strerror or err})")
            return
        seen: Dict[str, int] = {}
        last_seq: Optional[int] = None
        with raw_lines:
            lines = list(raw_lines)
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                ev = Event.from_json(raw)
            except ValueError as err:
                if number == len(lines) and not raw.endswith(b"\n") and self.report.partial:
                    self.report.notes.append(f"{INDEX} line {number}: truncated last line of an "
                                             "interrupted capture (ignored when loading)")
                else:
                    self.problem(f"{INDEX} line {number}: not a valid event ({err})")
                continue
            self.counts["events"] += 1
            if last_seq is not None and ev.seq <= last_seq:
                self.problem(f"{INDEX} line {number}: event seq {ev.seq} is not after "
                             f"seq {last_seq}")
            last_seq = ev.seq
            for rec in ev.tensors:
                self.counts["tensors"] += 1
                where = f"{INDEX} line {number} (event seq {ev.seq}), key {rec.key!r}"
                if rec.key in seen:
                    self.problem(f"{where}: duplicate key, first recorded at line {seen[rec.key]}")
                else:
                    seen[rec.key] = number
                if rec.has_data:
                    self.counts["with_data"] += 1
                    self.check_record(rec, where)

    def check_record(self, rec: Any, where: str) -> None:
        if not rec.shard:
            self.problem(f"{where}: has data_key {rec.data_key!r} but names no shard")
            return
        handle = self.open(rec.shard, where)
        if handle is None:
            return
        if rec.data_key not in self.checked:
            self.checked[rec.data_key] = self.check_data(rec, handle)
        failure, got = self.checked[rec.data_key]
        if failure is not None:
            self.problem(f"{where}: {failure}")
            return
        # the stored data is sound; compare it with this record's view of it
        dtype, shape = self.shape_dtype(rec, handle)
        if dtype != rec.dtype or tuple(shape) != tuple(rec.shape):
            self.problem(f"{where}: {rec.shard} holds {rec.data_key!r} as {dtype}{list(shape)}, "
                         f"the index says {rec.dtype}{list(rec.shape)}")
            return
        fp = rec.stats.get("fingerprint")
        if fp and got is not None:
            self.counts["fingerprints"] += 1
            if got != fp:
                self.problem(f"{where}: content fingerprint {got} differs from the recorded "
                             f"{fp} (the data in {rec.shard} changed or is corrupted)")

    def open(self, shard: str, where: str) -> Optional[Any]:
        if shard in self.files:
            handle = self.files[shard]
            if handle is None:
                self.problem(f"{where}: its file {shard} is missing or unreadable (see above)")
            return handle
        file = self.path / shard
        handle = None
        if not file.is_file():
            self.problem(f"{shard}: missing, referenced by {where}")
        else:
            try:
                if shard == H5_FILE:
                    import h5py

                    handle = h5py.File(file, "r")
                else:
                    from safetensors import safe_open

                    handle = safe_open(str(file), framework="pt")
                    _check_safetensors_size(file)
                self.counts["files"] += 1
            except Exception as err:  # noqa: BLE001 - safetensors/h5py error types vary
                self.problem(f"{shard}: cannot be opened ({err}), referenced by {where}")
                handle = None
        self.files[shard] = handle
        return handle

    def shape_dtype(self, rec: Any, handle: Any) -> Tuple[str, Tuple[int, ...]]:
        if rec.shard == H5_FILE:
            from .writer import h5_dataset_name

            ds = handle[h5_dataset_name(rec.data_key)]
            return str(ds.attrs["dtype"]), tuple(ds.shape)
        sl = handle.get_slice(rec.data_key)
        return _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape())

    def check_data(self, rec: Any, handle: Any) -> Tuple[Optional[str], Optional[str]]:
        """Read the stored data of ``rec.data_key``: (problem text or None, fingerprint)."""
        try:
            if rec.shard == H5_FILE:
                from .writer import h5_dataset_name

                if h5_dataset_name(rec.data_key) not in handle:
                    return f"{rec.shard} has no data {rec.data_key!r}", None
            elif rec.data_key not in self.keys_of(rec.shard, handle):
                return f"{rec.shard} has no data {rec.data_key!r}", None
            t = self.read(rec, handle)  # reads the bytes: catches truncation
        except Exception as err:  # noqa: BLE001 - safetensors/h5py error types vary
            return f"{rec.shard}: data of {rec.data_key!r} unreadable ({err})", None
        self.counts["checked"] += 1
        return None, (fingerprint(t) if self.fingerprints else None)

    def keys_of(self, shard: str, handle: Any) -> Set[str]:
        keys = self.shard_keys.get(shard)
        if keys is None:
            keys = self.shard_keys[shard] = set(handle.keys())
        return keys

    def read(self, rec: Any, handle: Any) -> Any:
        if rec.shard == H5_FILE:
            from .h5 import from_numpy
            from .writer import h5_dataset_name

            ds = handle[h5_dataset_name(rec.data_key)]
            return from_numpy(ds[()], str(ds.attrs["dtype"]))
        return handle.get_tensor(rec.data_key)

    def close(self) -> None:
        for handle in self.files.values():
            if handle is not None and hasattr(handle, "close"):
                handle.close()
        self.files.clear()

    def check_orphans(self, referenced: Set[str]) -> None:
        for p in sorted(self.path.iterdir()):
            if is_shard_name(p.name) and p.name not in referenced:
                self.report.notes.append(f"{p.name}: not referenced by any index line (written "
                                         "by a capture that stopped before indexing it)")
            elif p.name.endswith(".tmp"):
                self.report.notes.append(f"{p.name}: temporary file of an interrupted write")


# safetensors dtype codes -> dump dtype names
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
              "C64": "complex64"}


def _check_safetensors_size(file: Path) -> None:
    """Raise ValueError when the file is shorter or longer than its header says."""
    import json
    import struct

    with open(file, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    size = file.stat().st_size
    if size != 8 + n + end:
        raise ValueError(f"size {size} bytes, the header describes {8 + n + end}: truncated "
                         "or padded")

