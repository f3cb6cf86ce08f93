"""The watch log: one JSON line per record, appended and flushed per step (docs/watch.md).

A log is a directory holding ``watch.jsonl`` (``rank{N}/watch.jsonl`` per rank of a multi-rank
job). Its lines, in order:

- one ``header``: ``{"format": "precisiondiff-watch", "version": 1, "fields": [...], "model":
  {"signature", "modules", "params"[, "shards"]}, "rank", "world_size", "meta": {...}}`` (``shards``:
  the DTensor parameters' placements and mesh, :mod:`.shards`);
- one ``step`` record per watched step: ``{"step": N, "loss": x, "tensors": {KEY: [...]},
  "params": {NAME: {"weight": ..., "grad": ..., ...}}}``, where ``KEY`` is ``scope:output`` or
  ``scope:grad_output`` and each list follows ``fields``; the first record holds ``dtypes`` (each
  tensor key's dtype), and a record in which a parameter quantity first appears holds
  ``param_dtypes`` (``{NAME: {"grad": "bfloat16", "state.exp_avg": "float32", ...}}``: the dtype
  of the tensor each norm was taken of, by which compare judges it);
- ``{"note": "..."}`` lines (watch's own errors);
- an ``{"end": {"steps": N}}`` line when the run closed the watch; without it the log is partial.

Every line is written whole and flushed at once, so a killed run leaves every finished step
readable; a torn last line (no newline) is ignored and counted. Floats NaN/Infinity are written
as ``NaN``/``Infinity`` (what Python's json reads), as in the dump's index.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import PrecisionDiffError

__all__ = ["FORMAT", "VERSION", "LOG_FILE", "FIELDS", "LogWriter", "WatchLog", "is_watch_log", "read_log",
           "read_logs"]

FORMAT = "precisiondiff-watch"
VERSION = 1
LOG_FILE = "watch.jsonl"
# one tensor's statistics in a step record, in this order (capture/stats.py's fields, and the
# element count, by which the statistics of a tensor's shards on several ranks combine)
FIELDS = ("min", "max", "mean", "abs_mean", "norm", "nan", "inf", "fingerprint", "numel")


class LogWriter:
    """Appends records to ``directory/watch.jsonl``, one flushed line each.

    Args:
        directory: the log directory (created).
        header: the header record (written first).
        overwrite: replace an existing log; otherwise an existing log is refused.
    """

    def __init__(self, directory: "str | os.PathLike", header: Dict[str, Any], *, overwrite: bool = False) -> None:
        self.path = os.path.join(os.fspath(directory), LOG_FILE)
        if os.path.exists(self.path) and not overwrite:
            raise PrecisionDiffError(f"{self.path} exists: choose another directory or pass --overwrite")
        try:
            os.makedirs(os.fspath(directory), exist_ok=True)
            self._fh = open(self.path, "w", encoding="utf-8")
        except OSError as err:
            raise PrecisionDiffError(f"cannot write the watch log {self.path}: {err.strerror or err}") from err
        self.write({"format": FORMAT, "version": VERSION, "fields": list(FIELDS), **header})

    def write(self, record: Dict[str, Any]) -> None:
        """One record as one line, flushed to the operating system (a killed process keeps it)."""
        self._fh.write(json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n")
        self._fh.flush()

    def close(self, *, steps: int) -> None:
        """Mark the log complete and close it."""
        if self._fh.closed:
            return
        self.write({"end": {"steps": steps}})
        self._fh.close()

    def abandon(self) -> None:
        """Close without the end line (the log reads as partial)."""
        if not self._fh.closed:
            self._fh.close()


@dataclass
class WatchLog:
    """A watch log as read: its header, its step records in order, notes, and whether it is whole."""

    path: str
    header: Dict[str, Any]
    steps: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    complete: bool = False
    torn_lines: int = 0

    @property
    def signature(self) -> str:
        return self.header.get("model", {}).get("signature", "")

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", 0))

    def by_step(self) -> Dict[int, Dict[str, Any]]:
        return {int(r["step"]): r for r in self.steps}

    def held_dtypes(self) -> "tuple[Dict[str, str], Dict[str, Dict[str, str]]]":
        """The dtypes the logged quantities are held in: ``({tensor key: dtype}, {parameter:
        {quantity: dtype}})``, merged over the step records that declare them (``dtypes``,
        ``param_dtypes``); a log written before ``param_dtypes`` existed has none for parameters."""
        tensors: Dict[str, str] = {}
        params: Dict[str, Dict[str, str]] = {}
        for r in self.steps:
            if r.get("dtypes"):
                for k, v in r["dtypes"].items():
                    tensors.setdefault(k, v)
            for name, kinds in (r.get("param_dtypes") or {}).items():
                into = params.setdefault(name, {})
                for what, v in kinds.items():
                    into.setdefault(what, v)
        return tensors, params


def _log_files(path: str) -> Dict[int, str]:
    """rank -> log file below ``path`` (a log directory, a job directory of ``rank{N}/``, or the file)."""
    if os.path.isfile(path) and os.path.basename(path) == LOG_FILE:
        return {0: path}
    direct = os.path.join(path, LOG_FILE)
    if os.path.isfile(direct):
        return {0: direct}
    found = {}
    if os.path.isdir(path):
        for name in os.listdir(path):
            m = re.fullmatch(r"rank(\d+)", name)
            if m and os.path.isfile(os.path.join(path, name, LOG_FILE)):
                found[int(m.group(1))] = os.path.join(path, name, LOG_FILE)
    return found


def is_watch_log(path: "str | os.PathLike") -> bool:
    """Whether ``path`` holds a watch log (a directory with ``watch.jsonl``, or ``rank{N}/`` ones)."""
    return bool(_log_files(os.fspath(path)))


def read_log(file: str) -> WatchLog:
    """Read one ``watch.jsonl``; a torn or damaged line is skipped and counted, never fatal.

    Raises:
        PrecisionDiffError: the file is not a watch log (no header line).
    """
    try:
        with open(file, "rb") as fh:
            data = fh.read()
    except OSError as err:
        raise PrecisionDiffError(f"cannot read {file}: {err.strerror or err}") from err
    lines = data.split(b"\n")
    torn = 0
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:  # the last line has no newline: a write cut short by a kill
        lines.pop()
        torn += 1
    log: Optional[WatchLog] = None
    for raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            torn += 1
            continue
        if log is None:
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise PrecisionDiffError(f"{file} is not a precisiondiff watch log (no watch header)")
            if int(record.get("version", 0)) > VERSION:
                raise PrecisionDiffError(f"{file} is watch log version {record.get('version')}; this "
                                         f"precisiondiff reads up to {VERSION}: upgrade precisiondiff")
            log = WatchLog(path=file, header=record)
        elif "step" in record:
            log.steps.append(record)
        elif "note" in record:
            log.notes.append(str(record["note"]))
        elif "end" in record:
            log.complete = True
    if log is None:
        raise PrecisionDiffError(f"{file} is empty: the watched run stopped before writing its header")
    log.torn_lines = torn
    return log


def read_logs(path: "str | os.PathLike") -> Dict[int, WatchLog]:
    """Every rank's log below ``path``: ``{rank: WatchLog}``.

    Raises:
        PrecisionDiffError: no watch log there.
    """
    files = _log_files(os.fspath(path))
    if not files:
        raise PrecisionDiffError(f"{os.fspath(path)} holds no watch log ({LOG_FILE}): "
                                 "give the -o directory of 'precisiondiff watch'")
    return {rank: read_log(f) for rank, f in sorted(files.items())}
